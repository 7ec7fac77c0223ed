"""The journal: decided events on their way to the event log, and the seqs the log gave them.

The engine decides on the event-loop thread and appends the events here, in order. The journal hands
them to the writer (robustd/writer.py) a batch at a time, with the stream checks' cursors and the side
writes (diagnostic reports and golden digests from robustd/diagnostics/shelf.py, the boot id) in the
same transaction, and only once that write returned calls `on_written` with the events as the log
numbered them: nobody hears of an event before it is on disk.

It is also where readers find seqs without asking SQLite: `head`, the newest seq written and told (read
from the log once at start, then advanced only by this journal's own commits), and `seq_of`, the last
committed seq of each standing condition. Both move only after a commit returned, so a seq a client
has seen is on disk and is never handed out again after a crash (the log's AUTOINCREMENT never reuses
one).

When the log cannot be written (disk full, read-only, failing or frozen state disk) nothing is dropped:
the events, cursors and side writes wait here in order (events compacted past COMPACT_AT), and the write
is retried every RETRY_EVERY; a write that has not returned after STUCK_AFTER is a state disk that does
not answer. The journal tells its owner why (`on_trouble(reason)`, repeated while it lasts, and
`on_trouble(None)` once a write succeeds) and holds the events the owner answers with (the engine's
STATE_UNWRITABLE on check/store) like any others.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable, Iterable, Mapping

from robustd.model import Condition, Event, EventKind
from robustd.store import Side, Store
from robustd.writer import InlineWriter, ThreadWriter

# The engine's name: the log lines (one per event written, the state disk's trouble) read as before.
log = logging.getLogger("robustd.engine")
ERROR_LOG_EVERY = 60.0
COMPACT_AT = 1000  # held events beyond this are compacted (see compact)
RETRY_EVERY = 1.0  # a failed write is retried this often
STUCK_AFTER = 5.0  # a write still running after this long means the state disk does not answer
UNWRITTEN = (0, 0.0)  # seq_of a condition with no committed event yet: (seq, changed_at)

Key = tuple[str, str]
Trouble = Callable[[str | None], list[Event]]


def compact(events: list[Event]) -> list[Event]:
    """Drop each UPDATED that a later UPDATED of the same condition supersedes before any RAISED or CLEARED
    of it, so a long outage holds O(conditions x transitions) events, not one per repeat per second.

    What is kept still replays to the same conditions: every RAISED and CLEARED, and each condition's
    newest state between them.
    """
    superseded: set[int] = set()
    last_update: dict[Key, int] = {}
    for i, ev in enumerate(events):
        key = ev.condition.key
        if ev.kind is EventKind.UPDATED:
            if key in last_update:
                superseded.add(last_update[key])
            last_update[key] = i
        else:
            last_update.pop(key, None)
    return [ev for i, ev in enumerate(events) if i not in superseded]


class Journal:
    """`backlog` holds every decided event not yet on disk, in order: the batch being written (its first
    `_writing` events) and what arrived since. A write that fails leaves it there, retried at most every
    RETRY_EVERY. Event-loop thread only; the writes themselves run on the writer's.
    """

    def __init__(self, store: Store, clock: Callable[[], float] = time.time,
                 writer: InlineWriter | ThreadWriter | None = None, *, standing: Iterable[Condition] = (),
                 cursors: Mapping[str, Mapping[str, str]] | None = None,
                 on_trouble: Trouble = lambda reason: [],
                 on_written: Callable[[list[Event]], None] = lambda done: None,
                 on_pruned: Callable[[int], None] = lambda through: None):
        self.store = store
        self.clock = clock
        self.writer = writer or InlineWriter()
        self.on_trouble = on_trouble  # the log's trouble (a reason) or its end (None) -> events to hold
        self.on_written = on_written  # events just committed, with their seqs, in order
        self.on_pruned = on_pruned  # retention deleted every event up to this seq
        self.backlog: list[Event] = []  # decided, not yet on disk
        self._cursors: dict[str, Mapping[str, str]] = {}
        self._side: Side = {}  # keyed writes waiting for a commit; a newer one replaces an older one
        self._writing = 0  # how many of backlog's first events the write in flight carries (0: none in flight)
        self._waiters: dict[int, asyncio.Future[Event]] = {}  # id(event) -> whoever waits for its seq
        self.head = store.head_seq()  # the newest seq written, as told: from here on only commits move it
        self.pruned = store.pruned_through()  # retention deleted every event up to this seq (see prune)
        # Each stream check's newest cursor: the log's at start (read once, by the daemon, which made the checks
        # with them), then as handed in.
        self._known_cursors = {k: dict(v) for k, v in (store.cursors() if cursors is None else cursors).items()}
        # The committed seq of each condition standing at start (the log's, read once by the daemon for the policy too)
        self._seqs: dict[Key, tuple[int, float]] = {c.key: (c.seq, c.changed_at) for c in standing}
        self._raising: collections.Counter[Key] = collections.Counter()  # held RAISEDs: a new condition, unwritten
        self.written = 0  # events committed since start
        self.error = ""  # why the backlog is not being written; "" while the log is written normally
        self.error_since: float | None = None
        self._last_error_log = 0.0
        self._retry_at = 0.0
        self._pruning = False
        self._closing = False
        if not store.writable:
            self._retry_at = self.clock() + RETRY_EVERY
            self._problem(store.open_error or "the event log is not open")

    # -- what readers ask (event-loop thread) ----------------------------------------------------
    def seq_of(self, key: Key) -> tuple[int, float]:
        """(seq, changed_at) of the newest committed event of the condition standing on `key`; UNWRITTEN while
        its RAISED is still held (it is a new condition: the seq of an earlier one on the key is not its)."""
        if self._raising.get(key):
            return UNWRITTEN
        return self._seqs.get(key, UNWRITTEN)

    def cursor(self, check: str) -> dict[str, str]:
        """The newest cursor `check` handed in (held or written), else the one the log had at start: what a
        check made again (a reload) resumes from, without reading the log."""
        return dict(self._known_cursors.get(check, {}))

    def waiting(self, kind: str) -> dict[str, tuple[Any, ...]]:
        """The side writes of `kind` not yet on disk, by key (what a reader must see at once)."""
        return {key: value for (k, key), value in self._side.items() if k == kind}

    @property
    def idle(self) -> bool:
        """Nothing held and nothing in flight."""
        return not (self._writing or self.backlog or self._side)

    # -- inputs ----------------------------------------------------------------------------------
    def append(self, events: list[Event], cursors: Mapping[str, Mapping[str, str]] | None = None,
               side: Side | None = None) -> None:
        """Hold `events` (in decision order), cursors and side writes, and write them as soon as the log allows:
        all of one call go in the same transaction."""
        self.backlog.extend(self._held(events))
        if cursors:
            self._cursors.update(cursors)
            self._known_cursors.update((name, dict(cursor)) for name, cursor in cursors.items())
        if side:
            self._side.update(side)
        self._compact_held()
        self._flush()

    def put(self, kind: str, key: str, value: tuple[Any, ...]) -> None:
        """One keyed side write (a kind of store.py's `_SIDE_WRITES`) for the next commit; reads see it at once
        through `waiting`."""
        self.append([], side={(kind, key): value})

    async def write(self, ev: Event, timeout: float) -> Event:
        """Append `ev` and return it as committed; TimeoutError if the log does not take it within `timeout`
        (it stays held and is written later)."""
        fut: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._waiters[id(ev)] = fut
        try:
            self.append([ev])
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            self._waiters.pop(id(ev), None)

    async def settled(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until what was appended before this call is written; False at once while
        the log has trouble (it will not be written soon)."""
        if not self.backlog:
            return True
        if self.error:
            return False
        fut = self._waiters.get(id(last := self.backlog[-1]))
        if fut is None:
            fut = self._waiters[id(last)] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
            return True
        except TimeoutError:
            return False

    def _stuck_for(self) -> float | None:
        """How long the write in progress has not returned, once that is STUCK_AFTER or more; else None."""
        busy = self.writer.busy_since
        if busy is None:
            return None
        waited = time.monotonic() - busy
        return waited if waited >= STUCK_AFTER else None

    @property
    def stuck(self) -> bool:
        """A write has not returned for STUCK_AFTER: the state disk does not answer (frozen, hung)."""
        return self._stuck_for() is not None

    def watch(self) -> None:
        """A write that does not come back is a state disk that does not answer: say so while it hangs."""
        if (stuck := self._stuck_for()) is not None:
            self._problem(f"a write to the event log has not returned for {stuck:.0f}s "
                          "(the state disk is not responding)")
        elif self.error:
            self._problem(self.error)  # keeps the condition fresh while the problem lasts

    def prune(self, max_age: float, max_events: int) -> None:
        """Retention, on the writer (it deletes rows); skipped while a prune is still running."""
        if self._pruning or not self.store.writable:  # nothing to prune in a log that cannot be written
            return
        self._pruning = True
        self.writer.run(lambda: self.store.prune(self.clock(), max_age, max_events), self._pruned)

    async def close(self, timeout: float) -> bool:
        """Write what is held, for at most `timeout` seconds; False if something could not be written."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            self._flush()
            if self.idle:
                break
            await asyncio.sleep(0.02)
        clean = not self.backlog and not self._writing
        # The write connection is closed by the writer thread itself, after what it still has to do: closing
        # it checkpoints the log (a write), which must never hold the caller on a frozen disk.
        self.writer.run(lambda: self.store.close(reader=False), lambda _result, _err: None)
        stopped = self.writer.stop(max(0.0, deadline - loop.time()))
        if not clean:
            log.error("stopping with %d events not written to the event log (%s); the checks will report "
                      "standing faults again after the restart", len(self.backlog),
                      self.error or "the write did not finish in time")
        return clean and stopped

    # -- writing ---------------------------------------------------------------------------------
    def _compact_held(self) -> None:
        """Past COMPACT_AT held events, compact those not in the write in flight (see compact)."""
        if len(self.backlog) - self._writing > COMPACT_AT:
            self.backlog = self.backlog[:self._writing] + compact(self.backlog[self._writing:])

    def _flush(self) -> None:
        """Start a write of everything held, unless one is in flight or a failed one waits for its retry."""
        if self._writing or not (self.backlog or self._cursors or self._side):
            return
        if self.error and not self._closing and self.clock() < self._retry_at:
            return
        batch, cursors, side = list(self.backlog), self._cursors, dict(self._side)
        self._writing, self._cursors = max(len(batch), 1), {}
        extra = {"side": side} if side else {}
        self.writer.run(lambda: self.store.commit(batch, cursors, **extra),
                        lambda done, err: self._written(batch, cursors, side, done, err))

    def _written(self, batch: list[Event], cursors: dict[str, Mapping[str, str]], side: Side,
                 done: list[Event] | None, err: BaseException | None) -> None:
        self._writing = 0
        if self._waiters:
            self._forget_waiters(batch if err is None else [])
        if err is not None or done is None:
            self._cursors = {**cursors, **self._cursors}
            self._compact_held()
            self._failed(err or RuntimeError("the write returned nothing"))
            return
        del self.backlog[:len(batch)]
        for key, value in side.items():  # forget what was written, unless it was replaced meanwhile
            if self._side.get(key) is value:
                del self._side[key]
        if self.error:
            log.warning("event log writable again: committed %d held events (held for %.0fs)", len(batch),
                        self.clock() - (self.error_since or self.clock()))
            self.error, self.error_since = "", None
            self.backlog.extend(self._held(self.on_trouble(None)))
        if done:
            self._committed(done)
            self.on_written(done)
            for before, ev in zip(batch, done, strict=True):
                c = ev.condition
                # The upper-case extras become journal fields (journalctl -o json, or COMPONENT=gpu/...).
                log.info("%s %s %s %s seq=%d: %s", ev.kind.name, c.severity.name, c.component, c.code, ev.seq,
                         c.message, extra={"SEVERITY": c.severity.name, "COMPONENT": c.component, "CODE": c.code,
                                           "ACTION": c.action.name, "EVENT": ev.kind.name, "SEQ": ev.seq})
                if (fut := self._waiters.get(id(before))) is not None and not fut.done():
                    fut.set_result(ev)
        self._flush()  # what was decided while this write ran

    def _committed(self, done: list[Event]) -> None:
        """The seqs readers show move here, and only here: after the commit returned."""
        for ev in done:
            key = ev.condition.key
            if ev.kind is EventKind.CLEARED:
                self._seqs.pop(key, None)
                continue
            self._seqs[key] = (ev.seq, ev.at)
            if ev.kind is EventKind.RAISED:
                self._raising[key] -= 1
                if self._raising[key] <= 0:
                    del self._raising[key]
        self.head = max(self.head, done[-1].seq)
        self.written += len(done)

    def _held(self, events: list[Event]) -> list[Event]:
        """`events`, after counting the RAISEDs among them (see seq_of)."""
        for ev in events:
            if ev.kind is EventKind.RAISED:
                self._raising[ev.condition.key] += 1
        return events

    def _forget_waiters(self, resolving: list[Event]) -> None:
        """Drop waiters whose event is no longer held (compacted away), except those this write resolves."""
        live = {id(e) for e in self.backlog} | {id(e) for e in resolving}
        for key in [k for k in self._waiters if k not in live]:
            del self._waiters[key]

    def _failed(self, err: BaseException) -> None:
        """Keep what could not be written; say so at once, then once a minute while it lasts."""
        self._retry_at = self.clock() + RETRY_EVERY
        self._problem(self.store.open_error if not self.store.writable and self.store.open_error
                      else f"{type(err).__name__}: {err}")

    def _problem(self, reason: str) -> None:
        now = self.clock()
        if not self.error:
            self.error_since = now
            self._last_error_log = 0.0
        changed = reason != self.error
        self.error = reason
        if changed and now - self._last_error_log >= ERROR_LOG_EVERY:
            log.error("cannot write the event log (%s): %d events held in memory, retried every second; "
                      "GetVerdict stays current, Watch streams wait", reason, len(self.backlog))
            self._last_error_log = now
        self.backlog.extend(self._held(self.on_trouble(reason)))

    def _pruned(self, through: Any, err: BaseException | None) -> None:
        self._pruning = False
        if err is not None:  # a full disk must not stop the ticks (and the watchdog)
            log.error("event log retention could not run: %s", err)
        elif through:
            self.pruned = max(self.pruned, int(through))
            self.on_pruned(int(through))
