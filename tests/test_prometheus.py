"""The alert rules and the Grafana dashboard, against Debian's real promtool and Prometheus server.

`promtool check rules` and `promtool test rules` run the rules' own unit tests
(deploy/prometheus/robustd-alerts.test.yaml). The end-to-end tests start a real Prometheus server
(its own config, data dir and free loopback port) scraping a real robustd every second with the
rules loaded: an Xid 79 written to the real /dev/kmsg must make RobustdNodeCritical fire in
Prometheus's HTTP API, an acknowledgement must make it go, and every query of the dashboard must
evaluate on what Prometheus really scraped, naming only metrics and labels robustd exports.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import yaml
from conftest import IN_CI, REPO, Daemon, bdf, cond, eventually, free_port, inject_kmsg, need_root, plugin_env

from robustd.api.v1 import robustd_pb2 as pb

RULES = REPO / "deploy" / "prometheus" / "robustd-alerts.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "robustd-alerts.test.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "robustd-dashboard.json"
DEADLINE = 90.0  # generous: the alert needs its `for:` plus a few 1 s scrapes and evaluations
# What Grafana substitutes before a query reaches Prometheus (the dashboard's variables and macros).
GRAFANA_VARS = {"$__rate_interval": "30s", "$__range": "5m", "$__interval": "1s", "$job": "robustd",
                "$instance": ".*"}


def need_tool(tool: str) -> str:
    """The path of a binary from Debian's `prometheus` package: fail under CI (make test installs it), else skip."""
    path = shutil.which(tool)
    if path is None:
        (pytest.fail if IN_CI else pytest.skip)(f"{tool} is not installed (apt-get install prometheus; "
                                                "`make deps` does it as root)")
    assert path is not None
    return path


def promtool(*args: str, cwd: Path = RULES.parent) -> subprocess.CompletedProcess[str]:
    return subprocess.run([need_tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          stdin=subprocess.DEVNULL)


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


# -- the rules, offline ----------------------------------------------------------------------------
def test_promtool_check_rules_accepts_the_alerts() -> None:
    p = promtool("check", "rules", str(RULES))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in p.stdout


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    p = promtool("test", "rules", RULE_TESTS.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout + p.stderr


def test_the_unit_tests_catch_a_slower_critical_alert(tmp_path: Path) -> None:
    """The rule tests have teeth: RobustdNodeCritical with a 5 m `for:` fails them."""
    slow = RULES.read_text().replace("        for: 15s\n", "        for: 5m\n", 1)
    assert slow != RULES.read_text()
    (tmp_path / RULES.name).write_text(slow)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    p = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert p.returncode != 0
    assert "alertname: RobustdNodeCritical" in p.stdout + p.stderr


def test_every_alert_has_severity_texts_and_a_readme_runbook() -> None:
    headings = {line[4:].strip() for line in (REPO / "README.md").read_text().splitlines() if line.startswith("### ")}
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"RobustdNodeCritical", "RobustdNodeWarningHeld", "RobustdCheckFailing",
                                           "RobustdNvmlHang", "RobustdDiagnosticFailed", "RobustdDown",
                                           "RobustdNotScraped", "RobustdEventLogNotWritable", "RobustdWatchdogTrouble"}
    for r in rules:
        name = r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        assert r["annotations"]["runbook_url"].endswith(f"README.md#{name.lower()}"), name
        assert name in headings, f"README.md has no '### {name}' section for the runbook_url to point at"
    critical = next(r for r in rules if r["alert"] == "RobustdNodeCritical")
    assert _seconds(critical["for"]) <= 30


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", duration)
    assert m, duration
    return int(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m[2]]


# -- a real Prometheus scraping a real robustd ------------------------------------------------------
class Prometheus:
    """Debian's Prometheus server on a free loopback port, with its own config and data dir."""

    def __init__(self, root: Path, target: str):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "robustd", "static_configs": [{"targets": [target]}]}]}
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = root / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [need_tool("prometheus"), f"--config.file={self.root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.root / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready within 30s:\n{self.log()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a success, else an AssertionError with Prometheus's error."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        assert body.get("status") == "success", f"{path} {params}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"].get("alertname") == name]

    def wait(self, what: str, predicate: Any, timeout: float = DEADLINE) -> Any:
        return eventually(predicate, timeout, what, every=0.5,
                          detail=lambda: f"alerts: {self.api('alerts')}\n{self.log()}")


