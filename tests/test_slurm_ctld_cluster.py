"""The three-node Slurm of tests/fixtures/slurm/multi.py, for the controller hooks of issue 29: each node's slurmd
and robustd in its own network namespace, slurmctld and its EpilogSlurmctld/PrologSlurmctld in the root one.

One cluster per module (it comes up in about 1.5 s here), reset between tests. These first tests are about the
harness itself, so that the controller hook's tests can trust it: Slurm sees three nodes at their own
addresses, a 3-node job runs on all three and calls the EpilogSlurmctld wrapper once with the environment the
hook reads, the wrapper runs a command with the checkout's code and a working scontrol, and the controller's
client certificate reaches every node's robustd over TCP with mutual TLS, for a fleet diagnosis that passes.
"""

from __future__ import annotations

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
    c = MultiCluster(3)
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
    assert slurm.states() == {n: ("idle", "") for n in ("n1", "n2", "n3")}
    for node in slurm.nodes:
        assert slurm.node_field(node, "NodeAddr") == slurm.addr(node), slurm.node_info(node)
        assert slurm.addr(node) != slurm.addr("n1") or node == "n1"
    job = slurm.submit("hostname; exit 1", nodes=3)
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
    assert slurm.states() == {n: ("idle", "") for n in ("n1", "n2", "n3")}


def test_the_controller_certificate_reaches_every_robustd_and_a_healthy_fleet_passes(slurm: MultiCluster) -> None:
    for node in slurm.nodes:
        r = slurm.remote(node, "status")
        assert r.returncode == 0 and f"node {node}: OK" in r.stdout, r.stdout + r.stderr
    t0 = time.monotonic()
    rc, doc, err = slurm.fleet_diagnose()  # all_gather: inter and pairs, from the root namespace
    took = time.monotonic() - t0
    print(f"fleet diagnose over 3 nodes (TCP + mutual TLS, all_gather): {took:.1f} s")
    assert rc == 0 and doc["outcome"] == "PASS" and doc["suspects"] == [], f"{doc}\n{err}\n{slurm.logs()}"
    assert [h["addr"] for h in doc["hosts"]] == [slurm.addr(n) for n in slurm.nodes]
    # The same CA's certificate for another identity may read, but not run the diagnosis.
    assert slurm.remote("n2", "status", client="operator").returncode == 0
    rc, doc, err = slurm.fleet_diagnose(*slurm.tls_args("operator"))
    assert rc == 4 and doc["outcome"] == "ERROR", f"{doc}\n{err}"
    # The config the harness writes for the controller hook is one robustctl accepts.
    ctld = load_settings(str(slurm.ctld_config()), SCHEMA).section("slurm").ctld
    assert (ctld.epilog, ctld.port, ctld.level, ctld.tls_cert) == (True, 7070, "net", slurm.tls()[1])
