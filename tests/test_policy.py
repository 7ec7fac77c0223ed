"""The policy as a pure function of findings and time: lists in, events out."""

from __future__ import annotations

from dataclasses import replace

from robustd.boots import BootHistory
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


def test_a_sticky_tolerated_fault_keeps_its_full_severity_after_the_window() -> None:
    """A soft lockup is tolerated once, CRITICAL when it repeats, and sticky: once it repeated the node
    stays CRITICAL until reboot or acknowledgement, however long ago the repeats were."""
    p = Policy(CodeTable([{"SOFT_LOCKUP": CodeRule(severity="CRITICAL", action="REBOOT", sticky=True,
                                                   tolerate=Tolerate(count=2, window="1h"))}]), "boot-a")
    [e1] = p.apply([f("SOFT_LOCKUP", "host")], "kernel", now=0.0)
    assert e1.condition.severity is Severity.WARNING
    [e2] = p.apply([f("SOFT_LOCKUP", "host")], "kernel", now=60.0)
    assert e2.condition.severity is Severity.CRITICAL
    assert p.tick(now=60.0 + 2 * 3600) == []  # the window passed: still CRITICAL, no event
    assert p.conditions[("host", "SOFT_LOCKUP")].severity is Severity.CRITICAL
    restarted = Policy(p.table, "boot-a")  # and after a daemon restart, from the stored condition
    restarted.load(p.conditions.values(), now=8000.0)
    assert restarted.tick(now=8001.0) == []
    p2 = Policy(CodeTable([TABLE]), "boot-a", default_clear_after=3600.0)  # a non-sticky tolerated fault does
    for t in (0.0, 10.0, 20.0):                                             # go back to WARNING: flaps forgotten
        p2.apply([f("LINK_DOWN", "nic/ib1")], "kernel", now=t)
    assert p2.conditions[("nic/ib1", "LINK_DOWN")].severity is Severity.CRITICAL
    [down] = p2.tick(now=20.0 + 301)
    assert down.condition.severity is Severity.WARNING


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


def raised_in(*boots: str, component: str = GPU, code: str = "XID_48") -> BootHistory:
    """What the event log says: a RAISED of (component, code) in each of `boots`."""
    return BootHistory([(component, code, boot, seq) for seq, boot in enumerate(boots, 1)])


def test_reboot_fixable_fault_back_after_two_reboots_escalates_to_hw_inspect() -> None:
    seen = {"boot-a": 0, "boot-b": 1, "boot-c": 2}
    for boot, earlier in seen.items():
        p = Policy(CodeTable([TABLE]), boot, escalate_after_reboots=2,
                   boots=raised_in(*list(seen)[:earlier], boot))  # this boot's own RAISED does not count
        [ev] = p.apply([f("XID_48")], "kernel", now=0.0)
        expected = Action.HW_INSPECT if earlier >= 2 else Action.RESET_GPU
        assert ev.condition.action is expected, boot
    assert "escalated" in ev.condition.evidence


def test_reboot_facts_follow_committed_events_retention_and_a_new_boot_id() -> None:
    p = Policy(CodeTable([TABLE]), "boot-b", escalate_after_reboots=2, boots=raised_in("boot-a"))  # seq 1
    [ev] = p.apply([f("XID_48")], "kernel", now=0.0)
    assert ev.condition.action is Action.RESET_GPU  # one earlier boot
    p.logged([replace(ev, seq=2)])  # the log committed it: boot-b has raised it too
    p.acknowledge(GPU, "XID_48", "reseated", now=1.0)
    [ev] = p.apply([f("XID_48")], "kernel", now=2.0)
    assert ev.condition.action is Action.RESET_GPU  # boot-b is this boot: it does not count
    p.logged([replace(ev, seq=3)])
    p.acknowledge(GPU, "XID_48", "reseated", now=3.0)
    p.reboot(now=4.0, boot_id="boot-c")  # the boot id changes while the policy runs
    [ev] = p.apply([f("XID_48")], "kernel", now=5.0)
    assert ev.condition.action is Action.HW_INSPECT and "seen in 2 earlier boots" in ev.condition.evidence["escalated"]
    p.acknowledge(GPU, "XID_48", "replaced", now=6.0)
    p.pruned(2)  # retention deleted boot-a's RAISED (seq 1) and boot-b's first; boot-b's second (seq 3) stays
    [ev] = p.apply([f("XID_48")], "kernel", now=7.0)
    assert ev.condition.action is Action.RESET_GPU
    p.pruned(3)
    assert p.boots.earlier((GPU, "XID_48"), "boot-c") == 0


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


# -- bounded standing conditions: folding ------------------------------------------------------
def gpus(n: int, start: int = 0) -> list[str]:
    return [f"gpu/0000:{i // 32:02x}:{i % 32:02x}.0" for i in range(start, start + n)]


