"""The controller hooks of issue 29 on a real multi-node Slurm (tests/fixtures/slurm/multi.py): each node's
slurmd and robustd in its own network namespace, the robustd listening on the namespace's address with mutual
TLS, slurmctld and its EpilogSlurmctld/PrologSlurmctld (`robustctl slurm epilog-ctld | prolog-ctld`) in the
root one; the node Epilog (`robustctl slurm epilog`, `slurm.ctld.epilog: true`) on every node; a slow link is
a real token bucket (tc tbf) on the node's veth. The jobs run on three nodes (n1-n3, the first idle ones); a
fourth is where the preflight's requeued job goes.

One cluster per module (it comes up in about 1.5 s here), reset between tests. The first tests are about the
harness itself (Slurm sees the nodes at their own addresses, the EpilogSlurmctld wrapper gets the job's
environment, the controller's certificate reaches every robustd); the rest are the issue's: what Slurm shows
after a failed multi-node job (`scontrol show node`: the culprit drained with the diagnosis's reason, the
others idle and taking the next job), and the hook's own log.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Iterator

import pytest
from conftest import IN_CI, REPO, need_root

sys.path.insert(0, str(REPO / "tests" / "fixtures" / "slurm"))
from cluster import missing_programs  # noqa: E402
from multi import MultiCluster  # noqa: E402

from robustd.adapters.common.watch import load_settings  # noqa: E402
from robustd.adapters.slurm.config import SCHEMA  # noqa: E402

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def cluster() -> Iterator[MultiCluster]:
    need_root("network namespaces, munged, slurmctld and slurmd")
    missing = missing_programs() + [p for p in ("nsenter", "openssl", "tc") if shutil.which(p) is None]
    if missing:
        (pytest.fail if IN_CI else pytest.skip)(f"not installed: {', '.join(missing)} (`make deps` installs "
                                                "slurmctld, slurmd, slurm-client and munge)")
    c = MultiCluster(4)  # jobs run on three; the fourth is where a preflight's requeued job goes
    # The node epilogs leave multi-node jobs to the controller, and triage the per-rank logs a job writes under
    # joblogs/<job>/ (the controller's config does not name them: where it cannot read the job's output, the
    # node epilogs' verdicts are what it has).
    c.node_config = {"slurm": {"ctld": {"epilog": True}, "triage_logs": [str(c.root / "joblogs" / "%j" / "*.log")]}}
    c.start()  # stops everything again itself if it fails
    print(f"3-node cluster up in {c.startup_seconds:.2f} s")
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)


@pytest.fixture
def slurm(cluster: MultiCluster) -> MultiCluster:
    cluster.reset()
    return cluster


def test_three_nodes_at_their_addresses_and_a_failed_job_calls_epilog_slurmctld_once(slurm: MultiCluster) -> None:
    assert slurm.states() == {n: ("idle", "") for n in ("n1", "n2", "n3", "n4")}
    for node in slurm.nodes:
        assert slurm.node_field(node, "NodeAddr") == slurm.addr(node), slurm.node_info(node)
        assert slurm.addr(node) != slurm.addr("n1") or node == "n1"
    job = slurm.submit("hostname; exit 1", nodes=3)  # the first three idle nodes: n1-n3
    # The job is COMPLETING while EpilogSlurmctld runs, and FAILED only once it has returned.
    assert slurm.wait_job(job) == "FAILED", slurm.logs()
    info = slurm.job(job)
    assert (info["NodeList"], info["ExitCode"]) == ("n[1-3]", "1:0")
    assert slurm.job_nodes(job) == ["n1", "n2", "n3"]
    assert slurm.job_output(job).strip()  # the batch step ran on n1 and wrote to the shared directory
    calls = slurm.hook_calls("epilog-ctld")
    assert len(calls) == 1, calls
    env = calls[0]
    print("EpilogSlurmctld's environment on Slurm 22.05:", env)
    assert env["SLURM_JOB_ID"] == job and env["SLURM_JOB_NODELIST"] == "n[1-3]"
    assert env["SLURM_JOB_EXIT_CODE"] == "256" and env["SLURM_JOB_EXIT_CODE2"] == "1:0"  # a wait status, code:signal
    assert env["SLURM_SCRIPT_CONTEXT"] == "epilog_slurmctld"
    assert slurm.hook_exits("epilog-ctld") == []  # not enabled: it only recorded the call
    assert [c["SLURM_JOB_ID"] for c in slurm.hook_calls("prolog-ctld")] == [job]
    # slurmd's Epilog ran on every node of the job (PrologFlags=Alloc: the Prolog too)
    for hook in ("prolog", "epilog"):
        assert sorted(c["SLURMD_NODENAME"] for c in slurm.hook_calls(hook)) == ["n1", "n2", "n3"], hook


def test_an_enabled_ctld_hook_runs_the_checkout_with_scontrol_and_its_exit_code_is_kept(slurm: MultiCluster) -> None:
    probe = ("import os, subprocess, robustd; print(robustd.__file__); "
             "print(subprocess.run(['scontrol', 'show', 'hostnames', os.environ['SLURM_JOB_NODELIST']], "
             "capture_output=True, text=True, check=True).stdout.split()); raise SystemExit(3)")
    slurm.enable_ctld_hook("epilog-ctld", [sys.executable, "-c", probe])
    job = slurm.submit("exit 2", nodes=2)
    assert slurm.wait_job(job) == "FAILED"
    assert slurm.job(job)["NodeList"] == "n[1-2]"
    assert slurm.hook_exits("epilog-ctld") == [3]
    log = slurm.hook_log("epilog-ctld").splitlines()
    assert log == [str(REPO / "robustd" / "__init__.py"), "['n1', 'n2']"], log
    assert slurm.states() == {n: ("idle", "") for n in slurm.nodes}


def test_the_controller_certificate_reaches_every_robustd_and_another_may_only_read(slurm: MultiCluster) -> None:
    for node in slurm.nodes:
        r = slurm.remote(node, "status")
        assert r.returncode == 0 and f"node {node}: OK" in r.stdout, r.stdout + r.stderr
    # (The controller's certificate runs the whole diagnosis in the hook's tests below.) The same CA's
    # certificate for another identity may read, but not run the diagnosis.
    assert slurm.remote("n2", "status", client="operator").returncode == 0
    rc, doc, err = slurm.fleet_diagnose(*slurm.tls_args("operator"))
    assert rc == 4 and doc["outcome"] == "ERROR", f"{doc}\n{err}"
    # The config the harness writes for the controller hook is one robustctl accepts.
    ctld = load_settings(str(slurm.ctld_config()), SCHEMA).section("slurm").ctld
    assert (ctld.epilog, ctld.port, ctld.level, ctld.tls_cert) == (True, 7070, "net", slurm.tls()[1])


# --- the controller's hooks (issue 29) ----------------------------------------------------------------------

# What a 3-node training job prints when NCCL fails under it (the lines of tests/test_slurm.py's TRAIN_NCCL):
# triage says nccl, infra likely, next diagnose.
NCCL = ("node-17:2345:2406 [3] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<42174> "
        "with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 remoteGid ::ffff:10.0.0.2\n"
        "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system "
        "error, NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, malloc) or external library call "
        "failed or device error.\n")
KEYERROR = ("Traceback (most recent call last):\n  File \"/home/alice/proj/train.py\", line 187, in main\n"
            "    labels = collate(batch, \"labels\")\n  File \"/home/alice/proj/train.py\", line 42, in collate\n"
            "    return [sample[key] for sample in batch]\nKeyError: 'labels'\n")
DIAGNOSIS = 200  # s: a failed job's end to its hook's end (the 8 mbit node's pairs take ~25 s of it)


def failing_job(slurm: MultiCluster, text: str, before: str = "", nodes: int = 3, **kw: object) -> str:
    """A job that prints `text` (to its output, on the shared directory) and exits 1."""
    script = slurm.root / "jobs" / f"print-{time.monotonic_ns()}.txt"
    script.write_text(text)
    return slurm.submit(f"{before}cat {script} >&2; exit 1", nodes=nodes, **kw)  # type: ignore[arg-type]


def with_hooks(slurm: MultiCluster, **ctld: object) -> None:
    """robustd's EpilogSlurmctld with the harness's controller config (+ `ctld` keys), the nodes' Epilog."""
    slurm.enable_ctld_hook("epilog-ctld", slurm.ctld_command("epilog-ctld", slurm.ctld_config(**ctld)))
    slurm.enable_node_hook("epilog")


