"""robustd-slurm's decisions with plain values: the rules, the breaker, the parsers, the state file, one pass.

No Slurm and no daemon here (tests/test_slurm.py runs the real ones): every input is written out,
so each rule is pinned down by the values it sees.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import grpc
import pytest

from robustd.adapters.common.model import CLEARED, RAISED, UPDATED, Cond, Table
from robustd.adapters.common.statefile import LockTimeout
from robustd.adapters.slurm.actor import Actor
from robustd.adapters.slurm.agent import Agent
from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.decide import (
    REASON_MAX,
    Do,
    Health,
    applied,
    assess,
    breaker,
    clean,
    decide,
    self_checked,
)
from robustd.adapters.slurm.jobs import job_failed
from robustd.adapters.slurm.model import FLAP_WINDOW, AgentState, AgentStateFile, DrainRecord, NodeView, SelfCheck
from robustd.adapters.slurm.slurmcli import (
    Completed,
    NodeNotFound,
    Slurm,
    SlurmError,
    parse_node,
    parse_rows,
    parse_state,
)
from robustd.model import Action, Severity

NOW = 1_800_000_000.0
CFG = SlurmConfig()
XID = Cond("gpu/0000:3b:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 12)
DBE = Cond("gpu/0000:1b:00.0", "GPU_ECC_DBE", Severity.CRITICAL, Action.RESET_GPU, 20)
IDLE = NodeView("n1", "IDLE", frozenset(), "", ("gpu",))


def cfg(**kw: Any) -> SlurmConfig:
    return SlurmConfig(**kw)


def health(*conds: Cond, config: SlurmConfig = CFG, boot: str = "b1") -> Health:
    return assess(list(conds), config, max((c.seq for c in conds), default=5), boot)


def drained(reason: str, state: str = "IDLE", *flags: str) -> NodeView:
    return NodeView("n1", state, frozenset(("DRAIN", *flags)), reason, ("gpu",))


def ours(st: AgentState | None = None, mode: str = "drain", boot: str = "b1", at: float = NOW - 600) -> AgentState:
    st = st or AgentState()
    st.drain = DrainRecord(reason="robustd: XID_79 on gpu/0000:3b:00.0 (action REBOOT, seq 12)", mode=mode, seq=12,
                           at=at, boot_id=boot)
    return st


# --- what counts as bad ------------------------------------------------------------------------------


def test_only_critical_conditions_with_a_drain_action_count_worst_first() -> None:
    conds = [Cond("nic/eth0", "NIC_DOWN", Severity.WARNING, Action.HW_INSPECT, 3),
             Cond("gpu/0000:5b:00.0", "XID_13", Severity.CRITICAL, Action.RESTART_JOB, 4),
             Cond("check/kernel", "CHECK_ERROR", Severity.WARNING, Action.NONE, 5), DBE, XID]
    h = assess(conds, CFG, 30, "b1")
    assert h.bad and [c.code for c in h.faults] == ["XID_79", "GPU_ECC_DBE"]  # REBOOT before RESET_GPU
    assert h.newest_fault_seq == 20
    assert not assess(conds[:3], CFG, 30, "b1").bad
    assert not assess(conds, cfg(drain_actions=["HW_INSPECT"]), 30, "b1").bad


def test_actions_are_accepted_with_or_without_their_prefix() -> None:
    assert cfg(drain_actions=["action_reboot", "HW_INSPECT"]).drain_actions == [Action.REBOOT, Action.HW_INSPECT]


# --- draining --------------------------------------------------------------------------------------


def test_a_bad_verdict_drains_a_node_in_service_naming_code_component_action_and_seq() -> None:
    plan, st = decide(CFG, health(XID, DBE), IDLE, AgentState(), NOW)
    assert plan.do is Do.DRAIN and plan.mode == "drain" and not plan.flapping
    assert plan.reason == "robustd: XID_79 on gpu/0000:3b:00.0 (action REBOOT, seq 12) +1 more"
    after = applied(plan, st, health(XID, DBE), NOW)
    assert after.drain == DrainRecord(plan.reason, "drain", 20, NOW, "b1")


def test_on_critical_down_and_reboot_on_choose_the_scontrol_call() -> None:
    assert decide(cfg(on_critical="down"), health(XID), IDLE, AgentState(), NOW)[0].mode == "down"
    plan, _ = decide(cfg(reboot_on=["REBOOT"]), health(XID), IDLE, AgentState(), NOW)
    assert plan.mode == "reboot" and plan.reason.startswith("robustd: reboot for XID_79 on gpu/0000:3b:00.0")
    assert decide(cfg(reboot_on=["REBOOT"]), health(DBE), IDLE, AgentState(), NOW)[0].mode == "drain"


def test_the_prefix_is_configurable() -> None:
    plan, _ = decide(cfg(reason_prefix="RD:"), health(XID), IDLE, AgentState(), NOW)
    assert plan.reason.startswith("RD: XID_79")


def test_a_good_verdict_leaves_a_node_in_service_alone() -> None:
    plan, st = decide(CFG, health(), IDLE, AgentState(), NOW)
    assert plan.do is Do.NOTHING and st.drain is None


@pytest.mark.parametrize("node", [
    drained("ops: replacing a fan"),
    drained(""),  # drained without a reason (NHC leaves these alone too)
    NodeView("n1", "DOWN", frozenset({"NOT_RESPONDING"}), "Not responding", ("gpu",)),
    drained("RobustD: uppercase is not our prefix"),
])
@pytest.mark.parametrize("bad", [True, False])
def test_someone_elses_drain_is_never_touched(node: NodeView, bad: bool) -> None:
    st = AgentState(ok_since=NOW - 9999)
    plan, after = decide(cfg(resume_after="0s"), health(XID) if bad else health(), node, st, NOW)
    assert plan.do is Do.NOTHING


def test_an_operators_drain_cleared_by_hand_is_not_redone_but_a_standing_fault_drains_for_itself() -> None:
    plan, st = decide(CFG, health(), drained("ops: maintenance"), AgentState(), NOW)
    plan, st = decide(CFG, health(), IDLE, st, NOW + 60)  # cleared by hand, verdict OK
    assert plan.do is Do.NOTHING
    _, st = decide(CFG, health(XID), drained("ops: maintenance"), AgentState(), NOW)
    plan, _ = decide(CFG, health(XID), IDLE, st, NOW + 60)  # cleared by hand while robustd's fault stands
    assert plan.do is Do.DRAIN and plan.reason.startswith("robustd: XID_79")


def test_robustds_drain_taken_over_by_someone_else_is_released() -> None:
    plan, st = decide(CFG, health(XID), drained("ops: mine now"), ours(), NOW)
    assert plan.do is Do.NOTHING and st.drain is None and "no longer owns" in plan.note


# --- resuming --------------------------------------------------------------------------------------


def test_resume_only_after_the_hold_down() -> None:
    node = drained("robustd: XID_79 on gpu/0000:3b:00.0 (action REBOOT, seq 12)")
    c = cfg(resume_after="300s")
    plan, st = decide(c, health(), node, ours(), NOW)
    assert plan.do is Do.WAIT and plan.wake_at == NOW + 300 and st.ok_since == NOW
    plan, st = decide(c, health(), node, st, NOW + 299)
    assert plan.do is Do.WAIT
    plan, st = decide(c, health(), node, st, NOW + 300)
    assert plan.do is Do.RESUME
    after = applied(plan, st, health(), NOW + 300)
    assert after.drain is None and after.resumes == [NOW + 300] and after.ok_since is None


def test_a_fault_during_the_hold_down_starts_it_again() -> None:
    node = drained("robustd: XID_79")
    _, st = decide(cfg(resume_after="300s"), health(), node, ours(), NOW)
    plan, st = decide(cfg(resume_after="300s"), health(XID), node, st, NOW + 100)
    assert plan.do is Do.NOTHING and st.ok_since is None
    plan, st = decide(cfg(resume_after="300s"), health(), node, st, NOW + 200)
    assert plan.do is Do.WAIT and plan.wake_at == NOW + 500


def test_a_robustd_drain_is_never_rereasoned_while_the_fault_stands() -> None:
    plan, _ = decide(CFG, health(XID, DBE), drained("robustd: XID_79 on gpu/0000:3b:00.0"), ours(), NOW)
    assert plan.do is Do.NOTHING


def test_a_drain_with_our_prefix_but_no_record_is_adopted_and_resumed() -> None:
    node = drained("robustd: GPU_ECC_DBE on gpu/0000:1b:00.0 (action RESET_GPU, seq 20)")
    plan, st = decide(cfg(resume_after="0s"), health(), node, AgentState(), NOW)
    assert plan.do is Do.RESUME and st.drain is not None and st.drain.mode == "drain" and "taking it" in plan.note


@pytest.mark.parametrize("reason, words", [
    ("robustd: diagnosing after job 42", "the controller's job-level diagnosis"),
    ("robustd: job 42 diagnosis FAIL: pairs: bus bandwidth 0.0007 GB/s", "failed diagnosis"),
    ("robustd: job 42 preflight FAIL: link n1-n2: slow", "failed diagnosis"),
    ("robustd: diagnostic 7f3a FAIL after job 41: eud failed on gpu/index2; triage nccl", "failed diagnosis"),
])
def test_a_diagnosis_drain_or_a_controller_hold_is_not_resumed_on_a_good_verdict(reason: str, words: str) -> None:
    """The live verdict cannot see a slow link the stop-time tests found, and a hold is the controller hook's."""
    node = drained(reason)
    plan, st = decide(cfg(resume_after="0s"), health(), node, AgentState(), NOW)
    assert plan.do is Do.NOTHING and words in plan.note and st.drain is not None and st.drain.reason == reason
    again, st2 = decide(cfg(resume_after="0s"), health(), node, st, NOW + 86400)  # a day later: still held, quietly
    assert again.do is Do.NOTHING and again.note == "" and st2.drain == st.drain
    resumed, st3 = decide(cfg(resume_after="0s"), health(), IDLE, st2, NOW + 86400)  # an operator resumed it
    assert resumed.do is Do.NOTHING and st3.drain is None and "resumed by someone else" in resumed.note
    assert decide(cfg(), health(), drained("robustd: jobless diagnosis FAIL"), AgentState(), NOW)[0].do is Do.WAIT


