"""The kernel check: /dev/kmsg matched against rule files, pushed as the kernel logs.

Faults logged while the daemon was down are reported once: the committed cursor
(`{"boot_id", "seq"}`) says where the last run stopped; on a new boot the check looks back
`lookback` into this boot's log instead. Matching keeps no state; this check keeps the ring
buffer of recent lines that multi-line rules need.

Records the kernel overwrote before the check read them (the reader fell behind, /dev/kmsg
said EPIPE) are not lost silently: each batch that had any becomes one `KMSG_OVERRUN` finding on
`check/kernel` saying how many, the first of a burst is logged, and `overruns` / `records_lost`
keep running totals for metrics.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from checks.kernel.config import KernelConfig
from checks.kernel.kmsg import KmsgReader, Overrun
from checks.kernel.parse import KmsgRecord
from checks.kernel.rules import SHIPPED_RULE_FILES, RuleSet, load_rules, shipped_rules
from robustd.check import Check, CheckConfig, CheckContext, stop_reading
from robustd.codes import CodeRule
from robustd.model import Finding, FindingBatch
from robustd.roots import read_boot_id

CURSOR_EVERY_S = 1.0  # a cursor-only batch (nothing matched) goes out at most this often
READ_BATCH = 256  # records read per wake-up; the loop runs other work between batches
OVERRUN_BURST_S = 10.0  # overruns closer than this are one burst: one log line for all of them
OVERRUN_LOG_EVERY_S = 60.0  # a burst that goes on is logged again this often
OVERRUN_CODE = "KMSG_OVERRUN"
_CLOSED = object()


class KernelCheck(Check):
    """Watches the kernel log; each matching line becomes a Finding."""

    name = "kernel"
    mode = "watch"
    Config = KernelConfig

    def __init__(self) -> None:
        self._ruleset: RuleSet | None = None
        self._reader: KmsgReader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ring: deque[str] = deque(maxlen=8)
        self._ctx: CheckContext | None = None
        self._boot_id = ""
        self._last_seq = -1
        self._first: FindingBatch | None = None
        # Running totals since this check object was made (metrics export them as counters).
        self.overruns: int = 0
        self.records_lost: int = 0
        self._reader_counts = (0, 0)  # the reader's (overruns, records_lost) already added above
        self._last_overrun = -OVERRUN_BURST_S  # time.monotonic() of the last overrun
        self._last_overrun_log = -OVERRUN_LOG_EVERY_S

    # --- rules -------------------------------------------------------------------------------
    @staticmethod
    def load_ruleset(cfg: CheckConfig | None = None) -> RuleSet:
        """The shipped rules plus the config's extra files; raises RuleError naming file and line."""
        extra = cfg.rules if isinstance(cfg, KernelConfig) else []
        return load_rules([*SHIPPED_RULE_FILES, *extra]) if extra else shipped_rules()

    def codes(self, cfg: CheckConfig | None = None) -> Mapping[str, CodeRule]:
        """The merged `codes:` table of the loaded rule files, for the policy."""
        if self._ruleset is None or cfg is not None:
            return self.load_ruleset(cfg).codes
        return self._ruleset.codes

    # --- lifecycle ---------------------------------------------------------------------------
    @staticmethod
    def _config(ctx: CheckContext) -> KernelConfig:
        return ctx.config if isinstance(ctx.config, KernelConfig) else KernelConfig()

    @staticmethod
    def kmsg_path(ctx: CheckContext) -> str:
        """roots.kmsg (checks.kernel.kmsg_path is folded into it when the config is loaded)."""
        return ctx.roots.kmsg

    def supported(self, ctx: CheckContext) -> str | None:
        path = self.kmsg_path(ctx)
        if not os.path.exists(path):
            return f"{path} does not exist"
        if not os.access(path, os.R_OK):
            return f"{path} is not readable (needs root or CAP_SYSLOG)"
        return None

    async def start(self, ctx: CheckContext) -> None:
        cfg = self._config(ctx)
        self._ctx = ctx
        self._ruleset = self.load_ruleset(cfg)
        self._ring = deque(maxlen=max(cfg.buffer_lines, self._ruleset.max_lines))
        self._boot_id = read_boot_id(ctx.roots.boot_id)
        self._last_seq, self._first = -1, None
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._reader = self._open_reader(self.kmsg_path(ctx))
        self._reader_counts = (0, 0)
        try:
            backlog = self._reader.read_available() + self._reader.flush()
            saved = self._saved_seq(ctx.cursor)
            if saved is not None:
                self._last_seq = saved
                findings = self._handle(backlog, lambda r: r.seq > saved)
            else:
                since_us = (time.clock_gettime(time.CLOCK_MONOTONIC) - cfg.lookback) * 1e6
                findings = self._handle(backlog, lambda r: r.ts_usec >= since_us)
            findings += self._overrun_findings()
            self._first = FindingBatch(check=self.name, findings=tuple(findings), cursor=self._cursor())
            self._loop.add_reader(self._reader.fileno(), self._on_readable)
        except BaseException:
            self._reader.close()
            self._reader = None
            raise

    @staticmethod
    def _open_reader(path: str) -> KmsgReader:
        """The reader of `path` (a seam: tests hand in one that scripts EPIPE)."""
        return KmsgReader(path)

    def _saved_seq(self, cursor: Mapping[str, str]) -> int | None:
        """The saved seq if the cursor is from this boot, else None (scan by lookback)."""
        if not cursor or cursor.get("boot_id") != self._boot_id:
            return None
        try:
            return int(cursor.get("seq", ""))
        except ValueError:
            return None

    def _cursor(self) -> dict[str, str]:
        return {"boot_id": self._boot_id, "seq": str(self._last_seq)}

    async def close(self) -> None:
        if self._reader is not None:
            stop_reading(self._loop, self._reader)
            self._reader = None
        self._queue.put_nowait(_CLOSED)

    # --- matching ----------------------------------------------------------------------------
    def _handle(self, records: Sequence[KmsgRecord],
                report: Callable[[KmsgRecord], bool] | None = None) -> list[Finding]:
        """Feed records through the ring buffer; match the lines of those `report(rec)` accepts.

        Skipped records still enter the ring, so a multi-line fault that straddles the resume
        point is seen whole.
        """
        assert self._ruleset is not None and self._ctx is not None
        out: list[Finding] = []
        wall, mono = self._ctx.clock(), time.clock_gettime(time.CLOCK_MONOTONIC)
        for rec in records:
            wanted = report is None or report(rec)
            for line in rec.lines():
                self._ring.append(line)  # the matcher clips what it matches, and evidence keeps that
                if not wanted:
                    continue
                at = wall - max(0.0, mono - rec.ts_usec / 1e6)
                for f in self._ruleset.match(self._ring):
                    out.append(replace(f, at=at, evidence={**f.evidence, "seq": str(rec.seq)}))
            self._last_seq = max(self._last_seq, rec.seq)
        return out

    def _overrun_findings(self) -> list[Finding]:
        """One KMSG_OVERRUN finding for the overruns the reader noticed since the last call.

        The reader's counters, not its list of gaps (which is bounded), feed the totals, so they
        stay exact however many gaps one batch had. The first overrun of a burst is logged.
        """
        assert self._ctx is not None
        if self._reader is None:
            return []
        gaps = self._reader.take_overruns()
        counts = (self._reader.overruns, self._reader.records_lost)
        n, lost = counts[0] - self._reader_counts[0], counts[1] - self._reader_counts[1]
        self._reader_counts = counts
        if n <= 0:
            return []
        self.overruns += n
        self.records_lost += lost
        unknown = any(g.lost is None for g in gaps)
        how_many = (f"at least {lost}" if lost else "an unknown number of") if unknown else str(lost)
        span = self._span(gaps)
        message = (f"the kernel log reader fell behind: {how_many} records were overwritten before robustd "
                   f"read them{span} in {n} overrun{'s' if n != 1 else ''}; {self.records_lost} records lost "
                   f"in {self.overruns} overrun{'s' if self.overruns != 1 else ''} since the check started")
        now = time.monotonic()
        if now - self._last_overrun >= OVERRUN_BURST_S or now - self._last_overrun_log >= OVERRUN_LOG_EVERY_S:
            self._ctx.log.warning("kernel: %s (rate-limited: one line per burst)", message)
            self._last_overrun_log = now
        self._last_overrun = now
        evidence = {"records_lost": str(lost), "overruns": str(n),
                    "records_lost_total": str(self.records_lost), "overruns_total": str(self.overruns)}
        if unknown:
            evidence["records_lost_unknown"] = "true"  # a gap before the first record this reader read
        if gaps:
            evidence["last_seq_before"] = str(gaps[0].after_seq)
            evidence["first_seq_after"] = str(gaps[-1].next_seq)
        return [Finding(component=f"check/{self.name}", code=OVERRUN_CODE, message=message, evidence=evidence,
                        at=self._ctx.clock())]

    @staticmethod
    def _span(gaps: Sequence[Overrun]) -> str:
        """` (seq a..b)`: the sequence numbers that were lost, when the reader knows them."""
        known = [g for g in gaps if g.after_seq >= 0 and g.next_seq > g.after_seq + 1]
        if not known:
            return ""
        return f" (seq {known[0].after_seq + 1}..{known[-1].next_seq - 1})"

    def _on_readable(self) -> None:
        """Event-loop callback: drain what the kernel pushed and hand it to `reports`."""
        if self._reader is None:
            return
        try:
            records = self._reader.read_available(READ_BATCH)
            findings = self._handle(records) if records else []
            findings += self._overrun_findings()
            if records or findings:
                self._queue.put_nowait(findings)
        except Exception as e:  # raised from watch(), where the runner turns it into a finding
            self._queue.put_nowait(e)
            if self._loop is not None:
                self._loop.remove_reader(self._reader.fileno())

    def watch(self) -> AsyncIterator[FindingBatch]:
        if self._first is None:
            raise RuntimeError("KernelCheck.watch() called before start()")
        return self._iterate(self._first)

    async def _iterate(self, first: FindingBatch) -> AsyncIterator[FindingBatch]:
        yield first
        last_emit, emitted = time.monotonic(), self._last_seq
        while True:
            behind = self._last_seq != emitted  # the cursor moved but was not handed out yet
            holding = self._reader is not None and self._reader.holding
            try:
                item = await asyncio.wait_for(self._queue.get(), CURSOR_EVERY_S if behind or holding else None)
            except TimeoutError:
                item = self._handle(self._reader.flush()) if self._reader is not None else []
            if item is _CLOSED:
                return
            if isinstance(item, BaseException):
                raise item
            now = time.monotonic()
            if item or (self._last_seq != emitted and now - last_emit >= CURSOR_EVERY_S):
                yield FindingBatch(check=self.name, findings=tuple(item), cursor=self._cursor())
                last_emit, emitted = now, self._last_seq
