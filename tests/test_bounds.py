"""Every text that reaches a condition is bounded, so every event and verdict can be sent."""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import replace
from pathlib import Path

from robustd import bounds
from robustd.api import convert
from robustd.api.v1 import robustd_pb2 as pb
from robustd.codes import CodeRule, CodeTable
from robustd.engine import Engine
from robustd.model import Action, Condition, Event, EventKind, Finding, FindingBatch, Severity
from robustd.policy import Policy
from robustd.store import Store

DEFAULT_MESSAGE_LIMIT = 4 << 20
U64 = 2**64 - 1


def cond(**kw: object) -> Condition:
    base: dict[str, object] = dict(component="gpu/0000:3b:00.0", code="XID_79", severity=Severity.CRITICAL,
                                   action=Action.REBOOT, message="Xid 79", evidence={"seq": "1"}, first_seen=1.0,
                                   last_seen=2.0, count=1, sticky=True, source="kernel", boot_id="b" * 36)
    base.update(kw)
    return Condition(**base)  # type: ignore[arg-type]


def worst_case(rng: random.Random) -> Condition:
    """A condition with every field as large as its source could make it, in varied shapes."""
    def junk(n: int) -> str:
        return "".join(rng.choices(["a", "é", "\x00", " ", "€", "𝄞", "\\", "\ud800"], k=n))

    entries = rng.choice([1, 15, 16, 17, 200])
    return cond(component=junk(rng.choice([10, 200, 5000])), code=junk(rng.choice([5, 100])),
                message=junk(rng.choice([100, 600, 20_000])), source=junk(80), boot_id=junk(70),
                evidence={junk(rng.choice([1, 3, 70])): junk(rng.choice([1, 30, 600, 5000])) for _ in range(entries)},
                count=U64, first_seen=253402300799.999, last_seen=253402300799.999)


def test_text_is_cut_at_a_character_boundary_with_a_visible_marker() -> None:
    cut = bounds.text("é" * 1000, 512)
    assert len(cut.encode()) <= 512 and cut.endswith(f"… [truncated {2000 - len(cut.split('…')[0].encode())} bytes]")
    assert bounds.text("short", 512) == "short"
    assert bounds.text("bad \ud800 surrogate", 512) == "bad ? surrogate"


def test_tokens_are_printable_ascii_and_long_ones_stay_distinct() -> None:
    assert bounds.token("gpu/0000:3b:00.0", 128) == "gpu/0000:3b:00.0"
    assert bounds.token("disk/my data\n", 128) == "disk/my\\x20data\\x0a"
    a, b = bounds.token("gpu/" + "x" * 500 + "a", 128), bounds.token("gpu/" + "x" * 500 + "b", 128)
    assert len(a) == len(b) == 128 and a != b and a.isascii() and a.isprintable()
    assert bounds.token("", 64) == "-"


def test_evidence_keeps_short_entries_and_cuts_the_longest_values() -> None:
    ev = bounds.evidence({"line": "L" * 900, "detail": "D" * 800, "seq": "123", "bdf": "0000:3b:00.0"})
    assert ev["seq"] == "123" and ev["bdf"] == "0000:3b:00.0"
    assert ev["line"].endswith("bytes]") and ev["detail"].endswith("bytes]")
    assert sum(len(k) + len(v.encode()) for k, v in ev.items()) <= bounds.MAX_EVIDENCE_BYTES
    many = bounds.evidence({f"k{i}": str(i) for i in range(100)})
    assert len(many) == bounds.MAX_EVIDENCE_ENTRIES and many[bounds.TRUNCATED_ENTRIES] == "85"


def test_a_bounded_condition_serialises_within_the_documented_size_and_bounding_is_idempotent() -> None:
    rng = random.Random(7)
    largest = 0
    for _ in range(150):
        c = bounds.condition(worst_case(rng))
        assert bounds.condition(c) is c  # bounded twice (made, then read back): unchanged, not even copied
        msg = convert.condition(c)
        largest = max(largest, msg.ByteSize())
        event = pb.Event(seq=U64, at=convert.ts(253402300799.0), kind=pb.EVENT_KIND_CLEARED, condition=msg,
                         snapshot=True)
        assert event.ByteSize() <= bounds.MAX_CONDITION_BYTES + 64
    assert largest <= bounds.MAX_CONDITION_BYTES
    assert largest > bounds.MAX_CONDITION_BYTES - 200  # the documented bound is tight, not a guess


def test_the_largest_verdict_the_default_caps_allow_is_half_the_message_limit() -> None:
    p = Policy(table=None, boot_id="b")  # type: ignore[arg-type]
    most = p.max_conditions + p.max_foldovers + 1
    one = convert.field_size(bounds.MAX_CONDITION_BYTES)
    verdict = most * one + 4096  # node, boot id, emulated labels, the event log's error, scalars
    assert verdict < DEFAULT_MESSAGE_LIMIT * 0.55, verdict


