"""robustd-k8s's shadow mode, stale news and reload, through the official client against the API-server stand-in.

The decisions are driven two ways: the reconciler with a simulated clock (the same fault sequence in act
and in shadow), and the whole agent following a robustd stand-in over real gRPC on a real Unix socket
(FakeRobustd below: it serves GetVerdict and Watch from events the test writes, so a fault can be an hour
old). What is asserted is what kubectl and the operator see: the Node (its resourceVersion), its Events,
the agent's log, `robustd-k8s --status`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import yaml
from conftest import REPO, eventually, free_port, terminate
from fakes.kube_apiserver import KubeAPIServer

from robustd.adapters.common.model import CLEARED, RAISED, Cond, Table
from robustd.adapters.common.watch import load_settings
from robustd.adapters.k8s.agent import Agent
from robustd.adapters.k8s.config import SCHEMA, K8sConfig
from robustd.adapters.k8s.families import event_for
from robustd.adapters.k8s.kube import Kube, api_client
from robustd.adapters.k8s.reconciler import Reconciler
from robustd.adapters.k8s.state import K8sState, K8sStateFile
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.model import Action, Severity

XID = Cond("gpu/0000:1b:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 5)
LINK = Cond("nic/eth0", "NIC_LINK_DOWN", Severity.WARNING, Action.NONE, 6)
QUARANTINE = {"actions": ["REBOOT"], "release_after": "5m", "max_fraction": 1.0}


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    s = KubeAPIServer().start()
    yield s
    s.stop()


def table(*conds: Cond) -> Table:
    return Table(seq=max([c.seq for c in conds], default=0), conditions={c.key: c for c in conds})


def writes(server: KubeAPIServer, node: str) -> list[Any]:
    """Every write that touched `node` or posted an Event about it."""
    return [r for r in server.requests() if r.method != "GET" and (f"/nodes/{node}" in r.path or node in str(r.body))]


def scenario(server: KubeAPIServer, tmp: Path, node: str, mode: str) -> Reconciler:
    """One fault sequence: a warning, a CRITICAL REBOOT fault (cordon), both cleared, the hold-down, release."""
    clock = Clock()
    kube = Kube(api_client(str(server.kubeconfig(tmp / f"{node}.kc"))), 2.0)
    r = Reconciler(K8sConfig(mode=mode, quarantine=QUARANTINE), kube, node, K8sStateFile(str(tmp / f"{node}.json")),
                   K8sState(node=node), clock=clock, rng=random.Random(7))
    steps: list[tuple[tuple[Cond, ...], list[tuple[int, Cond, int]]]] = [
        ((), []), ((LINK,), [(RAISED, LINK, 6)]), ((LINK, XID), [(RAISED, XID, 7)]), ((XID,), [(CLEARED, LINK, 8)]),
        ((), [(CLEARED, XID, 9)]), ((), []), ((), [])]
    for conds, events in steps:
        for kind, c, seq in events:
            r.queue(event_for(kind, c, seq))  # type: ignore[arg-type]
        r.step(table(*conds))
        clock.t += 200  # the last two steps: OK for 400 s, past release_after
    return r


def said(r: Reconciler) -> list[tuple[str, str]]:
    return [(d.kind, d.text.replace(r.node, "NODE")) for d in r.state.recent]


@pytest.mark.parametrize("operator_cordon", [False, True], ids=["free", "cordoned-by-an-operator"])
def test_shadow_decides_as_act_and_writes_nothing(server: KubeAPIServer, tmp_path: Path,
                                                  operator_cordon: bool) -> None:
    server.add_node("gpu-act", unschedulable=operator_cordon)
    act = scenario(server, tmp_path, "gpu-act", "act")
    cordons = [r.status for r in server.requests("PATCH", "/nodes/gpu-act") if not r.path.endswith("/status")]
    assert cordons == [200, 200]  # cordoned, released: the operator's cordon stays
    assert bool(server.node("gpu-act")["spec"].get("unschedulable")) is operator_cordon
    server.add_node("gpu-shadow", unschedulable=operator_cordon)
    before = server.node("gpu-shadow")
    shadow = scenario(server, tmp_path, "gpu-shadow", "shadow")

    assert said(shadow) == said(act)  # the same decisions, in the same words
    kinds = [k for k, _ in said(act)]
    # four Events for the faults, and RobustdCordoned
    assert kinds.count("cordon") == 1 and kinds.count("uncordon") == 1 and kinds.count("event") == 5, kinds
    kept = (" (it was cordoned already: that cordon stays)", " (only the taint: someone else cordoned it first)")
    assert ("cordon", "cordon NODE: XID_79 on gpu/0000:1b:00.0 (CRITICAL, action REBOOT), taint "
            "robustd.io/unhealthy=REBOOT:NoSchedule" + (kept[0] if operator_cordon else "")) in said(act)
    assert said(act)[-1] == ("uncordon", "uncordon NODE: robustd's verdict has been OK for 300s" +
                             (kept[1] if operator_cordon else ""))
    assert ("condition", "set condition RobustdGPUProblem=True on NODE (Xid79) XID_79 on gpu/0000:1b:00.0 "
            "(CRITICAL, action REBOOT)") in said(act)
    assert shadow.state.decisions == {"shadow": act.state.decisions["act"]}
    saved = K8sStateFile(str(tmp_path / "gpu-shadow.json")).read()  # counted in the state file
    assert saved.decisions == shadow.state.decisions and saved.recent[-1].text.startswith("uncordon gpu-shadow")

    # The Node as kubectl shows it: not written at all; read as act reads it (at start, before the cordon).
    assert server.node("gpu-shadow") == before
    assert writes(server, "gpu-shadow") == [] and writes(server, "gpu-act")
    assert [r.method for r in server.requests(contains="/nodes/gpu-shadow")] == ["GET", "GET", "GET"]
    assert not [e for e in server.events() if e["involvedObject"]["name"] == "gpu-shadow"]


def agent_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustd.adapters.k8s.agent", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL)


def test_status_reads_the_state_file_and_a_bad_mode_names_key_and_line(server: KubeAPIServer,
                                                                      tmp_path: Path) -> None:
    server.add_node("gpu-shadow")
    scenario(server, tmp_path, "gpu-shadow", "shadow")
    server.stop()  # --status needs no API server (nor robustd)
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nlisten: {{unix: {tmp_path}/none.sock}}\nk8s:\n"
                   f"  node_name: gpu-shadow\n  state_file: {tmp_path}/gpu-shadow.json\n  mode: shadow\n")
    r = agent_cli("--status", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"robustd-k8s on Node gpu-shadow: mode shadow (state {tmp_path}/gpu-shadow.json)"
    assert lines[1] == "decisions (shadow): condition 13, event 5, cordon 1, uncordon 1", r.stdout
    assert any(x.endswith("would cordon gpu-shadow: XID_79 on gpu/0000:1b:00.0 (CRITICAL, action REBOOT), taint "
                          "robustd.io/unhealthy=REBOOT:NoSchedule") for x in lines), r.stdout
    assert lines[-1].endswith("would uncordon gpu-shadow: robustd's verdict has been OK for 300s"), r.stdout

    cfg.write_text(cfg.read_text().replace("mode: shadow", "mode: dry-run"))
    r = agent_cli("--check-config", "--config", str(cfg))
    assert r.returncode != 0 and f"{cfg}:6: k8s.mode" in r.stderr, r.stderr


# --- the whole agent, following a robustd stand-in over gRPC -----------------------------------------------


class FakeRobustd(pb_grpc.NodeHealthServicer):
    """GetVerdict and Watch(from_seq) from a log the test writes; events up to `released` are streamed."""

    def __init__(self) -> None:
        self.log: list[pb.Event] = []
        self.released = 1 << 62
        self.cv = threading.Condition()

    def add(self, kind: int, c: Cond, at: float | None = None) -> int:
        with self.cv:
            seq = (self.log[-1].seq if self.log else 10) + 1
            ev = pb.Event(seq=seq, kind=kind, condition=pb.Condition(
                component=c.component, code=c.code, severity=int(c.severity), action=int(c.action), seq=seq))
            stamp = time.time() if at is None else at
            ev.at.FromNanoseconds(int(stamp * 1e9))
            ev.condition.last_seen.FromNanoseconds(int(stamp * 1e9))
            self.log.append(ev)
            self.cv.notify_all()
            return seq

    def release(self, seq: int) -> None:
        with self.cv:
            self.released = seq
            self.cv.notify_all()

    def GetVerdict(self, request: Any, context: Any) -> pb.Verdict:
        with self.cv:
            standing: dict[tuple[str, str], pb.Condition] = {}
            for ev in self.log:
                key = (ev.condition.component, ev.condition.code)
                if ev.kind == pb.EVENT_KIND_CLEARED:
                    standing.pop(key, None)
                else:
                    standing[key] = ev.condition
            return pb.Verdict(node="fake", seq=self.log[-1].seq if self.log else 0, boot_id="b1",
                              conditions=list(standing.values()))

    def Watch(self, request: Any, context: Any) -> Iterator[pb.Event]:
        sent = request.from_seq
        while context.is_active():
            with self.cv:
                ready = [e for e in self.log if sent < e.seq <= self.released]
                if not ready:
                    self.cv.wait(0.05)
                    continue
            for ev in ready:
                sent = ev.seq
                yield ev


@pytest.fixture
def robustd(short_tmp: Path) -> Iterator[tuple[FakeRobustd, str]]:
    sock = str(short_tmp / "robustd.sock")
    fake = FakeRobustd()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_NodeHealthServicer_to_server(fake, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    yield fake, sock
    server.stop(0)


def agent_config(tmp: Path, sock: str, **k8s: Any) -> Path:
    cfg = tmp / "robustd.yaml"
    doc = {"state_dir": str(tmp / "state"), "listen": {"unix": sock},
           "k8s": {"node_name": "gpu-1", "state_file": str(tmp / "k8s.json"), "request_timeout": "2s",
                   "quarantine": {**QUARANTINE, "release_after": "1s"}, **k8s}}
    cfg.write_text(yaml.safe_dump(doc))
    return cfg


def make_agent(server: KubeAPIServer, tmp: Path, sock: str, **k8s: Any) -> Agent:
    cfg = agent_config(tmp, sock, **k8s)
    agent = Agent(load_settings(str(cfg), SCHEMA), Kube(api_client(str(server.kubeconfig(tmp / "kc"))), 2.0))
    agent._resume()
    return agent


def turn_until(agent: Agent, pred: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        agent._turn()


def saved_position(tmp: Path, seq: int) -> None:
    """The state file of an agent that stopped after handling seq `seq` (nothing standing then)."""
    K8sStateFile(str(tmp / "k8s.json")).write(K8sState(node="gpu-1", table=Table(seq=seq, boot_id="b1"),
                                                       events_seq=seq))


def cordons(server: KubeAPIServer) -> list[Any]:
    return [r for r in server.requests("PATCH", "/nodes/gpu-1") if not r.path.endswith("/status")]


def test_a_fault_raised_and_cleared_while_the_agent_was_down_cordons_nothing(
        server: KubeAPIServer, robustd: tuple[FakeRobustd, str], tmp_path: Path) -> None:
    fake, sock = robustd
    server.add_node("gpu-1")
    saved_position(tmp_path, 10)
    raised = fake.add(RAISED, XID, at=time.time() - 30)  # while the agent was down
    cleared = fake.add(CLEARED, XID, at=time.time() - 20)
    fake.release(raised)  # the replay arrives in two parts: the agent turns in between
    agent = make_agent(server, tmp_path, sock)
    turn_until(agent, lambda: agent.table is not None and agent.table.seq == raised, "the raise replayed")
    for _ in range(4):
        agent._turn()
    fake.release(cleared)
    turn_until(agent, lambda: agent.table is not None and agent.table.seq == cleared and not agent.state.pending,
               "the clear replayed and both Events posted")
    agent._turn()
    assert cordons(server) == [] and not server.node("gpu-1")["spec"].get("taints")
    assert sorted(e["type"] for e in server.events() if e["reason"] == "XID_79") == ["Normal", "Warning"]
    assert server.condition("gpu-1", "RobustdGPUProblem")["status"] == "False"  # type: ignore[index]
    assert "cordon" not in [d.kind for d in agent.state.recent]


def test_a_watch_resumed_across_an_hour_old_fault_does_not_cordon(
        server: KubeAPIServer, robustd: tuple[FakeRobustd, str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake, sock = robustd
    server.add_node("gpu-1")
    saved_position(tmp_path, 10)
    fake.add(RAISED, XID, at=time.time() - 3600)  # an hour ago, and it still stands
    agent = make_agent(server, tmp_path, sock)
    turn_until(agent, lambda: (c := server.condition("gpu-1", "RobustdGPUProblem")) is not None and
               c["status"] == "True", "the condition shown")
    agent._turn()
    assert cordons(server) == []
    assert "ignore stale news for gpu-1: XID_79 on gpu/0000:1b:00.0 was read 3600s after it happened" in caplog.text
    assert "older than k8s.max_event_age 600s: no cordon" in caplog.text
    fresh = Cond("gpu/0000:2a:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 0)
    fake.add(RAISED, fresh)  # news of now: acted on
    turn_until(agent, lambda: server.node("gpu-1")["spec"].get("unschedulable") is True, "cordoned for the new one")
    assert [d.text for d in agent.state.recent if d.kind == "cordon"] == [
        "cordon gpu-1: XID_79 on gpu/0000:2a:00.0 (CRITICAL, action REBOOT), taint robustd.io/unhealthy=REBOOT:"
        "NoSchedule"]
    agent._shutdown()


def test_sighup_switches_shadow_to_act_without_acting_on_the_past(
        server: KubeAPIServer, robustd: tuple[FakeRobustd, str], tmp_path: Path) -> None:
    unit = (REPO / "systemd" / "robustd-k8s.service").read_text()
    assert "\nExecReload=/bin/kill -HUP $MAINPID\n" in unit
    fake, sock = robustd
    server.add_node("gpu-1")
    metrics = f"127.0.0.1:{free_port()}"
    cfg = agent_config(tmp_path, sock, mode="shadow", metrics_address=metrics)
    good = cfg.read_text()

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        return {k: float(v) for k, v in (x.rsplit(" ", 1) for x in text.splitlines()
                                         if x.startswith("robustd_k8s_"))}

    out = tmp_path / "agent.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("NOTIFY_SOCKET", None)
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "robustd.adapters.k8s.agent", "--config", str(cfg),
                                 "--kubeconfig", str(server.kubeconfig(tmp_path / "kc"))], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    try:
        def logged(text: str, timeout: float = 10.0) -> None:
            eventually(lambda: text in out.read_text(), timeout, repr(text), detail=out.read_text)

        logged("watching robustd from seq")
        before = server.node("gpu-1")
        fake.add(RAISED, XID)
        logged("would cordon gpu-1: XID_79 on gpu/0000:1b:00.0")

        cfg.write_text(good.replace("mode: shadow", "mode: sideways"))  # a bad reload: the old config stays
        line = next(i for i, x in enumerate(cfg.read_text().splitlines(), 1) if "sideways" in x)
        proc.send_signal(signal.SIGHUP)
        logged(f"{cfg}:{line}: k8s.mode")
        assert "the config in force is kept" in out.read_text()
        fake.add(RAISED, LINK)
        logged("would set condition RobustdNetworkProblem=True on gpu-1")
        assert server.node("gpu-1") == before and not server.events()  # shadow: nothing written
        m = scrape()
        assert m["robustd_k8s_shadow_mode"] == 1.0
        assert m['robustd_k8s_decisions_total{decision="cordon",mode="shadow"}'] == 1.0
        assert m['robustd_k8s_decisions_total{decision="event",mode="shadow"}'] == 3.0  # RobustdCordoned too
        assert m['robustd_k8s_decisions_total{decision="cordon",mode="act"}'] == 0.0

        cfg.write_text(good.replace("mode: shadow", "mode: act"))
        proc.send_signal(signal.SIGHUP)
        logged("k8s.mode is now act")
        eventually(lambda: (c := server.condition("gpu-1", "RobustdGPUProblem")) and c["status"] == "True", 10,
                   "the conditions as they stand, written after the switch")
        fake.add(CLEARED, XID)  # the quarantine decided in shadow ends: nothing to undo, nothing written
        logged("the quarantine decided in shadow mode ends (nothing on the Node to undo)")
        assert cordons(server) == [] and not server.node("gpu-1")["spec"].get("unschedulable")
        assert [(e["type"], e["reason"]) for e in server.events()] == [("Normal", "XID_79")]  # decided after it

        fresh = Cond("gpu/0000:2a:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 0)
        fake.add(RAISED, fresh)  # a decision after the switch: carried out
        eventually(lambda: server.node("gpu-1")["spec"].get("unschedulable") is True, 10, "cordoned",
                   detail=out.read_text)
        m = eventually(lambda: (m := scrape())['robustd_k8s_decisions_total{decision="cordon",mode="act"}'] == 1.0
                       and m, 5, "the cordon counted (the count follows the write)")
        assert m["robustd_k8s_shadow_mode"] == 0.0
        assert m['robustd_k8s_decisions_total{decision="cordon",mode="shadow"}'] == 1.0
    finally:
        assert terminate(proc) == 0, out.read_text()


def test_new_keys_defaults_and_errors_name_key_and_line(tmp_path: Path) -> None:
    from robustd.config import ConfigError, load_config

    path = tmp_path / "robustd.yaml"
    path.write_text("k8s:\n")
    k = load_config(str(path), SCHEMA).section("k8s")
    assert (k.mode, k.max_event_age, k.metrics_address) == ("act", 600.0, None)
    path.write_text("k8s:\n  mode: shadow\n  max_event_age: 1h\n  metrics_address: 127.0.0.1:9465\n")
    k = load_config(str(path), SCHEMA).section("k8s")
    assert (k.mode, k.max_event_age, k.metrics_address) == ("shadow", 3600.0, "127.0.0.1:9465")
    for text, key in {"k8s:\n  mode: act\n  max_event_age: soon\n": ":3: k8s.max_event_age",
                      "k8s:\n  max_event_age: 0s\n": ":2: k8s.max_event_age",
                      "k8s:\n  metrics_address: 9465\n": ":2: k8s.metrics_address",
                      "k8s:\n  mode: ACT\n": ":2: k8s.mode"}.items():
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(str(path), SCHEMA)
        assert key in str(e.value), str(e.value)
