"""robustd-slurm and the robustctl Slurm hooks against a real Slurm (slurmctld, slurmd, munged) on this machine.

One private single-node cluster per module (tests/fixtures/slurm/cluster.py), reset between tests;
each test has its own robustd daemon and state file. Faults come from the real /dev/kmsg for the
Xid 79 test and from the NVML emulator elsewhere (the other tests' kernel-log lines cannot reach
them). What is asserted is what an operator sees: `sinfo`'s state and reason, whether a job runs,
what slurmctld logged, and the exit codes of the hooks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import yaml
from conftest import IN_CI, REPO, Daemon, inject_kmsg, merge, need_root

sys.path.insert(0, str(REPO / "tests" / "fixtures" / "slurm"))
from cluster import AgentProcess, SlurmCluster, missing_programs  # noqa: E402

from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.nvmlemu import build  # noqa: E402
from robustd.nvmlemu import state as emu  # noqa: E402

pytestmark = pytest.mark.root

FAKE_DCGMI = str(REPO / "tests" / "fakes" / "dcgmi")
BUS = "0000:1b:00.0"  # the emulator's GPU 0 (gpu/0000:1b:00.0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    need_root("running munged, slurmctld and slurmd")
    missing = missing_programs()
    if missing:
        (pytest.fail if IN_CI else pytest.skip)(f"Slurm is not installed (no {', '.join(missing)}): `make deps` "
                                                "installs slurmctld, slurmd, slurm-client and munge")
    c = SlurmCluster()
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    yield c
    c.stop()
    shutil.rmtree(c.root, ignore_errors=True)


@pytest.fixture
def slurm(cluster: SlurmCluster) -> SlurmCluster:
    cluster.reset()
    return cluster


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build.build_emulator(str(tmp_path_factory.mktemp("nvmlemu")))


class Node:
    """This node's robustd (NVML emulator or the real kernel log), its config, and robustd-slurm for it."""

    def __init__(self, make_daemon: Any, cluster: SlurmCluster, lib: str, slurm: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None, kernel: bool = False, env: dict[str, str] | None = None):
        self.cluster = cluster
        self.gpu_state = ""
        cfg: dict[str, Any] = {"slurm": {"resume_after": "500ms", **(slurm or {})},
                               "diagnostics": {"eud": {"command": [FAKE_DCGMI, "diag", "-r", "eud", "-j"],
                                                       "timeout": "20s"},
                                               "levels": {"quick": ["eud"], "selfcheck": ["eud"]}}}
        if kernel:
            cfg["checks"] = {"kernel": {"lookback": "0s"}}
        else:
            self.gpu_state = str(cluster.root / f"nvml-{time.monotonic_ns()}.state")
            emu.save(self.gpu_state, emu.healthy_node(2))
            cfg["checks"] = {"kernel": {"enabled": False},  # other tests write the real /dev/kmsg
                             "gpu": {"enabled": True, "backend": "emulator", "emulator_state": self.gpu_state,
                                     "emulator_library": lib, "interval": "100ms"}}
            cfg["policy"] = {"codes": {"GPU_ECC_DBE": {"clear_after": "1s"}}}
        self.d: Daemon = make_daemon(merge(cfg, config or {}), env=env)
        self.d.start()
        self.agent = AgentProcess(self.d.config_path, cluster, self.d.root / "agent.log")
        self.state_file = Path(self.d.state_dir) / "slurm.json"

    def fault(self, gpu: int = 0, fault: str = "ecc-dbe") -> None:
        st = emu.load(self.gpu_state)
        emu.apply_fault(st, gpu, fault)
        emu.save(self.gpu_state, st)

    def clear(self, gpu: int = 0) -> None:
        st = emu.load(self.gpu_state)
        emu.clear(st, gpu)
        emu.save(self.gpu_state, st)

    def critical(self, timeout: float = 10) -> pb.Verdict:
        return self.d.wait_for(lambda v: v.severity == pb.SEVERITY_CRITICAL, timeout)

    def ok(self, timeout: float = 10) -> pb.Verdict:
        return self.d.wait_for(lambda v: v.severity == pb.SEVERITY_OK, timeout)

    def robustctl_slurm(self, verb: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "slurm", verb, "--config",
                               str(self.d.config_path), *extra], capture_output=True, text=True, timeout=60,
                              env=self.cluster.env, cwd=REPO, stdin=subprocess.DEVNULL)

    def saved(self) -> dict[str, Any]:
        return dict(json.loads(self.state_file.read_text()))

    def stop(self) -> None:
        self.agent.stop()
        self.d.stop()


@pytest.fixture
def make_node(make_daemon: Any, slurm: SlurmCluster, emulator: str) -> Iterator[Any]:
    made: list[Node] = []

    def factory(**kw: Any) -> Node:
        n = Node(make_daemon, slurm, emulator, **kw)
        made.append(n)
        return n

    yield factory
    for n in made:
        n.agent.stop()


