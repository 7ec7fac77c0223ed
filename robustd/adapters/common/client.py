"""The daemon's gRPC API as an adapter uses it, over the Unix socket: GetVerdict, Watch, Diagnostics.Run and
Tracer.CaptureStacks. Wire values become plain ones here (Cond, robustd's enums); nothing past this module
sees protobuf but the report a run returns."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_status import rpc_status

from robustd.adapters.common.model import Cond, action_of, severity_of
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.socketpath import UntrustedSocket, check_socket

log = logging.getLogger("robustd.adapters")
OUTCOMES = {pb.OUTCOME_PASS: "PASS", pb.OUTCOME_FAIL: "FAIL", pb.OUTCOME_CANCELLED: "CANCELLED",
            pb.OUTCOME_ERROR: "ERROR", pb.OUTCOME_RUNNING: "RUNNING"}


class Unreachable(Exception):
    """robustd did not answer: the adapter changes nothing (a down daemon must not drain a fleet)."""


def open_channel(socket: str) -> grpc.Channel:
    """A channel to robustd's socket, once the socket is known to be robustd's (robustd/socketpath.py): another
    user's listener at the path would otherwise answer "OK, 0 conditions" in its name. Unreachable if not."""
    if not os.path.exists(socket):
        raise Unreachable(f"no robustd socket at {socket}")
    try:
        check_socket(socket)
    except UntrustedSocket as e:
        raise Unreachable(str(e)) from None
    except OSError as e:
        raise Unreachable(f"robustd socket {socket}: {e.strerror or e}") from None
    # A local subchannel pool: a reconnect must not inherit the previous connection's backoff.
    return grpc.insecure_channel(f"unix://{socket}", options=[("grpc.use_local_subchannel_pool", 1)])


def cond(c: Any) -> Cond:
    return Cond(component=c.component, code=c.code, severity=severity_of(c.severity), action=action_of(c.action),
                seq=int(c.seq))


def get_verdict(socket: str, timeout: float) -> pb.Verdict:
    channel = open_channel(socket)
    try:
        return pb_grpc.NodeHealthStub(channel).GetVerdict(pb.GetVerdictRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise Unreachable(f"robustd at {socket}: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()


def evidence(socket: str, components: Sequence[str], codes: Sequence[str], reason: str, timeout: float) -> str | None:
    """Evidence.Create: the id of a bundle robustd keeps for this decision, or None (logged, with why) when it
    could not make one within `timeout`. Never raises: a drain must not wait on, nor fail for, its evidence."""
    try:
        channel = open_channel(socket)
    except Unreachable as e:
        log.warning("no evidence bundle for %r: %s", reason, e)
        return None
    try:
        req = pb.CreateEvidenceRequest(components=list(components)[:16], codes=list(codes)[:16],
                                       reason=reason.encode()[:512].decode(errors="ignore"))
        return str(pb_grpc.EvidenceStub(channel).Create(req, timeout=timeout).id)
    except grpc.RpcError as e:
        log.warning("no evidence bundle for %r: robustd at %s: %s: %s", reason, socket, e.code().name, e.details())
    except Exception as e:  # noqa: BLE001 - whatever goes wrong, the caller's decision goes on without an id
        log.warning("no evidence bundle for %r: %s: %s", reason, type(e).__name__, e)
    finally:
        channel.close()
    return None


def record_triage(socket: str, job: str, verdict: pb.TriageResponse | None, timeout: float) -> None:
    """Diagnostics.RecordTriage: leave this node's verdict on `job` (None: no log read) for the controller."""
    channel = open_channel(socket)
    try:
        req = pb.RecordTriageRequest(job_id=job)
        if verdict is not None:
            req.verdict.CopyFrom(verdict)
        pb_grpc.DiagnosticsStub(channel).RecordTriage(req, timeout=timeout)
    except grpc.RpcError as e:
        raise Unreachable(f"robustd at {socket}: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()


def run_diagnostic(socket: str, level: str, run_timeout: float, force: bool = False,
                   holder: list[Any] | None = None) -> pb.DiagnosticReport:
    """Diagnostics.Run at `level`, bounded by `run_timeout` (the daemon's limit, plus a margin for our deadline).

    `holder` receives the live call, so another thread (a stop signal) can cancel it.
    """
    channel = open_channel(socket)
    try:
        req = pb.RunRequest(level=level, force=force)
        req.timeout.FromNanoseconds(int(run_timeout * 1e9))
        call = pb_grpc.DiagnosticsStub(channel).Run(req, timeout=run_timeout + 30)
        if holder is not None:
            holder.append(call)
        report = None
        for msg in call:
            if msg.phase == pb.DiagnosticProgress.PHASE_DONE:
                report = msg.report
        if report is None:
            raise Unreachable("Diagnostics.Run ended without a report")
        return report
    except grpc.RpcError as e:
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            raise Unreachable(f"robustd at {socket}: {code.name}: {e.details()}") from None
        raise DiagnosticRefused(f"{code.name}: {e.details()}") from None
    finally:
        channel.close()


class DiagnosticRefused(Exception):
    """The daemon answered Diagnostics.Run with an error (another run, unknown level, not authorized, ...)."""


class CaptureRefused(Exception):
    """The daemon answered Tracer.CaptureStacks with an error; `code` is its gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class NotTraceable(CaptureRefused):
    """CaptureStacks refused because the selector named processes that are not training processes; `pids` and
    `ranks` say which, read from the status's details (pb.NotTraceable), never from its text."""

    def __init__(self, details: str, pids: tuple[int, ...], ranks: tuple[int, ...]):
        super().__init__(grpc.StatusCode.NOT_FOUND, details)
        self.pids = pids
        self.ranks = ranks


def capture_stacks(socket: str, pids: list[int], timeout: float) -> pb.CaptureResponse:
    """Tracer.CaptureStacks of `pids`, bounded by `timeout`. Unreachable when robustd does not answer,
    NotTraceable when some pids are not training processes, CaptureRefused for any other error."""
    channel = open_channel(socket)
    try:
        return pb_grpc.TracerStub(channel).CaptureStacks(
            pb.CaptureRequest(selector=pb.ProcessSelector(pids=pids)), timeout=timeout)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            raise Unreachable(f"robustd at {socket}: {code.name}: {details}") from None
        refused = not_traceable(e) if code == grpc.StatusCode.NOT_FOUND else None
        if refused is not None:
            raise NotTraceable(details, tuple(refused.pids), tuple(refused.ranks)) from None
        raise CaptureRefused(code, details) from None
    finally:
        channel.close()


def not_traceable(err: grpc.RpcError) -> pb.NotTraceable | None:
    """The pb.NotTraceable in a call's rich status (google.rpc.Status details), if it carries one."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type] - a failed call is a grpc.Call
    except ValueError:  # details that contradict the call's own code or message: none to trust
        return None
    for detail in status.details if status is not None else ():
        if detail.Is(pb.NotTraceable.DESCRIPTOR):
            found = pb.NotTraceable()
            detail.Unpack(found)
            return found
    return None


def report_summary(r: pb.DiagnosticReport) -> str:
    """One line: what failed, on what, and what would fix it."""
    failed = sorted({x.test for x in r.results if x.status == pb.RESULT_FAIL})
    suspects = ", ".join(list(r.suspects)[:4]) + (f" +{len(r.suspects) - 4} more" if len(r.suspects) > 4 else "")
    action = action_of(r.action).name
    return f"{','.join(failed) or 'tests'} failed on {suspects or 'the node'} (action {action})"
