"""robustd-k8s end to end: a real robustd (faults written to the real /dev/kmsg), robustd-k8s as a child
process with the official kubernetes client, and the Kubernetes API-server stand-in (tests/fakes/).

What is asserted is what an operator sees with kubectl: the Node's conditions, taints, cordon and
annotations, the Events on it; and what crossed the wire (content types, bodies). With
ROBUSTD_K8S_E2E=1 (`make k8s-e2e`) the same scenarios run against the cluster in $KUBECONFIG instead,
on its first node; the scenarios that inject API-server failures need the stand-in and are skipped there.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from conftest import REPO, Daemon, eventually, inject_kmsg, need_root, terminate
from fakes.kube_apiserver import SMP, KubeAPIServer

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.root

E2E = os.environ.get("ROBUSTD_K8S_E2E", "") == "1"
TAINT = "robustd.io/unhealthy"


def wait_until(fn: Callable[[], Any], timeout: float, what: str, log: Callable[[], str] = lambda: "") -> Any:
    return eventually(fn, timeout, what, detail=log)


class RealCluster:
    """The cluster in $KUBECONFIG, read with the official client, behind the stand-in's reading interface."""

    def __init__(self) -> None:
        from kubernetes import client, config

        self.kubeconfig_path = Path(os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config")))
        self.api = config.new_client_from_config(config_file=str(self.kubeconfig_path))
        self.core = client.CoreV1Api(self.api)
        self.node_name = self.core.list_node().items[0].metadata.name

    def kubeconfig(self, path: Path, token: str = "") -> Path:
        return self.kubeconfig_path

    def node(self, name: str) -> dict[str, Any]:
        return dict(self.api.sanitize_for_serialization(self.core.read_node(name)))

    def condition(self, node: str, ctype: str) -> dict[str, Any] | None:
        return next((c for c in self.node(node)["status"].get("conditions") or [] if c["type"] == ctype), None)

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_event(namespace or "default",
                                                field_selector=f"involvedObject.name={self.node_name}").items
        return [dict(self.api.sanitize_for_serialization(e)) for e in items]

    def reset(self, name: str) -> None:
        """Take off whatever an earlier run left: robustd's conditions, taint, cordon and annotations."""
        node = self.node(name)
        taints = [t for t in node["spec"].get("taints") or [] if t["key"] != TAINT]
        self.core.patch_node(name, {"spec": {"taints": taints or None, "unschedulable": None},
                                    "metadata": {"annotations": {"robustd.io/cordoned-by": None,
                                                                 "robustd.io/pre-existing-cordon": None}}})
        conds = [{"type": c["type"], "$patch": "delete"} for c in node["status"].get("conditions") or []
                 if c["type"].startswith("Robustd")]
        if conds:
            self.core.patch_node_status(name, {"status": {"conditions": conds}})


class AgentProcess:
    """robustd-k8s as systemd (or the DaemonSet) runs it: its own process, signals, a log."""

    def __init__(self, config: Path, kubeconfig: Path, log: Path):
        self.config, self.kubeconfig, self.log_path = config, kubeconfig, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NOTIFY_SOCKET", None)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "robustd.adapters.k8s.agent", "--config",
                                          str(self.config), "--kubeconfig", str(self.kubeconfig)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                         env=env)

    def stop(self) -> int | None:
        return None if self.proc is None else terminate(self.proc)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""