def test_flapping_the_drain_past_max_resumes_holds_the_node() -> None:
    c = cfg(max_resumes=2, resume_after="0s")
    st = AgentState(resumes=[NOW - 3600, NOW - 60])
    plan, st = decide(c, health(XID), IDLE, st, NOW)
    assert plan.do is Do.DRAIN and plan.flapping
    assert plan.reason.startswith("robustd: flapping: 2 resumes in 24h, held drained; XID_79 on gpu/0000:3b:00.0")
    st = applied(plan, st, health(XID), NOW)
    plan, st = decide(c, health(), drained(plan.reason), st, NOW + 10_000)
    assert plan.do is Do.NOTHING and st.flapping  # the fault is gone; the node stays out


def test_resumes_older_than_24h_do_not_count() -> None:
    c = cfg(max_resumes=2)
    plan, _ = decide(c, health(XID), IDLE, AgentState(resumes=[NOW - FLAP_WINDOW - 1, NOW - 60]), NOW)
    assert plan.do is Do.DRAIN and not plan.flapping


def test_an_adopted_drain_past_max_resumes_gets_the_flapping_reason_instead_of_a_resume() -> None:
    st = AgentState(resumes=[NOW - 100, NOW - 50, NOW - 10])
    plan, _ = decide(cfg(resume_after="0s"), health(), drained("robustd: XID_79 on gpu/x"), st, NOW)
    assert plan.do is Do.SET_REASON and plan.reason.startswith("robustd: flapping: 3 resumes in 24h")


