"""Who may call what: caller identity per RPC, and the allowlist for disruptive RPCs.

Identity comes from the transport:

- TCP with TLS: the client certificate's names (SAN DNS/URI/..., and the CN), from the call's auth context.
- The Unix socket: the peer's uid, gid and supplementary groups from SO_PEERCRED/SO_PEERGROUPS. grpcio does
  not expose a connection's socket to servicers, so the public socket is accepted here (`UnixFront`): each
  connection's credentials are read at accept time, then its bytes are relayed to gRPC's private inner
  socket over a connection bound to a unique path in a 0700 directory. gRPC reports that path as the call's
  peer (`unix:/…/c17`), which maps back to the credentials. Nobody else can reach the inner socket, so a
  peer name cannot be forged.

Read-only RPCs are open to any caller the transport admitted (with `listen.tls.client_ca`, only holders of
a certificate that CA signed). Disruptive RPCs need an allowed identity: a certificate name in
`authz.disruptive.identities`, or on the Unix socket uid 0 or a member of a group in
`authz.disruptive.unix_groups`. Without an identity the answer is UNAUTHENTICATED, with one that is not
allowed PERMISSION_DENIED; either way the method never runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import itertools
import logging
import os
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from robustd.config import AuthzConfig

log = logging.getLogger("robustd.authz")

# Full method names of the RPCs that change state or load the node.
DISRUPTIVE = frozenset({
    "/robustd.v1.Diagnostics/Run",
    "/robustd.v1.Diagnostics/Cancel",
    "/robustd.v1.Diagnostics/RecordGolden",
    "/robustd.v1.NodeHealth/Acknowledge",
    "/robustd.v1.Tracer/CaptureStacks",  # pauses the training processes while it samples them
})
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
RELAY_CHUNK = 64 * 1024


@dataclass(frozen=True)
class UnixPeer:
    uid: int
    gid: int
    pid: int
    groups: frozenset[int] = field(default_factory=frozenset)

    def __str__(self) -> str:
        return f"uid {self.uid} (pid {self.pid})"


@dataclass(frozen=True)
class Identity:
    """Who called: a Unix peer, or the names on a verified client certificate."""

    unix: UnixPeer | None = None
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return str(self.unix) if self.unix else "certificate " + ", ".join(self.names)


def peer_credentials(sock: socket.socket) -> UnixPeer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    groups: set[int] = {gid}
    size = 64
    while size <= 65536:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * size)
        except OSError as e:
            if e.errno == 34:  # ERANGE: more groups than the buffer holds
                size *= 4
                continue
            break  # an old kernel: the primary gid only
        groups.update(struct.unpack(f"{len(raw) // 4}I", raw))
        break
    return UnixPeer(uid=uid, gid=gid, pid=pid, groups=frozenset(groups))


class UnixFront:
    """The public Unix socket: records each peer's credentials and relays it to gRPC's inner socket."""

    def __init__(self, path: str, mode: int, group: str | None = None):
        self.path = path
        self.mode = mode
        self.group = group
        parent = os.path.dirname(os.path.abspath(path))
        _sweep_stale(parent)
        self.dir = tempfile.mkdtemp(prefix=".robustd-", dir=parent)
        os.chmod(self.dir, 0o700)
        self.inner = os.path.join(self.dir, "s")
        self.peers: dict[str, UnixPeer] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def inner_address(self) -> str:
        return f"unix:{self.inner}"

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, self.path, limit=RELAY_CHUNK)
        if self.group is not None:  # members of this group can connect (mode 0660 by default)
            import grp

            os.chown(self.path, -1, grp.getgrnam(self.group).gr_gid)
        os.chmod(self.path, self.mode)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def lookup(self, peer: str) -> UnixPeer | None:
        return self.peers.get(peer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        key = ""
        try:
            creds = peer_credentials(writer.get_extra_info("socket"))
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
        except (OSError, asyncio.CancelledError) as e:
            if not isinstance(e, asyncio.CancelledError):
                log.debug("unix connection ended: %s", e)
        finally:
            self.peers.pop(key, None)
            writer.close()
            self._tasks.discard(task)


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


class Authorizer:
    def __init__(self, config: Callable[[], AuthzConfig], front: UnixFront | None):
        self.config = config
        self.front = front

    def identify(self, context: grpc.aio.ServicerContext) -> Identity | None:
        peer = context.peer() or ""
        if self.front is not None and peer.startswith("unix:"):
            creds = self.front.lookup(peer)
            return Identity(unix=creds) if creds else None
        auth = context.auth_context() or {}
        if auth.get("transport_security_type") != [b"ssl"]:
            return None
        names = [n.decode(errors="replace") for key in ("x509_subject_alternative_name", "x509_common_name")
                 for n in auth.get(key, [])]
        return Identity(names=tuple(dict.fromkeys(names))) if names else None

    def allowed(self, ident: Identity) -> bool:
        rules = self.config().disruptive
        if ident.unix is not None:
            if ident.unix.uid == 0:
                return True
            for name in rules.unix_groups:
                try:
                    gid = grp.getgrnam(name).gr_gid
                except KeyError:
                    continue
                if gid in ident.unix.groups:
                    return True
            return False
        return any(n in rules.identities for n in ident.names)

    async def check(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """Abort the call unless its caller may run `method` (a disruptive one)."""
        ident = self.identify(context)
        if ident is None:
            log.warning("%s refused: caller %s has no identity", method, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{method} needs an authenticated caller (a client certificate or the Unix socket)")
        elif not self.allowed(ident):
            log.warning("%s refused: %s is not allowed", method, ident)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{ident} may not call {method} (see authz.disruptive)")


class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of disruptive methods so the check runs, with the call's context, before them."""

    def __init__(self, authz: Authorizer):
        self.authz = authz

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method not in DISRUPTIVE:
            return handler
        authz = self.authz
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await authz.check(method, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await authz.check(method, context)
                async for msg in inner_us(request, context):
                    yield msg

            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        raise RuntimeError(f"{method}: a disruptive method of an unexpected kind")  # fail closed
