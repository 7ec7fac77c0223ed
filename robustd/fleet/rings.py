"""Pairs along a ring, and what their results say: a bad machine, a bad link, or nothing to tell apart.

In a collective every rank waits for the slowest one, so one all-gather across N hosts says only that
something is wrong. Tested in pairs, each host with both of its ring neighbours, a host that is bad with
both is the machine to take out, and a pair that is bad while both of its hosts are good with their other
neighbour is the link between them. The N pairs of a ring (one for N = 2) fit in at most three rounds
whatever N, no host twice in a round: so the cost is three collectives, not N.

The pairs of one round share whatever they have in common (the switch, and on a test machine the CPUs), so
one round's figures are noisy: on the 2-core CI machine healthy pairs of one diagnosis measured anywhere
from 0.03 to 0.5 GB/s. A pair that measured slow is therefore re-tested alone (`slow_pairs`, at most
MAX_RETESTS of them, one collective each) and judged by the better of its two figures against the rounds'
reference: a machine or link that is slow stays slow alone, a pair that lost a race for a shared resource
does not. A pair that failed is never re-tested: a failure is evidence, not noise.

Pure functions on plain data (host indexes, figures); robustd/fleet/diagnose.py runs the collectives.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Pair = tuple[int, int]  # host indexes; the first one hosts the rendezvous
MAX_RETESTS = 4  # slow pairs re-tested alone: a slow host's two pairs, a slow link, and room for noise


def ring_pairs(n: int) -> list[Pair]:
    """(i, i+1 mod n) for every host: each host with both neighbours; one pair for two hosts, none for one."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def ring_rounds(n: int) -> list[list[Pair]]:
    """The ring's pairs in rounds whose pairs can run at once (no host twice in a round).

    Even n: the pairs starting at even indexes, then those starting at odd ones (two rounds). Odd n: the
    same, less the pair that closes the ring, which is a third round of its own. Two hosts: one round.
    """
    pairs = ring_pairs(n)
    if n <= 2:
        return [pairs] if pairs else []
    closing = [pairs[-1]] if n % 2 else []
    body = pairs[:-1] if n % 2 else pairs
    return [r for r in ([p for p in body if p[0] % 2 == 0], [p for p in body if p[0] % 2 == 1], closing) if r]


@dataclass(frozen=True)
class PairResult:
    """What one pair's collective showed.

    `bad`: a failure, a hang, a missing or wrong answer (`why` says which), judged before bandwidth;
    `untested`: the collective could not run at all (a daemon refused, the harness broke) — no evidence
    either way; otherwise `busbw_gbps` is the pair's bus bandwidth.
    """

    pair: Pair
    bad: bool = False
    untested: bool = False
    why: str = ""
    busbw_gbps: float | None = None


@dataclass(frozen=True)
class PairSuspect:
    kind: str  # "host" or "link"
    hosts: tuple[int, ...]  # the host; or both ends of the link
    peers: tuple[int, ...]  # for a host: the neighbours it was bad with; for a link: the other end
    reason: str


@dataclass
class PairsJudgement:
    suspects: list[PairSuspect] = field(default_factory=list)
    verdicts: dict[Pair, str] = field(default_factory=dict)  # PASS, FAIL (bad or slow), ERROR (untested)
    reasons: dict[Pair, str] = field(default_factory=dict)  # why a pair is bad or untested
    median_gbps: float | None = None  # the reference slowness is measured against
    busbw_gbps: dict[Pair, float] = field(default_factory=dict)  # each pair's figure: the better of its two
    inconclusive: str = ""  # why no suspect could be named although pairs were bad


def reference_bandwidth(results: Sequence[PairResult]) -> float | None:
    """The median, over the hosts, of each host's best good pair.

    Not the plain median of the pairs: with three hosts a slow one is in two of the three pairs, and the
    plain median would be its own bandwidth. A host's best pair is slow only when both of its pairs are, so
    a single slow machine (or link) cannot pull the reference down.
    """
    best: dict[int, float] = {}
    for r in results:
        if r.bad or r.untested or r.busbw_gbps is None:
            continue
        for h in r.pair:
            best[h] = max(best.get(h, 0.0), r.busbw_gbps)
    return statistics.median(best.values()) if best else None


def slow_pairs(n: int, results: Sequence[PairResult], slow_fraction: float) -> list[Pair]:
    """The pairs that ran clean but measured below `slow_fraction` of the reference, slowest first, at most
    MAX_RETESTS: the ones to re-test alone before anyone is blamed. None for two hosts: their one pair is its
    own reference (slowness there is the all-gather's absolute floor, `min_busbw_gbps`, to judge)."""
    ref = reference_bandwidth(results)
    if n < 3 or ref is None:
        return []
    slow = [r for r in results if not r.bad and not r.untested and r.busbw_gbps is not None
            and r.busbw_gbps < slow_fraction * ref]
    return [r.pair for r in sorted(slow, key=lambda r: r.busbw_gbps or 0.0)][:MAX_RETESTS]