def drained(c: SlurmCluster) -> bool:
    state, reason = c.state()
    return state.startswith(("drain", "down")) and reason.startswith("robustd:")


def wait_drained(c: SlurmCluster, node: Node, timeout: float = 10) -> tuple[str, str]:
    ok = c.wait_for(lambda: drained(c), timeout, "drained by robustd", fail=False)
    assert ok, f"sinfo: {c.state()}\nagent log:\n{node.agent.log()[-3000:]}\n{c.logs()[-2000:]}"
    return c.state()


def wait_idle(c: SlurmCluster, node: Node, timeout: float = 15) -> None:
    ok = c.wait_for(lambda: c.state()[0] == "idle", timeout, "idle", fail=False)
    assert ok, f"sinfo: {c.state()}\nagent log:\n{node.agent.log()[-3000:]}"


def stays(c: SlurmCluster, expected: tuple[str, str], seconds: float) -> None:
    """sinfo shows exactly `expected` (state, reason) the whole time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert c.state() == expected, f"{c.state()} != {expected}"
        time.sleep(0.1)


# --- the tests the issue lists ---------------------------------------------------------------------


def test_xid79_drains_within_a_second_job_waits_and_runs_after_ack(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(kernel=True, slurm={"resume_after": "2s"})
    n.agent.start()
    n.agent.wait_connected()
    bus = f"{os.getpid() % 0xd0 + 0x20:02x}"
    sent = time.monotonic()
    inject_kmsg(f"NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1, name=python, GPU has fallen off the bus.")
    state, reason = wait_drained(slurm, n, timeout=5)
    took = time.monotonic() - sent
    print(f"kmsg Xid 79 -> sinfo drained: {took * 1000:.0f} ms")
    assert took < 2.0  # the benchmark's p99 is the precise figure; this bounds it on a loaded machine
    assert state in ("drained", "draining")
    assert reason.startswith("robustd: XID_79 on gpu/0000:" + bus + ":00.0 (action REBOOT, seq "), reason

    job = slurm.submit(f"touch {slurm.root}/jobs/ran-{bus}")
    time.sleep(3)
    assert slurm.job_state(job) == "PENDING"
    assert not (slurm.root / "jobs" / f"ran-{bus}").exists()

    acked = time.monotonic()  # before the call: the agent may see the ack before robustctl's process has exited
    r = n.d.robustctl("ack", f"gpu/0000:{bus}:00.0", "XID_79", "--reason", "reseated")
    assert r.returncode == 0, r.stderr
    wait_idle(slurm, n, timeout=15)
    assert time.monotonic() - acked >= 2.0  # resume_after
    ran = slurm.wait_for(lambda: (slurm.root / "jobs" / f"ran-{bus}").exists(), 20, "the job ran", fail=False)
    assert ran, f"{slurm.state()} {slurm.jobs()} {slurm.job_state(job)}\n{n.agent.log()}"
    assert "resumed" in n.agent.log()


def test_operator_drain_is_never_resumed_or_rereasoned(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"resume_after": "0s", "reconcile_interval": "500ms"})
    n.agent.start()
    n.agent.wait_connected()
    slurm.sh("scontrol", "update", f"NodeName={slurm.node}", "State=DRAIN", "Reason=ops: replacing a fan")
    held = ("drained", "ops: replacing a fan")
    set_at = slurm.reason_set_at()
    stays(slurm, held, 2.0)  # verdict OK and resume_after 0s: still the operator's

    n.fault()
    n.critical()
    stays(slurm, held, 2.0)  # a CRITICAL verdict does not rewrite another reason
    n.clear()
    n.ok()
    stays(slurm, held, 2.0)
    assert slurm.reason_set_at() == set_at
    assert slurm.reasons_logged() == []  # robustd never wrote a reason

    slurm.sh("scontrol", "update", f"NodeName={slurm.node}", "State=RESUME")  # the operator's drain, cleared by hand
    wait_idle(slurm, n)
    stays(slurm, ("idle", ""), 2.0)  # not redone
    assert slurm.reasons_logged() == []


def test_operator_resume_of_robustds_drain_is_respected_until_a_new_fault(make_node: Any,
                                                                         slurm: SlurmCluster) -> None:
    n = make_node(slurm={"reconcile_interval": "500ms"})
    n.agent.start()
    n.agent.wait_connected()
    n.fault(0)
    wait_drained(slurm, n)
    slurm.sh("scontrol", "update", f"NodeName={slurm.node}", "State=RESUME")  # while GPU_ECC_DBE stands
    wait_idle(slurm, n)
    stays(slurm, ("idle", ""), 2.5)
    assert "resumed by someone else while GPU_ECC_DBE" in n.agent.log()
    r = n.robustctl_slurm("status")
    assert "left alone until a new fault event" in r.stdout, r.stdout

    n.fault(1)  # a new fault event
    state, reason = wait_drained(slurm, n)
    assert "GPU_ECC_DBE" in reason and len(slurm.reasons_logged()) == 2


def test_flapping_node_stays_drained(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"max_resumes": 2, "resume_after": "300ms"})
    n.agent.start()
    n.agent.wait_connected()
    for _ in range(2):
        n.fault()
        state, reason = wait_drained(slurm, n)
        assert "flapping" not in reason
        n.clear()
        wait_idle(slurm, n)
    n.fault()  # the third drain in 24 h: past max_resumes resumes
    state, reason = wait_drained(slurm, n)
    assert reason.startswith("robustd: flapping: 2 resumes in 24h"), reason
    n.clear()
    n.ok()
    stays(slurm, (state, reason), 2.0)  # the fault is gone, the node stays out
    r = n.robustctl_slurm("status")
    assert r.returncode == 1 and "flapping" in r.stdout, r.stdout + r.stderr


def test_circuit_breaker_suppresses_and_warns(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"max_drained_fraction": 0, "min_drains": 0})
    n.agent.start()
    n.agent.wait_connected()
    n.fault()
    n.critical()
    slurm.wait_for(lambda: "SLURM_DRAIN_SUPPRESSED" in n.agent.log(), 10, "the warning in the agent's log")
    stays(slurm, ("idle", ""), 1.5)
    assert "partition test already has 0 of 1 nodes drained by robustd (allowance 0)" in n.agent.log()
    r = n.robustctl_slurm("status")
    assert r.returncode == 1 and "WARNING SLURM_DRAIN_SUPPRESSED" in r.stdout, r.stdout + r.stderr
    r = n.robustctl_slurm("status", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["warning"]["code"] == "SLURM_DRAIN_SUPPRESSED"
    n.clear()
    n.ok()
    slurm.wait_for(lambda: n.robustctl_slurm("status").returncode == 0, 10, "the warning cleared with the fault")


def test_circuit_breaker_defaults_drain_a_one_node_partition(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={})  # min_drains 1, max_drained_fraction 0.1: one node of one may go
    n.agent.start()
    n.agent.wait_connected()
    n.fault()
    state, reason = wait_drained(slurm, n)
    assert reason.startswith("robustd: GPU_ECC_DBE on gpu/") and "SLURM_DRAIN_SUPPRESSED" not in n.agent.log()


def test_circuit_breaker_counts_robustds_other_drains_in_the_partition(make_daemon: Any, cluster: SlurmCluster,
                                                                      emulator: str) -> None:
    """This node and nine others share the partition `big`: with one of them drained by robustd, the defaults'
    allowance (max(1, 10 x 0.1) = 1) is used up, so this node stays in service until that drain ends."""
    big = SlurmCluster(fakes=9)  # a second private cluster, alongside the module's
    try:
        big.start()
        n = Node(make_daemon, big, emulator, slurm={"reconcile_interval": "1s"})
        big.sh("scontrol", "update", "NodeName=fake03", "State=DRAIN", "Reason=robustd: XID_79 on gpu/0000:3b:00.0")
        n.agent.start()
        n.agent.wait_connected()
        n.fault()
        n.critical()
        big.wait_for(lambda: "SLURM_DRAIN_SUPPRESSED" in n.agent.log(), 10, "the warning")
        assert "partition big already has 1 of 10 nodes drained by robustd (allowance 1)" in n.agent.log()
        stays(big, ("idle", ""), 1.5)
        big.sh("scontrol", "update", "NodeName=fake03", "State=DRAIN", "Reason=ops: gone for repair")
        state, reason = wait_drained(big, n, timeout=10)  # the next reconcile finds the allowance free
        assert reason.startswith("robustd: GPU_ECC_DBE on gpu/" + BUS)
        assert "SLURM_DRAIN_SUPPRESSED cleared" in n.agent.log()
        n.agent.stop()
    finally:
        big.stop()
        shutil.rmtree(big.root, ignore_errors=True)


def test_agent_killed_mid_stream_misses_nothing_and_repeats_nothing(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"reconcile_interval": "1s"})
    n.agent.start()
    n.agent.wait_connected()
    n.agent.kill()
    n.fault(0)  # while the agent is down
    n.critical()
    n.agent.start()
    wait_drained(slurm, n)  # not missed
    set_at = slurm.reason_set_at()
    assert len(slurm.reasons_logged()) == 1
    for gpu in (1, 0):  # more events, and a kill in the middle of them
        n.fault(gpu, "lost")
        time.sleep(0.15)
        n.agent.kill()
        n.agent.start()
        n.agent.wait_connected()
    n.d.restart()  # and the daemon too: the agent resumes from its seq over a new connection
    n.agent.wait_connected(connects=2)
    time.sleep(2.5)  # two reconciles
    assert slurm.reasons_logged() == [slurm.state()[1]] and slurm.reason_set_at() == set_at  # one drain, once
    saved = n.saved()
    head = n.d.verdict().seq
    slurm.wait_for(lambda: n.saved()["watch"]["seq"] == head, 5, "the agent's position at robustd's head")
    assert saved["drain"]["reason"] == slurm.state()[1]
    log = n.agent.log()
    assert "resuming after seq" in log and log.count(f"drained {slurm.node}:") == 1


def test_a_drain_whose_fault_cleared_while_the_agent_was_down_is_resumed_after_the_hold_down(
        make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"resume_after": "3s"})
    n.agent.start()
    n.agent.wait_connected()
    n.fault()
    wait_drained(slurm, n)
    n.agent.kill()
    n.clear()
    n.ok()
    n.agent.start()
    started = time.monotonic()
    wait_idle(slurm, n, timeout=20)
    assert time.monotonic() - started >= 3.0  # the hold-down, counted from when the agent saw the good verdict


def test_a_reset_event_log_means_a_new_snapshot(make_node: Any, slurm: SlurmCluster) -> None:
    """robustd's state was wiped (its seqs start again below ours): the agent takes a snapshot instead of waiting."""
    n = make_node()
    n.state_file.parent.mkdir(parents=True, exist_ok=True)
    n.state_file.write_text(json.dumps({"version": 1, "node": slurm.node,
                                        "watch": {"seq": 999_999, "boot_id": "old", "conditions": []}}))
    n.agent.start()
    n.agent.wait_connected()
    assert "its event log was reset; new snapshot" in n.agent.log()
    n.fault()
    wait_drained(slurm, n)


