"""The kernel check: /dev/kmsg matched against rule files, pushed as the kernel logs.

Faults logged while the daemon was down are reported once: the committed cursor
(`{"boot_id", "seq"}`) says where the last run stopped; on a new boot the check looks back
`lookback` into this boot's log instead. Matching keeps no state; this check keeps the ring
buffer of recent lines that multi-line rules need.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pydantic import Field, field_validator

from checks.kernel_rules import SHIPPED_RULES, RuleError, RuleSet, clip_line, load_rules
from checks.kmsg import KmsgReader, KmsgRecord
from robustd.check import Check, CheckConfig, CheckContext
from robustd.codes import CodeRule
from robustd.durations import Duration
from robustd.model import Finding, Report
from robustd.paths import AbsPath
from robustd.roots import DEFAULT_KMSG, read_boot_id

CURSOR_EVERY_S = 1.0  # a cursor-only report (nothing matched) goes out at most this often
_CLOSED = object()


class KernelConfig(CheckConfig):
    """`checks.kernel`."""

    kmsg_path: AbsPath = DEFAULT_KMSG
    lookback: Duration = 300.0  # backlog of this boot scanned when there is no cursor for it
    rules: list[AbsPath] = Field(default_factory=list)  # extra rule files, tried before the shipped one
    buffer_lines: int = Field(default=8, ge=1, le=256)  # ring buffer for multi-line rules

    @field_validator("rules")
    @classmethod
    def _rules_load(cls, paths: list[str]) -> list[str]:
        """A bad extra rule file is a config error (so a reload with one is rejected whole)."""
        if paths:
            try:
                load_rules([SHIPPED_RULES, *paths])
            except RuleError as e:
                raise ValueError("; ".join(e.problems)) from e
        return paths


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
        self._first: Report | None = None

    # --- rules -------------------------------------------------------------------------------
    @staticmethod
    def load_ruleset(cfg: CheckConfig | None = None) -> RuleSet:
        """The shipped rules plus the config's extra files; raises RuleError naming file and line."""
        extra = cfg.rules if isinstance(cfg, KernelConfig) else []
        return load_rules([SHIPPED_RULES, *extra])

    def codes(self, cfg: CheckConfig | None = None) -> Mapping[str, CodeRule]:
        """The merged `codes:` table of the loaded rule files, for the policy."""
        if self._ruleset is None or cfg is not None:
            return self.load_ruleset(cfg).codes
        return self._ruleset.codes

    # --- lifecycle ---------------------------------------------------------------------------
    @staticmethod
    def _config(ctx: CheckContext) -> KernelConfig:
        return ctx.config if isinstance(ctx.config, KernelConfig) else KernelConfig()

    @classmethod
    def kmsg_path(cls, ctx: CheckContext) -> str:
        """The config's path when set, else the roots' (which the daemon builds from it)."""
        cfg = cls._config(ctx)
        return cfg.kmsg_path if cfg.kmsg_path != DEFAULT_KMSG else ctx.roots.kmsg

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
        self._reader = KmsgReader(self.kmsg_path(ctx))
        try:
            backlog = self._reader.read_available() + self._reader.flush()
            saved = self._saved_seq(ctx.cursor)
            if saved is not None:
                self._last_seq = saved
                findings = self._handle(backlog, lambda r: r.seq > saved)
            else:
                since_us = (time.clock_gettime(time.CLOCK_MONOTONIC) - cfg.lookback) * 1e6
                findings = self._handle(backlog, lambda r: r.ts_usec >= since_us)
            self._first = Report(check=self.name, findings=tuple(findings), cursor=self._cursor())
            self._loop.add_reader(self._reader.fileno(), self._on_readable)
        except BaseException:
            self._reader.close()
            self._reader = None
            raise

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
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._reader.fileno())
            self._reader.close()
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
                self._ring.append(clip_line(line))  # what every rule matches, and what evidence keeps
                if not wanted:
                    continue
                at = wall - max(0.0, mono - rec.ts_usec / 1e6)
                for f in self._ruleset.match(self._ring):
                    out.append(replace(f, at=at, evidence={**f.evidence, "seq": str(rec.seq)}))
            self._last_seq = max(self._last_seq, rec.seq)
        return out

    def _on_readable(self) -> None:
        """Event-loop callback: drain what the kernel pushed and hand it to `reports`."""
        if self._reader is None:
            return
        try:
            records = self._reader.read_available()
            if records:
                self._queue.put_nowait(self._handle(records))
        except Exception as e:  # raised from reports(), where the runner turns it into a finding
            self._queue.put_nowait(e)
            if self._loop is not None:
                self._loop.remove_reader(self._reader.fileno())

    def reports(self) -> AsyncIterator[Report]:
        if self._first is None:
            raise RuntimeError("KernelCheck.reports() called before start()")
        return self._iterate(self._first)

    async def _iterate(self, first: Report) -> AsyncIterator[Report]:
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
                yield Report(check=self.name, findings=tuple(item), cursor=self._cursor())
                last_emit, emitted = now, self._last_seq