class Node:
    """One robustd (the real kernel log), robustd-k8s for it, and the Node it writes."""

    def __init__(self, make_daemon: Any, api: Any, k8s: dict[str, Any] | None = None,
                 daemon: dict[str, Any] | None = None):
        self.api = api
        self.name = api.node_name if E2E else f"gpu-{uuid.uuid4().hex[:8]}"
        if E2E:
            api.reset(self.name)
        else:
            api.add_node(self.name, labels={"nvidia.com/gpu.present": "true"})
        cfg = {"node_name": self.name, "request_timeout": "1s", "max_backoff": "1s", **(k8s or {})}
        self.d: Daemon = make_daemon({"k8s": cfg, "checks": {"kernel": {"lookback": "0s"}}, **(daemon or {})})
        self.d.start()
        self.kubeconfig = api.kubeconfig(self.d.root / "kubeconfig")
        self.agent = AgentProcess(self.d.config_path, self.kubeconfig, self.d.root / "agent.log")
        self.state_file = Path(self.d.state_dir) / "k8s.json"

    def condition(self, family: str) -> dict[str, Any] | None:
        return self.api.condition(self.name, "Robustd" + family)

    def events(self, pred: Callable[[dict[str, Any]], bool] = lambda e: True) -> list[dict[str, Any]]:
        return [e for e in self.api.events("default") if e["involvedObject"]["name"] == self.name and pred(e)]

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        return dict(wait_until(lambda: next(iter(self.events(pred)), None), timeout, "an event", self.agent.log))

    def saved_seq(self) -> int:
        return int(json.loads(self.state_file.read_text())["watch"]["seq"])


@pytest.fixture
def api() -> Iterator[Any]:
    if E2E:
        yield RealCluster()
        return
    server = KubeAPIServer().start()
    yield server
    server.stop()


@pytest.fixture
def make_node(make_daemon: Any, api: Any) -> Iterator[Callable[..., Node]]:
    need_root("writing /dev/kmsg")
    made: list[Node] = []

    def factory(k8s: dict[str, Any] | None = None, daemon: dict[str, Any] | None = None) -> Node:
        n = Node(make_daemon, api, k8s, daemon)
        made.append(n)
        return n

    yield factory
    for n in made:
        n.agent.stop()


def xid79() -> tuple[str, str]:
    """A Xid 79 line on a bus no other test uses, and the component robustd names for it."""
    bus = f"{uuid.uuid4().int % 0xd0 + 0x20:02x}"
    return (f"NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1, name=python, GPU has fallen off the bus.",
            f"gpu/0000:{bus}:00.0")


def ack_others(n: Node, comp: str) -> None:
    """Other tests on this machine write Xid lines to the same /dev/kmsg, and this daemon sees them too: they are
    acknowledged as they come (their components differ from ours, so no assertion mixes them up)."""
    with n.d.channel() as ch:
        stub = pb_grpc.NodeHealthStub(ch)
        for c in stub.GetVerdict(pb.GetVerdictRequest(), timeout=5).conditions:
            if c.component != comp:
                with contextlib.suppress(grpc.RpcError):  # cleared meanwhile
                    stub.Acknowledge(pb.AcknowledgeRequest(component=c.component, code=c.code,
                                                           reason="another test's line"), timeout=5)


def ack(n: Node, comp: str) -> None:
    r = n.d.robustctl("ack", comp, "XID_79", "--reason", "reseated")
    assert r.returncode == 0, r.stderr
    ack_others(n, comp)


def wait_raised(n: Node, comp: str, timeout: float = 10.0) -> dict[str, Any]:
    """RobustdGPUProblem True and naming our component."""
    return dict(wait_until(lambda: (c := n.condition("GPUProblem")) and c["status"] == "True" and
                           comp in c["message"] and c, timeout, f"RobustdGPUProblem True for {comp}", n.agent.log))


def wait_cleared(n: Node, comp: str, timeout: float = 20.0) -> dict[str, Any]:
    """RobustdGPUProblem False once our fault is acknowledged (and any other test's line that arrived since)."""
    deadline = time.monotonic() + timeout
    while True:
        c = n.condition("GPUProblem") or {}
        if c.get("status") == "False":
            return c
        if time.monotonic() > deadline:
            raise AssertionError(f"RobustdGPUProblem not False within {timeout}s: {c}\n{n.agent.log()}")
        if comp not in c.get("message", comp):
            ack_others(n, comp)
        time.sleep(0.1)