def test_drain_redone_after_slurmctld_comes_back(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"reconcile_interval": "1s"})
    n.agent.start()
    n.agent.wait_connected()
    slurm.stop_ctld()
    try:
        n.fault()
        n.critical()
        slurm.wait_for(lambda: "will try again" in n.agent.log(), 15, "the agent failing to reach slurmctld")
        agent = psutil.Process(n.agent.proc.pid)
        cpu = sum(agent.cpu_times()[:2])
        time.sleep(3)
        assert sum(agent.cpu_times()[:2]) - cpu < 1.0  # retrying with a backoff, not spinning
    finally:
        slurm.start_ctld()
    state, reason = wait_drained(slurm, n, timeout=20)
    assert reason.startswith("robustd: GPU_ECC_DBE on gpu/" + BUS)


def test_healthcheck_program_run_by_slurmd(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"resume_after": "0s"})  # no agent: slurmd's HealthCheckProgram alone
    slurm.enable_hook("healthcheck", n.d.config_path)
    slurm.wait_for(lambda: len(slurm.hook_exits("healthcheck")) >= 1, 15, "slurmd running the health check")
    assert slurm.state() == ("idle", "")
    n.fault()
    n.critical()
    state, reason = wait_drained(slurm, n, timeout=15)
    assert reason.startswith("robustd: GPU_ECC_DBE on gpu/" + BUS)
    n.clear()
    n.ok()
    wait_idle(slurm, n, timeout=15)  # and resumed by it, once the verdict is OK (resume_after 0s)

    n.d.stop()  # robustd down: the health check changes nothing and exits 0
    runs = len(slurm.hook_exits("healthcheck"))
    slurm.wait_for(lambda: len(slurm.hook_exits("healthcheck")) >= runs + 2, 15, "two more health checks")
    assert slurm.state() == ("idle", "")
    assert set(slurm.hook_exits("healthcheck")) == {0}
    assert "changing nothing" in slurm.hook_log("healthcheck")


