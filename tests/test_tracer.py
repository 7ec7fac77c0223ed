"""Tracer.CaptureStacks with the real py-spy on a real multi-process "training job", through gRPC and robustctl;
`robustctl fleet stacks` over two daemons naming the stuck rank's machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, Daemon, need_root

from robustd.adapters.common import client
from robustd.adapters.common.client import NotTraceable, not_traceable
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.nvmlemu import build
from robustd.nvmlemu import state as emu

TRAIN = '''
import sys, threading, time

def data_loader():
    while True:
        time.sleep(0.05)

def allreduce_gradients():
    while True:
        time.sleep(0.05)

def wait_for_peer_recv():
    while True:
        time.sleep(0.05)

def train_step(stuck):
    if stuck:
        wait_for_peer_recv()
    allreduce_gradients()

threading.Thread(target=data_loader, name="data-loader", daemon=True).start()
print("ready", flush=True)
train_step(stuck=sys.argv[sys.argv.index("--stuck") + 1] == "1")
'''


class Job:
    """`world` Python processes named `fake_train.py --job ID --node N`, RANK/LOCAL_RANK/WORLD_SIZE set; one stuck."""

    def __init__(self, root: Path, world: int, per_node: int, stuck_rank: int | None):
        self.id = uuid.uuid4().hex[:8]
        self.script = root / "fake_train.py"
        self.script.write_text(TRAIN)
        self.procs: list[subprocess.Popen[str]] = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(world)}
            self.procs.append(subprocess.Popen(
                [sys.executable, str(self.script), "--job", self.id, "--node", str(rank // per_node),
                 "--stuck", "1" if rank == stuck_rank else "0"], env=env, stdout=subprocess.PIPE, text=True))
        for p in self.procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"

    def pattern(self, node: int | None = None) -> str:
        return rf"fake_train\.py --job {self.id}" + (f" --node {node} " if node is not None else "")

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def job(short_tmp: Path) -> Iterator[Job]:
    need_root("py-spy attaches to other processes (ptrace)")
    j = Job(short_tmp, world=4, per_node=4, stuck_rank=2)
    yield j
    j.stop()


def tracer_daemon(make_daemon: Any, patterns: list[str], **tracer: Any) -> Daemon:
    d = make_daemon({"tracer": {"process_patterns": patterns, **tracer}, "checks": {"kernel": {"enabled": False}}})
    d.start()
    return d


def capture(d: Daemon, deadline: float = 60, **req: Any) -> pb.CaptureResponse:
    with d.channel() as ch:
        return pb_grpc.TracerStub(ch).CaptureStacks(pb.CaptureRequest(**req), timeout=deadline)


def main_thread(p: pb.ProcessStacks) -> list[str]:
    [t] = [t for t in p.threads if t.name == "MainThread"]
    return [f.function for f in t.frames]


def test_capture_stacks_of_the_training_processes_over_grpc(make_daemon: Any, job: Job) -> None:
    d = tracer_daemon(make_daemon, [job.pattern()])
    resp = capture(d)
    assert resp.node == "test-node" and resp.captured_at.seconds > 0
    assert [p.rank for p in resp.processes] == [0, 1, 2, 3]  # ordered by rank
    for rank, p in enumerate(resp.processes):
        assert p.pid == job.pid(rank) and not p.error and not p.timed_out, p
        assert (p.local_rank, p.world_size) == (rank, 4)
        assert p.selected_by == f"pattern:{job.pattern()}"
        assert f"--job {job.id}" in p.command
        assert {t.name for t in p.threads} == {"MainThread", "data-loader"}
        stack = main_thread(p)
        assert stack[-1] == "<module>" and "train_step" in stack  # innermost first
        expected = "wait_for_peer_recv" if rank == 2 else "allreduce_gradients"
        assert expected in stack and ("allreduce_gradients" in stack) == (rank != 2)
        f = next(f for t in p.threads for f in t.frames if f.function == "train_step")
        assert f.file == str(job.script) and f.line > 0 and not f.native

    only = capture(d, selector=pb.ProcessSelector(ranks=[2]))
    assert [p.pid for p in only.processes] == [job.pid(2)]
    only = capture(d, selector=pb.ProcessSelector(pids=[job.pid(1)]))
    assert [p.rank for p in only.processes] == [1]

    # Never an arbitrary process: this test's own pid matches no pattern. The refusal names what it refused
    # in its status details (pb.NotTraceable), so a caller can drop those and ask again without parsing text.
    with pytest.raises(grpc.RpcError) as err:
        capture(d, selector=pb.ProcessSelector(pids=[os.getpid(), job.pid(0)]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "not a training process" in (err.value.details() or "")
    refused = not_traceable(err.value)
    assert refused is not None and list(refused.pids) == [os.getpid()] and list(refused.ranks) == []
    with pytest.raises(grpc.RpcError) as err:
        capture(d, selector=pb.ProcessSelector(ranks=[9]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    refused = not_traceable(err.value)
    assert refused is not None and list(refused.ranks) == [9] and list(refused.pids) == []
    with pytest.raises(NotTraceable) as refusal:  # the adapters' client reads the same status
        client.capture_stacks(d.socket, [os.getpid(), job.pid(0)], 30)
    assert refusal.value.pids == (os.getpid(),)
    assert [p.pid for p in client.capture_stacks(d.socket, [job.pid(0)], 30).processes] == [job.pid(0)]


def test_native_capture_includes_native_frames(make_daemon: Any, job: Job) -> None:
    d = tracer_daemon(make_daemon, [job.pattern()])
    resp = capture(d, native=True, selector=pb.ProcessSelector(ranks=[1]))
    [p] = resp.processes
    assert not p.error, p.error
    frames = [f for t in p.threads for f in t.frames]
    assert any(f.native for f in frames), [(f.function, f.file) for f in frames]  # e.g. the sleep in libc
    assert "allreduce_gradients" in [f.function for f in frames if not f.native]


def test_robustctl_trace_prints_each_process_and_its_rank(make_daemon: Any, job: Job) -> None:
    d = tracer_daemon(make_daemon, [job.pattern()])
    r = d.robustctl("trace", timeout=90)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("test-node: 4 training processes\n")
    assert f"Process {job.pid(2)} (rank 2, local 2, world 4; pattern:" in r.stdout
    assert 'Thread ' in r.stdout and '"data-loader"' in r.stdout
    block = r.stdout.split(f"Process {job.pid(2)} ")[1].split("Process ")[0]
    assert "    wait_for_peer_recv (fake_train.py:" in block and "allreduce_gradients" not in block

    r = d.robustctl("trace", "--json", "--rank", "0", "--rank", "3", timeout=90)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [p["rank"] for p in doc["processes"]] == [0, 3]
    assert doc["processes"][0]["threads"][0]["frames"][0]["function"]

    r = d.robustctl("trace", "--pid", "1")
    assert r.returncode == 4 and "NOT_FOUND" in r.stderr and "not a training process" in r.stderr


def test_a_capture_that_fails_or_hangs_is_that_process_s_error_not_the_call_s(make_daemon: Any, job: Job,
                                                                           short_tmp: Path) -> None:
    # A matching process that is not Python: py-spy fails on it, the others are still captured.
    tag = str(int(job.id[:5], 16))
    other = subprocess.Popen(["sleep", f"1000.{tag}"])
    try:
        d = tracer_daemon(make_daemon, [job.pattern(), rf"^sleep 1000\.{tag}$"])
        resp = capture(d)
        by_pid = {p.pid: p for p in resp.processes}
        assert by_pid[other.pid].error.startswith("py-spy: ") and not by_pid[other.pid].threads
        assert not by_pid[other.pid].HasField("rank")
        assert all(not by_pid[job.pid(r)].error for r in range(4))
        r = d.robustctl("trace")
        assert r.returncode == 1 and f"Process {other.pid} (rank ?; pattern:" in r.stdout
        assert "NOT CAPTURED: py-spy: " in r.stdout
    finally:
        other.kill()
        other.wait()

    # A py-spy that never returns: each process times out on its own deadline, and the child is killed.
    hang = short_tmp / "py-spy-hang"
    marker = f"hang-{job.id}"
    hang.write_text(f"#!/bin/sh\nexec sleep 60 # {marker}\n")
    hang.chmod(0o755)
    d2 = tracer_daemon(make_daemon, [job.pattern()], py_spy=str(hang), concurrency=4)
    t0 = time.monotonic()
    resp = capture(d2, deadline=30, timeout=_duration(1.0))
    took = time.monotonic() - t0
    assert took < 5, took  # four processes at once, one second each
    assert [p.timed_out for p in resp.processes] == [True] * 4
    assert all(p.error == "py-spy did not finish within 1 s" and 0.9 < p.duration.ToNanoseconds() / 1e9 < 3
               for p in resp.processes)
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout == "", f"py-spy children left running: {left.stdout}"

    with pytest.raises(grpc.RpcError) as err:
        capture(d2, timeout=_duration(3600.0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _duration(seconds: float) -> Any:
    from google.protobuf.duration_pb2 import Duration

    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def test_gpu_compute_processes_are_traced_without_any_pattern(make_daemon: Any, job: Job, short_tmp: Path) -> None:
    lib = build.build_emulator(str(short_tmp / "nvmlemu"))
    state = emu.healthy_node(2)
    state.gpus[1].processes = f"{job.pid(3)}:1073741824"
    path = str(short_tmp / "nvml.state")
    emu.save(path, state)
    d = make_daemon({"checks": {"kernel": {"enabled": False},
                                "gpu": {"enabled": True, "backend": "emulator", "emulator_state": path,
                                        "emulator_library": lib, "interval": "200ms"}}})
    d.start()
    deadline = time.monotonic() + 10
    while not (resp := capture(d)).processes and time.monotonic() < deadline:
        time.sleep(0.2)  # until the GPU check has polled once
    assert [(p.pid, p.rank, p.selected_by) for p in resp.processes] == [(job.pid(3), 3, "gpu")]
    assert "allreduce_gradients" in main_thread(resp.processes[0])


def test_config_rejects_a_bad_pattern_with_its_line(make_daemon: Any) -> None:
    d = make_daemon({"tracer": {"process_patterns": ["ok", "(unclosed"]}})
    r = subprocess.run([sys.executable, "-m", "robustd.daemon", "--config", str(d.config_path), "--check-config"],
                       capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode != 0
    line = next(i for i, text in enumerate(d.config_path.read_text().splitlines(), 1) if "(unclosed" in text)
    assert f"{d.config_path}:{line}: tracer.process_patterns" in r.stderr
    assert "not a valid regular expression" in r.stderr


def test_an_unauthorized_caller_cannot_trace(make_daemon: Any, job: Job) -> None:
    d = tracer_daemon(make_daemon, [job.pattern()])
    d.write_config({"listen": {"unix_mode": 0o666}})
    d.restart()
    for p in (d.root, d.root.parent):
        os.chmod(p, 0o711)
    code = ("import sys, grpc\nfrom robustd.api.v1 import robustd_pb2 as pb, robustd_pb2_grpc as pb_grpc\n"
            "ch = grpc.insecure_channel('unix://' + sys.argv[1])\n"
            "try:\n    pb_grpc.TracerStub(ch).CaptureStacks(pb.CaptureRequest(), timeout=20); print('OK')\n"
            "except grpc.RpcError as e:\n    print(e.code().name)\n")
    r = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", sys.executable, "-c",
                        code, d.socket], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.stdout.strip() == "PERMISSION_DENIED", r.stderr
    assert "Tracer/CaptureStacks refused" in d.log()


def test_fleet_stacks_names_the_machine_of_the_stuck_rank(make_daemon: Any, short_tmp: Path) -> None:
    need_root("py-spy attaches to other processes (ptrace)")
    job = Job(short_tmp, world=8, per_node=4, stuck_rank=6)  # tp=2, pp=2, dp=2; node 1 holds ranks 4-7
    try:
        nodes = [tracer_daemon(make_daemon, [job.pattern(n)]) for n in (0, 1)]
        hosts = [f"unix:{n.socket}" for n in nodes]
        r = nodes[0].robustctl("fleet", "stacks", "--layout", "tp=2,pp=2,dp=2", "--json", *hosts, timeout=120)
        assert r.returncode == 1, r.stderr  # suspects named
        doc = json.loads(r.stdout)
        [rnd] = doc["rounds"]
        assert rnd["outliers"] == [6] and rnd["missing"] == [] and rnd["unreachable"] == []
        # The smallest eviction covering rank 6: its TP group (ranks 6, 7), on one machine.
        assert rnd["suspect_kind"] == "tp" and doc["suspect_machines"] == [hosts[1]]
        assert [(g["ranks"], g["outliers"]) for g in rnd["suspects"]] == [([6, 7], [6])]
        healthy = [g for g in rnd["groups"] if g["healthy"]]
        assert len(healthy) == 1 and healthy[0]["ranks"] == [0, 1, 2, 3, 4, 5, 7]

        r = nodes[0].robustctl("fleet", "stacks", "--layout", "tp=2,pp=2,dp=2", *hosts, timeout=120)
        assert r.returncode == 1, r.stderr
        assert "8 of 8 ranks captured" in r.stdout and f"SUSPECTS (tp): evict {hosts[1]}" in r.stdout
        assert "wait_for_peer_recv" in r.stdout

        # Fail-slow mode over 2 rounds, one host down: its ranks are missing, so they are the suspects.
        nodes[1].stop()
        r = nodes[0].robustctl("fleet", "stacks", "--layout", "tp=2,pp=2,dp=2", "--rounds", "2", "--interval",
                               "100ms", "--json", *hosts, timeout=120)
        doc = json.loads(r.stdout)
        assert [len(x["unreachable"]) for x in doc["rounds"]] == [1, 1]
        assert doc["rounds"][0]["missing"] == [4, 5, 6, 7]
        assert doc["fail_slow"]["flags"] == 2 and doc["fail_slow"]["suspect"]["outliers"] == [4, 5, 6, 7]
    finally:
        job.stop()


def test_selection_on_a_proc_tree(tmp_path: Path) -> None:
    """Who counts as a training process, on a fixture /proc: the daemon's own descendants never do."""
    from robustd import tracer
    from robustd.config import TracerConfig
    from robustd.roots import Roots

    def proc(pid: int, ppid: int, cmd: str, env: dict[str, str] | None = None) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")
        (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
        (d / "stat").write_text(f"{pid} ({cmd.split()[0]} x) S {ppid} {pid} {pid} 0 -1\n")

    proc(1, 0, "/sbin/init")
    proc(100, 1, "robustd --config /etc/robustd/robustd.yaml")
    proc(101, 100, "python -m stoptests.all_to_all --spec s.json")      # a diagnostics child
    proc(102, 101, "python -m stoptests.collective_worker --worker-fd 5")  # its rank process, on a GPU
    proc(200, 1, "torchrun --nproc-per-node 2 pretrain_gpt.py")
    proc(201, 200, "python pretrain_gpt.py --lr 1e-4", {"RANK": "8", "LOCAL_RANK": "0", "WORLD_SIZE": "16"})
    proc(202, 200, "python pretrain_gpt.py --lr 1e-4", {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "x"})
    proc(300, 1, "sshd: root@pts/0")
    (tmp_path / "self").mkdir()  # not a pid
    roots = Roots(proc=str(tmp_path))

    cfg = TracerConfig(process_patterns=[r"python .*pretrain_gpt\.py"])
    got = tracer.select(roots, cfg, gpu_pids=[102, 202, 999], own_pid=100)
    assert [(t.pid, t.rank, t.local_rank, t.world_size, t.selected_by) for t in got] == [
        (201, 8, 0, 16, r"pattern:python .*pretrain_gpt\.py"),
        (202, 9, 1, None, "gpu"),  # a GPU process is selected as such; a malformed WORLD_SIZE is left out
    ]
    assert [t.pid for t in tracer.select(roots, TracerConfig(gpu_processes=False), [201], own_pid=100)] == []
    assert [t.pid for t in tracer.select(roots, TracerConfig(max_processes=1, process_patterns=["pretrain"]), [],
                                         own_pid=100)] == [201]  # torchrun (no RANK) sorts after the ranks
    with pytest.raises(tracer.NotTraceable, match="pid 300: not a training process"):
        tracer.narrow(got, [300], [])
    assert [t.pid for t in tracer.narrow(got, [], [9])] == [202]