def released_idle(slurm: MultiCluster, nodes: list[str], log: str) -> None:
    """The released nodes are idle again. Slurm marks a node it was told to resume right after a job's end
    not responding (`idle*`) until its next ping, a few seconds: wait for that, and say how long it took."""
    t0 = time.monotonic()
    ok = slurm.wait_for(lambda: all(slurm.states()[n] == ("idle", "") for n in nodes), 60, "idle", fail=False,
                        interval=0.2)
    assert ok, f"{slurm.states()}\n{log}\n{slurm.logs(('slurmctld.log',), 4000)}"
    print(f"{', '.join(nodes)} idle {time.monotonic() - t0:.1f} s after the hook ended")


def diagnosed_runs(slurm: MultiCluster, node: str, job: str) -> list[str]:
    """The tests of node's diagnostic reports that the controller's diagnosis of `job` started."""
    doc = json.loads(slurm.remote(node, "--json", "diag", "list").stdout or "{}")
    return [",".join(r.get("tests", [])) for r in doc.get("reports", []) if r.get("run_id") == f"slurm-job-{job}"]


def test_a_failed_job_with_one_slow_node_drains_that_node_and_the_others_take_the_next_job(
        slurm: MultiCluster) -> None:
    with_hooks(slurm)
    slurm.slow("n2")
    job = failing_job(slurm, NCCL)
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED", slurm.logs()
    log = slurm.hook_log("epilog-ctld")
    assert slurm.hook_exits("epilog-ctld") == [0], log
    states = slurm.states()
    assert states["n2"][0].startswith("drain"), f"{states}\n{log}"
    assert states["n2"][1].startswith(f"robustd: job {job} diagnosis FAIL: "), states
    released_idle(slurm, ["n1", "n3"], log)
    assert "triage of 1 log(s) by n1: nccl, infra likely" in log, log
    for node in ("n1", "n2", "n3"):
        assert f"{node} held: robustd: diagnosing after job {job}" in log, log
    assert "n1 released: diagnosis FAIL, not a suspect" in log and "n2 drained: " in log, log
    # The node epilogs left the multi-node job to the controller: no node ran a test of its own.
    epilogs = slurm.hook_log("epilog")
    assert epilogs.count(f"job {job} failed on 3 nodes: the controller's EpilogSlurmctld diagnoses it") == 3, epilogs
    assert "running the" not in epilogs, epilogs
    # The culprit stays out; the two others run the next 2-node job.
    slurm.clear_faults()
    nxt = slurm.submit("hostname", nodes=2)
    assert slurm.wait_job(nxt, 60) == "COMPLETED", slurm.logs()
    assert len(slurm.job_nodes(nxt)) == 2 and "n2" not in slurm.job_nodes(nxt), slurm.job(nxt)
    assert slurm.states()["n2"][1].startswith(f"robustd: job {job} diagnosis FAIL: ")