def test_prolog_refuses_a_job_on_a_critical_node(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node()  # no agent: the prolog alone
    slurm.enable_hook("prolog", n.d.config_path)
    ok_job = slurm.submit(f"touch {slurm.root}/jobs/ok-job")
    slurm.wait_for(lambda: (slurm.root / "jobs" / "ok-job").exists(), 20, "a job on a healthy node")
    assert slurm.hook_exits("prolog") == [0] and ok_job

    n.fault()
    n.critical()
    job = slurm.submit(f"touch {slurm.root}/jobs/bad-job")
    slurm.wait_for(lambda: 1 in slurm.hook_exits("prolog"), 20, "the prolog refusing")
    slurm.wait_for(lambda: any(j[0] == job and "held" in j[2].lower() for j in slurm.jobs()), 20,
                   "the job requeued, held")
    assert not (slurm.root / "jobs" / "bad-job").exists()
    state, reason = wait_drained(slurm, n)
    assert reason.startswith("robustd: GPU_ECC_DBE on gpu/" + BUS), reason  # robustd's reason: robustd may resume it


def test_epilog_diagnoses_a_failed_job_and_drains_on_fail(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"epilog_diagnostics": "quick", "epilog_timeout": "60s"}, env={"FAKE_DCGMI_MODE": "fail4"})
    slurm.enable_hook("epilog", n.d.config_path)
    slurm.submit("true")
    slurm.wait_for(lambda: len(slurm.hook_exits("epilog")) >= 1, 20, "the epilog of a good job")
    assert n.d.robustctl("diag", "list").stdout.strip() == "no diagnostics"  # a job that succeeded: nothing run
    assert slurm.state() == ("idle", "")

    job = slurm.submit("exit 3")
    slurm.wait_for(lambda: len(slurm.hook_exits("epilog")) >= 2, 30, "the epilog of a failed job")
    assert slurm.hook_exits("epilog") == [0, 0]
    state, reason = wait_drained(slurm, n)
    listed = n.d.robustctl("--json", "diag", "list")
    report = json.loads(listed.stdout)["reports"][0]
    assert report["outcome"] == "OUTCOME_FAIL"
    assert reason.startswith(f"robustd: diagnostic {report['id']} FAIL after job {job}: eud failed on gpu/index2"), \
        reason


