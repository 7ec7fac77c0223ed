"""What a check is: the small contract between the runner and every module in `checks/`.

A check observes one thing and reports findings; it never decides severity or eviction.
It is polled (`poll`, run by the runner in the check's own worker thread under a deadline),
a watcher (`start` positions its source, `reports` yields as the kernel pushes), or both
(e.g. netlink link events pushed, counters polled each second).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, ClassVar, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from robustd.codes import CodeRule
from robustd.durations import Duration, PositiveDuration
from robustd.model import Finding, Report
from robustd.roots import Roots


class CheckConfig(BaseModel):
    """`checks.<name>`: the keys every check has. A check extends it with its own."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
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


class Check:
    """Base class for checks. Subclasses set `name`, `mode`, `Config`, and implement one mode."""

    name: ClassVar[str] = ""
    mode: ClassVar[Literal["poll", "watch", "both"]] = "poll"
    Config: ClassVar[type[CheckConfig]] = CheckConfig

    def emulated(self) -> str | None:
        """A label when this check reads emulated hardware (shown in every verdict), else None."""
        return None

    def codes(self) -> Mapping[str, CodeRule]:
        """The meaning of the codes this check reports (usually `load_codes` of its rules/*.yaml)."""
        return {}

    def timeout_findings(self, ctx: CheckContext, stuck_for: float) -> Sequence[Finding] | None:
        """Findings for a poll stuck past its deadline; None means the generic CHECK_TIMEOUT.

        Called from the event loop while the poll thread is still blocked, so it may only read
        what the poll published (e.g. which GPU it was asking when it hung).
        """
        return None

    def supported(self, ctx: CheckContext) -> str | None:
        """None if the check can run here, else the reason it cannot (shown in ListChecks)."""
        return None

    # poll mode
    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        raise NotImplementedError

    # watch mode
    async def start(self, ctx: CheckContext) -> None:
        """Open and position the source. The daemon answers only after every start returned."""

    def reports(self) -> AsyncIterator[Report]:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what start opened."""