def test_the_same_failure_on_a_healthy_cluster_releases_every_node(slurm: MultiCluster) -> None:
    with_hooks(slurm)
    t0 = time.monotonic()
    job = failing_job(slurm, NCCL)
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED", slurm.logs()
    print(f"job {job}: end of job to every node released: {time.monotonic() - t0:.1f} s (job included)")
    log = slurm.hook_log("epilog-ctld")
    released_idle(slurm, slurm.nodes, log)
    assert f"diagnosis slurm-job-{job} PASS" in log, log
    assert all(f"{n} released: diagnosis PASS, not a suspect" in log for n in ("n1", "n2", "n3")), log
    assert all(diagnosed_runs(slurm, n, job) for n in ("n1", "n2", "n3")), [slurm.remote(n, "diag", "list").stdout
                                                                              for n in slurm.nodes]


def test_a_job_failing_with_a_user_bug_holds_and_drains_nothing(slurm: MultiCluster) -> None:
    with_hooks(slurm)
    job = failing_job(slurm, KEYERROR)
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED", slurm.logs()
    log = slurm.hook_log("epilog-ctld")
    assert f"job {job}: not diagnosing: triage (the job's output, judged by n1) says user_code" in log, log
    assert "held" not in log, log
    assert slurm.states() == {n: ("idle", "") for n in slurm.nodes}
    assert not any(diagnosed_runs(slurm, n, job) for n in slurm.nodes)
    # Slurm was told nothing
    assert f"after job {job}" not in (slurm.root / "slurmctld.log").read_text(errors="replace")


