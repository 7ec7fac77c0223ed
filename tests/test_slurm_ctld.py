"""The controller hooks' decisions (robustd/adapters/slurm/ctld.py) on plain data: which job ends are diagnosed,
which nodes are held, drained and released, and the ownership rules (issue 29); and the hooks themselves
(ctld_hook.py) driven with a fake Slurm and a fake diagnosis. No Slurm, no daemon: the real cluster is
tests/test_slurm_ctld_cluster.py."""

from __future__ import annotations

import pytest

from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.ctld import (
    Finding,
    JobEnd,
    Step,
    TriageSummary,
    findings,
    gate,
    hold_reason,
    holds,
    job_end,
    preflight,
    settle,
)
from robustd.adapters.slurm.model import NodeView
from robustd.adapters.slurm.slurmcli import parse_hostnames
from robustd.fleet.diagnosis import Suspect

CFG = SlurmConfig()
NOW = 1_700_000_000.0
NODES = ("n1", "n2", "n3")


def idle(name: str, part: str = "gpu") -> NodeView:
    return NodeView(name, "IDLE", partitions=(part,))


def held(name: str, job: str = "42", part: str = "gpu") -> NodeView:
    return NodeView(name, "IDLE", frozenset({"DRAIN"}), hold_reason(CFG, job), (part,))


def failed(nodes: tuple[str, ...] = NODES) -> JobEnd:
    return JobEnd("42", True, nodes)


def steps(actions: list) -> dict[str, Step]:
    return {a.node: a.step for a in actions}


def rows(n: int, part: str = "gpu", reason: str = "") -> list[tuple[str, str, str]]:
    return [(f"n{i}", part, reason) for i in range(1, n + 1)]


# --- the environment --------------------------------------------------------------------------------------

def test_the_job_end_reads_the_exit_codes_as_the_node_epilog_and_expands_the_node_list() -> None:
    asked = []

    def expand(text: str) -> list[str]:
        asked.append(text)
        return ["n1", "n2", "n3", "n2"]

    j = job_end({"SLURM_JOB_ID": "42", "SLURM_JOB_EXIT_CODE": "256", "SLURM_JOB_NODELIST": "n[1-3]"}, expand)
    assert j == JobEnd("42", True, NODES) and asked == ["n[1-3]"]
    assert job_end({"SLURM_JOB_EXIT_CODE2": "0:0", "SLURM_JOB_NODELIST": "n1"}, lambda _: ["n1"]).failed is False
    assert job_end({"SLURM_JOB_EXIT_CODE2": "0:9", "SLURM_JOB_NODELIST": "n1"}, lambda _: ["n1"]).failed is True
    j = job_end({}, expand)
    assert j.failed is None and j.nodes == () and j.job == "?" and len(asked) == 1  # nothing to expand


def test_scontrol_show_hostnames_output_is_one_name_a_line() -> None:
    assert parse_hostnames("n1\nn2\n\n n3 \nn2\n") == ["n1", "n2", "n3"]


# --- the gate -------------------------------------------------------------------------------------------

def test_a_failed_multi_node_job_without_triage_is_diagnosed_as_infra_unknown() -> None:
    ok, why = gate(failed(), None)
    assert ok and "infra unknown" in why


@pytest.mark.parametrize("klass", ["user_code", "oom_gpu", "oom_host"])
def test_user_code_and_out_of_memory_are_never_diagnosed(klass: str) -> None:
    ok, why = gate(failed(), TriageSummary(klass, "unknown", "diagnose"))
    assert not ok and klass in why


@pytest.mark.parametrize("infra, nxt, expected", [("likely", "diagnose", True), ("unknown", "diagnose", True),
                                                  ("unlikely", "diagnose", False), ("likely", "restart", False)])
def test_the_triage_verdict_decides_as_in_the_node_epilog(infra: str, nxt: str, expected: bool) -> None:
    ok, why = gate(failed(), TriageSummary("nccl", infra, nxt, source="node n2"))
    assert ok is expected and "triage (node n2) says nccl" in why


