"""The Slurm epilog's triage, without a Slurm cluster: Slurm's exit status words, where a job's logs are
found and how they are read (as root, on paths the job's user chose), which verdicts run diagnostics, and a
hang's stack capture of the job's leftover processes through a real daemon and the real py-spy.

The end-to-end tests against a real Slurm are in tests/test_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, Daemon, need_root

from robustd.adapters.slurm.hung_job import job_pids
from robustd.adapters.slurm.jobs import expand_path, expand_pattern, job_status, read_owned, worth_diagnosing
from robustd.roots import Roots
from robustd.triage import CLASSES, Triage

KEYERROR = ("step 1200 | loss 2.3141\nTraceback (most recent call last):\n"
            "  File \"/home/alice/proj/train.py\", line 42, in collate\n    return [s[key] for s in batch]\n"
            "KeyError: 'labels'\n")
NCCL = ("node-17:2345:2406 [3] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
        "10.0.0.2<42174> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 "
        "remoteGid ::ffff:10.0.0.2\n"
        "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system "
        "error, NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, malloc) or external library call "
        "failed or device error.\n")
HANG = ("[rank3]:[E ProcessGroupNCCL.cpp:563] [Rank 3] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=48213, OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for "
        "600034 milliseconds before timing out.\n")


# --- Slurm's words --------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, status", [
    ({"SLURM_JOB_EXIT_CODE": "0"}, (0, None)),
    ({"SLURM_JOB_EXIT_CODE": "768"}, (3, None)),  # exited 3
    ({"SLURM_JOB_EXIT_CODE": "9"}, (None, "SIGKILL")),  # killed by SIGKILL: no exit code
    ({"SLURM_JOB_EXIT_CODE": "139"}, (None, "SIGSEGV")),  # SIGSEGV with a core dump
    ({"SLURM_JOB_EXIT_CODE": "35072"}, (137, None)),  # a script that exited 137 (its child was SIGKILLed)
    ({"SLURM_JOB_EXIT_CODE": "x", "SLURM_JOB_EXIT_CODE2": "1:0"}, (1, None)),
    ({"SLURM_JOB_EXIT_CODE2": "0:15"}, (None, "SIGTERM")),
    ({"SLURM_JOB_EXIT_CODE2": "2:9"}, (2, "SIGKILL")),
    ({"SLURM_JOB_EXIT_CODE2": "0:0"}, (0, None)),
    ({"SLURM_JOB_EXIT_CODE2": "0:99"}, (None, None)),  # not a signal Linux has
    ({"SLURM_JOB_EXIT_CODE2": "x:y"}, None), ({"SLURM_JOB_EXIT_CODE2": "300:0"}, None), ({}, None),
])
def test_job_status(env: dict[str, str], status: tuple[int | None, str | None] | None) -> None:
    assert job_status(env) == status


def test_patterns_and_output_names() -> None:
    assert expand_pattern("/scratch/%u/logs/%j/rank*.log", "42", "alice") == "/scratch/alice/logs/42/rank*.log"
    assert expand_pattern("/s/%u/%j-%%.log", "42", "a[b]") == "/s/a[[]b]/42-%.log"  # the values are not globs
    assert expand_pattern("/s/%u/x", "42", None) is None
    assert expand_path("/home/a/out-%j.txt", "7", "a") == "/home/a/out-7.txt"
    assert expand_path("/home/a/100%%-%u.txt", "7", "a") == "/home/a/100%-a.txt"
    assert expand_path("/home/a/%x-%j.out", "7", "a") is None  # only Slurm knows the job name: scontrol then
    assert expand_path("/home/a/[x].out", "7", "a") == "/home/a/[x].out"


def test_only_a_cause_that_may_be_the_machine_is_diagnosed() -> None:
    def t(klass: str, infra: str, nxt: str) -> Triage:
        return Triage(klass=klass, infra=infra, next=nxt, level="eud" if nxt == "diagnose" else None)

    assert worth_diagnosing(t("nccl", "likely", "diagnose")) and worth_diagnosing(t("unknown", "unknown", "diagnose"))
    assert not worth_diagnosing(t("nccl", "likely", "restart"))  # transient-looking: restart first
    assert not worth_diagnosing(t("launcher", "unlikely", "diagnose"))
    for klass in ("user_code", "oom_gpu", "oom_host"):  # never, whatever else the answer says
        assert klass in CLASSES and not worth_diagnosing(t(klass, "likely", "diagnose"))


# --- reading as root what the job's user wrote ----------------------------------------------------------

def test_a_log_is_read_only_when_it_is_the_users_regular_file(tmp_path: Path) -> None:
    me = os.geteuid()
    log = tmp_path / "out.txt"
    log.write_bytes(b"a" * 5000 + b"\n" + KEYERROR.encode())
    got = read_owned(str(log), 1024, me)
    assert not isinstance(got, str)
    text, ident = got
    data = log.read_bytes()
    assert text.data == data[-1024:] and text.offset == len(data) - 1024 and not text.whole
    assert ident == (log.stat().st_dev, log.stat().st_ino)
    whole = read_owned(str(log), 1 << 20, me)
    assert not isinstance(whole, str) and whole[0].whole and whole[0].data == data
    assert read_owned(str(log), 1024, me + 1) == f"owned by uid {me}, not the job's user (uid {me + 1})"
    link = tmp_path / "link.txt"
    link.symlink_to(log)  # e.g. to /etc/shadow: never followed
    assert isinstance(read_owned(str(link), 1024, me), str)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t = time.monotonic()
    assert read_owned(str(fifo), 1024, me) == "not a regular file" and time.monotonic() - t < 5  # never blocks
    assert read_owned(os.devnull, 1024, me) == "not a regular file"  # a device is never opened for reading
    assert read_owned(str(tmp_path / "missing"), 1024, me) == "No such file or directory"
    assert read_owned(str(tmp_path), 1024, me) == "not a regular file"


# --- the job's leftover processes --------------------------------------------------------------------------

def fake_proc(root: Path, pid: int, ppid: int, comm: str, env: dict[str, str], cgroup: str = "0::/user.slice\n",
              cmdline: str | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    (d / "comm").write_text(comm + "\n")
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    (d / "cgroup").write_text(cgroup)
    cmd = comm if cmdline is None else cmdline
    (d / "cmdline").write_bytes(cmd.encode() + b"\0" if cmd else b"")  # a zombie's is empty


def test_the_jobs_processes_are_found_by_environment_or_cgroup(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    job = {"SLURM_JOB_ID": "42", "PATH": "/usr/bin"}
    fake_proc(proc, 100, 1, "slurmd", {})
    fake_proc(proc, 200, 100, "sh", job)  # the epilog's shell wrapper: an ancestor of the epilog
    fake_proc(proc, 201, 200, "robustctl", job)  # the epilog itself
    fake_proc(proc, 300, 1, "slurmstepd", job, cgroup="0::/system.slice/slurmstepd.scope/job_42/step_0/slurm\n")
    fake_proc(proc, 301, 300, "python", job)  # a rank, by its environment
    fake_proc(proc, 302, 300, "python", {}, cgroup="0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_1\n")
    fake_proc(proc, 303, 300, "python", {}, cgroup="4:memory:/slurm/uid_1000/job_42/step_batch\n")  # cgroup v1
    fake_proc(proc, 304, 300, "python", job, cmdline="")  # a zombie: nothing to capture
    fake_proc(proc, 400, 1, "python", {"SLURM_JOB_ID": "420"}, cgroup="0::/slurmstepd.scope/job_420/step_0\n")
    fake_proc(proc, 401, 1, "python", {"SLURM_JOB_ID_X": "42", "X": "SLURM_JOB_ID=42"})  # not the variable
    roots = Roots(proc=str(proc))
    assert job_pids(roots, "42", own=201) == [301, 302, 303]
    assert job_pids(roots, "42", own=201, limit=2) == [301, 302]
    assert job_pids(roots, "420", own=201) == [400]
    assert job_pids(roots, "4*", own=201) == [] and job_pids(roots, "?", own=201) == []


# --- the epilog, end to end without Slurm ------------------------------------------------------------------

def epilog_config(tmp_path: Path, socket: str, scontrol_out: str = "", **slurm: Any) -> tuple[Path, Path]:
    """A config whose scontrol prints `scontrol_out` for `show job` (and records every call)."""
    calls = tmp_path / "calls.log"
    for tool, body in (("scontrol", f"cat <<'EOF'\n{scontrol_out}\nEOF\n"), ("sinfo", "exit 0\n")):
        script = tmp_path / tool
        script.write_text(f"#!/bin/sh\necho {tool} \"$@\" >>{calls}\n{body}")
        script.chmod(0o755)
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "listen": {"unix": socket},
                                   "slurm": {"scontrol": str(tmp_path / "scontrol"), "sinfo": str(tmp_path / "sinfo"),
                                             "node_name": "n1", "epilog_diagnostics": "quick", **slurm}}))
    return cfg, calls


def epilog(cfg: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "slurm", "epilog", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL,
                          env={**base, **env})


def job_env(job: str, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_EXIT_CODE": "256", "SLURM_JOB_UID": str(os.geteuid()),
            "SLURM_JOB_USER": "alice", **extra}


def test_a_users_bug_is_not_diagnosed_and_the_verdict_is_logged(tmp_path: Path) -> None:
    out = tmp_path / "slurm-51.out"
    out.write_text(KEYERROR)
    cfg, calls = epilog_config(tmp_path, str(tmp_path / "nobody.sock"),
                               f"JobId=51 JobName=train UserId=alice({os.geteuid()}) StdErr={out} StdIn=/dev/null "
                               f"StdOut={out} Power=")
    r = epilog(cfg, job_env("51"))
    assert r.returncode == 0, r.stderr
    assert "job 51 triage of 1 log: user_code" in r.stderr and "KeyError: 'labels'" in r.stderr, r.stderr
    assert "not diagnosing: triage says user_code" in r.stderr and "running the" not in r.stderr, r.stderr
    assert calls.read_text().splitlines() == ["scontrol show job --oneliner 51"]

    cfg, _ = epilog_config(tmp_path, str(tmp_path / "nobody.sock"), triage=False)  # the old behaviour
    r = epilog(cfg, job_env("51", SLURM_JOB_STDOUT=str(out)))
    assert "triage" not in r.stderr and "job 51 failed (exit 256): running the 'quick' diagnostics" in r.stderr


def test_the_environment_names_the_output_and_triage_logs_add_rank_logs(tmp_path: Path) -> None:
    ranks = tmp_path / "scratch" / "alice" / "logs" / "77"
    ranks.mkdir(parents=True)
    for i in range(4):
        (ranks / f"rank{i}.log").write_text(NCCL if i == 3 else f"step 880 | rank {i} | loss 1.91\n")
    (ranks / "notes.txt").write_text("not a log\n")
    out = tmp_path / "out-77.txt"
    out.write_text("launching 4 ranks\n")
    cfg, calls = epilog_config(tmp_path, str(tmp_path / "nobody.sock"),
                               triage_logs=[str(tmp_path / "scratch" / "%u" / "logs" / "%j" / "rank*.log"),
                                            str(tmp_path / "nothing-%j-*.log")])
    # slurmd 22.05 hands the Epilog the name as submitted: %j is filled in here, no scontrol needed
    r = epilog(cfg, job_env("77", SLURM_JOB_STDOUT=str(tmp_path / "out-%j.txt")))
    assert r.returncode == 0, r.stderr
    assert "job 77 triage of 5 logs: nccl, infra likely, next diagnose" in r.stderr, r.stderr
    assert str(ranks / "rank3.log") in r.stderr
    assert "job 77 failed (exit 256): running the 'quick' diagnostics (triage: nccl" in r.stderr
    assert not calls.exists()


def test_without_a_known_user_no_log_is_read(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text(KEYERROR)
    cfg, _ = epilog_config(tmp_path, str(tmp_path / "nobody.sock"), f"JobId=9 StdOut={out} Power=")
    env = job_env("9", SLURM_JOB_STDOUT=str(out))
    del env["SLURM_JOB_UID"]
    r = epilog(cfg, env)
    assert r.returncode == 0 and "the job's user is unknown" in r.stderr and "triage of 0 logs" in r.stderr, r.stderr
    cfg, _ = epilog_config(tmp_path, str(tmp_path / "nobody.sock"))
    r = epilog(cfg, job_env("9", SLURM_JOB_STDOUT=str(out), SLURM_JOB_UID=str(os.geteuid() + 1)))
    assert "triage of 0 logs" in r.stderr and "not the job's user" in r.stderr, r.stderr


# --- a hang: stacks first -----------------------------------------------------------------------------------

HUNG_RANK = """
import time