# --- triage in the epilog (issue 14): a user's bug never costs the node a test; an NCCL failure does -----

TRAIN_KEYERROR = """\
import sys


def collate(batch, key):
    return [sample[key] for sample in batch]


print("step 1200 | loss 2.3141 | lr 3.0e-04", flush=True)
batch = [{"input_ids": [101, 2023, 102], "attention_mask": [1, 1, 1]}]
labels = collate(batch, "labels")
"""

# What a torch job prints when an InfiniBand completion fails under NCCL (NCCL_DEBUG=WARN, torch 1.13's
# message): the WARN line from the transport, then the Python exception carrying ncclSystemError.
TRAIN_NCCL = """\
import os
import sys

host, pid = os.uname().nodename, os.getpid()
print(f"{host}:{pid}:{pid + 61} [3] NCCL INFO Channel 00/0 : 3[3] -> 11[3] [send] via NET/IB/0", flush=True)
print(f"{host}:{pid}:{pid + 61} [3] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
      "10.0.0.2<42174> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 "
      "remoteGid ::ffff:10.0.0.2", file=sys.stderr, flush=True)
print(f"{host}:{pid}:{pid + 61} [3] NCCL INFO include/net.h:32 -> 6", file=sys.stderr, flush=True)
raise RuntimeError("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system "
                   "error, NCCL version 2.14.3\\nncclSystemError: System call (e.g. socket, malloc) or external "
                   "library call failed or device error. \\nLast error:\\nNET/IB : Got completion from peer "
                   "10.0.0.2<42174> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 "
                   "remoteGid ::ffff:10.0.0.2")
"""


def run_job(slurm: SlurmCluster, name: str, program: str) -> tuple[str, Path]:
    """A job running `program` with this Python, its output (stdout and stderr) in jobs/<name>-<id>.out."""
    script = slurm.root / "jobs" / f"{name}.py"
    script.write_text(program)
    job = slurm.submit(f"{sys.executable} {script}", output=slurm.root / "jobs" / f"{name}-%j.out")
    return job, slurm.root / "jobs" / f"{name}-{job}.out"


def test_epilog_triage_user_code_runs_no_diagnostics_and_keeps_the_node(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"epilog_diagnostics": "quick", "epilog_timeout": "60s"}, env={"FAKE_DCGMI_MODE": "fail4"})
    slurm.enable_hook("epilog", n.d.config_path)
    job, out = run_job(slurm, "keyerror", TRAIN_KEYERROR)
    slurm.wait_for(lambda: len(slurm.hook_exits("epilog")) >= 1, 30, "the epilog of the failed job")
    assert slurm.hook_exits("epilog") == [0]
    assert "KeyError: 'labels'" in out.read_text()  # a real traceback, in the job's own output file
    epilog = slurm.hook_log("epilog")
    assert f"job {job} triage" in epilog and "user_code" in epilog, epilog
    assert "not diagnosing" in epilog, epilog
    assert n.d.robustctl("diag", "list").stdout.strip() == "no diagnostics"
    stays(slurm, ("idle", ""), 1.0)


def test_epilog_triage_nccl_failure_diagnoses_and_drains_with_the_class(make_node: Any,
                                                                        slurm: SlurmCluster) -> None:
    n = make_node(slurm={"epilog_diagnostics": "quick", "epilog_timeout": "60s"}, env={"FAKE_DCGMI_MODE": "fail4"})
    slurm.enable_hook("epilog", n.d.config_path)
    job, out = run_job(slurm, "nccl", TRAIN_NCCL)
    slurm.wait_for(lambda: len(slurm.hook_exits("epilog")) >= 1, 30, "the epilog of the failed job")
    assert slurm.hook_exits("epilog") == [0]
    assert "ncclSystemError" in out.read_text()
    epilog = slurm.hook_log("epilog")
    assert f"job {job} triage" in epilog and "nccl" in epilog, epilog
    state, reason = wait_drained(slurm, n)
    report = json.loads(n.d.robustctl("--json", "diag", "list").stdout)["reports"][0]
    assert report["outcome"] == "OUTCOME_FAIL"
    assert reason.startswith(f"robustd: diagnostic {report['id']} FAIL after job {job}: eud failed on gpu/index2"), \
        reason
    assert "triage nccl" in reason, reason


