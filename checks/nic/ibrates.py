"""InfiniBand error counters as rates over an hour: the grey link that still runs at full rate but will flap.

IB_ERRORS_RISING (checks/nic/ib.py) sees a burst within seconds; a link that takes a few hundred symbol
errors an hour never trips it, yet that is the port that drops tomorrow. Peers judge these counters per
hour against public limits (checks/nic/rules.yaml `thresholds.ib_per_hour` cites each one); this module keeps
each counter's history for `checks.nic.ib_window` (default 1h) and turns it into a rate per hour.

What the counters do that a plain rate would get wrong:
- They saturate rather than wrap (IBA PortCounters: symbol_error and port_rcv_errors are 16-bit,
  link_error_recovery and link_downed 8-bit, local_link_integrity and excessive_buffer_overrun 4-bit; some
  drivers give 32-bit values). A counter at its maximum cannot rise, so its rate reads 0 while the link may
  be worse than ever: the rate is then "unknown", and a raised condition is held, not cleared.
- They go down when someone clears them (`perfquery -R`) or the driver reloads: the window starts again
  from that reading, never a negative rate.
- A node that just started has no hour of history. A breach is still certain once the errors seen so far
  exceed the hour's allowance (the hour holds at least those), so that raises at once; anything less waits
  until the window is full, and ListChecks' note says how much history there is.

Memory is bounded: about one sample a minute for the hour, at most `SLOTS` + 3 a counter (the window's base and
the latest reading included).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from robustd.durations import format_duration
from robustd.model import Finding, FindingKind

SLOTS = 60  # samples kept across one window: one a minute for an hour
HOUR = 3600.0

# counter → (code, what its increases are, IBA PortCounters width in bits)
HOURLY: dict[str, tuple[str, str, int]] = {
    "symbol_error": ("IB_SYMBOL_ERRORS_HIGH", "symbol errors", 16),
    "link_error_recovery": ("IB_LINK_RECOVERIES_HIGH", "link error recoveries", 8),
    "link_downed": ("IB_LINK_DOWNED_HIGH", "link-downed events", 8),
    "port_rcv_errors": ("IB_RCV_ERRORS_HIGH", "receive errors", 16),
    "local_link_integrity_errors": ("IB_LINK_INTEGRITY_ERRORS_HIGH", "local link integrity errors", 4),
    "excessive_buffer_overrun_errors": ("IB_BUFFER_OVERRUNS_HIGH", "buffer overruns", 4),
}
U32_MAX = 2**32 - 1  # a driver that reports the counter 32 bits wide saturates here


def saturated(name: str, value: int) -> bool:
    """True when `value` is the counter's saturation point (its IBA width, or 32 bits)."""
    bits = HOURLY[name][2]
    return value == 2**bits - 1 or value >= U32_MAX


def span_text(seconds: float) -> str:
    """A history length for people: whole seconds under two minutes, whole minutes above."""
    return format_duration(max(0, round(seconds))) if seconds < 120 else format_duration(round(seconds / 60) * 60)


def rate_text(per_hour: float) -> str:
    """A rate per hour for people: whole numbers from 10 up (never 4.8e+04), three digits below."""
    return f"{per_hour:.0f}" if per_hour >= 10 else f"{per_hour:.3g}"


@dataclass
class CounterHistory:
    """One counter's readings across `window` seconds: samples at least window/SLOTS apart, the newest always."""

    name: str
    window: float
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    since: float = 0.0  # when this run of history began: the first reading, or the last reset
    resets: int = 0  # times the counter went down (cleared, driver reload)
    raised: bool = False  # over the threshold at the last judgement that knew

    def add(self, t: float, value: int) -> None:
        if self.samples and value < self.samples[-1][1]:  # cleared or reloaded: the window starts again
            self.samples.clear()
            self.resets += 1
        if not self.samples:
            self.since = t
        if len(self.samples) >= 2 and t - self.samples[-2][0] < self.window / SLOTS:
            self.samples[-1] = (t, value)  # too close to the one before: the newest reading replaces it
        else:
            self.samples.append((t, value))
        while len(self.samples) >= 2 and self.samples[1][0] <= t - self.window:
            self.samples.popleft()  # samples[0] stays the newest one at least a window old


