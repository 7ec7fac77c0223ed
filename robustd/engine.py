"""The single decider: findings → policy → journal → event log → hub and listeners, one way.

The engine composes three small pieces and adds nothing but their order:

- the **policy** (robustd/policy.py) decides, on the event-loop thread, from memory only: it never
  waits on the disk and never hears back what the log made of its events (beyond the committed events
  it keeps its reboot facts from);
- the **journal** (robustd/journal.py) holds what was decided until the writer thread has committed it,
  retries while the state disk has trouble, and keeps the seqs readers show (the head, and the last
  committed seq of each standing condition);
- the **hub** (robustd/hub.py) and the listeners hear of an event only after its write returned, with
  its seq. A Watch that subscribes and then reads the log therefore sees every event exactly once (the
  servicer skips a seq it already sent).

Readers get `EngineView`: the policy's conditions with the journal's seqs, the log's reads up to the
head, and the hub to watch. When the log cannot be written, GetVerdict stays current (the policy's
conditions), `store_error` says why the log lags, `STATE_UNWRITABLE` stands on `check/store`, and Watch
streams get the events once they are on disk.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable, Iterable, Mapping, Protocol

from robustd.codes import CodeTable, Meaning
from robustd.hub import Hub, Subscriber
from robustd.journal import Journal
from robustd.model import Action, Condition, Event, Finding, FindingBatch, FindingKind, Severity
from robustd.policy import Policy
from robustd.reads import InlineReads, ThreadReads
from robustd.store import Store
from robustd.writer import InlineWriter, ThreadWriter

READS_CLOSE_WAIT = 0.2  # how long a stop waits for the reader thread to close its connection
SETTLE_WAIT = 0.25  # how long GetVerdict and a Watch snapshot wait for writes in flight before answering
STORE_COMPONENT, STATE_CODE, STORE_SOURCE = "check/store", "STATE_UNWRITABLE", "store"
STATE_RESOLVED = Finding(component=STORE_COMPONENT, code=STATE_CODE, kind=FindingKind.RESOLVED,
                         message="the event log is written again")


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
        self._policy = engine.policy
        self._journal = engine.journal
        self._store = engine.store
        self._reads = engine.reads

    # -- the verdict, from memory --------------------------------------------------------------
    def conditions(self) -> list[Condition]:
        """The standing conditions as the policy holds them, without seqs (snapshot() has those); a copy."""
        return list(self._policy.conditions.values())

    def standing(self, component: str, code: str) -> bool:
        """Whether a condition stands for (component, code). Safe from any thread (the poll threads ask before
        waking the loop with a "resolved" finding)."""
        return self._policy.stands(component, code)

    def snapshot(self) -> tuple[list[Condition], int]:
        return self._engine.snapshot()

    async def settled(self, timeout: float = SETTLE_WAIT) -> bool:
        """Wait (at most `timeout`) until what was decided before this call is written, so an answer from
        memory carries the seqs the log gave; a stuck or failing disk only delays it by `timeout`."""
        return await self._journal.settled(timeout)

    def meaning(self, code: str, severity: Severity | None = None, action: Action | None = None) -> Meaning:
        """What `code` means under the current code table (rule files, then policy.codes)."""
        return self._policy.meaning(code, severity, action)

    @property
    def events_total(self) -> int:
        """Events written since start."""
        return self._journal.written

    @property
    def store_error(self) -> str:
        """Why the event log lags ("" while it is written normally)."""
        return self._journal.error

    @property
    def disk_stuck(self) -> bool:
        """The state disk does not answer (a write has hung): what needs files there must not start now."""
        return self._journal.stuck

    @property
    def events_held(self) -> int:
        """Decided changes not yet on disk."""
        return len(self._journal.backlog)

    # -- the event log -------------------------------------------------------------------------
    # From memory: what the journal knows without asking SQLite.
    def head_seq(self) -> int:
        """The newest seq written and told: every event a reader is given has a seq up to it."""
        return self._journal.head

    def pruned_through(self) -> int:
        """Retention has deleted every event up to this seq."""
        return self._journal.pruned

    def cursor(self, check: str) -> dict[str, str]:
        """Where stream check `check` resumes (its newest cursor)."""
        return self._journal.cursor(check)

    # Off the loop: reads of the log on the reader thread, each within its deadline, else reads.Unreadable.
    async def query(self, *, since: float | None, component: str, min_severity: int, limit: int,
                    after_seq: int) -> tuple[list[Event], int]:
        """The newest `limit` matching events (oldest first, up to the head) and the oldest seq the log holds."""
        store, head = self._store, self._journal.head

        def read() -> tuple[list[Event], int]:
            return (store.query(since=since, component=component, min_severity=min_severity, limit=limit,
                                after_seq=after_seq, through=head), store.oldest_seq())
        return await self._reads(read)

    async def events_after(self, seq: int, batch: int = 500) -> AsyncIterator[Event]:
        """Every event after `seq` up to the head, in order, read a batch at a time. An event on disk but not
        yet told is left to the hub, which tells it next: a reader never holds a seq past head_seq()."""
        store = self._store
        while True:
            head = self._journal.head
            events = await self._reads(lambda after=seq, through=head: store.events_after(after, batch, through))
            if not events:
                return
            for ev in events:
                yield ev
            seq = events[-1].seq

    # -- live events ---------------------------------------------------------------------------
    def subscribe(self) -> Subscriber:
        return self._engine.hub.subscribe()

    def unsubscribe(self, sub: Subscriber) -> None:
        self._engine.hub.unsubscribe(sub)


class NotWritten(Exception):
    """A change was decided, but the event log could not take it within the time allowed."""


class Engine:
    """Decides on the event-loop thread (the policy); writes through the journal; tells after the write.

    A state disk that cannot be written is a condition of robustd's own (`STATE_UNWRITABLE` on
    `check/store`), never a hardware verdict: the journal says why, the policy makes it a condition,
    and it clears once a write succeeds.
    """

    def __init__(self, policy: Policy, store: Store, clock: Callable[[], float] = time.time,
                 writer: InlineWriter | ThreadWriter | None = None, standing: Iterable[Condition] = (),
                 reads: InlineReads | ThreadReads | None = None,
                 cursors: Mapping[str, Mapping[str, str]] | None = None):
        """`standing`: the conditions the log holds at start, as the policy loaded them (their seqs). `reads`:
        where reads of the log run once started (robustd/reads.py; at once on the caller's thread if None).
        `cursors`: the stream checks' cursors the log holds at start, as the checks were made with them."""
        self.policy = policy
        self.store = store
        self.reads = reads or InlineReads()
        self.clock = clock
        self.hub = Hub()
        self.listeners: list[Callable[[list[Event]], None]] = []  # e.g. the health service
        self._shown: dict[tuple[str, str], tuple[Condition, tuple[int, float], Condition]] = {}  # see snapshot
        self.journal = Journal(store, clock, writer, standing=standing, cursors=cursors, on_trouble=self._trouble,
                               on_written=self._written, on_pruned=policy.pruned)
        self.view = EngineView(self)  # what readers get: never the policy, the journal or the hub themselves

    def reload(self, table: CodeTable, policy: PolicySettings) -> None:
        """A config reload's part for the engine, in one place: the code table (rule files, policy.codes) and
        every key of the `policy` section. Standing conditions keep their state; new findings use the new ones."""
        self.policy.configure(table, policy)

    # -- inputs (event-loop thread) ------------------------------------------------------------
    def submit(self, batch: FindingBatch) -> list[Event]:
        events = self.policy.apply(batch.findings, batch.check, self.clock())
        cursors = {batch.check: batch.cursor} if batch.cursor is not None else None
        if events or cursors:
            self.journal.append(events, cursors)
        return events

    def tick(self) -> list[Event]:
        self.journal.watch()
        events = self.policy.tick(self.clock())
        self.journal.append(events)
        return events

    def reboot(self, boot_id: str) -> list[Event]:
        """The log last saw another boot: clear every condition of an earlier boot and record `boot_id`, in one
        transaction (a crash leaves both or neither)."""
        events = self.policy.reboot(self.clock(), boot_id)
        self.journal.append(events, side={("meta", "boot_id"): (boot_id,)})
        return events

    async def acknowledge(self, component: str, code: str, reason: str, timeout: float = 5.0) -> Event:
        """Clear a condition for an operator and return its event once written; KeyError if there is none,
        NotWritten if the log cannot take it within `timeout` (the clear stands and is written later)."""
        ev = self.policy.acknowledge(component, code, reason, self.clock())
        try:
            return await self.journal.write(ev, timeout)
        except TimeoutError:
            raise NotWritten(f"the event log did not take the change within {timeout:g}s "
                             f"({self.journal.error or 'a write is still in progress'}); the condition is cleared "
                             "and the event is written when the state disk answers") from None

    def prune(self, max_age: float, max_events: int) -> None:
        self.journal.prune(max_age, max_events)

    # -- what the journal reports --------------------------------------------------------------
    def _written(self, done: list[Event]) -> None:
        self.policy.logged(done)
        self.hub.publish(done)
        for listener in self.listeners:
            listener(done)

    def _trouble(self, reason: str | None) -> list[Event]:
        """The log's trouble as a condition of its own (reason None: it is over)."""
        if reason is None:
            return self.policy.apply([STATE_RESOLVED], STORE_SOURCE, self.clock())
        state_dir = self.store.state_dir
        finding = Finding(component=STORE_COMPONENT, code=STATE_CODE, kind=FindingKind.STATE,
                          message=f"the event log in {state_dir} cannot be written: {reason}",
                          evidence={"error": reason, "state_dir": state_dir})
        events = self.policy.apply([finding], STORE_SOURCE, self.clock())
        for listener in self.listeners:
            listener([])  # the conditions changed even though the log did not
        return events

    # -- stopping ------------------------------------------------------------------------------
    def end_watches(self) -> None:
        """End every Watch stream now, and any that starts from now on (the daemon is stopping)."""
        self.hub.close()

    async def close(self, timeout: float) -> bool:
        """Write what is held, for at most `timeout` seconds in all; False if something could not be written.

        The reader thread closes the read connection (waited for briefly: nobody reads any more), then the
        journal writes and the writer thread closes the write connection last, which checkpoints the log.
        Each thread closes its own connection, so a stuck disk holds only that thread, never the caller."""
        store = self.store
        self.reads.stop(lambda: store.close(writer=False), timeout=min(READS_CLOSE_WAIT, timeout / 4))
        return await self.journal.close(timeout)

    # -- readers -------------------------------------------------------------------------------
    def snapshot(self) -> tuple[list[Condition], int]:
        """The standing conditions, each with the seq of its last committed change (journal.seq_of), ordered by
        it, and the head seq: read together, from memory, on the event loop.

        A composed condition is kept while neither it nor its seq changes, so it is the same object from one
        call to the next (the API serialises each condition once: robustd/api/convert.py).
        """
        seq_of, cache = self.journal.seq_of, self._shown
        fresh: dict[tuple[str, str], tuple[Condition, tuple[int, float], Condition]] = {}
        for key, c in self.policy.conditions.items():
            committed = seq_of(key)
            hit = cache.get(key)
            if hit is None or hit[0] is not c or hit[1] != committed:
                hit = (c, committed, c.with_seq(*committed))
            fresh[key] = hit
        self._shown = fresh
        return sorted((hit[2] for hit in fresh.values()), key=lambda c: c.seq), self.journal.head