def test_a_code_past_its_cap_folds_into_one_family_condition_that_counts_what_it_folded() -> None:
    p = policy(max_conditions_per_code=4)
    evs = p.apply([f("XID_13", g) for g in gpus(10)], "kernel", now=0.0)
    own = [c for c in p.conditions.values() if c.component != "gpu/*"]
    assert len(own) == 4 and {c.code for c in own} == {"XID_13"}
    fold = p.conditions[("gpu/*", "XID_13")]
    assert fold.evidence["folded"] == "6"
    assert "6 more gpu components with XID_13" in fold.message and "max_conditions_per_code=4" in fold.message
    assert fold.evidence["examples"].startswith(gpus(1, 4)[0])
    assert (fold.severity, fold.action) == (Severity.WARNING, Action.RESTART_JOB)
    assert [e.kind for e in evs] == [EventKind.RAISED] * 5  # four own conditions and the fold-over
    # The same components again are not counted twice; every folded occurrence still counts.
    p.apply([f("XID_13", g) for g in gpus(6, 4)], "kernel", now=0.5)
    fold = p.conditions[("gpu/*", "XID_13")]
    assert fold.evidence["folded"] == "6" and fold.count == 12
    [ev] = p.tick(now=1.0)  # repeats are coalesced into one UPDATED per interval, like any condition
    assert ev.kind is EventKind.UPDATED and ev.condition.component == "gpu/*"
    # Other codes are unaffected by XID_13's cap.
    [ev] = p.apply([f("XID_48", gpus(1, 9)[0])], "kernel", now=2.0)
    assert ev.kind is EventKind.RAISED and ev.condition.component == gpus(1, 9)[0]


def test_a_component_the_node_has_is_never_folded_however_many_made_up_ones_stand() -> None:
    mine = {"gpu/0000:1b:00.0", "nic/ens1f0np0"}
    p = policy(max_conditions_per_code=64, owned=lambda component: component in mine)
    flood = [f"gpu/00{i:02x}:ee:00.0" for i in range(200)]  # a driver printing made-up bus ids
    p.apply([f("XID_79", g) for g in flood], "kernel", now=0.0)
    assert ("gpu/*", "XID_79") in p.conditions
    [ev] = p.apply([f("XID_79", "gpu/0000:1b:00.0")], "kernel", now=1.0)
    assert (ev.kind, ev.condition.component) == (EventKind.RAISED, "gpu/0000:1b:00.0")  # its own, not gpu/*
    assert (ev.condition.severity, ev.condition.action, ev.condition.sticky) == (Severity.CRITICAL, Action.REBOOT,
                                                                                  True)
    fold = p.conditions[("gpu/*", "XID_79")]
    assert fold.evidence["folded"] == str(200 - 64)  # the real GPU was not counted into it
    # The fold-over names the flood's start and what it names now, newest first.
    assert fold.evidence["examples"].startswith(flood[64]) and fold.evidence["newest"] == ", ".join(flood[:-4:-1])
    assert f"newest {flood[-1]}" in fold.message
    ack = p.acknowledge("gpu/0000:1b:00.0", "XID_79", "replaced", now=2.0)  # by its own name
    assert ack.kind is EventKind.CLEARED and ack.condition.component == "gpu/0000:1b:00.0"


def test_the_nodes_own_components_are_bounded_too() -> None:
    p = policy(max_conditions=10, max_conditions_per_code=4, owned=lambda component: True)
    p.apply([f("XID_13", g) for g in gpus(40)], "kernel", now=0.0)
    ordinary = [c for c in p.conditions.values() if not c.component.endswith("*")]
    assert len(ordinary) == 2 * 10  # exempt from the caps, but never past twice max_conditions
    assert p.conditions[("gpu/*", "XID_13")].evidence["folded"] == "20"


def test_a_fold_over_takes_the_worst_severity_action_and_stickiness_it_folded() -> None:
    p = policy(max_conditions_per_code=1)
    sw = [f"nvswitch/0000:0{i}:00.0" for i in range(4)]
    p.apply([f("SXID_20009", sw[0], severity=Severity.WARNING)], "kernel", now=0.0)
    [ev] = p.apply([f("SXID_20009", sw[1], severity=Severity.WARNING)], "kernel", now=0.0)
    assert (ev.kind, ev.condition.component, ev.condition.severity) == (EventKind.RAISED, "nvswitch/*",
                                                                         Severity.WARNING)
    [ev] = p.apply([f("SXID_20009", sw[2], severity=Severity.CRITICAL)], "kernel", now=0.1)
    assert ev.kind is EventKind.UPDATED  # a worse one is published at once, not coalesced
    assert (ev.condition.severity, ev.condition.action) == (Severity.CRITICAL, Action.HW_INSPECT)
    p.apply([f("SXID_20009", sw[3], severity=Severity.WARNING)], "kernel", now=0.2)
    assert p.conditions[("nvswitch/*", "SXID_20009")].severity is Severity.CRITICAL  # never better while standing
    p.apply([f("XID_79", g) for g in gpus(3)], "kernel", now=0.0)
    fold = p.conditions[("gpu/*", "XID_79")]
    assert fold.sticky and (fold.severity, fold.action) == (Severity.CRITICAL, Action.REBOOT)
    assert p.tick(now=10 * 86400.0) and ("gpu/*", "XID_79") in p.conditions  # sticky: only ack or reboot


