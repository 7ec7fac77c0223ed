"""Diagnostics.Triage: a failed job's logs and exit status in, its failure class and next step out; and
RecordTriage / GetTriage, where a node epilog leaves its verdict on a multi-node job for the controller's hook.

The judge (robustd.triage) is pure and CPU-bound; it runs in a worker thread so the event loop keeps
answering every other call, and at most `MAX_CONCURRENT` triages run at once (the rest wait their
turn), so a burst of requests cannot take all of asyncio's default executor from the daemon.

What a caller may send is bounded before anything is judged (INVALID_ARGUMENT otherwise, one short
line): at most `MAX_LOGS` logs, each named by 1 to `MAX_NAME` printable characters used only once;
an exit code of 0..255; a signal Linux knows. The whole request is bounded by gRPC itself
(`listen.max_message_bytes`: RESOURCE_EXHAUSTED), and of each log only its last `MAX_LOG_BYTES`
are judged, as `robustctl triage` reads only a file's tail.

The exit-code and signal rules are the library's (robustd/triage/status.py), shared by every edge.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from robustd import bounds
from robustd.api.requests import Invalid
from robustd.api.v1 import robustd_pb2 as pb
from robustd.triage import MAX_LOG_BYTES, MAX_LOGS, Evidence, LogText, Triage, to_json, triage
from robustd.triage.model import CLASSES, INFRA, MAX_NAME, NEXT
from robustd.triage.status import exit_code, signal_name

MAX_CONCURRENT = 2  # triages judged at once; more wait (each holds a worker thread and its logs)
MAX_OFFSET = (1 << 63) - 1
_INT32 = (1 << 31) - 1
_UINT32 = (1 << 32) - 1

_running: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
log = logging.getLogger("robustd.api.triage")


# --- the request ---------------------------------------------------------------------------------------

def log_name(name: str, where: str) -> str:
    if not name:
        raise Invalid(f"{where}.name is required")
    if len(name) > MAX_NAME:
        raise Invalid(f"{where}.name is {len(name)} characters; at most {MAX_NAME} are accepted")
    if not name.isprintable():
        raise Invalid(f"{where}.name must be printable (no control characters): {bounds.echo(name)}")
    return name


def logs_of(request: pb.TriageRequest, tail: int = MAX_LOG_BYTES) -> list[LogText]:
    """The request's logs as the judge reads them: each cut to its last `tail` bytes. Raises Invalid."""
    if len(request.logs) > MAX_LOGS:
        raise Invalid(f"{len(request.logs)} logs; at most {MAX_LOGS} are judged in one request")
    seen: dict[str, int] = {}
    out = []
    for i, log in enumerate(request.logs):
        where = f"logs[{i}]"
        name = log_name(log.name, where)
        if name in seen:
            raise Invalid(f"{where}.name {bounds.echo(name)} is also logs[{seen[name]}]'s: names must be unique")
        seen[name] = i
        if log.offset > MAX_OFFSET:
            raise Invalid(f"{where}.offset must be below 2^63 (got {log.offset})")
        data, offset = log.data, int(log.offset)
        if len(data) > tail:
            offset += len(data) - tail
            data = data[-tail:]
        out.append(LogText(name=name, data=data, offset=offset, whole=offset == 0))
    return out


def status_of(request: pb.TriageRequest) -> tuple[int | None, str | None]:
    """(exit_code, signal) of the request, normalised. Raises Invalid."""
    try:
        code = exit_code(request.exit_code if request.HasField("exit_code") else None)
    except ValueError as e:
        raise Invalid(f"exit_code: {e}") from None
    try:
        sig = signal_name(request.signal)
    except ValueError as e:
        raise Invalid(f"signal: {e}") from None
    return code, sig


# --- the answer ----------------------------------------------------------------------------------------

def response(t: Triage) -> pb.TriageResponse:
    """The judge's answer as a TriageResponse: the `robustctl triage --json` object, field for field."""
    doc = to_json(t)
    evidence = []
    for e in doc["evidence"]:
        ev = pb.TriageEvidence(file=e["file"], line=max(0, min(int(e["line"]), _UINT32)), text=e["text"],
                               offset=max(0, min(int(e["offset"]), MAX_OFFSET)))
        if e.get("rank") is not None and -_INT32 - 1 <= e["rank"] <= _INT32:
            ev.rank = e["rank"]
        evidence.append(ev)
    return pb.TriageResponse(**{"class": doc["class"]}, infra=doc["infra"], next=doc["next"],
                             level=doc.get("level") or "", evidence=evidence,
                             ranks=[r for r in doc.get("ranks", ()) if -_INT32 - 1 <= r <= _INT32],
                             reason=doc.get("reason") or "", partial=doc.get("partial", ()))


