"""The diagnostics' shelf: reports read (off the loop in the daemon), goldens kept in memory; both written
with the journal's next commit, or at
once when no journal drives the store (tools, tests)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

from robustd.codes import CodeRule, CodeTable
from robustd.diagnostics.shelf import Shelf
from robustd.engine import Engine
from robustd.model import Event, Finding, FindingBatch
from robustd.policy import Policy
from robustd.store import Store


def rows(state_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(state_dir / "robustd.db") as db:
        return db.execute(sql).fetchall()


def test_a_shelf_without_a_journal_writes_at_once(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    shelf = Shelf(store)
    shelf.save_report("r1", 10.0, "PASS", '{"id": "r1"}', keep=10)
    shelf.set_golden("h200", "abc", "r1", 11.0)
    assert rows(tmp_path, "SELECT id, outcome FROM diagnostic_reports") == [("r1", "PASS")]
    assert asyncio.run(shelf.report("r1")) == '{"id": "r1"}' and asyncio.run(shelf.reports(5)) == ['{"id": "r1"}']
    assert shelf.goldens() == [("h200", "abc", "r1", 11.0)]
    store.close()
    store = Store(str(tmp_path))
    assert Shelf(store).goldens() == [("h200", "abc", "r1", 11.0)]  # read once at start, kept in memory
    store.close()


def test_held_writes_are_read_at_once_and_go_with_the_next_commit(tmp_path: Path) -> None:
    store, now = Store(str(tmp_path)), [1000.0]
    engine = Engine(Policy(CodeTable([{"XID_13": CodeRule(severity="WARNING")}]), "boot-a"), store, lambda: now[0])
    shelf = Shelf(store, engine.journal)
    shelf.save_report("old", 1.0, "FAIL", "old", keep=10)  # the log takes it at once
    real_commit = store.commit
    full = {"on": True}
    commits: list[tuple[int, int]] = []

    def commit(events: list[Event], cursors: Any = None, side: Any = None) -> list[Event]:
        if full["on"]:
            raise sqlite3.OperationalError("database or disk is full")
        commits.append((len(events), len(side or {})))
        return real_commit(events, cursors, side)

    store.commit = commit  # type: ignore[method-assign]
    shelf.save_report("new", 2.0, "RUNNING", "running", keep=10)
    shelf.save_report("new", 2.0, "PASS", "passed", keep=10)  # replaces the held one
    shelf.set_golden("h200", "abc", "new", 3.0)
    assert asyncio.run(shelf.report("new")) == "passed" and asyncio.run(shelf.reports(5)) == ["passed", "old"]
    assert asyncio.run(shelf.reports(5, outcome="RUNNING")) == []
    assert asyncio.run(shelf.reports(5, outcome="FAIL")) == ["old"]
    assert shelf.goldens() == [("h200", "abc", "new", 3.0)]
    assert rows(tmp_path, "SELECT id FROM diagnostic_reports") == [("old",)]  # nothing else on disk yet
    full["on"] = False
    now[0] += 2  # past the retry time
    engine.submit(FindingBatch("kernel", (Finding(component="gpu/0", code="XID_13", message="m"),)))
    # One transaction: the event, robustd's own STATE_UNWRITABLE, and both side writes.
    assert commits[0][1] == 2 and commits[0][0] >= 2
    assert sorted(rows(tmp_path, "SELECT id, outcome FROM diagnostic_reports")) == [("new", "PASS"), ("old", "FAIL")]
    assert rows(tmp_path, "SELECT key, digest FROM goldens") == [("h200", "abc")]
    assert engine.journal.waiting("report") == {} and asyncio.run(shelf.reports(5)) == ["passed", "old"]
    store.close()