def test_single_node_successful_and_unknown_jobs_are_not_the_controllers() -> None:
    assert gate(failed(("n1",)), None) == (False, "job 42 ran on 1 node: the node epilog diagnoses it")
    assert not gate(JobEnd("42", False, NODES), None)[0]
    assert not gate(JobEnd("42", None, NODES), None)[0]
    assert not gate(failed(()), None)[0]


# --- the hold -------------------------------------------------------------------------------------------

def test_nodes_nobody_owns_are_held_with_the_job_in_the_reason() -> None:
    acts = holds(CFG, failed(), {n: idle(n) for n in NODES})
    assert steps(acts) == {n: Step.HOLD for n in NODES}
    assert {a.reason for a in acts} == {"robustd: diagnosing after job 42"}


def test_someone_elses_drain_robustds_own_and_unknown_nodes_are_not_held() -> None:
    views = {"n1": NodeView("n1", "IDLE", frozenset({"DRAIN"}), "operator: cable swap", ("gpu",)),
             "n2": NodeView("n2", "IDLE", frozenset({"DRAIN"}), "robustd: XID_79 on gpu0", ("gpu",)),
             "n3": None,
             "n4": NodeView("n4", "DOWN", frozenset(), "Not responding", ("gpu",)),
             "n5": idle("n5")}
    acts = holds(CFG, failed(("n1", "n2", "n3", "n4", "n5")), views)
    assert steps(acts) == {"n1": Step.LEAVE, "n2": Step.LEAVE, "n3": Step.LEAVE, "n4": Step.LEAVE,
                           "n5": Step.HOLD}
    assert "someone else" in acts[0].note and "operator: cable swap" in acts[0].note


def test_the_prefix_is_the_configured_one() -> None:
    cfg = SlurmConfig(reason_prefix="[rd]")
    assert holds(cfg, failed(("n1", "n2")), {"n1": idle("n1"), "n2": idle("n2")})[0].reason == \
        "[rd] diagnosing after job 42"


# --- after the diagnosis ----------------------------------------------------------------------------------

def test_the_culprit_is_drained_and_the_others_released() -> None:
    found = [Finding("n3", "host", "pairs: slow in every pair (1.2 GB/s against 40 GB/s)")]
    acts = settle(CFG, "42", NODES, "FAIL", found, {n: held(n) for n in NODES}, rows(16), NOW)
    assert steps(acts) == {"n1": Step.RELEASE, "n2": Step.RELEASE, "n3": Step.DRAIN}
    assert acts[2].reason == "robustd: job 42 diagnosis FAIL: pairs: slow in every pair (1.2 GB/s against 40 GB/s)"


def test_a_healthy_diagnosis_releases_every_held_node() -> None:
    acts = settle(CFG, "42", NODES, "PASS", [], {n: held(n) for n in NODES}, rows(3), NOW)
    assert steps(acts) == {n: Step.RELEASE for n in NODES}


@pytest.mark.parametrize("outcome", [None, "ERROR"])
def test_a_diagnosis_that_could_not_run_releases_everything_held(outcome: str | None) -> None:
    found = [Finding("n3", "host", "would be blamed")] if outcome is None else []
    acts = settle(CFG, "42", NODES, outcome, found, {n: held(n) for n in NODES}, rows(3), NOW,
                  why_not="no TLS certificate")
    assert steps(acts) == {n: Step.RELEASE for n in NODES}
    if outcome is None:
        assert "could not run (no TLS certificate)" in acts[0].note


def test_an_unreachable_node_is_released_never_drained_for_it() -> None:
    found = [Finding("n2", "unreachable", "connection refused")]
    acts = settle(CFG, "42", NODES, "ERROR", found, {n: held(n) for n in NODES}, rows(3), NOW)
    assert steps(acts) == {n: Step.RELEASE for n in NODES}
    assert "did not answer" in acts[1].note


