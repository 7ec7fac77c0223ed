"""The Unix socket's path: it appears with its mode and group already set, and a symlink at (or swapped into)
its place is replaced, never followed; a directory where other users could take or swap names is refused, and
every client refuses a socket another user owns (a real `nobody` listening at the path)."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
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


IMPOSTOR = """
import sys
from concurrent.futures import ThreadPoolExecutor
import grpc
from robustd.api.v1 import robustd_pb2 as pb, robustd_pb2_grpc as pb_grpc
class Impostor(pb_grpc.NodeHealthServicer):
    def GetVerdict(self, request, context):
        return pb.Verdict(node="impostor", severity=pb.SEVERITY_OK, action=pb.ACTION_NONE)
server = grpc.server(ThreadPoolExecutor(max_workers=2))
pb_grpc.add_NodeHealthServicer_to_server(Impostor(), server)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
sys.stdin.read()  # until the test closes our stdin
server.stop(0)
"""


@contextlib.contextmanager
def impostor(path: str) -> Iterator[None]:
    """`nobody` listening at `path`: a gRPC server that answers every GetVerdict "OK, 0 conditions"."""
    need_root("listening as another uid")
    p = subprocess.Popen(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", sys.executable,
                          "-c", IMPOSTOR, path], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            assert time.monotonic() < deadline, "the impostor did not listen within 30s"
            time.sleep(0.05)
        assert os.lstat(path).st_uid == pwd.getpwnam("nobody").pw_uid
        yield
    finally:
        assert p.stdin is not None
        p.stdin.close()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if p.stderr is not None:
            p.stderr.close()


def squat_dir(short_tmp: Path) -> Path:
    """A sticky directory everyone can write to (as /tmp is), reachable by `nobody`."""
    os.chmod(short_tmp, 0o711)
    d = short_tmp / "run"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


def robustctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", *args], capture_output=True, text=True,
                          timeout=30, cwd=REPO, stdin=subprocess.DEVNULL)


def test_a_listener_another_user_planted_is_refused_by_robustd_and_by_robustctl(make_daemon: Any,
                                                                                 short_tmp: Path) -> None:
    """`nobody` binds the socket's name in a sticky, world-writable directory before robustd starts."""
    os.chmod(short_tmp, 0o711)
    d = make_daemon(QUIET)
    os.chmod(d.root, 0o1777)
    with impostor(d.socket):
        out = start_fails(d)  # the directory is named, not only the squatter
        assert f"listen.unix: socket directory {d.root} is writable by group/others (mode 1777)" in out, out
        assert "/run/robustd" in out and "Traceback" not in out

        r = d.robustctl("status")
        assert r.returncode == 3 and r.stdout == "", r.stdout + r.stderr  # unreachable, never the impostor's OK
        assert r.stderr.startswith(f"robustctl: refusing {d.socket}: socket directory {d.root} is writable by "
                                   "group/others (mode 1777)"), r.stderr

        # The directory made safe again, the squatter's socket still there: its owner is named.
        os.chmod(d.root, 0o755)
        owned = (f"refusing {d.socket}: it is owned by uid 65534 (nobody), not root; another user may be "
                 "impersonating robustd")
        r = d.robustctl("status")
        assert (r.returncode, r.stdout, r.stderr) == (3, "", f"robustctl: {owned}\n")
        r = robustctl("fleet", "status", "--json", f"unix:{d.socket}")
        assert r.returncode == 3, r.stdout + r.stderr
        host = json.loads(r.stdout)["hosts"][0]
        assert (host["reachable"], host["error"]) == (False, owned) and "impostor" not in r.stdout

        # A symlink to it is no way round: the socket it names is still nobody's.
        link = short_tmp / "link.sock"
        os.symlink(d.socket, link)
        r = robustctl("--socket", str(link), "status")
        assert r.returncode == 3 and r.stdout == "", r.stdout + r.stderr
        assert f"refusing {link}: {d.socket} is owned by uid 65534 (nobody), not root" in r.stderr, r.stderr


def test_the_adapters_and_the_slurm_hooks_refuse_a_socket_another_user_planted(short_tmp: Path) -> None:
    from robustd.adapters.common import client

    run = squat_dir(short_tmp)
    sock = str(run / "robustd.sock")
    with impostor(sock):
        # robustd-slurm, robustd-k8s and the hooks all dial through this one call path.
        with pytest.raises(client.Unreachable) as refused:
            client.get_verdict(sock, 5)
        assert str(refused.value).startswith(f"refusing {sock}: socket directory {run} is writable by group/others")
        os.chmod(run, 0o755)
        owned = f"refusing {sock}: it is owned by uid 65534 (nobody), not root"
        with pytest.raises(client.Unreachable, match=re.escape(owned)):
            client.get_verdict(sock, 5)
        with pytest.raises(client.Unreachable, match=re.escape(owned)):
            client.run_diagnostic(sock, "quick", 5)

        # A Slurm hook treats the impostor as an unreachable robustd: it fails open and asks Slurm nothing.
        calls = short_tmp / "calls.log"
        for tool in ("scontrol", "sinfo"):
            script = short_tmp / tool
            script.write_text(f"#!/bin/sh\necho {tool} \"$@\" >>{calls}\n")
            script.chmod(0o755)
        cfg = short_tmp / "robustd.yaml"
        cfg.write_text(yaml.safe_dump({"state_dir": str(short_tmp / "state"), "listen": {"unix": sock},
                                       "slurm": {"scontrol": str(short_tmp / "scontrol"),
                                                 "sinfo": str(short_tmp / "sinfo"), "node_name": "n1"}}))
        for verb in ("healthcheck", "prolog"):
            r = robustctl("slurm", verb, "--config", str(cfg))
            assert r.returncode == 0, r.stderr
            assert f"{owned}; another user may be impersonating robustd; " in r.stderr, r.stderr
            assert not calls.exists()
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
