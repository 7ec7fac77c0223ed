"""Issue 32, as a newcomer meets robustctl: every exit code means one thing (and --help, the man page and the
README say the same), tables in a pipe keep their text, colours and the diag progress line behave on a
terminal, the man pages format cleanly, a relative socket path is a socket, and the small things
(--version, sim show's bus ids, triage --help, a missing socket's hint).

One daemon for the module: a fake dcgmi that cannot start (every eud run is ERROR) and the kernel check on
the real /dev/kmsg (one long Xid line, for the pipe and colour checks).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from conftest import REPO, Daemon, inject_kmsg, need_root, stragglers_cli
from test_cli_tty import RED, env, on_pty
from test_stragglers_watch import synthetic_windows, write_meta, write_window

from robustd import __version__
from robustd.cli import exitcodes

ROBUSTCTL = [sys.executable, "-m", "robustd.cli.robustctl"]
FAKE_DCGMI = str(REPO / "tests" / "fakes" / "dcgmi")
COMPONENT = "gpu/0000:c7:00.0"
DETAIL = "the GPU fell off the bus " + " ".join(f"word{i}" for i in range(40)) + " END"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    need_root("reading /dev/kmsg")
    root = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))  # a short path: Unix socket names <= 108 bytes
    d = Daemon(root, {"diagnostics": {"eud": {"command": [FAKE_DCGMI, "diag", "-r", "eud", "-j"], "timeout": "20s"}}},
               env={"FAKE_DCGMI_MODE": "nojson"})
    d.start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def critical(daemon: Daemon) -> Daemon:
    inject_kmsg(f"NVRM: Xid (PCI:0000:c7:00): 79, pid=1, name=python, {DETAIL}")
    daemon.wait_for(lambda v: any(c.component == COMPONENT for c in v.conditions))
    return daemon


def no_columns() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NO_COLOR")}


def test_readme_man_page_and_help_list_the_same_exit_codes() -> None:
    readme = (REPO / "README.md").read_text()
    assert exitcodes.markdown() in readme
    man = (REPO / "man" / "robustctl.1").read_text()
    assert ".SH EXIT STATUS\n" + exitcodes.roff() in man
    for verb in ("diag run", "stragglers analyze", "evidence export", "slurm status"):
        r = subprocess.run([*ROBUSTCTL, *verb.split(), "--help"], capture_output=True, text=True, cwd=REPO,
                           timeout=30)
        assert exitcodes.epilog(verb) in r.stdout, r.stdout
    for verb, codes in exitcodes.VERBS.items():  # within a verb, each code means one thing
        numbers = [c for c, _ in codes]
        assert len(numbers) == len(set(numbers)), verb


def test_diag_run_error_exits_5_and_a_bad_level_64(daemon: Daemon) -> None:
    r = daemon.robustctl("diag", "run", "--tests", "eud", timeout=60)
    assert r.returncode == exitcodes.DIAG_ERROR == 5 and "ERROR" in r.stdout, r.stdout + r.stderr
    r = daemon.robustctl("diag", "run", "--level", "no-such-level")
    assert r.returncode == 64 and "no-such-level" in r.stderr, r.stdout + r.stderr


def on_narrow_pty(cmd: Sequence[str], columns: int, timeout: float = 60) -> str:
    """`cmd` with stdout and stderr on a pty `columns` wide; what it wrote, raw."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    environ = {**no_columns(), "TERM": "xterm-256color"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=environ, cwd=REPO)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            out += data
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
    return out.decode(errors="replace")


def screen(raw: str, columns: int) -> list[str]:
    """What a terminal `columns` wide shows for `raw`: CR back to column 0, LF a new row, wrap at the edge."""
    rows: list[list[str]] = [[]]
    row, col = 0, 0
    for ch in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw):
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
        else:
            if col == columns:
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            col += 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(r).rstrip() for r in rows]


def test_diag_runs_final_line_leaves_no_stale_text_on_a_terminal(daemon: Daemon) -> None:
    raw = on_narrow_pty([*ROBUSTCTL, "--socket", daemon.socket, "diag", "run", "--tests", "eud"], 60)
    shown = screen(raw, 60)
    assert "eud running" in raw, raw  # the running line was drawn ...
    assert not any("running" in row for row in shown), shown  # ... and nothing of it is left on screen
    final = [row for row in shown if "eud finished" in row]
    assert len(final) == 1 and re.search(r"eud finished: ERROR after \d+s$", final[0]), shown


