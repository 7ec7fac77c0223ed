"""NVML events through the real pynvml on the emulator (each run in a child process, as in
test_nvml_emulator.py): what `robustctl sim` injects reaches the event sets registered when it happens."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from conftest import Daemon, bdf, inject_kmsg, need_root
from test_gpu_check import BUS
from test_nvml_emulator import lib, node, run  # noqa: F401 - fixtures and the child runner

from robustd.api.v1 import robustd_pb2 as pb
from robustd.nvmlemu import state as emu

WATCHED = "n.nvmlEventTypeXidCriticalError | n.nvmlEventTypeDoubleBitEccError | 0x800 | 0x2000 | 0x4000 | 0x8000"


def test_each_event_fault_reaches_a_registered_set_with_the_drivers_fields(lib: str, node: Path) -> None:  # noqa: F811
    got = run(lib, node, f"""
        n.nvmlInit()
        h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
        s = n.nvmlEventSetCreate()
        for x in h:
            n.nvmlDeviceRegisterEvents(x, {WATCHED}, s)
        out = {{"supported": n.nvmlDeviceGetSupportedEventTypes(h[0]), "events": []}}
        t0 = time.monotonic()
        out["idle"] = code(n.nvmlEventSetWait_v2, s, 100)
        out["idle_waited"] = time.monotonic() - t0
        for gpu, fault, value in [(2, "xid", "79"), (3, "ecc-dbe", None), (4, "retirement-failure", None),
                                  (5, "poison", None), (6, "recovery-action", "drain-and-reset"),
                                  (7, "unavailable", None)]:
            edit(lambda st: emu.apply_fault(st, gpu, fault, value=value))
            t0 = time.monotonic()
            d = n.nvmlEventSetWait_v2(s, 2000)
            out["events"].append([n.nvmlDeviceGetIndex(d.device) if gpu != 7 else 7,
                                  n.nvmlDeviceGetPciInfo(d.device).busId if gpu != 7 else "",
                                  d.eventType, d.eventData, d.gpuInstanceId, d.computeInstanceId,
                                  time.monotonic() - t0])
        [field] = n.nvmlDeviceGetFieldValues(h[6], [n.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
        out["recovery"] = [field.nvmlReturn, field.value.uiVal]
        [other] = n.nvmlDeviceGetFieldValues(h[6], [n.NVML_FI_DEV_POWER_INSTANT])
        out["other_field"] = other.nvmlReturn
        out["unavailable_now"] = code(n.nvmlDeviceGetName, h[7])
        out["remap"] = n.nvmlDeviceGetRemappedRows(h[4])
        out["dbe"] = n.nvmlDeviceGetTotalEccErrors(h[3], 1, n.NVML_VOLATILE_ECC)
        n.nvmlEventSetFree(s)
        out["freed"] = code(n.nvmlEventSetWait_v2, s, 10)
        print(json.dumps(out))
    """)
    assert got["supported"] == 0xFE9F  # nvmlEventTypeAll
    assert got["idle"] == 10 and 0.09 <= got["idle_waited"] < 1.0  # NVML_ERROR_TIMEOUT, bounded
    none = 0xFFFFFFFF
    bus = [emu.healthy_gpu(i).bus_id for i in range(8)]
    expected = [[2, bus[2], 0x8, 79], [3, bus[3], 0x2, 0], [4, bus[4], 0x800, 0], [5, bus[5], 0x2000, 0],
                [6, bus[6], 0x8000, 0], [7, "", 0x4000, 0]]
    assert [e[:4] for e in got["events"]] == expected  # eventData is the Xid, 0 for every other type
    assert all(e[4:6] == [none, none] for e in got["events"])  # no MIG instance
    assert max(e[6] for e in got["events"]) < 0.5  # a waiter sees the file change within milliseconds
    assert got["recovery"] == [0, 4] and got["other_field"] == 3  # DRAIN_AND_RESET; NOT_SUPPORTED
    assert got["unavailable_now"] == 15 and got["remap"][3] == 1 and got["dbe"] == 1
    assert got["freed"] == 2  # INVALID_ARGUMENT: a freed set


def test_events_reach_only_sets_registered_when_they_happen_and_clear_drops_undelivered(
        lib: str, node: Path) -> None:  # noqa: F811
    got = run(lib, node, """
        n.nvmlInit()
        h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
        early = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h[1], n.nvmlEventTypeXidCriticalError, early)
        only_dbe = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h[1], n.nvmlEventTypeDoubleBitEccError, only_dbe)
        edit(lambda st: emu.apply_fault(st, 1, "xid", value="13"))
        n.nvmlDeviceGetCount()  # the emulator reads the change: the event is handed to `early` now
        late = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h[1], n.nvmlEventTypeXidCriticalError, late)
        out = {"late": code(n.nvmlEventSetWait_v2, late, 50), "only_dbe": code(n.nvmlEventSetWait_v2, only_dbe, 50),
               "early": n.nvmlEventSetWait_v2(early, 50).eventData}
        # undelivered events are dropped by clear: one already handed to the set, one still in the file
        edit(lambda st: emu.apply_fault(st, 1, "xid", value="31"))
        n.nvmlDeviceGetCount()
        edit(lambda st: emu.apply_fault(st, 1, "xid", value="43"))
        edit(lambda st: emu.clear(st, 1))
        out["after_clear"] = code(n.nvmlEventSetWait_v2, early, 50)
        edit(lambda st: emu.apply_fault(st, 1, "xid", value="79"))
        out["next"] = n.nvmlEventSetWait_v2(early, 1000).eventData
        # a GPU that supports no events: NOT_SUPPORTED, and the set stays usable
        edit(lambda st: emu.set_value(st, 2, "event_types", "0"))
        out["unsupported_mask"] = n.nvmlDeviceGetSupportedEventTypes(h[2])
        out["unsupported"] = code(n.nvmlDeviceRegisterEvents, h[2], n.nvmlEventTypeXidCriticalError, early)
        out["still_usable"] = code(n.nvmlEventSetWait_v2, early, 10)
        print(json.dumps(out))
    """)
    assert got["late"] == 10 and got["only_dbe"] == 10 and got["early"] == 13  # TIMEOUT for the others
    assert got["after_clear"] == 10 and got["next"] == 79
    assert got["unsupported_mask"] == 0 and got["unsupported"] == 3 and got["still_usable"] == 10


def test_a_hung_gpu_blocks_the_event_wait_past_its_timeout(lib: str, node: Path) -> None:  # noqa: F811
    got = run(lib, node, """
        n.nvmlInit()
        s = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(0), n.nvmlEventTypeXidCriticalError, s)
        edit(lambda st: emu.apply_fault(st, 0, "hang"))
        result = {}
        def wait():
            result["ret"] = code(n.nvmlEventSetWait_v2, s, 100)
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        t.join(0.8)
        blocked = t.is_alive()
        edit(lambda st: emu.clear(st, 0))
        t.join(2.0)
        print(json.dumps({"blocked": blocked, "alive": t.is_alive(), **result}))
    """)
    assert got == {"blocked": True, "alive": False, "ret": 10}


def test_sim_event_verbs_and_their_errors(tmp_path: Path) -> None:
    path = str(tmp_path / "nvml.state")
    emu.save(path, emu.healthy_node(2))

    def sim(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "sim", "--state", path, *args],
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)

    started = time.monotonic()
    assert sim("fault", "gpu", "1", "xid", "79").returncode == 0
    took = time.monotonic() - started
    assert sim("fault", "gpu", "0", "recovery-action", "node-reboot").returncode == 0
    assert sim("fault", "gpu", "0", "unavailable").returncode == 0
    st = emu.load(path)
    assert st.event_seq == 3 and st.gpus[1].fault_list == ["xid79"] and st.gpus[0].recovery_action == 2
    assert [e.split(":")[:3] for e in st.gpus[0].events.split(",")] == [["2", "0x8000", "0"], ["3", "0x4000", "0"]]
    assert "lost" in st.gpus[0].fault_list  # an unavailable GPU answers GPU_IS_LOST from then on
    for bad in (["xid"], ["xid", "seventy"], ["recovery-action", "explode"], ["lost", "3"]):
        r = sim("fault", "gpu", "0", *bad)
        assert r.returncode == 64 and r.stderr.startswith("robustctl: sim: "), (bad, r.stderr)
    assert sim("clear", "gpu", "0").returncode == 0
    st = emu.load(path)
    assert (st.gpus[0].events, st.gpus[0].event_floor, st.gpus[0].recovery_action) == ("", 3, 0)
    assert took < 2.0  # tests time faults from sim's invocation: it must start quickly


# -- the policy: one fault seen by the kernel log and by NVML is one occurrence -----------------------
def _tolerating_policy() -> Any:
    from robustd.codes import CodeRule, CodeTable, Tolerate
    from robustd.model import Action, Severity
    from robustd.policy import Policy

    table = {"XID_13": CodeRule(severity=Severity.CRITICAL, action=Action.RESET_GPU,
                                tolerate=Tolerate(count=3, window="60s"))}
    return Policy(CodeTable([table]), "boot-a", default_clear_after=60.0, update_interval=1.0)


def test_two_sources_within_ten_seconds_are_one_occurrence_and_never_a_double_count() -> None:
    from robustd.model import EventKind, Finding, FindingKind, Severity

    def xid(**ev: str) -> list[Finding]:
        return [Finding(component="gpu/0000:3b:00.0", code="XID_13", message="Xid 13", evidence=ev,
                        kind=FindingKind.OCCURRENCE)]

    p = _tolerating_policy()
    [raised] = p.apply(xid(line="NVRM: Xid ..."), "kernel", now=100.0)
    assert raised.kind is EventKind.RAISED and raised.condition.severity is Severity.WARNING
    assert p.apply(xid(source="nvml_event"), "gpu", now=100.004) == []  # the same fault: no event, no count
    c = p.conditions[raised.condition.key]
    assert c.count == 1 and c.evidence["also_seen_by"] == "gpu" and c.evidence["line"] == "NVRM: Xid ..."
    [updated] = p.tick(now=101.5)  # the merged evidence goes out with one coalesced UPDATED
    assert updated.kind is EventKind.UPDATED and updated.condition.count == 1
    # a second real fault, NVML first this time, the kernel line 3 s later: still one more, not two
    [ev] = p.apply(xid(), "gpu", now=105.0)
    assert ev.condition.count == 2 and ev.condition.severity is Severity.WARNING  # tolerate 3: not yet
    assert p.apply(xid(), "kernel", now=108.0) == [] and p.conditions[c.key].count == 2
    # two lines from one source are two faults, however close; past 10 s sources no longer pair
    p.apply(xid(), "kernel", now=108.5)
    assert p.conditions[c.key].count == 3 and p.conditions[c.key].severity is Severity.CRITICAL
    p.apply(xid(), "gpu", now=125.0)
    assert p.conditions[c.key].count == 4
    p.tick(now=200.0)
    assert p._sightings == {}  # pruned once the window has passed


# -- the GPU check's watcher, end to end: a real daemon on the emulator ------------------------------
KINDS = {pb.EVENT_KIND_RAISED: "RAISED", pb.EVENT_KIND_UPDATED: "UPDATED", pb.EVENT_KIND_CLEARED: "CLEARED"}


def gpu_node(make_daemon: Any, root: Path, lib: str, interval: str = "60s", kernel: bool = False,  # noqa: F811
             state: emu.EmulatorState | None = None, codes: dict[str, Any] | None = None,
             timeout: str | None = None, kernel_rules: list[str] | None = None) -> tuple[Daemon, str]:
    """A daemon whose GPU check runs on the emulator. A 60 s poll interval: after the first poll, only the
    event watcher can report within a test's timeouts."""
    path = str(root / "nvml.state")
    emu.save(path, state or emu.healthy_node(8))
    checks: dict[str, Any] = {"gpu": {"enabled": True, "backend": "emulator", "emulator_state": path,
                                      "emulator_library": lib, "interval": interval}}
    if timeout:
        checks["gpu"]["timeout"] = timeout  # the deadline past which a stuck NVML call is NVML_HANG
    checks["kernel"] = ({"enabled": True, "lookback": "0s", "rules": kernel_rules or []} if kernel
                        else {"enabled": False})
    d = make_daemon({"checks": checks, "policy": {"codes": codes or {}}})
    d.start()
    deadline = time.monotonic() + 20
    while not any(c.name == "gpu" and c.runs >= 1 for c in d.stub().ListChecks(pb.ListChecksRequest()).checks):
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)  # the first poll has registered the event set
    return d, path


