"""Tab completion as bash runs it: the packaged script (packaging/completion/robustctl) sourced into a
real bash, its completion function called the way bash calls it, robustctl answering from the parser
and, for `ack`'s component and code, from the live verdict of a real daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Daemon, inject_kmsg

SCRIPT = REPO / "packaging" / "completion" / "robustctl"
COMPONENT = "gpu/0000:e7:00.0"


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A `robustctl` on PATH as the packages install it: a wrapper around this interpreter's robustctl."""
    d = tmp_path / "bin"
    d.mkdir()
    wrapper = d / "robustctl"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m robustd.cli.robustctl "$@"\n')
    wrapper.chmod(0o755)
    return d


def complete(line: str, bin_dir: Path, socket: str) -> list[str]:
    """COMPREPLY for the command line `line` with the cursor at its end, as bash would fill it."""
    if shutil.which("bash") is None:
        pytest.fail("bash is not installed")
    words = line.split(" ")
    script = f"""
source {SCRIPT}
COMP_LINE={_quote(line)}
COMP_POINT=${{#COMP_LINE}}
COMP_WORDS=({" ".join(_quote(w) for w in words)})
COMP_CWORD={len(words) - 1}
COMP_TYPE=9
_python_argcomplete robustctl {_quote(words[-1])} {_quote(words[-2])}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "ROBUSTD_SOCKET": socket,
           "PYTHONPATH": str(REPO)}
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return [w.strip() for w in r.stdout.splitlines() if w.strip()]


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def test_verbs_and_options_complete_from_the_parser(bin_dir: Path, tmp_path: Path) -> None:
    nowhere = str(tmp_path / "none.sock")
    assert complete("robustctl ev", bin_dir, nowhere) == ["events", "evidence"]
    assert set(complete("robustctl ", bin_dir, nowhere)) >= {"status", "watch", "events", "ack", "diag"}
    assert complete("robustctl ack --rea", bin_dir, nowhere) == ["--reason"]


def test_ack_completes_component_and_code_from_the_live_verdict(daemon: Daemon, bin_dir: Path) -> None:
    inject_kmsg("NVRM: Xid (PCI:0000:e7:00): 79, pid=1, name=python, GPU has fallen off the bus.")
    daemon.wait_for(lambda v: any(c.component == COMPONENT for c in v.conditions))
    assert COMPONENT in complete("robustctl ack ", bin_dir, daemon.socket)
    assert complete("robustctl ack gpu/0000:e7", bin_dir, daemon.socket) == ["e7:00.0"]  # bash splits words at ":"
    assert complete(f"robustctl ack {COMPONENT} ", bin_dir, daemon.socket) == ["XID_79"]
    assert complete(f"robustctl ack {COMPONENT} XID_1", bin_dir, daemon.socket) == []
    assert complete(f"robustctl --socket {daemon.socket} ack {COMPONENT} X", bin_dir, "/nonexistent") == ["XID_79"]


def test_no_daemon_completes_nothing_and_prints_nothing(bin_dir: Path, tmp_path: Path) -> None:
    assert complete("robustctl ack ", bin_dir, str(tmp_path / "none.sock")) == []