@dataclass(frozen=True)
class Judgement:
    """One counter's history against its threshold (per hour). `over` None: not known (yet)."""

    over: bool | None
    rate: float  # per hour: over the window once it is full; before, the lower bound the errors seen so far give
    increase: int  # within the window (or the history so far)
    value: int  # the latest reading
    full: bool  # a whole window of history
    history: float  # seconds of history behind the rate
    saturated: bool


def judge(h: CounterHistory, threshold: float, now: float) -> Judgement:
    """The hourly rate of `h` against `threshold` (per hour), its window full or not (call after `add`)."""
    (t0, v0), (t1, v1) = h.samples[0], h.samples[-1]
    increase = v1 - v0
    full = t0 <= now - h.window
    if full and t1 > t0:
        rate = increase / (t1 - t0) * HOUR
        over: bool | None = rate > threshold
    else:  # the hour holds at least what was seen so far: over its allowance already is certain
        rate = increase / h.window * HOUR
        over = True if increase > threshold * h.window / HOUR else None
    sat = saturated(h.name, v1)
    if sat and not over:
        over = None  # a counter that cannot rise says nothing about the link now
    return Judgement(over, rate, increase, v1, full, (t1 - t0) if full else now - h.since, sat)


class HourlyRates:
    """The hourly error-counter histories of one IB port, and the findings they give each poll."""

    def __init__(self, key: str, thresholds: dict[str, float | None], window: float):
        self.key = key
        self.thresholds = thresholds
        self.window = window
        self.counters: dict[str, CounterHistory] = {}

    def clear(self) -> None:
        self.counters.clear()

    def poll(self, counters: dict[str, int], now: float) -> list[Finding]:
        """STATE findings for each counter over its threshold; a counter whose rate is not known now (saturated,
        or its window restarted) holds what it last said. A counter file that is missing is skipped."""
        out: list[Finding] = []
        for name, (code, what, _) in HOURLY.items():
            threshold = self.thresholds.get(name)
            value = counters.get(name)
            if threshold is None or value is None:
                self.counters.pop(name, None)
                continue
            h = self.counters.get(name)
            if h is None:
                h = self.counters[name] = CounterHistory(name, self.window)
            h.add(now, value)
            j = judge(h, threshold, now)
            if j.over is not None:
                h.raised = j.over
            if h.raised:
                out.append(self._finding(code, what, name, threshold, h, j))
        return out

    def _finding(self, code: str, what: str, name: str, threshold: float, h: CounterHistory,
                 j: Judgement) -> Finding:
        window = format_duration(self.window)
        ev = {"counter": name, "value": str(j.value), "increase": str(j.increase),
              "rate_per_hour": rate_text(j.rate), "threshold_per_hour": f"{threshold:g}", "window": window,
              "history": span_text(j.history)}
        if j.saturated:
            ev["saturated"] = "true"
        if h.resets:
            ev["resets"] = str(h.resets)
        head = f"IB port {self.key}: {what} "
        if j.over and j.full:
            msg = f"{j.increase} in the last {window}, {rate_text(j.rate)}/h (threshold {threshold:g}/h)"
        elif j.over:
            msg = (f"{j.increase} in the first {span_text(j.history)} of history, at least {rate_text(j.rate)}/h over "
                   f"{window} (threshold {threshold:g}/h)")
        elif j.saturated:
            msg = (f"counter {name} saturated at {j.value}: rate unknown, held until the counters are cleared and "
                   f"a full {window} shows it below {threshold:g}/h")
        else:
            msg = (f"counter {name} went down (cleared or driver reload) {span_text(j.history)} ago: held until "
                   f"a full {window} shows it below {threshold:g}/h")
        return Finding(f"ib/{self.key}", code, head + msg, ev, FindingKind.STATE)

    def status(self, now: float) -> tuple[float | None, list[str]]:
        """The shortest history of any judged counter that lacks a full window (None: all full), and the
        counters saturated without a raised condition (their rate cannot be known)."""
        short: float | None = None
        stuck: list[str] = []
        for name, h in self.counters.items():
            if not h.samples:
                continue
            if h.samples[0][0] > now - self.window:
                have = now - h.since
                short = have if short is None else min(short, have)
            if saturated(name, h.samples[-1][1]) and not h.raised:
                stuck.append(f"{self.key} {name}={h.samples[-1][1]}")
        return short, stuck
