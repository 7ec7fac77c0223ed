"""Schedules the checks: each poll check in its own long-lived thread under a deadline, each watcher as a task.

Each poll check's thread keeps the check's schedule itself and wakes the event loop only when there is
something to decide: findings, a failure, or a change of status. A healthy node's quiet polls cost one
timer wake of their own thread each and nothing on the loop (issue 15's CPU budget: the earlier design
handed each poll from the loop to the thread and back, three wakes a poll, ~100 µs of CPU each).

A poll that overruns its deadline becomes a CHECK_TIMEOUT finding and its thread is left to finish on
its own (Python cannot kill a thread stuck in a driver call); the check is not polled again until that
thread returns, and its late result is dropped. The loop's heartbeat finds overruns: at each beat it
looks at every poll in progress and arms a timer for the exact deadline of any that would pass it before
the next beat, so a hang is reported at its deadline, not a beat later. A poll that raises becomes
CHECK_ERROR. Either way the other checks keep their intervals and the daemon goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from robustd.check import Check, CheckConfig, CheckContext, CheckStatus
from robustd.model import Finding, FindingBatch, FindingKind

log = logging.getLogger("robustd.runner")

Sink = Callable[[FindingBatch], Any]
Standing = Callable[[str, str], bool]  # whether (component, code) is a standing condition (any thread may ask)
ContextFactory = Callable[[Check, CheckConfig], CheckContext]
WATCH_RETRY = 5.0
CLOSE_TIMEOUT = 0.4  # stopping the checks (at shutdown and reload) never waits longer than this
BEAT = 1.0  # the heartbeat: the watchdog's sign of life and the look for overrun polls (faster if a deadline is)
MIN_BEAT = 0.1  # a deadline shorter than this is seen up to this late


@dataclass
class CheckState:
    """What ListChecks shows about one check."""

    check: Check
    config: CheckConfig
    status: CheckStatus = CheckStatus.NOT_YET_RUN
    last_run: float | None = None
    last_duration: float | None = None
    last_error: str = ""
    runs: int = 0
    failures: int = 0
    stuck_since: float | None = None
    worker: _PollWorker | None = field(default=None, repr=False)
    ctx: CheckContext | None = field(default=None, repr=False)
    # `runs` is counted by the loop (watched batches, polls with news) and by the poll thread (quiet polls).
    _count: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return self.check.name

    def ran(self, took: float | None = None) -> None:
        """One more completed poll or watched batch (from any thread)."""
        with self._count:
            self.runs += 1
            if took is not None:
                self.last_duration = took


def failure(name: str, code: str, message: str, **evidence: str) -> Finding:
    return Finding(component=f"check/{name}", code=code, message=message, evidence=evidence,
                   kind=FindingKind.STATE)


class Runner:
    def __init__(self, checks: Sequence[tuple[Check, CheckConfig]], make_context: ContextFactory, sink: Sink,
                 clock: Callable[[], float] = time.time, standing: Standing | None = None):
        self.states = [CheckState(check=c, config=cfg) for c, cfg in checks]
        self.make_context = make_context
        self._sink = sink
        self._standing = standing or (lambda component, code: True)  # unknown: every RESOLVED is news
        self.clock = clock
        self.tasks: list[asyncio.Task[None]] = []
        self.last_tick = time.monotonic()  # the watchdog pings only while this moves
        self._recheck: asyncio.TimerHandle | None = None  # the exact deadline of a poll due before the next beat
        self._watchers: list[CheckState] = []

    def sink(self, batch: FindingBatch) -> None:
        """Hand a batch of findings to the engine; a failure there is logged, never the end of this check's loop."""
        try:
            self._sink(batch)
        except Exception:  # noqa: BLE001 - a poll loop that dies here would stop the check silently
            log.exception("check %s: its findings could not be processed", batch.check)

    async def start_sources(self) -> None:
        """Start every enabled watcher (e.g. position the kmsg reader). Failures become findings."""
        for st in self.states:
            if not st.config.enabled:
                st.status = CheckStatus.DISABLED
                continue
            reason = st.check.supported(self.make_context(st.check, st.config))
            if reason:
                st.status, st.last_error = CheckStatus.UNSUPPORTED, reason
                log.warning("check %s unsupported here: %s", st.name, reason)
                continue
            if st.check.mode in ("watch", "both"):
                await self._start_watch(st)

    def run(self) -> None:
        loop = asyncio.get_running_loop()
        beat = BEAT
        polled = [st for st in self.states if st.check.mode in ("poll", "both") and st.status.active]
        order = {id(st): i for i, st in enumerate(polled)}
        for st in self.states:
            if not st.status.active:
                continue
            if st.check.mode in ("watch", "both"):
                self._watchers.append(st)
                self.tasks.append(loop.create_task(self._watch_loop(st), name=f"watch-{st.name}"))
            if st.check.mode in ("poll", "both"):
                if st.ctx is None:  # one context per check and config: polls do not re-read the store
                    st.ctx = self.make_context(st.check, st.config)
                # Phases spread over the grid's half-beat, off its points: polls do not wait on each other
                # for the interpreter, nor on the loop's beats and ticks.
                phase = (order[id(st)] + 1) / (len(polled) + 1) * min(st.config.interval, BEAT / 2)
                st.worker = _PollWorker(st, st.ctx, loop, self.clock, self._deliver, self._standing, phase)
                beat = max(MIN_BEAT, min(beat, st.config.deadline))
        self.tasks.append(loop.create_task(self._heartbeat(beat), name="runner-heartbeat"))

    async def stop(self) -> None:
        """Cancel every loop and close the watchers, all within CLOSE_TIMEOUT: a loop or a close that hangs
        is left behind (logged), never waited for; stuck poll threads are daemon threads."""
        for t in self.tasks:
            t.cancel()
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        _, hung = await asyncio.wait(self.tasks, timeout=CLOSE_TIMEOUT) if self.tasks else (set(), set())
        for t in hung:
            log.warning("check loop %s ignored cancellation; left behind", t.get_name())
        self.tasks.clear()
        closing = []
        for st in self.states:
            if st.worker is not None:
                st.worker.stop()  # a stuck one never reads this; it is a daemon thread
                st.worker = None
            if st.check.mode in ("watch", "both") and st.status.active:
                closing.append(asyncio.ensure_future(self._close(st)))
        if closing:
            _, hung = await asyncio.wait(closing, timeout=CLOSE_TIMEOUT)
            for t in hung:
                t.cancel()

    @staticmethod
    async def _close(st: CheckState) -> None:
        try:
            await asyncio.wait_for(st.check.close(), CLOSE_TIMEOUT)
        except TimeoutError:
            log.warning("check %s did not close within %gs; left behind", st.name, CLOSE_TIMEOUT)
        except Exception:  # noqa: BLE001 - closing must not stop shutdown
            log.exception("closing check %s", st.name)

    async def _heartbeat(self, beat: float) -> None:
        """The scheduler is alive (the watchdog allows it 2 s), no poll overruns its deadline unseen, and no
        watcher hangs unseen. Beats fall on multiples of `beat` of the loop's clock, as the daemon's tick
        does, so one wake of the loop serves both."""
        while True:
            self.last_tick = time.monotonic()
            self._supervise(beat)
            self._look_at_watchers()
            await on_grid(beat)

    # -- poll checks ---------------------------------------------------------------------------
    def _deliver(self, worker: _PollWorker, findings: Any, error: BaseException | None, took: float) -> None:
        """On the loop: one poll's outcome, sent by its thread because it has something to say."""
        st = worker.st
        if st.worker is not worker:  # stopped (shutdown or reload) while the poll ran
            return
        if error is not None:
            st.last_duration = took
            st.status, st.failures = CheckStatus.ERROR, st.failures + 1
            st.last_error = f"{type(error).__name__}: {error}"
            log.warning("check %s raised %s", st.name, st.last_error)
            self.sink(FindingBatch(st.name, (failure(st.name, "CHECK_ERROR", f"check {st.name} failed: {st.last_error}",
                                               error=st.last_error),)))
            return
        st.ran(took)
        st.status, st.last_error, st.stuck_since = CheckStatus.OK, "", None
        self.sink(FindingBatch(st.name, tuple(findings or ())))

    def _supervise(self, beat: float) -> None:
        """FindingBatch polls past their deadline; arm one timer for the earliest deadline due before the next beat."""
        now = time.monotonic()
        earliest: float | None = None
        for st in self.states:
            worker = st.worker
            if worker is None:
                continue
            due = worker.overrun(now)
            if isinstance(due, str):
                self._timed_out(st, first=due == "first")
            elif due is not None and due < now + beat and (earliest is None or due < earliest):
                earliest = due
        if earliest is not None:
            if self._recheck is not None:
                self._recheck.cancel()
            self._recheck = asyncio.get_running_loop().call_at(earliest, self._supervise, beat)

    def _look_at_watchers(self) -> None:
        """Each watcher's own words for a wait stuck in its source (e.g. NVML_HANG on an event wait), once a beat."""
        for st in self._watchers:
            try:
                stuck = st.check.stuck_findings()
            except Exception:  # noqa: BLE001 - the look must not stop the heartbeat
                log.exception("check %s: stuck_findings raised", st.name)
                continue
            if stuck:
                self.sink(FindingBatch(st.name, tuple(stuck)))

    def _timed_out(self, st: CheckState, first: bool) -> None:
        """A poll is past its deadline: said at once as TIMEOUT, then again every interval while it stays stuck."""
        if first:
            st.status, st.failures, st.stuck_since = CheckStatus.TIMEOUT, st.failures + 1, st.last_run
            st.last_error = f"poll overran its {st.config.deadline:g}s deadline"
            log.warning("check %s: %s", st.name, st.last_error)
            self.sink(FindingBatch(st.name, self._timeout_findings(st, st.config.deadline)))
        else:
            stuck = self.clock() - (st.stuck_since or self.clock())
            self.sink(FindingBatch(st.name, self._timeout_findings(st, stuck)))

    def _timeout_findings(self, st: CheckState, stuck: float) -> tuple[Finding, ...]:
        """The check's own words for a stuck poll (e.g. NVML_HANG on the GPU it was asking), else CHECK_TIMEOUT."""
        try:
            own = st.check.timeout_findings(st.ctx or self.make_context(st.check, st.config), stuck)
        except Exception:  # noqa: BLE001 - the hook must not hide the timeout
            log.exception("check %s: timeout_findings raised", st.name)
            own = None
        if own:
            return tuple(own)
        return (failure(st.name, "CHECK_TIMEOUT", f"check {st.name} is stuck in a poll for {stuck:.0f}s "
                        f"(deadline {st.config.deadline:g}s)", deadline=f"{st.config.deadline:g}s",
                        stuck_for=f"{stuck:.0f}s"),)

    # -- watch checks --------------------------------------------------------------------------
    async def _start_watch(self, st: CheckState) -> bool:
        try:
            await asyncio.wait_for(st.check.start(self.make_context(st.check, st.config)), 30)
        except Exception as e:  # noqa: BLE001
            self._watch_failed(st, e)
            return False
        st.status = CheckStatus.WATCHING
        return True

    async def _watch_loop(self, st: CheckState) -> None:
        while True:
            if st.status is CheckStatus.WATCHING:
                try:
                    async for batch in st.check.watch():
                        st.ran()
                        st.last_run = self.clock()
                        self.sink(batch)
                    raise RuntimeError("the watcher's stream ended")
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001
                    self._watch_failed(st, e)
                    try:
                        await st.check.close()
                    except Exception:  # noqa: BLE001
                        log.exception("closing check %s", st.name)
            await asyncio.sleep(WATCH_RETRY)
            if st.status is not CheckStatus.WATCHING:
                await self._start_watch(st)

    def _watch_failed(self, st: CheckState, e: BaseException) -> None:
        st.status, st.failures = CheckStatus.ERROR, st.failures + 1
        st.last_error = f"{type(e).__name__}: {e}"
        log.error("check %s failed: %s (retrying every %gs)", st.name, st.last_error, WATCH_RETRY)
        self.sink(FindingBatch(st.name, (failure(st.name, "CHECK_ERROR", f"check {st.name} failed: {st.last_error}",
                                           error=st.last_error),)))