def test_an_operators_drain_during_the_job_is_kept_neither_held_nor_released(slurm: MultiCluster) -> None:
    with_hooks(slurm)
    job = failing_job(slurm, NCCL, before="sleep 3; ")
    slurm.wait_job(job, 30, states=("RUNNING",))
    slurm.drain("n3", "operator: cable")
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED", slurm.logs()
    log = slurm.hook_log("epilog-ctld")
    assert slurm.states()["n3"][1] == "operator: cable" and slurm.states()["n3"][0].startswith("drain"), log
    assert "n3 is held by someone else" in log and "n3 held" not in log and "n3 released" not in log, log
    released_idle(slurm, ["n1", "n2"], log)
    assert not diagnosed_runs(slurm, "n3", job)  # an operator's node is not tested either
    assert diagnosed_runs(slurm, "n1", job) and diagnosed_runs(slurm, "n2", job)


def test_a_node_whose_robustd_is_down_is_left_and_the_others_are_diagnosed_and_released(
        slurm: MultiCluster) -> None:
    with_hooks(slurm)
    slurm.stop_robustd("n3")
    job = failing_job(slurm, NCCL)
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED", slurm.logs()
    log = slurm.hook_log("epilog-ctld")
    assert "n3: its robustd did not answer" in log and "n3 held" not in log, log
    released_idle(slurm, slurm.nodes, log)
    assert diagnosed_runs(slurm, "n1", job) and diagnosed_runs(slurm, "n2", job)
    assert f"diagnosis slurm-job-{job} PASS" in log, log


def test_without_shared_output_the_node_epilogs_verdicts_decide(slurm: MultiCluster) -> None:
    """The controller cannot read the job's output (here: /dev/null); the per-rank log is where the nodes'
    slurm.triage_logs finds it, so each node epilog triages it and leaves the verdict in its robustd."""
    with_hooks(slurm)
    logs = slurm.root / "joblogs"
    script = slurm.root / "jobs" / "nccl-rank.txt"
    script.write_text(NCCL)
    job = slurm.submit(f'mkdir -p {logs}/$SLURM_JOB_ID && cat {script} > {logs}/$SLURM_JOB_ID/rank0.log; exit 1',
                       output="/dev/null")
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED", slurm.logs()
    log = slurm.hook_log("epilog-ctld")
    assert "triage from node n" in log and "'s epilog: nccl, infra likely, next diagnose" in log, log
    assert f"diagnosis slurm-job-{job} PASS" in log, log
    released_idle(slurm, slurm.nodes, log)


