"""What an operator reads before running anything: `--help` with examples, and man pages that match it.

The man pages in man/ and the completion script in packaging/completion/ are generated from the
argument parsers (`make man`) and committed; a parser change without `make man` fails here.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import IN_CI, REPO

from robustd.cli.robustctl import build_parser

ROBUSTCTL = [sys.executable, "-m", "robustd.cli.robustctl"]


def verbs() -> list[str]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def test_every_verb_is_covered() -> None:
    assert {"status", "watch", "events", "checks", "ack", "diag", "fleet", "trace", "triage"} <= set(verbs())


def test_help_shows_an_example() -> None:
    r = subprocess.run([*ROBUSTCTL, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "examples:\n  export ROBUSTD_SOCKET=" in r.stdout, r.stdout + r.stderr
    assert "robustctl status" in r.stdout.split("examples:", 1)[1] and "NO_COLOR" in r.stdout


@pytest.mark.parametrize("verb", verbs())
def test_every_verb_help_shows_an_example(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([verb, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert re.search(rf"^examples?:\n  robustctl {verb}\b", shown, re.M), shown


def test_man_pages_and_completion_are_not_stale() -> None:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen-man.py"), "--check"], capture_output=True,
                       text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"run `make man`:\n{r.stdout}{r.stderr}"
    for page in ("robustd.8", "robustctl.1", "robustd-slurm.8"):
        assert (REPO / "man" / page).is_file(), page


def test_man_page_renders_with_every_verb_and_its_examples() -> None:
    """`man robustctl` as the packages install it: every verb, the examples of every verb's --help."""
    r = subprocess.run(["man", "-l", str(REPO / "man" / "robustctl.1")], capture_output=True, text=True,
                       timeout=60, env={"MANWIDTH": "200", "PATH": "/usr/bin:/bin", "MAN_KEEP_FORMATTING": ""},
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0 and "not found" in r.stderr:
        (pytest.fail if IN_CI else pytest.skip)("man is not installed (make deps installs man-db)")
    page = r.stdout
    assert "EXAMPLES" in page and "robustctl ack gpu/0000:1b:00.0 XID_79" in page, page[:2000]
    for verb in verbs():
        assert f"COMMAND 'robustctl {verb}'" in page, verb


def test_stale_page_is_reported(tmp_path: Path) -> None:
    """The check must be able to fail: a page that differs from its parser, or a lost one, is named."""
    shutil.copytree(REPO / "man", tmp_path / "man")
    shutil.copytree(REPO / "packaging" / "completion", tmp_path / "packaging" / "completion")
    page = tmp_path / "man" / "robustd.8"
    page.write_text(page.read_text().replace("validate the config", "check the config"))
    (tmp_path / "packaging" / "completion" / "robustctl").unlink()
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen-man.py"), "--check", "--root", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stdout + r.stderr
    assert sorted(r.stdout.splitlines()) == ["man/robustd.8: stale or missing; run `make man`",
                                             "packaging/completion/robustctl: stale or missing; run `make man`"]


def test_the_readme_runs_in_order_as_written_against_make_run(tmp_path: Path) -> None:
    """Every README block marked to run, in the README's order, in one shell, against the daemon `make run`
    starts in a scratch copy of the checkout (tests/readme_session.py says how blocks are marked and judged).
    A block without a marker fails too: whoever adds one decides whether it runs here."""
    import os
    import signal

    import readme_session as rs
    from conftest import need_root

    need_root("the README's Try it writes /dev/kmsg as root")
    readme = (REPO / "README.md").read_text()
    blocks = rs.blocks(readme)
    unmarked = [b.line for b in blocks if not b.kind]
    assert not unmarked, f"README blocks without a <!-- readme-test: ... --> marker at lines {unmarked}"
    work, scratch = tmp_path / "checkout", tmp_path / "session"
    work.mkdir()
    scratch.mkdir()
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for top in sorted({p.split("/")[0] for p in tracked.splitlines()} | {".venv"}):
        if top not in ("run", "var") and (REPO / top).exists():
            (work / top).symlink_to(REPO / top)
    for leftover in Path("/tmp").glob("pp-*"):  # what the README's examples write: a fresh machine has none
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ROBUSTD_SOCKET", "PYTHONPATH", "MAKEFLAGS", "MFLAGS")}
    env["HOME"] = str(tmp_path)
    log = (tmp_path / "make-run.log").open("w")
    daemon = subprocess.Popen(["make", "run"], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    session = None
    try:
        sock = work / "run" / "robustd.sock"
        up = time.monotonic() + 180
        while not (sock.exists() and subprocess.run(
                [str(REPO / ".venv/bin/robustctl"), "--socket", str(sock), "status"],
                capture_output=True, timeout=30).returncode in (0, 1, 2)):
            assert daemon.poll() is None, (tmp_path / "make-run.log").read_text()[-3000:]
            assert time.monotonic() < up, "make run did not answer within 180 s"
            time.sleep(0.5)
        session = rs.Session(work, env, scratch)
        failed, ran = [], 0
        for block in blocks:
            if block.kind not in ("run", "transcript"):
                continue
            for cmd in rs.commands(block):
                rc, out, err = session.run(cmd, timeout=300)
                ran += 1
                why = rs.problems(cmd, rc, out, err)
                if why:
                    failed.append(f"README.md:{cmd.line}: {cmd.text.strip()[:160]}\n  {why}\n  stderr: "
                                  f"{err.strip()[-600:]}")
        print(f"{ran} README commands run in order")
        assert ran >= 40, ran
        assert not failed, "\n".join(failed)
    finally:
        if session is not None:
            session.close()
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=10)
        log.close()
