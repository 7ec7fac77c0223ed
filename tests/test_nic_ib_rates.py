"""Grey IB links: error counters per hour against checks.nic.ib_thresholds (checks/nic/ibrates.py).

The hour is driven through `IbPorts.poll(now)` on a copy of the 8-port sysfs fixture, so an hour of history
takes milliseconds; then a real daemon with a 3 s window reads the same tree, raises and clears.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon
from test_daemon import Watcher, cond

from checks.nic.config import NicConfig, ib_defaults
from checks.nic.ib import IbPorts
from checks.nic.ibrates import SLOTS, CounterHistory, judge
from robustd.api.v1 import robustd_pb2 as pb
from robustd.model import Finding, FindingKind

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "sys" / "ib-8port"
NO_KMSG = {"kernel": {"enabled": False}}
HOUR = 3600.0


class Node:
    """A copy of the fixture's IB tree and the watched ports, polled at times the test chooses."""

    def __init__(self, tmp: Path, **thresholds: float | None) -> None:
        self.root = tmp / "ib"
        shutil.copytree(FIXTURE / "class" / "infiniband", self.root)
        self.ports = IbPorts(str(self.root), [], None, error_rate=1e9, rate_window=10,
                             thresholds={**ib_defaults(), **thresholds}, hour_window=HOUR)
        self.ports.discover()

    def counter(self, name: str, dev: int = 0) -> Path:
        return self.root / f"mlx5_{dev}" / "ports" / "1" / "counters" / name

    def set(self, name: str, value: int, dev: int = 0) -> None:
        self.counter(name, dev).write_text(f"{value}\n")

    def high(self, now: float) -> list[Finding]:
        return [f for f in self.ports.poll(now) if f.code.endswith("_HIGH")]


def test_defaults_come_from_the_rule_file() -> None:
    assert ib_defaults() == {"symbol_error": 120, "link_error_recovery": 300, "link_downed": 2,
                             "port_rcv_errors": 36000, "local_link_integrity_errors": 0,
                             "excessive_buffer_overrun_errors": 0}
    cfg = NicConfig.model_validate({"ib_thresholds": {"symbol_error": 60, "link_downed": None}})
    assert cfg.ib_thresholds["symbol_error"] == 60 and cfg.ib_thresholds["link_downed"] is None
    assert cfg.ib_thresholds["link_error_recovery"] == 300 and cfg.ib_window == HOUR


