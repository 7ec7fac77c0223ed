"""Stopping and failing to start: always bounded, always clean, always one clear line.

A daemon that does not exit after SIGTERM holds systemd for 90 s and a developer's terminal forever;
one whose start failed and stays alive leaves a socket that every client hangs on. These tests load
the daemon with what has held shutdown before (Watch streams, a running stop-time test, a poll stuck
in NVML, idle relay connections) and time SIGTERM → exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, Daemon, free_port

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.nvmlemu import build
from robustd.nvmlemu import state as emu

FAKE_DCGMI = str(REPO / "tests" / "fakes" / "dcgmi")
EXIT_WITHIN = 2.0


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build.build_emulator(str(tmp_path_factory.mktemp("nvmlemu")))


def exit_status(d: Daemon, after: str) -> int:
    """The daemon's exit status within 15 s; a daemon still running then is killed and the test fails."""
    assert d.proc is not None
    try:
        return d.proc.wait(15)
    except subprocess.TimeoutExpired:
        d.proc.kill()
        d.proc.wait(5)
        raise AssertionError(f"robustd still running 15 s after {after}:\n{d.log()}") from None


def timed_stop(d: Daemon, sig: int = signal.SIGTERM) -> tuple[int, float]:
    assert d.proc is not None
    t0 = time.monotonic()
    d.proc.send_signal(sig)
    code = exit_status(d, f"signal {sig}")
    return code, time.monotonic() - t0


