"""robustd-k8s's shadow mode, stale news and reload, through the official client against the API-server stand-in.

The decisions are driven two ways: the reconciler with a simulated clock (the same fault sequence in act
and in shadow), and the whole agent following a robustd stand-in over real gRPC on a real Unix socket
(FakeRobustd below: it serves GetVerdict and Watch from events the test writes, so a fault can be an hour
old). What is asserted is what kubectl and the operator see: the Node (its resourceVersion), its Events,
the agent's log, `robustd-k8s --status`.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import REPO
from fakes.kube_apiserver import KubeAPIServer

from robustd.adapters.common.model import CLEARED, RAISED, Cond, Table
from robustd.adapters.k8s.config import K8sConfig
from robustd.adapters.k8s.families import event_for
from robustd.adapters.k8s.kube import Kube, api_client
from robustd.adapters.k8s.reconciler import Reconciler
from robustd.adapters.k8s.state import K8sState, K8sStateFile
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


def test_shadow_decides_as_act_and_writes_nothing(server: KubeAPIServer, tmp_path: Path) -> None:
    server.add_node("gpu-act")
    act = scenario(server, tmp_path, "gpu-act", "act")
    cordons = [r.status for r in server.requests("PATCH", "/nodes/gpu-act") if not r.path.endswith("/status")]
    assert cordons == [200, 200] and not server.node("gpu-act")["spec"].get("unschedulable")  # cordoned, released
    server.add_node("gpu-shadow")
    before = server.node("gpu-shadow")
    shadow = scenario(server, tmp_path, "gpu-shadow", "shadow")

    assert said(shadow) == said(act)  # the same decisions, in the same words
    kinds = [k for k, _ in said(act)]
    assert kinds.count("cordon") == 1 and kinds.count("uncordon") == 1 and kinds.count("event") == 4, kinds
    assert ("cordon", "cordon NODE: XID_79 on gpu/0000:1b:00.0 (CRITICAL, action REBOOT), taint "
            "robustd.io/unhealthy=REBOOT:NoSchedule") in said(act)
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
    assert lines[1] == "decisions (shadow): condition 13, event 4, cordon 1, uncordon 1", r.stdout
    assert any(x.endswith("would cordon gpu-shadow: XID_79 on gpu/0000:1b:00.0 (CRITICAL, action REBOOT), taint "
                          "robustd.io/unhealthy=REBOOT:NoSchedule") for x in lines), r.stdout
    assert lines[-1].endswith("would uncordon gpu-shadow: robustd's verdict has been OK for 300s"), r.stdout

    cfg.write_text(cfg.read_text().replace("mode: shadow", "mode: dry-run"))
    r = agent_cli("--check-config", "--config", str(cfg))
    assert r.returncode != 0 and f"{cfg}:6: k8s.mode" in r.stderr, r.stderr
