"""What-if straggler analysis (ByteDance, OSDI '25, §3-§5): slowdowns, attribution and cause hints.

T is the replay of the traced durations, T_ideal the replay with every op at its category's ideal value
(mean for compute, median transfer duration for communication); both are per step, averaged over the
selected steps.

- S = T / T_ideal; wasted fraction = 1 - 1/S; per-step slowdown = step time / (T_ideal per step).
- S_t (per op category) = T_ideal^{-t} / T_ideal, where only category t keeps its traced durations.
- Per DP rank / PP rank: only that rank's ops keep their traced durations. A worker's slowdown is
  min(S_dp, S_pp) (the paper's approximation of fixing all but one worker).
- M_W = (T - T^W) / (T - T_ideal), W = the slowest ceil(3 % of workers) fixed, everything else traced.
  M_S likewise with the last PP stage fixed (0 without pipeline parallelism).
- Simulation error = traced step time / T - 1 (untraced CPU launch delays, mostly). Above SIM_ERROR_CUTOFF
  the replay is not trusted: M_S and M_W are reported but no cause that rests on them (stage_imbalance,
  slow_worker) is given; an `untrusted` cause says why in their place.
- M_S < 0 or a worker slowdown < 1 is not an error: T_ideal uses the mean compute time, the slow workers'
  own included, so a stage or worker faster than that mean replays faster than ideal (fixing it to the
  ideal makes the replay slower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

import robustd.stragglers.graph as graphmod
import robustd.stragglers.whatif as whatif
from robustd.stragglers.graph import CATEGORIES, Graph
from robustd.stragglers.optrace import OpTrace, OpTraceError

STRAGGLING = 1.1  # S above which a job straggles (paper §4.2); below it no cause is hinted
M_THRESHOLD = 0.5  # M_S / M_W above which the last stage / the slowest workers are the cause
LAST_STAGE_HEAVIER = 1.05  # the last stage's compute per microbatch vs the other stages' (the loss layer)
CORRELATION = 0.9  # forward/backward compute correlation that flags sequence-length imbalance ...
MIN_VARIATION = 0.05  # ... when microbatch compute varies by at least this much (not clock jitter)
MIN_DP_SPREAD = 0.02  # ... and the DP ranks' step compute differs from step to step by at least this much
ROW_SLOWER = 1.05  # a DP rank whose compute is this much above the other ranks' on every stage carries heavier data
GC_SHARE = 0.2  # share of the slowdown that GC pauses must explain
WORST_SHARE = 0.03  # M_W fixes the slowest 3 % of workers
STUDY_DISCARD = 0.05  # the study's bar: traces whose replay misses more than 5 % of the step were discarded
SIM_ERROR_CUTOFF = 5.0
"""Simulation error above which the replay is not trusted to attribute the slowdown (M_S, M_W).

