"""Where the event log's reads run: a thread of their own, each read with a deadline.

A read of SQLite is not safe on the event loop either. In WAL mode a reader marks what it reads in
the `-shm` file, a shared memory map on the state disk; on a frozen (fsfreeze), failing or very slow
disk that store into the map faults and sleeps in the kernel until the disk answers, and a thread
sleeping there cannot be interrupted. On the event-loop thread one such read froze every RPC, the
kernel-log reader and the watchdog with it. Every read after start therefore runs here, one at a
time, and its caller waits at most `deadline`: past it, or while an earlier read is still stuck,
it gets `Unreadable` at once (the API answers UNAVAILABLE, saying the log is unreadable), and what
is in memory (the verdict, the seqs, the reboot facts) keeps being served.

`InlineReads` runs the same reads at once on the caller's thread, for tools and unit tests that use
the engine without a daemon.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable, TypeVar

log = logging.getLogger("robustd.reads")
T = TypeVar("T")
READ_DEADLINE = 0.8  # how long a caller waits for one read; an RPC that reads the log answers within ~1 s
MAX_WAITING = 64  # reads queued at once; past it a caller is told the log is busy rather than queued


class Unreadable(Exception):
    """The event log could not be read within the deadline (the message says why)."""


class InlineReads:
    """Runs each read at once, on the caller's thread."""

    async def __call__(self, read: Callable[[], T]) -> T:
        return read()

    def stop(self, last: Callable[[], object] | None = None, timeout: float = 0.0) -> bool:
        if last is not None:
            last()
        return True


class ThreadReads:
    """One daemon thread that runs reads in order; each caller waits at most `deadline` for its own.

    A read whose caller gave up before it started is skipped; one already running is left to finish
    (nothing can stop it) and its result is dropped. While a read has been running for longer than
    `deadline`, new callers are refused at once instead of queueing behind it.
    """

    def __init__(self, deadline: float = READ_DEADLINE, max_waiting: int = MAX_WAITING,
                 name: str = "event-log-reader"):
        self.deadline = deadline
        self.max_waiting = max_waiting
        self.busy_since: float | None = None  # time.monotonic() the running read started at; None when idle
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future[object]] | None] = \
            queue.SimpleQueue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def __call__(self, read: Callable[[], T]) -> T:
        busy = self.busy_since
        if busy is not None and (stuck := time.monotonic() - busy) >= self.deadline:
            raise Unreadable(f"the event log is unreadable: a read has not returned for {stuck:.1f}s "
                             "(the state disk is not responding)")
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise Unreadable(f"the event log is busy: {self._waiting} reads are waiting")
            self._waiting += 1
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._jobs.put((read, fut))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.deadline)  # type: ignore[return-value]
        except TimeoutError:
            raise Unreadable(f"the event log is unreadable: a read did not return within {self.deadline:g}s "
                             "(the state disk is slow or not responding)") from None

    def stop(self, last: Callable[[], object] | None = None, timeout: float = 0.0) -> bool:
        """Run `last` (closing the read connection) after the reads queued now, on this thread, and end it;
        wait at most `timeout` for that. False if the thread is still busy: a read stuck in the kernel keeps
        it until the disk answers, and nobody can end it sooner."""
        if last is not None:
            with self._lock:
                self._waiting += 1
            self._jobs.put((last, concurrent.futures.Future()))
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            read, fut = item
            with self._lock:
                self._waiting -= 1
            if not fut.set_running_or_notify_cancel():
                continue  # its caller gave up before it started
            self.busy_since = time.monotonic()
            try:
                result = read()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            else:
                fut.set_result(result)
            finally:
                self.busy_since = None
