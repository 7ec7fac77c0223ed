"""The public Unix socket: each caller's credentials read at accept time, its bytes relayed to gRPC.

grpcio does not expose a connection's socket to servicers, so the public socket is accepted here
(`UnixFront`): each connection's credentials (uid, gid, supplementary groups from
SO_PEERCRED/SO_PEERGROUPS) are read at accept time, then its bytes are relayed to gRPC's private inner
socket over a connection bound to a unique path in a 0700 directory. gRPC reports that path as the call's
peer (`unix:/…/c17`), which maps back to the credentials (robustd/authz.py decides what they may call).
Nobody else can reach the inner socket, so a peer name cannot be forged.

The socket is bound inside that private directory, given its mode and group there, and renamed onto the
public path: nothing is ever chmod'ed or chown'ed through a path another user could swap a symlink into,
and a socket directory that others can write to (sticky or not) is refused (robustd/socketpath.py).

The relay is bounded (design rule 7): every relayed connection holds three descriptors, so connections are
counted per uid and in total (`listen.max_connections_per_uid`, `listen.max_connections`), and one that
sends nothing within `listen.handshake_timeout` is closed (a gRPC client sends its HTTP/2 preface at once).
The per-uid cap applies to every uid, root included; the other uids together may hold at most
`max_connections` minus root's reserve (`min(max_connections_per_uid, max_connections // 2)`), so a flood
from unprivileged users never locks out an operator or a scheduler running as root. The excess is accepted
and closed at once, so its client sees the connection end instead of hanging in the backlog. Hand-written
rather than asyncio.start_unix_server because that server logs a traceback per failed accept and spins
on EMFILE; this loop backs off and logs at most one line per 10 s (robustd/ratelog.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import grp
import itertools
import logging
import os
import resource
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass, field

from robustd.ratelog import RateLimitedLog
from robustd.socketpath import directory_problem, trusted_uids

log = logging.getLogger("robustd.relay")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
RELAY_CHUNK = 64 * 1024
FDS_PER_RELAY = 3  # the caller's connection, ours to the inner socket, and gRPC's end of it
FD_HEADROOM = 1024  # descriptors for everything else: gRPC, SQLite, checks, the diagnostics' pipes
LISTEN_BACKLOG = 512
ACCEPT_RETRY = (0.05, 1.0)  # first and longest pause after a failed accept (EMFILE stays "readable")
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class UnixPeer:
    uid: int
    gid: int
    pid: int
    groups: frozenset[int] = field(default_factory=frozenset)

    def __str__(self) -> str:
        return f"uid {self.uid} (pid {self.pid})"


def peer_credentials(sock: socket.socket) -> UnixPeer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    groups: set[int] = {gid}
    size = 64
    while size <= 65536:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * size)
        except OSError as e:
            if e.errno == errno.ERANGE:  # more groups than the buffer holds
                size *= 4
                continue
            break  # an old kernel: the primary gid only
        groups.update(struct.unpack(f"{len(raw) // 4}I", raw))
        break
    return UnixPeer(uid=uid, gid=gid, pid=pid, groups=frozenset(groups))


# -- the socket's directory and descriptors -------------------------------------------------------------

def check_socket_dir(directory: str) -> None:
    """Refuse a socket directory where another local user could take the socket's name or swap it.

    In a directory that others may write to, sticky or not, anyone can bind a socket of their own at the
    path while robustd is down, or plant a file there so that it cannot start; where it is not sticky they
    can also replace the entries robustd creates, e.g. put a symlink where the socket or the relay's
    private directory is about to be, and have root act on a file of their choosing. The rules, shared with
    the clients' check, are robustd/socketpath.py's. Raises RuntimeError with one line that names the
    directory and what to use instead.
    """
    problem = directory_problem(directory, trusted_uids())
    if problem is not None:
        raise RuntimeError(f"listen.unix: {problem}")


def raise_fd_limit(connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force.

    systemd (and most login sessions) start a process with a soft limit of 1,024, for the sake of
    programs that still use select() (FD_SETSIZE), and a far higher hard limit that a program using
    poll/epoll is expected to raise itself. robustd is such a program (asyncio and gRPC use epoll), and the
    relay holds three descriptors per connection: at 1,024 a few hundred idle connections would make
    every accept, open() and socket() in the daemon fail. The unit also sets LimitNOFILE=. A limit that
    cannot hold `listen.max_connections` relays is logged, since connections beyond it fail at accept.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
    need = FDS_PER_RELAY * connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("the open-file limit is %d: too low for listen.max_connections %d (%d descriptors each, "
                    "about %d in all); set LimitNOFILE= higher or lower listen.max_connections", soft,
                    connections, FDS_PER_RELAY, need)
    return soft


# -- the Unix socket relay ------------------------------------------------------------------------------

class UnixFront:
    """The public Unix socket: records each peer's credentials and relays it to gRPC's inner socket.

    The socket is bound under a private name in robustd's own 0700 directory, given its mode and group
    there, and only then renamed onto the public path: nobody sees it before its permissions are right, and
    rename() replaces whatever is at the path (a stale socket, or a symlink someone planted) without
    following it. Nothing is ever chmod'ed or chown'ed through the public path.
    """

    def __init__(self, path: str, mode: int, group: str | None = None, *, max_connections: int = 256,
                 max_connections_per_uid: int = 64, handshake_timeout: float = 10.0):
        self.path = path
        self.mode = mode
        self.group = group
        self.max_connections = max_connections
        self.max_per_uid = max_connections_per_uid
        self.root_reserve = min(max_connections_per_uid, max_connections // 2)
        self.handshake_timeout = handshake_timeout
        parent = os.path.dirname(os.path.abspath(path))
        check_socket_dir(parent)
        _sweep_stale(parent)
        self.dir = tempfile.mkdtemp(prefix=".robustd-", dir=parent)  # mode 0700, a name nobody could have taken
        self.inner = os.path.join(self.dir, "s")
        self.peers: dict[str, UnixPeer] = {}
        self.open_by_uid: collections.Counter[int] = collections.Counter()
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._refusals = RateLimitedLog(log)
        self._errors = RateLimitedLog(log)

    @property
    def inner_address(self) -> str:
        return f"unix:{self.inner}"

    @property
    def open_connections(self) -> int:
        return sum(self.open_by_uid.values())

    async def start(self) -> None:
        raise_fd_limit(self.max_connections)
        private = os.path.join(self.dir, "listen")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(private)
            if self.group is not None:  # members of this group can connect (mode 0660 by default)
                os.chown(private, -1, grp.getgrnam(self.group).gr_gid, follow_symlinks=False)
            os.chmod(private, self.mode)  # in our 0700 directory: no one can have put a symlink here
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
            os.rename(private, self.path)  # atomic; replaces a stale socket or a symlink, never follows one
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._acceptor = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._refusals.cancel()
        self._errors.cancel()
        shutil.rmtree(self.dir, ignore_errors=True)

    def lookup(self, peer: str) -> UnixPeer | None:
        return self.peers.get(peer)

    async def _accept_loop(self) -> None:
        """Accept forever; on a failed accept, pause and log at most one line per ratelog.LOG_INTERVAL.

        Our own loop rather than asyncio.start_unix_server: when accept() fails with EMFILE the listening
        socket stays readable, and asyncio's server logs a traceback for each attempt; here the loop backs
        off (up to ACCEPT_RETRY[1]) instead of spinning, and the log line says what happened once.
        """
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        pause = ACCEPT_RETRY[0]
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as e:
                hint = " (the open-file limit is reached; see listen.max_connections)" \
                    if e.errno in _RESOURCE_ERRORS else ""
                self._errors("failed accepts on the Unix socket", "Unix socket %s: accept failed: %s%s; "
                             "retrying in %.2fs", self.path, e.strerror or e, hint, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, ACCEPT_RETRY[1])
                continue
            pause = ACCEPT_RETRY[0]
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            creds = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        refusal = self._refusal(creds.uid)
        if refusal is not None:
            conn.close()  # accepted and closed at once: the client sees the end, not a hang
            self._refusals("refused connections on the Unix socket", "Unix socket %s: refused a connection "
                           "from %s: %s", self.path, creds, refusal)
            return
        self.open_by_uid[creds.uid] += 1
        started: list[bool] = []  # the relay appends once it owns `conn` (a task cancelled early never does)
        task = asyncio.get_running_loop().create_task(self._relay(conn, creds, started))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._release(t, conn, creds.uid, started))

    def _refusal(self, uid: int) -> str | None:
        """Why a new connection from `uid` is over the limits, or None to admit it."""
        mine = self.open_by_uid[uid]
        total = self.open_connections
        if mine >= self.max_per_uid:
            return f"it already holds {mine} connections (listen.max_connections_per_uid)"
        if total >= self.max_connections:
            return f"{total} connections are open (listen.max_connections)"
        if uid != 0 and total - self.open_by_uid[0] >= self.max_connections - self.root_reserve:
            return (f"{total} connections are open; the last {self.root_reserve} of listen.max_connections are "
                    "kept for root")
        return None

    def _release(self, task: asyncio.Task[None], conn: socket.socket, uid: int, started: list[bool]) -> None:
        self._tasks.discard(task)
        if not started:
            conn.close()  # cancelled before it ran; otherwise the relay's transport closes it
        elif not task.cancelled() and task.exception() is not None:
            log.error("Unix socket relay failed", exc_info=task.exception())
        self.open_by_uid[uid] -= 1
        if self.open_by_uid[uid] <= 0:
            del self.open_by_uid[uid]

    async def _relay(self, conn: socket.socket, creds: UnixPeer, started: list[bool]) -> None:
        started.append(True)
        key = ""
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=RELAY_CHUNK)
            try:  # until the first bytes arrive this connection holds one descriptor, not three
                first = await asyncio.wait_for(reader.read(RELAY_CHUNK), self.handshake_timeout)
            except TimeoutError:
                log.debug("Unix connection from %s closed: nothing sent within listen.handshake_timeout", creds)
                return
            if not first:
                return
            out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bound = os.path.join(self.dir, f"c{next(self._ids)}")
            try:
                out.bind(bound)
                key = f"unix:{bound}"
                self.peers[key] = creds
                out.setblocking(False)
                await asyncio.get_running_loop().sock_connect(out, self.inner)
            except OSError:
                out.close()
                raise
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(bound)  # the kernel keeps the name for the peer; the file is not needed
            inner_reader, inner_writer = await asyncio.open_unix_connection(sock=out, limit=RELAY_CHUNK)
            inner_writer.write(first)
            pumps = {asyncio.ensure_future(_pump(reader, inner_writer)),
                     asyncio.ensure_future(_pump(inner_reader, writer))}
            try:  # until both directions end (half-close is normal), or one of them fails
                done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()
            finally:
                for t in pumps:
                    t.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                inner_writer.close()
        except OSError as e:
            if e.errno in _RESOURCE_ERRORS:
                self._errors("failed accepts on the Unix socket", "Unix socket %s: cannot relay a connection "
                             "from %s: %s (the open-file limit is reached; see listen.max_connections)",
                             self.path, creds, e.strerror)
            else:
                log.debug("Unix connection ended: %s", e)
        finally:
            self.peers.pop(key, None)
            if writer is not None:
                writer.close()
            else:
                conn.close()  # no transport was made for it


def _sweep_stale(parent: str) -> None:
    """Remove private directories a killed robustd left behind: ours, and nobody listens in them."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for e in entries:
        if not e.name.startswith(".robustd-") or not e.is_dir(follow_symlinks=False):
            continue
        try:
            if e.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
        except OSError:
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.path.join(e.path, "s"))
        except OSError:
            shutil.rmtree(e.path, ignore_errors=True)
        finally:
            probe.close()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(RELAY_CHUNK):
            dst.write(data)
            await dst.drain()
    finally:
        if dst.can_write_eof():
            with contextlib.suppress(OSError):
                dst.write_eof()


# -- certificate identities ------------------------------------------------------------------------------
