"""The event log: every condition change, committed to SQLite (WAL) before anyone hears of it.

Holds the events (strictly increasing seq, never reused: AUTOINCREMENT), the standing conditions,
small metadata (the boot id, how far retention has pruned), the stream checks' cursors, and the
diagnostics' reports and golden digests — all that one batch carries is written in one transaction,
so a SIGKILL leaves either all of a batch or none.

The store is the bottom of a one-way flow: the journal (robustd/journal.py) hands it batches to write
on the writer thread; at start the daemon and the journal read what they need once (standing
conditions, cursors, the boot id, reboot facts, the head seq); readers (robustd/engine.py's EngineView,
the diagnostics' shelf) read committed rows. It holds nothing in memory and calls nothing back.
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from dataclasses import asdict
from typing import Any, Callable, Mapping

from robustd import bounds
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
CREATE TABLE IF NOT EXISTS diagnostic_reports (
    id TEXT PRIMARY KEY,
    started REAL NOT NULL,
    outcome TEXT NOT NULL,  -- an Outcome's name (robustd/diagnostics/model.py)
    report TEXT NOT NULL  -- the report's JSON (robustd.diagnostics.model.report_to_json)
);
CREATE INDEX IF NOT EXISTS diagnostic_reports_started ON diagnostic_reports (started);
CREATE TABLE IF NOT EXISTS goldens (key TEXT PRIMARY KEY, digest TEXT NOT NULL, report_id TEXT NOT NULL,
                                    at REAL NOT NULL);
"""
_NO_END = (1 << 63) - 1  # the largest seq SQLite can hold: "no upper bound"
Side = dict[tuple[str, str], tuple[Any, ...]]  # (kind, key) -> the values of one side write (_SIDE_WRITES)


def condition_to_json(c: Condition) -> str:
    d = asdict(c)
    d["severity"] = c.severity.name
    d["action"] = c.action.name
    d["evidence"] = dict(c.evidence)
    return json.dumps(d, sort_keys=True)


def condition_from_json(text: str) -> Condition:
    """A stored condition, bounded: rows written before conditions were bounded must still be sendable."""
    d: dict[str, Any] = json.loads(text)
    d["severity"] = Severity[d["severity"]]
    d["action"] = Action[d["action"]]
    return bounds.condition(Condition(**d))


