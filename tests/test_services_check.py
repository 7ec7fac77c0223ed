"""The services check against a real systemd and a real D-Bus system bus: NVIDIA_SERVICE_DOWN raised when a
stand-in NVIDIA unit fails or stops, cleared when it runs again, and nothing raised where the node does not
need the unit.

systemd runs as PID 1 of its own namespaces (tests/systemd_ns.py) on a Debian root with `dbus` added (cached
under build/systemd-root-dbus, beside the root test_systemd_real.py uses). The stand-in units are plain
`sleep infinity` services under the NVIDIA names. robustd runs on the host and reaches the nested system
bus through PID 1's root (`checks.services.bus`), as it would reach /run/dbus/system_bus_socket on a node.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import IN_CI, REPO, Daemon, cond, eventually, need_root
from systemd_ns import NestedError, NestedSystemd, ensure_root, workdir

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.root

BUILD = REPO / "build"
ROOT = BUILD / "systemd-root-dbus"
STANDIN = """[Unit]
Description=robustd test stand-in for {name}
[Service]
Type=simple
ExecStart=/bin/sleep infinity
Restart=no
[Install]
WantedBy=multi-user.target
"""
UNITS = ("nvidia-fabricmanager", "nvidia-persistenced", "nvidia-imex")
CODE = "NVIDIA_SERVICE_DOWN"


@pytest.fixture(scope="module")
def ns() -> Iterator[NestedSystemd]:
    need_root("running systemd in its own namespaces")
    if importlib.util.find_spec("jeepney") is None:
        (pytest.fail if IN_CI else pytest.skip)("jeepney (requirements.txt) is not installed")
    for tool in ("debootstrap", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            (pytest.fail if IN_CI else pytest.skip)(f"{tool} is not installed")
    try:
        took = ensure_root(ROOT, ("dbus",))
    except NestedError as e:
        pytest.fail(str(e))
    print(f"debootstrap: {took:.1f}s" if took else "debootstrap: cached root")
    box = NestedSystemd(ROOT, workdir(BUILD / "systemd-runs"))
    try:
        print(f"boot: {box.start():.1f}s")
        for name in UNITS:
            box.path(f"/etc/systemd/system/{name}.service").write_text(STANDIN.format(name=name))
        box.run("systemctl", "daemon-reload")
        box.run("systemctl", "start", "dbus.service", *UNITS)
        yield box
    finally:
        print(f"poweroff: {box.stop():.1f}s")
        shutil.rmtree(box.workdir, ignore_errors=True)


def node(tmp: Path, nvswitch: bool, imex_nodes: str) -> dict[str, Path]:
    """A sysfs with (or without) an NVSwitch on its PCI bus, and an IMEX nodes config with `imex_nodes`."""
    dev = tmp / "sys" / "bus" / "pci" / "devices"
    gpu = dev / "0000:18:00.0"
    gpu.mkdir(parents=True)
    (gpu / "vendor").write_text("0x10de\n")
    (gpu / "class").write_text("0x030200\n")
    if nvswitch:
        sw = dev / "0000:07:00.0"
        sw.mkdir()
        (sw / "vendor").write_text("0x10de\n")
        (sw / "class").write_text("0x068000\n")
    cfg = tmp / "nodes_config.cfg"
    cfg.write_text(imex_nodes)
    return {"sys": tmp / "sys", "imex": cfg}


def start(make_daemon: Any, box: NestedSystemd, paths: dict[str, Path], **services: Any) -> Daemon:
    bus = f"unix:path={box.path('/run/dbus/system_bus_socket')}"
    d = make_daemon({"roots": {"sys": str(paths["sys"])},
                     "checks": {"kernel": {"enabled": False},
                                "services": {"enabled": True, "interval": "1s", "bus": bus,
                                             "imex_nodes_config": str(paths["imex"]), **services}}})
    d.start()
    return d


def check_info(d: Daemon) -> pb.CheckInfo:
    with d.channel() as ch:
        checks = pb_grpc.NodeHealthStub(ch).ListChecks(pb.ListChecksRequest(), timeout=5).checks
    return next(c for c in checks if c.name == "services")


def watching(d: Daemon) -> None:
    """Until the check polled once; it must not have failed (the daemon answers only after every watch's start
    returned, so the units are subscribed by then)."""
    info = eventually(lambda: (i := check_info(d)).runs >= 1 and i, 10, "the services check running",
                      detail=lambda: f"{check_info(d)}\n{d.log()}")
    assert info.status == pb.CHECK_STATUS_OK and not info.last_error and not info.failures, f"{info}\n{d.log()}"


def test_a_failed_or_stopped_unit_is_raised_with_its_result_and_cleared_when_it_runs_again(
        make_daemon: Any, ns: NestedSystemd, short_tmp: Path) -> None:
    ns.run("systemctl", "enable", "nvidia-persistenced.service")
    ns.run("systemctl", "start", *UNITS)
    d = start(make_daemon, ns, node(short_tmp, nvswitch=True, imex_nodes="10.0.0.1\n10.0.0.2\n"))
    watching(d)
    time.sleep(0.3)  # a healthy node: nothing raised while every unit runs
    assert not d.verdict().conditions, d.verdict()
    # An operator's restart passes through inactive with its job queued: no blip (CRITICAL would drain the node).
    ns.run("systemctl", "restart", "nvidia-fabricmanager.service")
    time.sleep(0.3)
    assert "RAISED" not in d.log() and not d.verdict().conditions, d.log()

    # The fabric manager dies by SIGKILL: failed, Result "signal"; CRITICAL, pushed (no poll to wait for).
    t = time.monotonic()
    ns.run("systemctl", "kill", "--signal=KILL", "nvidia-fabricmanager.service")
    v = d.wait_for(lambda v: cond(v, CODE, "host/nvidia-fabricmanager") is not None, timeout=5)
    print(f"fabricmanager failure seen after {time.monotonic() - t:.2f}s")
    c = cond(v, CODE, "host/nvidia-fabricmanager")
    assert c is not None and c.severity == pb.SEVERITY_CRITICAL and c.action == pb.ACTION_REBOOT, c
    assert c.evidence["active_state"] == "failed" and c.evidence["result"] == "signal", c.evidence
    assert "result signal" in c.message and "NVSwitch" in c.evidence["watched_because"], c
    assert v.severity == pb.SEVERITY_CRITICAL

    # persistenced stopped by hand: inactive, Result "success"; WARNING beside it.
    ns.run("systemctl", "stop", "nvidia-persistenced.service")
    v = d.wait_for(lambda v: cond(v, CODE, "host/nvidia-persistenced") is not None, timeout=5)
    c = cond(v, CODE, "host/nvidia-persistenced")
    assert c is not None and c.severity == pb.SEVERITY_WARNING and c.evidence["active_state"] == "inactive", c
    assert c.evidence["result"] == "success"

    # imex ends on SIGTERM (a clean exit to systemd: inactive), its domain configured: CRITICAL.
    ns.run("systemctl", "kill", "--signal=TERM", "nvidia-imex.service")
    v = d.wait_for(lambda v: cond(v, CODE, "host/nvidia-imex") is not None, timeout=5)
    c = cond(v, CODE, "host/nvidia-imex")
    assert c is not None and c.severity == pb.SEVERITY_CRITICAL, c

    # Held past polls (they re-report from memory), then cleared by the units running again.
    time.sleep(1.5)
    assert len([c for c in d.verdict().conditions if c.code == CODE]) == 3
    ns.run("systemctl", "start", *UNITS)
    d.wait_for(lambda v: not [c for c in v.conditions if c.code == CODE], timeout=5)
    assert not check_info(d).failures


def test_a_node_that_does_not_need_the_units_raises_nothing(make_daemon: Any, ns: NestedSystemd,
                                                            short_tmp: Path) -> None:
    # No NVSwitch, an IMEX nodes config with only a comment, persistenced disabled: every unit down, nothing said.
    ns.run("systemctl", "disable", "nvidia-persistenced.service")
    ns.run("systemctl", "stop", *UNITS)
    try:
        d = start(make_daemon, ns, node(short_tmp, nvswitch=False, imex_nodes="# no domain here\n\n"))
        watching(d)
        assert "nvidia-persistenced.service is disabled: not watched" in check_info(d).note
        time.sleep(1.5)  # a poll included
        assert not d.verdict().conditions, d.verdict()
        d.stop()

        # Forced on (`always`), a unit that is not installed still raises nothing; an installed one does.
        ns.path("/etc/systemd/system/nvidia-imex.service").unlink()
        ns.run("systemctl", "daemon-reload")
        d = start(make_daemon, ns, node(short_tmp / "b", nvswitch=False, imex_nodes=""),
                  fabricmanager="always", imex="always", persistenced="never")
        watching(d)
        assert "nvidia-imex.service not installed (not-found)" in check_info(d).note, check_info(d)
        v = d.wait_for(lambda v: cond(v, CODE, "host/nvidia-fabricmanager") is not None, timeout=5)
        assert [c.component for c in v.conditions] == ["host/nvidia-fabricmanager"], v
    finally:
        ns.path("/etc/systemd/system/nvidia-imex.service").write_text(STANDIN.format(name="nvidia-imex"))
        ns.run("systemctl", "daemon-reload")


def test_a_restarted_system_bus_is_reconnected_and_the_units_read_anew(make_daemon: Any, ns: NestedSystemd,
                                                                       short_tmp: Path) -> None:
    ns.run("systemctl", "start", *UNITS)
    d = start(make_daemon, ns, node(short_tmp, nvswitch=True, imex_nodes=""), persistenced="never")
    watching(d)
    ns.run("systemctl", "restart", "dbus.service")
    eventually(lambda: check_info(d).failures >= 1, 5, "the lost bus connection seen as a watch failure",
               detail=lambda: f"{check_info(d)}\n{d.log()}")
    # The unit fails while the watch is down: the runner starts it again (within 5 s), which reads every unit anew.
    ns.run("systemctl", "kill", "--signal=KILL", "nvidia-fabricmanager.service")
    v = d.wait_for(lambda v: cond(v, CODE, "host/nvidia-fabricmanager") is not None, timeout=10)
    assert cond(v, CODE, "host/nvidia-fabricmanager").evidence["result"] == "signal"  # type: ignore[union-attr]
    ns.run("systemctl", "start", "nvidia-fabricmanager.service")  # and pushed again after the reconnect
    d.wait_for(lambda v: cond(v, CODE, "host/nvidia-fabricmanager") is None, timeout=5)


def test_a_crash_looping_unit_is_down_between_its_restarts(make_daemon: Any, ns: NestedSystemd,
                                                           short_tmp: Path) -> None:
    """Restart=always hides a dead service behind `activating (auto-restart)`: that is down too, with the exit."""
    drop_in = ns.path("/etc/systemd/system/nvidia-persistenced.service.d/crash.conf")
    drop_in.parent.mkdir(exist_ok=True)
    ns.run("systemctl", "enable", "nvidia-persistenced.service")
    ns.run("systemctl", "start", *UNITS)
    d = start(make_daemon, ns, node(short_tmp, nvswitch=False, imex_nodes=""))
    watching(d)
    try:
        drop_in.write_text("[Service]\nExecStart=\nExecStart=/bin/sh -c 'exit 3'\nRestart=always\nRestartSec=30s\n")
        ns.run("systemctl", "daemon-reload")
        ns.run("systemctl", "restart", "nvidia-persistenced.service")
        # systemd passes through failed on its way to auto-restart: the condition's evidence follows it there.
        v = d.wait_for(lambda v: (c := cond(v, CODE, "host/nvidia-persistenced")) is not None
                       and c.evidence["sub_state"] == "auto-restart", timeout=5)
        c = cond(v, CODE, "host/nvidia-persistenced")
        assert c is not None and c.severity == pb.SEVERITY_WARNING and c.evidence["active_state"] == "activating", c
        assert c.evidence["result"] == "exit-code" and c.evidence["exec_main_status"] == "3", c.evidence
    finally:
        drop_in.unlink(missing_ok=True)
        ns.run("systemctl", "daemon-reload")
        ns.run("systemctl", "restart", "nvidia-persistenced.service")
    d.wait_for(lambda v: cond(v, CODE, "host/nvidia-persistenced") is None, timeout=5)


def test_a_host_without_a_system_bus_has_the_check_unsupported_and_raises_nothing(make_daemon: Any,
                                                                                   short_tmp: Path) -> None:
    if importlib.util.find_spec("jeepney") is None:
        (pytest.fail if IN_CI else pytest.skip)("jeepney (requirements.txt) is not installed")
    paths = node(short_tmp, nvswitch=True, imex_nodes="10.0.0.1\n")
    d = make_daemon({"roots": {"sys": str(paths["sys"])},
                     "checks": {"kernel": {"enabled": False},
                                "services": {"enabled": True, "bus": f"unix:path={short_tmp}/no-bus",
                                             "imex_nodes_config": str(paths["imex"])}}})
    d.start()
    info = check_info(d)
    assert info.status == pb.CHECK_STATUS_UNSUPPORTED and "no D-Bus system bus at" in info.last_error + info.note, info
    assert not d.verdict().conditions
