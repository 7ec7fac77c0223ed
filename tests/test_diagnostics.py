"""Stop-time diagnostics through the real daemon's gRPC API: reports, conditions, refusals, cancel."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from conftest import REPO, Daemon

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.nvmlemu import state as emu

FAKE_DCGMI = str(REPO / "tests" / "fakes" / "dcgmi")


def diag_daemon(make_daemon: Any, mode: str = "pass4", diagnostics: dict[str, Any] | None = None,
                checks: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
                in_root: bool = False, env: dict[str, str] | None = None) -> Daemon:
    """A started daemon for diagnostics; `in_root` starts it in its own directory (like `make run` in the checkout);
    `env` adds to the daemon's environment (the fake dcgmi's other settings)."""
    d = make_daemon({"diagnostics": {"eud": {"command": [FAKE_DCGMI, "diag", "-r", "eud", "-j"], "timeout": "20s"},
                                     "test_faults": True, **(diagnostics or {})},
                     "checks": {"kernel": {"enabled": False}, **(checks or {})}, **(config or {})},
                    env={"FAKE_DCGMI_MODE": mode, **(env or {})})
    if in_root:
        d.cwd = d.root
    d.start()
    return d


def stub(d: Daemon) -> pb_grpc.DiagnosticsStub:
    return pb_grpc.DiagnosticsStub(d.channel())


def run(d: Daemon, **req: Any) -> tuple[list[pb.DiagnosticProgress], pb.DiagnosticReport]:
    msgs = list(stub(d).Run(pb.RunRequest(**req), timeout=120))
    assert msgs[-1].phase == pb.DiagnosticProgress.PHASE_DONE
    return msgs, msgs[-1].report


def dcgmi_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if FAKE_DCGMI in (p.info["cmdline"] or [])]


def test_eud_failure_names_gpus_raises_conditions_and_survives_restart(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, "fail4")
    msgs, report = run(d, tests=["eud"])
    phases = [m.phase for m in msgs]
    assert phases[0] == pb.DiagnosticProgress.PHASE_STARTED and pb.DiagnosticProgress.PHASE_FINISHED in phases
    assert report.outcome == pb.OUTCOME_FAIL
    assert list(report.suspects) == ["gpu/index2", "gpu/index5"]
    assert report.severity == pb.SEVERITY_CRITICAL
    v = d.verdict()  # the scheduler sees it like any other fault
    conds = {(c.component, c.code): c for c in v.conditions}
    assert {k[1] for k in conds} == {"DIAG_EUD_FAILED"}
    assert conds[("gpu/index5", "DIAG_EUD_FAILED")].action == pb.ACTION_RESET_GPU  # DCGM said RESET
    assert conds[("gpu/index2", "DIAG_EUD_FAILED")].evidence["report"] == report.id
    d.restart()
    again = stub(d).Get(pb.GetDiagnosticRequest(id=report.id), timeout=5)
    assert again == report
    assert [r.id for r in stub(d).List(pb.ListDiagnosticsRequest(), timeout=5).reports] == [report.id]
    r = d.robustctl("diag", "show", report.id)
    assert r.returncode == 2 and "gpu/index2" in r.stdout and "FAIL" in r.stdout


def diag_conditions(d: Daemon) -> list[tuple[str, str]]:
    return [(c.component, c.code) for c in d.verdict().conditions if c.code.startswith("DIAG_")]


def assert_error_not_fail(d: Daemon, report: pb.DiagnosticReport) -> None:
    """A harness failure: an ERROR report that blames nothing and raises no condition."""
    assert report.outcome == pb.OUTCOME_ERROR, report
    assert (report.severity, report.action) == (pb.SEVERITY_OK, pb.ACTION_NONE)
    assert not report.suspects and not [x for x in report.results if x.status == pb.RESULT_FAIL]
    assert diag_conditions(d) == []
    r = d.robustctl("diag", "show", report.id)
    assert r.returncode == 5 and "ERROR" in r.stdout  # exitcodes.DIAG_ERROR


def test_missing_dcgmi_is_an_error_never_pass(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, diagnostics={"eud": {"command": ["/nonexistent/dcgmi", "diag", "-j"]}})
    _, report = run(d, tests=["eud"])
    assert [(x.component, x.status) for x in report.results] == [("host", pb.RESULT_ERROR)]
    assert report.results[0].message.startswith("dcgmi not found: /nonexistent/dcgmi")
    assert_error_not_fail(d, report)


def test_a_test_that_cannot_run_does_not_stop_the_next(make_daemon: Any) -> None:
    """stop_on_failure (the default) stops after hardware evidence, not after a harness ERROR: a host
    without DCGM still gets its all-to-all."""
    d = diag_daemon(make_daemon, diagnostics={"eud": {"command": ["/nonexistent/dcgmi", "diag", "-j"]},
                                              "collectives": {"cpu_ranks": 2, "timeout": "40s"}})
    _, report = run(d, tests=["eud", "all_to_all"])
    assert [(x.test, x.status) for x in report.results if x.component == "host"][:1] == [("eud", pb.RESULT_ERROR)]
    assert {x.test for x in report.results if x.status == pb.RESULT_PASS} == {"all_to_all"}
    assert report.outcome == pb.OUTCOME_ERROR  # not everything asked for could be tested
    assert diag_conditions(d) == []


def test_make_run_relative_state_dir_standard_level_passes(make_daemon: Any) -> None:
    # `make run`: state_dir ./var, relative to the daemon's working directory. It once became the
    # rendezvous URL file://./var/..., read as /var/...: every rank waited, and a FAIL blamed the machine.
    d = diag_daemon(make_daemon, config={"state_dir": "./var"}, in_root=True,
                    diagnostics={"collectives": {"cpu_ranks": 2, "timeout": "40s"}, "minigpt": {"steps": 3}})
    r = d.robustctl("diag", "run", "--level", "standard", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr + d.log()
    report = stub(d).List(pb.ListDiagnosticsRequest(), timeout=5).reports[0]
    assert report.outcome == pb.OUTCOME_PASS and "PASS" in r.stdout
    assert {x.test for x in report.results if x.status == pb.RESULT_PASS} == {"all_to_all", "minigpt"}
    assert (d.root / "var").is_dir()  # the state is where the operator said: under the working directory
    assert diag_conditions(d) == []


def test_ranks_that_cannot_rendezvous_are_an_error_not_a_fail(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, diagnostics={"collectives": {"cpu_ranks": 2, "timeout": "8s"}})
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, report = run(d, tests=["all_gather", "all_to_all"], stop_on_failure=False,
                    rendezvous=pb.Rendezvous(master_addr="127.0.0.1", master_port=port, world_size=2, node_rank=1,
                                             run_id="job-9"),
                    test_faults_json='{"all_to_all": {"unusable_store": true}}')  # a FileStore nobody can open
    errors = {x.test: x.message for x in report.results if x.component == "host" and x.status == pb.RESULT_ERROR}
    assert errors["all_gather"].startswith(f"ranks could not rendezvous: could not reach the rendezvous master "
                                           f"127.0.0.1:{port}")
    assert errors["all_to_all"].startswith("ranks could not rendezvous: ")
    assert_error_not_fail(d, report)


def test_a_child_that_cannot_import_torch_is_an_error(make_daemon: Any, python_without_torch: str) -> None:
    d = diag_daemon(make_daemon, diagnostics={"python": python_without_torch, "collectives": {"cpu_ranks": 2},
                                              "minigpt": {"steps": 2}})
    _, report = run(d, tests=["all_to_all", "minigpt"], stop_on_failure=False)
    assert [(x.test, x.component, x.status) for x in report.results] == [
        ("all_to_all", "host", pb.RESULT_ERROR), ("minigpt", "host", pb.RESULT_ERROR)]
    for x in report.results:
        assert x.message.startswith(f"{x.test} could not run: ") and "torch is not usable here" in x.message, x
    assert_error_not_fail(d, report)


@pytest.fixture
def python_with_torch_only(tmp_path: Path) -> str:
    """The interpreter README's install section gives the children: torch, but none of the daemon's own
    packages (a separate venv). Stand-ins that raise ImportError shadow them, for the child and its ranks."""
    shadow = tmp_path / "shadow"
    for name in ("pynvml", "pydantic", "pyroute2", "yaml", "grpc", "psutil", "prometheus_client", "google"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(f'raise ImportError("no {name} in this venv")\n')
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={shadow}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_children_run_on_an_interpreter_with_torch_only(make_daemon: Any, python_with_torch_only: str) -> None:
    """Importing `checks` used to import every live check (pynvml, pydantic, ...): under a torch-only venv
    every stop-time test died before it started."""
    d = diag_daemon(make_daemon, diagnostics={"python": python_with_torch_only,
                                              "collectives": {"cpu_ranks": 2, "timeout": "40s"},
                                              "minigpt": {"steps": 2}})
    _, report = run(d, tests=["all_to_all", "minigpt"], stop_on_failure=False)
    assert report.outcome == pb.OUTCOME_PASS, report
    assert {x.test for x in report.results if x.status == pb.RESULT_PASS} == {"all_to_all", "minigpt"}


def test_a_missing_interpreter_is_an_error(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, diagnostics={"python": "/nonexistent/python3"})
    _, report = run(d, tests=["all_to_all"])
    assert [(x.component, x.status) for x in report.results] == [("host", pb.RESULT_ERROR)]
    assert report.results[0].message.startswith("all_to_all could not start: ")
    assert "/nonexistent/python3" in report.results[0].message
    assert_error_not_fail(d, report)


def _rendezvous(**kw: Any) -> pb.Rendezvous:
    return pb.Rendezvous(**{"master_addr": "10.0.0.1", "master_port": 29500, "world_size": 2, "node_rank": 0,
                            "run_id": "job-1", **kw})


IMPOSSIBLE = [
    (dict(rendezvous=_rendezvous(world_size=2**32 - 1)), "world_size must be between 1 and 4096"),
    (dict(rendezvous=_rendezvous(world_size=0)), "world_size must be between 1 and 4096"),
    (dict(rendezvous=_rendezvous(master_port=70000)), "master_port must be between 1 and 65535"),
    (dict(rendezvous=_rendezvous(master_port=0)), "master_port must be between 1 and 65535"),
    (dict(rendezvous=_rendezvous(node_rank=2)), "node_rank must be below world_size 2"),
    (dict(rendezvous=_rendezvous(master_addr="")), "master_addr"),
    (dict(rendezvous=_rendezvous(master_addr="a" * 300)), "master_addr"),
    (dict(rendezvous=_rendezvous(master_addr="10.0.0.1\n; rm -rf /")), "master_addr"),
    (dict(rendezvous=_rendezvous(run_id="j" * 200)), "run_id"),
    (dict(rendezvous=_rendezvous(run_id="job 1\x1b[2J")), "run_id"),
    (dict(level="x" * 10_000), "level is longer than"),
    (dict(tests=["eud"] * 100), "tests: at most"),
    (dict(tests=["eud"], gpus=["0000:1b:00.0"] * 5000), "gpus: at most"),
    (dict(tests=["eud"], test_faults_json="{" + " " * 100_000 + "}"), "test_faults_json is longer than"),
]


def test_impossible_requests_are_refused_before_anything_starts(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon)
    for fields, words in IMPOSSIBLE:
        req = pb.RunRequest(**{"tests": ["all_gather"], **fields})
        with pytest.raises(grpc.RpcError) as err:
            list(stub(d).Run(req, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, err.value)
        assert words in (err.value.details() or ""), (words, err.value.details())
        assert len(err.value.details() or "") < 300
    req8 = pb.RunRequest(tests=["eud"])
    req8.timeout.FromSeconds(8 * 86400)
    with pytest.raises(grpc.RpcError) as err:
        list(stub(d).Run(req8, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 7 days" in (err.value.details() or "")
    r = d.robustctl("diag", "run", "--tests", "all_gather", "--rendezvous", "10.0.0.1:70000,2,0,job-1")
    assert r.returncode != 0 and "65535" in r.stderr, r
    assert stub(d).List(pb.ListDiagnosticsRequest(), timeout=5).reports == []  # nothing started


def test_second_run_is_aborted_and_cancel_kills_the_children(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, "hang", diagnostics={"eud": {"command": [FAKE_DCGMI, "diag", "-j"],
                                                              "timeout": "10m"}})
    got: list[pb.DiagnosticProgress] = []
    t = threading.Thread(target=lambda: got.extend(stub(d).Run(pb.RunRequest(tests=["eud"]), timeout=60)))
    t.start()
    deadline = time.monotonic() + 10
    while not dcgmi_processes():
        assert time.monotonic() < deadline, "the fake dcgmi never started"
        time.sleep(0.05)
    running = stub(d).List(pb.ListDiagnosticsRequest(), timeout=5).reports[0]
    assert running.outcome == pb.OUTCOME_RUNNING
    with pytest.raises(grpc.RpcError) as err:
        list(stub(d).Run(pb.RunRequest(tests=["eud"]), timeout=10))
    assert err.value.code() == grpc.StatusCode.ABORTED and running.id in (err.value.details() or "")
    report = stub(d).Cancel(pb.CancelDiagnosticRequest(id=running.id), timeout=20)
    assert report.outcome == pb.OUTCOME_CANCELLED
    t.join(20)
    assert got[-1].report.outcome == pb.OUTCOME_CANCELLED
    assert dcgmi_processes() == []  # no orphan left behind
    r = d.robustctl("diag", "list")
    assert r.returncode == 0 and "CANCELLED" in r.stdout


def test_a_hung_test_is_killed_at_its_timeout(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, "hang", diagnostics={"eud": {"command": [FAKE_DCGMI, "diag", "-j"], "timeout": "2s"}})
    t0 = time.monotonic()
    _, report = run(d, tests=["eud"])
    assert time.monotonic() - t0 < 15
    assert report.outcome == pb.OUTCOME_ERROR
    assert any(x.status == pb.RESULT_ERROR for x in report.results)
    assert dcgmi_processes() == []


def test_busy_node_refused_unless_forced(make_daemon: Any, short_tmp: Path) -> None:
    state = short_tmp / "nvml.state"
    node = emu.healthy_node(2)
    node.gpus[0].processes = "4242:1073741824"
    emu.save(str(state), node)
    d = diag_daemon(make_daemon, "pass4", checks={"gpu": {"enabled": True, "backend": "emulator",
                                                          "emulator_state": str(state), "interval": "200ms"}})
    deadline = time.monotonic() + 10
    while True:
        try:
            list(stub(d).Run(pb.RunRequest(tests=["eud"]), timeout=30))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "4242" in (err.details() or "")
            break
        assert time.monotonic() < deadline, "a busy node was not refused"
        time.sleep(0.2)  # the GPU check has not polled yet
    _, report = run(d, tests=["eud"], force=True)
    assert report.outcome == pb.OUTCOME_PASS


def test_exited_processes_from_a_stale_poll_do_not_refuse_the_next_run(make_daemon: Any, short_tmp: Path) -> None:
    """Seen on an H200: a second Run right after the first was refused, naming the first run's rank.

    The GPU check polls once an hour here, so its snapshot stays older than the first run's end: a pid
    in it that has exited since does not make the node busy; one still alive does.
    """
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        state = short_tmp / "nvml.state"
        node = emu.healthy_node(2)
        node.gpus[0].processes = f"{gone.pid}:1073741824"
        node.gpus[1].processes = f"{alive.pid}:1073741824"
        emu.save(str(state), node)
        d = diag_daemon(make_daemon, "pass4", checks={"gpu": {"enabled": True, "backend": "emulator",
                                                              "emulator_state": str(state), "interval": "1h"}})
        deadline = time.monotonic() + 10
        while True:  # the first poll has published both pids
            try:
                list(stub(d).Run(pb.RunRequest(tests=["eud"]), timeout=30))
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                if str(gone.pid) in (err.details() or ""):
                    break
            assert time.monotonic() < deadline, "the first poll did not publish the compute pids"
            time.sleep(0.2)
        _, report = run(d, tests=["eud"], force=True)
        assert report.outcome == pb.OUTCOME_PASS
        with pytest.raises(grpc.RpcError) as err:  # still busy: the live one
            list(stub(d).Run(pb.RunRequest(tests=["eud"]), timeout=30))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert str(alive.pid) in (err.value.details() or "") and str(gone.pid) not in (err.value.details() or "")
        alive.kill()
        alive.wait()
        _, report = run(d, tests=["eud"])
        assert report.outcome == pb.OUTCOME_PASS
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("req, words", [
    ({"tests": ["eud"], "level": "quick"}, "not both"),
    ({"level": "nope"}, "unknown level"),
    ({"tests": ["memtest"]}, "unknown tests"),
    ({"tests": ["eud"], "gpus": ["0000:99:00.0"]}, "unknown GPUs"),
])
def test_invalid_requests(make_daemon: Any, req: dict[str, Any], words: str) -> None:
    d = diag_daemon(make_daemon)
    with pytest.raises(grpc.RpcError) as err:
        list(stub(d).Run(pb.RunRequest(**req), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in (err.value.details() or "")


def test_fault_injection_is_refused_unless_configured(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, diagnostics={"test_faults": False})
    with pytest.raises(grpc.RpcError) as err:
        list(stub(d).Run(pb.RunRequest(tests=["eud"], test_faults_json='{"eud": {}}'), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_minigpt_through_the_daemon_odd_rank_out_golden_and_no_torch_in_the_daemon(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, diagnostics={"minigpt": {"steps": 5}, "collectives": {"cpu_ranks": 3}})
    _, report = run(d, tests=["minigpt"], test_faults_json='{"minigpt": {"perturb_ulp": {"rank": 1}}}')
    assert report.outcome == pb.OUTCOME_FAIL and list(report.suspects) == ["rank/1"]
    assert report.severity == pb.SEVERITY_CRITICAL  # silent data corruption: out of its jobs
    _, good = run(d, tests=["minigpt"])
    assert good.outcome == pb.OUTCOME_PASS
    assert not any(c.code == "DIAG_MINIGPT_FAILED" for c in d.verdict().conditions)  # the pass cleared it
    golden = stub(d).RecordGolden(pb.RecordGoldenRequest(), timeout=5)
    host = next(x for x in good.results if x.component == "host")
    assert golden.report_id == good.id and golden.digest == host.details["node_digest"]
    assert "torch" in golden.key and "steps" in golden.key
    _, again = run(d, tests=["minigpt"])
    host = next(x for x in again.results if x.component == "host")
    assert again.outcome == pb.OUTCOME_PASS and host.details["golden"] == golden.digest
    r = d.robustctl("diag", "golden", "show")
    assert r.returncode == 0 and golden.digest[:16] in r.stdout
    assert d.proc is not None and "libtorch" not in _maps(d.proc.pid)  # children only


def test_all_to_all_corrupt_byte_names_the_sender_on_watch(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, diagnostics={"collectives": {"cpu_ranks": 4}})
    with d.channel() as ch:
        health = pb_grpc.NodeHealthStub(ch)
        head = health.GetVerdict(pb.GetVerdictRequest(), timeout=5).seq
        watch = health.Watch(pb.WatchRequest(from_seq=head))
        _, report = run(d, tests=["all_to_all", "minigpt"],
                        test_faults_json='{"all_to_all": {"flip_bit": {"rank": 2}}}')
        ev = next(iter(watch))
        watch.cancel()
    assert report.outcome == pb.OUTCOME_FAIL and list(report.suspects) == ["rank/2"]
    assert [x.status for x in report.results if x.test == "minigpt"] == [pb.RESULT_SKIPPED]  # stop_on_failure
    assert (ev.kind, ev.condition.code, ev.condition.component) == (
        pb.EVENT_KIND_RAISED, "DIAG_ALL_TO_ALL_FAILED", "rank/2")
    passing = [x for x in report.results if x.status == pb.RESULT_PASS]
    assert {x.component for x in passing} == {"rank/0", "rank/1", "rank/3"}
    assert all(x.figures["busbw_gbps"] > 0 for x in passing)