def test_max_resumes_zero_never_resumes() -> None:
    plan, _ = decide(cfg(max_resumes=0, resume_after="0s"), health(), drained("robustd: XID_79"), ours(), NOW)
    assert plan.do is Do.NOTHING and "max_resumes is 0" in plan.note


# --- someone resumed robustd's drain ------------------------------------------------------------------


def test_an_operators_resume_is_respected_until_a_new_fault_event() -> None:
    plan, st = decide(CFG, health(XID), IDLE, ours(), NOW)  # drained by robustd, now in service
    assert plan.do is Do.NOTHING and st.respect_until_seq == 12 and st.drain is None
    assert "respected until a new fault event" in plan.note
    plan, st = decide(CFG, health(XID), IDLE, st, NOW + 60)  # the same fault, later
    assert plan.do is Do.NOTHING
    newer = Cond("gpu/0000:3b:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 31)  # it happened again (UPDATED)
    plan, st = decide(CFG, health(newer), IDLE, st, NOW + 120)
    assert plan.do is Do.DRAIN


def test_a_new_fault_on_another_component_after_an_operators_resume_drains() -> None:
    _, st = decide(CFG, health(XID), IDLE, ours(), NOW)
    again = Cond("gpu/0000:5b:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 40)
    plan, _ = decide(CFG, health(XID, again), IDLE, st, NOW)
    assert plan.do is Do.DRAIN


def test_the_respect_ends_when_the_verdict_is_good_again() -> None:
    _, st = decide(CFG, health(XID), IDLE, ours(), NOW)
    _, st = decide(CFG, health(), IDLE, st, NOW + 1)
    assert st.respect_until_seq == 0


def test_an_operators_resume_of_a_flapping_node_starts_the_count_again() -> None:
    st = ours(AgentState(resumes=[NOW - 10, NOW - 5, NOW - 1]))
    st.flapping = True
    _, st = decide(CFG, health(), IDLE, st, NOW)
    assert st.resumes == [] and not st.flapping


# --- reboot and self-check ------------------------------------------------------------------------


def test_after_robustds_reboot_a_self_check_must_pass_first() -> None:
    c = cfg(reboot_on=["REBOOT"], resume_after="0s")
    node = NodeView("n1", "DOWN", frozenset(), "robustd: reboot for XID_79 : reboot issued : reboot complete")
    st = ours(mode="reboot", boot="b1")
    plan, st = decide(c, health(boot="b1"), NodeView("n1", "DOWN", frozenset({"DRAIN", "REBOOT_ISSUED"}),
                                                      "robustd: reboot for XID_79 : reboot issued"), st, NOW)
    assert plan.do is Do.RESUME and plan.cancel_reboot  # acknowledged before the reboot: cancel it and resume
    st = ours(mode="reboot", boot="b1")
    plan, st = decide(c, health(boot="b2"), node, st, NOW)
    assert plan.do is Do.SELF_CHECK
    plan, st2 = self_checked(c, st, SelfCheck("b2", "PASS", "d-1", NOW))
    assert plan.do is Do.NOTHING
    plan, _ = decide(c, health(boot="b2"), node, st2, NOW)
    assert plan.do is Do.RESUME and not plan.cancel_reboot
    plan, st3 = self_checked(c, st, SelfCheck("b2", "FAIL", "d-2", NOW, "eud failed on gpu/index2"))
    assert plan.do is Do.SET_REASON and plan.reason.startswith("robustd: self-check FAIL after reboot, report d-2")
    st3 = applied(plan, st3, health(boot="b2"), NOW)
    plan, _ = decide(c, health(boot="b2"), drained(plan.reason, "DOWN"), st3, NOW + 9999)
    assert plan.do is Do.NOTHING  # held
    plan, _ = decide(c, health(boot="b2"), node, self_checked(c, st, SelfCheck("b2", "ERROR", "", NOW))[1], NOW)
    assert plan.do is Do.SELF_CHECK  # an ERROR proves nothing: try again


def test_without_resume_check_a_rebooted_node_resumes_after_the_hold_down() -> None:
    c = cfg(reboot_on=["REBOOT"], resume_after="0s", resume_check=None)
    node = NodeView("n1", "DOWN", frozenset(), "robustd: reboot for XID_79 : reboot complete")
    assert decide(c, health(boot="b2"), node, ours(mode="reboot", boot="b1"), NOW)[0].do is Do.RESUME


# --- the circuit breaker ----------------------------------------------------------------------------


def rows(partition: str, size: int, ours_: int, others: int = 0) -> list[tuple[str, str, str]]:
    out = []
    for i in range(size - 1):  # n1, this node, is added by the breaker itself
        reason = "robustd: XID_79" if i < ours_ else ("ops: maintenance" if i < ours_ + others else "")
        out.append((f"m{i}", partition, reason))
    return out


@pytest.mark.parametrize("size, drained_by_robustd, fraction, minimum, suppressed", [
    (1, 0, 0.1, 1, False),  # defaults, a one-node partition: its node may drain
    (10, 0, 0.1, 1, False),
    (10, 1, 0.1, 1, True),  # max(1, floor(1.0)) = 1 already used
    (100, 9, 0.1, 1, False),
    (100, 10, 0.1, 1, True),
    (100, 10, 0.1, 11, False),  # min_drains above the fraction
    (10, 0, 0.0, 0, True),  # fraction 0, min 0: never drain
    (5, 4, 1.0, 0, False),
])
def test_the_breaker_allowance(size: int, drained_by_robustd: int, fraction: float, minimum: int,
                               suppressed: bool) -> None:
    c = cfg(max_drained_fraction=fraction, min_drains=minimum)
    node = NodeView("n1", "IDLE", frozenset(), "", ("gpu",))
    sup = breaker(c, node, rows("gpu", size, drained_by_robustd, others=2), "XID_79 on gpu/x", NOW)
    assert (sup is not None) == suppressed
    if sup:
        assert (sup.partition, sup.drained, sup.size) == ("gpu", drained_by_robustd, size)
        assert sup.text().startswith("SLURM_DRAIN_SUPPRESSED: not draining for XID_79 on gpu/x: partition gpu")


def test_the_breaker_counts_only_robustds_drains_and_not_this_node() -> None:
    node = NodeView("n1", "IDLE", frozenset(), "", ("gpu",))
    r = rows("gpu", 10, 0, others=5) + [("n1", "gpu", "robustd: an old reason")]
    assert breaker(CFG, node, r, "f", NOW) is None


def test_the_breaker_suppresses_when_any_partition_of_the_node_is_at_its_allowance() -> None:
    node = NodeView("n1", "IDLE", frozenset(), "", ("small", "big"))
    r = rows("small", 1, 0) + rows("big", 10, 1)
    sup = breaker(CFG, node, r, "f", NOW)
    assert sup is not None and sup.partition == "big"


# --- reasons and state ------------------------------------------------------------------------------


def test_reasons_are_printable_ascii_without_quotes_and_bounded() -> None:
    text = clean("robustd: \x1b[31m'GPU'\" \u202e" + "x" * 1000)
    assert len(text) == REASON_MAX and text.isascii() and text.isprintable()
    assert not set("'\"\\\x1b") & set(text) and text.endswith("...")
    long = Cond("gpu/" + "z" * 200, "XID_79", Severity.CRITICAL, Action.REBOOT, 1)
    assert len(decide(CFG, health(long), IDLE, AgentState(), NOW)[0].reason) <= REASON_MAX


def test_the_table_applies_each_event_once_in_seq_order() -> None:
    t = Table(seq=10)
    assert t.apply(RAISED, XID, 11)
    assert not t.apply(CLEARED, XID, 11)  # replayed after a reconnect: already in
    assert not t.apply(CLEARED, XID, 9)
    assert t.apply(UPDATED, DBE, 12) and set(t.conditions) == {XID.key, DBE.key}
    assert t.apply(CLEARED, XID, 13) and set(t.conditions) == {DBE.key} and t.seq == 13


def test_the_state_round_trips_through_json() -> None:
    st = ours(AgentState(node="n1", resumes=[NOW - 5], respect_until_seq=7, table=Table(44, "b1", {XID.key: XID})))
    st.self_check = SelfCheck("b1", "PASS", "d-9", NOW)
    again = AgentState.from_json(json.loads(json.dumps(st.to_json())))
    assert again == st
    with pytest.raises(ValueError):
        AgentState.from_json({"version": 99})
    with pytest.raises(ValueError):
        AgentState.from_json({"version": 1, "drain": {"reason": 1}})


def test_the_state_file_is_replaced_atomically_and_a_corrupt_one_set_aside(tmp_path: Path) -> None:
    f = AgentStateFile(str(tmp_path / "sub" / "slurm.json"))
    assert f.read() == AgentState()
    st = ours(AgentState(node="n1"))
    f.write(st)
    assert f.read() == st and sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["slurm.json"]
    (tmp_path / "sub" / "slurm.json").write_text("{half a fi")
    assert f.read() == AgentState()
    assert (tmp_path / "sub" / "slurm.json.corrupt").read_text() == "{half a fi"


def test_the_state_lock_excludes_another_holder_and_times_out(tmp_path: Path) -> None:
    """flock(2) locks belong to an open file, so another open of the lock file stands for another process."""
    import fcntl

    f = AgentStateFile(str(tmp_path / "slurm.json"))
    fd = os.open(f.lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LockTimeout), f.locked(0.3):
            pass
    finally:
        os.close(fd)
    with f.locked(1.0):
        pass


# --- Slurm's words ------------------------------------------------------------------------------------

SHOW_NODE = """NodeName=vm Arch=x86_64 CoresPerSocket=1
   CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=1.06
   AvailableFeatures=(null)
   NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05.8
   RealMemory=1 AllocMem=0 FreeMem=21151 Sockets=2 Boards=1
   State=DOWN*+DRAIN+REBOOT_ISSUED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   NextState=DOWN
   Partitions=test,big
   BootTime=2026-11-30T10:19:38 SlurmdStartTime=2026-11-30T11:35:43
   Reason=robustd: reboot for XID_79 Foo=bar [x] : reboot issued [root@2026-11-30T11:36:23]

"""


def test_parse_scontrol_show_node() -> None:
    n = parse_node(SHOW_NODE, "vm")
    assert n.state == "DOWN" and n.flags == {"NOT_RESPONDING", "DRAIN", "REBOOT_ISSUED"}
    assert n.reason == "robustd: reboot for XID_79 Foo=bar [x] : reboot issued"
    assert n.partitions == ("test", "big") and n.out_of_service and n.reboot_pending
    assert n.addr == "127.0.0.1"  # where the controller's hook dials the node's robustd
    plain = parse_node(SHOW_NODE.replace("State=DOWN*+DRAIN+REBOOT_ISSUED", "State=MIXED")
                       .replace("   Reason=robustd: reboot for XID_79 Foo=bar [x] : reboot issued "
                                "[root@2026-11-30T11:36:23]\n", ""), "vm")
    assert (plain.state, plain.flags, plain.reason, plain.out_of_service) == ("MIXED", frozenset(), "", False)
    with pytest.raises(SlurmError):
        parse_node("NodeName=other State=IDLE\n", "vm")


@pytest.mark.parametrize("text, base, flags", [
    ("IDLE", "IDLE", set()), ("IDLE+DRAIN", "IDLE", {"DRAIN"}), ("ALLOCATED+DRAIN", "ALLOCATED", {"DRAIN"}),
    ("IDLE*", "IDLE", {"NOT_RESPONDING"}), ("MIXED~", "MIXED", set()), ("FUTURE", "FUTURE", set()),
])
def test_parse_state(text: str, base: str, flags: set[str]) -> None:
    assert parse_state(text) == (base, frozenset(flags))


def test_parse_sinfo_rows() -> None:
    text = "vm|test*|none\nfake03|big|robustd: XID_79 | a bar in a reason\ngarbage\n"
    assert parse_rows(text) == [("vm", "test", ""), ("fake03", "big", "robustd: XID_79 | a bar in a reason")]


class FakeRunner:
    """Records argv and answers from a script: (returncode, stdout, stderr) per call, or an exception."""

    def __init__(self, *answers: Any):
        self.answers = list(answers)
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> Completed:
        self.calls.append((list(argv), timeout))
        a = self.answers.pop(0) if self.answers else (0, "", "")
        if isinstance(a, Exception):
            raise a
        return Completed(*a)


def test_the_exact_scontrol_and_sinfo_command_lines() -> None:
    run = FakeRunner()
    s = Slurm("/x/scontrol", "/x/sinfo", timeout=7, run=run)
    s.drain("vm", "robustd: A B")
    s.down("vm", "robustd: C")
    s.reboot("vm", "robustd: reboot for D")
    s.cancel_reboot("vm")
    s.resume("vm")
    s.partition_rows(("test", "big"))
    assert [c[0] for c in run.calls] == [
        ["/x/scontrol", "update", "NodeName=vm", "State=DRAIN", "Reason=robustd: A B"],
        ["/x/scontrol", "update", "NodeName=vm", "State=DOWN", "Reason=robustd: C"],
        ["/x/scontrol", "reboot", "ASAP", "nextstate=DOWN", "reason=robustd: reboot for D", "vm"],
        ["/x/scontrol", "cancel_reboot", "vm"],
        ["/x/scontrol", "update", "NodeName=vm", "State=RESUME"],
        ["/x/sinfo", "--noheader", "--Node", "--partition", "test,big", "--format", "%N|%P|%E"],
    ]
    assert {c[1] for c in run.calls} == {7}


def test_slurm_failures_are_one_line_errors() -> None:
    s = Slurm("scontrol", "sinfo", run=FakeRunner((1, "", "slurm_load_node error: Unable to contact slurm "
                                                           "controller (connect failure)\n"),
                                                  (1, "Node nope not found\n", ""),
                                                  SlurmError("scontrol did not finish within 10s")))
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        s.node("vm")
    with pytest.raises(NodeNotFound, match="set slurm.node_name"):
        s.node("nope")
    with pytest.raises(SlurmError, match="did not finish"):
        s.resume("vm")


def test_a_hung_slurm_command_is_killed_at_its_timeout(tmp_path: Path) -> None:
    hang = tmp_path / "scontrol"
    hang.write_text("#!/bin/sh\nsleep 30\n")
    hang.chmod(0o755)
    import time

    t = time.monotonic()
    with pytest.raises(SlurmError, match="did not finish within 0.5s"):
        Slurm(str(hang), timeout=0.5).resume("vm")
    assert time.monotonic() - t < 5


# --- one pass, with a Slurm that does what it is told -------------------------------------------------


class FakeSlurm:
    def __init__(self, node: NodeView, rows: list[tuple[str, str, str]] | None = None):
        self.current = node
        self.rows = rows or []
        self.calls: list[tuple[str, ...]] = []
        self.fail = ""
        self.taken_meanwhile: NodeView | None = None

    def node(self, name: str) -> NodeView:
        if self.fail == "read":
            raise SlurmError("slurmctld down")
        if self.taken_meanwhile is not None and any(c[0] == "rows" for c in self.calls):
            self.current = self.taken_meanwhile
        return self.current

    def partition_rows(self, partitions: Sequence[str]) -> list[tuple[str, str, str]]:
        self.calls.append(("rows", *partitions))
        return self.rows

    def _write(self, what: str, *args: str) -> None:
        if self.fail == "write":
            raise SlurmError("slurmctld down")
        self.calls.append((what, *args))

    def drain(self, name: str, reason: str) -> None:
        self._write("drain", name, reason)

    def down(self, name: str, reason: str) -> None:
        self._write("down", name, reason)

    def reboot(self, name: str, reason: str) -> None:
        self._write("reboot", name, reason)

    def cancel_reboot(self, name: str) -> None:
        self._write("cancel_reboot", name)

    def resume(self, name: str) -> None:
        self._write("resume", name)


def actor(tmp_path: Path, fake: FakeSlurm, config: SlurmConfig = CFG) -> Actor:
    return Actor(config, fake, AgentStateFile(str(tmp_path / "slurm.json")), "n1", clock=lambda: NOW)  # type: ignore[arg-type]


def test_a_pass_drains_and_records(tmp_path: Path) -> None:
    fake = FakeSlurm(IDLE, rows("gpu", 10, 0))
    a = actor(tmp_path, fake)
    r = a.step(health(XID))
    assert r.acted and fake.calls[-1] == ("drain", "n1", "robustd: XID_79 on gpu/0000:3b:00.0 (action REBOOT, seq 12)")
    assert a.state_file.read().drain is not None


def test_a_pass_never_overwrites_a_reason_set_between_its_read_and_its_write(tmp_path: Path) -> None:
    fake = FakeSlurm(IDLE)
    fake.taken_meanwhile = drained("ops: mine")
    r = actor(tmp_path, fake).step(health(XID))
    assert not r.acted and [c[0] for c in fake.calls] == ["rows"]


def test_a_failed_drain_changes_nothing_and_is_redone_by_the_next_pass(tmp_path: Path) -> None:
    fake = FakeSlurm(IDLE)
    a = actor(tmp_path, fake)
    fake.fail = "write"
    r = a.step(health(XID))
    assert r.error and a.state_file.read().drain is None
    fake.fail = ""
    assert a.step(health(XID)).acted and fake.calls[-1][0] == "drain"


def test_a_suppressed_drain_is_recorded_once_with_its_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "robustd.slurm")
    fake = FakeSlurm(IDLE, rows("gpu", 10, 1))
    a = actor(tmp_path, fake)
    a.step(health(XID))
    a.clock = lambda: NOW + 60
    r = a.step(health(XID))
    assert r.suppressed is not None and not any(c[0] == "drain" for c in fake.calls)
    saved = a.state_file.read().suppressed
    assert saved is not None and saved.since == NOW
    assert caplog.text.count("SLURM_DRAIN_SUPPRESSED") == 1
    a.step(health())
    assert a.state_file.read().suppressed is None and "SLURM_DRAIN_SUPPRESSED cleared" in caplog.text


def test_passes_from_two_threads_drain_once(tmp_path: Path) -> None:
    """The agent and a hook at the same moment: the lock serialises them and the second sees the first's drain."""
    fake = FakeSlurm(IDLE)
    real_drain = fake.drain

    def drain(name: str, reason: str) -> None:
        real_drain(name, reason)
        fake.current = drained(reason)

    fake.drain = drain  # type: ignore[method-assign]
    a1, a2 = actor(tmp_path, fake), actor(tmp_path, fake)
    threads = [threading.Thread(target=a.step, args=(health(XID),)) for a in (a1, a2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [c[0] for c in fake.calls].count("drain") == 1


# --- the epilog's reading of Slurm's environment -----------------------------------------------------


@pytest.mark.parametrize("env, failed", [
    ({"SLURM_JOB_EXIT_CODE": "0"}, False), ({"SLURM_JOB_EXIT_CODE": "768"}, True),
    ({"SLURM_JOB_EXIT_CODE": "9"}, True), ({"SLURM_JOB_EXIT_CODE2": "0:0"}, False),
    ({"SLURM_JOB_EXIT_CODE2": "3:0"}, True), ({"SLURM_JOB_EXIT_CODE2": "0:9"}, True), ({}, None),
    ({"SLURM_JOB_EXIT_CODE2": "x:y"}, None),
])
def test_job_failed(env: dict[str, str], failed: bool | None) -> None:
    assert job_failed(env) is failed


# --- the agent's Watch bookkeeping ------------------------------------------------------------------


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def agent(tmp_path: Path) -> Agent:
    from robustd.adapters.slurm.config import SCHEMA
    from robustd.config import parse_config

    settings = parse_config(f"state_dir: {tmp_path}\nlisten: {{unix: {tmp_path}/none.sock}}\n", "test", SCHEMA)
    return Agent(settings, slurm=FakeSlurm(IDLE))  # type: ignore[arg-type]


def test_out_of_range_means_a_new_snapshot_at_once(tmp_path: Path) -> None:
    import time

    a = agent(tmp_path)
    stream = object()
    a.stream, a.table = stream, Table(seq=50)  # type: ignore[assignment]
    a._handle("error", _RpcError(grpc.StatusCode.OUT_OF_RANGE, "seq 50 is older than the oldest retained"), stream)
    assert a.stream is None and a.table is None and a.next_connect <= time.monotonic()


def test_a_lost_stream_keeps_the_table_and_reconnects_after_a_backoff(tmp_path: Path) -> None:
    import time

    a = agent(tmp_path)
    stream, old = object(), object()
    a.stream, a.table = stream, Table(seq=50)  # type: ignore[assignment]
    a._handle("end", "the daemon closed the stream", old)  # a stream already replaced: ignored
    assert a.stream is stream
    a._handle("error", _RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), stream)
    assert a.stream is None and a.table is not None and a.table.seq == 50 and a.next_connect > time.monotonic()


def test_events_move_the_table_forward_once(tmp_path: Path) -> None:
    from robustd.api.v1 import robustd_pb2 as pb

    a = agent(tmp_path)
    a.table = Table(seq=10)
    ev = pb.Event(seq=11, kind=pb.EVENT_KIND_RAISED, condition=pb.Condition(
        component="gpu/0000:3b:00.0", code="XID_79", severity=pb.SEVERITY_CRITICAL, action=pb.ACTION_REBOOT, seq=11))
    a._handle("event", ev, None)
    a._handle("event", ev, None)
    assert a.table.seq == 11 and list(a.table.conditions.values()) == [Cond(
        "gpu/0000:3b:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 11)]
    assert a._health().bad
