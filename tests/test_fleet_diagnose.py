"""`robustctl fleet diagnose` / robustd.fleet.diagnose: the ring's rounds and the judging on plain data, then
real daemons on this machine (Unix sockets, every collective on 127.0.0.1, gloo on CPU).

The network-namespace cases (a rate-limited link, a link down, a link slow between two hosts) are in
tests/test_fleet_diagnose_netns.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from conftest import REPO, Daemon, eventually
from netns_fabric import TEST_SLOW_FRACTION

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.fleet.diagnosis import (
    EXIT_INCOMPLETE,
    Diagnosis,
    HostRecord,
    PhaseRecord,
    Result,
    RunOutcome,
    Suspect,
    judge_inter,
    judge_local,
    pair_result,
)
from robustd.fleet.rings import (
    MAX_RETESTS,
    PairResult,
    judge_pairs,
    reference_bandwidth,
    ring_pairs,
    ring_rounds,
    slow_pairs,
)

KEYS = {"outcome", "suspects", "hosts", "phases", "seconds"}
HOST_KEYS = {"host", "addr", "local", "inter", "pairs", "busbw_gbps", "reports"}

# ---- the ring ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(2, 8))
def test_ring_rounds_cover_every_host_twice_in_at_most_three_rounds(n: int) -> None:
    rounds = ring_rounds(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == sorted(ring_pairs(n))
    assert len(rounds) == (1 if n == 2 else 2 if n % 2 == 0 else 3)
    for h in range(n):
        assert sum(h in p for p in pairs) == min(2, n - 1), (n, h, rounds)
    for r in rounds:
        hosts = [h for p in r for h in p]
        assert len(hosts) == len(set(hosts)), (n, r)  # no host twice in a round: its pairs run at once
    for a, b in pairs:
        assert (b - a) % n in (1, n - 1)  # ring neighbours only
    assert ring_rounds(1) == [] and ring_pairs(1) == []


def good(a: int, b: int, gbps: float = 1.0) -> PairResult:
    return PairResult((a, b), busbw_gbps=gbps)


def ring(n: int, gbps: dict[tuple[int, int], float] | None = None,
         bad: dict[tuple[int, int], str] | None = None) -> list[PairResult]:
    out = []
    for p in ring_pairs(n):
        if bad and p in bad:
            out.append(PairResult(p, bad=True, why=bad[p]))
        else:
            out.append(good(*p, (gbps or {}).get(p, 1.0)))
    return out


@pytest.mark.parametrize("n,slow", [(3, 1), (4, 2), (5, 0), (6, 3), (7, 6)])
def test_a_slow_host_is_the_suspect_against_the_median(n: int, slow: int) -> None:
    slow_pairs = {p: 0.01 for p in ring_pairs(n) if slow in p}
    j = judge_pairs(n, ring(n, slow_pairs), 0.5)
    assert [(s.kind, s.hosts) for s in j.suspects] == [("host", (slow,))]
    assert sorted(j.suspects[0].peers) == sorted({(slow - 1) % n, (slow + 1) % n})
    assert "bus bandwidth 0.01 GB/s, below 0.5 of the median 1 GB/s" in j.suspects[0].reason
    assert j.median_gbps == 1.0 and not j.inconclusive


def test_three_hosts_the_median_is_not_the_slow_hosts_own() -> None:
    # A slow host is in two of three pairs: the plain median of the pairs would be its own bandwidth.
    results = ring(3, {(0, 1): 0.1, (1, 2): 0.1})
    assert reference_bandwidth(results) == 1.0
    assert [s.hosts for s in judge_pairs(3, results, 0.5).suspects] == [(1,)]


def test_fail_slow_is_found_above_any_absolute_floor() -> None:
    # 40 GB/s is plenty by any floor, but 0.4 of its peers': the machine that slows the job down.
    results = ring(4, {(0, 1): 100.0, (1, 2): 40.0, (2, 3): 40.0, (3, 0): 100.0})
    j = judge_pairs(4, results, 0.5)
    assert [(s.kind, s.hosts) for s in j.suspects] == [("host", (2,))]
    assert not judge_pairs(4, results, 0.3).suspects  # --slow-fraction 0.3: 40 of 100 is fine


@pytest.mark.parametrize("n", [3, 4, 5])
def test_a_pair_slow_only_between_two_hosts_is_a_link(n: int) -> None:
    j = judge_pairs(n, ring(n, {(1, 2): 0.02}), 0.5, {h: f"h{h}" for h in range(n)})
    assert [(s.kind, s.hosts, s.peers) for s in j.suspects] == [("link", (1, 2), (2,))]
    assert "h1 and h2" in j.suspects[0].reason and "good with their other neighbour" in j.suspects[0].reason


def test_two_hosts_a_bad_pair_is_a_link_naming_both() -> None:
    j = judge_pairs(2, [PairResult((0, 1), bad=True, why="node rank 1 sent wrong bytes")], 0.5)
    assert [(s.kind, s.hosts) for s in j.suspects] == [("link", (0, 1))]
    assert "nothing can tell" in j.suspects[0].reason
    assert not judge_pairs(2, [good(0, 1, 0.001)], 0.5).suspects  # one pair is its own median: never slow


def test_a_host_failing_both_pairs_is_named_and_its_pairs_are_no_links() -> None:
    j = judge_pairs(5, ring(5, bad={(2, 3): "hung", (3, 4): "never joined"}), 0.5)
    assert [(s.kind, s.hosts) for s in j.suspects] == [("host", (3,))]
    assert j.verdicts[(2, 3)] == j.verdicts[(3, 4)] == "FAIL" and j.verdicts[(0, 1)] == "PASS"


def test_every_pair_bad_names_nobody() -> None:
    j = judge_pairs(4, ring(4, bad={p: "hung" for p in ring_pairs(4)}), 0.5)
    assert not j.suspects and "every pair that ran was bad" in j.inconclusive


def test_a_pair_slow_in_its_round_but_not_alone_is_nobodys_fault() -> None:
    # Measured on the 2-core CI machine: a healthy pair at 0.03 GB/s while the others ran at 0.3-0.5.
    results = ring(4, {(0, 1): 0.03, (1, 2): 0.4, (2, 3): 0.3, (3, 0): 0.5})
    assert slow_pairs(4, results, 0.5) == [(0, 1)]
    assert [s.kind for s in judge_pairs(4, results, 0.5).suspects] == ["link"]  # without the re-test: wrong
    j = judge_pairs(4, results, 0.5, alone={(0, 1): good(0, 1, 0.45)})
    assert not j.suspects and set(j.verdicts.values()) == {"PASS"}
    assert j.busbw_gbps[(0, 1)] == 0.45  # the better of its two figures
    assert j.median_gbps == reference_bandwidth(results)  # the rounds' reference: one sharing for all


def test_a_slow_host_stays_slow_alone_and_its_reason_gives_both_figures() -> None:
    results = ring(4, {(1, 2): 0.0007, (2, 3): 0.0006})
    assert slow_pairs(4, results, 0.5) == [(2, 3), (1, 2)]  # slowest first
    j = judge_pairs(4, results, 0.5, {h: f"h{h}" for h in range(4)},
                    alone={(1, 2): good(1, 2, 0.0009), (2, 3): PairResult((2, 3), untested=True, why="busy")})
    assert [(s.kind, s.hosts) for s in j.suspects] == [("host", (2,))]
    reason = j.suspects[0].reason
    assert "0.0007 GB/s, 0.0009 GB/s re-tested alone, below 0.5 of the median 1 GB/s" in reason
    assert "with h3: bus bandwidth 0.0006 GB/s, below" in reason  # a re-test that could not run: the round's
    # A re-test that fails is evidence like any failure.
    j = judge_pairs(4, results, 0.5, alone={(1, 2): PairResult((1, 2), bad=True, why="h2 hung")})
    assert "re-tested alone: h2 hung" in j.reasons[(1, 2)]


def test_only_clean_slow_pairs_are_re_tested_and_at_most_a_few() -> None:
    assert slow_pairs(2, [good(0, 1, 0.001)], 0.5) == []  # one pair: its own reference
    results = ring(4, {(0, 1): 0.01}, bad={(2, 3): "hung"})
    assert slow_pairs(4, results, 0.5) == [(0, 1)]  # a failure is evidence, not noise: never re-tested
    n = 2 * MAX_RETESTS + 2
    results = ring(n, {p: 0.01 for p in ring_pairs(n)[:MAX_RETESTS + 2]})
    assert len(slow_pairs(n, results, 0.5)) == MAX_RETESTS


def test_untested_pairs_blame_nobody() -> None:
    results = [PairResult((0, 1), untested=True, why="h1: ABORTED: busy"), good(1, 2), good(2, 0)]
    j = judge_pairs(3, results, 0.5)
    assert not j.suspects and j.verdicts[(0, 1)] == "ERROR"
    # A bad pair whose host had no other pair tested: a link (nothing tells it from the machine), said so.
    results = [PairResult((0, 1), untested=True), PairResult((1, 2), bad=True, why="hung"), good(2, 0)]
    j = judge_pairs(3, results, 0.5)
    assert [(s.kind, s.hosts) for s in j.suspects] == [("link", (1, 2))] and "no other pair" in j.suspects[0].reason


# ---- the phases' judging on plain data ------------------------------------------------------------


def done(outcome: str, *results: Result) -> RunOutcome:
    return RunOutcome("done", "diag-1", outcome, "", tuple(results))


def ag(status: str, peer: int | None = None, message: str = "", busbw: float | None = None,
       cause: str = "") -> Result:
    return Result("all_gather", "host" if peer is None else f"node/n{peer}", status, message, busbw, peer, cause)


def test_local_fail_is_a_suspect_and_error_is_reported_not_blamed() -> None:
    v = judge_local(done("FAIL", Result("all_to_all", "rank/1", "FAIL", "sent wrong bytes"),
                         Result("all_gather", "host", "SKIPPED", "needs a rendezvous")))
    assert (v.column, v.suspect, v.excluded) == ("FAIL", True, True)
    assert "all_to_all rank/1: sent wrong bytes" in v.reason
    v = judge_local(done("ERROR", Result("eud", "host", "ERROR", "dcgmi not found"),
                         Result("all_to_all", "rank/0", "PASS")))
    assert (v.column, v.suspect, v.excluded) == ("ERROR", False, False) and "dcgmi not found" in v.reason
    v = judge_local(done("PASS", Result("all_to_all", "rank/0", "PASS"), Result("all_gather", "host", "SKIPPED")))
    assert (v.column, v.suspect, v.excluded, v.reason) == ("PASS", False, False, "")
    v = judge_local(RunOutcome("refused", message="ABORTED: diagnostic diag-x is running"))
    assert (v.column, v.suspect, v.excluded) == ("ERROR", False, True) and "diag-x is running" in v.reason
    assert judge_local(RunOutcome("unreachable", message="gone")).column == "UNREACHABLE"
    # A level whose only test is all_gather: nothing local ran (the daemon's ERROR "nothing was tested").
    assert judge_local(done("ERROR", Result("all_gather", "host", "SKIPPED"))).column == "SKIPPED"


def test_inter_blames_whom_most_peers_name_and_never_with_two_hosts() -> None:
    corrupt = "sent wrong bytes (global rank 2)"
    runs = [done("FAIL", ag("FAIL", 1, corrupt), ag("PASS", 2)), done("PASS", ag("PASS", 0), ag("PASS", 2)),
            done("FAIL", ag("PASS", 0), ag("FAIL", 1, corrupt))]
    j = judge_inter(runs)
    assert set(j.blamed) == {1} and j.witnesses[1] == [0, 2] and corrupt in j.blamed[1]
    assert j.outcome == "FAIL" and j.columns == {0: "FAIL", 1: "PASS", 2: "FAIL"}
    one_witness = [runs[0], done("PASS", ag("PASS", 0), ag("PASS", 2)), done("PASS", ag("PASS", 0), ag("PASS", 1))]
    assert not judge_inter(one_witness).blamed  # one of two others is no majority
    assert not judge_inter([done("FAIL", ag("FAIL", 1, "late")), done("PASS", ag("PASS", 0))]).blamed
    never = [done("FAIL", ag("FAIL", 2, "node rank 2 never joined")), done("FAIL", ag("FAIL", 2, "never joined")),
             RunOutcome("refused", message="ABORTED: busy")]
    assert not judge_inter(never).blamed  # it never ran: its daemon said no
    j = judge_inter([done("PASS", ag("PASS", 1, busbw=2.0)), RunOutcome("hung")])
    assert j.columns[1] == "HUNG" and j.outcome == "FAIL" and j.busbw_gbps == {0: 2.0}


def test_pair_result_tells_a_data_plane_from_a_harness() -> None:
    p = pair_result((0, 1), (done("PASS", ag("PASS", 1, busbw=1.0)), done("PASS", ag("PASS", 0, busbw=3.0))))
    assert (p.bad, p.untested, p.busbw_gbps) == (False, False, 2.0)
    rdv = ag("ERROR", None, "ranks could not rendezvous: could not reach the rendezvous master", cause="rendezvous")
    p = pair_result((0, 1), (done("FAIL", ag("FAIL", 1, "node rank 1 never joined")), done("ERROR", rdv)),
                    {0: "a", 1: "b"})
    assert p.bad and "a saw: node rank 1 never joined" in p.why and "b saw: ranks could not rendezvous" in p.why
    harness = ag("ERROR", None, "every rank of this node failed before joining the process group", cause="harness")
    p = pair_result((0, 1), (done("ERROR", harness), done("ERROR", ag("ERROR", 0, "could not run", cause="harness"))))
    assert p.untested and not p.bad
    assert pair_result((0, 1), (RunOutcome("hung"), done("FAIL", ag("FAIL", 0, "late")))).bad
    assert pair_result((0, 1), (RunOutcome("refused", message="busy"), done("PASS", ag("PASS", 0, busbw=1.0)))).untested
    # A daemon that refused the run (busy, GPUs in use): its peer's "never joined" is no evidence of a bad link.
    p = pair_result((0, 1), (done("FAIL", ag("FAIL", 1, "node rank 1 never joined")),
                             RunOutcome("refused", message="FAILED_PRECONDITION: GPU compute processes are alive")))
    assert p.untested and not p.bad and "GPU compute processes are alive" in p.why


def diagnosis(*suspects: Suspect, gaps: bool = False) -> Diagnosis:
    return Diagnosis("fleet-x", [HostRecord("a", "10.0.0.1")], [PhaseRecord(n) for n in ("local", "inter", "pairs")],
                     list(suspects), gaps=gaps)


def test_outcome_and_exit_code() -> None:
    assert (diagnosis().outcome, diagnosis().exit_code) == ("PASS", 0)
    gone = Suspect("b", "unreachable", "cannot reach robustd")
    assert (diagnosis(gone).outcome, diagnosis(gone).exit_code) == ("ERROR", 3)
    assert diagnosis(gone, gaps=True).exit_code == EXIT_INCOMPLETE  # more than an unreachable host is missing
    assert (diagnosis(Suspect("a", "host", "slow"), gone).outcome, diagnosis(Suspect("a", "link", "x")).exit_code) \
        == ("FAIL", 1)
    doc = diagnosis(Suspect("a", "link", "slow", ("b",))).to_json()
    assert set(doc) >= KEYS and set(doc["hosts"][0]) == HOST_KEYS
    assert doc["suspects"] == [{"host": "a", "kind": "link", "reason": "slow", "peers": ["b"]}]
    assert [p["name"] for p in doc["phases"]] == ["local", "inter", "pairs"]


# ---- real daemons -----------------------------------------------------------------------------------

CORRUPT = '{"all_gather": {"corrupt_node": true}}'
# Healthy pairs of daemons on this 2-core machine: netns_fabric.TEST_SLOW_FRACTION says what was measured.
SLOW_FRACTION = str(TEST_SLOW_FRACTION)


def ctl(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)


def nodes(make_daemon: Any, n: int = 3) -> list[Daemon]:
    out = []
    for i in range(n):
        d = make_daemon({"node_name": f"node-{i}", "checks": {"kernel": {"enabled": False}},
                         "diagnostics": {"test_faults": True,
                                         "collectives": {"cpu_ranks": 2, "size_mb": 0.25, "iterations": 2,
                                                         "timeout": "40s"}}}, name=f"n{i}")
        d.start()
        out.append(d)
    return out


def hosts(ds: list[Daemon]) -> list[str]:
    return [f"unix:{d.socket}" for d in ds]


def listed(d: Daemon) -> list[pb.DiagnosticReport]:
    with d.channel() as ch:
        return list(pb_grpc.DiagnosticsStub(ch).List(pb.ListDiagnosticsRequest(limit=50), timeout=5).reports)


def test_healthy_hosts_pass_and_every_report_carries_the_run_id(make_daemon: Any) -> None:
    ds = nodes(make_daemon)
    r = ctl("fleet", "diagnose", *hosts(ds), "--tests", "all_to_all", "--timeout", "3m", "--json", "--port", "29611",
            "--slow-fraction", SLOW_FRACTION)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) >= KEYS and doc["outcome"] == "PASS" and doc["suspects"] == []
    assert [(p["name"], p["outcome"]) for p in doc["phases"]] == [("local", "PASS"), ("inter", "PASS"),
                                                                   ("pairs", "PASS")]
    for h, d in zip(doc["hosts"], ds, strict=True):
        assert set(h) == HOST_KEYS and h["host"] == f"unix:{d.socket}" and h["addr"] == "127.0.0.1"
        assert (h["local"], h["inter"], h["pairs"]) == ("PASS", "PASS", "PASS") and h["busbw_gbps"] > 0
        # local, inter, and its two pairs (three hosts: three rounds of one pair; and the re-test of a pair
        # slow in its round, if one was), each tagged with the run id
        reports = {x.id: x for x in listed(d)}
        assert 4 <= len(h["reports"]) <= 4 + MAX_RETESTS and set(h["reports"]) <= set(reports)
        assert {reports[i].run_id for i in h["reports"]} == {doc["run_id"]}
        assert [reports[i].tests for i in h["reports"]] == [["all_to_all"]] + [["all_gather"]] * (len(h["reports"]) - 1)
        gather = next(x for x in reports[h["reports"][1]].results if x.test == "all_gather")
        assert gather.figures["bytes"] == 3 * (1 << 18)  # collectives.size_mb: 0.25 MiB x 3 nodes (a CPU rank each)
        table = d.robustctl("diag", "list")
        assert all(line.split()[3] == doc["run_id"] for line in table.stdout.splitlines()[1:5]), table.stdout
    assert "local: started on 3 hosts" in r.stderr and "pairs: PASS after" in r.stderr

    r = ctl("fleet", "diagnose", *hosts(ds[:2]), "--tests", "all_gather", "--timeout", "2m", "--port", "29621")
    assert r.returncode == 0, r.stdout + r.stderr
    head, columns, *rows = r.stdout.splitlines()
    assert head.startswith("fleet diagnose fleet-") and ": PASS in " in head and "no suspects" in head
    assert columns.split() == ["HOST", "ADDR", "LOCAL", "INTER", "PAIRS", "BUSBW", "VERDICT", "REASON"]
    assert [row.split()[2:5] + row.split()[7:] for row in rows] == [["SKIPPED", "PASS", "PASS", "OK", "-"]] * 2


def test_a_killed_daemon_is_unreachable_and_the_others_are_diagnosed(make_daemon: Any) -> None:
    ds = nodes(make_daemon)
    ds[2].kill()
    r = ctl("fleet", "diagnose", *hosts(ds), "--tests", "all_to_all", "--timeout", "2m", "--json", "--port", "29631")
    assert r.returncode == 3, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["outcome"] == "ERROR"
    [gone] = doc["suspects"]
    assert (gone["host"], gone["kind"]) == (f"unix:{ds[2].socket}", "unreachable")
    assert "cannot reach robustd" in gone["reason"]
    assert [(h["local"], h["inter"], h["pairs"]) for h in doc["hosts"]] == [("PASS", "PASS", "PASS")] * 2 + [
        ("UNREACHABLE", "UNREACHABLE", "UNREACHABLE")]


def test_a_corrupting_host_is_named_by_the_pairs_and_by_the_all_gather_alone(make_daemon: Any) -> None:
    ds = nodes(make_daemon)
    bad = f"unix:{ds[1].socket}"
    r = ctl("fleet", "diagnose", *hosts(ds), "--tests", "all_gather", "--timeout", "2m", "--json",
            "--port", "29641", "--test-faults", f"{bad}={CORRUPT}")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["outcome"] == "FAIL"
    assert [(s["host"], s["kind"]) for s in doc["suspects"]] == [(bad, "host")]
    assert "bad in both of its pairs" in doc["suspects"][0]["reason"] and "wrong bytes" in doc["suspects"][0]["reason"]
    assert sorted(doc["suspects"][0]["peers"]) == sorted(hosts([ds[0], ds[2]]))

    r = ctl("fleet", "diagnose", *hosts(ds), "--tests", "all_gather", "--timeout", "2m", "--json", "--no-pairs",
            "--port", "29651", "--test-faults", f"{bad}={CORRUPT}")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert [(s["host"], s["kind"]) for s in doc["suspects"]] == [(bad, "host")]
    assert "said by 2 of the 2 other hosts" in doc["suspects"][0]["reason"]
    assert doc["phases"][2] == {"name": "pairs", "seconds": 0.0, "outcome": "SKIPPED"}
    assert {h["pairs"] for h in doc["hosts"]} == {"SKIPPED"} and all(len(h["reports"]) == 1 for h in doc["hosts"])


@pytest.mark.parametrize("sig,code,said", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_ctrl_c_or_sigterm_cancels_every_run_it_started(make_daemon: Any, sig: int, code: int, said: str) -> None:
    ds = nodes(make_daemon)
    stall = '{"all_gather": {"delay": {"rank": 0, "seconds": 60}}}'
    proc = subprocess.Popen([sys.executable, "-m", "robustd.cli.robustctl", "fleet", "diagnose", *hosts(ds),
                             "--tests", "all_gather", "--port", "29661",
                             "--test-faults", f"unix:{ds[1].socket}={stall}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            stdin=subprocess.DEVNULL)
    try:
        eventually(lambda: all(any(x.outcome == pb.OUTCOME_RUNNING for x in listed(d)) for d in ds), 30,
                   "every daemon running the all-gather")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert f"fleet diagnose {said}: every run it started was cancelled" in err
    t0 = time.monotonic()
    for d in ds:
        [report] = listed(d)
        assert report.outcome == pb.OUTCOME_CANCELLED, report
    assert time.monotonic() - t0 < 5


def test_a_daemon_stuck_mid_diagnosis_is_cancelled_at_each_deadline_and_named_by_its_peers(make_daemon: Any) -> None:
    # 90 s: the all-gather's share of it must hold six ranks' torch imports on two busy cores (at 60 s the
    # healthy peers' own ranks were still loading torch at their 6.6 s deadline: ERROR, not PASS).
    ds = nodes(make_daemon)
    stuck = ds[1]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "robustd.cli.robustctl", "fleet", "diagnose", *hosts(ds), "--json",
                             "--tests", "all_gather", "--timeout", "90s", "--port", "29671"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            stdin=subprocess.DEVNULL)
    try:
        eventually(lambda: any(x.outcome == pb.OUTCOME_RUNNING for x in listed(stuck)), 30, "the all-gather running")
        # RUNNING is told before the child is spawned: stopped earlier, the daemon would never start it, and its
        # peers would rightly find no one at the rendezvous instead of a peer that never reports.
        assert stuck.proc is not None
        eventually(lambda: psutil.Process(stuck.proc.pid).children(recursive=True), 30, "the all-gather's child")
        stuck.signal(signal.SIGSTOP)  # its all-gather child goes on; the daemon answers nothing any more
        out, err = proc.communicate(timeout=120)
    finally:
        stuck.signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    assert proc.returncode == 1, out + err
    doc = json.loads(out)
    assert [(s["host"], s["kind"]) for s in doc["suspects"]] == [(f"unix:{stuck.socket}", "host")]
    assert "did not finish by the phase's deadline" in doc["suspects"][0]["reason"]
    assert [(h["inter"], h["pairs"]) for h in doc["hosts"]] == [("PASS", "FAIL"), ("HUNG", "FAIL"), ("PASS", "FAIL")]
    # the phases share the 90 s, the wait for a cancelled run's report included; the Cancels still in flight
    # at the end get their deadline (5 s) and 5 s more, and robustctl its start-up: not the stuck daemon's time
    assert took < 90 + 10 + 5, took


def test_a_run_id_the_daemon_cannot_keep_is_refused(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    with d.channel() as ch, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.DiagnosticsStub(ch).Run(pb.RunRequest(tests=["eud"], run_id="a b"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "run_id" in (err.value.details() or "")


@pytest.mark.parametrize("args,message", [
    ([], "no hosts"),
    (["h1", "--level", "quick", "--tests", "eud"], "not allowed with argument"),
    (["h1", "--slow-fraction", "0"], "must be more than 0 and at most 1"),
    (["h1", "--slow-fraction", "1.5"], "must be more than 0 and at most 1"),
    (["h1", "--tests", "eud,bogus"], "unknown tests"),
    (["h1", "h2", "--port", "65535"], "need ports 65535 to 65537"),
    (["h1", "--timeout", "0s"], "--timeout '0s' must be more than zero"),
    (["h1", "--test-faults", "h1={nope"], "--test-faults h1"),
    (["h1", "--test-faults", 'h9={"all_gather": {}}'], "h9, which is not one of the hosts"),
    (["h1", "--hosts-file", "/nonexistent/hosts"], "/nonexistent/hosts"),
])
def test_usage_errors_exit_64(args: list[str], message: str) -> None:
    r = ctl("fleet", "diagnose", *args, timeout=60)
    assert r.returncode == 64 and message in r.stderr, r.stderr


def test_hosts_file_lines_give_the_collectives_address(tmp_path: Path) -> None:
    from robustd.cli import remote
    from robustd.fleet.diagnose import parse_target

    f = tmp_path / "hosts"
    f.write_text("# job 42\nnode1 10.0.0.1\nnode2:7071   # its ADDR: node2\n[fd00::3]:7070\n"
                 "unix:/run/r.sock 10.0.0.4\n")
    assert [(t.host, t.addr) for t in (parse_target(h, a) for h, a in remote.read_entries(str(f)))] == [
        ("node1", "10.0.0.1"), ("node2:7071", "node2"), ("[fd00::3]:7070", "fd00::3"), ("unix:/run/r.sock", "10.0.0.4")]
    assert parse_target("node2:7071").addr == "node2" and parse_target("/run/r.sock").addr == "127.0.0.1"
    assert remote.read_hosts(str(f)) == ["node1", "node2:7071", "[fd00::3]:7070", "unix:/run/r.sock"]  # fleet status
    f.write_text("node1 10.0.0.1 extra\n")
    with pytest.raises(ValueError, match=r"hosts:1: expected HOST \[ADDR\], got 3 fields"):
        remote.read_entries(str(f))
