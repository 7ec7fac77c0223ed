"""Prometheus view of the daemon's state, read at scrape time (never a second copy of it)."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from robustd.engine import Engine
from robustd.model import Severity, worst
from robustd.runner import CheckState

# 0 OK, 1 WARNING, 2 CRITICAL: the same numbers robustctl exits with.
LEVEL = {Severity.OK: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


class StateCollector(Collector):
    def __init__(self, engine: Engine, node: str, checks: Callable[[], Sequence[CheckState]]):
        self.engine = engine
        self.node = node
        self.checks = checks

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        conds = list(self.engine.policy.conditions.values())
        node = GaugeMetricFamily("robustd_node_severity", "Node verdict: 0 OK, 1 WARNING, 2 CRITICAL", labels=["node"])
        node.add_metric([self.node], LEVEL[worst(conds)[0]])
        yield node
        cond = GaugeMetricFamily("robustd_condition", "Standing conditions: value is the severity (1 WARNING, "
                                 "2 CRITICAL)", labels=["component", "code", "action", "sticky"])
        for c in conds:
            cond.add_metric([c.component, c.code, c.action.name, str(c.sticky).lower()], LEVEL[c.severity])
        yield cond
        events = CounterMetricFamily("robustd_events", "Events committed since start")
        events.add_metric([], self.engine.events_total)
        yield events
        dur = GaugeMetricFamily("robustd_check_duration_seconds", "Duration of each check's last poll",
                                labels=["check"])
        runs = CounterMetricFamily("robustd_check_runs", "Polls or watcher batches completed", labels=["check"])
        fails = CounterMetricFamily("robustd_check_failures", "Check errors and timeouts", labels=["check"])
        for st in self.checks():
            if st.last_duration is not None:
                dur.add_metric([st.name], st.last_duration)
            runs.add_metric([st.name], st.runs)
            fails.add_metric([st.name], st.failures)
        yield from (dur, runs, fails)


def serve(address: str, collector: Collector) -> CollectorRegistry:
    """Start the /metrics endpoint on host:port in a background thread."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
    return registry