def loaded_daemon(make_daemon: Any, short_tmp: Path, lib: str) -> tuple[Daemon, list[Any]]:
    """A daemon with a hung NVML call, a running EUD that never returns, Watch streams and idle connections."""
    state = str(short_tmp / "nvml.state")
    emu.save(state, emu.healthy_node(4))
    d = make_daemon({"checks": {"kernel": {"enabled": False},
                                "gpu": {"enabled": True, "backend": "emulator", "emulator_state": state,
                                        "emulator_library": lib, "interval": "200ms"}},
                     "diagnostics": {"eud": {"command": [FAKE_DCGMI, "diag", "-r", "eud", "-j"], "timeout": "10m"}},
                     "metrics": {"address": f"127.0.0.1:{free_port()}"}},
                    env={"FAKE_DCGMI_MODE": "hang"})
    d.start()
    held: list[Any] = []
    # Watch streams, as schedulers hold them, read on threads.
    for _ in range(3):
        ch = d.channel()
        call = pb_grpc.NodeHealthStub(ch).Watch(pb.WatchRequest())
        call.initial_metadata()
        threading.Thread(target=lambda c=call: [None for _ in c], daemon=True).start()
        held += [ch, call]
    # A robustctl watch process.
    held.append(subprocess.Popen([sys.executable, "-m", "robustd.cli.robustctl", "--socket", d.socket, "watch"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO))
    # Idle connections to the relay that never speak.
    for _ in range(5):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket)
        held.append(s)
    # A stop-time test that never returns (dcgmi hangs).
    dch = d.channel()
    run = pb_grpc.DiagnosticsStub(dch).Run(pb.RunRequest(tests=["eud"]))
    held += [dch, run]
    threading.Thread(target=lambda: [None for _ in _quiet(run)], daemon=True).start()
    # A poll stuck inside NVML.
    st = emu.load(state)
    emu.apply_fault(st, 2, "hang")
    emu.save(state, st)
    d.wait_for(lambda v: any(c.code == "NVML_HANG" for c in v.conditions), timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = pb_grpc.DiagnosticsStub(dch).List(pb.ListDiagnosticsRequest(), timeout=5).reports
        if running and running[0].outcome == pb.OUTCOME_RUNNING:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the diagnostic never started")
    time.sleep(0.5)  # dcgmi is up and hanging
    return d, held


def _quiet(it: Any) -> Any:
    try:
        yield from it
    except grpc.RpcError:
        return


def release(held: list[Any]) -> None:
    for h in held:
        if isinstance(h, subprocess.Popen):
            h.terminate()
            h.wait(10)
        elif isinstance(h, (socket.socket, grpc.Channel)):
            h.close()


def test_sigterm_under_load_exits_0_within_2s_and_removes_the_socket(make_daemon: Any, short_tmp: Path,
                                                                     lib: str) -> None:
    d, held = loaded_daemon(make_daemon, short_tmp, lib)
    try:
        code, took = timed_stop(d)
        assert code == 0, d.log()
        assert took < EXIT_WITHIN, f"exit took {took:.2f}s:\n{d.log()}"
        assert not os.path.exists(d.socket)
        assert not [p for p in os.listdir(os.path.dirname(d.socket)) if p.startswith(".robustd-")]
        log = d.log()
        assert "stopping" in log and "Traceback" not in log, log
        # The run the stop interrupted is closed as cancelled/error, never left RUNNING.
        d.start()
        reports = pb_grpc.DiagnosticsStub(d.channel()).List(pb.ListDiagnosticsRequest(), timeout=5).reports
        assert reports and reports[0].outcome in (pb.OUTCOME_CANCELLED, pb.OUTCOME_ERROR)
    finally:
        release(held)


def test_sigint_also_stops_within_2s(make_daemon: Any, short_tmp: Path, lib: str) -> None:
    d, held = loaded_daemon(make_daemon, short_tmp, lib)
    try:
        code, took = timed_stop(d, signal.SIGINT)
        assert code == 0 and took < EXIT_WITHIN, (code, took, d.log())
        assert "Traceback" not in d.log()
    finally:
        release(held)


def start_failure(d: Daemon) -> tuple[int, float, list[str]]:
    t0 = time.monotonic()
    d.start(wait=False)
    code = exit_status(d, "a failed start")
    took = time.monotonic() - t0
    d.stop()
    return code, took, [line for line in d.log().splitlines() if line.strip()]


def test_metrics_port_in_use_fails_start_fast_with_one_line(make_daemon: Any) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = make_daemon({"metrics": {"address": f"127.0.0.1:{port}"}, "checks": {"kernel": {"enabled": False}}})
        code, took, lines = start_failure(d)
    assert code != 0
    assert took < EXIT_WITHIN, f"{took:.2f}s (interpreter start included: ~0.4 s here)"
    text = "\n".join(lines)
    assert f"metrics: cannot listen on 127.0.0.1:{port}: " in text and "in use" in text, text
    assert "Traceback" not in text
    assert len([line for line in lines if "cannot listen" in line]) == 1, text
    assert not os.path.exists(d.socket)  # nobody is left for clients to hang on


def test_tcp_port_in_use_fails_start_with_one_line(make_daemon: Any) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = make_daemon({"listen": {"tcp": f"127.0.0.1:{port}", "insecure": True},
                         "checks": {"kernel": {"enabled": False}}})
        code, _took, lines = start_failure(d)
    text = "\n".join(lines)
    assert code != 0 and f"listen.tcp: cannot listen on 127.0.0.1:{port}: " in text and "in use" in text, text
    assert "Traceback" not in text
    assert not os.path.exists(d.socket)


def test_a_state_dir_held_by_a_live_daemon_fails_the_second_start_fast(make_daemon: Any) -> None:
    first = make_daemon({"checks": {"kernel": {"enabled": False}}})
    first.start()
    second = make_daemon({"state_dir": first.state_dir, "checks": {"kernel": {"enabled": False}}})
    code, took, lines = start_failure(second)
    text = "\n".join(lines)
    assert code != 0 and took < EXIT_WITHIN, (code, took, text)
    assert f"state_dir {first.state_dir} is in use by another robustd" in text, text
    assert first.proc is not None and str(first.proc.pid) in text, text
    assert "Traceback" not in text and not os.path.exists(second.socket)
    assert first.verdict().node == "test-node"  # the first one is untouched


def test_a_socket_held_by_a_live_daemon_fails_the_second_start(make_daemon: Any) -> None:
    first = make_daemon({"checks": {"kernel": {"enabled": False}}})
    first.start()
    second = make_daemon({"listen": {"unix": first.socket}, "checks": {"kernel": {"enabled": False}}})
    code, _took, lines = start_failure(second)
    text = "\n".join(lines)
    assert code != 0 and f"another process is already listening on {first.socket}" in text, text
    assert "Traceback" not in text
    assert os.path.exists(first.socket) and first.verdict().node == "test-node"
