"""The single decider: findings → policy → event log → publish to watchers.

Decisions are made on the event-loop thread; the writes run on the writer thread (robustd/writer.py),
and an event is published to Watch streams and listeners only after its write returned, with its seq.
A Watch that subscribes and then reads the log therefore sees every event exactly once (the servicer
skips a seq it already sent, since a write can be on disk a moment before it is published).

When the event log cannot be written (disk full, read-only, failing or frozen state disk) nothing is
dropped: the events and cursors wait in memory, in order (compacted past COMPACT_AT), and are retried
every second. Meanwhile the policy's conditions — what GetVerdict reports — stay current, `store_error`
says why the log lags, and Watch streams get the events once they are on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterator, Mapping, Protocol

from robustd import bounds
from robustd.codes import CodeTable, Meaning
from robustd.hub import Hub, Subscriber
from robustd.model import Action, Condition, Event, EventKind, Finding, FindingKind, Report, Severity
from robustd.policy import Policy
from robustd.store import Store, iter_batches
from robustd.writer import InlineWriter, ThreadWriter

log = logging.getLogger("robustd.engine")
ERROR_LOG_EVERY = 60.0
COMPACT_AT = 1000  # held events beyond this are compacted (see compact)
RETRY_EVERY = 1.0  # a failed write is retried this often
STUCK_AFTER = 5.0  # a write still running after this long means the state disk does not answer
SETTLE_WAIT = 0.25  # how long GetVerdict and a Watch snapshot wait for writes in flight before answering
STORE_COMPONENT, STATE_CODE, STORE_SOURCE = "check/store", "STATE_UNWRITABLE", "store"
STATE_RESOLVED = Finding(component=STORE_COMPONENT, code=STATE_CODE, kind=FindingKind.RESOLVED,
                         message="the event log is written again")


def compact(events: list[Event]) -> list[Event]:
    """Drop each UPDATED that a later UPDATED of the same condition supersedes before any RAISED or CLEARED
    of it, so a long outage holds O(conditions x transitions) events, not one per repeat per second.

    What is kept still replays to the same conditions: every RAISED and CLEARED, and each condition's
    newest state between them.
    """
    superseded: set[int] = set()
    last_update: dict[tuple[str, str], int] = {}
    for i, ev in enumerate(events):
        key = ev.condition.key
        if ev.kind is EventKind.UPDATED:
            if key in last_update:
                superseded.add(last_update[key])
            last_update[key] = i
        else:
            last_update.pop(key, None)
    return [ev for i, ev in enumerate(events) if i not in superseded]


class PolicySettings(Protocol):
    """The reloadable `policy` section (robustd.config.PolicyConfig), as the engine reads it."""

    clear_after: float
    update_interval: float
    escalate_after_reboots: int
    max_conditions_per_code: int
    max_conditions: int


class EngineView:
    """What metrics, the daemon, the diagnostics and the API read of the engine — and nothing they could
    change: the standing conditions, what a code means, the event log's reads, and the hub to watch."""

    def __init__(self, engine: Engine):
        self._engine = engine

    # -- the verdict, from memory --------------------------------------------------------------
    def conditions(self) -> list[Condition]:
        """The standing conditions (a copy: changing it changes nothing)."""
        return list(self._engine.policy.conditions.values())

    def standing(self, component: str, code: str) -> bool:
        """Whether a condition stands for (component, code), as the policy keys it. Safe from any thread: one
        dict lookup (the poll threads ask before waking the loop with a "resolved" finding)."""
        return (bounds.token(component, bounds.MAX_COMPONENT), bounds.token(code, bounds.MAX_CODE)) \
            in self._engine.policy.conditions

    def snapshot(self) -> tuple[list[Condition], int]:
        return self._engine.snapshot()

    async def settled(self, timeout: float = SETTLE_WAIT) -> bool:
        return await self._engine.settled(timeout)

    def meaning(self, code: str, severity: Severity | None = None, action: Action | None = None) -> Meaning:
        """What `code` means under the current code table (rule files, then policy.codes)."""
        return self._engine.policy.meaning(code, severity, action)

    @property
    def events_total(self) -> int:
        return self._engine.events_total

    @property
    def store_error(self) -> str:
        """Why the event log lags ("" while it is written normally)."""
        return self._engine.store_error

    @property
    def events_held(self) -> int:
        """Decided changes not yet on disk."""
        return len(self._engine.backlog)

    # -- the event log -------------------------------------------------------------------------
    def head_seq(self) -> int:
        return self._engine.store.head_seq()

    def oldest_seq(self) -> int:
        return self._engine.store.oldest_seq()

    def pruned_through(self) -> int:
        return self._engine.store.pruned_through()

    def query(self, *, since: float | None, component: str, min_severity: int, limit: int,
              after_seq: int) -> list[Event]:
        return self._engine.store.query(since=since, component=component, min_severity=min_severity, limit=limit,
                                        after_seq=after_seq)

    def events_after(self, seq: int) -> Iterator[Event]:
        """Every committed event after `seq`, in order, read a batch at a time."""
        for batch in iter_batches(self._engine.store, seq):
            yield from batch

    # -- live events ---------------------------------------------------------------------------
    def subscribe(self) -> Subscriber:
        return self._engine.hub.subscribe()

    def unsubscribe(self, sub: Subscriber) -> None:
        self._engine.hub.unsubscribe(sub)