# --- beyond the list: reboot with a self-check, and on_critical: down ----------------------------------


def test_reboot_then_self_check_pass_resumes_fail_holds(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"reboot_on": ["REBOOT"], "resume_check": "selfcheck", "resume_after": "0s"},
                  env={"FAKE_DCGMI_MODE": "pass4"})
    n.agent.start()
    n.agent.wait_connected()
    n.fault(0, "lost")  # GPU_LOST: CRITICAL, REBOOT, sticky
    slurm.wait_for(lambda: slurm.reboot_requests() >= 1, 20, "slurmd running RebootProgram")
    state, reason = slurm.state()
    assert reason.startswith("robustd: reboot for GPU_LOST on gpu/" + BUS), reason
    assert "REBOOT_ISSUED" in slurm.node_info() or "REBOOT_REQUESTED" in slurm.node_info()

    def reboot(mode: str) -> None:
        n.d.stop()
        n.clear(0)
        n.d.reboot()  # a new boot id: the sticky GPU_LOST is gone
        n.d.env["FAKE_DCGMI_MODE"] = mode
        slurm.rebooted()
        slurm.wait_for(lambda: slurm.state()[0] == "down", 20, "slurmctld: reboot complete, nextstate DOWN")
        n.d.start()

    reboot("pass4")
    wait_idle(slurm, n, timeout=30)  # self-check PASS, then resumed
    assert "self-check" in n.agent.log() and n.saved()["self_check"]["outcome"] == "PASS"

    n.fault(0, "lost")
    slurm.wait_for(lambda: slurm.reboot_requests() >= 2, 20, "the second reboot")
    reboot("fail4")
    slurm.wait_for(lambda: "self-check FAIL" in slurm.state()[1], 30, "the self-check FAIL in the reason")
    # the agent records the outcome in its state file just after the reason (under its lock): wait for it
    slurm.wait_for(lambda: (n.saved().get("self_check") or {}).get("outcome") == "FAIL", 10,
                   "the self-check FAIL in the agent's state file")
    sc = n.saved()["self_check"]
    assert sc["outcome"] == "FAIL" and sc["report_id"] in slurm.state()[1]
    stays(slurm, slurm.state(), 2.0)  # held: never resumed by robustd


def test_on_critical_down_kills_the_job_and_resumes(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"on_critical": "down", "resume_after": "0s"})
    n.agent.start()
    n.agent.wait_connected()
    job = slurm.submit("sleep 300")
    slurm.wait_for(lambda: slurm.job_state(job) == "RUNNING", 20, "the job running")
    n.fault()
    slurm.wait_for(lambda: slurm.state()[0].startswith("down"), 10, "down")
    assert slurm.state()[1].startswith("robustd: GPU_ECC_DBE")
    slurm.wait_for(lambda: slurm.job_state(job) != "RUNNING", 15, "the job no longer running")
    n.clear()
    wait_idle(slurm, n, timeout=20)


def test_a_drain_reason_carries_its_evidence_bundle_id(make_node: Any, slurm: SlurmCluster) -> None:
    """Issue 31: `sinfo -R` leads to the evidence: the reason ends in ` ev=<id>`, and that bundle is robustd's."""
    n = make_node()
    n.agent.start()
    n.agent.wait_connected()
    n.fault(0, "ecc-dbe")
    _, reason = wait_drained(slurm, n)
    m = re.search(r" ev=(ev-\S+)$", reason)
    assert m and reason.startswith("robustd: GPU_ECC_DBE on gpu/"), reason
    shown = n.d.robustctl("evidence", "show", m.group(1))
    assert shown.returncode == 0, shown.stderr
    bundle = json.loads(shown.stdout)
    assert bundle["id"] == m.group(1) and bundle["reason"] == reason.removesuffix(m.group(0))
    assert any(c["code"] == "GPU_ECC_DBE" for c in bundle["verdict"]["conditions"])


# --- shadow mode (issue 31): the same decisions as act, written nowhere but the log and the state file -------

DECISION = (r"(?:(drained|downed|reboot requested for|resumed)|would (drain|down|reboot|resume)) ({node})"
            r"(?::| \(was|$)(.*)$")
ACT_KIND = {"drained": "drain", "downed": "down", "reboot requested for": "reboot", "resumed": "resume"}


