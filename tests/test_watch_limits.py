"""Watch streams per caller (robustd/api/watch_slots.py): one uid cannot hold thousands of them, root keeps
a reserve, and a stream that ends gives its slot back. A real daemon, real streams from real uids."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest
from conftest import REPO, Daemon, need_root

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.api.watch_slots import WatchSlots
from robustd.authz import CertNames, Identity
from robustd.relay import UnixPeer

NOBODY = 65534
# Opens Watch streams as whatever uid it runs as, on command from stdin: `open N` answers one line with each
# stream's outcome (OK once its headers came, else the status and its message), `cancel` ends the newest.
WATCHER = r"""
import sys, grpc
from robustd.api.v1 import robustd_pb2 as pb, robustd_pb2_grpc as pb_grpc
stub = pb_grpc.NodeHealthStub(grpc.insecure_channel("unix://" + sys.argv[1]))
held = []
def open_one():
    call = stub.Watch(pb.WatchRequest(from_seq=0), timeout=120)
    if "robustd-head-seq" in dict(call.initial_metadata()):  # headers: registered; else the call has ended
        held.append(call)
        return "OK"
    return f"{call.code().name}: {call.details()}"
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "open":
        print(" | ".join(open_one() for _ in range(int(cmd[1]))), flush=True)
    elif cmd[0] == "cancel":
        held.pop().cancel()
        print("cancelled", flush=True)
"""


class Watcher:
    """A client process as `uid` that holds Watch streams on `d`'s Unix socket."""

    def __init__(self, d: Daemon, uid: int):
        self.proc = subprocess.Popen(["setpriv", "--reuid", str(uid), "--regid", str(NOBODY), "--clear-groups",
                                      sys.executable, "-c", WATCHER, d.socket], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)

    def ask(self, command: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().rstrip("\n").split(" | ")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def root_watch(ch: grpc.Channel) -> Any:
    """A Watch of this (root) process; its headers came, so the daemon admitted it."""
    call = pb_grpc.NodeHealthStub(ch).Watch(pb.WatchRequest(from_seq=0), timeout=120)
    assert "robustd-head-seq" in dict(call.initial_metadata()), (call.code(), call.details())
    return call


def test_watch_streams_are_capped_per_uid_and_root_keeps_its_reserve(make_daemon: Any) -> None:
    need_root("watching as other uids")
    # 8 streams in all; root's reserve is min(3, 8 // 2) = 3, so the other uids together hold at most 5.
    d = make_daemon({"listen": {"unix_mode": 0o666, "max_watches": 8, "max_watches_per_uid": 3},
                     "checks": {"kernel": {"enabled": False}}})
    d.start()
    for p in (d.root, d.root.parent):
        os.chmod(p, 0o711)  # let other uids reach the socket
    nobody, other = Watcher(d, NOBODY), Watcher(d, 60001)
    try:
        got = nobody.ask("open 4")
        assert got[:3] == ["OK"] * 3, got
        assert got[3] == ("RESOURCE_EXHAUSTED: uid 65534 already holds 3 Watch streams "
                          "(listen.max_watches_per_uid 3); end one first"), got
        with d.channel() as ch:
            mine = [root_watch(ch)]  # root is served while nobody is at its cap
            got = other.ask("open 3")  # 5 - 3: two left for the other uids, the rest is root's
            assert got[:2] == ["OK"] * 2, got
            assert got[2] == ("RESOURCE_EXHAUSTED: 6 Watch streams are open; the last 3 of listen.max_watches 8 "
                              "are kept for root"), got
            mine += [root_watch(ch), root_watch(ch)]  # root's reserve is all there: 8 open
            call = pb_grpc.NodeHealthStub(ch).Watch(pb.WatchRequest(from_seq=0), timeout=120)
            call.initial_metadata()
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "listen.max_watches_per_uid 3" in \
                call.details(), (call.code(), call.details())  # the per-uid cap holds for root too

            # A cancelled stream gives its slot back: the same uid is admitted again.
            assert nobody.ask("cancel") == ["cancelled"]
            deadline = time.monotonic() + 10
            while (got := nobody.ask("open 1")) != ["OK"]:
                assert time.monotonic() < deadline, got
                time.sleep(0.1)
            for c in mine:
                c.cancel()
        log = d.log()
        assert "Traceback" not in log, log
        assert "Watch refused for uid 65534: uid 65534 already holds 3 Watch streams" in log, log
    finally:
        nobody.close()
        other.close()
    assert d.stop() == 0


class FakeContext:
    """The two things WatchSlots reads of a call (its peer), and abort() as grpc.aio raises it."""

    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def test_certificates_and_anonymous_addresses_are_callers_with_the_same_cap() -> None:
    ids = {"ipv4:10.0.0.5:4000": Identity(cert=CertNames(dns=("sched.example",))),
           "ipv4:10.0.0.5:4001": Identity(cert=CertNames(dns=("sched.example",))),  # the same certificate
           "ipv4:10.0.0.6:4000": None, "ipv4:10.0.0.6:4001": None,  # no certificate: its address counts
           "unix:/run/x/c1": Identity(unix=UnixPeer(uid=0, gid=0, pid=1))}
    slots = WatchSlots(lambda ctx: ids[ctx.peer()], max_per_uid=1, max_total=4)

    async def run() -> None:
        first = await slots.admit(FakeContext("ipv4:10.0.0.5:4000"))
        with pytest.raises(RuntimeError, match=r"^RESOURCE_EXHAUSTED: certificate sched.example already holds 1 "
                                               r"Watch streams \(listen.max_watches_per_uid 1\)"):
            await slots.admit(FakeContext("ipv4:10.0.0.5:4001"))
        await slots.admit(FakeContext("ipv4:10.0.0.6:4000"))
        with pytest.raises(RuntimeError, match="address ipv4:10.0.0.6 already holds 1"):
            await slots.admit(FakeContext("ipv4:10.0.0.6:4001"))
        await slots.admit(FakeContext("unix:/run/x/c1"))  # root: its reserve (1) is untouched
        first.release()
        first.release()  # twice is once
        assert slots.open_by_caller == {"address ipv4:10.0.0.6": 1, "uid 0": 1}
        await slots.admit(FakeContext("ipv4:10.0.0.5:4001"))

    asyncio.run(run())
