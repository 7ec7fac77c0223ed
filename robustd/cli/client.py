"""One daemon address as robustctl sees it: channels, deadlines, and gRPC failures as exit codes.

Kept apart from robustctl's main module so that `python -m robustd.cli.robustctl` and the verbs'
own modules share one CliError class.
"""

from __future__ import annotations

import os
from typing import Any

import grpc

from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.cli import exitcodes
from robustd.durations import format_duration
from robustd.socketpath import UntrustedSocket, check_socket

EXIT_UNREACHABLE = exitcodes.UNREACHABLE
EXIT_RPC = exitcodes.RPC
EXIT_USAGE = exitcodes.USAGE
MISSING_SOCKET_HINT = " (is robustd running? give its socket with --socket PATH or ROBUSTD_SOCKET=PATH)"


class CliError(Exception):
    """A failure with its exit code and the one line to print."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Client:
    """One daemon address; opens channels and turns gRPC failures into CliErrors."""

    def __init__(self, socket: str | None, address: str | None, timeout: float,
                 tls: tuple[str | None, str | None, str | None] = (None, None, None), socket_hint: bool = True):
        self.socket_hint = socket_hint  # a missing socket names --socket/ROBUSTD_SOCKET (not for fleet hosts)
        self.socket = os.path.abspath(socket) if socket else None
        self.target = address if address else f"unix://{self.socket}"
        self.timeout = timeout
        self.tls = tls  # (CA, client certificate, client key) for a TLS listener

    def open(self) -> grpc.Channel:
        if self.socket is not None:
            if not os.path.exists(self.socket):
                # ENOENT: say it plainly, do not wait out the deadline, and say how to name another socket
                raise self.unreachable(os.strerror(2) + (MISSING_SOCKET_HINT if self.socket_hint else ""))
            try:  # another user's socket would answer in robustd's name (robustd/socketpath.py)
                check_socket(self.socket)
            except UntrustedSocket as e:
                raise CliError(EXIT_UNREACHABLE, str(e)) from None
            except OSError as e:
                raise self.unreachable(e.strerror or str(e)) from None
        # A local subchannel pool: a reconnect must not inherit the old connection's backoff.
        options = [("grpc.use_local_subchannel_pool", 1)]
        ca, cert, key = self.tls
        if self.socket is None and ca:
            try:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=_read_bytes(ca), certificate_chain=_read_bytes(cert) if cert else None,
                    private_key=_read_bytes(key) if key else None)
            except OSError as e:
                raise CliError(EXIT_USAGE, f"cannot read TLS file {e.filename}: {e.strerror}") from None
            return grpc.secure_channel(self.target, creds, options=options)
        return grpc.insecure_channel(self.target, options=options)

    def unreachable(self, reason: str) -> CliError:
        return CliError(EXIT_UNREACHABLE, f"cannot reach robustd at {self.target}: {reason}")

    def error(self, err: grpc.RpcError, channel: grpc.Channel | None) -> CliError:
        code, details = err.code(), err.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.DEADLINE_EXCEEDED and not _ready(channel)):
            # "failed to connect to all addresses; last error: UNKNOWN: unix:/x: Connection refused"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return self.unreachable(f"no connection within {format_duration(self.timeout)}")
            reason = details.rsplit(": ", 1)[-1] if "last error" in details else details
            return self.unreachable(reason or code.name)
        return CliError(EXIT_RPC, f"{code.name}: {details}" if details else code.name)

    def call(self, method: str, request: Any, service: str = "NodeHealth", timeout: float | None = None) -> Any:
        channel = self.open()
        try:
            stub = getattr(pb_grpc, f"{service}Stub")(channel)
            return getattr(stub, method)(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as err:
            raise self.error(err, channel) from None
        finally:
            channel.close()


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _ready(channel: grpc.Channel | None) -> bool:
    """Whether the channel got connected: a deadline before that means unreachable, after it a stuck daemon.

    Asked of the core channel directly; the public subscribe() races close() and prints a traceback.
    """
    try:
        state = channel._channel.check_connectivity_state(False)  # type: ignore[attr-defined]
    except Exception:
        return False
    return bool(state == grpc.ChannelConnectivity.READY.value[0])
