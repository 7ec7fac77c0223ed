"""Model ↔ protobuf. Kept apart so the servicer reads as the API contract and nothing else."""

from __future__ import annotations

from typing import Sequence, TypeVar

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from robustd import bounds
from robustd.api.v1 import robustd_pb2 as pb
from robustd.check import CheckStatus
from robustd.model import Condition, Event
from robustd.runner import CheckState

MAX_LABEL = 256  # a check's emulation label, the event log's error: one line each
EVENT_MAX_BYTES = bounds.MAX_CONDITION_BYTES + 64  # a bounded condition plus seq, time, kind and snapshot


def ts(seconds: float | None) -> Timestamp | None:
    return _of_seconds(Timestamp(), seconds)


def dur(seconds: float | None) -> Duration | None:
    return _of_seconds(Duration(), seconds)


_Time = TypeVar("_Time", Timestamp, Duration)


def _of_seconds(message: _Time, seconds: float | None) -> _Time | None:
    """`message` (a Timestamp or a Duration) set to `seconds`, to the nanosecond; None for None."""
    if seconds is None:
        return None
    message.FromNanoseconds(int(seconds * 1e9))
    return message


def condition(c: Condition) -> pb.Condition:
    return pb.Condition(
        component=c.component, code=c.code, severity=int(c.severity), action=int(c.action), message=c.message,
        evidence=dict(c.evidence), first_seen=ts(c.first_seen), last_seen=ts(c.last_seen), count=c.count,
        sticky=c.sticky, seq=c.seq, source=c.source, boot_id=c.boot_id)


def event(e: Event, snapshot: bool = False) -> pb.Event:
    """An event as sent. Its condition is bounded already: by the policy that made it, and, for rows read
    back from the log (some written before bounds existed), by store.condition_from_json."""
    return pb.Event(seq=e.seq, at=ts(e.at), kind=int(e.kind), condition=condition(e.condition), snapshot=snapshot)


def event_within(e: Event, limit: int, snapshot: bool = False) -> pb.Event:
    """`event(e)`, without evidence and with a short message if even a bounded one exceeds `limit`.

    Only a `listen.max_message_bytes` far below the default (its minimum is 1 KiB) makes that happen;
    a stream that cannot send an event would end at it on every resume.
    """
    msg = event(e, snapshot)
    if limit < EVENT_MAX_BYTES and msg.ByteSize() > limit:  # a bounded event always fits the default limit
        _abridge(msg.condition, message=True)
    return msg


def field_size(n: int) -> int:
    """Bytes a length-delimited field of `n` bytes takes in its parent (tag, length, body)."""
    return 1 + _varint_size(n) + n


def fit_conditions(conds: list[Condition], budget: int) -> tuple[list[pb.Condition], int, int]:
    """The conditions as sent in at most `budget` bytes: (messages, how many trimmed, how many left out).

    Never needed with the default caps and message limit (bounds.py). Past them, the least severe
    conditions (then the least drastic action, then the oldest change) lose their evidence first, then
    their message, and only then are they left out; the worst ones always go out whole.
    """
    msgs = [condition(c) for c in conds]
    sizes = [field_size(m.ByteSize()) for m in msgs]
    total = sum(sizes)
    if total <= budget:
        return msgs, 0, 0
    order = sorted(range(len(conds)), key=lambda i: (conds[i].severity, conds[i].action, conds[i].seq))
    trimmed: set[int] = set()
    for with_message in (False, True):
        for i in order:
            if total <= budget:
                break
            _abridge(msgs[i], message=with_message)
            trimmed.add(i)
            size = field_size(msgs[i].ByteSize())
            total += size - sizes[i]
            sizes[i] = size
    omitted: set[int] = set()
    for i in order:
        if total <= budget:
            break
        omitted.add(i)
        total -= sizes[i]
    return [m for i, m in enumerate(msgs) if i not in omitted], len(trimmed - omitted), len(omitted)


class SerialisedConditions:
    """The standing conditions serialised once per change, for GetVerdict at hundreds of calls a second and
    for many callers at once.

    A Condition never changes (the policy replaces the object on every change), so its bytes stay
    right for as long as the same object stands; only conditions standing at the last call are kept.
    `joined` keeps the whole encoded list too, shared by every caller until a condition changes: a
    caps-full verdict is ~1.6 MB, and each caller building its own answer made that per caller (a
    463 MiB transient was measured under concurrent calls). Runs on the event loop only.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], tuple[Condition, bytes]] = {}
        self._joined: tuple[list[Condition], bytes] = ([], b"")

    def joined(self, conds: Sequence[Condition]) -> bytes:
        """All of `conds` as encoded `Verdict.conditions` fields, one bytes object shared while they stand."""
        last, data = self._joined
        if len(last) == len(conds) and all(a is b for a, b in zip(last, conds, strict=True)):
            return data
        data = b"".join(self.fields(conds))
        self._joined = (list(conds), data)
        return data

    def fields(self, conds: Sequence[Condition]) -> list[bytes]:
        """Each condition as an encoded `Verdict.conditions` field (tag, length, body)."""
        cache = self._cache
        fresh: dict[tuple[str, str], tuple[Condition, bytes]] = {}
        out: list[bytes] = []
        for c in conds:
            hit = cache.get(c.key)
            if hit is None or hit[0] is not c:
                hit = (c, pb.Verdict(conditions=[condition(c)]).SerializeToString())
            fresh[c.key] = hit
            out.append(hit[1])
        self._cache = fresh
        return out


def label(text: str) -> str:
    return bounds.text(text, MAX_LABEL)


def _abridge(c: pb.Condition, message: bool) -> None:
    c.ClearField("evidence")
    c.evidence["abridged"] = "evidence left out to fit listen.max_message_bytes"
    if message:
        c.message = bounds.text(c.message, 64)


def _varint_size(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


_STATUS = {
    CheckStatus.NOT_YET_RUN: pb.CHECK_STATUS_NOT_YET_RUN, CheckStatus.OK: pb.CHECK_STATUS_OK,
    CheckStatus.ERROR: pb.CHECK_STATUS_ERROR, CheckStatus.TIMEOUT: pb.CHECK_STATUS_TIMEOUT,
    CheckStatus.DISABLED: pb.CHECK_STATUS_DISABLED, CheckStatus.UNSUPPORTED: pb.CHECK_STATUS_UNSUPPORTED,
    CheckStatus.WATCHING: pb.CHECK_STATUS_WATCHING,
}


def check_info(st: CheckState) -> pb.CheckInfo:
    cfg = st.config
    watch = st.check.mode == "watch"
    return pb.CheckInfo(
        name=st.name, enabled=cfg.enabled, mode=st.check.mode,
        interval=None if watch else dur(cfg.interval), timeout=None if watch else dur(cfg.deadline),
        last_run=ts(st.last_run), last_duration=dur(st.last_duration),
        status=_STATUS[st.status], last_error=bounds.text(st.last_error, bounds.MAX_MESSAGE), runs=st.runs,
        failures=st.failures, note=bounds.text(st.check.note(), bounds.MAX_MESSAGE))
