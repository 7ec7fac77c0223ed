"""Online straggler monitoring (the study's SMon loop) over a recorder's trace directory.

Each time every (DP, PP) worker has written its shard of a window, the window is analysed on its own and
reported as one line: its slowdown S, the GPU time wasted, the first cause hint and the slowest workers;
the heatmap PNG is rewritten. When S stays above `alert_slowdown` (the study's 1.1: a straggling job) for
`alert_windows` consecutive windows, the watch raises an alert and stops: one slow window is noise, a run
of them is a job to act on (evict the named worker, repartition, rebalance the data, schedule GC).

Waiting is bounded: the watch ends when every rank's recorder has closed and its windows are analysed,
or when no new window has appeared for `idle_timeout` seconds. A metadata file that does not parse is
waited on for `META_GRACE_S` while following (a job's launcher may still be writing it, not every writer
replaces the file atomically as the recorder does); after that, and at once with --once, it is an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from robustd.cli import exitcodes
from robustd.stragglers import heatmap, tracedir
from robustd.stragglers.analysis import Report, analyze
from robustd.stragglers.optrace import Meta, OpTraceError
from robustd.stragglers.recorder import METADATA, replacing

EXIT_OK, EXIT_ALERT = exitcodes.OK, exitcodes.ALERT
META_GRACE_S = 5.0  # how long a malformed metadata file may stay so while following (a writer mid-write)
MAX_WINDOWS_PER_POLL = 64  # a watch far behind reports the newest windows, not a backlog of thousands


@dataclass
class Window:
    first: int  # the window's first step (its shard name)
    steps: list[int]
    report: Report | None
    error: str = ""

    def to_json(self) -> dict:
        if self.report is None:
            return {"window": self.first, "error": self.error}
        r = self.report
        return {"window": self.first, "steps": self.steps, "slowdown": round(r.slowdown, 6),
                "wasted_fraction": round(r.wasted_fraction, 6), "trusted": r.trusted, "cause": r.causes[0].kind,
                "evidence": r.causes[0].evidence, "slowest": [w.to_json() for w in r.workers[:3]]}

    def line(self) -> str:
        span = f"steps {self.steps[0]}-{self.steps[-1]}" if self.steps else f"window {self.first}"
        if self.report is None:
            return f"{span}: error: {self.error}"
        r = self.report
        slow = ", ".join(f"DP {w.dp_rank} PP {w.pp_rank} {w.slowdown:.2f}" for w in r.workers[:3])
        return (f"{span}: S = {r.slowdown:.3f}, wasted {r.wasted_fraction:.1%}, cause {r.causes[0].kind}; "
                f"slowest {slow}")


@dataclass
class Watch:
    """The state of one watch: which windows were reported and the current run of straggling ones."""

    directory: Path
    alert_windows: int = 3
    alert_slowdown: float = 1.1
    heatmap_path: Path | None = None
    meta: Meta | None = None
    seen: set[int] = field(default_factory=set)
    streak: list[Window] = field(default_factory=list)
    finished: bool = False  # every rank's recorder had closed when the last scan began
    meta_grace_s: float = 0.0  # follow() sets META_GRACE_S; 0: a malformed metadata file fails at once
    meta_bad_since: float | None = None

    def poll(self, now: float = 0.0) -> list[Window]:
        """Analyse the windows completed since the last poll, oldest first."""
        if self.meta is None:
            if not (self.directory / METADATA).exists():
                return []
            try:
                self.meta = tracedir.load_meta(self.directory)
            except OpTraceError:
                self.meta_bad_since = now if self.meta_bad_since is None else self.meta_bad_since
                if now - self.meta_bad_since >= self.meta_grace_s:
                    raise
                return []  # perhaps still being written: the next poll reads it again
        listing = tracedir.scan(self.directory, self.meta)
        new = [w for w in listing.complete(self.meta) if w not in self.seen]
        skipped = new[:-MAX_WINDOWS_PER_POLL]
        self.seen.update(skipped)
        out = []
        for w in new[-MAX_WINDOWS_PER_POLL:]:
            self.seen.add(w)
            out.append(self._analyse(listing, w))
        self.finished = len(listing.done) >= self.meta.workers
        return out

    def _analyse(self, listing: tracedir.Listing, first: int) -> Window:
        assert self.meta is not None
        try:
            trace = tracedir.load_windows(self.directory, self.meta, listing, [first])
            report = analyze(trace)
        except (OpTraceError, OSError) as e:
            return Window(first=first, steps=[], report=None, error=str(e))
        if self.heatmap_path is not None:
            with replacing(self.heatmap_path) as tmp:
                heatmap.write_png(report.worker_matrix, tmp,
                                  title=f"steps {report.steps[0]}-{report.steps[-1]}: S = {report.slowdown:.3f}")
        return Window(first=first, steps=report.steps, report=report)

    def alert(self, w: Window) -> str | None:
        """Count `w` into the straggling run; the alert line once the run is long enough."""
        if w.report is None:
            return None  # an unreadable window neither extends nor breaks the run
        if w.report.slowdown <= self.alert_slowdown:
            self.streak = []
            return None
        self.streak.append(w)
        if len(self.streak) < self.alert_windows:
            return None
        first, last = self.streak[0], self.streak[-1]
        cause = last.report.causes[0] if last.report else None
        return (f"ALERT: S > {self.alert_slowdown:g} for {len(self.streak)} consecutive windows (steps "
                f"{first.steps[0]}-{last.steps[-1]}): {cause.kind if cause else '?'}: "
                f"{cause.evidence if cause else ''}")


def follow(watch: Watch, emit: Callable[[Window, str | None], None], poll_s: float = 1.0,
           idle_timeout: float = 600.0, once: bool = False,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> tuple[int, str]:
    """Poll until an alert (exit 1), the job's end or `idle_timeout` seconds without a new window (exit 0).
    `emit(window, alert_line_or_None)` is called per window. Returns (exit code, closing message)."""
    last_new = clock()
    if not once:
        watch.meta_grace_s = max(watch.meta_grace_s, META_GRACE_S)
    quiet_after_end = 0  # scans with nothing new since every recorder closed (two: no shard was missed)
    while True:
        if not watch.directory.exists() and once:
            raise FileNotFoundError(2, "No such directory", str(watch.directory))
        windows = watch.poll(clock()) if watch.directory.exists() else []
        for w in windows:
            line = watch.alert(w)
            emit(w, line)
            if line is not None:
                return EXIT_ALERT, ""
        if windows:
            last_new = clock()
        if once:
            if watch.meta is None:
                raise FileNotFoundError(2, "No such file", str(watch.directory / METADATA))
            return EXIT_OK, f"watch: {len(watch.seen)} window(s), no alert"
        quiet_after_end = quiet_after_end + 1 if watch.finished and not windows else 0
        if quiet_after_end >= 2:
            return EXIT_OK, f"watch: the job's recorders have all closed: {len(watch.seen)} window(s), no alert"
        if clock() - last_new > idle_timeout:
            what = "window" if watch.meta is not None else f"{METADATA} in {watch.directory}"
            return EXIT_OK, f"watch: no new {what} for {idle_timeout:g} s: stopped, {len(watch.seen)} window(s)"
        sleep(poll_s)