def test_the_global_cap_folds_new_codes_and_past_the_fold_overs_one_catch_all_takes_the_rest() -> None:
    p = policy(max_conditions=5, max_foldovers=2)
    findings = [f(f"XID_{1000 + i}", g) for i, g in enumerate(gpus(40))]
    p.apply(findings, "kernel", now=0.0)
    assert len(p.conditions) == 5 + 2 + 1  # max_conditions + max_foldovers + the catch-all, exactly
    folds = {k: c for k, c in p.conditions.items() if k[0] in ("gpu/*", "*")}
    assert set(folds) == {("gpu/*", "XID_1005"), ("gpu/*", "XID_1006"), ("*", "CONDITIONS_OVERFLOW")}
    assert folds[("gpu/*", "XID_1005")].evidence["limit"] == "policy.max_conditions=5"
    catch_all = folds[("*", "CONDITIONS_OVERFLOW")]
    assert catch_all.evidence["folded"] == "33" and "33 components" in catch_all.message
    assert catch_all.evidence["codes"] == "XID_1007, XID_1008, XID_1009, ..."
    # Nothing dropped: own conditions plus everything folded is every component seen.
    assert 5 + sum(int(c.evidence["folded"]) for c in folds.values()) == 40
    # A repeat of a folded fault lands in the same fold-over.
    p.apply([f("XID_1005", gpus(1, 39)[0])], "kernel", now=1.0)
    assert p.conditions[("gpu/*", "XID_1005")].evidence["folded"] == "2"


def test_the_catch_all_counts_distinct_codes_and_its_message_stays_bounded() -> None:
    """Repeats of a code the catch-all already folded do not count again, and its text, however many
    codes and components it names, stays within bounds.MAX_MESSAGE in memory (as GetVerdict sends it)."""
    from robustd import bounds

    p = policy(max_conditions=1, max_foldovers=1)
    long = [f"XID_{1000 + i}" + "9" * 40 for i in range(6)]  # long codes and components make a long text
    components = [f"gpu/{'a' * 100}{i:03d}" for i in range(18)]
    p.apply([f(code, g) for code, g in zip(long * 3, components, strict=True)], "kernel", now=0.0)
    catch_all = p.conditions[("*", "CONDITIONS_OVERFLOW")]
    assert " with 5 codes " in catch_all.message  # XID_1000 and XID_1002..XID_1005; XID_1001 has a fold-over
    assert len(catch_all.message.encode()) <= bounds.MAX_MESSAGE


def test_a_fold_over_clears_by_its_own_hold_down_refreshed_by_each_folded_finding() -> None:
    p = policy(max_conditions_per_code=2)  # XID_13: WARNING, not sticky; hold-down 60 s
    p.apply([f("XID_13", g) for g in gpus(5)], "kernel", now=0.0)
    p.apply([f("XID_13", gpus(1, 4)[0])], "kernel", now=50.0)  # a folded component again
    cleared = p.tick(now=60.0)
    assert sorted(e.condition.component for e in cleared) == gpus(2)  # the own ones, not the fold-over
    assert all(e.condition.evidence["cleared_by"] == "hold-down" for e in cleared)
    assert p.tick(now=100.0) == []
    [ev] = p.tick(now=110.0)
    assert (ev.kind, ev.condition.component, ev.condition.evidence["cleared_by"]) == \
        (EventKind.CLEARED, "gpu/*", "hold-down")
    assert p.conditions == {}
    # With room again, a component that was folded raises its own condition.
    [ev] = p.apply([f("XID_13", gpus(1, 4)[0])], "kernel", now=120.0)
    assert ev.kind is EventKind.RAISED and ev.condition.component == gpus(1, 4)[0]


def test_a_recovered_component_does_not_clear_the_fold_over_it_is_in() -> None:
    p = policy(max_conditions_per_code=1)
    p.apply([f("LINK_DOWN", f"nic/eth{i}") for i in range(3)], "kernel", now=0.0)
    assert p.apply([f("LINK_DOWN", "nic/eth2", kind=FindingKind.RESOLVED)], "kernel", now=1.0) == []
    assert ("nic/*", "LINK_DOWN") in p.conditions


