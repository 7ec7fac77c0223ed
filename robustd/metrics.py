"""Prometheus view of the daemon's state, read at scrape time (never a second copy of it)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from robustd.engine import EngineView
from robustd.model import Severity, worst
from robustd.runner import CheckState

# 0 OK, 1 WARNING, 2 CRITICAL: the same numbers robustctl exits with.
LEVEL = {Severity.OK: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


class StateCollector(Collector):
    def __init__(self, engine: EngineView, node: str, checks: Callable[[], Sequence[CheckState]]):
        self.engine = engine
        self.node = node
        self.checks = checks

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        conds = self.engine.conditions()
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
        writable = GaugeMetricFamily("robustd_event_log_writable", "1 while the event log takes writes, 0 while "
                                     "it is full, read-only or not responding (changes then wait in memory)")
        writable.add_metric([], 0 if self.engine.store_error else 1)
        yield writable
        held = GaugeMetricFamily("robustd_events_held", "Decided changes not yet written to the event log")
        held.add_metric([], self.engine.events_held)
        yield held
        dur = GaugeMetricFamily("robustd_check_duration_seconds", "Duration of each check's last poll",
                                labels=["check"])
        runs = CounterMetricFamily("robustd_check_runs", "Polls or watcher batches completed", labels=["check"])
        fails = CounterMetricFamily("robustd_check_failures", "Check errors and timeouts", labels=["check"])
        overruns = CounterMetricFamily("robustd_kmsg_overruns", "Times the kernel log ring overran the kernel "
                                       "check's reader (records were lost)")
        lost = CounterMetricFamily("robustd_kmsg_records_lost", "Kernel log records lost to ring overruns")
        for st in self.checks():
            if st.last_duration is not None:
                dur.add_metric([st.name], st.last_duration)
            runs.add_metric([st.name], st.runs)
            fails.add_metric([st.name], st.failures)
            if st.name == "kernel":
                overruns.add_metric([], getattr(st.check, "overruns", 0))
                lost.add_metric([], getattr(st.check, "records_lost", 0))
        yield from (dur, runs, fails, overruns, lost)


def serve(address: str, collector: Collector) -> Any:
    """Start the /metrics endpoint on host:port in a daemon thread; returns the HTTP server (to close it).
    Raises OSError when the address cannot be listened on."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry()
    registry.register(collector)
    server, _thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
    return server