def test_preflight_requeues_a_job_away_from_a_slow_node_and_lets_a_healthy_one_start(slurm: MultiCluster) -> None:
    slurm.enable_ctld_hook("prolog-ctld", slurm.ctld_command("prolog-ctld", slurm.ctld_config(preflight="net")))
    slurm.slow("n1")  # Slurm gives a 3-node job the first idle nodes: n1-n3
    job = slurm.submit("hostname", nodes=3)
    slurm.wait_for(lambda: int(slurm.job(job).get("Restarts", "0") or 0) >= 1, DIAGNOSIS, "the job requeued",
                   interval=0.2)
    # Slurm makes a batch job requeued by PrologSlurmctld eligible again only after a delay of its own
    # (BeginTime, about two minutes here): that is Slurm's, not robustd's, so the test lets it start now.
    info = slurm.job(job)
    print(f"requeued: {info.get('JobState')} reason {info.get('Reason')} eligible {info.get('EligibleTime')}")
    slurm.sh("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    assert slurm.wait_job(job, 60) == "COMPLETED", slurm.logs()
    log = slurm.hook_log("prolog-ctld")
    assert slurm.hook_exits("prolog-ctld")[:2] == [1, 0], log
    assert f"n1 drained before job {job}: robustd: job {job} preflight FAIL: " in log, log
    assert slurm.job_nodes(job) == ["n2", "n3", "n4"], slurm.job(job)
    assert int(slurm.job(job).get("Restarts", "0")) >= 1, slurm.job(job)
    state, reason = slurm.states()["n1"]
    assert state.startswith("drain") and reason.startswith(f"robustd: job {job} preflight FAIL: "), (state, reason)
    # A healthy cluster: the preflight passes and the job starts, within slurm.ctld.preflight_timeout (60 s).
    slurm.clear_faults()
    slurm.resume("n1")
    slurm.wait_idle()
    t0 = time.monotonic()
    ok = slurm.submit("hostname", nodes=3)
    assert slurm.wait_job(ok, 120, states=("RUNNING", "COMPLETING", "COMPLETED")) != "PENDING"
    started = time.monotonic() - t0
    assert slurm.wait_job(ok, 60) == "COMPLETED", slurm.logs()
    log = slurm.hook_log("prolog-ctld")
    assert f"job {ok}: preflight PASS in " in log, log
    took = float(log.split(f"job {ok}: preflight PASS in ", 1)[1].split(" s", 1)[0])
    print(f"preflight over 3 healthy nodes: {took:.1f} s; job start after {started:.1f} s")
    assert took <= 60, log
    assert slurm.hook_exits("prolog-ctld")[-1] == 0


def test_the_hook_with_a_bad_config_or_every_daemon_down_exits_0_holds_nothing_and_says_why(
        slurm: MultiCluster) -> None:
    bad = slurm.root / "ctld" / "bad.yaml"
    bad.write_text(slurm.ctld_config().read_text().replace("timeout: 120s", "timeout: 120s\n    colour: blue"))
    slurm.enable_ctld_hook("epilog-ctld", slurm.ctld_command("epilog-ctld", bad))
    job = failing_job(slurm, NCCL)
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED"
    log = slurm.hook_log("epilog-ctld")
    assert slurm.hook_exits("epilog-ctld") == [0] and "invalid config" in log and "colour" in log, log
    assert slurm.states() == {n: ("idle", "") for n in slurm.nodes}
    for node in slurm.nodes:
        slurm.stop_robustd(node)
    with_hooks(slurm)
    job = failing_job(slurm, NCCL)
    assert slurm.wait_job(job, DIAGNOSIS) == "FAILED"
    log = slurm.hook_log("epilog-ctld")
    assert slurm.hook_exits("epilog-ctld")[-1] == 0, log
    assert f"job {job}: 0 node(s) whose robustd answers" in log and "holding nothing" in log, log
    assert "held" not in log.split(f"job {job}:", 1)[1], log
    assert slurm.states() == {n: ("idle", "") for n in slurm.nodes}