def wait_for_peer_recv():
    while True:
        time.sleep(0.05)

print("ready", flush=True)
wait_for_peer_recv()
"""


def test_a_hang_captures_the_stacks_of_the_jobs_leftover_processes(make_daemon: Any, tmp_path: Path) -> None:
    need_root("py-spy attaches to other processes (ptrace)")
    job = str(90000 + uuid.uuid4().int % 9999)
    marker = f"hung_rank_{job}.py"
    d: Daemon = make_daemon({"tracer": {"process_patterns": [marker]}, "checks": {"kernel": {"enabled": False}}})
    d.start()
    script = tmp_path / marker
    script.write_text(HUNG_RANK)
    env = {**os.environ, "SLURM_JOB_ID": job, "RANK": "3"}
    rank = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    helper = subprocess.Popen(["sleep", "300"], env=env)  # the job's too, but no training process: left out
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        out = tmp_path / "slurm.out"
        out.write_text("step 4410 | loss 1.7734\n" + HANG)
        cfg, _ = epilog_config(tmp_path, d.socket, epilog_diagnostics=None)  # the capture needs no diagnostics
        r = epilog(cfg, job_env(job, SLURM_JOB_STDOUT=str(out)))
        assert r.returncode == 0, r.stderr
        assert f"job {job} triage of 1 log: hang" in r.stderr, r.stderr
        assert "stacks of 1 of its processes captured (0 not), saved to " in r.stderr, r.stderr
        saved = r.stderr.split("saved to ", 1)[1].split()[0]
        assert saved.startswith(str(tmp_path / "state" / "stacks" / f"job-{job}-")), saved
        assert oct(os.stat(saved).st_mode & 0o777) == "0o600"
        doc = json.loads(Path(saved).read_text())
        [p] = doc["processes"]
        assert p["pid"] == rank.pid and p["rank"] == 3 and not p.get("error"), p
        frames = [f["function"] for t in p["threads"] for f in t["frames"]]
        assert "wait_for_peer_recv" in frames, frames
    finally:
        for p in (rank, helper):
            p.kill()
            p.wait()
        if rank.stdout is not None:
            rank.stdout.close()
