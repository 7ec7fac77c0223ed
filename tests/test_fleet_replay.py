"""Dual-phase replay planner and warm-standby sizing: pure functions and `robustctl fleet`."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from math import comb

import pytest

from robustd.fleet import replay, standby
from robustd.fleet.replay import LayoutError

# ---- dual-phase replay ---------------------------------------------------------------------------


@pytest.mark.parametrize("pp,k", [(4, 1), (2, 2), (1, 4)])  # every m = k*PP = 4 for the paper's Fig. 6
def test_paper_example_24_machines(pp: int, k: int) -> None:
    p = replay.plan(24, pp, k)
    assert (p.m, p.n) == (4, 6)
    assert p.horizontal[3] == (12, 13, 14, 15)
    assert p.vertical[1] == (1, 7, 13, 19)
    assert set(p.horizontal[3]) & set(p.vertical[1]) == {13}
    assert replay.locate(24, pp, k, 3, 1) == 13


def test_groupings_follow_the_rule() -> None:
    p = replay.plan(24, 2, 2)
    assert len(p.horizontal) == len(p.vertical) == p.n
    for i, g in enumerate(p.horizontal):
        assert len(g) == p.m and all(x // p.m == i for x in g)
    for j, g in enumerate(p.vertical):
        assert len(g) == p.m and all(x % p.n == j for x in g)
    for phase in (p.horizontal, p.vertical):
        assert sorted(x for g in phase for x in g) == list(range(24))


@pytest.mark.parametrize("machines,pp,k", [(24, 4, 1), (36, 2, 3), (64, 8, 1), (100, 5, 2), (9, 3, 1)])
def test_locate_finds_every_machine(machines: int, pp: int, k: int) -> None:
    p = replay.plan(machines, pp, k)
    for x in range(machines):
        h = next(i for i, g in enumerate(p.horizontal) if x in g)
        v = next(j for j, g in enumerate(p.vertical) if x in g)
        assert replay.locate(machines, pp, k, h, v) == x
        # each horizontal group meets each vertical group at most once when m <= n
        assert all(len(set(a) & set(p.vertical[v])) <= 1 for a in p.horizontal)


def test_refuses_m_more_than_n() -> None:
    with pytest.raises(LayoutError, match=r"m = k\*PP = 1\*8 = 8 is more than n = .* = 3.*m <= n"):
        replay.plan(24, 8, 1)
    with pytest.raises(LayoutError, match="m <= n"):
        replay.locate(24, 4, 2, 0, 0)  # m = 8, n = 3


def test_refuses_m_times_n_not_machines() -> None:
    with pytest.raises(LayoutError, match=r"25 machines do not split .* m\*n must equal the machine count"):
        replay.plan(25, 2, 2)
    assert issubclass(LayoutError, ValueError)


@pytest.mark.parametrize("bad", [(0, 2, 2), (24, 0, 2), (24, 2, 0), (-24, 2, 2), (24, 2.0, 2), (24, True, 2)])
def test_refuses_non_positive_or_non_integer(bad: tuple) -> None:
    with pytest.raises(LayoutError, match="whole number of at least 1"):
        replay.plan(*bad)


@pytest.mark.parametrize("h,v,what", [(6, 1, "horizontal group 6"), (-1, 1, "horizontal group -1"),
                                      (3, 6, "vertical group 6"), (3, -1, "vertical group -1")])
def test_locate_bad_indices(h: int, v: int, what: str) -> None:
    with pytest.raises(LayoutError, match=f"failed {what} is out of range: groups are 0..5"):
        replay.locate(24, 2, 2, h, v)


def test_locate_groups_that_do_not_meet() -> None:
    # H3 = {12..15} has residues 0..3 mod 6, so V5 = {5, 11, 17, 23} never meets it.
    with pytest.raises(LayoutError, match="share no machine"):
        replay.locate(24, 2, 2, 3, 5)


# ---- warm standby --------------------------------------------------------------------------------

PAPER_P = 0.0012  # daily per-machine failure probability that reproduces Table 5


def _exact_spares(n: int, p: float, q: Fraction = Fraction(99, 100)) -> int:
    pf, cdf = Fraction(str(p)), Fraction(0)  # the decimal the caller meant
    for s in range(n + 1):
        cdf += comb(n, s) * pf**s * (1 - pf) ** (n - s)
        if cdf >= q:
            return s
    return n


def test_paper_figure_4_spares_for_1024() -> None:
    assert standby.spares(1024, PAPER_P) == 4


def test_paper_table_5() -> None:
    assert [standby.spares(n, PAPER_P) for n in (128, 256, 512, 1024)] == [2, 2, 3, 4]


@pytest.mark.parametrize("n", [1, 7, 128, 1024, 1500])
@pytest.mark.parametrize("p", [1e-4, 0.0012, 0.01, 0.1, 0.5, 0.93])
def test_matches_exact_rational_sum(n: int, p: float) -> None:
    assert standby.spares(n, p) == _exact_spares(n, p)


def test_edges() -> None:
    assert standby.spares(1024, 0.0) == 0
    assert standby.spares(1, 0.0) == 0
    assert standby.spares(1024, 1.0) == 1024
    assert standby.spares(1, 0.5) == 1  # P(X <= 0) = 0.5 < 0.99
    assert standby.spares(1, 0.01) == 0  # P(X <= 0) = 0.99 exactly: a tie reaches the quantile
    assert standby.spares(1, 0.011) == 1
    assert standby.spares(1024, PAPER_P, quantile=0.5) <= standby.spares(1024, PAPER_P)


def test_monotonic_in_p_and_n() -> None:
    ps = [i / 1000 for i in range(0, 1001, 5)]
    got = [standby.spares(1024, p) for p in ps]
    assert got == sorted(got) and got[0] == 0 and got[-1] == 1024
    got_n = [standby.spares(n, PAPER_P) for n in range(1, 3000, 37)]
    assert got_n == sorted(got_n)


def test_large_n_does_not_underflow() -> None:
    s = standby.spares(10_000_000, 0.01)  # (1 - p)^N underflows a double outside log space
    assert 100_000 < s < 100_000 + 4 * 315  # mean 1e5, sd ~315: P99 ~ mean + 2.33 sd


@pytest.mark.parametrize("args", [(0, 0.1), (-5, 0.1), (10.0, 0.1), (10, -0.01), (10, 1.01),
                                  (10, float("nan")), (10, 0.1, 1.0), (10, 0.1, 0.0)])
def test_standby_rejects_bad_inputs(args: tuple) -> None:
    with pytest.raises(ValueError):
        standby.spares(*args)


# ---- robustctl fleet -----------------------------------------------------------------------------


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    # --socket to a path that does not exist: these verbs must not need a daemon
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "--socket", "/nonexistent/robustd.sock",
                           "fleet", *args], capture_output=True, text=True, timeout=60)


LAYOUT = ["--machines", "24", "--pp", "2", "--k", "2"]


def test_cli_replay_plan_text() -> None:
    r = _ctl("replay-plan", *LAYOUT)
    assert r.returncode == 0, r.stderr
    assert "m = 4" in r.stdout and "n = 6" in r.stdout
    assert "H3: 12 13 14 15" in r.stdout and "V1: 1 7 13 19" in r.stdout
    assert r.stdout.index("phase 1") < r.stdout.index("H0:") < r.stdout.index("phase 2") < r.stdout.index("V0:")


def test_cli_replay_plan_json() -> None:
    r = _ctl("replay-plan", *LAYOUT, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"m", "n", "horizontal", "vertical"}
    assert (doc["m"], doc["n"]) == (4, 6)
    assert doc["horizontal"][3] == [12, 13, 14, 15] and doc["vertical"][1] == [1, 7, 13, 19]
    assert len(doc["horizontal"]) == len(doc["vertical"]) == 6


def test_cli_replay_locate() -> None:
    r = _ctl("replay-locate", *LAYOUT, "--failed-horizontal", "3", "--failed-vertical", "1")
    assert r.returncode == 0, r.stderr
    assert "13" in r.stdout
    r = _ctl("--json", "replay-locate", *LAYOUT, "--failed-horizontal", "3", "--failed-vertical", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"machine": 13, "horizontal_group": 3, "vertical_group": 1}


def test_cli_standby() -> None:
    r = _ctl("standby", "--machines", "1024", "--failure-prob", str(PAPER_P))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "4"
    r = _ctl("standby", "--machines", "1024", "--failure-prob", str(PAPER_P), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"spares": 4, "machines": 1024, "failure_prob": PAPER_P, "quantile": 0.99}


@pytest.mark.parametrize("args,message", [
    (["replay-plan", "--machines", "24", "--pp", "8", "--k", "1"], "m <= n"),
    (["replay-plan", "--machines", "25", "--pp", "2", "--k", "2"], "m*n must equal the machine count"),
    (["--json", "replay-plan", "--machines", "24", "--pp", "8", "--k", "1"], "m <= n"),
    (["replay-locate", *LAYOUT, "--failed-horizontal", "6", "--failed-vertical", "1"], "out of range"),
    (["replay-locate", *LAYOUT, "--failed-horizontal", "3", "--failed-vertical", "5"], "share no machine"),
    (["standby", "--machines", "1024", "--failure-prob", "1.5"], "between 0 and 1"),
    (["standby", "--machines", "0", "--failure-prob", "0.1"], "at least 1"),
])
def test_cli_refusals_exit_64_one_line(args: list[str], message: str) -> None:
    r = _ctl(*args)
    assert r.returncode == 64
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("robustctl: fleet: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_cli_missing_argument_is_usage_error() -> None:
    r = _ctl("replay-plan", "--machines", "24", "--pp", "2")
    assert r.returncode == 64 and "--k" in r.stderr and "Traceback" not in r.stderr
