"""/metrics: names by Prometheus conventions, bounded condition series, and the start-up warning.

The collector is exercised on a real Policy, Engine and Store (SQLite in tmp); the flood and the
warning on a real daemon whose /metrics is scraped over HTTP.
"""

from __future__ import annotations

import logging
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, bdf, free_port, inject_kmsg, need_root
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_diagnostics import diag_daemon
from test_diagnostics import run as run_diagnostic

from robustd.api.v1 import robustd_pb2 as pb
from robustd.check import Check, CheckConfig, CheckStatus
from robustd.codes import CodeRule, CodeTable
from robustd.config import ConfigError, Schema, parse_config
from robustd.engine import Engine
from robustd.metrics import DaemonProbe, StateCollector, is_loopback, serve
from robustd.model import Finding, FindingBatch
from robustd.policy import Policy
from robustd.runner import CheckState
from robustd.store import Store

# Every family robustd exports, as the README's metrics table lists it (name as scraped, type).
FAMILIES = {
    "robustd_build_info": "gauge", "robustd_start_time_seconds": "gauge", "robustd_node_severity": "gauge",
    "robustd_conditions": "gauge", "robustd_condition": "gauge", "robustd_condition_series_dropped_total": "counter",
    "robustd_condition_series_max": "gauge", "robustd_conditions_folded": "gauge", "robustd_events_total": "counter",
    "robustd_event_log_writable": "gauge", "robustd_events_held": "gauge",
    "robustd_check_duration_seconds": "gauge", "robustd_check_runs_total": "counter",
    "robustd_check_failures_total": "counter", "robustd_check_status": "gauge",
    "robustd_kmsg_overruns_total": "counter", "robustd_kmsg_records_lost_total": "counter",
    "robustd_watchdog_interval_seconds": "gauge", "robustd_watchdog_notification_age_seconds": "gauge",
    "robustd_runner_tick_age_seconds": "gauge", "robustd_diagnostic_runs_total": "counter",
    "robustd_diagnostic_running": "gauge",
}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Poller(Check):
    name = "poller"


def engine(tmp_path: Path, **caps: int) -> tuple[Engine, Clock]:
    clock = Clock()
    table = CodeTable([{"XID_79": CodeRule(severity="CRITICAL", action="REBOOT", sticky=True),
                        "LINK_FLAP": CodeRule(severity="WARNING", action="NONE")}])
    return Engine(Policy(table, "boot-a", **caps), Store(str(tmp_path)), clock), clock


def raise_(eng: Engine, code: str, components: list[str]) -> None:
    eng.submit(FindingBatch("kernel", tuple(Finding(component=c, code=code, message="m") for c in components)))