def test_a_verdict_past_the_limit_abridges_its_least_severe_conditions_first() -> None:
    big = {f"k{i}": "v" * 60 for i in range(15)}
    conds = [cond(component=f"gpu/{i}", severity=Severity.WARNING if i % 2 else Severity.CRITICAL,
                  message="m" * 500, evidence=big, seq=i) for i in range(100)]
    full = sum(convert.field_size(convert.condition(c).ByteSize()) for c in conds)
    msgs, trimmed, omitted = convert.fit_conditions(conds, full * 3 // 4)
    assert (omitted, len(msgs)) == (0, 100) and 0 < trimmed <= 50
    assert sum(convert.field_size(m.ByteSize()) for m in msgs) <= full * 3 // 4
    assert all(dict(m.evidence) == big for m in msgs if m.severity == pb.SEVERITY_CRITICAL)  # the worst go whole
    msgs, trimmed, omitted = convert.fit_conditions(conds, 5000)
    assert omitted > 0 and all(m.severity == pb.SEVERITY_CRITICAL for m in msgs)


def test_the_event_log_holds_only_bounded_events(tmp_path: Path) -> None:
    """What reaches the log came through the policy, which bounds what enters it: the rows are bounded."""
    store = Store(str(tmp_path))
    engine = Engine(Policy(CodeTable([{"XID_79": CodeRule(severity="CRITICAL")}]), "b" * 5000), store)
    huge = Finding(component="gpu/" + "x" * 10_000, code="XID_79", message="m" * 4_000_000,
                   evidence={"reason": "r" * 4_000_000, **{f"k{i}": "v" for i in range(50)}})
    engine.submit(FindingBatch("k" * 5000, (huge,)))
    [ev] = store.events_after(0)
    store.close()
    db = sqlite3.connect(tmp_path / "robustd.db")
    for (text,) in db.execute("SELECT condition FROM events UNION ALL SELECT condition FROM conditions"):
        stored = json.loads(text)
        assert len(stored["message"].encode()) <= bounds.MAX_MESSAGE and "[truncated" in stored["message"]
        assert len(stored["component"]) <= bounds.MAX_COMPONENT
        assert len(stored["evidence"]) <= bounds.MAX_EVIDENCE_ENTRIES
        assert len(stored["source"]) <= bounds.MAX_SOURCE and len(stored["boot_id"]) <= bounds.MAX_BOOT_ID
    assert ev.condition.component == stored["component"]
    assert convert.event(ev).ByteSize() <= bounds.MAX_CONDITION_BYTES + 64


def test_a_row_written_unbounded_reads_back_bounded(tmp_path: Path) -> None:
    """A row as a version before the bounds wrote it is bounded where it is read back: still sendable."""
    store = Store(str(tmp_path))
    huge = cond(message="m" * 4_000_000, evidence={"reason": "r" * 4_000_000, **{f"k{i}": "v" for i in range(50)}},
                component="gpu/" + "x" * 10_000)
    store.commit([Event(EventKind.RAISED, huge, 1.0)])  # the store writes what it is handed
    [ev], [standing] = store.events_after(0), store.conditions()
    for c in (ev.condition, standing):
        assert len(c.message.encode()) <= bounds.MAX_MESSAGE and len(c.component) <= bounds.MAX_COMPONENT
        assert len(c.evidence) <= bounds.MAX_EVIDENCE_ENTRIES
    assert convert.event(ev).ByteSize() <= bounds.MAX_CONDITION_BYTES + 64
    store.close()


def test_the_standing_conditions_are_encoded_once_per_change_and_shared_by_every_caller() -> None:
    from robustd.api import convert

    conds = [Condition(component=f"gpu/0000:{i:02x}:00.0", code="XID_79", severity=Severity.CRITICAL,
                       action=Action.REBOOT, message="m" * 900, evidence={}, first_seen=1.0, last_seen=2.0, count=1,
                       sticky=True, seq=i + 1)
             for i in range(1000)]
    shared = convert.SerialisedConditions()
    first = shared.joined(conds)
    assert shared.joined(list(conds)) is first  # another caller, the same conditions: the same bytes, not a copy
    assert pb.Verdict.FromString(first) == pb.Verdict(conditions=[convert.condition(c) for c in conds])
    changed = [*conds[:-1], replace(conds[-1], count=2)]
    again = shared.joined(changed)
    assert again is not first and pb.Verdict.FromString(again).conditions[-1].count == 2
    # A header made per call and the shared conditions concatenate into one valid Verdict (what GetVerdict sends).
    v = pb.Verdict.FromString(pb.Verdict(node="n", seq=7).SerializeToString() + again)
    assert (v.node, v.seq, len(v.conditions)) == ("n", 7, 1000)
