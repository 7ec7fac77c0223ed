"""The NIC check: parsers and link tracking on literal input, then a real daemon watching a real
veth end in a network namespace, and an 8-port InfiniBand sysfs tree changed while it runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Daemon, need_root
from test_daemon import Watcher, cond

from checks.common.counters import RateWindow
from checks.nic import NicCheck
from checks.nic.config import NicConfig
from checks.nic.ib import IbPorts
from checks.nic.netlink import LinkObs, LinkTracker
from checks.nic.parse import PortState, parse_ib_state, parse_rate
from robustd.api.v1 import robustd_pb2 as pb
from robustd.codes import CodeTable
from robustd.model import FindingKind

FIXTURE = Path(__file__).parent / "fixtures" / "sys" / "ib-8port"
NO_KMSG = {"kernel": {"enabled": False}}  # other tests write Xids to the real kernel log meanwhile


# -- pure parts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [("4: ACTIVE\n", (4, "ACTIVE")), ("1: DOWN", (1, "DOWN")),
                                        ("5: LinkUp\n", (5, "LinkUp")), ("3: Disabled", (3, "Disabled")),
                                        ("2: INIT", (2, "INIT"))])
def test_parse_ib_state(text: str, want: tuple[int, str]) -> None:
    assert parse_ib_state(text) == PortState(*want)


@pytest.mark.parametrize("text, want", [("400 Gb/sec (4X NDR)\n", 400.0), ("200 Gb/sec (4X HDR)", 200.0),
                                        ("2.5 Gb/sec (1X SDR)", 2.5), ("100 Gb/sec", 100.0), ("400", 400.0),
                                        (800, 800.0)])
def test_parse_rate(text: Any, want: float) -> None:
    assert parse_rate(text) == want


@pytest.mark.parametrize("bad", ["ACTIVE", "", "four: ACTIVE"])
def test_parse_ib_state_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_ib_state(bad)


def test_rate_window_treats_a_counter_that_went_back_as_a_new_baseline() -> None:
    w = RateWindow(window=10)
    assert w.add(0, 1000) is None and w.rate() is None
    assert w.add(1, 1010) == 10 and w.rate() == 10
    assert w.add(2, 3) is None and w.rate() is None  # driver reload: no negative or huge rate
    assert w.add(3, 5) == 2 and w.rate() == 2
    for t in range(4, 30):
        w.add(t, 5)
    assert w.rate() == 0  # old increases age out of the window


def test_nic_codes_load_and_tolerate_link_loss() -> None:
    table = CodeTable([NicCheck().codes()])
    m = table.resolve("NIC_DOWN", hint_severity=None, hint_action=None, default_clear_after=300,
                      default_escalate=2)
    assert m.severity.name == "CRITICAL" and m.action.name == "HW_INSPECT"
    assert m.tolerate is not None and (m.tolerate.count, m.tolerate.window, m.tolerate.persist) == (3, 300, 30)
    assert NicConfig.model_validate({"expected_ib_rate": "400 Gb/sec"}).expected_ib_rate == 400.0


def obs(cc: int, down: bool = False, index: int = 7) -> LinkObs:
    return LinkObs("eth9", index, carrier=not down, operstate="LOWERLAYERDOWN" if down else "UP", carrier_changes=cc)


def kinds(findings: list[Any]) -> list[tuple[str, FindingKind]]:
    return [(f.code, f.kind) for f in findings]


def test_link_tracker_dump_overtaken_by_event_cannot_undo_it() -> None:
    t = LinkTracker(lambda n: n == "eth9", ["eth9"], flap_count=6, flap_window=60)
    assert kinds(t.snapshot([obs(4)], 0)) == [("NIC_DOWN", FindingKind.RESOLVED)]
    assert kinds(t.event(obs(5, down=True), 1)) == [("NIC_DOWN", FindingKind.STATE)]
    assert kinds(t.snapshot([obs(4)], 1.1)) == [("NIC_DOWN", FindingKind.STATE)]  # stale: still down
    # Same carrier_changes but a different state: believed only when two dumps agree.
    assert kinds(t.snapshot([obs(5)], 2)) == [("NIC_DOWN", FindingKind.STATE)]
    assert kinds(t.snapshot([obs(5)], 3)) == [("NIC_DOWN", FindingKind.RESOLVED)]


def test_link_tracker_counts_missed_changes_and_ignores_driver_reload() -> None:
    t = LinkTracker(lambda n: True, ["eth9"], flap_count=6, flap_window=60)
    t.snapshot([obs(10)], 0)
    got = t.snapshot([obs(16)], 1)  # six changes happened between dumps, no event seen (ENOBUFS)
    assert ("NIC_FLAPPING", FindingKind.STATE) in kinds(got)
    t2 = LinkTracker(lambda n: True, ["eth9"], flap_count=6, flap_window=60)
    t2.snapshot([obs(5000)], 0)
    assert kinds(t2.snapshot([obs(1, index=8)], 1)) == []  # new ifindex, counter restarted: no alarm
    assert kinds(t2.snapshot([], 2)) == [("NIC_DOWN", FindingKind.STATE)] * 2  # gone (raised, then re-reported)


def test_ib_counters_reset_is_not_an_alarm(tmp_path: Path) -> None:
    root = tmp_path / "ib"
    shutil.copytree(FIXTURE / "class" / "infiniband", root)
    ports = IbPorts(str(root), [], None, error_rate=1.0, rate_window=10)
    ports.discover()
    assert sorted(ports.ports) == [f"mlx5_{i}/1" for i in range(8)]
    c = root / "mlx5_0" / "ports" / "1" / "counters"
    (c / "symbol_error").write_text("50000\n")
    (c / "link_downed").write_text("9\n")
    assert {f.code for f in ports.poll(0)} == {"IB_PORT_DOWN", "IB_RATE_DEGRADED"}  # all RESOLVED
    (c / "symbol_error").write_text("0\n")  # driver reload: counters restart
    (c / "link_downed").write_text("0\n")
    (c / "port_xmit_data").write_text(str(53174420596 + 250_000_000) + "\n")
    got = [f for f in ports.poll(1) if f.kind is not FindingKind.RESOLVED]
    assert got == []
    tx, rx = ports.traffic["ib/mlx5_0/1"]
    assert tx == 1_000_000_000 and rx == 0  # words are 4 bytes: the hang signal reads bytes/s


# -- a real veth in a network namespace ---------------------------------------------------------
class Veth:
    """A veth pair: `watched` inside namespace `ns`, `peer` in ours."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns, self.watched, self.peer = f"rdtest-{tag}", f"rdw{tag}", f"rdp{tag}"

    def ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def set_peer(self, state: str) -> None:
        self.ip("link", "set", self.peer, state)

    def set_watched(self, state: str) -> None:
        self.ip("-n", self.ns, "link", "set", self.watched, state)