def test_a_node_changed_during_the_diagnosis_is_left_as_it_is() -> None:
    views = {"n1": NodeView("n1", "IDLE", frozenset({"DRAIN"}), "operator: taking it", ("gpu",)),
             "n2": idle("n2"),  # someone resumed it
             "n3": held("n3", job="43"),  # another job's hold (shared nodes)
             "n4": None}
    found = [Finding(n, "host", "bad") for n in ("n1", "n2", "n3", "n4")]
    acts = settle(CFG, "42", ("n1", "n2", "n3", "n4"), "FAIL", found, views, rows(40), NOW)
    assert steps(acts) == {n: Step.LEAVE for n in ("n1", "n2", "n3", "n4")}


def test_only_the_nodes_this_hook_held_are_settled() -> None:
    acts = settle(CFG, "42", ("n1", "n2"), "FAIL", [Finding("n3", "host", "bad")],
                  {n: held(n) for n in NODES}, rows(40), NOW)
    assert steps(acts) == {"n1": Step.RELEASE, "n2": Step.RELEASE}


def test_both_ends_of_a_bad_link_are_drained() -> None:
    found = [Finding("n1", "link", "slow pair", ("n2",))]
    acts = settle(CFG, "42", NODES, "FAIL", found, {n: held(n) for n in NODES}, rows(40), NOW)
    assert steps(acts) == {"n1": Step.DRAIN, "n2": Step.DRAIN, "n3": Step.RELEASE}
    assert "link n1-n2" in acts[0].reason


def test_the_breaker_applies_to_the_final_drains_not_to_the_holds() -> None:
    # 10 nodes: allowance max(1, floor(0.1 x 10)) = 1. The three holds carry robustd's prefix but do not count.
    part = rows(10)
    part[:3] = [(n, "gpu", hold_reason(CFG, "42")) for n in NODES]
    found = [Finding("n2", "host", "bad"), Finding("n3", "host", "bad too")]
    acts = settle(CFG, "42", NODES, "FAIL", found, {n: held(n) for n in NODES}, part, NOW)
    assert steps(acts) == {"n1": Step.RELEASE, "n2": Step.DRAIN, "n3": Step.RELEASE}
    assert "SLURM_DRAIN_SUPPRESSED" in acts[2].note
    # A robustd drain elsewhere in the partition already uses the allowance: no drain at all.
    part[5] = ("n6", "gpu", "robustd: XID_79 on gpu0")
    acts = settle(CFG, "42", NODES, "FAIL", found[:1], {n: held(n) for n in NODES}, part, NOW)
    assert steps(acts)["n2"] is Step.RELEASE


def test_suspects_are_mapped_from_the_dialled_targets_to_node_names() -> None:
    node_of = {"10.0.0.1:7070": "n1", "10.0.0.2:7070": "n2"}
    got = findings([Suspect("10.0.0.1:7070", "link", "slow", ("10.0.0.2:7070",)),
                    Suspect("10.0.0.9:7070", "unreachable", "refused")], node_of)
    assert got == [Finding("n1", "link", "slow", ("n2",)), Finding("10.0.0.9:7070", "unreachable", "refused")]
    host = findings([Suspect("10.0.0.2:7070", "host", "bad in both of its pairs: with 10.0.0.1:7070: bus bandwidth "
                                                      "0.0007 GB/s; with 110.0.0.1:7070: 0.0006 GB/s")],
                    {**node_of, "110.0.0.1:7070": "n11"})
    assert host[0].reason == "bad in both of its pairs: with n1: bus bandwidth 0.0007 GB/s; with n11: 0.0006 GB/s"


# --- preflight --------------------------------------------------------------------------------------------

def test_preflight_drains_a_suspect_in_service_and_fails_open_otherwise() -> None:
    views = {n: NodeView(n, "ALLOCATED", partitions=("gpu",)) for n in NODES}
    acts = preflight(CFG, "42", "FAIL", [Finding("n3", "host", "slow")], views, rows(16), NOW)
    assert steps(acts) == {"n3": Step.DRAIN} and acts[0].reason == "robustd: job 42 preflight FAIL: slow"
    assert preflight(CFG, "42", None, [Finding("n3", "host", "slow")], views, rows(16), NOW) == []
    assert preflight(CFG, "42", "PASS", [], views, rows(16), NOW) == []
    views["n3"] = NodeView("n3", "ALLOCATED", frozenset({"DRAIN"}), "operator", ("gpu",))
    assert steps(preflight(CFG, "42", "FAIL", [Finding("n3", "host", "slow")], views, rows(16), NOW)) == \
        {"n3": Step.LEAVE}