def test_history_is_bounded_to_one_sample_a_minute() -> None:
    h = CounterHistory("symbol_error", HOUR)
    for t in range(0, 3 * 3600, 1):  # three hours polled every second
        h.add(float(t), t // 60)
    assert len(h.samples) <= SLOTS + 3
    j = judge(h, 120, 3 * 3600 - 1)
    assert j.full and 59 <= j.increase <= 61 and 59 <= j.rate <= 61 and j.over is False


def test_a_new_node_waits_for_an_hour_unless_the_count_is_already_over(tmp_path: Path) -> None:
    n = Node(tmp_path)
    assert n.high(0) == []
    assert "0s of history so far" in n.ports.note(0)
    n.set("symbol_error", 100)  # 100 in 10 minutes: maybe 600/h, maybe 100/h: not known yet, nothing said
    assert n.high(600) == []
    assert "10m of history so far" in n.ports.note(600)
    t = 600.0
    while t < 2 * HOUR:  # two hours pass with no more errors: 100/h at most, below 120
        t += 60
        assert n.high(t) == []
    assert n.ports.note(t) == ""  # a full window everywhere: nothing to say
    n.set("symbol_error", 231)  # 131 within the last hour
    [f] = n.high(t + 60)
    assert (f.code, f.component, f.kind) == ("IB_SYMBOL_ERRORS_HIGH", "ib/mlx5_0/1", FindingKind.STATE)
    assert f.evidence["threshold_per_hour"] == "120" and f.evidence["window"] == "1h"
    assert 125 < float(f.evidence["rate_per_hour"]) <= 131 and f.evidence["increase"] == "131"
    assert "131 in the last 1h" in f.message and "(threshold 120/h)" in f.message

    m = Node(tmp_path / "b")  # just started, and 121 already in the first 5 minutes: certain, raised at once
    m.high(0)
    m.set("link_error_recovery", 301, dev=3)
    [g] = m.high(300)
    assert (g.code, g.component) == ("IB_LINK_RECOVERIES_HIGH", "ib/mlx5_3/1")
    assert "in the first 5m of history, at least 301/h over 1h (threshold 300/h)" in g.message
    assert g.evidence["history"] == "5m"


def test_raised_until_the_hourly_rate_falls_back(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.high(0)
    n.set("link_downed", 3, dev=1)  # 3 losses in the first hour: over 2/h
    assert [f.code for f in n.high(60)] == ["IB_LINK_DOWNED_HIGH"]
    t = 60.0
    while t + 300 < HOUR:  # still within the hour of the losses: reported every poll
        t += 300
        assert [f.code for f in n.high(t)] == ["IB_LINK_DOWNED_HIGH"]
    t = HOUR + 120  # the losses have aged out of the window: below the threshold, no longer reported
    assert n.high(t) == []


def test_a_counter_that_goes_down_restarts_the_window_and_holds_what_it_said(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.high(0)
    n.set("symbol_error", 5000)
    assert [f.code for f in n.high(60)] == ["IB_SYMBOL_ERRORS_HIGH"]
    n.set("symbol_error", 0)  # perfquery -R, or a driver reload: no negative rate, no new alarm ...
    [f] = n.high(120)
    assert "went down" in f.message and f.evidence["resets"] == "1" and f.evidence["increase"] == "0"
    assert float(f.evidence["rate_per_hour"]) == 0  # ... but the link is not known to be better yet
    for t in range(180, int(HOUR) + 120, 300):
        assert [f.code for f in n.high(float(t))] == ["IB_SYMBOL_ERRORS_HIGH"]
    assert n.high(HOUR + 240) == []  # a full quiet hour since the reset: cleared

    m = Node(tmp_path / "b")  # never raised: a reset is only a new baseline
    m.set("symbol_error", 60000)
    m.high(0)
    m.set("symbol_error", 3)
    assert m.high(60) == [] and m.high(120) == []


def test_a_saturated_counter_is_held_not_cleared_and_said_when_never_raised(tmp_path: Path) -> None:
    n = Node(tmp_path)
    n.high(0)
    n.set("symbol_error", 65535)  # 16-bit SymbolErrorCounter: rose to its maximum and sticks there
    assert [f.code for f in n.high(60)] == ["IB_SYMBOL_ERRORS_HIGH"]
    for t in range(120, int(2 * HOUR), 600):  # it cannot rise any more: the rate is unknown, the link no better
        [f] = n.high(float(t))
        assert f.evidence["saturated"] == "true"
    assert "saturated at 65535: rate unknown" in f.message

    m = Node(tmp_path / "b")
    m.set("port_rcv_errors", 65535, dev=4)  # saturated before robustd started: no rate can be had
    m.set("excessive_buffer_overrun_errors", 2**32 - 1, dev=6)  # a driver reporting 32 bits
    m.high(0)
    assert m.high(HOUR + 60) == []
    note = m.ports.note(HOUR + 60)
    assert "IB counters saturated, rate unknown: mlx5_4/1 port_rcv_errors=65535" in note
    assert "mlx5_6/1 excessive_buffer_overrun_errors=4294967295" in note


def test_missing_counter_files_are_skipped_and_thresholds_can_be_off(tmp_path: Path) -> None:
    n = Node(tmp_path, local_link_integrity_errors=None)
    n.counter("link_error_recovery", dev=2).unlink()
    n.high(0)
    n.set("local_link_integrity_errors", 9, dev=2)  # turned off: never judged
    n.set("excessive_buffer_overrun_errors", 1, dev=2)  # 0 a hour allowed: any increase
    got = n.ports.poll(60)
    assert [f.code for f in got if f.kind is not FindingKind.RESOLVED and f.code != "IB_ERRORS_RISING"] == [
        "IB_BUFFER_OVERRUNS_HIGH"]
    assert "link_error_recovery" not in n.ports.ports["mlx5_2/1"].hourly.counters


@pytest.mark.parametrize("text, key, line, words", [
    ("checks:\n  nic:\n    ib_thresholds:\n      symbol_errors: 5\n", "checks.nic.ib_thresholds.symbol_errors", 4,
     "symbol_error"),
    ("checks:\n  nic:\n    ib_thresholds:\n      link_downed: -1\n", "checks.nic.ib_thresholds.link_downed", 4,
     "greater than or equal to 0"),
    ("checks:\n  nic:\n    ib_window: 60\n", "checks.nic.ib_window", 3, "no unit"),
])
def test_bad_ib_thresholds_name_the_key_and_line(tmp_path: Path, text: str, key: str, line: int,
                                                 words: str) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(text)
    r = subprocess.run([sys.executable, "-m", "robustd.daemon", "--check-config", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{cfg}:{line}:" in r.stderr and key in r.stderr and words in r.stderr, r.stderr


def test_daemon_raises_symbol_errors_high_with_rate_and_clears_when_the_rate_falls(
        make_daemon: Any, short_tmp: Path) -> None:
    sysfs = short_tmp / "sys"
    shutil.copytree(FIXTURE, sysfs)
    d: Daemon = make_daemon({
        "checks": {**NO_KMSG, "nic": {"enabled": True, "interval": "200ms", "sysfs_root": str(sysfs),
                                      "ib_window": "3s", "ib_error_rate": 1e9}},
        "policy": {"codes": {"IB_SYMBOL_ERRORS_HIGH": {"clear_after": "1s"}}},
    })
    d.start()
    w = Watcher(d)
    try:
        [nic] = [c for c in d.stub().ListChecks(pb.ListChecksRequest(), timeout=5).checks if c.name == "nic"]
        assert "IB error rates per 3s:" in nic.note and "of history so far" in nic.note, nic.note
        (sysfs / "class/infiniband/mlx5_5/ports/1/counters/symbol_error").write_text("40\n")
        ev = w.until(lambda e: e.condition.code == "IB_SYMBOL_ERRORS_HIGH" and e.kind == pb.EVENT_KIND_RAISED,
                     timeout=4)
        assert ev.condition.component == "ib/mlx5_5/1"
        c = cond(d.verdict(), "IB_SYMBOL_ERRORS_HIGH", "ib/mlx5_5/1")
        assert c is not None and (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)
        assert c.evidence["window"] == "3s" and c.evidence["threshold_per_hour"] == "120"
        assert float(c.evidence["rate_per_hour"]) >= 40 * 1100 and "threshold 120/h" in c.message
        t0 = time.monotonic()  # no more errors: once they leave the 3 s window, the 1 s hold-down clears it
        w.until(lambda e: e.condition.code == "IB_SYMBOL_ERRORS_HIGH" and e.kind == pb.EVENT_KIND_CLEARED,
                timeout=8)
        assert time.monotonic() - t0 >= 1.5
        assert d.verdict().severity == pb.SEVERITY_OK
    finally:
        w.close()
