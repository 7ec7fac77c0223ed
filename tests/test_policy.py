"""The policy as a pure function of findings and time: lists in, events out."""

from __future__ import annotations

from robustd.codes import CodeRule, CodeTable, Tolerate
from robustd.model import Action, EventKind, Finding, FindingKind, Severity
from robustd.policy import Policy

TABLE = {
    "XID_79": CodeRule(severity="CRITICAL", action="REBOOT", sticky=True),
    "XID_13": CodeRule(severity="WARNING", action="RESTART_JOB"),
    "XID_48": CodeRule(severity="CRITICAL", action="RESET_GPU"),
    "LINK_DOWN": CodeRule(severity="CRITICAL", action="HW_INSPECT", tolerate=Tolerate(count=3, window="5m")),
    "NIC_DOWN": CodeRule(severity="CRITICAL", action="HW_INSPECT", tolerate=Tolerate(count=3, window="30s"),
                         clear_after="5s"),
    "SXID_*": CodeRule(action="HW_INSPECT"),
    "XID_*": CodeRule(severity="WARNING", action="HW_INSPECT"),
    "SXID_12028": CodeRule(severity="WARNING"),
}
GPU = "gpu/0000:3b:00.0"


def policy(**kw: object) -> Policy:
    return Policy(CodeTable([TABLE]), "boot-a", default_clear_after=60.0, update_interval=1.0, **kw)  # type: ignore[arg-type]


def f(code: str, component: str = GPU, **kw: object) -> Finding:
    return Finding(component=component, code=code, message=f"{code} seen", **kw)  # type: ignore[arg-type]


def test_high_confidence_fault_is_critical_at_once_and_sticky() -> None:
    p = policy()
    [ev] = p.apply([f("XID_79")], "kernel", now=100.0)
    assert ev.kind is EventKind.RAISED
    c = ev.condition
    assert (c.severity, c.action, c.sticky, c.count, c.source) == (Severity.CRITICAL, Action.REBOOT, True, 1, "kernel")
    assert p.tick(now=100.0 + 10 * 86400) == []  # sticky: no hold-down ever clears it


def test_application_xid_is_a_warning_not_an_eviction() -> None:
    [ev] = policy().apply([f("XID_13")], "kernel", now=1.0)
    assert (ev.condition.severity, ev.condition.action) == (Severity.WARNING, Action.RESTART_JOB)


def test_tolerated_fault_stays_warning_until_count_within_window() -> None:
    p = policy()
    nic = "nic/ens1f0np0"
    [e1] = p.apply([f("LINK_DOWN", nic)], "kernel", now=0.0)
    assert e1.condition.severity is Severity.WARNING
    [e2] = p.apply([f("LINK_DOWN", nic)], "kernel", now=100.0)
    assert e2.kind is EventKind.UPDATED and e2.condition.severity is Severity.WARNING and e2.condition.count == 2
    [e3] = p.apply([f("LINK_DOWN", nic)], "kernel", now=200.0)
    assert e3.condition.severity is Severity.CRITICAL and e3.condition.count == 3


def test_tolerate_window_forgets_old_occurrences() -> None:
    p = policy()
    nic = "nic/ib0"
    for t in (0.0, 200.0, 400.0, 600.0):  # never three within 5 minutes
        evs = p.apply([f("LINK_DOWN", nic)], "kernel", now=t)
    assert p.conditions[(nic, "LINK_DOWN")].severity is Severity.WARNING
    assert evs and evs[0].condition.count == 4


def test_tolerated_state_escalates_when_it_persists_past_the_window() -> None:
    p = policy()
    nic = "nic/eth9"
    evs = []
    for t in range(0, 31, 1):
        evs += p.apply([f("NIC_DOWN", nic, kind=FindingKind.STATE)], "nic", now=float(t))
        evs += p.tick(now=float(t))
    assert p.conditions[(nic, "NIC_DOWN")].severity is Severity.CRITICAL
    assert [(e.kind, e.condition.severity) for e in evs] == [(EventKind.RAISED, Severity.WARNING),
                                                              (EventKind.UPDATED, Severity.CRITICAL)]


def test_non_sticky_condition_clears_after_hold_down_without_the_fault() -> None:
    p = policy()
    p.apply([f("XID_13")], "kernel", now=0.0)
    p.apply([f("XID_13")], "kernel", now=50.0)  # seen again: the hold-down restarts
    assert p.tick(now=100.0) == []
    [ev] = p.tick(now=110.0)
    assert ev.kind is EventKind.CLEARED and ev.condition.evidence["cleared_by"] == "hold-down"
    assert p.conditions == {}


def test_repeats_are_coalesced_into_one_update_per_interval() -> None:
    p = policy()
    p.apply([f("XID_13")], "kernel", now=0.0)
    evs = p.apply([f("XID_13")] * 50, "kernel", now=0.5)
    assert evs == []  # within update_interval: counted, not yet published
    [ev] = p.tick(now=1.0)
    assert ev.kind is EventKind.UPDATED and ev.condition.count == 51
    assert p.tick(now=2.0) == []


def test_state_findings_refresh_without_events() -> None:
    p = policy()
    [ev] = p.apply([f("XID_13", kind=FindingKind.STATE)], "poller", now=0.0)
    for t in range(1, 30):
        assert p.apply([f("XID_13", kind=FindingKind.STATE)], "poller", now=float(t)) == []
        assert p.tick(now=float(t)) == []
    assert p.conditions[(GPU, "XID_13")].count == 1


