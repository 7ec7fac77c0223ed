"""The event log: every condition change, committed to SQLite (WAL) before anyone hears of it.

Holds the events (strictly increasing seq, never reused), the standing conditions, small
metadata (the boot id, how far retention has pruned) and the stream checks' cursors — all
written in one transaction per batch, so a SIGKILL leaves either all of a batch or none.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import asdict
from typing import Any, Iterator, Mapping

from robustd.model import Action, Condition, Event, EventKind, Severity

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind INTEGER NOT NULL,
    component TEXT NOT NULL,
    code TEXT NOT NULL,
    severity INTEGER NOT NULL,
    boot_id TEXT NOT NULL,
    condition TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_key ON events (component, code);
CREATE INDEX IF NOT EXISTS events_at ON events (at);
CREATE TABLE IF NOT EXISTS conditions (
    component TEXT NOT NULL,
    code TEXT NOT NULL,
    seq INTEGER NOT NULL,
    condition TEXT NOT NULL,
    PRIMARY KEY (component, code)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cursors (check_name TEXT PRIMARY KEY, cursor TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS diagnostics (
    id TEXT PRIMARY KEY,
    started REAL NOT NULL,
    outcome INTEGER NOT NULL,
    report BLOB NOT NULL  -- a serialized robustd.v1.DiagnosticReport
);
CREATE INDEX IF NOT EXISTS diagnostics_started ON diagnostics (started);
CREATE TABLE IF NOT EXISTS goldens (key TEXT PRIMARY KEY, digest TEXT NOT NULL, report_id TEXT NOT NULL,
                                    at REAL NOT NULL);
"""


def condition_to_json(c: Condition) -> str:
    d = asdict(c)
    d["severity"] = c.severity.name
    d["action"] = c.action.name
    d["evidence"] = dict(c.evidence)
    return json.dumps(d, sort_keys=True)


def condition_from_json(text: str) -> Condition:
    d: dict[str, Any] = json.loads(text)
    d["severity"] = Severity[d["severity"]]
    d["action"] = Action[d["action"]]
    return Condition(**d)


