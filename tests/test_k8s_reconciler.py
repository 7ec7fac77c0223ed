"""robustd-k8s's reconciler with a simulated clock, through the official client, against the API-server stand-in.

The clock is injected (no test waits for real heartbeats or hold-downs); the HTTP, the client and the
API-server semantics are real. What is asserted is the Node and its Events as kubectl would show them,
and the requests on the wire.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from fakes.kube_apiserver import SMP, KubeAPIServer
from kubernetes import client

from robustd.adapters.common.model import CLEARED, RAISED, Cond, Table
from robustd.adapters.common.watch import load_settings
from robustd.adapters.k8s.agent import Agent
from robustd.adapters.k8s.config import SCHEMA, K8sConfig
from robustd.adapters.k8s.families import event_for
from robustd.adapters.k8s.kube import Kube, api_client
from robustd.adapters.k8s.reconciler import CORDONED_BY, TAINT_KEY, Reconciler
from robustd.adapters.k8s.state import K8sState, K8sStateFile
from robustd.api.v1 import robustd_pb2 as pb
from robustd.model import Action, Severity

NODE = "gpu-1"
XID = Cond("gpu/0000:1b:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 5)
LINK = Cond("nic/eth0", "NIC_LINK_DOWN", Severity.WARNING, Action.NONE, 6)


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    s = KubeAPIServer().start()
    s.add_node(NODE, labels={"gpu": "yes"})
    yield s
    s.stop()


def table(*conds: Cond) -> Table:
    return Table(seq=max([c.seq for c in conds], default=0), conditions={c.key: c for c in conds})


def reconciler(server: KubeAPIServer, tmp: Path, clock: Clock, token: str = "admin", **cfg: Any) -> Reconciler:
    kube = Kube(api_client(str(server.kubeconfig(tmp / f"{token}.kubeconfig", token))), 2.0)
    return Reconciler(K8sConfig(**cfg), kube, NODE, K8sStateFile(str(tmp / "k8s.json")), K8sState(), clock=clock,
                      rng=random.Random(7))


def test_a_quiet_hour_writes_once_per_heartbeat(server: KubeAPIServer, tmp_path: Path) -> None:
    clock = Clock()
    r = reconciler(server, tmp_path, clock, heartbeat="5m")
    t = table(LINK)
    for _ in range(3600):  # one simulated hour, a step each second, nothing changing
        r.step(t)
        clock.t += 1
    writes = server.requests("PATCH", f"/nodes/{NODE}/status")
    print(f"writes in a quiet hour at heartbeat 5m: {len(writes)}")
    assert 3600 / (300 * 1.1) <= len(writes) <= 3600 / 300 + 1  # the heartbeat, jittered, and the first write
    stamps = [w.body["status"]["conditions"][0]["lastHeartbeatTime"] for w in writes]
    assert len(set(stamps)) == len(stamps)  # each one a heartbeat
    c = server.condition(NODE, "RobustdNetworkProblem")
    assert c is not None and c["status"] == "True" and c["lastTransitionTime"] == stamps[0]  # not moved by heartbeats
    assert len(server.requests("GET")) == 1  # the node read once, at start


def test_change_is_written_at_once_and_kept_transition_time_survives_restart(server: KubeAPIServer,
                                                                            tmp_path: Path) -> None:
    clock = Clock()
    r = reconciler(server, tmp_path, clock)
    r.step(table())
    first = server.condition(NODE, "RobustdGPUProblem")
    assert first is not None and first["status"] == "False"
    clock.t += 10
    r.step(table(XID))
    raised = server.condition(NODE, "RobustdGPUProblem")
    assert raised is not None and raised["status"] == "True" and raised["reason"] == "Xid79"
    assert raised["lastTransitionTime"] != first["lastTransitionTime"]
    clock.t += 3600
    again = reconciler(server, tmp_path, clock)  # a new agent: reads the node's conditions first
    again.step(table(XID))
    after = server.condition(NODE, "RobustdGPUProblem")
    assert after is not None and after["lastTransitionTime"] == raised["lastTransitionTime"]
    assert after["lastHeartbeatTime"] > raised["lastHeartbeatTime"]
    ready = server.condition(NODE, "Ready")
    assert ready is not None and ready["reason"] == "KubeletReady"  # never robustd's to write


def test_same_event_again_counts_the_existing_event_up(server: KubeAPIServer, tmp_path: Path) -> None:
    clock = Clock()
    r = reconciler(server, tmp_path, clock)
    for seq in (5, 7, 9):
        r.queue(event_for(RAISED, XID, seq))  # type: ignore[arg-type]
        r.step(table(XID))
        clock.t += 60
    r.queue(event_for(CLEARED, XID, 10))  # type: ignore[arg-type]
    r.step(table())
    events = server.events("default")
    assert sorted((e["type"], e.get("count")) for e in events) == [("Normal", 1), ("Warning", 3)]
    patches = server.requests("PATCH", "/events/")
    assert len(patches) == 2 and all(p.content_type == SMP and set(p.body) == {"count", "lastTimestamp"}
                                      for p in patches)
    assert r.state.events_seq == 10 and not r.state.pending


def test_quarantine_is_off_by_default(server: KubeAPIServer, tmp_path: Path) -> None:
    r = reconciler(server, tmp_path, Clock())
    r.step(table(XID))
    node = server.node(NODE)
    assert not node["spec"].get("unschedulable") and not node["spec"].get("taints")
    assert not node["metadata"].get("annotations")
    assert all(q.path.endswith("/status") for q in server.requests("PATCH", "/nodes/"))  # only conditions written
    assert not [q for q in server.requests("GET") if q.verb == "list"]  # no breaker count either
    assert server.condition(NODE, "RobustdGPUProblem")["status"] == "True"  # type: ignore[index]


def test_quarantine_keeps_someone_elses_cordon_after_the_clear(server: KubeAPIServer, tmp_path: Path) -> None:
    server.edit_node(NODE, lambda n: n["spec"].update(unschedulable=True))  # an operator's kubectl cordon
    clock = Clock()
    r = reconciler(server, tmp_path, clock, quarantine={"actions": ["REBOOT"], "release_after": "5m",
                                                        "max_fraction": 1.0})
    r.step(table(XID))
    node = server.node(NODE)
    assert node["spec"]["taints"] == [{"key": TAINT_KEY, "value": "REBOOT", "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"] == {"robustd.io/cordoned-by": "robustd",
                                               "robustd.io/pre-existing-cordon": "true"}
    r.step(table())  # the verdict clears: released only after release_after
    clock.t += 299
    r.step(table())
    assert server.node(NODE)["spec"].get("taints")
    clock.t += 2
    r.step(table())
    node = server.node(NODE)
    assert not node["spec"].get("taints") and node["spec"]["unschedulable"] is True  # the operator's cordon stays
    assert not node["metadata"].get("annotations")


def test_a_concurrent_edit_is_retried_and_neither_write_is_lost(server: KubeAPIServer, tmp_path: Path) -> None:
    other = {"key": "example.com/maintenance", "value": "bios", "effect": "NoSchedule"}

    def operator(node: dict[str, Any]) -> None:
        node["spec"].setdefault("taints", []).append(dict(other))
        node["metadata"]["labels"]["maintenance"] = "yes"

    server.on_next_write(NODE, operator)  # lands between robustd-k8s's GET and its write
    r = reconciler(server, tmp_path, Clock(), quarantine={"actions": ["REBOOT"], "max_fraction": 1.0})
    r.step(table(XID))
    statuses = [q.status for q in server.requests("PATCH", f"/nodes/{NODE}") if not q.path.endswith("/status")]
    assert statuses == [409, 200]
    node = server.node(NODE)
    assert other in node["spec"]["taints"] and node["metadata"]["labels"]["maintenance"] == "yes"
    assert {"key": TAINT_KEY, "value": "REBOOT", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert node["spec"]["unschedulable"] is True


def test_circuit_breaker_suppresses_quarantine_with_one_event(server: KubeAPIServer, tmp_path: Path) -> None:
    for i in range(9):
        server.add_node(f"gpu-{i + 2}", labels={"gpu": "yes"})
    server.add_node("cpu-1", labels={"gpu": "no"})

    def quarantine(n: dict[str, Any]) -> None:  # as robustd-k8s on gpu-2 holds it: cordon, taint, annotations
        n["spec"].update(unschedulable=True, taints=[{"key": TAINT_KEY, "value": "REBOOT", "effect": "NoSchedule"}])
        n["metadata"]["annotations"].update({CORDONED_BY: "robustd", "robustd.io/pre-existing-cordon": "false"})

    def release(n: dict[str, Any]) -> None:
        del n["spec"]["taints"], n["spec"]["unschedulable"]
        n["metadata"]["annotations"].clear()

    server.edit_node("gpu-2", quarantine, manager="robustd-k8s")
    clock = Clock()
    r = reconciler(server, tmp_path, clock, quarantine={"actions": ["REBOOT"], "node_selector": "gpu=yes"})
    r.step(table(XID))
    clock.t += 61
    r.step(table(XID))  # looked at again: still full, no second event
    node = server.node(NODE)
    assert not node["spec"].get("unschedulable") and not node["spec"].get("taints")
    events = [e for e in server.events() if e["reason"] == "QuarantineSuppressed"]
    assert len(events) == 1 and "1 of 10 nodes" in events[0]["message"], events
    lists = [q for q in server.requests("GET", "/api/v1/nodes") if q.verb == "list"]
    assert [q.query.get("labelSelector") for q in lists] == ["gpu=yes", "gpu=yes"]
    # Metadata only, as kubectl asks for it (no spec, status or image list of every node).
    assert all(q.accept.split(",")[0] == "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
               and q.status == 200 for q in lists)
    server.edit_node("gpu-2", release, manager="robustd-k8s")  # that node released: room again
    clock.t += 61
    r.step(table(XID))
    assert server.node(NODE)["spec"].get("unschedulable") is True


def test_unknown_after_three_heartbeats_without_robustd(server: KubeAPIServer, tmp_path: Path) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nlisten: {{unix: {tmp_path}/none.sock}}\n"
                   f"k8s: {{node_name: {NODE}, heartbeat: 1m}}\n")
    clock = Clock()
    kube = Kube(api_client(str(server.kubeconfig(tmp_path / "kc"))), 2.0)
    agent = Agent(load_settings(str(cfg), SCHEMA), kube, clock=clock)
    agent._turn()
    clock.t += 179
    agent._turn()
    assert server.condition(NODE, "RobustdGPUProblem") is None  # not yet: robustd may just be restarting
    clock.t += 2
    agent.next_connect = 0
    agent._turn()
    c = server.condition(NODE, "RobustdGPUProblem")
    assert c is not None and c["status"] == "Unknown" and c["reason"] == "RobustdUnreachable"
    assert f"cannot reach robustd at {tmp_path}/none.sock" in c["message"]


def test_api_server_errors_are_retried_with_backoff(server: KubeAPIServer, tmp_path: Path) -> None:
    clock = Clock()
    r = reconciler(server, tmp_path, clock, max_backoff="8s")
    server.fail(503, count=4)
    waits = []
    for _ in range(4):
        waits.append(r.step(table(XID)))
        clock.t += waits[-1]
    assert all(0.25 <= w <= 8 for w in waits) and waits[3] > waits[0]  # growing, capped, jittered
    r.step(table(XID))
    assert server.condition(NODE, "RobustdGPUProblem")["status"] == "True"  # type: ignore[index]
    server.fail(429, count=1, retry_after=5)
    clock.t += 400  # a heartbeat is due
    assert r.step(table(XID)) >= 5  # the server's Retry-After is honoured


def test_families_reasons_and_messages() -> None:
    from robustd.adapters.k8s.families import desired, family

    assert [family(c, code) for c, code in [
        ("gpu/0000:1b:00.0", "XID_79"), ("nvswitch/0", "NVSWITCH_FATAL"), ("nic/eth0", "NIC_LINK_DOWN"),
        ("ib/mlx5_0/1", "IB_PORT_DOWN"), ("pcie/0000:1a:00.0", "PCIE_AER"), ("memory/0", "EDAC_UE"),
        ("disk/nvme0n1", "DISK_IO_ERROR"), ("host/coretemp/core0", "THERMAL_HIGH"), ("host", "KERNEL_PANIC"),
        ("gpu/0000:1b:00.0", "DIAG_EUD_FAILED"), ("check/gpu", "CHECK_HUNG")]] == [
        "GPUProblem", "GPUProblem", "NetworkProblem", "NetworkProblem", "PCIeProblem", "MemoryProblem",
        "DiskProblem", "ThermalProblem", "KernelProblem", "DiagnosticsFailed", "AgentProblem"]
    ecc = Cond("gpu/0000:2a:00.0", "GPU_ECC_DBE", Severity.CRITICAL, Action.RESET_GPU, 8)
    got = {c.type: c for c in desired([XID, ecc, LINK], K8sConfig())}
    assert list(got) == [f"Robustd{f}" for f in ("GPUProblem", "NetworkProblem", "PCIeProblem", "MemoryProblem",
                                                 "DiskProblem", "ThermalProblem", "KernelProblem",
                                                 "DiagnosticsFailed", "AgentProblem")]
    gpu = got["RobustdGPUProblem"]
    assert (gpu.status, gpu.reason) == ("True", "Xid79And1More")  # the most drastic action first
    assert gpu.message == ("XID_79 on gpu/0000:1b:00.0 (CRITICAL, action REBOOT); "
                           "GPU_ECC_DBE on gpu/0000:2a:00.0 (CRITICAL, action RESET_GPU)")
    assert got["RobustdNetworkProblem"].status == "True"
    strict = {c.type: c for c in desired([LINK], K8sConfig(condition_severity="CRITICAL", condition_prefix="Acme"))}
    assert strict["AcmeNetworkProblem"].status == "False"  # a WARNING does not reach a CRITICAL threshold
    many = [Cond(f"gpu/{i}", "XID_79", Severity.CRITICAL, Action.REBOOT, i) for i in range(1000)]
    assert len(desired(many, K8sConfig())[0].message) <= 1024  # bounded, whatever robustd holds


def test_unknown_node_is_an_error_retried_slowly(server: KubeAPIServer, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    kube = Kube(api_client(str(server.kubeconfig(tmp_path / "kc"))), 2.0)
    r = Reconciler(K8sConfig(max_backoff="30s"), kube, "no-such-node", K8sStateFile(str(tmp_path / "s.json")),
                   K8sState(), clock=Clock(), rng=random.Random(1))
    assert r.step(table(XID)) == 30.0
    assert 'nodes "no-such-node" not found' in caplog.text and "not a hardware verdict" in caplog.text
    assert [q.status for q in server.log] == [404]


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def pb_cond(c: Cond) -> pb.Condition:
    return pb.Condition(component=c.component, code=c.code, severity=int(c.severity), action=int(c.action), seq=c.seq)


def listed_events(server: KubeAPIServer, tmp: Path) -> list[tuple[str, str, str]]:
    """The Events as `kubectl get events` shows them: read with the official client."""
    core = client.CoreV1Api(api_client(str(server.kubeconfig(tmp / "reader.kc"))))
    items = core.list_namespaced_event("default").items
    return sorted((e.type, e.reason, e.message) for e in items if e.involved_object.name == NODE)


def test_events_for_a_fault_standing_at_start_a_severity_change_and_a_pruned_span(server: KubeAPIServer,
                                                                                 tmp_path: Path) -> None:
    """A first start posts the faults already standing; an UPDATED that changes severity (a mere repeat does not)
    is posted; after an OUT_OF_RANGE the new snapshot's differences are posted, with an EventsSkipped saying so."""
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nlisten: {{unix: {tmp_path}/none.sock}}\nk8s: {{node_name: {NODE}}}\n")
    clock = Clock()
    kube = Kube(api_client(str(server.kubeconfig(tmp_path / "kc"))), 2.0)
    agent = Agent(load_settings(str(cfg), SCHEMA), kube, clock=clock)
    warn = Cond(XID.component, "XID_79", Severity.WARNING, Action.REBOOT, 5)
    agent._sync(pb.Verdict(seq=5, conditions=[pb_cond(warn)]))  # the first start: the fault stands already
    agent.reconciler.step(agent.table)
    raised = ("Warning", "XID_79", f"XID_79 raised on {XID.component}: WARNING, action REBOOT")
    assert listed_events(server, tmp_path) == [raised]

    repeat = pb.Event(seq=6, kind=pb.EVENT_KIND_UPDATED, condition=pb_cond(replace(warn, seq=6)))
    worse = pb.Event(seq=7, kind=pb.EVENT_KIND_UPDATED,
                     condition=pb_cond(replace(warn, severity=Severity.CRITICAL, seq=7)))
    for ev in (repeat, worse):
        agent._handle("event", ev, None)
    agent.reconciler.step(agent.table)
    updated = ("Warning", "XID_79", f"XID_79 updated on {XID.component}: WARNING -> CRITICAL, action REBOOT")
    assert listed_events(server, tmp_path) == [raised, updated]

    stream = object()
    agent.stream = stream  # type: ignore[assignment]
    agent._handle("error", _RpcError(grpc.StatusCode.OUT_OF_RANGE, "events after seq 7 up to 12 are past retention; "
                                     "re-snapshot with from_seq=0"), stream)
    assert agent.table is None
    agent._sync(pb.Verdict(seq=20, conditions=[pb_cond(replace(LINK, seq=15))]))  # XID cleared, LINK raised
    agent.reconciler.step(agent.table)
    skipped = ("Normal", "EventsSkipped", "robustd-k8s could not read robustd's events after seq 7 (events after "
               "seq 7 up to 12 are past retention); 2 Events for what changed up to seq 20 come from a new snapshot: "
               "a fault raised and cleared in between has none")
    assert listed_events(server, tmp_path) == sorted([
        raised, updated, skipped, ("Normal", "XID_79", f"XID_79 cleared on {XID.component}"),
        ("Warning", "NIC_LINK_DOWN", "NIC_LINK_DOWN raised on nic/eth0: WARNING, action NONE")])
    assert agent.state.events_seq == 20 and not agent.state.pending

    again = Agent(load_settings(str(cfg), SCHEMA), kube, clock=clock)  # a restart that lost its state file
    again._sync(pb.Verdict(seq=20, conditions=[pb_cond(replace(LINK, seq=15))]))
    again.reconciler.step(again.table)
    assert len(listed_events(server, tmp_path)) == 5  # the standing fault's Event is the one posted already


