"""Kernel counters read poll by poll: increases, increases within a window, and rates.

One way for every check that watches a monotonic counter (host EDAC and SCSI I/O errors, PCIe AER,
NIC and InfiniBand port counters): the first reading is a baseline (nothing is "new" at start), and a
counter that went backwards was reset (driver reload) and counts again from zero, never as a huge
or negative increase.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Hashable, NamedTuple, TypeVar

from robustd.model import Finding, FindingKind

K = TypeVar("K", bound=Hashable)


def counter_delta(old: int, new: int) -> int:
    """The increase of a monotonic counter; a decrease means it was reset and counts from zero."""
    return new - old if new >= old else new


@dataclass
class Counter:
    """A kernel counter seen poll by poll: its increases, and their sum over a recent window."""

    value: int
    history: deque[tuple[float, int]] = field(default_factory=deque)

    def update(self, new: int, now: float) -> int:
        delta = counter_delta(self.value, new)
        self.value = new
        if delta:
            self.history.append((now, delta))
        return delta

    def increase_within(self, window: float, now: float) -> int:
        while self.history and now - self.history[0][0] > window:
            self.history.popleft()
        return sum(d for _, d in self.history)


def rising(counter: Counter, window: float, threshold: int, now: float, component: str, code: str, subject: str,
           errors: str, evidence: dict[str, str]) -> Finding | None:
    """A STATE finding when `counter` rose by `threshold` or more within `window` seconds, else None.

    The message reads `<subject>: <n> <errors> in the last <window>s (threshold <threshold>)`; the evidence
    gets `recent` (n) and `window` added to what the caller gives.
    """
    recent = counter.increase_within(window, now)
    if recent < threshold:
        return None
    return Finding(component=component, code=code, kind=FindingKind.STATE,
                   message=f"{subject}: {recent} {errors} in the last {window:g}s (threshold {threshold})",
                   evidence={**evidence, "recent": str(recent), "window": f"{window:g}s"})


class Reading(NamedTuple):
    counter: Counter
    old: int  # the value at the previous poll
    delta: int  # the increase since then


class Counters(Generic[K]):
    """Counters by key (a device, a memory controller and kind, ...), each baselined at its first reading."""

    def __init__(self) -> None:
        self._by_key: dict[K, Counter] = {}

    def update(self, key: K, value: int, now: float, *, baseline: bool = False) -> Reading | None:
        """The reading's increase, or None for a first reading (or when `baseline` asks to start again)."""
        counter = self._by_key.get(key)
        if counter is None or baseline:
            self._by_key[key] = Counter(value)
            return None
        old = counter.value
        return Reading(counter, old, counter.update(value, now))


@dataclass
class RateWindow:
    """Samples of one counter over `window` seconds; `add` returns the increase since the last sample."""

    window: float
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, t: float, value: int) -> int | None:
        """The increase since the last sample; None for the first sample or after a reset."""
        last = self.samples[-1][1] if self.samples else None
        if last is not None and value < last:  # reset (driver reload): start a new baseline
            self.samples.clear()
            last = None
        self.samples.append((t, value))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.window:
            self.samples.popleft()
        return None if last is None else value - last

    def rate(self) -> float | None:
        """Increase per second across the window; None until two samples exist."""
        if len(self.samples) < 2:
            return None
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None
