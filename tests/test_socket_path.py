"""The Unix socket's path: it appears with its mode and group already set, and a symlink at (or swapped into)
its place is replaced, never followed; a directory where other users could take or swap names is refused."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from conftest import REPO, Daemon, need_root

QUIET = {"checks": {"kernel": {"enabled": False}}}


def start_fails(d: Daemon) -> str:
    """Run the daemon, expecting it to refuse to start; its output."""
    r = subprocess.run(d.command(), capture_output=True, text=True, timeout=20, cwd=REPO)
    assert r.returncode == 1, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_socket_directory_others_can_write_is_refused_sticky_or_not(make_daemon: Any) -> None:
    d = make_daemon(QUIET)
    for mode in (0o777, 0o775, 0o1777, 0o1770):  # sticky, as /tmp is, or not: another user could take the name
        os.chmod(d.root, mode)
        out = start_fails(d)
        lines = [line for line in out.splitlines() if "listen.unix" in line]
        assert len(lines) == 1, out
        assert (f"listen.unix: socket directory {d.root} is writable by group/others (mode {mode:04o}): another "
                "user could take the socket's name, sticky bit or not, and answer in robustd's place; use a "
                "directory only root can write, such as /run/robustd") in lines[0], out
        assert "Traceback" not in out
        assert not os.path.lexists(d.socket) and list(d.root.glob(".robustd-*")) == []

    # A directory above the socket's counts too (it could be renamed away with everything in it).
    os.chmod(d.root, 0o777)
    d.write_config({"listen": {"unix": str(d.root / "sub" / "robustd.sock")}})
    out = start_fails(d)
    assert (f"listen.unix: {d.root}, above the socket directory {d.root / 'sub'}, is writable by group/others "
            "and not sticky") in out, out

    # Above the socket's directory, sticky is enough (as /tmp is above every test's): only the owner of the
    # root-owned directory inside it may rename or remove it, and nobody else can write into that one.
    os.chmod(d.root, 0o1777)
    d.socket = str(d.root / "sub" / "robustd.sock")
    d.write_config({"listen": {"unix": d.socket, "unix_mode": 0o640}})
    d.start()
    assert stat.S_IMODE(os.lstat(d.socket).st_mode) == 0o640
    assert d.robustctl("status").returncode == 0


def test_socket_has_its_mode_and_group_and_replaces_a_planted_symlink(make_daemon: Any) -> None:
    need_root("giving the socket a group")
    d = make_daemon({**QUIET, "listen": {"unix_mode": 0o660, "unix_group": "adm"}})
    target = d.root.parent / "precious"
    target.write_text("keep me")
    os.chmod(target, 0o600)
    os.symlink(target, d.socket)  # planted where the socket will be
    d.start()
    st = os.lstat(d.socket)
    assert stat.S_ISSOCK(st.st_mode)  # the symlink was replaced, not followed
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam("adm").gr_gid
    t = os.lstat(target)
    assert stat.S_ISREG(t.st_mode) and stat.S_IMODE(t.st_mode) == 0o600 and t.st_gid == 0
    assert target.read_text() == "keep me"
    assert d.verdict().node == "test-node"

    # A stale socket a killed daemon left behind is replaced the same way.
    d.kill()
    assert stat.S_ISSOCK(os.lstat(d.socket).st_mode)
    d.start()
    assert os.lstat(d.socket).st_ino != st.st_ino and d.verdict().node == "test-node"


def swap_in_symlinks(path: str, target: Path, stop: threading.Event, swaps: list[int]) -> None:
    """Replace the socket at `path` with a symlink to `target` whenever one appears, until `stop`."""
    tmp = path + ".swap"
    while not stop.is_set():
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.symlink(target, tmp)
                os.replace(tmp, path)  # what a local attacker would do, atomically
                swaps[0] += 1
        except FileNotFoundError:
            pass


def test_a_symlink_swapped_in_while_the_daemon_starts_is_never_followed(make_daemon: Any) -> None:
    """Another process replaces the socket with a symlink the moment it appears, over and over."""
    d = make_daemon({**QUIET, "listen": {"unix_mode": 0o666}})
    target = d.root.parent / "precious"
    target.write_text("keep me")
    os.chmod(target, 0o600)
    swaps = [0]
    for attempt in range(5):
        stop = threading.Event()
        swapper = threading.Thread(target=swap_in_symlinks, args=(d.socket, target, stop, swaps), daemon=True)
        swapper.start()
        try:
            d.start(wait=False)
            deadline = time.monotonic() + 15
            while d.log().count(" ready on ") <= attempt or swaps[0] <= attempt:  # started, and swapped once
                assert d.proc is not None and d.proc.poll() is None, d.log()
                assert time.monotonic() < deadline, d.log()
                time.sleep(0.01)
        finally:
            stop.set()
            swapper.join(5)
            d.stop()
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o600, f"attempt {attempt}: the daemon chmod'ed the target"
        if os.path.lexists(d.socket):
            os.unlink(d.socket)
    assert target.read_text() == "keep me"