The study (OSDI '25) discards traces whose replay misses more than 5 % of the real step time (its fleet:
median 1.3 %, p90 5.5 %); its sample traces read +0.7 % (AR) and +1.9 % (ST), the synthetic jobs under 2 %.
A CPU job recorded with cpu_compute_clock="thread" (examples/pipeline_train.py, 4 ranks on 2 cores) is far
above 5 % by design: a compute op is timed by the CPU time it got, so the time it waited for a core is
outside every traced op, and the replay (T, and T_ideal alike) leaves it out on purpose. Measured on a
shared 2-core machine: +17 % to +70 % per window quiet, +47 % to +131 % with the host's other load,
+94 % to +186 % with 2 CPU burners beside the job, +189 % to +371 % per run or 4-step window with 4
burners, and every run and window still named its injected cause (slow_worker, stage_imbalance,
sequence_imbalance, gc; none when healthy). A 5 % cut-off would discard every CPU run of the example, the
repository's own end-to-end tests among them (their slow_worker alert runs on a loaded CI machine). Above
+500 % the traced ops cover less than a sixth of the step: the untraced time then dwarfs any slowdown the
replay can explain and M_S / M_W describe a sliver of the job, so the hints that rest on them are not given.
"""


@dataclass
class Worker:
    dp_rank: int
    pp_rank: int
    slowdown: float

    def to_json(self) -> dict:
        return {"dp_rank": self.dp_rank, "pp_rank": self.pp_rank, "slowdown": _round(self.slowdown)}


@dataclass
class Cause:
    kind: str  # stage_imbalance, slow_worker, sequence_imbalance, gc, none, untrusted (see SIM_ERROR_CUTOFF)
    evidence: str
    score: float = 0.0
    workers: list[Worker] = field(default_factory=list)


@dataclass
class Report:
    name: str
    dp: int
    pp: int
    steps: list[int]
    measured_time: float  # T per step (replay of traced durations)
    ideal_time: float  # T_ideal per step
    traced_time: float  # mean traced step time
    step_slowdown: dict[int, float]
    op_types: dict[str, float]
    dp_slowdown: list[float]
    pp_slowdown: list[float]
    workers: list[Worker]  # slowest first
    worker_matrix: np.ndarray  # [PP, DP] worker slowdowns
    m_s: float
    m_w: float
    worst: list[Worker]  # the workers M_W fixes
    causes: list[Cause]
    variation: dict[int, StageVariation]  # per PP stage

    @property
    def slowdown(self) -> float:
        return self.measured_time / self.ideal_time if self.ideal_time > 0 else 1.0

    @property
    def wasted_fraction(self) -> float:
        return 1.0 - 1.0 / self.slowdown

    @property
    def simulation_error(self) -> float:
        return self.traced_time / self.measured_time - 1.0 if self.measured_time > 0 else 0.0

    @property
    def trusted(self) -> bool:
        """Whether the replay's own error is small enough to attribute the slowdown (SIM_ERROR_CUTOFF)."""
        return self.simulation_error <= SIM_ERROR_CUTOFF

    @property
    def trust_reason(self) -> str:
        """One plain line on why the replay is not trusted ("" when it is)."""
        if self.trusted:
            return ""
        untraced = 1.0 - 1.0 / (1.0 + self.simulation_error)
        return (f"simulation error {self.simulation_error:+.0%} is above the {SIM_ERROR_CUTOFF:.0%} cut-off: "
                f"{untraced:.0%} of the traced step time is outside the traced ops (CPU launch delays, ops "
                f"waiting for a core on an overloaded host), so M_S and M_W are not trusted")

    def to_json(self) -> dict:
        r = _round
        return {
            "trial": self.name,
            "layout": {"dp": self.dp, "pp": self.pp, "workers": self.dp * self.pp},
            "slowdown": r(self.slowdown),
            "measured_time": r(self.measured_time),
            "ideal_time": r(self.ideal_time),
            "traced_time": r(self.traced_time),
            "wasted_fraction": r(self.wasted_fraction),
            "m_s": r(self.m_s),
            "m_w": r(self.m_w),
            "m_w_workers": [{"dp_rank": w.dp_rank, "pp_rank": w.pp_rank} for w in self.worst],
            "simulation_error": r(self.simulation_error),
            "trusted": self.trusted,
            "sim_error_cutoff": SIM_ERROR_CUTOFF,
            "trust_reason": self.trust_reason,
            "steps": {str(s): r(v) for s, v in self.step_slowdown.items()},
            "op_types": {k: r(v) for k, v in self.op_types.items()},
            "dp_ranks": [r(v) for v in self.dp_slowdown],
            "pp_ranks": [r(v) for v in self.pp_slowdown],
            "workers": [w.to_json() for w in self.workers],
            "causes": [{"kind": c.kind, "evidence": c.evidence,
                        **({"workers": [w.to_json() for w in c.workers]} if c.workers else {})} for c in self.causes],
        }


def _round(x: float) -> float:
    return round(float(x), 6)