def test_resolved_finding_clears_non_sticky_but_not_sticky() -> None:
    p = policy()
    p.apply([f("LINK_DOWN", "nic/ib0"), f("XID_79")], "kernel", now=0.0)
    [ev] = p.apply([f("LINK_DOWN", "nic/ib0", kind=FindingKind.RESOLVED)], "kernel", now=1.0)
    assert ev.kind is EventKind.CLEARED and ev.condition.evidence["cleared_by"] == "resolved"
    assert p.apply([f("XID_79", kind=FindingKind.RESOLVED)], "kernel", now=2.0) == []
    assert (GPU, "XID_79") in p.conditions


def test_acknowledge_clears_sticky_and_unknown_raises() -> None:
    p = policy()
    p.apply([f("XID_79")], "kernel", now=0.0)
    ev = p.acknowledge(GPU, "XID_79", "replaced the riser", now=5.0)
    assert ev.kind is EventKind.CLEARED
    assert ev.condition.evidence["cleared_by"] == "acknowledge"
    assert ev.condition.evidence["reason"] == "replaced the riser"
    try:
        p.acknowledge(GPU, "XID_79", "again", now=6.0)
    except KeyError:
        pass
    else:
        raise AssertionError("acknowledging a missing condition must raise KeyError")


def test_reboot_clears_conditions_of_earlier_boots_only() -> None:
    p = policy()
    p.apply([f("XID_79")], "kernel", now=0.0)
    p2 = Policy(CodeTable([TABLE]), "boot-b")
    p2.load(p.conditions.values(), now=10.0)
    p2.apply([f("XID_13", "gpu/0000:5e:00.0")], "kernel", now=11.0)
    [ev] = p2.reboot(now=12.0)
    assert ev.condition.code == "XID_79" and ev.condition.evidence["cleared_by"] == "reboot"
    assert list(p2.conditions) == [("gpu/0000:5e:00.0", "XID_13")]


def test_reboot_fixable_fault_back_after_two_reboots_escalates_to_hw_inspect() -> None:
    seen = {"boot-a": 0, "boot-b": 1, "boot-c": 2}
    for boot, earlier in seen.items():
        p = Policy(CodeTable([TABLE]), boot, escalate_after_reboots=2,
                   prior_boots=lambda c, code, b, n=earlier: n)  # type: ignore[misc]
        [ev] = p.apply([f("XID_48")], "kernel", now=0.0)
        expected = Action.HW_INSPECT if earlier >= 2 else Action.RESET_GPU
        assert ev.condition.action is expected, boot
    assert "escalated" in ev.condition.evidence


def test_code_table_layers_wildcards_and_hints() -> None:
    p = policy()
    # Unknown SXid: the wildcard gives the action, the line's hint gives the severity.
    [a] = p.apply([f("SXID_20009", "nvswitch/0000:06:00.0", severity=Severity.CRITICAL)], "kernel", now=0.0)
    assert (a.condition.severity, a.condition.action) == (Severity.CRITICAL, Action.HW_INSPECT)
    # The table names 12028's severity: it wins over the line's "Fatal".
    [b] = p.apply([f("SXID_12028", "nvswitch/0000:06:00.0", severity=Severity.CRITICAL)], "kernel", now=0.0)
    assert b.condition.severity is Severity.WARNING
    # An operator's policy.codes layer overrides the rule file.
    over = Policy(CodeTable([TABLE, {"XID_13": CodeRule(severity="CRITICAL")}]), "boot-a")
    [c] = over.apply([f("XID_13")], "kernel", now=0.0)
    assert (c.condition.severity, c.condition.action) == (Severity.CRITICAL, Action.RESTART_JOB)


def test_hint_beats_wildcard_but_not_exact_entry() -> None:
    # Xid 154 carries its own recovery action in the line; the unknown-Xid wildcard must not hide it.
    [ev] = policy().apply([f("XID_154", severity=Severity.CRITICAL, action=Action.REBOOT)], "kernel", now=0.0)
    assert (ev.condition.severity, ev.condition.action) == (Severity.CRITICAL, Action.REBOOT)
    [ev] = policy().apply([f("XID_999")], "kernel", now=0.0)
    assert (ev.condition.severity, ev.condition.action) == (Severity.WARNING, Action.HW_INSPECT)
    [ev] = policy().apply([f("XID_13", severity=Severity.CRITICAL)], "kernel", now=0.0)
    assert ev.condition.severity is Severity.WARNING


def test_tolerated_state_escalates_after_persist_not_the_whole_window() -> None:
    table = {"NIC_DOWN": CodeRule(severity="CRITICAL", action="HW_INSPECT",
                                  tolerate=Tolerate(count=3, window="5m", persist="10s"))}
    p = Policy(CodeTable([table]), "boot-a")
    [ev] = p.apply([f("NIC_DOWN", "nic/eth0", kind=FindingKind.STATE)], "nic", now=0.0)
    assert ev.condition.severity is Severity.WARNING
    assert p.tick(now=9.0) == []
    [ev] = p.tick(now=10.0)
    assert (ev.kind, ev.condition.severity) == (EventKind.UPDATED, Severity.CRITICAL)