def decisions(log: str, node: str) -> list[tuple[str, str, str]]:
    """(kind, node, reason with its seq and evidence id left out) of each drain/resume of `node` the agent
    carried out or would have."""
    out = []
    pattern = re.compile(DECISION.format(node=re.escape(node)))
    for line in log.splitlines():
        m = pattern.search(line)
        if m is None:
            continue
        kind = ACT_KIND[m[1]] if m[1] else m[2]
        # The seq, and the evidence bundle act makes for its drain (shadow writes no reason: it makes none).
        reason = re.sub(r" ev=\S+$", "", re.sub(r", seq \d+\)", ")", m[4].strip())) if kind != "resume" else ""
        out.append((kind, m[3], reason))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def in_service(c: SlurmCluster) -> bool:
    """sinfo: idle with no reason (a trailing * is slurmctld not having heard from slurmd lately, on a busy host)."""
    state, reason = c.state()
    return state.rstrip("*") == "idle" and reason == ""


def test_shadow_mode_decides_as_act_and_never_changes_slurm(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"resume_after": "1s", "reconcile_interval": "1s"})
    port = free_port()
    shadow = merge(n.d.config, {"slurm": {"mode": "shadow", "state_file": str(n.d.root / "shadow.json"),
                                          "metrics_address": f"127.0.0.1:{port}"}})
    shadow_cfg = n.d.root / "shadow.yaml"
    shadow_cfg.write_text(yaml.safe_dump(shadow, sort_keys=False))

    def run(agent: AgentProcess, wait: Any) -> list[tuple[str, str, str]]:
        agent.start()
        agent.wait_connected()
        n.fault()
        wait(lambda: len(decisions(agent.log(), slurm.node)) >= 1, "the drain")
        n.clear()
        n.ok()
        wait(lambda: len(decisions(agent.log(), slurm.node)) >= 2, "the resume")
        assert agent.stop() == 0
        return decisions(agent.log(), slurm.node)

    def act_wait(predicate: Any, what: str) -> None:
        slurm.wait_for(predicate, 15, what)

    act = run(n.agent, act_wait)
    assert in_service(slurm) and len(slurm.reasons_logged()) == 1

    slurm.log_mark = slurm._log_size()  # from here on: no reason set, and sinfo unchanged at every look
    set_at = slurm.reason_set_at()

    def shadow_wait(predicate: Any, what: str) -> None:
        def check() -> bool:
            assert in_service(slurm), f"{slurm.state()}\n{agent.log()}"
            return bool(predicate())
        slurm.wait_for(check, 15, what)

    agent = AgentProcess(shadow_cfg, slurm, n.d.root / "shadow.log")
    started = time.monotonic()
    shadowed = run(agent, shadow_wait)
    assert shadowed == act, agent.log()
    assert [k for k, _, _ in act] == ["drain", "resume"] and act[0][2].startswith("robustd: GPU_ECC_DBE on gpu/")
    assert f"would drain {slurm.node}: robustd: GPU_ECC_DBE on gpu/{BUS}" in agent.log()
    assert time.monotonic() - started >= 1.0  # the hold-down held the would-resume back, as in act
    assert slurm.reasons_logged() == [] and slurm.reason_set_at() == set_at and in_service(slurm)

    saved = json.loads((n.d.root / "shadow.json").read_text())
    assert saved["shadow"]["counts"] == {"drain": 1, "resume": 1} and saved["drain"] is None
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "slurm", "status", "--config",
                        str(shadow_cfg)], capture_output=True, text=True, timeout=60, env=slurm.env, cwd=REPO)
    assert "mode: shadow" in r.stdout and "shadow decisions (would, not carried out): drain 1, resume 1" in r.stdout
    assert f"would drain {slurm.node}: robustd: GPU_ECC_DBE on gpu/{BUS}" in r.stdout
    assert f"would resume {slurm.node}" in r.stdout, r.stdout

    # Ownership in shadow too: an operator's drain is never drained over in shadow either, and never "would resume"d.
    agent.start()
    agent.wait_connected()
    metrics = scrape(port)  # the counts kept in the state file, after a restart
    assert 'robustd_slurm_shadow_decisions_total{kind="drain"} 1.0' in metrics, metrics
    assert 'robustd_slurm_shadow_decisions_total{kind="resume"} 1.0' in metrics
    assert 'robustd_slurm_shadow_decisions_total{kind="down"} 0.0' in metrics
    assert "robustd_slurm_mode 1.0" in metrics
    slurm.sh("scontrol", "update", f"NodeName={slurm.node}", "State=DRAIN", "Reason=ops: replacing a fan")
    n.fault()
    n.critical()
    time.sleep(1.5)  # a reconcile
    n.clear()
    n.ok()
    time.sleep(1.5)
    assert agent.stop() == 0
    assert decisions(agent.log(), slurm.node) == act, agent.log()
    assert slurm.state() == ("drained", "ops: replacing a fan")


# --- no action on stale news (issue 31) ---------------------------------------------------------------------


