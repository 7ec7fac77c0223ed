"""The daemon's gRPC API as robustd-slurm uses it: GetVerdict, Watch, Diagnostics.Run, over the Unix socket."""

from __future__ import annotations

import os
from typing import Any

import grpc

from robustd.adapters.slurm.model import Cond, action_name, severity_name
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

OUTCOMES = {pb.OUTCOME_PASS: "PASS", pb.OUTCOME_FAIL: "FAIL", pb.OUTCOME_CANCELLED: "CANCELLED",
            pb.OUTCOME_ERROR: "ERROR", pb.OUTCOME_RUNNING: "RUNNING"}


class Unreachable(Exception):
    """robustd did not answer: the adapter changes nothing (a down daemon must not drain a fleet)."""


def open_channel(socket: str) -> grpc.Channel:
    if not os.path.exists(socket):
        raise Unreachable(f"no robustd socket at {socket}")
    # A local subchannel pool: a reconnect must not inherit the previous connection's backoff.
    return grpc.insecure_channel(f"unix://{socket}", options=[("grpc.use_local_subchannel_pool", 1)])


def cond(c: Any) -> Cond:
    return Cond(component=c.component, code=c.code, severity=severity_name(c.severity),
                action=action_name(c.action), seq=int(c.seq))


def get_verdict(socket: str, timeout: float) -> pb.Verdict:
    channel = open_channel(socket)
    try:
        return pb_grpc.NodeHealthStub(channel).GetVerdict(pb.GetVerdictRequest(), timeout=timeout)
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


def report_summary(r: pb.DiagnosticReport) -> str:
    """One line: what failed, on what, and what would fix it."""
    failed = sorted({x.test for x in r.results if x.status == pb.RESULT_FAIL})
    suspects = ", ".join(list(r.suspects)[:4]) + (f" +{len(r.suspects) - 4} more" if len(r.suspects) > 4 else "")
    action = action_name(r.action)
    return f"{','.join(failed) or 'tests'} failed on {suspects or 'the node'} (action {action})"
