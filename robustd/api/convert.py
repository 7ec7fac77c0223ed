"""Model ↔ protobuf. Kept apart so the servicer reads as the API contract and nothing else."""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from robustd.api.v1 import robustd_pb2 as pb
from robustd.model import Condition, Event
from robustd.runner import CheckState


def ts(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    t = Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def dur(seconds: float | None) -> Duration | None:
    if seconds is None:
        return None
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def condition(c: Condition) -> pb.Condition:
    return pb.Condition(
        component=c.component, code=c.code, severity=int(c.severity), action=int(c.action), message=c.message,
        evidence=dict(c.evidence), first_seen=ts(c.first_seen), last_seen=ts(c.last_seen), count=c.count,
        sticky=c.sticky, seq=c.seq, source=c.source, boot_id=c.boot_id)


def event(e: Event, snapshot: bool = False) -> pb.Event:
    return pb.Event(seq=e.seq, at=ts(e.at), kind=int(e.kind), condition=condition(e.condition), snapshot=snapshot)


_STATUS = {
    "NOT_YET_RUN": pb.CHECK_STATUS_NOT_YET_RUN, "OK": pb.CHECK_STATUS_OK, "ERROR": pb.CHECK_STATUS_ERROR,
    "TIMEOUT": pb.CHECK_STATUS_TIMEOUT, "DISABLED": pb.CHECK_STATUS_DISABLED,
    "UNSUPPORTED": pb.CHECK_STATUS_UNSUPPORTED, "WATCHING": pb.CHECK_STATUS_WATCHING,
}


def check_info(st: CheckState) -> pb.CheckInfo:
    cfg = st.config
    watch = st.check.mode == "watch"
    return pb.CheckInfo(
        name=st.name, enabled=cfg.enabled, mode=st.check.mode,
        interval=None if watch else dur(cfg.interval), timeout=None if watch else dur(cfg.deadline),
        last_run=ts(st.last_run), last_duration=dur(st.last_duration),
        status=_STATUS[st.status], last_error=st.last_error, runs=st.runs, failures=st.failures)