class NotWritten(Exception):
    """A change was decided, but the event log could not take it within the time allowed."""


class Engine:
    """Decides on the event-loop thread; writes on the writer's (robustd/writer.py); tells after the write.

    `backlog` holds every decided event not yet on disk, in order: the batch being written (its first
    `_writing` events) and what arrived since. A write that fails leaves it there, retried at most every
    RETRY_EVERY; a write that does not return within STUCK_AFTER is reported while it hangs. Either way
    the problem is a condition of robustd's own (`STATE_UNWRITABLE` on `check/store`), never a hardware
    verdict, and it clears once a write succeeds.
    """

    def __init__(self, policy: Policy, store: Store, clock: Callable[[], float] = time.time,
                 writer: InlineWriter | ThreadWriter | None = None):
        self.policy = policy
        self.store = store
        self.clock = clock
        self.writer = writer or InlineWriter()
        self.hub = Hub()
        self.view = EngineView(self)  # what readers get: never the policy, the store or the hub themselves
        self.events_total = 0
        self.listeners: list[Callable[[list[Event]], None]] = []  # e.g. the health service
        self.backlog: list[Event] = []  # decided, not yet on disk
        self._backlog_cursors: dict[str, Mapping[str, str]] = {}
        self._writing = 0  # how many of backlog's first events the write in flight carries (0: none in flight)
        self._waiters: dict[int, asyncio.Future[Event]] = {}  # id(event) -> whoever waits for its seq
        self.head = store.head_seq()  # the newest seq written, as published
        self.store_error = ""  # why the backlog is not being written; "" while the log is written normally
        self.store_error_since: float | None = None
        self._last_error_log = 0.0
        self._retry_at = 0.0
        self._pruning = False
        self._closing = False
        store.wants_flush = self._flush
        if not store.writable:
            self._retry_at = self.clock() + RETRY_EVERY
            self._store_problem(store.open_error or "the event log is not open")

    @property
    def reports(self) -> Store:
        """The diagnostics' shelf for their reports and golden digests (the event log's database file)."""
        return self.store

    def reload(self, table: CodeTable, policy: PolicySettings) -> None:
        """A config reload's part for the engine, in one place: the code table (rule files, policy.codes) and
        every key of the `policy` section. Standing conditions keep their state; new findings use the new ones."""
        self.policy.configure(table, policy)

    # -- inputs (event-loop thread) ------------------------------------------------------------
    def submit(self, report: Report) -> list[Event]:
        events = self.policy.apply(report.findings, report.check, self.clock())
        cursors = {report.check: report.cursor} if report.cursor is not None else None
        if events or cursors:
            self._enqueue(events, cursors)
        return events

    def tick(self) -> list[Event]:
        self._watch_writer()
        events = self.policy.tick(self.clock())
        self._enqueue(events)
        return events

    async def acknowledge(self, component: str, code: str, reason: str, timeout: float = 5.0) -> Event:
        """Clear a condition for an operator and return its event once written; KeyError if there is none,
        NotWritten if the log cannot take it within `timeout` (the clear stands and is written later)."""
        ev = self.policy.acknowledge(component, code, reason, self.clock())
        fut: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._waiters[id(ev)] = fut
        try:
            self._enqueue([ev])
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise NotWritten(f"the event log did not take the change within {timeout:g}s "
                             f"({self.store_error or 'a write is still in progress'}); the condition is cleared "
                             "and the event is written when the state disk answers") from None
        finally:
            self._waiters.pop(id(ev), None)

    def commit_events(self, events: list[Event]) -> None:
        self._enqueue(events)

    def prune(self, max_age: float, max_events: int) -> None:
        """Retention, on the writer (it deletes rows); skipped while a prune is still running."""
        if self._pruning or not self.store.writable:  # nothing to prune in a log that cannot be written
            return
        self._pruning = True
        self.writer.run(lambda: self.store.prune(self.clock(), max_age, max_events), self._pruned)

    def _pruned(self, result: Any, err: BaseException | None) -> None:
        self._pruning = False
        if err is not None:  # a full disk must not stop the ticks (and the watchdog)
            log.error("event log retention could not run: %s", err)

    # -- writing -------------------------------------------------------------------------------
    def _enqueue(self, events: list[Event], cursors: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.backlog.extend(events)
        if cursors:
            self._backlog_cursors.update(cursors)
        self._compact_held()
        self._flush()

    def _compact_held(self) -> None:
        """Past COMPACT_AT held events, compact those not in the write in flight (see compact)."""
        if len(self.backlog) - self._writing > COMPACT_AT:
            self.backlog = self.backlog[:self._writing] + compact(self.backlog[self._writing:])

    def _flush(self) -> None:
        """Start a write of everything held, unless one is in flight or a failed one waits for its retry."""
        if self._writing or not (self.backlog or self._backlog_cursors or self.store.has_side):
            return
        if self.store_error and not self._closing and self.clock() < self._retry_at:
            return
        batch, cursors, side = list(self.backlog), self._backlog_cursors, self.store.take_side()
        self._writing, self._backlog_cursors = max(len(batch), 1), {}
        extra = {"side": side} if side else {}
        self.writer.run(lambda: self.store.commit(batch, cursors, **extra),
                        lambda done, err: self._written(batch, cursors, side, done, err))

    def _written(self, batch: list[Event], cursors: dict[str, Mapping[str, str]],
                 side: Mapping[tuple[str, str], tuple[Any, ...]], done: list[Event] | None,
                 err: BaseException | None) -> None:
        self._writing = 0
        if self._waiters:
            self._forget_waiters(batch if err is None else [])
        if err is not None or done is None:
            self._backlog_cursors = {**cursors, **self._backlog_cursors}
            self._compact_held()
            self._failed(err or RuntimeError("the write returned nothing"))
            return
        del self.backlog[:len(batch)]
        self.store.settle_side(side)
        if self.store_error:
            log.warning("event log writable again: committed %d held events (held for %.0fs)", len(batch),
                        self.clock() - (self.store_error_since or self.clock()))
            self.store_error, self.store_error_since = "", None
            self.backlog.extend(self.policy.apply([STATE_RESOLVED], STORE_SOURCE, self.clock()))
        self.policy.committed(done)
        if done:
            self.head = max(self.head, done[-1].seq)
            self.events_total += len(done)
            self.hub.publish(done)
            for listener in self.listeners:
                listener(done)
            for before, ev in zip(batch, done, strict=True):
                c = ev.condition
                # The upper-case extras become journal fields (journalctl -o json, or COMPONENT=gpu/...).
                log.info("%s %s %s %s seq=%d: %s", ev.kind.name, c.severity.name, c.component, c.code, ev.seq,
                         c.message, extra={"SEVERITY": c.severity.name, "COMPONENT": c.component, "CODE": c.code,
                                           "ACTION": c.action.name, "EVENT": ev.kind.name, "SEQ": ev.seq})
                if (fut := self._waiters.get(id(before))) is not None and not fut.done():
                    fut.set_result(ev)
        self._flush()  # what was decided while this write ran

    def _forget_waiters(self, resolving: list[Event]) -> None:
        """Drop waiters whose event is no longer held (compacted away), except those this write resolves."""
        live = {id(e) for e in self.backlog} | {id(e) for e in resolving}
        for key in [k for k in self._waiters if k not in live]:
            del self._waiters[key]

    def _failed(self, err: BaseException) -> None:
        """Keep what could not be written; say so at once, then once a minute while it lasts."""
        self._retry_at = self.clock() + RETRY_EVERY
        self._store_problem(self.store.open_error if not self.store.writable and self.store.open_error
                            else f"{type(err).__name__}: {err}")

    def _watch_writer(self) -> None:
        """A write that does not come back is a state disk that does not answer: say so while it hangs."""
        busy = self.writer.busy_since
        if busy is not None and (stuck := time.monotonic() - busy) >= STUCK_AFTER:
            self._store_problem(f"a write to the event log has not returned for {stuck:.0f}s "
                                "(the state disk is not responding)")
        elif self.store_error:
            self._store_problem(self.store_error)  # keeps the condition fresh while the problem lasts

    def _store_problem(self, reason: str) -> None:
        now = self.clock()
        if not self.store_error:
            self.store_error_since = now
            self._last_error_log = 0.0
        changed = reason != self.store_error
        self.store_error = reason
        held = len(self.backlog)
        if changed and now - self._last_error_log >= ERROR_LOG_EVERY:
            log.error("cannot write the event log (%s): %d events held in memory, retried every second; "
                      "GetVerdict stays current, Watch streams wait", reason, held)
            self._last_error_log = now
        finding = Finding(component=STORE_COMPONENT, code=STATE_CODE, kind=FindingKind.STATE,
                          message=f"the event log in {self.store.state_dir} cannot be written: {reason}",
                          evidence={"error": reason, "state_dir": self.store.state_dir})
        self.backlog.extend(self.policy.apply([finding], STORE_SOURCE, now))
        for listener in self.listeners:
            listener([])  # the conditions changed even though the log did not

    def end_watches(self) -> None:
        """End every Watch stream now, and any that starts from now on (the daemon is stopping)."""
        self.hub.close()

    async def close(self, timeout: float) -> bool:
        """Write what is held, for at most `timeout` seconds; False if something could not be written."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            self._flush()
            if not self._writing and not self.backlog and not self.store.has_side:
                break
            await asyncio.sleep(0.02)
        clean = not self.backlog and not self._writing
        stopped = self.writer.stop(max(0.0, deadline - loop.time()))
        if not clean:
            log.error("stopping with %d events not written to the event log (%s); the checks will report "
                      "standing faults again after the restart", len(self.backlog),
                      self.store_error or "the write did not finish in time")
        self.store.close(writer=stopped)
        return clean and stopped

    async def settled(self, timeout: float = SETTLE_WAIT) -> bool:
        """Wait (at most `timeout`) until what was decided before this call is written, so an answer from
        memory carries the seqs the log gave; a stuck or failing disk only delays it by `timeout`."""
        if not self.backlog:
            return True
        if self.store_error:  # it will not be written soon: answer from memory now
            return False
        fut = self._waiters.get(id(last := self.backlog[-1]))
        if fut is None:
            fut = self._waiters[id(last)] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
            return True
        except TimeoutError:
            return False

    def snapshot(self) -> tuple[list[Condition], int]:
        """The standing conditions (by seq) and the newest seq, read together, from memory."""
        conds = sorted(self.policy.conditions.values(), key=lambda c: c.seq)
        return conds, self.head
