"""Where the event log's writes run: a thread of their own, so a stuck state disk never stalls the API.

SQLite's commit ends in fsync(2); on a frozen, failing or very slow disk that call blocks for as long
as the disk does, and a thread blocked there cannot be interrupted. Run on the event-loop thread it
froze every RPC, the Watch streams and the watchdog with it. Every write therefore runs here, one at a
time and in order, and its outcome is handed back to the event loop; the journal meanwhile keeps what
is not yet written in memory (bounded: see robustd/journal.py) and GetVerdict answers from memory.

`InlineWriter` runs the same jobs at once on the caller's thread, for unit tests that drive the engine
without an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

log = logging.getLogger("robustd.writer")

Job = Callable[[], Any]
Done = Callable[[Any, BaseException | None], None]


class InlineWriter:
    """Runs each job immediately and reports its outcome before returning."""

    busy_since: float | None = None

    def run(self, job: Job, done: Done) -> None:
        try:
            result = job()
        except Exception as e:  # noqa: BLE001 - the outcome, good or bad, goes to `done`
            done(None, e)
            return
        done(result, None)

    def stop(self, timeout: float) -> bool:
        return True


class ThreadWriter:
    """One daemon thread running jobs in submission order; `done` is called on the event loop.

    `busy_since` (time.monotonic) says how long the current job has been running, so the journal can
    report a stuck disk while the job is still inside fsync. The thread is a daemon thread: a job stuck
    in the kernel can never hold the process's exit.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "event-log-writer"):
        self.loop = loop
        self.busy_since: float | None = None
        self._jobs: queue.SimpleQueue[tuple[Job, Done] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run(self, job: Job, done: Done) -> None:
        self._jobs.put((job, done))

    def stop(self, timeout: float) -> bool:
        """Let queued jobs finish, for at most `timeout` seconds; False if the thread is still busy."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done = item
            self.busy_since = time.monotonic()
            try:
                result, error = job(), None
            except Exception as e:  # noqa: BLE001 - handed to `done` on the loop
                result, error = None, e
            finally:
                self.busy_since = None
            try:
                self.loop.call_soon_threadsafe(done, result, error)
            except RuntimeError:  # the loop is closed: the daemon is exiting and nobody waits for this
                log.debug("event-log write finished after the event loop closed")