def test_release_keeps_a_cordon_another_manager_made_after_robustds(server: KubeAPIServer, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """robustd cordons; an operator then uncordons and cordons again (`kubectl uncordon; kubectl cordon`, field
    manager kubectl-cordon); the fault clears: robustd takes its taint and annotations off, the cordon stays."""
    caplog.set_level(logging.INFO, "robustd.k8s")
    clock = Clock()
    r = reconciler(server, tmp_path, clock, quarantine={"actions": ["REBOOT"], "release_after": "1m",
                                                        "max_fraction": 1.0})
    r.step(table(XID))
    node = client.CoreV1Api(api_client(str(server.kubeconfig(tmp_path / "op.kc")))).read_node(NODE)
    assert node.spec.unschedulable is True
    owner = [m.manager for m in node.metadata.managed_fields if "f:unschedulable" in (m.fields_v1 or {}).get(
        "f:spec", {})]
    assert owner == ["robustd-k8s"]  # robustd-k8s names itself on every write
    writes = server.requests("PATCH", f"/nodes/{NODE}") + server.requests("POST", "/events")
    assert writes and all(q.query.get("fieldManager") == "robustd-k8s" for q in writes)

    kubectl = client.CoreV1Api(api_client(str(server.kubeconfig(tmp_path / "kubectl.kc"))))
    for value in (None, True):
        kubectl.patch_node(NODE, {"spec": {"unschedulable": value}}, field_manager="kubectl-cordon",
                           _content_type=SMP)
    r.step(table())
    clock.t += 61
    r.step(table())
    node = kubectl.read_node(NODE)
    assert node.spec.unschedulable is True and not node.spec.taints  # the operator's cordon stays; robustd's taint goes
    assert not node.metadata.annotations
    assert "(only the taint: spec.unschedulable is kubectl-cordon's now, not robustd-k8s's" in caplog.text
    assert r.state.quarantine is None
