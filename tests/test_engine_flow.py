"""The engine's one-way flow: the policy decides from memory, the journal keeps the seqs readers show, and
what a reader is shown never runs ahead of the log."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

from robustd.boots import BootHistory
from robustd.codes import CodeRule, CodeTable
from robustd.engine import Engine
from robustd.model import Action, Event, EventKind, Finding, FindingBatch
from robustd.policy import Policy
from robustd.store import Store

TABLE = CodeTable([{"XID_13": CodeRule(severity="WARNING", action="RESTART_JOB", clear_after="10s"),
                    "XID_48": CodeRule(severity="CRITICAL", action="RESET_GPU")}])


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def xid(code: str, component: str = "gpu/0") -> FindingBatch:
    return FindingBatch("kernel", (Finding(component=component, code=code, message=f"{code} seen"),))


def engine_on(store: Store, boot: str = "boot-a", clock: Clock | None = None) -> Engine:
    policy = Policy(TABLE, boot, update_interval=0.0, boots=BootHistory(store.raised_in_boots()))
    standing = store.conditions()
    policy.load(standing, (clock or Clock())())
    return Engine(policy, store, clock or Clock(), standing=standing)


def failing(store: Store) -> dict[str, bool]:
    """Make the store's commits fail while the returned flag is on."""
    real, full = store.commit, {"on": True}

    def commit(events: list[Event], cursors: Any = None, **side: Any) -> list[Event]:
        if full["on"]:
            raise sqlite3.OperationalError("database or disk is full")
        return real(events, cursors, **side)

    store.commit = commit  # type: ignore[method-assign]
    return full


def test_readers_get_the_head_and_seqs_from_memory_not_from_sqlite(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    engine = engine_on(store)
    engine.submit(xid("XID_13"))
    engine.submit(xid("XID_48"))

    def no_sqlite(*_: Any, **__: Any) -> Any:
        raise AssertionError("read SQLite while deciding or answering from memory")

    store.head_seq = no_sqlite  # type: ignore[method-assign]
    store._rows = no_sqlite  # type: ignore[method-assign] - every read of the store goes through it
    engine.submit(xid("XID_48", "gpu/1"))  # deciding (reboot escalation included) reads nothing
    conds, head = engine.view.snapshot()
    assert head == engine.view.head_seq() == 3
    assert [(c.component, c.code, c.seq) for c in conds] == [("gpu/0", "XID_13", 1), ("gpu/0", "XID_48", 2),
                                                            ("gpu/1", "XID_48", 3)]
    assert all(c.seq == 0 for c in engine.view.conditions())  # the policy's own conditions carry no seq
    again, _ = engine.view.snapshot()
    assert all(a is b for a, b in zip(conds, again, strict=True))  # unchanged: the same objects (serialised once)
    store.close()


def test_an_unwritten_condition_shows_its_last_committed_seq_and_a_new_one_none(tmp_path: Path) -> None:
    clock = Clock()
    store = Store(str(tmp_path))
    engine = engine_on(store, clock=clock)
    engine.submit(xid("XID_13"))
    full = failing(store)
    clock.now += 1
    engine.submit(xid("XID_13"))  # UPDATED, held
    shown = {c.key: c for c in engine.view.snapshot()[0]}
    assert shown[("gpu/0", "XID_13")].seq == 1 and shown[("gpu/0", "XID_13")].count == 2
    engine.journal.append([engine.policy.acknowledge("gpu/0", "XID_13", "r", clock.now)])
    engine.submit(xid("XID_13"))  # raised again: a new condition, its RAISED held
    shown = {c.key: c for c in engine.view.snapshot()[0]}
    assert shown[("gpu/0", "XID_13")].seq == 0 and shown[("gpu/0", "XID_13")].count == 1
    full["on"] = False
    clock.now += 2
    engine.tick()
    shown = {c.key: c for c in engine.view.snapshot()[0]}
    last = store.events_after(0)
    raised = [e for e in last if e.kind is EventKind.RAISED and e.condition.code == "XID_13"][-1]
    assert shown[("gpu/0", "XID_13")].seq == raised.seq > 1
    assert engine.view.head_seq() == store.head_seq()
    store.close()


def test_log_reads_stop_at_the_head_readers_are_told(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    engine = engine_on(store)
    engine.submit(xid("XID_13"))
    other = Store(str(tmp_path))  # a write on disk that the engine has not told anyone of yet
    other.commit([Event(EventKind.RAISED, engine.view.conditions()[0], 5.0)])
    other.close()
    assert store.head_seq() == 2 and engine.view.head_seq() == 1

    async def read() -> tuple[list[int], list[int]]:
        told = [e.seq async for e in engine.view.events_after(0)]
        page, _oldest = await engine.view.query(since=None, component="", min_severity=0, limit=10, after_seq=0)
        return told, [e.seq for e in page]
    assert asyncio.run(read()) == ([1], [1])
    store.close()


def test_seqs_shown_are_on_disk_and_never_given_again_after_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    store = Store(str(tmp_path))
    engine = engine_on(store, clock=clock)
    engine.submit(xid("XID_13"))
    engine.submit(xid("XID_48"))
    conds, head = engine.view.snapshot()
    store.close()  # as after a crash: nothing is flushed on the way out
    again = Store(str(tmp_path))
    restarted = engine_on(again, clock=clock)
    conds2, head2 = restarted.view.snapshot()
    assert head2 == head and [(c.key, c.seq) for c in conds2] == [(c.key, c.seq) for c in conds]
    restarted.submit(xid("XID_13", "gpu/9"))
    assert restarted.view.head_seq() == head + 1
    again.close()


def test_reboot_escalation_reads_the_log_once_and_follows_retention(tmp_path: Path) -> None:
    clock = Clock()
    for boot in ("boot-a", "boot-b"):  # XID_48 on gpu/0 in two boots
        store = Store(str(tmp_path))
        engine = engine_on(store, boot, clock)
        engine.reboot(boot)
        engine.submit(xid("XID_48"))
        store.close()
        clock.now += 100
    store = Store(str(tmp_path))
    engine = engine_on(store, "boot-c", clock)
    engine.reboot("boot-c")
    [ev] = engine.submit(xid("XID_48"))
    assert ev.condition.action is Action.HW_INSPECT and "seen in 2 earlier boots" in ev.condition.evidence["escalated"]
    engine.journal.append([engine.policy.acknowledge("gpu/0", "XID_48", "replaced", clock.now)])
    clock.now += 1000
    engine.prune(max_age=500.0, max_events=1000)  # retention deletes both earlier boots' events
    [ev] = engine.submit(xid("XID_48"))
    assert ev.condition.action is Action.RESET_GPU and "escalated" not in ev.condition.evidence
    assert store.meta("boot_id") == "boot-c"
    store.close()


def test_a_reboot_clears_and_records_the_boot_in_one_commit(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    engine = engine_on(store)
    engine.submit(xid("XID_48"))
    commits: list[tuple[list[str], list[Any]]] = []
    real = store.commit

    def commit(events: list[Event], cursors: Any = None, side: Any = None) -> list[Event]:
        commits.append(([e.condition.code for e in events], sorted(side or {})))
        return real(events, cursors, side)

    store.commit = commit  # type: ignore[method-assign]
    engine.reboot("boot-b")
    assert commits == [(["XID_48"], [("meta", "boot_id")])]
    assert store.meta("boot_id") == "boot-b" and store.conditions() == []
    store.close()