def judge_pairs(n: int, results: Sequence[PairResult], slow_fraction: float,
                names: Mapping[int, str] | None = None,
                alone: Mapping[Pair, PairResult] | None = None) -> PairsJudgement:
    """Who is to blame, from the ring's pair results (`names` only words the reasons) and the re-tests of
    the slow ones (`alone`, by pair).

    A pair is bad when its collective went wrong (in its round or re-tested alone) or the better of its
    figures is below `slow_fraction` of the reference (`reference_bandwidth` of the rounds: every figure in
    it was measured under the same sharing). A re-test that could not run leaves the round's figure to
    judge. A host bad in both of its pairs is a `host` suspect; a bad pair
    not explained that way is a `link` suspect naming both ends (with two hosts, their one bad pair is a
    link: nothing can tell them apart). When every pair of three or more hosts is bad there is nothing
    to compare against: no suspect, and `inconclusive` says so.
    """
    def name(h: int) -> str:
        return names.get(h, f"host {h}") if names is not None else f"host {h}"

    out = PairsJudgement(median_gbps=reference_bandwidth(results))
    ref = out.median_gbps
    alone = alone or {}
    bad: dict[Pair, str] = {}
    for r in results:
        again = alone.get(r.pair)
        if r.untested:
            out.verdicts[r.pair], out.reasons[r.pair] = "ERROR", r.why or "not tested"
            continue
        if r.bad:
            bad[r.pair] = r.why or "failed"
            continue
        if again is not None and again.bad:
            bad[r.pair] = f"re-tested alone: {again.why or 'failed'}"
            continue
        figure = r.busbw_gbps
        if figure is not None and again is not None and again.busbw_gbps is not None:
            figure = max(figure, again.busbw_gbps)
        if figure is not None:
            out.busbw_gbps[r.pair] = figure
        if figure is not None and ref is not None and figure < slow_fraction * ref:
            measured = f"bus bandwidth {r.busbw_gbps:.4g} GB/s" + (
                f", {again.busbw_gbps:.4g} GB/s re-tested alone" if again is not None and again.busbw_gbps
                is not None else "")
            bad[r.pair] = f"{measured}, below {slow_fraction:g} of the median {ref:.4g} GB/s"
        else:
            out.verdicts[r.pair] = "PASS"
    for p, why in bad.items():
        out.verdicts[p], out.reasons[p] = "FAIL", why
    tested = [p for p, v in out.verdicts.items() if v != "ERROR"]
    if not bad:
        return out
    if n >= 3 and len(bad) == len(tested):
        out.inconclusive = (f"every pair that ran was bad ({len(bad)} of {len(tested)}): nothing to compare "
                            "against (a fault common to every host, the network between all of them, or a "
                            "--timeout too short for the collectives)")
        return out
    mine: dict[int, list[Pair]] = {}
    for p in out.verdicts:
        for h in p:
            mine.setdefault(h, []).append(p)
    host_suspects: set[int] = set()
    for h in sorted(mine):
        ps = [p for p in mine[h] if out.verdicts[p] != "ERROR"]
        if len(ps) >= 2 and all(p in bad for p in ps):
            host_suspects.add(h)
            peers = tuple(p[1] if p[0] == h else p[0] for p in ps)
            out.suspects.append(PairSuspect("host", (h,), peers, "bad in both of its pairs: " + "; ".join(
                f"with {name(q)}: {bad[p]}" for q, p in zip(peers, ps, strict=True))))
    for p, why in bad.items():
        a, b = p
        if a in host_suspects or b in host_suspects:
            continue
        others = {h: [q for q in mine[h] if q != p and out.verdicts[q] != "ERROR"] for h in p}
        if n == 2:
            reason = f"the only pair is bad ({why}): nothing can tell {name(a)} from {name(b)}"
        elif all(others[h] and all(q not in bad for q in others[h]) for h in p):
            reason = f"bad between {name(a)} and {name(b)} ({why}) while both are good with their other neighbour"
        else:
            untold = [name(h) for h in p if not others[h]]
            reason = (f"bad between {name(a)} and {name(b)} ({why}); {' and '.join(untold)} had no other pair "
                      "tested, so a bad machine cannot be told from a bad link")
        out.suspects.append(PairSuspect("link", (a, b), (b,), reason))
    return out
