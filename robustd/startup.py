"""What the daemon checks before it serves, each failure one plain line: the state lock, free ports, the socket path."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat

from robustd.relay import check_socket_dir
from robustd.roots import PROC_LOCKS


class StartError(Exception):
    """Why the daemon cannot start, as the one line the log shows (never a traceback)."""


def lock_state_dir(path: str) -> int | None:
    """flock(2) the state directory for this daemon's lifetime, so a second robustd on the same state fails
    at once naming the first, rather than waiting on SQLite's locks and then sharing its event log.

    None when the directory cannot be opened at all: the store then starts degraded and says why.
    """
    with contextlib.suppress(OSError):
        os.makedirs(path, mode=0o750, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _flock_holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StartError(f"state_dir {path} is in use by another robustd"
                             + (f" (pid {holder})" if holder else "")) from None
        return None  # a file system without flock: nothing to guard with
    return fd


def _flock_holder(fd: int) -> int | None:
    """The pid holding a flock on fd's file, from /proc/locks (`1: FLOCK ADVISORY WRITE <pid> <maj:min:ino> ...`)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open(PROC_LOCKS, encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == ident and parts[4].isdigit():
                    return int(parts[4])
    except OSError:
        pass
    return None


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); host "" means every interface. ValueError if malformed.

    The one check of a listening address (`listen.tcp`, `metrics.address`, both validated with it at load):
    the port is 1 to 65535. Port 0, which a socket takes as "any free port", is refused: clients could not
    know where to connect."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("expected host:port with a port from 1 to 65535")
    return host.strip("[]"), int(port)


def check_port(key: str, address: str) -> None:
    """Bind `host:port` once to say plainly why it cannot be listened on (gRPC only says it failed)."""
    try:
        host, port = split_address(address)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as e:
        raise StartError(f"{key}: cannot listen on {address}: {getattr(e, 'strerror', None) or e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
        try:
            probe.bind(addr)
        except OSError as e:
            raise StartError(f"{key}: cannot listen on {address}: {e.strerror or e}") from None


def prepare_socket_path(path: str) -> None:
    """Create the socket's directory; refuse one that others could write to (robustd/socketpath.py says why),
    and refuse to take over a live socket or a file that is not a socket.

    The directory is checked first, so that a file or listener another user planted is reported as what
    made it possible, not as a squatter to remove by hand. Nothing is removed here: UnixFront renames its new
    socket onto `path`, which atomically replaces a stale socket, or a symlink someone planted, without
    following it. Unlinking first would open a window in which another user could put a symlink at `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o755, exist_ok=True)
    check_socket_dir(directory)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return  # replaced by the rename, never followed (not even by a probe)
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody listens: a leftover from a crash, replaced by the rename
    finally:
        probe.close()
    raise RuntimeError(f"another process is already listening on {path}")