class _PollWorker:
    """One poll check's long-lived thread: it sleeps until the check's next slot, polls, and keeps quiet
    polls to itself.

    A poll is quiet when it found nothing new to the engine (nothing, or only "resolved" for conditions
    that do not stand) and the one before it was quiet too (the check is OK): the engine would do nothing
    with its findings, so only the counters ListChecks shows are updated, here. Anything else goes to the
    loop. The lock settles the race between a poll returning and the heartbeat declaring it overrun:
    whichever takes it first decides, and an overrun poll's result is dropped.
    """

    def __init__(self, st: CheckState, ctx: CheckContext, loop: asyncio.AbstractEventLoop,
                 clock: Callable[[], float], deliver: Callable[..., None], standing: Standing, phase: float = 0.0):
        self.st = st
        self._phase = phase  # after the first poll, polls fall at this offset from multiples of the interval
        self._ctx, self._loop, self._clock, self._deliver = ctx, loop, clock, deliver
        self._standing = standing
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._since: float | None = None  # time.monotonic() at the start of the poll in progress
        self._overran = False  # the heartbeat said the poll in progress is past its deadline
        self._said = 0.0  # when the heartbeat last reported it stuck
        self._clean = False  # the last poll found nothing, raised nothing and kept its deadline
        self.thread = threading.Thread(target=self._run, name=f"poll-{st.name}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def overrun(self, now: float) -> float | str | None:
        """For the heartbeat: "first" when the poll in progress has just passed its deadline, "again" when it
        is still stuck an interval after that was last said, its deadline while within it; else None."""
        with self._lock:
            if self._since is None:
                return None
            cfg = self.st.config
            if self._overran:
                if now - self._said < cfg.interval - 0.01:  # the beat's phase may land a hair short
                    return None
                self._said = now
                return "again"
            due = self._since + cfg.deadline
            if now < due:
                return due
            self._overran, self._clean, self._said = True, False, now
            return "first"

    def _nothing_to_say(self, findings: Any) -> bool:
        """No findings, or only "resolved" ones for conditions that do not stand (a healthy port says so
        every poll). A condition raised between this look and the next poll is resolved by that poll.
        Anything this cannot read (a third-party check returning odd things) goes to the loop to judge."""
        try:
            return all(f.kind is FindingKind.RESOLVED and not self._standing(f.component, f.code)
                       for f in findings or ())
        except Exception:  # noqa: BLE001 - never the end of this thread
            return False

    def _run(self) -> None:
        st, interval = self.st, self.st.config.interval
        next_at = time.monotonic()  # the first poll at once; then on the check's phase
        first = True
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            started = time.monotonic()
            with self._lock:
                self._since = started
            st.last_run = self._clock()
            findings: Any = None
            error: BaseException | None = None
            try:
                findings = st.check.poll(self._ctx)
            except BaseException as e:  # noqa: BLE001 - a check's failure is a finding
                error = e
            took = time.monotonic() - started
            with self._lock:
                self._since = None
                late, self._overran = self._overran, False
                clean = not late and error is None and self._nothing_to_say(findings)
                quiet, self._clean = clean and self._clean, clean
                if quiet:
                    st.ran(took)
            if self._stop.is_set():
                return
            if not (late or quiet):
                try:
                    self._loop.call_soon_threadsafe(self._deliver, self, findings, error, took)
                except RuntimeError:  # the loop is closed: robustd is exiting
                    return
            now = time.monotonic()
            if first:  # onto the phase, never sooner than half an interval (rates want their spacing)
                next_at, first = now + interval - (now - self._phase) % interval, False
                if next_at - now < interval / 2:
                    next_at += interval
                continue
            next_at += interval
            if next_at < now:  # a slow poll: skip the missed slots rather than bunching up
                next_at = now + interval - ((now - next_at) % interval)


async def on_grid(period: float) -> None:
    """Sleep to the next multiple of `period` on the loop's clock: loops that share a grid fall due
    together and cost one wake of the loop between them."""
    now = asyncio.get_running_loop().time()
    await asyncio.sleep(period - now % period)