def analyze(trace: OpTrace, g: Graph | None = None) -> Report:
    g = g if g is not None else graphmod.build(trace)
    n, dp, pp = g.nodes, g.dp, g.pp
    cats = [c for c in range(len(CATEGORIES)) if (g.category == c).any()]

    # Batch 1: measured, ideal, each category alone, each DP rank alone, each PP rank alone, last stage fixed.
    scen = [np.ones((n, dp), bool), np.zeros((n, dp), bool)]
    scen += [np.broadcast_to((g.category == c)[:, None], (n, dp)) for c in cats]
    scen += [np.broadcast_to(np.arange(dp)[None, :] == d, (n, dp)) for d in range(dp)]
    scen += [np.broadcast_to((g.stage == p)[:, None], (n, dp)) for p in range(pp)]
    scen.append(np.broadcast_to((g.stage != pp - 1)[:, None], (n, dp)))
    per_step = whatif.replay(g, np.stack(scen))
    times = per_step.mean(axis=1)
    t_meas, t_ideal = float(times[0]), float(times[1])
    if t_ideal <= 0.0 or t_meas <= 0.0:
        raise OpTraceError("every operation in the selected steps takes no time: nothing to analyse")
    i = 2
    op_types = {CATEGORIES[c]: float(times[i + j]) / t_ideal for j, c in enumerate(cats)}
    i += len(cats)
    dp_s = [float(x) / t_ideal for x in times[i:i + dp]]
    i += dp
    pp_s = [float(x) / t_ideal for x in times[i:i + pp]]
    t_rem_stage = float(times[i + pp])

    matrix = np.minimum(np.array(pp_s)[:, None], np.array(dp_s)[None, :])  # [PP, DP]
    flat = [Worker(d, p, float(matrix[p, d])) for p in range(pp) for d in range(dp)]
    workers = sorted(flat, key=lambda w: (-w.slowdown, w.pp_rank, w.dp_rank))
    worst = workers[:max(1, math.ceil(WORST_SHARE * dp * pp))]

    # Batch 2: the worst workers fixed (M_W).
    fix_w = np.ones((n, dp), bool)
    for w in worst:
        fix_w[g.stage == w.pp_rank, w.dp_rank] = False
    t_rem_worst = float(whatif.replay(g, fix_w[None]).mean())

    gap = t_meas - t_ideal  # M_W and M_S are shares of it; meaningless when there is (almost) none
    m_w = (t_meas - t_rem_worst) / gap if gap > 1e-6 * t_ideal else 0.0
    m_s = (t_meas - t_rem_stage) / gap if gap > 1e-6 * t_ideal and pp > 1 else 0.0

    step_slowdown = {int(s): float(t) / t_ideal for s, t in zip(g.steps, per_step[0], strict=True)}
    variation = _stage_variation(g)
    rep = Report(name=trace.meta.name, dp=dp, pp=pp, steps=[int(s) for s in g.steps], measured_time=t_meas,
                 ideal_time=t_ideal, traced_time=float(g.traced_step_time.mean()), step_slowdown=step_slowdown,
                 op_types=dict(sorted(op_types.items(), key=lambda kv: -kv[1])), dp_slowdown=dp_s,
                 pp_slowdown=pp_s, workers=workers, worker_matrix=matrix, m_s=m_s, m_w=m_w, worst=worst,
                 causes=[], variation=variation)
    rep.causes = _causes(rep, g)
    return rep


@dataclass
class StageVariation:
    """How a PP stage's per-microbatch compute varied once step, DP-rank and microbatch-position means are
    removed (so a steadily slow worker or a slow step does not count)."""

    r: float  # Pearson r of forward and backward compute time of the same microbatch
    variation: float  # residual std of forward compute / its mean
    dp_spread: float  # std across (step, DP rank) of the step's compute, beyond step and rank means / mean


def _stage_variation(g: Graph) -> dict[int, StageVariation]:
    fc, bc = graphmod.T["forward-compute"], graphmod.T["backward-compute"]
    out: dict[int, StageVariation] = {}
    for p in range(g.pp):
        f = np.nonzero((g.stage == p) & (g.optype == fc))[0]
        b = np.nonzero((g.stage == p) & (g.optype == bc))[0]
        f, b = f[np.argsort(g.seq[f])], b[np.argsort(g.seq[b])]
        m = min(len(f), len(b))
        if m == 0 or not (g.present[f[:m]] & g.present[b[:m]]).all():
            continue
        fd, bd = g.duration[f[:m]], g.duration[b[:m]]
        x, y = _center(fd), _center(bd)
        sx, sy = float(np.sqrt((x * x).sum())), float(np.sqrt((y * y).sum()))
        r = float((x * y).sum() / (sx * sy)) if sx > 1e-12 and sy > 1e-12 else 0.0
        tot = (fd + bd).sum(axis=0)  # [S, D]
        inter = tot - tot.mean(axis=0, keepdims=True) - tot.mean(axis=1, keepdims=True) + tot.mean()
        out[p] = StageVariation(r=r, variation=float(x.std() / max(fd.mean(), 1e-12)),
                                dp_spread=float(inter.std() / max(tot.mean(), 1e-12)))
    return out