@pytest.fixture
def veth() -> Iterator[Veth]:
    need_root("creating network namespaces and veth pairs")
    v = Veth()
    try:
        v.ip("netns", "add", v.ns)
        v.ip("link", "add", v.watched, "type", "veth", "peer", "name", v.peer)
        v.ip("link", "set", v.watched, "netns", v.ns)
        v.ip("link", "set", v.peer, "up")
        v.ip("-n", v.ns, "link", "set", v.watched, "up")
        yield v
    finally:
        subprocess.run(["ip", "link", "del", v.peer], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", v.ns], capture_output=True, timeout=10)


def nic_daemon(make_daemon: Any, v: Veth, **extra: Any) -> Daemon:
    d: Daemon = make_daemon({
        "checks": {**NO_KMSG, "nic": {"enabled": True, "interval": "200ms", "interfaces": [v.watched],
                                      "netns": v.ns, "flap_window": "1m", **extra}},
        "policy": {"codes": {"NIC_DOWN": {"tolerate": {"count": 3, "window": "5m", "persist": "1s"}}}},
    })
    d.start()
    return d


def is_nic(code: str, kind: int | None = None) -> Any:
    return lambda e: e.condition.code == code and (kind is None or e.kind == kind)


def test_veth_down_is_pushed_warning_first_cleared_on_up_critical_when_it_persists(
        make_daemon: Any, veth: Veth) -> None:
    d = nic_daemon(make_daemon, veth)
    comp = f"nic/{veth.watched}"
    w = Watcher(d)
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        veth.set_peer("down")
        ev = w.until(is_nic("NIC_DOWN"), timeout=3)
        assert time.monotonic() - t0 < 1.0
        assert ev.kind == pb.EVENT_KIND_RAISED and ev.condition.component == comp
        assert (ev.condition.severity, ev.condition.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)
        v = d.verdict()
        c = cond(v, "NIC_DOWN", comp)
        assert c is not None and c.source == "nic" and c.evidence["carrier"] == "off", v
        assert (v.severity, c.severity, c.action) == (pb.SEVERITY_WARNING, pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)

        t0 = time.monotonic()
        veth.set_peer("up")
        ev = w.until(is_nic("NIC_DOWN", pb.EVENT_KIND_CLEARED), timeout=3)
        assert time.monotonic() - t0 < 1.0
        assert cond(d.verdict(), "NIC_DOWN") is None

        veth.set_peer("down")  # second loss: still tolerated, until it has lasted `persist` (1s)
        ev = w.until(is_nic("NIC_DOWN", pb.EVENT_KIND_RAISED), timeout=3)
        assert ev.condition.severity == pb.SEVERITY_WARNING
        ev = w.until(is_nic("NIC_DOWN", pb.EVENT_KIND_UPDATED), timeout=4)
        assert ev.condition.severity == pb.SEVERITY_CRITICAL
        v = d.verdict()
        assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT), v
        veth.set_peer("up")
        w.until(is_nic("NIC_DOWN", pb.EVENT_KIND_CLEARED), timeout=3)
        assert d.verdict().severity == pb.SEVERITY_OK
    finally:
        w.close()