def response_json(resp: pb.TriageResponse) -> dict[str, Any]:
    """A TriageResponse as the `robustctl triage --json` object (absent keys left out as the CLI does)."""
    return to_json(triage_of(resp))


def triage_of(resp: pb.TriageResponse) -> Triage:
    """The judge's answer back from a TriageResponse (the inverse of `response`)."""
    evidence = tuple(Evidence(file=e.file, line=e.line, text=e.text, offset=e.offset,
                              rank=e.rank if e.HasField("rank") else None) for e in resp.evidence)
    return Triage(klass=getattr(resp, "class"), infra=resp.infra, next=resp.next, level=resp.level or None,
                  evidence=evidence, ranks=tuple(resp.ranks), reason=resp.reason, partial=tuple(resp.partial))


def judge(logs: Sequence[LogText], code: int | None, sig: str | None) -> pb.TriageResponse:
    return response(triage(logs, exit_code=code, signal=sig))


async def handle(request: pb.TriageRequest, context: grpc.aio.ServicerContext) -> pb.TriageResponse:
    """The Triage RPC: bounds first (INVALID_ARGUMENT), then the judge in a worker thread."""
    try:
        logs = logs_of(request)
        code, sig = status_of(request)
    except Invalid as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    loop = asyncio.get_running_loop()
    running = _running.get(loop)
    if running is None:
        running = _running[loop] = asyncio.Semaphore(MAX_CONCURRENT)
    async with running:
        try:
            return await asyncio.to_thread(judge, logs, code, sig)
        except Exception as e:  # noqa: BLE001 - a bug in the judge: one logged traceback, a short INTERNAL
            log.exception("Triage of %d logs failed", len(logs))
            await context.abort(grpc.StatusCode.INTERNAL, f"triage failed: {type(e).__name__}")
    raise AssertionError("unreachable")  # context.abort raises


# --- the node epilogs' verdicts (RecordTriage / GetTriage) ------------------------------------------------

MAX_JOBS = 512  # verdicts kept; the oldest goes first
KEEP_FOR = 3600.0  # seconds a verdict is kept: the controller reads it within seconds of the job's end
MAX_JOB_ID = 64
MAX_KEPT_EVIDENCE = 8  # evidence lines kept with a recorded verdict (each line is already clipped by the judge)
MAX_KEPT_TEXT = 1024  # characters of a recorded reason or evidence line


def job_id_of(text: str) -> str:
    if not text:
        raise Invalid("job_id is required")
    if len(text) > MAX_JOB_ID or not text.isprintable() or any(c.isspace() for c in text):
        raise Invalid(f"job_id must be 1 to {MAX_JOB_ID} printable characters without spaces: {bounds.echo(text)}")
    return text


def recorded_verdict(resp: pb.TriageResponse) -> pb.TriageResponse:
    """A recorded verdict checked against the judge's vocabulary and cut to a bounded size. Raises Invalid."""
    klass = getattr(resp, "class")
    for name, value, allowed in (("class", klass, CLASSES), ("infra", resp.infra, INFRA), ("next", resp.next, NEXT)):
        if value not in allowed:
            raise Invalid(f"verdict.{name} {bounds.echo(value)} is not one of {', '.join(allowed)}")
    out = pb.TriageResponse()
    out.CopyFrom(resp)
    del out.evidence[MAX_KEPT_EVIDENCE:]
    for e in out.evidence:
        e.text, e.file = e.text[:MAX_KEPT_TEXT], e.file[:MAX_NAME]
    del out.ranks[64:]
    del out.partial[16:]
    out.reason, out.level = out.reason[:MAX_KEPT_TEXT], out.level[:256]
    return out


class JobTriages:
    """The verdicts node epilogs recorded, by job id: bounded in count and age, in memory only."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._jobs: OrderedDict[str, pb.JobTriage] = OrderedDict()

    def record(self, request: pb.RecordTriageRequest) -> None:
        job = job_id_of(request.job_id)
        entry = pb.JobTriage(job_id=job)
        if request.HasField("verdict"):
            entry.verdict.CopyFrom(recorded_verdict(request.verdict))
        entry.recorded_at.FromNanoseconds(int(self._clock() * 1e9))
        self._jobs.pop(job, None)
        self._jobs[job] = entry
        while len(self._jobs) > MAX_JOBS:
            self._jobs.popitem(last=False)

    def get(self, job_id: str) -> pb.JobTriage | None:
        job = job_id_of(job_id)
        cutoff = self._clock() - KEEP_FOR
        while self._jobs:
            oldest = next(iter(self._jobs.values()))
            if oldest.recorded_at.ToNanoseconds() / 1e9 >= cutoff:
                break
            self._jobs.popitem(last=False)
        return self._jobs.get(job)