class WatchStream:
    """A Watch stream read on a thread: (kind, component, code, severity, action, count), as they come."""

    def __init__(self, d: Daemon):
        self.events: list[tuple[str, str, str, int, int, int]] = []
        self._call = d.stub().Watch(pb.WatchRequest(from_seq=0))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for ev in self._call:
                c = ev.condition
                self.events.append((KINDS[ev.kind], c.component, c.code, c.severity, c.action, c.count))
        except grpc.RpcError:
            pass

    def wait(self, kind: str, component: str, code: str, timeout: float = 3.0) -> tuple[str, str, str, int, int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if e[:3] == (kind, component, code):
                    return e
            time.sleep(0.01)
        raise AssertionError(f"no {kind} {code} on {component} within {timeout}s: {self.events}")

    def close(self) -> None:
        self._call.cancel()


def edit(path: str, fn: Any) -> None:
    st = emu.load(path)
    fn(st)
    emu.save(path, st)


def test_each_nvml_event_raises_its_condition_on_the_right_gpu_on_watch_without_a_poll(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    d, path = gpu_node(make_daemon, short_tmp, lib)
    watch = WatchStream(d)
    expected = [(1, "xid", "79", "XID_79", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
                (2, "ecc-dbe", None, "GPU_ECC_DBE", pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU),
                (3, "retirement-failure", None, "GPU_ROW_REMAP_FAILURE", pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT),
                (4, "poison", None, "GPU_FATAL_POISON", pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU),
                (5, "recovery-action", "drain-and-reset", "XID_154", pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU),
                (6, "recovery-action", "node-reboot", "XID_154", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
                (7, "unavailable", None, "GPU_LOST", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT)]
    for gpu, fault, value, code, severity, action in expected:
        started = time.monotonic()
        edit(path, lambda st, g=gpu, f=fault, x=value: emu.apply_fault(st, g, f, value=x))
        got = watch.wait("RAISED", f"gpu/{BUS[gpu]}", code)
        assert got[3:] == (severity, action, 1) and time.monotonic() - started < 2.0, (fault, got)
    # through `robustctl sim` as an integrator would, and back to NONE clears XID_154 as the kernel line does
    assert d.robustctl("sim", "--state", path, "fault", "gpu", "0", "xid", "13").returncode == 0
    assert watch.wait("RAISED", f"gpu/{BUS[0]}", "XID_13")[3:5] == (pb.SEVERITY_WARNING, pb.ACTION_RESTART_JOB)
    edit(path, lambda st: emu.apply_fault(st, 5, "recovery-action", value="none"))
    watch.wait("CLEARED", f"gpu/{BUS[5]}", "XID_154")
    v = d.verdict()
    c = next(c for c in v.conditions if c.code == "XID_79")
    assert c.evidence["source"] == "nvml_event" and c.evidence["emulated"] == "true" and c.evidence["xid"] == "79"
    assert c.source == "gpu"
    watch.close()


def test_a_dbe_the_poll_counted_first_is_not_counted_again_by_its_late_event(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    """The poll can read the volatile DBE count before the event wait returns (on a real driver too): that is
    one error, count 1, no UPDATED (an adapter would take an UPDATED as a new fault). A second error is two."""
    d, path = gpu_node(make_daemon, short_tmp, lib, interval="200ms")
    watch = WatchStream(d)
    comp = f"gpu/{BUS[2]}"

    def counter_only(st: emu.EmulatorState) -> None:  # the counter moves; the driver's event is not sent yet
        st.gpus[2].ecc_dbe_volatile += 1
        st.gpus[2].ecc_dbe_aggregate += 1

    edit(path, counter_only)
    assert watch.wait("RAISED", comp, "GPU_ECC_DBE")[3:] == (pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU, 1)
    edit(path, lambda st: emu.push_event(st, 2, emu.EVENT_DBE))  # the same error's event, late
    time.sleep(1.5)
    assert [e for e in watch.events if e[1:3] == (comp, "GPU_ECC_DBE")] == [
        ("RAISED", comp, "GPU_ECC_DBE", pb.SEVERITY_CRITICAL, pb.ACTION_RESET_GPU, 1)]
    edit(path, lambda st: emu.apply_fault(st, 2, "ecc-dbe"))  # a second error: counter 2 and its event
    got = watch.wait("UPDATED", comp, "GPU_ECC_DBE")
    assert got[5] == 2, watch.events
    time.sleep(1.0)
    assert next(c for c in d.verdict().conditions if c.code == "GPU_ECC_DBE").count == 2
    watch.close()


def test_a_remap_failure_and_a_lost_gpu_the_poll_reported_first_are_not_counted_again_by_their_late_events(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    """As for a DBE: the poll can read the remap-failure flag or find the GPU lost before the driver's event
    is delivered; one fault is count 1 and no UPDATED (an adapter would take it as a new fault and re-drain)."""
    d, path = gpu_node(make_daemon, short_tmp, lib, interval="200ms")
    watch = WatchStream(d)
    remap, lost = f"gpu/{BUS[3]}", f"gpu/{BUS[6]}"

    def state_only(st: emu.EmulatorState) -> None:  # what the poll reads changes; the driver's events come later
        st.gpus[3].remap_failure = 1
        st.gpus[6].faults = ",".join([*st.gpus[6].fault_list, "lost"])

    edit(path, state_only)
    watch.wait("RAISED", remap, "GPU_ROW_REMAP_FAILURE")
    watch.wait("RAISED", lost, "GPU_LOST")
    time.sleep(0.5)  # a few polls more: the state repeats without a count
    edit(path, lambda st: (emu.push_event(st, 3, emu.EVENT_DRAM_RETIREMENT_FAILURE),
                           emu.push_event(st, 6, emu.EVENT_GPU_UNAVAILABLE)))
    time.sleep(1.5)  # the events are in and the coalescing interval has passed
    for comp, code in ((remap, "GPU_ROW_REMAP_FAILURE"), (lost, "GPU_LOST")):
        assert [e[0] for e in watch.events if e[1:3] == (comp, code)] == ["RAISED"], watch.events
        assert next(c for c in d.verdict().conditions if c.code == code and c.component == comp).count == 1
    watch.close()


def test_an_operators_xid_meaning_in_an_extra_kernel_rule_file_holds_for_nvml_events_too(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    """The GPU check borrows the kernel rules' Xid table; it must not put the shipped meanings back over an
    operator's own (checks.kernel.rules), or an Xid from NVML would drain what the site said not to."""
    site = short_tmp / "site-xids.yaml"
    site.write_text("codes:\n  XID_79: {severity: WARNING, action: RESET_GPU}\n")
    d, path = gpu_node(make_daemon, short_tmp, lib, kernel=True, kernel_rules=[str(site)])
    watch = WatchStream(d)
    edit(path, lambda st: emu.apply_fault(st, 1, "xid", value="79"))
    got = watch.wait("RAISED", f"gpu/{BUS[1]}", "XID_79")
    assert got[3:5] == (pb.SEVERITY_WARNING, pb.ACTION_RESET_GPU), got
    watch.close()


def test_an_xid_in_the_kernel_log_and_from_nvml_is_one_condition_one_raised_one_occurrence(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    need_root("writing /dev/kmsg")
    st = emu.healthy_node(2)
    kernel_bdf = bdf()  # dddd:bb:00, unused by any other test's kernel lines
    st.gpus[0].bus_id = f"0000{kernel_bdf.upper()}.0"  # as NVML prints it
    tolerate = {"XID_13": {"tolerate": {"count": 2, "window": "5m"}, "severity": "CRITICAL", "action": "RESET_GPU"}}
    d, path = gpu_node(make_daemon, short_tmp, lib, kernel=True, state=st, codes=tolerate)
    watch = WatchStream(d)
    comp = f"gpu/{kernel_bdf}.0"
    edit(path, lambda s: emu.apply_fault(s, 0, "xid", value="13"))
    inject_kmsg(f"NVRM: Xid (PCI:{kernel_bdf}): 13, pid=42, name=python, Graphics Exception: ESR 0x1")
    watch.wait("RAISED", comp, "XID_13")
    time.sleep(1.5)  # both copies are in; the coalesced UPDATED with both sources' evidence is out
    c = next(c for c in d.verdict().conditions if c.code == "XID_13")
    assert c.component == comp and c.count == 1 and c.severity == pb.SEVERITY_WARNING  # tolerate 2: one fault
    assert {c.source, c.evidence["also_seen_by"]} == {"gpu", "kernel"}
    assert "line" in c.evidence and c.evidence.get("event") == "xid"  # the kernel line's and NVML's evidence
    raised = [e for e in watch.events if e[:3] == ("RAISED", comp, "XID_13")]
    assert len(raised) == 1 and len([e for e in d.verdict().conditions if e.code == "XID_13"]) == 1
    # a second real fault, seen by both: now two occurrences, and tolerate-2 takes it to CRITICAL
    inject_kmsg(f"NVRM: Xid (PCI:{kernel_bdf}): 13, pid=42, name=python, Graphics Exception: ESR 0x1")
    edit(path, lambda s: emu.apply_fault(s, 0, "xid", value="13"))
    v = d.wait_for(lambda v: any(c.code == "XID_13" and c.count == 2 for c in v.conditions))
    time.sleep(0.5)
    c = next(c for c in d.verdict().conditions if c.code == "XID_13")
    assert c.count == 2 and c.severity == pb.SEVERITY_CRITICAL and c.action == pb.ACTION_RESET_GPU, v
    watch.close()


def test_gpus_without_events_are_said_once_in_list_checks_and_stay_polled(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    st = emu.healthy_node(4)
    st.gpus[2].event_types = 0
    d, path = gpu_node(make_daemon, short_tmp, lib, interval="200ms", state=st)
    [gpu] = [c for c in d.stub().ListChecks(pb.ListChecksRequest()).checks if c.name == "gpu"]
    assert gpu.note.startswith("NVML events NOT_SUPPORTED on 1 of 4 GPUs; polling only there")
    assert BUS[2] in gpu.note and gpu.status != pb.CHECK_STATUS_ERROR and gpu.last_error == ""
    assert "NVML events NOT_SUPPORTED" in d.robustctl("--json", "checks").stdout
    edit(path, lambda s: emu.apply_fault(s, 2, "ecc-dbe"))  # no event from GPU 2: the poll still finds it
    d.wait_for(lambda v: any(c.code == "GPU_ECC_DBE" and c.component == f"gpu/{BUS[2]}" for c in v.conditions))
    edit(path, lambda s: emu.apply_fault(s, 1, "xid", value="79"))  # the other GPUs still push
    d.wait_for(lambda v: any(c.code == "XID_79" and c.component == f"gpu/{BUS[1]}" for c in v.conditions))
    assert d.log().count("NOT_SUPPORTED") == 1  # said once, not every poll


def test_a_hung_event_wait_is_nvml_hang_while_the_daemon_answers_and_it_still_stops_within_2s(
        make_daemon: Any, short_tmp: Path, lib: str) -> None:  # noqa: F811
    d, path = gpu_node(make_daemon, short_tmp, lib, timeout="1s")
    edit(path, lambda s: emu.apply_fault(s, 3, "hang"))
    started = time.monotonic()
    v = d.wait_for(lambda v: any(c.code == "NVML_HANG" and c.component == "host" for c in v.conditions),
                   timeout=10)
    c = next(c for c in v.conditions if c.code == "NVML_HANG" and c.component == "host")
    assert c.evidence["call"] == "nvmlEventSetWait_v2" and c.severity == pb.SEVERITY_CRITICAL
    assert time.monotonic() - started < 5.0
    for _ in range(5):  # the daemon keeps answering while the wait is stuck
        assert d.verdict().severity == pb.SEVERITY_CRITICAL
    assert d.proc is not None
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    rc = d.proc.wait(10)
    assert rc == 0 and time.monotonic() - t0 <= 2.0, d.log()