def test_veth_flapping_three_times_raises_nic_flapping_and_escalates_nic_down(make_daemon: Any, veth: Veth) -> None:
    d = nic_daemon(make_daemon, veth)
    w = Watcher(d)
    try:
        time.sleep(0.3)
        for _ in range(3):
            veth.set_watched("down")
            time.sleep(0.05)
            veth.set_watched("up")
            time.sleep(0.05)
        ev = w.until(is_nic("NIC_FLAPPING"), timeout=3)
        assert ev.kind == pb.EVENT_KIND_RAISED and ev.condition.component == f"nic/{veth.watched}"
        v = d.wait_for(lambda v: cond(v, "NIC_FLAPPING") is not None and cond(v, "NIC_DOWN") is None)
        c = cond(v, "NIC_FLAPPING")
        assert c is not None and (c.severity, c.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)
        assert int(c.evidence["carrier_changes_in_window"]) >= 6
        assert (v.severity, v.action) == (pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT)
        # The third loss within the window is no longer tolerated.
        events = d.stub().ListEvents(pb.ListEventsRequest(component=f"nic/{veth.watched}"), timeout=5).events
        downs = [e for e in events if e.condition.code == "NIC_DOWN" and e.kind != pb.EVENT_KIND_CLEARED]
        assert [e.condition.severity for e in downs][:2] == [pb.SEVERITY_WARNING] * 2
        assert downs[-1].condition.severity == pb.SEVERITY_CRITICAL
    finally:
        w.close()


def test_veth_dropping_packets_raises_errors_rising(make_daemon: Any, veth: Veth) -> None:
    # Frames bigger than the peer's MTU are dropped by veth and counted as tx_dropped: real drops.
    veth.ip("-n", veth.ns, "link", "set", veth.watched, "mtu", "9000")
    veth.ip("-n", veth.ns, "addr", "add", "10.213.0.2/24", "dev", veth.watched)
    veth.ip("addr", "add", "10.213.0.1/24", "dev", veth.peer)
    d = nic_daemon(make_daemon, veth, drop_rate=5, rate_window="1s")
    send = ("import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
            "for i in range(60):\n s.sendto(b'x'*4000,('10.213.0.1',9)); time.sleep(0.02)\n")
    subprocess.run(["ip", "netns", "exec", veth.ns, sys.executable, "-c", send], check=True, timeout=20)
    v = d.wait_for(lambda v: cond(v, "NIC_ERRORS_RISING") is not None, timeout=5)
    c = cond(v, "NIC_ERRORS_RISING", f"nic/{veth.watched}")
    assert c is not None and (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT), v
    assert int(c.evidence["tx_dropped"]) >= 10 and "drops" in c.evidence


