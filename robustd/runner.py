"""Schedules the checks: each poll in its own thread under a deadline, each watcher as a task.

A poll that overruns its deadline becomes a CHECK_TIMEOUT finding and its thread is left to
finish on its own (Python cannot kill a thread stuck in a driver call); the check is not
polled again until that thread returns. A poll that raises becomes CHECK_ERROR. Either way
the other checks keep their intervals and the daemon goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from robustd.check import Check, CheckConfig, CheckContext
from robustd.model import Finding, FindingKind, Report

log = logging.getLogger("robustd.runner")

Sink = Callable[[Report], Any]
ContextFactory = Callable[[Check, CheckConfig], CheckContext]
WATCH_RETRY = 5.0
CLOSE_TIMEOUT = 0.4  # stopping the checks (at shutdown and reload) never waits longer than this


@dataclass
class CheckState:
    """What ListChecks shows about one check."""

    check: Check
    config: CheckConfig
    status: str = "NOT_YET_RUN"  # NOT_YET_RUN OK ERROR TIMEOUT DISABLED UNSUPPORTED WATCHING
    last_run: float | None = None
    last_duration: float | None = None
    last_error: str = ""
    runs: int = 0
    failures: int = 0
    stuck_since: float | None = None
    pending: asyncio.Future[Sequence[Finding]] | None = field(default=None, repr=False)
    worker: _Worker | None = field(default=None, repr=False)
    ctx: CheckContext | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.check.name


def failure(name: str, code: str, message: str, **evidence: str) -> Finding:
    return Finding(component=f"check/{name}", code=code, message=message, evidence=evidence,
                   kind=FindingKind.STATE)


class Runner:
    def __init__(self, checks: Sequence[tuple[Check, CheckConfig]], make_context: ContextFactory, sink: Sink,
                 clock: Callable[[], float] = time.time):
        self.states = [CheckState(check=c, config=cfg) for c, cfg in checks]
        self.make_context = make_context
        self._sink = sink
        self.clock = clock
        self.tasks: list[asyncio.Task[None]] = []
        self.last_tick = time.monotonic()  # the watchdog pings only while this moves

    def sink(self, report: Report) -> None:
        """Hand a report to the engine; a failure there is logged, never the end of this check's loop."""
        try:
            self._sink(report)
        except Exception:  # noqa: BLE001 - a poll loop that dies here would stop the check silently
            log.exception("check %s: its report could not be processed", report.check)

    async def start_sources(self) -> None:
        """Start every enabled watcher (e.g. position the kmsg reader). Failures become findings."""
        for st in self.states:
            if not st.config.enabled:
                st.status = "DISABLED"
                continue
            reason = st.check.supported(self.make_context(st.check, st.config))
            if reason:
                st.status, st.last_error = "UNSUPPORTED", reason
                log.warning("check %s unsupported here: %s", st.name, reason)
                continue
            if st.check.mode in ("watch", "both"):
                await self._start_watch(st)

    def run(self) -> None:
        for st in self.states:
            if st.status in ("DISABLED", "UNSUPPORTED"):
                continue
            loop = asyncio.get_running_loop()
            if st.check.mode in ("watch", "both"):
                self.tasks.append(loop.create_task(self._watch_loop(st), name=f"watch-{st.name}"))
            if st.check.mode in ("poll", "both"):
                self.tasks.append(loop.create_task(self._poll_loop(st), name=f"poll-{st.name}"))
        self.tasks.append(asyncio.get_running_loop().create_task(self._heartbeat(), name="runner-heartbeat"))

    async def stop(self) -> None:
        """Cancel every loop and close the watchers, all within CLOSE_TIMEOUT: a loop or a close that hangs
        is left behind (logged), never waited for; stuck poll threads are daemon threads."""
        for t in self.tasks:
            t.cancel()
        _, hung = await asyncio.wait(self.tasks, timeout=CLOSE_TIMEOUT) if self.tasks else (set(), set())
        for t in hung:
            log.warning("check loop %s ignored cancellation; left behind", t.get_name())
        self.tasks.clear()
        closing = []
        for st in self.states:
            if st.worker is not None:
                st.worker.stop()  # a stuck one never reads this; it is a daemon thread
                st.worker = None
            if st.check.mode in ("watch", "both") and st.status not in ("DISABLED", "UNSUPPORTED"):
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

    async def _heartbeat(self) -> None:
        """The scheduler is alive even while no poll is due; the watchdog allows it 2 s."""
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(1.0)

    # -- poll checks ---------------------------------------------------------------------------
    async def _poll_loop(self, st: CheckState) -> None:
        loop = asyncio.get_running_loop()
        interval = st.config.interval
        next_at = loop.time()
        while True:
            self.last_tick = time.monotonic()
            if st.pending is not None and not st.pending.done():
                stuck = self.clock() - (st.stuck_since or self.clock())
                self.sink(Report(st.name, self._timeout_findings(st, stuck)))
            else:
                await self._poll_once(st, loop)
            next_at += interval
            now = loop.time()
            if next_at < now:  # a slow poll: skip the missed slots rather than bunching up
                next_at = now + interval - ((now - next_at) % interval)
            await asyncio.sleep(next_at - now)

    async def _poll_once(self, st: CheckState, loop: asyncio.AbstractEventLoop) -> None:
        if st.ctx is None:  # one context per check and config: polls do not re-read the store
            st.ctx = self.make_context(st.check, st.config)
        ctx = st.ctx
        fut: asyncio.Future[Sequence[Finding]] = loop.create_future()
        fut.add_done_callback(_consume_exception)
        st.pending = fut
        started = time.monotonic()
        st.last_run = self.clock()

        def work() -> None:
            try:
                result: Any = st.check.poll(ctx)
                loop.call_soon_threadsafe(_resolve, fut, result, None)
            except BaseException as e:  # noqa: BLE001 - a check's failure is a finding
                loop.call_soon_threadsafe(_resolve, fut, None, e)

        if st.worker is None:
            st.worker = _Worker(f"poll-{st.name}")
        st.worker.submit(work)
        try:
            findings = await asyncio.wait_for(asyncio.shield(fut), st.config.deadline)
        except TimeoutError:
            st.status, st.failures, st.stuck_since = "TIMEOUT", st.failures + 1, st.last_run
            st.last_error = f"poll overran its {st.config.deadline:g}s deadline"
            log.warning("check %s: %s", st.name, st.last_error)
            self.sink(Report(st.name, self._timeout_findings(st, st.config.deadline)))
            return
        except Exception as e:  # noqa: BLE001
            st.status, st.failures = "ERROR", st.failures + 1
            st.last_error = f"{type(e).__name__}: {e}"
            st.last_duration = time.monotonic() - started
            log.warning("check %s raised %s", st.name, st.last_error)
            self.sink(Report(st.name, (failure(st.name, "CHECK_ERROR", f"check {st.name} failed: {st.last_error}",
                                               error=st.last_error),)))
            return
        st.runs += 1
        st.status, st.last_error, st.stuck_since = "OK", "", None
        st.last_duration = time.monotonic() - started
        self.sink(Report(st.name, tuple(findings or ())))

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
        st.status = "WATCHING"
        return True

    async def _watch_loop(self, st: CheckState) -> None:
        while True:
            if st.status == "WATCHING":
                try:
                    async for report in st.check.reports():
                        st.runs += 1
                        st.last_run = self.clock()
                        self.sink(report)
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
            if st.status != "WATCHING":
                await self._start_watch(st)

    def _watch_failed(self, st: CheckState, e: BaseException) -> None:
        st.status, st.failures = "ERROR", st.failures + 1
        st.last_error = f"{type(e).__name__}: {e}"
        log.error("check %s failed: %s (retrying every %gs)", st.name, st.last_error, WATCH_RETRY)
        self.sink(Report(st.name, (failure(st.name, "CHECK_ERROR", f"check {st.name} failed: {st.last_error}",
                                           error=st.last_error),)))


class _Worker:
    """One long-lived thread per poll check: cheaper than a thread per poll, and a poll that
    hangs keeps its thread (the runner submits nothing more until that poll returns)."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


def _resolve(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