def about(component: str, kind: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == kind and e["reason"] == "XID_79" and component in e["message"]


def test_xid79_sets_gpu_problem_with_event_and_ack_clears_it(make_node: Any, api: Any) -> None:
    n = make_node()
    ready_before = api.condition(n.name, "Ready")
    n.agent.start()
    wait_until(lambda: n.condition("GPUProblem"), 10, "the first write", n.agent.log)  # connected
    line, comp = xid79()
    sent = time.monotonic()
    inject_kmsg(line)
    c = wait_raised(n, comp, timeout=5)
    print(f"kmsg Xid 79 -> RobustdGPUProblem True on the API server: {(time.monotonic() - sent) * 1000:.0f} ms "
          "(bench/k8s.py measures p50/p99)")
    assert c["reason"].startswith("Xid79"), c
    assert f"XID_79 on {comp} (CRITICAL, action REBOOT)" in c["message"], c
    warning = n.wait_event(about(comp, "Warning"))
    assert warning["reportingComponent"] == "robustd" and warning["source"]["component"] == "robustd"
    assert warning["involvedObject"]["kind"] == "Node" and warning["count"] == 1
    assert warning["message"] == f"XID_79 raised on {comp}: CRITICAL, action REBOOT"
    node = api.node(n.name)
    assert api.condition(n.name, "Ready") == ready_before or E2E  # Kubernetes' own condition is not robustd's
    assert not node["spec"].get("unschedulable") and not any(t["key"] == TAINT for t in node["spec"].get("taints")
                                                             or [])  # quarantine is off by default
    if not E2E:  # on the wire: strategic merge patches of the status subresource, robustd's types only
        patches = api.requests("PATCH", f"/nodes/{n.name}/status")
        assert patches and all(r.content_type == SMP for r in patches)
        for r in patches:
            types = [x["type"] for x in r.body["status"]["conditions"]]
            assert len(types) == 9 and all(t.startswith("Robustd") for t in types), types
        posts = api.requests("POST", "/namespaces/default/events")
        assert posts and all(r.content_type == "application/json" for r in posts)

    time.sleep(1.1)  # condition times have a resolution of one second
    ack(n, comp)
    cleared = wait_cleared(n, comp)
    assert cleared["lastTransitionTime"] > c["lastTransitionTime"]
    assert cleared["reason"] == "NoGPUProblem"
    normal = n.wait_event(about(comp, "Normal"))
    assert normal["message"] == f"XID_79 cleared on {comp}"
    assert n.agent.stop() == 0


def test_restart_posts_no_duplicates_keeps_transition_time_and_resumes_from_its_seq(make_node: Any, api: Any) -> None:
    n = make_node()
    n.agent.start()
    wait_until(lambda: n.condition("GPUProblem"), 10, "the first write", n.agent.log)
    line, comp = xid79()
    inject_kmsg(line)
    raised = wait_raised(n, comp)
    n.wait_event(about(comp, "Warning"))
    assert n.agent.stop() == 0
    seq = n.saved_seq()
    assert seq >= n.d.verdict().seq > 0  # the position it stopped at is on disk

    time.sleep(1.1)  # so that the restarted agent's first write has a later heartbeat time
    n.agent.start()  # nothing changed meanwhile
    wait_until(lambda: n.agent.log().count("watching robustd from seq") == 2, 10, "reconnected", n.agent.log)
    assert f"resuming after seq {seq}" in n.agent.log() and f"watching robustd from seq {seq} " in n.agent.log()
    heartbeat = wait_until(lambda: (c := n.condition("GPUProblem")) and c["lastHeartbeatTime"] >
                           raised["lastHeartbeatTime"] and c, 10, "the restarted agent's first write")
    assert heartbeat["lastTransitionTime"] == raised["lastTransitionTime"]
    assert len(n.events(about(comp, "Warning"))) == 1 and n.events(about(comp, "Warning"))[0]["count"] == 1

    assert n.agent.stop() == 0  # robustd's verdict changes while the agent is away
    time.sleep(1.1)
    ack(n, comp)
    n.agent.start()
    cleared = wait_cleared(n, comp)
    assert cleared["lastTransitionTime"] > raised["lastTransitionTime"]
    n.wait_event(lambda e: e["type"] == "Normal" and comp in e["message"])
    assert n.agent.stop() == 0
    n.agent.start()  # and once more: nothing new to say
    wait_until(lambda: n.agent.log().count("watching robustd from seq") == 4, 10, "reconnected", n.agent.log)
    time.sleep(0.5)
    assert n.agent.stop() == 0
    assert len(n.events(lambda e: comp in e["message"])) == 2  # one Warning, one Normal: no duplicates
    assert all(e["count"] == 1 for e in n.events(lambda e: comp in e["message"]))
    assert n.condition("GPUProblem")["lastTransitionTime"] == cleared["lastTransitionTime"]


def test_quarantine_cordons_taints_and_releases_only_what_it_did(make_node: Any, api: Any) -> None:
    n = make_node({"quarantine": {"actions": ["REBOOT"], "release_after": "1s", "max_fraction": 1.0}})
    n.agent.start()
    wait_until(lambda: n.condition("GPUProblem"), 10, "the first write", n.agent.log)
    line, comp = xid79()
    inject_kmsg(line)

    def quarantined() -> dict[str, Any] | None:
        node = api.node(n.name)
        return node if node["spec"].get("unschedulable") else None

    node = wait_until(quarantined, 10, "cordoned", n.agent.log)
    assert {"key": TAINT, "value": "REBOOT", "effect": "NoSchedule"} in node["spec"]["taints"]
    ann = node["metadata"]["annotations"]
    assert ann["robustd.io/cordoned-by"] == "robustd" and ann["robustd.io/pre-existing-cordon"] == "false"
    # issue 31: `kubectl describe node` leads to the evidence robustd kept for the cordon
    ident = ann["robustd.io/evidence"]
    assert ident.startswith("ev-"), ann
    cordoned = n.wait_event(lambda e: e["reason"] == "RobustdCordoned")
    assert cordoned["type"] == "Warning" and f"evidence {ident}" in cordoned["message"], cordoned
    assert f"XID_79 on {comp}" in cordoned["message"]
    shown = n.d.robustctl("evidence", "show", ident)
    assert shown.returncode == 0, shown.stderr
    bundle = json.loads(shown.stdout)
    assert bundle["id"] == ident and any(c["component"] == comp for c in bundle["verdict"]["conditions"])
    if not E2E:  # a merge patch naming the resourceVersion it read
        writes = api.requests("PATCH", f"/nodes/{n.name}")
        writes = [r for r in writes if not r.path.endswith("/status")]
        assert writes and writes[0].content_type == "application/merge-patch+json"
        assert writes[0].body["metadata"]["resourceVersion"]

    ack(n, comp)
    def released() -> dict[str, Any] | None:
        ack_others(n, comp)
        node = api.node(n.name)
        return None if node["spec"].get("unschedulable") else node

    node = wait_until(released, 10, "uncordoned", n.agent.log)
    assert not any(t["key"] == TAINT for t in node["spec"].get("taints") or [])
    assert "robustd.io/cordoned-by" not in (node["metadata"].get("annotations") or {})
    assert "robustd.io/evidence" not in (node["metadata"].get("annotations") or {})


def test_events_for_a_fault_standing_at_first_start_an_escalation_and_a_span_robustd_pruned(make_node: Any,
                                                                                           api: Any) -> None:
    """XID_79 tolerated once (WARNING, CRITICAL at the second), raised before robustd-k8s first starts; then,
    while robustd-k8s is stopped, two more faults and a clear, and a robustd restart that prunes its log to
    the newest 2 events: robustd-k8s's Watch resumes OUT_OF_RANGE, and the new snapshot's changes are posted."""
    n = make_node(daemon={"policy": {"codes": {"XID_79": {"tolerate": {"count": 2, "window": "1h"}}}},
                          "retention": {"max_events": 2}})
    line, comp = xid79()
    inject_kmsg(line)
    n.d.wait_for(lambda v: any(c.component == comp for c in v.conditions), 5)
    n.agent.start()  # its first start: the fault stands already
    raised = n.wait_event(about(comp, "Warning"))
    assert raised["message"] == f"XID_79 raised on {comp}: WARNING, action REBOOT"
    inject_kmsg(line)  # the second: CRITICAL (an UPDATED event)
    updated = n.wait_event(lambda e: e["message"] == f"XID_79 updated on {comp}: WARNING -> CRITICAL, action REBOOT")
    assert updated["type"] == "Warning" and updated["reason"] == "XID_79"
    wait_until(lambda: n.saved_seq() >= n.d.verdict().seq, 5, "the position saved", n.agent.log)
    assert n.agent.stop() == 0

    (line_b, comp_b), (line_c, comp_c) = xid79(), xid79()
    inject_kmsg(line_b, line_c)
    n.d.wait_for(lambda v: {comp_b, comp_c} <= {c.component for c in v.conditions}, 5)
    r = n.d.robustctl("ack", comp, "XID_79", "--reason", "reseated")  # only ours: B and C stand
    assert r.returncode == 0, r.stderr
    n.d.restart()  # retention prunes at start: the events after robustd-k8s's seq are gone
    n.agent.start()
    skipped = n.wait_event(lambda e: e["reason"] == "EventsSkipped", timeout=15)
    assert skipped["type"] == "Normal" and "past retention" in skipped["message"], skipped
    assert "OUT_OF_RANGE" in n.agent.log() or "no longer has the events" in n.agent.log()
    n.wait_event(lambda e: e["message"] == f"XID_79 cleared on {comp}")
    for c in (comp_b, comp_c):
        n.wait_event(lambda e, c=c: e["message"] == f"XID_79 raised on {c}: WARNING, action REBOOT")
    assert n.agent.stop() == 0
    mine = n.events(lambda e: any(c in e["message"] for c in (comp, comp_b, comp_c)))
    assert len(mine) == 5 and all(e["count"] == 1 for e in mine), mine  # each once


@pytest.mark.standin  # injected failures: `make k8s-e2e` leaves it out (-m "not standin")
def test_api_server_failing_for_a_while_conditions_right_once_it_recovers(make_node: Any, api: Any) -> None:
    n = make_node()
    n.agent.start()
    wait_until(lambda: n.condition("GPUProblem"), 10, "the first write", n.agent.log)
    api.fail("timeout", seconds=2.0, hold=3.0)  # every request held past the agent's 1 s timeout
    api.fail(500, seconds=4.0)  # then answered 500
    api.fail(429, seconds=5.0, retry_after=1)  # then throttled
    line, comp = xid79()
    inject_kmsg(line)
    n.d.wait_for(lambda v: any(c.component == comp for c in v.conditions), 5)  # robustd itself is unaffected
    c = wait_raised(n, comp, timeout=20)
    assert comp in c["message"]
    n.wait_event(about(comp, "Warning"))
    log = n.agent.log()
    assert "500" in log and "429" in log and "Timeout" in log, log
    statuses = {r.status for r in api.requests("PATCH", f"/nodes/{n.name}/status")}
    assert {-1, 500, 429, 200} <= statuses  # it met each failure on the wire, and then got through
    assert len(n.events(about(comp, "Warning"))) == 1


@pytest.mark.standin  # the stand-in's tokens: `make k8s-e2e` leaves it out (-m "not standin")
def test_bad_token_is_an_error_not_a_verdict(make_node: Any, api: Any) -> None:
    api.tokens["weak"] = {("get", "nodes")}  # may read its node, may not write its status
    n = make_node()
    n.agent.kubeconfig = api.kubeconfig(n.d.root / "weak.kubeconfig", token="weak")
    n.agent.start()
    wait_until(lambda: "403" in n.agent.log(), 10, "the refusal logged", n.agent.log)
    assert "cannot patch resource \"nodes\" subresource \"status\"" in n.agent.log()
    assert "not a hardware verdict" in n.agent.log()
    assert n.condition("GPUProblem") is None  # nothing written
    assert n.agent.proc is not None and n.agent.proc.poll() is None  # and it keeps running, retrying


def test_check_config_and_unusable_kubeconfig(make_daemon: Any, short_tmp: Path) -> None:
    d = make_daemon({"k8s": {"node_name": "gpu-1"}})
    run = [sys.executable, "-m", "robustd.adapters.k8s.agent", "--config", str(d.config_path)]
    p = subprocess.run([*run, "--check-config"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0 and "config OK (Node gpu-1" in p.stdout, p.stderr
    (short_tmp / "bad.kubeconfig").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    p = subprocess.run([*run, "--kubeconfig", str(short_tmp / "bad.kubeconfig")], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 1 and "robustd-k8s: cannot use kubeconfig" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
