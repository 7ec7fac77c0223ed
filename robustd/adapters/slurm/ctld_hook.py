"""`robustctl slurm epilog-ctld` (EpilogSlurmctld) and `prolog-ctld` (PrologSlurmctld): Slurm's controller
runs them once per job with the whole node list, as SlurmUser.

epilog-ctld, after a failed multi-node job: env → gate (not for user code or an out-of-memory: triage of
the job's output, robustd/adapters/slurm/ctld_triage.py) → hold the job's free nodes → the job-level
diagnosis (robustd.fleet.diagnose) over their daemons, dialled at Slurm's NodeAddr with mutual TLS → drain
the suspects, release the rest. prolog-ctld, before a multi-node job starts (`slurm.ctld.preflight`): the
same diagnosis; a suspect is drained and the hook exits 1, so Slurm requeues the job onto other nodes.

Every decision is a pure function of robustd/adapters/slurm/ctld.py and one log line. Both fail open: an
error of robustd's own (a bad config, TLS files it cannot read, no daemon answering, a diagnosis that could
not run, the budget spent) holds nothing or releases every hold, and lets the job start. The Slurm, triage
and diagnosis calls are arguments, so tests/test_slurm_ctld.py drives both with fakes; the real cluster is
tests/test_slurm_ctld_cluster.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.ctld import (
    MIN_NODES,
    Action,
    JobEnd,
    Step,
    TriageSummary,
    findings,
    gate,
    holds,
    job_end,
    preflight,
    settle,
    still_held,
)
from robustd.adapters.slurm.model import NodeView
from robustd.adapters.slurm.slurmcli import Slurm, SlurmError

log = logging.getLogger("robustd.slurm")

EXIT_OK = 0
EXIT_REQUEUE = 1  # prolog-ctld: a suspect was drained; Slurm requeues the job (a batch job) onto other nodes
Diagnose = Callable[..., Any]  # robustd.fleet.diagnose.diagnose's signature
Target = tuple[str, str]  # (node name, "addr:port" of its robustd)
Triage = Callable[[JobEnd, Sequence[Target]], TriageSummary | None]
PROBE_TIMEOUT = 5.0  # a node's robustd answers GetVerdict from memory: 5 s is a dead or unreachable daemon


def _view(slurm: Slurm, name: str) -> NodeView | None:
    try:
        return slurm.node(name)
    except SlurmError as e:
        log.warning("%s: %s", name, e)
        return None


def _say(a: Action) -> None:
    log.log(logging.WARNING if a.step in (Step.HOLD, Step.DRAIN) else logging.INFO, "%s", a.note)


def target_of(cfg: SlurmConfig, name: str, view: NodeView | None) -> Target:
    """Where the node's robustd answers: Slurm's NodeAddr (the name when Slurm gave none) at slurm.ctld.port."""
    addr = (view.addr if view is not None else "") or name
    return name, (f"[{addr}]" if ":" in addr else addr) + f":{cfg.ctld.port}"


def tls_problem(cfg: SlurmConfig) -> str:
    """Why the controller's TLS files cannot be used ("" when they can, or none are set): checked before
    anything is held, since a diagnosis without them cannot run."""
    from robustd.tls import read_pem

    c = cfg.ctld
    for key, path in (("tls_ca", c.tls_ca), ("tls_cert", c.tls_cert), ("tls_key", c.tls_key)):
        if path is None:
            continue
        try:
            read_pem(path)
        except ValueError as e:
            return f"slurm.ctld.{key} {path}: {e}"
    if c.tls_cert is None and c.tls_ca is not None:
        log.warning("slurm.ctld.tls_ca without tls_cert: the nodes see no client identity and refuse Run")
    return ""


def reachable(cfg: SlurmConfig, targets: Sequence[Target]) -> dict[str, str]:
    """The nodes whose robustd does not answer GetVerdict within PROBE_TIMEOUT (node → why), asked all at once
    (robustd.cli.remote.fan_out, as `robustctl fleet status` asks its hosts)."""
    from robustd.api.v1 import robustd_pb2 as pb
    from robustd.cli.remote import fan_out

    outcomes = fan_out([t for _, t in targets], lambda c: c.call("GetVerdict", pb.GetVerdictRequest()),
                       PROBE_TIMEOUT, cfg.ctld.tls)
    return {n: o.error for (n, _), o in zip(targets, outcomes, strict=True) if o.error}


Probe = Callable[[SlurmConfig, Sequence[Target]], dict[str, str]]


def epilog_ctld(cfg: SlurmConfig, env: Mapping[str, str], slurm: Slurm, diagnose: Diagnose,
                triage: Triage | None = None, now: Callable[[], float] | None = None,
                monotonic: Callable[[], float] = time.monotonic, probe: Probe | None = None) -> int:
    clock = now or time.time
    started = monotonic()
    try:
        job = job_end(env, slurm.hostnames)
    except SlurmError as e:
        log.error("job %s: cannot expand SLURM_JOB_NODELIST: %s; changing nothing", env.get("SLURM_JOB_ID", "?"), e)
        return EXIT_OK
    ok, why = gate(job, None)  # the job's own facts first: triage only for a failed multi-node job
    if not ok:
        log.info("%s", why)
        return EXIT_OK
    if problem := tls_problem(cfg):
        log.error("job %s: %s; holding nothing, diagnosing nothing", job.job, problem)
        return EXIT_OK
    views = {n: _view(slurm, n) for n in job.nodes}
    targets = [target_of(cfg, n, views[n]) for n in job.nodes if views[n] is not None]
    down = (probe or reachable)(cfg, targets)
    targets = [t for t in targets if t[0] not in down]
    if len(targets) < MIN_NODES:
        log.error("job %s: %d node(s) whose robustd answers%s; a job-level diagnosis needs %d: holding nothing",
                  job.job, len(targets), "".join(f"; {n}: {why}" for n, why in down.items()), MIN_NODES)
        return EXIT_OK
    summary = triage(job, targets) if triage is not None else None
    ok, why = gate(job, summary)
    log.warning("%s", why) if ok else log.info("%s", why)
    if not ok:
        return EXIT_OK
    held: list[str] = []
    try:
        for a in holds(cfg, job, {n: _view(slurm, n) for n in job.nodes}, down):
            if a.step is Step.HOLD:
                try:
                    slurm.drain(a.node, a.reason)
                except SlurmError as e:
                    log.error("%s: hold failed (%s); not diagnosed", a.node, e)
                    continue
                held.append(a.node)
            _say(a)
        if len(held) < MIN_NODES:
            log.warning("job %s: %d node(s) held; a job-level diagnosis needs %d: releasing", job.job, len(held),
                        MIN_NODES)
            _carry_out(cfg, job.job, slurm, settle(cfg, job.job, held, None, [], {n: _view(slurm, n) for n in held},
                                                   [], clock(), why_not=f"fewer than {MIN_NODES} nodes to test"))
            held = []
            return EXIT_OK
        left = cfg.ctld.timeout - (monotonic() - started)
        outcome, found, why_not = _diagnose(cfg, job.job, [t for t in targets if t[0] in held], diagnose,
                                            level=cfg.ctld.level, timeout=left, run_id=f"slurm-job-{job.job}")
        views = {n: _view(slurm, n) for n in held}
        rows, err = _rows(slurm, views)
        if err:  # no breaker without its counts: drain nothing, release every hold
            outcome, why_not = None, err
        _carry_out(cfg, job.job, slurm, settle(cfg, job.job, held, outcome, found, views, rows, clock(), why_not))
        held = []
        return EXIT_OK
    finally:
        if held:  # an exception or the budget's alarm half-way: robustd failing never leaves its holds behind
            log.error("job %s: stopped before the diagnosis was settled; releasing its holds", job.job)
            slurm.deadline = None
            _carry_out(cfg, job.job, slurm, settle(cfg, job.job, held, None, [], {n: _view(slurm, n) for n in held},
                                                   [], clock(), why_not="the hook was stopped"))


def prolog_ctld(cfg: SlurmConfig, env: Mapping[str, str], slurm: Slurm, diagnose: Diagnose,
                now: Callable[[], float] | None = None) -> int:
    """The preflight of a multi-node job; exit 1 only when a suspect was drained (Slurm requeues the job)."""
    clock = now or time.time
    level = cfg.ctld.preflight
    job_id = env.get("SLURM_JOB_ID", "?").strip() or "?"
    if level is None:
        log.info("job %s: slurm.ctld.preflight is off", job_id)
        return EXIT_OK
    try:
        nodes = list(job_end(env, slurm.hostnames).nodes)  # the job's nodes as epilog-ctld reads them
    except SlurmError as e:
        log.error("job %s: cannot expand SLURM_JOB_NODELIST: %s; letting it start", job_id, e)
        return EXIT_OK
    if len(nodes) < MIN_NODES:
        log.info("job %s: %d node(s); no preflight", job_id, len(nodes))
        return EXIT_OK
    if problem := tls_problem(cfg):
        log.error("job %s: %s; letting it start without a preflight", job_id, problem)
        return EXIT_OK
    started = time.monotonic()
    views = {n: _view(slurm, n) for n in nodes}
    outcome, found, why_not = _diagnose(cfg, job_id, [target_of(cfg, n, views[n]) for n in nodes], diagnose,
                                        level=level, timeout=cfg.ctld.preflight_timeout,
                                        run_id=f"slurm-job-{job_id}-preflight")
    if outcome is None:
        log.error("job %s: preflight could not run (%s); letting it start", job_id, why_not)
        return EXIT_OK
    views = {n: _view(slurm, n) for n in nodes}
    rows, err = _rows(slurm, views)
    if err:
        log.error("job %s: %s; draining nothing, letting it start", job_id, err)
        return EXIT_OK
    drained = 0
    for a in preflight(cfg, job_id, outcome, found, views, rows, clock()):
        if a.step is Step.DRAIN:
            fresh = _view(slurm, a.node)
            if fresh is None or fresh.out_of_service:
                log.info("%s changed meanwhile (%s); left", a.node, fresh.describe() if fresh else "unknown")
                continue
            try:
                slurm.drain(a.node, a.reason)
            except SlurmError as e:
                log.error("%s: drain failed: %s", a.node, e)
                continue
            drained += 1
        _say(a)
    took = time.monotonic() - started
    if drained:
        log.warning("job %s: preflight %s in %.1f s drained %d node(s); refusing the job so Slurm requeues it",
                    job_id, outcome, took, drained)
        return EXIT_REQUEUE
    log.info("job %s: preflight %s in %.1f s; the job starts", job_id, outcome, took)
    return EXIT_OK


def _rows(slurm: Slurm, views: Mapping[str, NodeView | None]) -> tuple[list[tuple[str, str, str]], str]:
    parts = sorted({p for v in views.values() if v is not None for p in v.partitions})
    try:
        return slurm.partition_rows(parts), ""
    except SlurmError as e:
        return [], f"sinfo for the circuit breaker failed: {e}"


def _diagnose(cfg: SlurmConfig, job: str, targets: Sequence[Target], diagnose: Diagnose, *, level: str | None,
              timeout: float, run_id: str) -> tuple[str | None, list[Any], str]:
    from robustd.fleet.diagnose import Target as FleetTarget

    if timeout <= 1:
        return None, [], "no time left of slurm.ctld.timeout"
    fleet = [FleetTarget(t, t.rsplit(":", 1)[0].strip("[]")) for _, t in targets]
    node_of = {t: n for n, t in targets}
    c = cfg.ctld
    try:
        d = diagnose(fleet, level=level, port=c.rendezvous_port, timeout=timeout, slow_fraction=c.slow_fraction,
                     tls=c.tls, run_id=run_id)
    except Exception as e:  # noqa: BLE001 - fail open: robustd's own error releases every hold
        log.error("job %s: the diagnosis could not run: %s: %s", job, type(e).__name__, e)
        return None, [], f"{type(e).__name__}: {e}"
    said = "; ".join(f"{s.kind} {node_of.get(s.host, s.host)}: {s.reason}" for s in d.suspects) or "no suspects"
    if not d.suspects and d.outcome != "PASS":  # why there was no verdict: the notes (and each host's)
        notes = [*d.notes, *(f"{node_of.get(r.host, r.host)}: {n}" for r in d.hosts for n in r.notes)]
        said += ("; " + "; ".join(notes[:6]))[:1500] if notes else ""
    log.warning("job %s: diagnosis %s %s in %.1f s: %s", job, d.run_id, d.outcome, d.seconds, said)
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