# --- the epilog-ctld skeleton with a fake Slurm and a fake diagnosis ---------------------------------------

class FakeSlurm:
    def __init__(self, views: dict[str, NodeView]):
        self.views = dict(views)
        self.calls: list[tuple[str, str]] = []

    def hostnames(self, nodelist: str) -> list[str]:
        return sorted(self.views)

    def node(self, name: str) -> NodeView:
        return self.views[name]

    def partition_rows(self, parts: list[str]) -> list[tuple[str, str, str]]:
        return [(v.name, p, v.reason) for v in self.views.values() for p in v.partitions if p in parts] + \
            [(f"x{i}", "gpu", "") for i in range(20)]

    def drain(self, name: str, reason: str) -> None:
        self.calls.append(("drain", name))
        v = self.views[name]
        self.views[name] = NodeView(name, v.state, v.flags | {"DRAIN"}, reason, v.partitions, v.addr)

    def resume(self, name: str) -> None:
        self.calls.append(("resume", name))
        v = self.views[name]
        self.views[name] = NodeView(name, v.state, v.flags - {"DRAIN"}, "", v.partitions, v.addr)


ALL_UP = lambda _cfg, _targets: {}  # noqa: E731 - every node's robustd answers
ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_EXIT_CODE": "256", "SLURM_JOB_NODELIST": "n[1-3]"}


def test_epilog_ctld_holds_diagnoses_drains_the_culprit_and_releases_the_rest() -> None:
    from robustd.adapters.slurm.ctld_hook import epilog_ctld
    from robustd.fleet.diagnosis import Diagnosis

    slurm = FakeSlurm({n: idle(n) for n in NODES})
    seen = {}

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.update(kw, hosts=[t.host for t in targets],
                    held=sorted(n for n, v in slurm.views.items() if v.reason == hold_reason(CFG, "42")))
        return Diagnosis("r1", [], [], suspects=[Suspect("n3:7070", "host", "slow")])

    assert epilog_ctld(CFG, ENV, slurm, diagnose, now=lambda: NOW, probe=ALL_UP) == 0
    assert seen["hosts"] == ["n1:7070", "n2:7070", "n3:7070"] and seen["held"] == list(NODES)
    assert seen["level"] == "quick" and seen["run_id"] == "slurm-job-42" and seen["slow_fraction"] == 0.5
    assert slurm.views["n3"].reason == "robustd: job 42 diagnosis FAIL: slow"
    assert [slurm.views[n].flags for n in ("n1", "n2")] == [frozenset(), frozenset()]


def test_epilog_ctld_releases_every_hold_when_the_diagnosis_raises_and_leaves_an_operators_node() -> None:
    from robustd.adapters.slurm.ctld_hook import epilog_ctld

    views = {n: idle(n) for n in NODES}
    views["n1"] = NodeView("n1", "IDLE", frozenset({"DRAIN"}), "operator: cable", ("gpu",))
    slurm = FakeSlurm(views)

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        raise ValueError("no daemon")

    assert epilog_ctld(CFG, ENV, slurm, diagnose, probe=ALL_UP) == 0
    assert slurm.calls == [("drain", "n2"), ("drain", "n3"), ("resume", "n2"), ("resume", "n3")]
    assert slurm.views["n1"].reason == "operator: cable"