def scrape(collector: StateCollector) -> dict[str, Any]:
    """{family name as scraped: (type, [(sample name, labels, value)])}."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, [(s.name, s.labels, s.value) for s in fam.samples])
    return out


def probe(**over: Any) -> DaemonProbe:
    base: dict[str, Any] = {"watchdog_interval": lambda: 15.0, "last_watchdog": lambda: time.monotonic() - 3,
                            "last_tick": lambda: time.monotonic() - 0.25,
                            "diagnostic_outcomes": lambda: {"FAIL": 2}, "diagnostic_running": lambda: False}
    return DaemonProbe(**{**base, **over})


def states() -> list[CheckState]:
    st = CheckState(check=Poller(), config=CheckConfig(), status=CheckStatus.TIMEOUT, last_duration=0.5, runs=7,
                    failures=2)
    return [st]


def test_every_family_follows_prometheus_naming_and_is_the_documented_set(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path)
    raise_(eng, "XID_79", ["gpu/0000:3b:00.0"])
    got = scrape(StateCollector(eng.view, "node-a", states, probe=probe()))
    assert {name: kind for name, (kind, _) in got.items()} == FAMILIES
    for name, (kind, samples) in got.items():
        assert name.startswith("robustd_") and name.count("robustd") == 1, name
        assert (kind == "counter") == name.endswith("_total"), name
        if re.search(r"duration|_age|interval|time", name):
            assert name.endswith("_seconds"), name
        assert all(s[0] == name for s in samples), name  # counters' samples carry _total, no _created
    # Values a user reads: the probe's ages, the check's status as one-hot, the diagnostics by outcome.
    assert [v for _, _, v in got["robustd_watchdog_notification_age_seconds"][1]][0] == pytest.approx(3, abs=1)
    status = {s[1]["status"]: s[2] for s in got["robustd_check_status"][1]}
    assert status["TIMEOUT"] == 1 and sum(status.values()) == 1
    assert set(status) == {"NOT_YET_RUN", "OK", "ERROR", "TIMEOUT", "DISABLED", "UNSUPPORTED", "WATCHING"}
    runs = {s[1]["outcome"]: s[2] for s in got["robustd_diagnostic_runs_total"][1]}
    assert runs == {"PASS": 0, "FAIL": 2, "ERROR": 0, "CANCELLED": 0}
    assert got["robustd_node_severity"][1] == [("robustd_node_severity", {"node": "node-a"}, 2)]


def test_check_statuses_are_the_protos_and_the_metrics_labels(tmp_path: Path) -> None:
    """One enum: ListChecks sends CHECK_STATUS_<name> for each, the metric labels each by its name."""
    from robustd.api import convert

    names = [s.value for s in CheckStatus]
    assert names == ["NOT_YET_RUN", "OK", "ERROR", "TIMEOUT", "DISABLED", "UNSUPPORTED", "WATCHING"]
    assert {f"CHECK_STATUS_{n}" for n in names} == set(pb.CheckStatus.keys()) - {"CHECK_STATUS_UNSPECIFIED"}
    eng, _ = engine(tmp_path)
    for s in CheckStatus:
        st = CheckState(check=Poller(), config=CheckConfig(), status=s)
        assert pb.CheckStatus.Name(convert.check_info(st).status) == f"CHECK_STATUS_{s.value}"
        got = scrape(StateCollector(eng.view, "node-a", lambda st=st: [st], probe=probe()))
        assert {x[1]["status"] for x in got["robustd_check_status"][1] if x[2] == 1} == {s.value}


def test_every_family_is_in_the_readme_metrics_table() -> None:
    readme = (REPO / "README.md").read_text()
    rows = set(re.findall(r"^\| `(robustd_\w+)`", readme, re.MULTILINE))
    assert rows == set(FAMILIES), (set(FAMILIES) - rows, rows - set(FAMILIES))


def test_condition_series_are_capped_most_severe_first_and_the_rest_counted(tmp_path: Path) -> None:
    eng, clock = engine(tmp_path)
    for i in range(30):
        clock.now += 1
        raise_(eng, "LINK_FLAP", [f"nic/eth{i}"])
    raise_(eng, "XID_79", [f"gpu/0000:{i:02x}:00.0" for i in range(5)])
    collector = StateCollector(eng.view, "node-a", states, max_condition_series=10)
    got = scrape(collector)
    shown = got["robustd_condition"][1]
    assert len(shown) == 10
    assert sorted(s[1]["component"] for s in shown if s[2] == 2) == [f"gpu/0000:{i:02x}:00.0" for i in range(5)]
    assert [s[1]["component"] for s in shown if s[2] == 1] == [f"nic/eth{i}" for i in range(5)]  # the oldest
    assert got["robustd_condition_series_dropped_total"][1][0][2] == 25
    totals = {(s[1]["severity"], s[1]["action"]): s[2] for s in got["robustd_conditions"][1]}
    assert totals[("WARNING", "NONE")] == 30 and totals[("CRITICAL", "REBOOT")] == 5
    assert sum(totals.values()) == 35
    assert scrape(collector)["robustd_condition_series_dropped_total"][1][0][2] == 50  # per scrape, summed
    assert not scrape(StateCollector(eng.view, "node-a", states, max_condition_series=0))["robustd_condition"][1]


def test_components_folded_by_the_policy_are_counted(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path, max_conditions_per_code=4)
    raise_(eng, "XID_79", [f"gpu/0000:{i:02x}:00.0" for i in range(10)])
    got = scrape(StateCollector(eng.view, "node-a", states, max_condition_series=3))
    assert got["robustd_conditions_folded"][1][0][2] == 6
    # The fold-over stands for many: it wins a place over the single GPUs of the same severity.
    assert ("gpu/*", "XID_79") in [(s[1]["component"], s[1]["code"]) for s in got["robustd_condition"][1]]


def test_no_watchdog_means_interval_zero_and_no_age_series(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path)
    got = scrape(StateCollector(eng.view, "n", states, probe=probe(watchdog_interval=lambda: None)))
    assert got["robustd_watchdog_interval_seconds"][1][0][2] == 0
    assert "robustd_watchdog_notification_age_seconds" not in got


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
                                                ("localhost", True), ("0.0.0.0", False), ("", False),
                                                ("::", False), ("192.0.2.7", False), ("no-such-host.invalid", False)])
def test_loopback_addresses_are_told_apart(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_serving_beyond_loopback_warns_and_loopback_does_not(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    eng, _ = engine(tmp_path)
    for address, warned in ((f"127.0.0.1:{free_port()}", False), (f"0.0.0.0:{free_port()}", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="robustd"):
            server = serve(address, StateCollector(eng.view, "n", states))
        try:
            port = address.rsplit(":", 1)[1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert b"robustd_node_severity" in r.read()
        finally:
            server.shutdown()
            server.server_close()
        assert ("reachable from other hosts" in caplog.text) is warned, caplog.text


def test_idle_connections_cannot_exhaust_the_endpoint(tmp_path: Path) -> None:
    """Clients that connect and send nothing hold at most max_connections slots, and only until their timeout."""
    eng, _ = engine(tmp_path)
    port = free_port()
    server = serve(f"127.0.0.1:{port}", StateCollector(eng.view, "n", states), max_connections=2, timeout=1.0)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.2)  # let the server take them
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert extra.recv(100) == b""  # closed unanswered: every slot is taken
        assert server.refused >= 1
        for s in idle:  # the idle ones are closed by the server once their timeout passes
            assert s.recv(100) == b""
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    assert b"robustd_node_severity" in r.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the endpoint did not recover after the idle clients timed out"
                time.sleep(0.1)
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("yaml_text", "message"), [
    ('metrics:\n  address: "9400"\n', "t.yaml:2: metrics.address"),
    ('metrics:\n  address: "127.0.0.1:http"\n', "t.yaml:2: metrics.address"),
    ("metrics:\n  max_condition_series: -1\n", "t.yaml:2: metrics.max_condition_series"),
])
def test_bad_metrics_config_names_key_and_line(yaml_text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(yaml_text, "t.yaml", Schema(), {})
    assert message in str(err.value)


# -- a real daemon ---------------------------------------------------------------------------------
def fetch(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_a_flood_of_distinct_gpus_is_capped_in_metrics_and_folded_in_the_verdict(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    port = free_port()
    d = make_daemon({"metrics": {"address": f"127.0.0.1:{port}", "max_condition_series": 5},
                     "policy": {"max_conditions_per_code": 8, "max_conditions": 20}})
    d.start()
    flood = [bdf() for _ in range(60)]  # a driver printing bus ids no host has
    inject_kmsg(*(f"NVRM: Xid (PCI:{a}): 79, pid=0, GPU has fallen off the bus." for a in flood))

    def folded(v: pb.Verdict) -> int:
        fold = next((c for c in v.conditions if c.component == "gpu/*" and c.code == "XID_79"), None)
        return int(fold.evidence["folded"]) if fold is not None else 0

    v = d.wait_for(lambda v: folded(v) >= 52, timeout=15)  # 8 of ours stand on their own (fewer if others' Xids came)
    assert len(v.conditions) <= 20 + 64 + 1  # the verdict is bounded: own conditions, fold-overs, the catch-all
    first = fetch(port)
    assert len(first["robustd_condition"]) == 5
    assert all(value == 2 for _, value in first["robustd_condition"])  # CRITICAL ones won the places
    assert first["robustd_conditions_folded"][0][1] >= 52
    standing = sum(value for _, value in first["robustd_conditions"])
    assert standing >= 9 and first["robustd_condition_series_dropped_total"][0][1] >= standing - 5
    second = fetch(port)
    dropped = "robustd_condition_series_dropped_total"
    assert second[dropped][0][1] > first[dropped][0][1]
    assert "reachable from other hosts" not in d.log()


def test_a_daemon_serving_metrics_beyond_loopback_warns_at_start(make_daemon: Any) -> None:
    port = free_port()
    d = make_daemon({"metrics": {"address": f"0.0.0.0:{port}"}, "checks": {"kernel": {"enabled": False}}})
    d.start()
    assert f"metrics.address 0.0.0.0:{port} is reachable from other hosts" in d.log()
    assert fetch(port)["robustd_node_severity"] == [({"node": "test-node"}, 0)]


def test_finished_diagnostics_are_counted_by_outcome(make_daemon: Any) -> None:
    port = free_port()
    d = diag_daemon(make_daemon, "fail4", config={"metrics": {"address": f"127.0.0.1:{port}"}})
    assert {labels["outcome"]: v for labels, v in fetch(port)["robustd_diagnostic_runs_total"]} == {
        "PASS": 0, "FAIL": 0, "ERROR": 0, "CANCELLED": 0}
    _, report = run_diagnostic(d, tests=["eud"])
    assert report.outcome == pb.OUTCOME_FAIL
    got = fetch(port)
    assert {labels["outcome"]: v for labels, v in got["robustd_diagnostic_runs_total"]} == {
        "PASS": 0, "FAIL": 1, "ERROR": 0, "CANCELLED": 0}
    assert got["robustd_diagnostic_running"] == [({}, 0)]
    # Its DIAG_EUD_FAILED conditions are in the per-condition series like any fault.
    assert {labels["code"] for labels, _ in got["robustd_condition"]} == {"DIAG_EUD_FAILED"}