def test_a_table_in_a_pipe_prints_the_message_whole(critical: Daemon) -> None:
    for verb in ("status", "events"):
        r = subprocess.run([*ROBUSTCTL, "--socket", critical.socket, verb], capture_output=True, text=True,
                           env=no_columns(), cwd=REPO, timeout=30, stdin=subprocess.DEVNULL)
        row = next(line for line in r.stdout.splitlines() if COMPONENT in line)
        assert row.endswith(DETAIL), row


def test_fleet_status_is_coloured_on_a_terminal_like_status(critical: Daemon) -> None:
    cmd = [*ROBUSTCTL, "fleet", "status", critical.socket]
    shown = on_pty(cmd, env())
    row = next(line for line in shown.splitlines() if critical.socket in line)
    assert RED in row, shown
    plain = on_pty(cmd, env(NO_COLOR="1"))
    assert "\x1b" not in plain and "CRITICAL" in plain, plain


def test_fleet_status_takes_an_existing_relative_path_for_a_socket(critical: Daemon) -> None:
    root = Path(critical.socket).parent
    for host, cwd in (("robustd.sock", root), (f"{root.name}/robustd.sock", root.parent)):
        r = subprocess.run([*ROBUSTCTL, "fleet", "status", host], capture_output=True, text=True, cwd=cwd,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=30)
        assert r.returncode == exitcodes.CRITICAL, r.stdout + r.stderr  # it answered: the node is CRITICAL
        assert "test-node" in r.stdout and "1 critical" in r.stdout, r.stdout


def test_every_man_page_formats_without_warnings() -> None:
    for page in sorted((REPO / "man").iterdir()):
        r = subprocess.run(["man", "-l", str(page)], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "MANWIDTH": "80"})
        assert r.returncode == 0 and r.stderr == "", (page.name, r.stderr)


def test_stragglers_analyze_unreadable_is_2_and_watch_alert_stays_1(tmp_path: Path) -> None:
    r = subprocess.run([*ROBUSTCTL, "stragglers", "analyze", "--trace-dir", str(tmp_path / "no-such-dir")],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == exitcodes.UNREADABLE == 2 and "no-such-dir" in r.stderr, r.stderr
    write_meta(tmp_path)
    for first, cols in synthetic_windows(4, fault_from=2).items():
        write_window(tmp_path, first, cols)
    code, out = stragglers_cli("watch", str(tmp_path), "--once", "--alert-windows", "2", "--alert-slowdown", "1.2")
    assert code == exitcodes.ALERT == 1 and out.splitlines()[-1].startswith("ALERT:"), out


def test_version_sim_bus_ids_and_triage_help(tmp_path: Path) -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ROBUSTCTL, *argv], capture_output=True, text=True, cwd=REPO, timeout=30)

    r = run("--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"robustctl {__version__}"), r
    state = str(tmp_path / "nvml.state")
    assert run("sim", "--state", state, "init", "--gpus", "2").returncode == 0
    shown = run("sim", "--state", state, "show").stdout
    ids = re.findall(r"\b[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d\b", shown)
    assert len(ids) == 2 and all(re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:00\.0", i) for i in ids), shown
    help_text = run("triage", "--help").stdout
    assert "--exit-code" in help_text and "--json" in help_text
    assert not any(opt in help_text for opt in ("--socket", "--address", "--tls-ca", "--tls-cert", "--timeout"))
    assert run("triage", "--socket", "/x", "examples/triage/nccl-ib/").returncode == 0  # accepted, ignored


def test_a_missing_socket_names_socket_and_robustd_socket(tmp_path: Path) -> None:
    r = subprocess.run([*ROBUSTCTL, "status"], capture_output=True, text=True, cwd=REPO, timeout=30,
                       env={**os.environ, "ROBUSTD_SOCKET": str(tmp_path / "none.sock")})
    assert r.returncode == 3 and "No such file or directory" in r.stderr, r.stderr
    assert "--socket" in r.stderr and "ROBUSTD_SOCKET" in r.stderr, r.stderr