def _center(a: np.ndarray) -> np.ndarray:
    """Residual of a [microbatch, step, DP] array after its three main effects."""
    mu = a.mean()
    return (a - a.mean(axis=(1, 2), keepdims=True) - a.mean(axis=(0, 2), keepdims=True)
            - a.mean(axis=(0, 1), keepdims=True) + 2 * mu)


def _causes(r: Report, g: Graph) -> list[Cause]:
    s = r.slowdown
    if s < STRAGGLING:
        return [Cause("none", f"S = {s:.3f} < {STRAGGLING}: the job does not straggle "
                              f"({r.wasted_fraction:.1%} of GPU time lost to waiting)")]
    excess = s - 1.0
    out: list[Cause] = []
    heavier = _last_stage_compute_ratio(g)
    withheld: list[str] = []  # hints that rest on M_S / M_W, not given when the replay is not trusted
    if r.pp > 1 and r.m_s >= M_THRESHOLD and heavier >= LAST_STAGE_HEAVIER:
        last = r.pp - 1
        evidence = (f"fixing the last stage (PP {last}) removes {_share(r.m_s)} of the slowdown (M_S = {r.m_s:.2f}); "
                    f"its compute per microbatch is {heavier:.2f}x the other stages'; PP {last} slowdown "
                    f"{r.pp_slowdown[last]:.3f}, other stages <= {max(r.pp_slowdown[:last]):.3f}")
        if r.trusted:
            out.append(Cause("stage_imbalance", evidence, score=min(r.m_s, 1.0)))
        else:
            withheld.append("stage_imbalance")
    flagged = {p: v.r for p, v in r.variation.items()
               if v.r >= CORRELATION and v.variation >= MIN_VARIATION and v.dp_spread >= MIN_DP_SPREAD}
    heavy_rows = _heavy_dp_ranks(g)
    if flagged:
        compute = r.op_types.get("forward-compute", 1.0) + r.op_types.get("backward-compute", 1.0) - 2.0
        slowest = _slowest_dp_per_step(g)
        stages = ", ".join(f"PP {p} r = {c:.2f}" for p, c in sorted(flagged.items()))
        if len(set(slowest)) == 1:
            where = (f"DP rank {slowest[0]} is the slowest in all {len(slowest)} steps"
                     + (", on every stage (its sequences cross them all)" if slowest[0] in heavy_rows else ""))
        else:
            where = f"the slowest DP rank changes from step to step ({len(set(slowest))} different ranks over " \
                    f"{len(slowest)} steps)"
        out.append(Cause("sequence_imbalance",
                         f"forward and backward compute times of the same microbatch are correlated ({stages}) and "
                         f"{where}: microbatch work varies with sequence length; compute explains "
                         f"{min(compute / excess, 1.0):.0%} of the slowdown", score=min(compute / excess, 1.0)))
    # A worker is slow when its machine is; a DP rank slow on every stage whose microbatch work varies with
    # sequence length is slow because of its data: fixing it removes the slowdown, but it is not a slow worker.
    explained = heavy_rows if flagged else set()
    # And a worker is named only when it alone would make the job straggle (its S_w >= STRAGGLING): a job just
    # over 1.1 whose slowest worker is not is scheduling noise spread over the workers (a healthy 4-rank job
    # on a loaded 2-core host read S = 1.108 with M_W >= 0.5 and was told it had a slow worker).
    if (r.m_w >= M_THRESHOLD and r.worst[0].slowdown >= STRAGGLING
            and not {w.dp_rank for w in r.worst} <= explained):
        # Name the workers that stand out among the fixed ones (all of them when few).
        top = r.worst[0].slowdown
        standouts = [w for w in r.worst if w.slowdown - 1.0 >= 0.5 * (top - 1.0)] or r.worst[:1]
        names = ", ".join(f"DP {w.dp_rank} PP {w.pp_rank} ({w.slowdown:.2f}x)" for w in standouts)
        fixed = ("the slowest worker" if len(r.worst) == 1 else
                 f"the slowest {len(r.worst)} workers ({WORST_SHARE:.0%})")
        if not r.trusted:
            withheld.append("slow_worker")
        else:
            out.append(Cause("slow_worker", f"slow worker{'s' if len(standouts) > 1 else ''} {names}: fixing {fixed} "
                                            f"removes {_share(r.m_w)} of the slowdown (M_W = {r.m_w:.2f})",
                             score=min(r.m_w, 1.0), workers=standouts))
    gc_s = r.op_types.get("gc", 1.0)
    if gc_s - 1.0 >= GC_SHARE * excess:
        gc_nodes = g.optype == graphmod.T["gc"]
        pauses = g.duration[gc_nodes][g.present[gc_nodes]]
        share = (gc_s - 1) / excess
        out.append(Cause("gc", f"garbage-collection pauses alone slow the job by {gc_s:.3f}x ({share:.0%} of the "
                               f"slowdown): pauses mean {pauses.mean() * 1e3:.0f} ms, max {pauses.max() * 1e3:.0f} ms, "
                               f"not synchronised across ranks", score=min(share, 1.0)))
    if withheld:
        # In the place of the hints that rest on M_S / M_W, first: what the watch line and its alert print.
        out.append(Cause("untrusted", f"S = {s:.3f}, but the {r.trust_reason}; what would rest on them "
                                      f"({' and '.join(k.replace('_', ' ') for k in withheld)}, M_S = {r.m_s:.2f}, "
                                      f"M_W = {r.m_w:.2f}) is not a finding", score=2.0))
    if not out:
        top = max(r.op_types.items(), key=lambda kv: kv[1])
        out.append(Cause("none", f"S = {s:.3f} but no known pattern: M_S = {r.m_s:.2f}, M_W = {r.m_w:.2f}, "
                                 f"largest op-type slowdown {top[0]} {top[1]:.3f}"))
    out.sort(key=lambda c: -c.score)
    return out


