"""The stop-time collectives children (stoptests/all_to_all.py, all_gather.py and their launcher and
worker), run as the daemon runs them: gloo on CPU."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from stoptests.collective_launcher import Launcher

REPO = Path(__file__).resolve().parent.parent
SMALL = {"size_mb": 0.5, "iterations": 3, "warmup": 1}  # keep every run to a few seconds on 2 cores
FAKE_GPUS = [{"index": i, "bus_id": f"0000:{0x1b + i:02x}:00.0", "uuid": f"GPU-fake-{i}", "name": "Fake"}
             for i in range(4)]


class Child:
    """One `python -m stoptests.<spec.test> --spec SPEC` run; remembers every descendant it saw."""

    def __init__(self, spec: dict[str, Any], tmp: Path, name: str = "spec", python: str = sys.executable,
                 cwd: Path = REPO):
        self.path = tmp / f"{name}.json"
        self.path.write_text(json.dumps(spec))
        self.t0 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(REPO)}  # as the daemon starts it, from any directory
        self.proc = subprocess.Popen([python, "-m", f"stoptests.{spec['test']}", "--spec", str(self.path)],
                                     cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.seen: dict[int, float] = {}
        self._watch = threading.Thread(target=self._track, daemon=True)
        self._watch.start()

    def _track(self) -> None:
        try:
            me = psutil.Process(self.proc.pid)
            while self.proc.poll() is None:
                for c in me.children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        self.seen.setdefault(c.pid, c.create_time())
                time.sleep(0.05)
        except psutil.NoSuchProcess:
            pass

    def wait(self, timeout: float) -> tuple[int, list[dict[str, Any]], str, float]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its workers die with it (PDEATHSIG)
            self.proc.communicate(timeout=10)
            raise
        elapsed = time.monotonic() - self.t0
        self._watch.join(5)
        lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        return self.proc.returncode, lines, err.decode(errors="replace"), elapsed

    def survivors(self) -> list[int]:
        alive = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


def results(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for line in lines:
        if line.get("type") == "result":
            assert line["component"] not in out, f"two results for {line['component']}"
            out[line["component"]] = line
    return out


def run_a2a(tmp: Path, cwd: Path = REPO, **extra: Any) -> tuple[dict[str, dict[str, Any]], float, Child]:
    spec = {"test": "all_to_all", "run_id": "t", "node": "n0", "work_dir": str(tmp / "work"), "timeout": 40.0,
            "gpus": [], "backend": "gloo", "cpu_ranks": 4, "min_busbw_gbps": 0.0, "faults": {}, **SMALL, **extra}
    child = Child(spec, tmp, cwd=cwd)
    rc, lines, err, elapsed = child.wait(spec["timeout"] + 15)
    assert rc == 0, err[-3000:]
    assert all(line.get("type") in ("progress", "result") for line in lines)
    assert not child.survivors(), "worker processes outlived the child"
    assert child.seen, "no worker process was ever seen"
    return results(lines), elapsed, child


def statuses(res: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {c: r["status"] for c, r in res.items()}


@pytest.mark.parametrize("start", ["fork", "exec"])  # fork: the default; exec: diagnostics.collectives.worker_start
def test_all_to_all_passes_with_bandwidth(tmp_path: Path, start: str) -> None:
    res, _, _ = run_a2a(tmp_path, worker_start=start)
    assert statuses(res) == {f"rank/{i}": "PASS" for i in range(4)}
    for r in res.values():
        f = r["figures"]
        assert f["busbw_gbps"] > 0 and f["algbw_gbps"] > f["busbw_gbps"]  # busbw = algbw * 3/4
        assert abs(f["busbw_gbps"] - f["algbw_gbps"] * 3 / 4) < 1e-3
        assert f["duration_s"] > 0 and f["bytes"] > 0
        assert r["details"]["completed"] is True


def test_flip_bit_names_the_sender(tmp_path: Path) -> None:
    res, _, _ = run_a2a(tmp_path, faults={"flip_bit": {"rank": 2}})
    assert statuses(res) == {"rank/0": "PASS", "rank/1": "PASS", "rank/2": "FAIL", "rank/3": "PASS"}
    assert "wrong bytes" in res["rank/2"]["message"] and "rank 3" in res["rank/2"]["message"]


def test_delayed_rank_is_the_hung_one(tmp_path: Path) -> None:
    res, elapsed, _ = run_a2a(tmp_path, timeout=12.0, faults={"delay": {"rank": 1, "seconds": 120}})
    assert res["rank/1"]["status"] == "FAIL" and "hung" in res["rank/1"]["message"]
    assert [c for c, s in statuses(res).items() if s == "FAIL"] == ["rank/1"]
    assert elapsed < 12.0 + 10.0  # the daemon's kill comes at timeout + 10 s; the child reports before it


def test_a_rank_that_never_began_to_run_is_an_error_not_a_fail(tmp_path: Path) -> None:
    """On CPU ranks nothing but robustd's own start-up lies before a worker runs: a host too loaded to start
    one in time is no evidence about a device (a scheduler would drain a healthy node on a FAIL)."""
    res, elapsed, _ = run_a2a(tmp_path, timeout=8.0, faults={"slow_start": {"rank": 2, "seconds": 60}})
    assert statuses(res) == {"host": "ERROR"}, res
    assert res["host"]["message"].startswith("the test could not start in time: rank(s) 2 were still starting")
    assert res["host"]["details"]["cause"] == "start-up"
    assert elapsed < 8.0 + 10.0


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_killed_rank_is_the_crashed_one(tmp_path: Path, start: str) -> None:
    res, _, _ = run_a2a(tmp_path, faults={"kill": {"rank": 3}}, worker_start=start)
    assert res["rank/3"]["status"] == "FAIL" and "crashed" in res["rank/3"]["message"]
    assert [c for c, s in statuses(res).items() if s == "FAIL"] == ["rank/3"]


def test_gpu_components_and_floor(tmp_path: Path) -> None:
    res, _, _ = run_a2a(tmp_path, gpus=FAKE_GPUS, min_busbw_gbps=1e6)  # gloo on CPU, the fake GPUs' names
    assert set(res) == {f"gpu/{g['bus_id']}" for g in FAKE_GPUS} | {"host"}
    assert res["host"]["status"] == "FAIL" and "floor" in res["host"]["message"]


def test_relative_work_dir_still_rendezvous(tmp_path: Path) -> None:
    # `make run`'s state_dir ./var: a relative work_dir once became file://var/..., which torch reads as
    # /..., and every rank waited for a store file nobody created, until a FAIL blamed the machine.
    (tmp_path / "var").mkdir()
    res, _, _ = run_a2a(tmp_path, cwd=tmp_path, work_dir="var/diag/a2a", timeout=20.0)
    assert statuses(res) == {f"rank/{i}": "PASS" for i in range(4)}, res


def test_no_rank_can_rendezvous_is_an_error_not_a_fail(tmp_path: Path) -> None:
    # Every rank waits at a FileStore in a directory that does not exist: the harness, not a device.
    res, elapsed, _ = run_a2a(tmp_path, timeout=10.0, faults={"unusable_store": True})
    assert statuses(res) == {"host": "ERROR"}, res
    assert res["host"]["message"].startswith("ranks could not rendezvous: ")
    assert "joining the process group" in res["host"]["message"]
    assert elapsed < 10.0 + 10.0


def test_without_torch_the_test_cannot_run(tmp_path: Path, python_without_torch: str) -> None:
    spec = {"test": "all_to_all", "run_id": "t", "node": "n0", "work_dir": str(tmp_path / "work"), "timeout": 30.0,
            "gpus": [], "backend": "gloo", "cpu_ranks": 2, "faults": {}, **SMALL}
    rc, lines, err, _ = Child(spec, tmp_path, python=python_without_torch).wait(60)
    assert rc == 2 and not results(lines)  # PROTOCOL.md: could not run -> the daemon's ERROR, never a FAIL
    assert "torch is not usable here" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("extra, words", [
    ({"size_mb": 1e9}, "size_mb must be between"),
    ({"worker_start": "spawn"}, "worker_start must be one of fork, exec, not 'spawn'"),
    ({"timeout": "1h"}, "timeout must be a number"),
    ({"test": "all_gather", "rendezvous": {"master_addr": "127.0.0.1", "master_port": 70000, "world_size": 2,
                                           "node_rank": 1}}, "master_port must be between 1 and 65535"),
    ({"test": "all_gather", "rendezvous": {"master_addr": "127.0.0.1", "master_port": 29500,
                                           "world_size": 2**32 - 1, "node_rank": 1}}, "world_size must be between"),
    ({"test": "all_gather", "rendezvous": {"master_addr": "127.0.0.1", "master_port": 29500, "world_size": 2,
                                           "node_rank": 2}}, "node_rank must be between 0 and 1"),
])
def test_bad_spec_cannot_run(tmp_path: Path, extra: dict[str, Any], words: str) -> None:
    spec = {"test": "all_to_all", "run_id": "t", "node": "n0", "work_dir": str(tmp_path / "work"), "timeout": 60.0,
            "gpus": [], "backend": "gloo", "cpu_ranks": 2, "faults": {}, **SMALL, **extra}
    child = Child(spec, tmp_path)
    rc, lines, err, elapsed = child.wait(20)  # killed long before a world of 2**32-1 ranks could be judged
    assert rc == 2 and not results(lines) and not child.seen  # refused before any worker started
    assert err.strip().splitlines()[-1].startswith("bad spec: ") and words in err
    assert elapsed < 10


def test_rank_counts_are_bounded_before_any_worker_starts() -> None:
    from stoptests.protocol import SpecError

    base = {"test": "all_to_all", "timeout": 30.0, "backend": "gloo", "faults": {}}
    with pytest.raises(SpecError, match="cpu_ranks must be between 1 and 1024"):
        Launcher({**base, "cpu_ranks": 100_000}, time.monotonic())
    with pytest.raises(SpecError, match="gpus has 2000 items"):
        Launcher({**base, "gpus": [{"index": 0}] * 2000}, time.monotonic())


def test_bad_data_attribution() -> None:
    bad = Launcher.bad_data_suspects
    one = [{"sender": 2, "receiver": 3, "iteration": 1, "offset": 9, "expected": 1, "got": 0}]
    assert list(bad(one, [0, 1, 2, 3], [0, 1, 2, 3])) == [2]
    # one receiver got wrong bytes from every other sender: the receiver is the suspect
    every = [{"sender": s, "receiver": 0, "iteration": 0, "offset": 0, "expected": 1, "got": 0} for s in (1, 2, 3)]
    assert list(bad(every, [0, 1, 2, 3], [0, 1, 2, 3])) == [0]
    # one sender's data wrong at every receiver: the sender
    spread = [{"sender": 1, "receiver": r, "iteration": 0, "offset": 0, "expected": 1, "got": 0} for r in (0, 2, 3)]
    assert list(bad(spread, [0, 1, 2, 3], [0, 1, 2, 3])) == [1]


# ----------------------------------------------------------------------------------------------
# all_gather: three "nodes" on this machine, one rendezvous on 127.0.0.1

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ag(tmp: Path, node_ranks: list[int], world: int = 3, timeout: float = 40.0,
           faults: dict[int, dict[str, Any]] | None = None) -> dict[int, tuple[dict[str, dict[str, Any]], float]]:
    port = free_port()  # without node rank 0 in node_ranks, nothing listens there
    children = {}
    for k in node_ranks:
        spec = {"test": "all_gather", "run_id": f"t{port}", "node": f"node-{k}", "work_dir": str(tmp / f"w{k}"),
                "timeout": timeout, "gpus": [], "backend": "gloo", "cpu_ranks": 4, "min_busbw_gbps": 0.0,
                "rendezvous": {"master_addr": "127.0.0.1", "master_port": port, "world_size": world,
                               "node_rank": k, "run_id": f"job-{port}"},
                "faults": (faults or {}).get(k, {}), **SMALL}
        children[k] = Child(spec, tmp, f"node{k}")
    out = {}
    for k, child in children.items():
        rc, lines, err, elapsed = child.wait(timeout + 15)
        assert rc == 0, f"node {k}: {err[-3000:]}"
        assert not child.survivors(), f"node {k}: worker processes outlived the child"
        out[k] = (results(lines), elapsed)
    return out


def test_all_gather_three_nodes_pass(tmp_path: Path) -> None:
    out = run_ag(tmp_path, [0, 1, 2])
    for k, (res, _) in out.items():
        assert statuses(res) == {f"node/node-{j}": "PASS" for j in range(3) if j != k}, (k, res)
        for r in res.values():
            assert r["figures"]["busbw_gbps"] > 0 and r["figures"]["bytes"] > 0


def test_all_gather_corrupt_node_is_named_by_every_peer(tmp_path: Path) -> None:
    out = run_ag(tmp_path, [0, 1, 2], faults={1: {"corrupt_node": True}})
    for k in (0, 2):
        res = out[k][0]
        fails = [c for c, s in statuses(res).items() if s == "FAIL"]
        assert fails == ["node/node-1"], (k, res)
        assert "wrong bytes" in res["node/node-1"]["message"]
    # node 1 judges its peers fine; its own data coming back wrong is on its `host`
    res1 = out[1][0]
    assert res1["node/node-0"]["status"] == "PASS" and res1["node/node-2"]["status"] == "PASS"


def test_all_gather_unreachable_master_is_an_error(tmp_path: Path) -> None:
    # Nothing listens at the master's port: this node learns nothing about node rank 0's hardware.
    out = run_ag(tmp_path, [1], world=2, timeout=8.0)
    res, _ = out[1]
    assert statuses(res) == {"node/rank0": "SKIPPED", "host": "ERROR"}, res
    assert res["host"]["message"].startswith("ranks could not rendezvous: could not reach the rendezvous master")


def test_all_gather_nobody_else_joined_is_an_error(tmp_path: Path) -> None:
    out = run_ag(tmp_path, [0], world=3, timeout=8.0)
    res, _ = out[0]
    assert statuses(res) == {"node/rank1": "SKIPPED", "node/rank2": "SKIPPED", "host": "ERROR"}, res
    assert "no other node joined the rendezvous" in res["host"]["message"]


def test_all_gather_a_node_late_to_start_is_an_error_for_every_node(tmp_path: Path) -> None:
    out = run_ag(tmp_path, [0, 1, 2], timeout=10.0, faults={1: {"slow_start": {"rank": 0, "seconds": 60}}})
    for k in (0, 2):
        res = out[k][0]
        assert res["node/node-1"]["status"] == "ERROR", (k, res)
        assert "could not start the test in time (late: its rank 1 was still starting" in res["node/node-1"]["message"]
        assert "FAIL" not in statuses(res).values(), (k, res)
    assert "FAIL" not in statuses(out[1][0]).values(), out[1][0]
    assert "ERROR" in statuses(out[1][0]).values(), out[1][0]


@pytest.mark.parametrize("timeout", [10.0])
def test_all_gather_missing_node_is_named(tmp_path: Path, timeout: float) -> None:
    out = run_ag(tmp_path, [0, 1], world=3, timeout=timeout)
    for k in (0, 1):
        res, elapsed = out[k]
        assert res["node/rank2"]["status"] in ("FAIL", "ERROR"), res
        assert "never joined" in res["node/rank2"]["message"]
        peer = f"node/node-{1 - k}"
        assert res[peer]["status"] != "FAIL"
        assert elapsed < timeout + 10.0