# -- an 8-port InfiniBand node ------------------------------------------------------------------
def test_ib_fixture_faults_raise_the_right_conditions_and_clear(make_daemon: Any, short_tmp: Path) -> None:
    sysfs = short_tmp / "sys"
    shutil.copytree(FIXTURE, sysfs)
    port = sysfs / "class" / "infiniband"
    fast = {"clear_after": "1s"}
    d: Daemon = make_daemon({
        "checks": {**NO_KMSG, "nic": {"enabled": True, "interval": "200ms", "sysfs_root": str(sysfs),
                                      "rate_window": "1s", "expected_ib_rate": "400 Gb/sec", "ib_error_rate": 5,
                                      # past 120 the burst below is over 120/h too: IB_SYMBOL_ERRORS_HIGH for an hour
                                      "ib_thresholds": {"symbol_error": None}}},
        "policy": {"codes": {"IB_RATE_DEGRADED": fast, "IB_LINK_DOWNED": fast, "IB_ERRORS_RISING": fast}},
    })
    d.start()
    w = Watcher(d)

    def p(dev: int, name: str) -> Path:
        return port / f"mlx5_{dev}" / "ports" / "1" / name

    def raised(code: str, dev: int) -> pb.Condition:
        ev = w.until(lambda e: e.condition.code == code and e.kind == pb.EVENT_KIND_RAISED, timeout=4)
        assert ev.condition.component == f"ib/mlx5_{dev}/1"
        c = cond(d.verdict(), code, f"ib/mlx5_{dev}/1")  # as the scheduler reads it
        assert c is not None
        return c

    def cleared(code: str) -> None:
        w.until(lambda e: e.condition.code == code and e.kind == pb.EVENT_KIND_CLEARED, timeout=5)

    try:
        time.sleep(0.5)
        assert [c.code for c in d.verdict().conditions if c.code.startswith("IB_")] == []

        p(2, "state").write_text("1: DOWN\n")
        p(2, "phys_state").write_text("3: Disabled\n")
        c = raised("IB_PORT_DOWN", 2)
        assert (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)  # tolerated at first
        assert c.evidence["state"] == "DOWN"
        p(2, "state").write_text("4: ACTIVE\n")
        p(2, "phys_state").write_text("5: LinkUp\n")
        cleared("IB_PORT_DOWN")

        p(5, "rate").write_text("200 Gb/sec (4X HDR)\n")
        c = raised("IB_RATE_DEGRADED", 5)
        assert (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)
        assert c.evidence["rate_gbps"] == "200"
        p(5, "rate").write_text("400 Gb/sec (4X NDR)\n")
        cleared("IB_RATE_DEGRADED")

        p(1, "counters/link_downed").write_text("1\n")
        c = raised("IB_LINK_DOWNED", 1)
        assert (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)
        cleared("IB_LINK_DOWNED")  # hold-down (1s here) once it stops increasing

        n = 0
        deadline = time.monotonic() + 4
        while cond(d.verdict(), "IB_ERRORS_RISING") is None:
            assert time.monotonic() < deadline, d.log()
            n += 50
            p(7, "counters/symbol_error").write_text(f"{n}\n")
            time.sleep(0.1)
        c = raised("IB_ERRORS_RISING", 7)
        assert (c.severity, c.action) == (pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT)
        assert "symbol_error" in c.evidence
        cleared("IB_ERRORS_RISING")  # stopped rising: the rate falls and the hold-down passes
        assert d.verdict().severity == pb.SEVERITY_OK
    finally:
        w.close()
