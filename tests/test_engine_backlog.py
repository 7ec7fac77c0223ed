"""The engine while the event log cannot be written: events held in order, compacted, none lost."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from robustd.codes import CodeRule, CodeTable
from robustd.engine import Engine
from robustd.journal import COMPACT_AT
from robustd.model import Event, EventKind, Finding, FindingBatch
from robustd.policy import Policy
from robustd.store import Store


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_held_events_are_compacted_and_replay_to_the_same_conditions(tmp_path: Path) -> None:
    clock = Clock()
    table = CodeTable([{"XID_13": CodeRule(severity="WARNING", action="RESTART_JOB"),
                        "LINK_FLAP": CodeRule(severity="WARNING", clear_after="10s")}])
    policy = Policy(table, "boot-a", default_clear_after=3600.0, update_interval=1.0)
    store = Store(str(tmp_path))
    engine = Engine(policy, store, clock)
    real_commit = store.commit
    full = {"on": True}

    def commit(events: list[Event], cursors: Any = None) -> list[Event]:
        if full["on"]:
            raise sqlite3.OperationalError("database or disk is full")
        return real_commit(events, cursors)

    store.commit = commit  # type: ignore[method-assign]
    xid = Finding(component="gpu/0", code="XID_13", message="app error")
    flap = Finding(component="nic/eth0", code="LINK_FLAP", message="flap")
    engine.submit(FindingBatch("kernel", (flap,)))
    for i in range(3 * COMPACT_AT):  # a day-long outage in miniature: one repeat a second
        clock.now += 1
        engine.submit(FindingBatch("kernel", (xid,)))
        if i == 100:
            engine.tick()  # the flap's hold-down has passed: CLEARED, held too
    view, held = engine.view, engine.journal.backlog
    assert view.store_error == "OperationalError: database or disk is full"
    assert view.events_held == len(held) <= COMPACT_AT + 1
    # robustd's own problem is a condition too, held like the rest (it says why nothing is written).
    assert (EventKind.RAISED, "STATE_UNWRITABLE") in [(e.kind, e.condition.code) for e in held]
    assert policy.conditions[("check/store", "STATE_UNWRITABLE")].evidence["error"] == view.store_error
    kinds = [(e.kind, e.condition.code) for e in held if e.condition.code != "STATE_UNWRITABLE"]
    assert kinds[:2] == [(EventKind.RAISED, "LINK_FLAP"), (EventKind.RAISED, "XID_13")]
    assert (EventKind.CLEARED, "LINK_FLAP") in kinds
    assert policy.conditions[("gpu/0", "XID_13")].count == 3 * COMPACT_AT
    assert store.head_seq() == view.head_seq() == 0

    full["on"] = False
    clock.now += 1
    engine.tick()
    assert view.store_error == "" and view.events_held == 0
    assert ("check/store", "STATE_UNWRITABLE") not in policy.conditions  # cleared once the log is written
    stored = {c.key: c for c in store.conditions()}
    assert stored.keys() == policy.conditions.keys() == {("gpu/0", "XID_13")}
    assert stored[("gpu/0", "XID_13")].count == policy.conditions[("gpu/0", "XID_13")].count
    shown = {c.key: c for c in view.snapshot()[0]}  # what GetVerdict shows: the seqs the log gave
    assert stored[("gpu/0", "XID_13")].seq == shown[("gpu/0", "XID_13")].seq == store.head_seq() - 1
    assert view.head_seq() == store.head_seq()
    last = store.events_after(store.head_seq() - 1)[0]  # written after the held ones: the problem is over
    assert (last.kind, last.condition.code) == (EventKind.CLEARED, "STATE_UNWRITABLE")
    store.close()