def test_acknowledging_a_fold_over_clears_it_and_frees_its_place() -> None:
    p = policy(max_conditions_per_code=1)
    p.apply([f("XID_79", g) for g in gpus(4)], "kernel", now=0.0)
    ev = p.acknowledge("gpu/*", "XID_79", "replaced the baseboard", now=5.0)
    assert ev.kind is EventKind.CLEARED and ev.condition.evidence["reason"] == "replaced the baseboard"
    assert ev.condition.evidence["folded"] == "3"
    assert list(p.conditions) == [(gpus(1)[0], "XID_79")]
    [ev] = p.apply([f("XID_79", gpus(1, 3)[0])], "kernel", now=6.0)  # folds into a new fold-over, counted afresh
    assert (ev.kind, ev.condition.component, ev.condition.evidence["folded"]) == (EventKind.RAISED, "gpu/*", "1")


def test_tolerate_and_reboot_escalation_keep_working_beside_folding() -> None:
    p = policy(max_conditions_per_code=1, escalate_after_reboots=2, boots=raised_in("boot-x", "boot-y"))
    nic = "nic/ens1"
    p.apply([f("LINK_DOWN", nic)], "kernel", now=0.0)
    p.apply([f("LINK_DOWN", f"nic/other{i}") for i in range(5)], "kernel", now=1.0)  # folded
    p.apply([f("LINK_DOWN", nic)], "kernel", now=2.0)
    assert p.conditions[(nic, "LINK_DOWN")].severity is Severity.WARNING  # 2 of 3: still tolerated
    p.apply([f("LINK_DOWN", nic)], "kernel", now=3.0)
    assert p.conditions[(nic, "LINK_DOWN")].severity is Severity.CRITICAL
    [ev] = p.apply([f("XID_48")], "kernel", now=4.0)
    assert ev.condition.action is Action.HW_INSPECT and "escalated" in ev.condition.evidence


def test_folds_survive_a_restart_and_keep_counting() -> None:
    p = policy(max_conditions_per_code=2)
    p.apply([f("XID_79", g) for g in gpus(5)], "kernel", now=0.0)
    p2 = policy(max_conditions_per_code=2)
    p2.load(p.conditions.values(), now=10.0)
    [ev] = p2.apply([f("XID_79", gpus(1, 7)[0])], "kernel", now=11.0)
    assert ev.kind is EventKind.UPDATED and ev.condition.component == "gpu/*"
    assert ev.condition.evidence["folded"] == "4"
    assert len(p2.conditions) == 3


def test_huge_kernel_text_is_bounded_where_the_condition_is_made() -> None:
    from robustd import bounds

    p = policy()
    evidence = {f"key{i}": "v" * 100_000 for i in range(1000)}
    [ev] = p.apply([Finding(component="gpu/" + "\x00é" * 100_000, code="xid 13\n" * 1000, message="m" * 1_000_000,
                            evidence=evidence)], "kernel" * 100, now=0.0)
    c = ev.condition
    assert len(c.message.encode()) <= bounds.MAX_MESSAGE and c.message.endswith("bytes]")
    assert "[truncated" in c.message
    assert len(c.component) <= bounds.MAX_COMPONENT and c.component.isascii() and c.component.isprintable()
    assert len(c.code) <= bounds.MAX_CODE and " " not in c.code and len(c.source) <= bounds.MAX_SOURCE
    assert len(c.evidence) <= bounds.MAX_EVIDENCE_ENTRIES
    assert sum(len(k) + len(v.encode()) for k, v in c.evidence.items()) <= bounds.MAX_EVIDENCE_BYTES
    assert c.evidence[bounds.TRUNCATED_ENTRIES] == str(1000 - 15)
    # The same huge finding again finds the same (bounded) condition.
    p.apply([Finding(component="gpu/" + "\x00é" * 100_000, code="xid 13\n" * 1000)], "kernel" * 100, now=0.5)
    assert len(p.conditions) == 1 and p.conditions[c.key].count == 2


def test_an_acknowledgement_reason_is_kept_whole_beside_long_kernel_evidence() -> None:
    p = policy()
    p.apply([f("XID_79", evidence={"line": "L" * 2000, "detail": "D" * 2000})], "kernel", now=0.0)
    ev = p.acknowledge(GPU, "XID_79", "é" * 256, now=1.0)
    assert ev.condition.evidence["reason"] == "é" * 256 and ev.condition.evidence["cleared_by"] == "acknowledge"
    assert "[truncated" in ev.condition.evidence["line"]