class NotifySocket:
    """A real sd_notify socket (a Unix datagram socket, as systemd's) read by a thread, so robustd runs with
    a systemd watchdog (WATCHDOG_USEC) and exports the watchdog metrics."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.5)
        self.messages: list[str] = []
        self.closed = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.closed:
            try:
                self.messages.append(self.sock.recv(4096).decode(errors="replace"))
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self.closed = True
        self.thread.join(2)
        self.sock.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Daemon, Prometheus, str]]:
    """robustd (kernel check on the real /dev/kmsg, a polled `tick` check, a failing `boom` check, a 2 s systemd
    watchdog) with /metrics on loopback, and a Prometheus scraping it every second with the rules loaded."""
    need_root("writing /dev/kmsg")
    need_tool("prometheus")
    root = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))
    notify = NotifySocket(root / "notify.sock")
    port = free_port()
    target = f"127.0.0.1:{port}"
    (root / "d").mkdir()
    env = {**plugin_env(root), "NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "2000000"}
    d = Daemon(root / "d", {"metrics": {"address": target},
                            "checks": {"hang": {"enabled": False}, "tick": {"interval": "1s"},
                                       "boom": {"interval": "1s"}}}, env)
    prom = Prometheus(root, target)
    try:
        d.start()
        prom.start()
        prom.wait("robustd scraped", lambda: prom.query(f'up{{job="robustd",instance="{target}"}} == 1'))
        yield d, prom, target
    finally:
        prom.stop()
        d.stop()
        notify.close()
        shutil.rmtree(root, ignore_errors=True)


def test_xid_79_fires_robustd_node_critical_in_prometheus_and_ack_resolves_it(
        stack: tuple[Daemon, Prometheus, str]) -> None:
    d, prom, target = stack
    addr = bdf()
    component = f"gpu/{addr}.0"
    inject_kmsg(f"NVRM: Xid (PCI:{addr}): 79, pid=0, GPU has fallen off the bus.")

    def firing() -> list[dict[str, Any]]:
        return [a for a in prom.alerts("RobustdNodeCritical") if a["state"] == "firing"]

    alert = prom.wait("RobustdNodeCritical firing", firing)[0]
    assert alert["labels"] == {"alertname": "RobustdNodeCritical", "severity": "critical", "job": "robustd",
                               "instance": target, "action": "REBOOT"}
    assert alert["annotations"]["summary"] == f"GPU node {target} is CRITICAL: needs REBOOT"
    assert alert["annotations"]["runbook_url"].endswith("README.md#robustdnodecritical")
    # The condition itself is in Prometheus too, as robustd exported it.
    series = prom.query(f'robustd_condition{{instance="{target}",code="XID_79",component="{component}"}}')
    assert [s["value"][1] for s in series] == ["2"] and series[0]["metric"]["action"] == "REBOOT"

    p = d.robustctl("ack", component, "XID_79", "--reason", "GPU reseated")
    assert p.returncode == 0, p.stdout + p.stderr
    assert cond(d.verdict(), "XID_79", component) is None

    def resolved() -> bool:
        # The kernel log is the host's: Xids other tests write at the same time are CRITICAL here too.
        for c in d.verdict().conditions:
            if c.severity == pb.SEVERITY_CRITICAL:
                with contextlib.suppress(grpc.RpcError):  # NOT_FOUND: it cleared meanwhile
                    d.stub().Acknowledge(pb.AcknowledgeRequest(component=c.component, code=c.code, reason="test"),
                                         timeout=5)
        return not prom.alerts("RobustdNodeCritical")

    prom.wait("RobustdNodeCritical gone from /api/v1/alerts", resolved)
    rule = next(r for g in prom.api("rules")["groups"] for r in g["rules"] if r["name"] == "RobustdNodeCritical")
    assert rule["state"] == "inactive" and rule["health"] == "ok"


def test_every_rule_is_healthy_and_names_only_exported_metrics(stack: tuple[Daemon, Prometheus, str]) -> None:
    _, prom, _ = stack
    exported = _exported(prom)
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    for r in rules:
        prom.wait(f"rule {r['name']} evaluated", lambda name=r["name"]: _rule(prom, name).get("lastEvaluation",
                  "0001").startswith("2"))
        r = _rule(prom, r["name"])
        assert r["health"] == "ok" and not r.get("lastError"), r
        assert _metric_names(r["query"]) <= exported, (r["name"], _metric_names(r["query"]) - exported)


def test_every_dashboard_query_evaluates_on_what_robustd_exports(stack: tuple[Daemon, Prometheus, str]) -> None:
    _, prom, target = stack
    # Every family is in Prometheus before the queries run (the watchdog's after its first notification).
    prom.wait("the watchdog metric scraped", lambda: prom.query("robustd_watchdog_notification_age_seconds"))
    exported = _exported(prom)
    labels = {name: _labels(prom, name) for name in exported}
    queries = _dashboard_queries()
    assert len(queries) >= 20
    for title, expr in queries:
        concrete = _substitute(expr)
        names = _metric_names(concrete)
        assert names and names <= exported, (title, names - exported)
        derived = set(re.findall(r'label_replace\([^,]+,\s*"(\w+)"', re.sub(r"\{[^}]*\}", "", concrete)))
        known = set().union(*(labels[n] for n in names)) | derived
        used = _label_names(concrete)
        assert used <= known, (title, used - known)
        prom.query(concrete)  # raises with Prometheus's error message
    # And what the panels show is what robustd says: this node is WARNING (boom's CHECK_ERROR) or worse.
    assert prom.query(f'robustd_node_severity{{instance="{target}"}} >= 1')
    assert prom.query('robustd_check_status{check="boom",status="ERROR"} == 1')
    assert prom.query('robustd_check_duration_seconds{check="tick"}')
    # WATCHDOG_USEC=2 s: robustd notifies every second, and on time.
    assert [s["value"][1] for s in prom.query("robustd_watchdog_interval_seconds")] == ["1"]
    assert prom.query("robustd_watchdog_notification_age_seconds <= 2 * robustd_watchdog_interval_seconds")


# -- helpers -----------------------------------------------------------------------------------------
def _rule(prom: Prometheus, name: str) -> dict[str, Any]:
    return next(r for g in prom.api("rules")["groups"] for r in g["rules"] if r["name"] == name)


def _exported(prom: Prometheus) -> set[str]:
    """Metric names Prometheus holds from the robustd job (plus `up`, which Prometheus adds per target)."""
    names = set(prom.api("label/__name__/values", **{"match[]": '{job="robustd"}'}))
    assert "robustd_node_severity" in names, names
    return names


def _labels(prom: Prometheus, name: str) -> set[str]:
    series = prom.api("series", **{"match[]": name})
    return set().union(*(set(s) for s in series)) - {"__name__"}


def _dashboard_queries() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    panels = [p for row in doc["panels"] for p in [row, *row.get("panels", [])]]
    for p in panels:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def _substitute(expr: str) -> str:
    for var in sorted(GRAFANA_VARS, key=len, reverse=True):  # $__rate_interval before $__range
        expr = expr.replace(var, GRAFANA_VARS[var])
    leftover = re.findall(r"\$\{?[A-Za-z_]\w*", expr)
    assert not leftover, f"an unknown dashboard variable in {expr!r}: {leftover}"
    return expr


FUNCTIONS = {"sum", "count", "max", "min", "avg", "rate", "increase", "changes", "sort_desc", "label_replace",
             "vector", "absent", "topk", "by", "without", "on", "or", "and", "unless", "bool", "group_left"}


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, labels or strings."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    bare = re.sub(r"\{[^}]*\}", "{}", bare)  # matchers
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # ranges
    return {w for w in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", bare)
            if w not in FUNCTIONS and not re.fullmatch(r"\d.*", w)}


def _label_names(expr: str) -> set[str]:
    """Labels a query matches on or groups by."""
    used: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)):
        used |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        used |= {x.strip() for x in group.split(",") if x.strip()}
    return used

