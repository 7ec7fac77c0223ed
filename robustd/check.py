"""What a check is: the small contract between the runner and every check in `checks/`.

A check observes one thing and reports findings; it never decides severity or eviction.
It is polled (`poll`, run by the runner in the check's own worker thread under a deadline),
a watcher (`start` positions its source, `watch` yields batches as the kernel pushes), or both
(e.g. netlink link events pushed, counters polled each second).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import AsyncIterator, Callable, ClassVar, Literal, Mapping, Protocol, Sequence

from pydantic import BaseModel, ConfigDict

from robustd.codes import CodeRule, load_codes
from robustd.durations import Duration, PositiveDuration
from robustd.flags import Flag
from robustd.model import Finding, FindingBatch
from robustd.roots import Roots
from robustd.traffic import TrafficSnapshot, read_traffic


class CheckStatus(StrEnum):
    """How a check's last run went, as ListChecks shows it (the proto's `CHECK_STATUS_<name>`) and the
    `robustd_check_status` metric labels it (the name itself)."""

    NOT_YET_RUN = "NOT_YET_RUN"
    OK = "OK"  # the last poll returned
    ERROR = "ERROR"  # the last poll raised, or the watcher failed (it is retried)
    TIMEOUT = "TIMEOUT"  # a poll is stuck past its deadline
    DISABLED = "DISABLED"  # `checks.<name>.enabled: false`
    UNSUPPORTED = "UNSUPPORTED"  # `Check.supported` gave a reason it cannot run here
    WATCHING = "WATCHING"  # a watcher whose source is open

    @property
    def active(self) -> bool:
        """The check runs here: its code table counts and what it publishes is read."""
        return self not in (CheckStatus.DISABLED, CheckStatus.UNSUPPORTED)

    @property
    def failing(self) -> bool:
        """Its last poll raised or overran, or its watcher failed."""
        return self in (CheckStatus.ERROR, CheckStatus.TIMEOUT)


class CheckConfig(BaseModel):
    """`checks.<name>`: the keys every check has. A check extends it with its own."""

    model_config = ConfigDict(extra="forbid")

    # Keys of this check that name an outside path, kept for the files that write them: each is folded into
    # its `roots:` key at load (robustd/config.py), and the check reads the path from CheckContext.roots.
    root_aliases: ClassVar[Mapping[str, str]] = {}

    enabled: Flag = True
    interval: PositiveDuration = 1.0
    timeout: Duration | None = None  # the poll deadline; default: the interval, at most 10s

    @property
    def deadline(self) -> float:
        return self.timeout if self.timeout else min(self.interval, 10.0)


@dataclass(frozen=True)
class CheckContext:
    """Everything a check may use, passed on every call; no globals."""

    name: str
    node_name: str
    roots: Roots
    config: CheckConfig
    state_dir: str
    cursor: Mapping[str, str] = field(default_factory=dict)  # last committed cursor (watchers)
    clock: Callable[[], float] = time.time
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("robustd.checks"))
    # The NIC check's last traffic snapshot (the daemon wires it; None when that check does not run).
    traffic_source: Callable[[], TrafficSnapshot | None] | None = None

    def traffic(self) -> TrafficSnapshot:
        """Network byte counters (robustd/traffic.py): the NIC check's, or read from sysfs now without one."""
        snap = self.traffic_source() if self.traffic_source is not None else None
        return snap if snap is not None else read_traffic(self.roots.sys)


class Check:
    """Base class for checks. Subclasses set `name`, `mode`, `Config`, and implement one mode."""

    name: ClassVar[str] = ""
    mode: ClassVar[Literal["poll", "watch", "both"]] = "poll"
    Config: ClassVar[type[CheckConfig]] = CheckConfig
    rule_file: ClassVar[str | None] = None  # the check's data file (checks/<name>/rules.yaml): its `codes:` table

    def emulated(self) -> str | None:
        """A label when this check reads emulated hardware (shown in every verdict), else None."""
        return None

    def codes(self) -> Mapping[str, CodeRule]:
        """The meaning of the codes this check owns: the `codes:` table of its rule file, if it has one."""
        return load_codes(self.rule_file) if self.rule_file else {}

    def borrowed_codes(self) -> Mapping[str, CodeRule]:
        """Codes this check raises whose meaning another check owns (the GPU check's Xids from NVML events mean
        what the kernel check's rules say). They sit below every check's own table, so the owner's, an
        operator's extra rule file included, wins while the owner runs, and they still mean something when it
        does not."""
        return {}

    def timeout_findings(self, ctx: CheckContext, stuck_for: float) -> Sequence[Finding] | None:
        """Findings for a poll stuck past its deadline; None means the generic CHECK_TIMEOUT.

        Called from the event loop while the poll thread is still blocked, so it may only read
        what the poll published (e.g. which GPU it was asking when it hung).
        """
        return None

    def stuck_findings(self) -> Sequence[Finding] | None:
        """Findings for a watcher stuck in its source (e.g. an NVML event wait that never returns); None
        while it is not. The runner's heartbeat asks once a beat, from the event loop, so a watcher needs
        no timer of its own for this and may only read what its thread published."""
        return None

    def supported(self, ctx: CheckContext) -> str | None:
        """None if the check can run here, else the reason it cannot (shown in ListChecks)."""
        return None

    def note(self) -> str:
        """What the check says about itself in ListChecks besides errors (e.g. a feature this host lacks)."""
        return ""

    # poll mode
    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        raise NotImplementedError

    # watch mode
    async def start(self, ctx: CheckContext) -> None:
        """Open and position the source. The daemon answers only after every start returned."""

    def watch(self) -> AsyncIterator[FindingBatch]:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what start opened."""


class _Source(Protocol):
    def fileno(self) -> int: ...

    def close(self) -> None: ...


def stop_reading(loop: asyncio.AbstractEventLoop | None, source: _Source) -> None:
    """End a watch: take `source` off the loop's readers (unless the loop is already closed), then close it."""
    if loop is not None and not loop.is_closed():
        loop.remove_reader(source.fileno())
    source.close()
