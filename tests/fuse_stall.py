"""A FUSE file system that stops answering, for tests that need a real process in uninterruptible sleep.

No FUSE library is installed here (no libfuse, fusepy or fusermount), so this speaks the kernel's
protocol on /dev/fuse itself, which needs root: mount(2) with `fd=N`, then read requests and write
replies. It answers FUSE_INIT, the root's GETATTR and every LOOKUP but one name, `STALL`, which it
holds unanswered until `release()`: the process that looked it up waits in the kernel like a reader of
a dead NFS mount.

How that waiter gets to `D`: fuse's request_wait_answer() first sleeps interruptibly (`S`); a caught
signal moves it on to wait_event_killable(), TASK_KILLABLE, which /proc shows as `D` (uninterruptible:
only SIGKILL or an answer ends it). `stall()` starts the child, waits until it sleeps in the request,
then sends it SIGUSR1 (it has a handler, so the signal is delivered, not ignored).

`close()` (and leaving the `with`) kills the child, aborts the connection (closing /dev/fuse ends
every pending request with ENOTCONN) and detaches the mount, whatever state the test left it in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

STALL = "stall"
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
_OUT_HEADER = struct.Struct("<IiQ")  # len error unique
_LOOKUP, _FORGET, _GETATTR, _INIT, _INTERRUPT, _DESTROY, _BATCH_FORGET = 1, 2, 3, 26, 36, 38, 42
_NO_REPLY = (_FORGET, _BATCH_FORGET, _INTERRUPT)  # the kernel expects no answer to these (INTERRUPT: on purpose)
# fuse_attr (88 bytes): ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid gid
# rdev blksize flags
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_CHILD = ("import os, signal, sys\n"
          "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
          "try:\n    os.stat(sys.argv[1])\nexcept OSError as e:\n    sys.exit(e.errno)\n")


def _attr_out() -> bytes:
    """fuse_attr_out for the root: a directory, attributes valid for an hour."""
    attr = _ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, 0o40755, 2, 0, 0, 0, 4096, 0)
    return struct.pack("<QII", 3600, 0, 0) + attr


class FuseStall:
    """A mounted FUSE file system at `mountpoint` whose `STALL` never answers until released."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.child: subprocess.Popen[bytes] | None = None
        self._held: int | None = None  # the unique id of the LOOKUP of STALL
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0".encode()
        if _LIBC.mount(b"robustd-test", str(mountpoint).encode(), b"fuse", _MS_NOSUID | _MS_NODEV, opts) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"mount fuse on {mountpoint}: {os.strerror(err)}")
        self._thread = threading.Thread(target=self._serve, name="fuse-stall", daemon=True)
        self._thread.start()

    def __enter__(self) -> FuseStall:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- the server ------------------------------------------------------------------------------
    def _reply(self, unique: int, error: int = 0, body: bytes = b"") -> None:
        try:
            os.write(self._fd, _OUT_HEADER.pack(_OUT_HEADER.size + len(body), -error, unique) + body)
        except OSError as e:
            if e.errno != errno.ENOENT:  # ENOENT: the request was interrupted meanwhile
                raise

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.1)
            if not ready:
                continue
            try:
                data = os.read(self._fd, 1 << 20)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted, or the connection was aborted
            _, opcode, unique, nodeid, *_ = _IN_HEADER.unpack_from(data)
            body = data[_IN_HEADER.size:]
            if opcode == _INIT:
                major, minor = struct.unpack_from("<II", body)
                # fuse_init_out (7.23+ layout, 64 bytes): major minor max_readahead flags max_background
                # congestion_threshold max_write time_gran max_pages map_alignment flags2 max_stack_depth unused[6]
                out = struct.pack("<IIIIHHIIHHII24x", 7, min(minor, 31), 0, 0, 1, 1, 4096, 1, 1, 0, 0, 0)
                self._reply(unique, 0 if major == 7 else errno.EPROTO, out)
            elif opcode == _GETATTR and nodeid == 1:
                self._reply(unique, 0, _attr_out())
            elif opcode == _LOOKUP and body.rstrip(b"\0") == STALL.encode():
                with self._lock:
                    self._held = unique
            elif opcode == _LOOKUP:
                self._reply(unique, errno.ENOENT)
            elif opcode in _NO_REPLY:
                continue
            elif opcode == _DESTROY:
                self._reply(unique)
                return
            else:
                self._reply(unique, errno.ENOSYS)

    # -- the stuck process -----------------------------------------------------------------------
    def stall(self, timeout: float = 5.0) -> int:
        """Start a process that looks STALL up and leave it in `D`; its pid."""
        self.child = subprocess.Popen([sys.executable, "-c", _CHILD, str(self.mountpoint / STALL)],
                                      stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while self._held is None or state(self.child.pid) != "S":
            assert self.child.poll() is None, f"the stalling child exited: {self.child.returncode}"
            assert time.monotonic() < deadline, f"the child did not block in the lookup (state {state(self.child.pid)})"
            time.sleep(0.02)
        os.kill(self.child.pid, signal.SIGUSR1)
        while state(self.child.pid) != "D":
            assert time.monotonic() < deadline, f"the child did not enter D (state {state(self.child.pid)})"
            time.sleep(0.02)
        return self.child.pid

    def release(self, timeout: float = 5.0) -> None:
        """Answer the held lookup (ENOENT): the child's stat returns and it exits."""
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            self._reply(held, errno.ENOENT)
        if self.child is not None:
            self.child.wait(timeout=timeout)

    def close(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()  # a TASK_KILLABLE sleep ends on SIGKILL
        self._stop.set()
        self._thread.join(timeout=2)
        os.close(self._fd)  # aborts the connection: every request still pending fails with ENOTCONN
        _LIBC.umount2(str(self.mountpoint).encode(), _MNT_DETACH)
        if self.child is not None:
            self.child.wait(timeout=5)


def state(pid: int) -> str:
    """The process's state letter from /proc/<pid>/stat, or "" once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rindex(")") + 2]
