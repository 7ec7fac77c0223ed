"""Prometheus view of the daemon's state, read at scrape time (never a second copy of it).

Names follow Prometheus conventions: one `robustd_` prefix, counters end in `_total`, times are in
seconds (`_seconds`), timestamps in Unix seconds, enumerations are one series per state with value
0 or 1. The README's "Metrics" table lists each family; `tests/test_metrics.py` checks that this
module exports exactly those names and `tests/test_prometheus.py` that the alert rules and the
Grafana dashboard (deploy/) ask only for what is exported.

**Bounded cardinality.** Every family has a fixed set of series (severities, actions, check names
from the config, diagnostic outcomes) except `robustd_condition`, one series per standing condition.
The policy already bounds the conditions (`policy.max_conditions` and its fold-overs, at most 1,065
with the defaults: robustd/policy.py), and `metrics.max_condition_series` bounds what a scrape
carries on top of that, because every series is multiplied by the fleet in Prometheus. The most
severe conditions win the places (then fold-overs, then the oldest); the ones left out are counted
in `robustd_condition_series_dropped_total` and still counted in `robustd_conditions` (by severity
and action), so the node's alerts never depend on which conditions got a series.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from robustd import __version__
from robustd.check import CheckStatus
from robustd.engine import EngineView
from robustd.metrics_http import is_loopback, serve, split_address
from robustd.model import Action, Condition, Severity, worst
from robustd.policy import is_fold_component
from robustd.runner import CheckState

__all__ = ["DaemonProbe", "StateCollector", "is_loopback", "ranked", "serve", "split_address"]

# 0 OK, 1 WARNING, 2 CRITICAL: the same numbers robustctl exits with.
LEVEL = {Severity.OK: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}
# Series that always exist (at 0 when nothing is counted), so that `for:` and increase() see a start.
CONDITION_SEVERITIES = (Severity.WARNING, Severity.CRITICAL)
DIAGNOSTIC_OUTCOMES = ("PASS", "FAIL", "ERROR", "CANCELLED")


@dataclass(frozen=True)
class DaemonProbe:
    """What the daemon itself knows beyond the engine and the checks, read at scrape time.

    Times are `time.monotonic()` values (None: not yet, or not applicable); the collector turns them
    into ages, so a node's clock never skews an alert.
    """

    watchdog_interval: Callable[[], float | None]  # how often WATCHDOG=1 is due; None: systemd set no watchdog
    last_watchdog: Callable[[], float | None]  # when WATCHDOG=1 was last sent
    last_tick: Callable[[], float | None]  # when the check scheduler last ran (the watchdog waits on it)
    diagnostic_outcomes: Callable[[], Mapping[str, int]]  # finished stop-time runs since start, by outcome
    diagnostic_running: Callable[[], bool]


@dataclass(eq=False)
class StateCollector(Collector):
    """Builds every family from the live state at each scrape (on the HTTP server's thread)."""

    engine: EngineView
    node: str
    checks: Callable[[], Sequence[CheckState]]
    max_condition_series: int = 1000
    probe: DaemonProbe | None = None
    clock: Callable[[], float] = time.monotonic
    started: float = field(default_factory=time.time, init=False)
    dropped: int = field(default=0, init=False)  # condition series left out of scrapes, summed over scrapes
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)  # scrapes may run at once

    def collect(self) -> Iterator[Metric]:
        conds = self.engine.conditions()
        yield from self._node(conds)
        yield from self._conditions(conds)
        yield from self._event_log()
        yield from self._checks()
        if self.probe is not None:
            yield from self._daemon(self.probe)

    # -- the verdict ---------------------------------------------------------------------------
    def _node(self, conds: list[Condition]) -> Iterator[Metric]:
        info = GaugeMetricFamily("robustd_build_info", "Always 1; the robustd version running", labels=["version"])
        info.add_metric([__version__], 1)
        start = GaugeMetricFamily("robustd_start_time_seconds", "When this robustd process started (Unix time)")
        start.add_metric([], self.started)
        node = GaugeMetricFamily("robustd_node_severity", "Node verdict: 0 OK, 1 WARNING, 2 CRITICAL", labels=["node"])
        node.add_metric([self.node], LEVEL[worst(conds)[0]])
        yield from (info, start, node)

    def _conditions(self, conds: list[Condition]) -> Iterator[Metric]:
        counts = {(s, a): 0 for s in CONDITION_SEVERITIES for a in Action}
        folded = 0
        for c in conds:
            counts[(c.severity, c.action)] = counts.get((c.severity, c.action), 0) + 1
            if is_fold_component(c.component):
                folded += _folded(c)
        total = GaugeMetricFamily("robustd_conditions", "Standing conditions by severity and action (every one, "
                                  "whether or not it has a robustd_condition series)", labels=["severity", "action"])
        for (severity, action), n in counts.items():
            total.add_metric([severity.name, action.name], n)
        yield total
        shown = ranked(conds)[:self.max_condition_series]
        with self._lock:
            self.dropped += len(conds) - len(shown)
            dropped = self.dropped
        cond = GaugeMetricFamily("robustd_condition", "One standing condition (at most metrics.max_condition_series, "
                                 "most severe first); value: 1 WARNING, 2 CRITICAL",
                                 labels=["component", "code", "action", "sticky"])
        for c in shown:
            cond.add_metric([c.component, c.code, c.action.name, str(c.sticky).lower()], LEVEL[c.severity])
        yield cond
        drop = CounterMetricFamily("robustd_condition_series_dropped", "Condition series left out of scrapes by "
                                   "metrics.max_condition_series, summed over scrapes")
        drop.add_metric([], dropped)
        limit = GaugeMetricFamily("robustd_condition_series_max", "metrics.max_condition_series: the most "
                                  "robustd_condition series one scrape carries")
        limit.add_metric([], self.max_condition_series)
        fold = GaugeMetricFamily("robustd_conditions_folded", "Components folded into fold-over conditions "
                                 "(<family>/* and */CONDITIONS_OVERFLOW) by policy.max_conditions_per_code "
                                 "and policy.max_conditions")
        fold.add_metric([], folded)
        yield from (drop, limit, fold)

    # -- the event log -------------------------------------------------------------------------
    def _event_log(self) -> Iterator[Metric]:
        events = CounterMetricFamily("robustd_events", "Events committed to the event log since start")
        events.add_metric([], self.engine.events_total)
        writable = GaugeMetricFamily("robustd_event_log_writable", "1 while the event log takes writes, 0 while "
                                     "it is full, read-only or not responding (changes then wait in memory)")
        writable.add_metric([], 0 if self.engine.store_error else 1)
        held = GaugeMetricFamily("robustd_events_held", "Decided changes not yet written to the event log")
        held.add_metric([], self.engine.events_held)
        yield from (events, writable, held)

    # -- the checks ----------------------------------------------------------------------------
    def _checks(self) -> Iterator[Metric]:
        dur = GaugeMetricFamily("robustd_check_duration_seconds", "Duration of each check's last poll",
                                labels=["check"])
        runs = CounterMetricFamily("robustd_check_runs", "Polls or watcher batches completed", labels=["check"])
        fails = CounterMetricFamily("robustd_check_failures", "Check errors and timeouts", labels=["check"])
        status = GaugeMetricFamily("robustd_check_status", "1 for each check's current status, 0 for the others",
                                   labels=["check", "status"])
        overruns = CounterMetricFamily("robustd_kmsg_overruns", "Times the kernel log ring overran the kernel "
                                       "check's reader (records were lost)")
        lost = CounterMetricFamily("robustd_kmsg_records_lost", "Kernel log records lost to ring overruns")
        kernel_seen = False
        for st in self.checks():
            if st.last_duration is not None:
                dur.add_metric([st.name], st.last_duration)
            runs.add_metric([st.name], st.runs)
            fails.add_metric([st.name], st.failures)
            for s in CheckStatus:  # the label is the status's name
                status.add_metric([st.name, s.value], 1 if st.status is s else 0)
            if st.name == "kernel":
                kernel_seen = True
                overruns.add_metric([], getattr(st.check, "overruns", 0))
                lost.add_metric([], getattr(st.check, "records_lost", 0))
        if not kernel_seen:  # the families exist whatever is enabled, so alerts on them evaluate
            overruns.add_metric([], 0)
            lost.add_metric([], 0)
        yield from (dur, runs, fails, status, overruns, lost)

    # -- the daemon ----------------------------------------------------------------------------
    def _daemon(self, probe: DaemonProbe) -> Iterator[Metric]:
        now = self.clock()
        interval = probe.watchdog_interval()
        dog = GaugeMetricFamily("robustd_watchdog_interval_seconds", "How often robustd sends WATCHDOG=1 to "
                                "systemd (half of WatchdogSec); 0 when systemd set no watchdog")
        dog.add_metric([], interval or 0.0)
        yield dog
        last = probe.last_watchdog()
        if interval:
            age = GaugeMetricFamily("robustd_watchdog_notification_age_seconds", "Seconds since robustd last "
                                    "sent WATCHDOG=1 (since start, before the first); systemd kills it at twice "
                                    "robustd_watchdog_interval_seconds")
            age.add_metric([], max(0.0, now - last) if last is not None else time.time() - self.started)
            yield age
        tick = probe.last_tick()
        loop = GaugeMetricFamily("robustd_runner_tick_age_seconds", "Seconds since the check scheduler last ran; "
                                 "the watchdog is fed only while this stays small")
        loop.add_metric([], max(0.0, now - tick) if tick is not None else 0.0)
        yield loop
        outcomes = probe.diagnostic_outcomes()
        runs = CounterMetricFamily("robustd_diagnostic_runs", "Stop-time diagnostic runs finished since start, "
                                   "by outcome (ERROR: the diagnostic itself could not run properly)",
                                   labels=["outcome"])
        for name in (*DIAGNOSTIC_OUTCOMES, *sorted(set(outcomes) - set(DIAGNOSTIC_OUTCOMES))):
            runs.add_metric([name], outcomes.get(name, 0))
        running = GaugeMetricFamily("robustd_diagnostic_running", "1 while a stop-time diagnostic runs")
        running.add_metric([], 1 if probe.diagnostic_running() else 0)
        yield from (runs, running)


def ranked(conds: list[Condition]) -> list[Condition]:
    """Conditions in the order they win a series: most severe, then fold-overs (they stand for many), then
    the oldest, then by name: a stable order, so that scrapes do not swap series that merely tie."""
    return sorted(conds, key=lambda c: (-c.severity, not is_fold_component(c.component), c.first_seen,
                                        c.component, c.code))


def _folded(c: Condition) -> int:
    n = c.evidence.get("folded", "")
    return int(n) if n.isdigit() else 0