class Store:
    def __init__(self, state_dir: str):
        os.makedirs(state_dir, mode=0o750, exist_ok=True)
        self.path = os.path.join(state_dir, "robustd.db")
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # committed means on disk, even across power loss
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- writes --------------------------------------------------------------------------------
    def commit(self, events: list[Event], cursors: Mapping[str, Mapping[str, str]] | None = None) -> list[Event]:
        """Write events (and cursors) in one transaction; return the events with their seqs."""
        out: list[Event] = []
        with self._tx():
            for ev in events:
                c = ev.condition
                cur = self.db.execute(
                    "INSERT INTO events (at, kind, component, code, severity, boot_id, condition)"
                    " VALUES (?, ?, ?, ?, ?, ?, '')",
                    (ev.at, int(ev.kind), c.component, c.code, int(c.severity), c.boot_id))
                seq = int(cur.lastrowid or 0)
                c = c.with_seq(seq, ev.at)
                self.db.execute("UPDATE events SET condition = ? WHERE seq = ?", (condition_to_json(c), seq))
                if ev.kind is EventKind.CLEARED:
                    self.db.execute("DELETE FROM conditions WHERE component = ? AND code = ?", c.key)
                else:
                    self.db.execute("INSERT OR REPLACE INTO conditions VALUES (?, ?, ?, ?)",
                                    (c.component, c.code, seq, condition_to_json(c)))
                out.append(Event(ev.kind, c, ev.at, seq))
            for name, cursor in (cursors or {}).items():
                self.db.execute("INSERT OR REPLACE INTO cursors VALUES (?, ?)", (name, json.dumps(dict(cursor))))
        return out

    def set_meta(self, key: str, value: str) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def prune(self, now: float, max_age: float, max_events: int) -> int:
        """Drop events past retention; remember how far, so a Watch from before gets OUT_OF_RANGE."""
        head = self.head_seq()
        with self._tx():
            row = self.db.execute("SELECT MAX(seq) FROM events WHERE at < ? OR seq <= ?",
                                  (now - max_age, head - max_events)).fetchone()
            upto = int(row[0] or 0)
            if upto <= self.pruned_through():
                return 0
            n = self.db.execute("DELETE FROM events WHERE seq <= ?", (upto,)).rowcount
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('pruned_through', ?)", (str(upto),))
        return n

    def save_report(self, report_id: str, started: float, outcome: int, blob: bytes, keep: int) -> None:
        """Insert or replace one diagnostic report; keep the newest `keep`."""
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO diagnostics VALUES (?, ?, ?, ?)",
                            (report_id, started, outcome, blob))
            self.db.execute("DELETE FROM diagnostics WHERE id NOT IN "
                            "(SELECT id FROM diagnostics ORDER BY started DESC LIMIT ?)", (keep,))

    def set_golden(self, key: str, digest: str, report_id: str, at: float) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO goldens VALUES (?, ?, ?, ?)", (key, digest, report_id, at))

    # -- reads ---------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def cursor(self, check: str) -> dict[str, str]:
        row = self.db.execute("SELECT cursor FROM cursors WHERE check_name = ?", (check,)).fetchone()
        return {} if row is None else dict(json.loads(row[0]))

    def conditions(self) -> list[Condition]:
        return [condition_from_json(r[0]) for r in self.db.execute("SELECT condition FROM conditions ORDER BY seq")]

    def report(self, report_id: str) -> bytes | None:
        row = self.db.execute("SELECT report FROM diagnostics WHERE id = ?", (report_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def reports(self, limit: int, outcome: int | None = None) -> list[bytes]:
        """Newest first."""
        if outcome is None:
            rows = self.db.execute("SELECT report FROM diagnostics ORDER BY started DESC LIMIT ?", (limit,))
        else:
            rows = self.db.execute("SELECT report FROM diagnostics WHERE outcome = ? ORDER BY started DESC LIMIT ?",
                                   (outcome, limit))
        return [bytes(r[0]) for r in rows]

    def goldens(self) -> list[tuple[str, str, str, float]]:
        return [tuple(r) for r in self.db.execute("SELECT key, digest, report_id, at FROM goldens ORDER BY key")]

    def head_seq(self) -> int:
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        return 0 if row is None else int(row[0])

    def pruned_through(self) -> int:
        return int(self.meta("pruned_through") or 0)

    def oldest_seq(self) -> int:
        row = self.db.execute("SELECT MIN(seq) FROM events").fetchone()
        return int(row[0] or 0)

    def events_after(self, seq: int, limit: int = 500) -> list[Event]:
        rows = self.db.execute("SELECT seq, at, kind, condition FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                               (seq, limit))
        return [self._event(r) for r in rows]

    def query(self, *, since: float | None, component: str, min_severity: int, limit: int,
              after_seq: int) -> list[Event]:
        """The newest `limit` matching events, oldest first."""
        sql = "SELECT seq, at, kind, condition FROM events WHERE seq > ? AND severity >= ?"
        args: list[Any] = [after_seq, min_severity]
        if since is not None:
            sql += " AND at >= ?"
            args.append(since)
        if component.endswith("/"):
            sql += " AND substr(component, 1, ?) = ?"
            args += [len(component), component]
        elif component:
            sql += " AND component = ?"
            args.append(component)
        sql += " ORDER BY seq DESC LIMIT ?"
        args.append(limit)
        return [self._event(r) for r in reversed(self.db.execute(sql, args).fetchall())]

    def boots_with(self, component: str, code: str, current_boot: str) -> int:
        """In how many earlier boots this fault was raised (for reboot escalation)."""
        row = self.db.execute("SELECT COUNT(DISTINCT boot_id) FROM events WHERE component = ? AND code = ?"
                              " AND kind = ? AND boot_id != ?",
                              (component, code, int(EventKind.RAISED), current_boot)).fetchone()
        return int(row[0])

    @staticmethod
    def _event(row: tuple[Any, ...]) -> Event:
        return Event(EventKind(row[2]), condition_from_json(row[3]), float(row[1]), int(row[0]))

    def _tx(self) -> _Tx:
        return _Tx(self.db)


class _Tx:
    """BEGIN IMMEDIATE … COMMIT, or ROLLBACK on error."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def iter_batches(store: Store, after: int, batch: int = 500) -> Iterator[list[Event]]:
    """Every event after `after`, in seq order, a batch at a time."""
    while True:
        evs = store.events_after(after, batch)
        if not evs:
            return
        yield evs
        after = evs[-1].seq
