"""`robustctl diag run` as an operator watches it: a live line per running test with its elapsed time, and
why a test failed or erred (the child's last stderr lines) in the normal output, not only in --json."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, Daemon, python_with_torch
from test_cli_tty import env, on_pty

ROBUSTCTL = [sys.executable, "-m", "robustd.cli.robustctl"]
FAKE_DCGMI = str(REPO / "tests" / "fakes" / "dcgmi")


def diag_daemon(make_daemon: Any, mode: str, timeout: str = "20s") -> Daemon:
    d = make_daemon({"diagnostics": {"eud": {"command": [FAKE_DCGMI, "diag", "-r", "eud", "-j"], "timeout": timeout}},
                     "checks": {"kernel": {"enabled": False}}}, env={"FAKE_DCGMI_MODE": mode})
    d.start()
    return d


@pytest.fixture
def python_with_broken_torch(tmp_path: Path) -> str:
    """An interpreter whose torch raises at import, as a CUDA build does on a node with a broken driver:
    the child dies with a Python traceback on stderr (not a clean cannot_run line)."""
    return python_with_torch(tmp_path, "def _init():\n    raise RuntimeError('CUDA driver initialization failed, "
                                       "you might not have a CUDA gpu.')\n_init()\n")


def test_an_erroring_test_says_why_with_the_childs_stderr(make_daemon: Any, python_with_broken_torch: str) -> None:
    d = make_daemon({"diagnostics": {"python": python_with_broken_torch, "collectives": {"cpu_ranks": 2}},
                     "checks": {"kernel": {"enabled": False}}})
    d.start()
    r = d.robustctl("diag", "run", "--tests", "all_to_all", timeout=120)
    assert r.returncode == 5, r.stdout + r.stderr  # ERROR (exitcodes.DIAG_ERROR), not an RPC error
    why = r.stdout.split("\nwhy:\n", 1)
    assert len(why) == 2, r.stdout  # the reason is in the normal output, after the table
    assert re.search(r"^all_to_all host ERROR: .*CUDA driver initialization failed", why[1], re.M), why[1]
    tail = why[1].split("last stderr lines of all_to_all:\n", 1)[-1].splitlines()
    assert 2 <= len(tail) <= 5 and all(line.startswith("  | ") for line in tail), why[1]
    assert "raise RuntimeError" in why[1] or "_init()" in why[1], why[1]  # the traceback, not only its last line
    # the progress on stderr names the result and how long the test ran, then the same reason
    assert re.search(r"all_to_all finished: ERROR after \d+s", r.stderr), r.stderr
    assert "all_to_all host ERROR:" in r.stderr, r.stderr


def test_a_running_test_shows_its_elapsed_time_on_a_terminal(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, "hang", timeout="3s")  # runs until its timeout kills it
    shown = on_pty([*ROBUSTCTL, "--socket", d.socket, "diag", "run", "--tests", "eud"], env(), timeout=120)
    redraws = re.findall(r"eud running (\d+)s", shown)
    assert redraws and max(int(s) for s in redraws) >= 1, shown  # the clock moved while nothing else did
    assert re.search(r"eud finished: ERROR after \d+s", shown), shown
    assert "\nwhy:\neud host ERROR:" in shown, shown


def test_in_a_pipe_each_test_gets_a_start_and_a_finish_line(make_daemon: Any) -> None:
    d = diag_daemon(make_daemon, "pass4")
    r = d.robustctl("diag", "run", "--tests", "eud")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert any(re.search(r"\] +0\.0%  eud running 0s$", line) for line in lines), r.stderr
    assert any(re.search(r"eud finished: PASS after \d+s$", line) for line in lines), r.stderr
    assert "\r" not in r.stderr and "why:" not in r.stdout