def _share(m: float) -> str:
    """M_S / M_W as words: above 1 the fix leaves the job faster than T_ideal (the ideal is the mean over all
    workers, the slow ones included), so it removes all of the slowdown, not more than all of it."""
    return "all" if m >= 1.0 else f"{m:.0%}"


def _heavy_dp_ranks(g: Graph) -> set[int]:
    """DP ranks whose compute per step is at least ROW_SLOWER x the other ranks' median on every stage."""
    if g.dp < 2:
        return set()
    compute = np.isin(g.optype, [graphmod.T["forward-compute"], graphmod.T["backward-compute"]])
    cell = np.zeros((g.pp, g.dp))
    for p in range(g.pp):
        sel = compute & (g.stage == p)
        cell[p] = np.where(g.present[sel], g.duration[sel], 0.0).sum(axis=(0, 1))
    heavy = set()
    for d in range(g.dp):
        others = np.median(np.delete(cell, d, axis=1), axis=1)
        if (cell[:, d] >= ROW_SLOWER * others).all():
            heavy.add(d)
    return heavy


def _last_stage_compute_ratio(g: Graph) -> float:
    """Mean forward+backward compute time per microbatch on the last stage / on the other stages."""
    compute = np.isin(g.optype, [graphmod.T["forward-compute"], graphmod.T["backward-compute"]])
    per_stage = []
    for p in range(g.pp):
        sel = compute & (g.stage == p)
        per_stage.append(g.duration[sel][g.present[sel]].sum() / max(int(sel.sum()), 1))
    rest = float(np.mean(per_stage[:-1])) if g.pp > 1 else 0.0
    return float(per_stage[-1]) / rest if rest > 0 else 1.0


def _slowest_dp_per_step(g: Graph) -> list[int]:
    compute = np.isin(g.optype, [graphmod.T["forward-compute"], graphmod.T["backward-compute"]])
    per = g.duration[compute].sum(axis=0)  # [S, D]
    return [int(x) for x in per.argmax(axis=1)]