class Store:
    """The event log. Reads use one connection (the event-loop thread); writes use another, and in the
    daemon run on the writer thread (robustd/writer.py), so a stuck disk stalls only that thread: an open
    reader in WAL mode keeps answering from what is committed.

    If the state directory cannot be written at start (a read-only or missing mount), the store opens
    what it can read (read-only) and every write first retries opening it for writing; the journal holds
    the events in memory meanwhile (robustd/journal.py). The store keeps nothing in memory and calls
    nobody: it reads what is committed and writes what it is handed.
    """

    def __init__(self, state_dir: str):
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, "robustd.db")
        self.db: sqlite3.Connection | None = None  # reads
        self._wdb: sqlite3.Connection | None = None  # writes (one thread at a time: the writer)
        self.open_error = ""  # why the log is not open for writing; "" once it is
        try:
            self.open()
        except (sqlite3.Error, OSError):
            self._open_read_only()

    @property
    def writable(self) -> bool:
        return self._wdb is not None

    def open(self) -> None:
        """Open (or create) the log for writing; raises if the state directory cannot be written."""
        if self._wdb is not None:
            return
        try:
            os.makedirs(self.state_dir, mode=0o750, exist_ok=True)
            w = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except (sqlite3.Error, OSError) as e:
            self.open_error = _why_unwritable(self.state_dir, e)
            raise
        try:
            w.execute("PRAGMA journal_mode=WAL")
            w.execute("PRAGMA synchronous=FULL")  # committed means on disk, even across power loss
            w.executescript(SCHEMA)
            w.execute("BEGIN IMMEDIATE")  # proves the file (and its -wal) can be written, not only read
            w.execute("COMMIT")
            r = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except BaseException as e:
            w.close()
            self.open_error = _why_unwritable(self.state_dir, e)
            raise
        old, self.db, self._wdb = self.db, r, w
        if old is not None:
            old.close()
        self.open_error = ""

    def _open_read_only(self) -> None:
        """Whatever of an existing log can be read (standing conditions, cursors) while it cannot be written."""
        if not os.path.exists(self.path):
            return
        for query in ("mode=ro", "immutable=1"):  # immutable: a WAL database whose -shm cannot be created
            try:
                db = sqlite3.connect(f"file:{urllib.parse.quote(self.path)}?{query}", uri=True,
                                     isolation_level=None, check_same_thread=False)
            except sqlite3.Error:
                continue
            try:
                db.execute("SELECT COUNT(*) FROM conditions").fetchone()
            except sqlite3.Error:
                db.close()
                continue
            self.db = db
            return

    def close(self, writer: bool = True, reader: bool = True) -> None:
        """Close the connections; `writer=False` leaves the write connection to a writer thread still in it, and
        `reader=False` the read connection to a reader thread (robustd/reads.py). In the daemon each thread
        closes its own: closing the last connection of a WAL log checkpoints it, a write, and a connection in
        use on another thread is waited for — neither may hold the main thread on a frozen disk."""
        if reader and self.db is not None:
            self.db.close()
            self.db = None
        if writer and self._wdb is not None:
            self._wdb.close()
            self._wdb = None

    # -- writes (the writer thread) ------------------------------------------------------------
    def commit(self, events: list[Event], cursors: Mapping[str, Mapping[str, str]] | None = None,
               side: Side | None = None) -> list[Event]:
        """Write events, cursors and side writes (keyed rows: `_SIDE_WRITES`) in one transaction; return the
        events with their seqs."""
        self.open()
        db = self._wdb
        assert db is not None
        out: list[Event] = []
        with _Tx(db):
            for ev in events:  # bounded already: only the policy makes conditions (bounds.py)
                c = ev.condition
                cur = db.execute(
                    "INSERT INTO events (at, kind, component, code, severity, boot_id, condition)"
                    " VALUES (?, ?, ?, ?, ?, ?, '')",
                    (ev.at, int(ev.kind), c.component, c.code, int(c.severity), c.boot_id))
                seq = int(cur.lastrowid or 0)
                c = c.with_seq(seq, ev.at)
                db.execute("UPDATE events SET condition = ? WHERE seq = ?", (condition_to_json(c), seq))
                if ev.kind is EventKind.CLEARED:
                    db.execute("DELETE FROM conditions WHERE component = ? AND code = ?", c.key)
                else:
                    db.execute("INSERT OR REPLACE INTO conditions VALUES (?, ?, ?, ?)",
                               (c.component, c.code, seq, condition_to_json(c)))
                out.append(Event(ev.kind, c, ev.at, seq))
            for name, cursor in (cursors or {}).items():
                db.execute("INSERT OR REPLACE INTO cursors VALUES (?, ?)", (name, json.dumps(dict(cursor))))
            for (kind, key), value in (side or {}).items():
                _SIDE_WRITES[kind](db, key, *value)
        return out

    def prune(self, now: float, max_age: float, max_events: int) -> int:
        """Drop events past retention; remember how far, so a Watch from before gets OUT_OF_RANGE. Returns the
        seq it pruned through now (0: nothing new was pruned)."""
        self.open()
        db = self._wdb
        assert db is not None
        with _Tx(db):
            head = _head_seq(db)
            row = db.execute("SELECT MAX(seq) FROM events WHERE at < ? OR seq <= ?",
                             (now - max_age, head - max_events)).fetchone()
            upto = int(row[0] or 0)
            done = db.execute("SELECT value FROM meta WHERE key = 'pruned_through'").fetchone()
            if upto <= int(done[0] if done else 0):
                return 0
            db.execute("DELETE FROM events WHERE seq <= ?", (upto,))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('pruned_through', ?)", (str(upto),))
        return upto

    # -- reads ---------------------------------------------------------------------------------
    def _rows(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[tuple[Any, ...]]:
        if self.db is None:  # nothing could be opened (no log yet on a read-only disk)
            return []
        return self.db.execute(sql, args).fetchall()

    def meta(self, key: str) -> str | None:
        """What the log has committed for `key` (a side write still held in the journal is not here yet)."""
        rows = self._rows("SELECT value FROM meta WHERE key = ?", (key,))
        return None if not rows else str(rows[0][0])

    def cursor(self, check: str) -> dict[str, str]:
        rows = self._rows("SELECT cursor FROM cursors WHERE check_name = ?", (check,))
        return {} if not rows else dict(json.loads(rows[0][0]))

    def cursors(self) -> dict[str, dict[str, str]]:
        """Every stream check's committed cursor, by check name (read once at start: robustd/journal.py)."""
        return {str(r[0]): dict(json.loads(r[1])) for r in self._rows("SELECT check_name, cursor FROM cursors")}

    def conditions(self) -> list[Condition]:
        return [condition_from_json(r[0]) for r in self._rows("SELECT condition FROM conditions ORDER BY seq")]

    def report(self, report_id: str) -> str | None:
        """One committed diagnostic report's JSON (robustd/diagnostics/shelf.py adds those still held)."""
        rows = self._rows("SELECT report FROM diagnostic_reports WHERE id = ?", (report_id,))
        return None if not rows else str(rows[0][0])

    def reports(self, limit: int, outcome: str | None = None) -> list[tuple[str, float, str, str]]:
        """The newest committed reports as (id, started, outcome name, JSON), newest first; only those with
        `outcome` if given."""
        sql, args = "SELECT id, started, outcome, report FROM diagnostic_reports", [limit]
        if outcome is not None:
            sql, args = sql + " WHERE outcome = ?", [outcome, *args]
        return [(str(r[0]), float(r[1]), str(r[2]), str(r[3]))
                for r in self._rows(sql + " ORDER BY started DESC LIMIT ?", args)]

    def migrate_reports(self, convert: Callable[[bytes], tuple[str, str] | None]) -> tuple[int, int]:
        """Move the reports an earlier robustd stored (table `diagnostics`, serialized protobuf) into
        `diagnostic_reports`, in one transaction, and drop the old table; return (moved, unreadable).

        `convert` turns one stored blob into (outcome name, JSON), or None when it cannot be read; the
        store knows no protobuf (robustd/api/diagnostics_convert.py does). Call it before anything else
        writes (at start); a log that cannot be written now is migrated at a later start.
        """
        db = self._wdb
        if db is None or not db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'diagnostics'").fetchone():
            return 0, 0
        moved = unreadable = 0
        with _Tx(db):
            for report_id, started, blob in db.execute("SELECT id, started, report FROM diagnostics").fetchall():
                got = convert(bytes(blob))
                if got is None:
                    unreadable += 1
                    continue
                db.execute("INSERT OR IGNORE INTO diagnostic_reports VALUES (?, ?, ?, ?)",
                           (str(report_id), float(started), *got))
                moved += 1
            db.execute("DROP TABLE diagnostics")
        return moved, unreadable

    def goldens(self) -> list[tuple[str, str, str, float]]:
        """The committed golden digests: (key, digest, report id, recorded at)."""
        return [(str(r[0]), str(r[1]), str(r[2]), float(r[3]))
                for r in self._rows("SELECT key, digest, report_id, at FROM goldens ORDER BY key")]

    def head_seq(self) -> int:
        return 0 if self.db is None else _head_seq(self.db)

    def pruned_through(self) -> int:
        return int(self.meta("pruned_through") or 0)

    def oldest_seq(self) -> int:
        rows = self._rows("SELECT MIN(seq) FROM events")
        return int(rows[0][0] or 0) if rows else 0

    def events_after(self, seq: int, limit: int = 500, through: int | None = None) -> list[Event]:
        """Up to `limit` events after `seq` (and up to `through`, if given), in seq order."""
        upto = _NO_END if through is None else through
        rows = self._rows("SELECT seq, at, kind, condition FROM events WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?",
                          (seq, upto, limit))
        return [self._event(r) for r in rows]

    def query(self, *, since: float | None, component: str, min_severity: int, limit: int,
              after_seq: int, through: int | None = None) -> list[Event]:
        """The newest `limit` matching events (up to seq `through`, if given), oldest first."""
        sql = "SELECT seq, at, kind, condition FROM events WHERE seq > ? AND seq <= ? AND severity >= ?"
        args: list[Any] = [after_seq, _NO_END if through is None else through, min_severity]
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
        return [self._event(r) for r in reversed(self._rows(sql, args))]

    def raised_in_boots(self) -> list[tuple[str, str, str, int]]:
        """(component, code, boot id, newest seq) for every fault and boot with a RAISED in the log, oldest
        first: what reboot escalation needs (robustd/boots.py), read once at start. As many rows as the log
        has distinct RAISED faults per boot, so retention bounds it."""
        rows = self._rows("SELECT component, code, boot_id, MAX(seq) AS newest FROM events WHERE kind = ?"
                          " GROUP BY component, code, boot_id ORDER BY newest", (int(EventKind.RAISED),))
        return [(str(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows]

    @staticmethod
    def _event(row: tuple[Any, ...]) -> Event:
        return Event(EventKind(row[2]), condition_from_json(row[3]), float(row[1]), int(row[0]))


def _why_unwritable(state_dir: str, err: BaseException) -> str:
    """SQLite says "unable to open database file"; name the cause an operator can act on."""
    detail = f"{type(err).__name__}: {err}"
    path = os.path.abspath(state_dir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{state_dir} is on a read-only file system ({detail})"
    except OSError:
        pass
    if not os.access(path, os.W_OK):
        return f"{state_dir} is not writable by robustd ({detail})"
    return detail


def _head_seq(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
    return 0 if row is None else int(row[0])


def _write_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))


def _write_report(db: sqlite3.Connection, report_id: str, started: float, outcome: str, text: str,
                  keep: int) -> None:
    db.execute("INSERT OR REPLACE INTO diagnostic_reports VALUES (?, ?, ?, ?)", (report_id, started, outcome, text))
    db.execute("DELETE FROM diagnostic_reports WHERE id NOT IN "
               "(SELECT id FROM diagnostic_reports ORDER BY started DESC LIMIT ?)", (keep,))


def _write_golden(db: sqlite3.Connection, key: str, digest: str, report_id: str, at: float) -> None:
    db.execute("INSERT OR REPLACE INTO goldens VALUES (?, ?, ?, ?)", (key, digest, report_id, at))


_SIDE_WRITES: dict[str, Callable[..., None]] = {"meta": _write_meta, "report": _write_report, "golden": _write_golden}


class _Tx:
    """BEGIN IMMEDIATE … COMMIT, or ROLLBACK on error."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