def test_no_drain_on_news_that_went_stale_while_the_agent_was_down(make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"reconcile_interval": "1s"})
    n.agent.start()
    n.agent.wait_connected()
    assert n.agent.stop() == 0

    # A fault raised and cleared while the agent was down: its replay (RAISED, then CLEARED) drains nothing.
    n.fault()
    n.critical()
    n.clear()
    n.ok()
    n.agent.start()
    n.agent.wait_connected()
    time.sleep(1.5)  # a reconcile
    assert in_service(slurm) and slurm.reasons_logged() == [], n.agent.log()
    assert n.agent.stop() == 0

    # A resumed Watch across an old fault: slurm.max_event_age 1s stands for the default 10m and the hour.
    stale_cfg = n.d.root / "stale.yaml"
    stale_cfg.write_text(yaml.safe_dump(merge(n.d.config, {"slurm": {"max_event_age": "1s"}}), sort_keys=False))
    agent = AgentProcess(stale_cfg, slurm, n.d.root / "stale.log")
    n.fault()
    n.critical()
    time.sleep(1.5)
    agent.start()
    agent.wait_connected()
    slurm.wait_for(lambda: "stale event seq" in agent.log(), 10, "the stale event logged")
    time.sleep(1.5)  # a reconcile
    assert in_service(slurm) and slurm.reasons_logged() == [], agent.log()
    assert "more than slurm.max_event_age 1s: no drain for it" in agent.log()
    assert agent.stop() == 0
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "slurm", "status", "--config", str(stale_cfg)],
                       capture_output=True, text=True, timeout=60, env=slurm.env, cwd=REPO)
    assert "stale events read (older than slurm.max_event_age 1s, no drain for them): 1" in r.stdout, r.stdout

    agent.start()  # the stale mark is kept in the state file: the saved table's fault is not news after a restart
    agent.wait_connected()
    time.sleep(1.5)
    assert in_service(slurm) and slurm.reasons_logged() == [], agent.log()
    n.fault(1)  # fresh news drains
    state, reason = wait_drained(slurm, n)
    assert reason.startswith("robustd: GPU_ECC_DBE on gpu/"), reason
    agent.stop()


# --- reload (issue 31): SIGHUP re-reads the config; shadow -> act carries out only what comes after ----------


def test_reload_switches_shadow_to_act_without_acting_on_the_past_and_keeps_a_bad_config(
        make_node: Any, slurm: SlurmCluster) -> None:
    n = make_node(slurm={"reconcile_interval": "1s"})
    cfg = n.d.root / "agent.yaml"

    def write(slurm_keys: dict[str, Any]) -> None:
        cfg.write_text(yaml.safe_dump(merge(n.d.config, {"slurm": slurm_keys}), sort_keys=False))

    port = free_port()
    write({"mode": "shadow", "metrics_address": f"127.0.0.1:{port}"})
    agent = AgentProcess(cfg, slurm, n.d.root / "reload.log")
    agent.start()
    agent.wait_connected()
    n.fault()
    slurm.wait_for(lambda: f"would drain {slurm.node}:" in agent.log(), 10, "the would-drain")
    n.clear()
    n.ok()
    slurm.wait_for(lambda: f"would resume {slurm.node}" in agent.log(), 10, "the would-resume")

    write({"mode": "bogus", "metrics_address": f"127.0.0.1:{port}"})
    lines = cfg.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip() == "mode: bogus")
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGHUP)
    slurm.wait_for(lambda: "reload: invalid config, keeping the one in use" in agent.log(), 10, "the bad reload")
    assert f"{cfg}:{line}: slurm.mode: " in agent.log(), agent.log()
    n.fault(1)  # still shadow
    slurm.wait_for(lambda: agent.log().count(f"would drain {slurm.node}:") == 2, 10, "the second would-drain")
    n.clear(1)
    n.ok()
    slurm.wait_for(lambda: agent.log().count(f"would resume {slurm.node}") == 2, 10, "the second would-resume")
    assert in_service(slurm) and slurm.reasons_logged() == []

    assert "robustd_slurm_mode 1.0" in scrape(port)
    write({"mode": "act", "metrics_address": f"127.0.0.1:{port}"})
    agent.proc.send_signal(signal.SIGHUP)
    slurm.wait_for(lambda: "slurm.mode act (was shadow)" in agent.log(), 10, "the switch to act")
    metrics = scrape(port)
    assert "robustd_slurm_mode 0.0" in metrics and 'shadow_decisions_total{kind="drain"} 2.0' in metrics, metrics
    time.sleep(1.5)  # a reconcile under act: nothing of the past is carried out
    assert in_service(slurm) and slurm.reasons_logged() == [], agent.log()
    n.fault()  # decided after the switch: carried out
    state, reason = wait_drained(slurm, n)
    assert reason.startswith(f"robustd: GPU_ECC_DBE on gpu/{BUS}"), reason
    assert agent.stop() == 0 and "Traceback" not in agent.log()
