"""`robustctl slurm epilog-ctld` (EpilogSlurmctld), a skeleton (issue 29, WIP: see WIP-29.md).

Runs on the controller as SlurmUser: env → gate → hold → fleet diagnosis → settle, each decision in
robustd/adapters/slurm/ctld.py, one log line each. Always exits 0. The Slurm and diagnosis calls are
arguments, so tests/test_slurm_ctld.py drives it with fakes.

Not done yet: triage of the job's output (`triage` is an argument, None = infra unknown), the TLS files'
check before dialling, NodeAddr as the collectives' address (the node name is used), prolog-ctld.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.ctld import (
    Action,
    JobEnd,
    Step,
    TriageSummary,
    findings,
    gate,
    holds,
    job_end,
    settle,
    still_held,
)
from robustd.adapters.slurm.model import NodeView
from robustd.adapters.slurm.slurmcli import Slurm, SlurmError

log = logging.getLogger("robustd.slurm")

EXIT_OK = 0
Diagnose = Callable[..., Any]  # robustd.fleet.diagnose.diagnose's signature


def _view(slurm: Slurm, name: str) -> NodeView | None:
    try:
        return slurm.node(name)
    except SlurmError as e:
        log.warning("%s: %s", name, e)
        return None


def _say(a: Action) -> None:
    log.log(logging.WARNING if a.step in (Step.HOLD, Step.DRAIN) else logging.INFO, "%s", a.note)


def epilog_ctld(cfg: SlurmConfig, env: Mapping[str, str], slurm: Slurm, diagnose: Diagnose,
                triage: Callable[[JobEnd], TriageSummary | None] = lambda _job: None,
                now: Callable[[], float] | None = None) -> int:
    import time

    clock = now or time.time
    try:
        job = job_end(env, slurm.hostnames)
    except SlurmError as e:
        log.error("job %s: cannot expand SLURM_JOB_NODELIST: %s; changing nothing", env.get("SLURM_JOB_ID", "?"), e)
        return EXIT_OK
    ok, why = gate(job, triage(job))
    log.warning("%s", why) if ok else log.info("%s", why)
    if not ok:
        return EXIT_OK
    held: list[str] = []
    for a in holds(cfg, job, {n: _view(slurm, n) for n in job.nodes}):
        if a.step is Step.HOLD:
            try:
                slurm.drain(a.node, a.reason)
            except SlurmError as e:
                log.error("%s: hold failed (%s); not diagnosed", a.node, e)
                continue
            held.append(a.node)
        _say(a)
    if len(held) < 2:
        log.warning("job %s: %d node(s) held; a job-level diagnosis needs 2: releasing", job.job, len(held))
        _carry_out(cfg, job.job, slurm, settle(cfg, job.job, held, None, [], {n: _view(slurm, n) for n in held},
                                               [], clock(), why_not="fewer than 2 nodes to test"))
        return EXIT_OK
    outcome, found, why_not = _diagnose(cfg, job, held, diagnose)
    views = {n: _view(slurm, n) for n in held}
    parts = sorted({p for v in views.values() if v is not None for p in v.partitions})
    try:
        rows = slurm.partition_rows(parts)
    except SlurmError as e:  # no breaker without its counts: drain nothing, release every hold
        outcome, why_not = None, f"sinfo for the circuit breaker failed: {e}"
        rows = []
    _carry_out(cfg, job.job, slurm, settle(cfg, job.job, held, outcome, found, views, rows, clock(), why_not))
    return EXIT_OK


def _diagnose(cfg: SlurmConfig, job: JobEnd, held: Sequence[str],
              diagnose: Diagnose) -> tuple[str | None, list[Any], str]:
    from robustd.fleet.diagnose import Target

    c = cfg.ctld
    targets = [Target(f"{n}:{c.port}", n) for n in held]
    node_of = {t.host: n for t, n in zip(targets, held, strict=True)}
    try:
        d = diagnose(targets, level=c.level, port=c.rendezvous_port, timeout=c.timeout,
                     tls=(c.tls_ca, c.tls_cert, c.tls_key), run_id=f"slurm-job-{job.job}")
    except Exception as e:  # noqa: BLE001 - fail open: robustd's own error releases every hold
        log.error("job %s: the diagnosis could not run: %s: %s", job.job, type(e).__name__, e)
        return None, [], f"{type(e).__name__}: {e}"
    log.warning("job %s: diagnosis %s %s in %.1f s: %s", job.job, d.run_id, d.outcome, d.seconds,
                "; ".join(f"{s.kind} {node_of.get(s.host, s.host)}: {s.reason}" for s in d.suspects) or "no suspects")
    return d.outcome, findings(d.suspects, node_of), ""


def _carry_out(cfg: SlurmConfig, job: str, slurm: Slurm, actions: Sequence[Action]) -> None:
    for a in actions:
        if a.step in (Step.DRAIN, Step.RELEASE):
            fresh = _view(slurm, a.node)  # right before writing: never touch a node taken meanwhile
            if not still_held(cfg, job, fresh):
                log.info("%s changed meanwhile (%s); left", a.node, fresh.describe() if fresh else "unknown")
                continue
            try:
                slurm.drain(a.node, a.reason) if a.step is Step.DRAIN else slurm.resume(a.node)
            except SlurmError as e:
                log.error("%s: %s failed: %s", a.node, a.step.value, e)
                continue
        _say(a)