def test_epilog_ctld_does_nothing_for_user_code_or_a_single_node_job() -> None:
    from robustd.adapters.slurm.ctld_hook import epilog_ctld

    slurm = FakeSlurm({n: idle(n) for n in NODES})
    assert epilog_ctld(CFG, ENV, slurm, None,
                       triage=lambda _j, _t: TriageSummary("user_code", "unlikely", "none"), probe=ALL_UP) == 0
    slurm1 = FakeSlurm({"n1": idle("n1")})
    assert epilog_ctld(CFG, ENV, slurm1, None, probe=ALL_UP) == 0
    assert slurm.calls == slurm1.calls == []


def test_epilog_ctld_dials_each_node_at_its_node_addr_and_gives_the_triage_the_targets() -> None:
    from robustd.adapters.slurm.ctld_hook import epilog_ctld
    from robustd.fleet.diagnosis import Diagnosis

    addrs = {"n1": "10.0.0.1", "n2": "fd00::2", "n3": ""}  # NodeAddr as scontrol shows it; none: the name
    slurm = FakeSlurm({n: NodeView(n, "IDLE", partitions=("gpu",), addr=a) for n, a in addrs.items()})
    seen: dict = {}

    def triage(job, targets):  # noqa: ANN001, ANN202
        seen["triage"] = list(targets)
        return TriageSummary("nccl", "likely", "diagnose")

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        seen["targets"] = [(t.host, t.addr) for t in targets]
        return Diagnosis("r1", [], [], suspects=[Suspect("[fd00::2]:7070", "host", "slow")])

    assert epilog_ctld(CFG, ENV, slurm, diagnose, triage=triage, now=lambda: NOW, probe=ALL_UP) == 0
    assert seen["triage"] == [("n1", "10.0.0.1:7070"), ("n2", "[fd00::2]:7070"), ("n3", "n3:7070")]
    assert seen["targets"] == [("10.0.0.1:7070", "10.0.0.1"), ("[fd00::2]:7070", "fd00::2"), ("n3:7070", "n3")]
    assert slurm.views["n2"].reason == "robustd: job 42 diagnosis FAIL: slow"  # the suspect mapped back to n2
    assert slurm.views["n1"].flags == slurm.views["n3"].flags == frozenset()


def test_epilog_ctld_holds_nothing_when_its_tls_files_cannot_be_read(tmp_path, caplog) -> None:  # noqa: ANN001
    from robustd.adapters.slurm.ctld_hook import epilog_ctld

    cfg = SlurmConfig.model_validate({"ctld": {"tls_ca": str(tmp_path / "ca.pem"), "tls_cert": str(tmp_path / "c.pem"),
                                               "tls_key": str(tmp_path / "c.key")}})
    slurm = FakeSlurm({n: idle(n) for n in NODES})
    with caplog.at_level("INFO", logger="robustd.slurm"):
        assert epilog_ctld(cfg, ENV, slurm, lambda *a, **k: pytest.fail("diagnosed"), probe=ALL_UP) == 0
    assert slurm.calls == []
    assert f"slurm.ctld.tls_ca {tmp_path / 'ca.pem'}: cannot read it" in caplog.text
    assert "holding nothing" in caplog.text


def test_epilog_ctld_stopped_half_way_releases_its_holds() -> None:
    """The budget's alarm (a BaseException) during the diagnosis: the holds are released on the way out."""
    from robustd.adapters.slurm.ctld_hook import epilog_ctld

    class Alarm(BaseException):
        pass

    slurm = FakeSlurm({n: idle(n) for n in NODES})

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        raise Alarm

    with pytest.raises(Alarm):
        epilog_ctld(CFG, ENV, slurm, diagnose, probe=ALL_UP)
    assert slurm.calls == [("drain", n) for n in NODES] + [("resume", n) for n in NODES]
    assert all(v.flags == frozenset() for v in slurm.views.values())


def test_epilog_ctld_gives_the_diagnosis_what_is_left_of_its_timeout() -> None:
    from robustd.adapters.slurm.ctld_hook import epilog_ctld
    from robustd.fleet.diagnosis import Diagnosis

    t = [100.0]
    slurm = FakeSlurm({n: idle(n) for n in NODES})
    seen = {}

    def triage(job, targets):  # noqa: ANN001, ANN202
        t[0] += 40  # the triage took 40 s of the 300
        return None

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.update(kw)
        return Diagnosis("r1", [], [])

    assert epilog_ctld(CFG, ENV, slurm, diagnose, triage=triage, monotonic=lambda: t[0], probe=ALL_UP) == 0
    assert seen["timeout"] == pytest.approx(CFG.ctld.timeout - 40)
    assert [c for c in slurm.calls if c[0] == "resume"] == [("resume", n) for n in NODES]


