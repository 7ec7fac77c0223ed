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