PCFG = SlurmConfig.model_validate({"ctld": {"preflight": "quick"}})


def test_prolog_ctld_drains_a_suspect_and_asks_slurm_to_requeue_the_job() -> None:
    from robustd.adapters.slurm.ctld_hook import prolog_ctld
    from robustd.fleet.diagnosis import Diagnosis

    slurm = FakeSlurm({n: NodeView(n, "ALLOCATED", partitions=("gpu",)) for n in NODES})
    seen = {}

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.update(kw)
        return Diagnosis("r1", [], [], suspects=[Suspect("n3:7070", "host", "bus bandwidth 0.001 GB/s")])

    assert prolog_ctld(PCFG, ENV, slurm, diagnose, now=lambda: NOW) == 1
    assert seen["level"] == "quick" and seen["timeout"] == 60 and seen["run_id"] == "slurm-job-42-preflight"
    assert slurm.calls == [("drain", "n3")]
    assert slurm.views["n3"].reason == "robustd: job 42 preflight FAIL: bus bandwidth 0.001 GB/s"


@pytest.mark.parametrize("case", ["healthy", "raises", "off", "one node"])
def test_prolog_ctld_lets_the_job_start_unless_it_drained_a_node(case: str) -> None:
    from robustd.adapters.slurm.ctld_hook import prolog_ctld
    from robustd.fleet.diagnosis import Diagnosis

    slurm = FakeSlurm({n: NodeView(n, "ALLOCATED", partitions=("gpu",)) for n in NODES})

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        if case == "raises":
            raise ValueError("cannot read TLS file")
        if case in ("off", "one node"):
            pytest.fail("diagnosed")
        return Diagnosis("r1", [], [])

    cfg = CFG if case == "off" else PCFG
    env = {**ENV, "SLURM_JOB_NODELIST": "n1"} if case == "one node" else ENV
    if case == "one node":
        slurm.hostnames = lambda _list: ["n1"]  # type: ignore[method-assign]
    assert prolog_ctld(cfg, env, slurm, diagnose) == 0
    assert slurm.calls == []


def test_epilog_ctld_leaves_a_node_whose_robustd_does_not_answer_and_holds_nothing_when_too_few_answer(
        caplog) -> None:  # noqa: ANN001
    from robustd.adapters.slurm.ctld_hook import epilog_ctld
    from robustd.fleet.diagnosis import Diagnosis

    slurm = FakeSlurm({n: idle(n) for n in NODES})
    seen = {}

    def diagnose(targets, **kw):  # noqa: ANN001, ANN003, ANN202
        seen["hosts"] = [t.host for t in targets]
        return Diagnosis("r1", [], [])

    assert epilog_ctld(CFG, ENV, slurm, diagnose, probe=lambda _c, _t: {"n3": "connection refused"}) == 0
    assert seen["hosts"] == ["n1:7070", "n2:7070"]
    assert ("drain", "n3") not in slurm.calls and ("resume", "n3") not in slurm.calls
    assert sorted(slurm.calls) == [("drain", "n1"), ("drain", "n2"), ("resume", "n1"), ("resume", "n2")]
    slurm = FakeSlurm({n: idle(n) for n in NODES})
    with caplog.at_level("INFO", logger="robustd.slurm"):
        assert epilog_ctld(CFG, ENV, slurm, lambda *a, **k: pytest.fail("diagnosed"),
                           probe=lambda _c, t: {n: "connection refused" for n, _ in t}) == 0
    assert slurm.calls == []
    assert "0 node(s) whose robustd answers; n1: connection refused" in caplog.text and "holding nothing" in caplog.text
