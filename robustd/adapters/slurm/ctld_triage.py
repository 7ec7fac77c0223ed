"""Where the controller's hook (EpilogSlurmctld) gets a failed job's triage verdict from.

The controller runs once per job with the whole node list, but the job's output lives wherever the user
wrote it. Two sources, in order:

1. **The job's output, read by the controller** (shared storage: `scontrol show job`'s StdOut/StdErr and
   `slurm.triage_logs`, read as the node epilog reads them, `jobs.job_logs`: only regular files owned by
   the job's user). The logs are judged by one of the job's nodes through `Diagnostics.Triage` (the first
   whose robustd answers), so the nodes' rules decide, even where the controller's robustctl is older;
   when no node answers, the same judge runs here (robustd.triage is a library).
2. **What the node epilogs left** (no shared storage): with `slurm.ctld.epilog` on, the node epilog of a
   multi-node job triages its node's copy of the output and records the verdict in its own robustd
   (`Diagnostics.RecordTriage`, disruptive: it steers the controller's decision); the controller asks
   each node with `Diagnostics.GetTriage` for a while (the node epilogs run at the same time as this
   hook), and takes the worst-for-the-machine answer: infra likely over unknown over unlikely.

Neither: None, infra unknown, and the gate diagnoses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.ctld import JobEnd, TriageSummary
from robustd.adapters.slurm.slurmcli import Slurm

if TYPE_CHECKING:
    from robustd.triage import LogText

log = logging.getLogger("robustd.slurm")

CTLD_MAX_LOGS = 32  # logs the controller sends in one Diagnostics.Triage request
CTLD_READ_BYTES = 3 << 20  # all of them together: below listen.max_message_bytes' 4 MiB default
RPC_TIMEOUT = 15.0  # one Triage or GetTriage call
ASK_NODES = 2  # nodes asked to judge the logs before the controller judges them itself
TRIAGE_WAIT = 30.0  # the whole triage before the hold, at most (and at most a fifth of slurm.ctld.timeout)
WAIT_FOR_EPILOGS = 20.0  # of which the node epilogs' verdicts are waited for
POLL = 1.0
_INFRA_RANK = {"likely": 0, "unknown": 1, "unlikely": 2}

Target = tuple[str, str]  # (node name, "addr:port") of a node's robustd


def summary_of(t: object, source: str) -> TriageSummary:
    """A robustd.triage.Triage or a TriageResponse as the gate reads it."""
    klass = getattr(t, "klass", None) or getattr(t, "class")
    return TriageSummary(klass=str(klass), infra=str(t.infra), next=str(t.next),
                         source=source)


def request_of(logs: Sequence[LogText], status: tuple[int | None, str | None]) -> object:
    from robustd.api.v1 import robustd_pb2 as pb

    req = pb.TriageRequest(logs=[pb.TriageLog(name=lg.name, data=lg.data, offset=lg.offset) for lg in logs],
                           signal=status[1] or "")
    if status[0] is not None:
        req.exit_code = status[0]
    return req


def job_triage(cfg: SlurmConfig, slurm: Slurm, env: Mapping[str, str], job: JobEnd, targets: Sequence[Target],
               deadline: float, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> TriageSummary | None:
    """The job's verdict from its output (judged by a node, else here), else from the node epilogs, else None."""
    from robustd.adapters.slurm.jobs import job_logs, job_status

    status = job_status(env) or (None, None)
    try:
        logs = job_logs(cfg, slurm, env, job.job, max_logs=CTLD_MAX_LOGS, read_bytes=CTLD_READ_BYTES)
    except Exception as e:  # noqa: BLE001 - fail open: no verdict is "infra unknown"
        log.error("job %s: reading its output failed (%s: %s)", job.job, type(e).__name__, e)
        logs = []
    if logs:
        return _judge(cfg, job, logs, status, targets, deadline, clock)
    if not cfg.ctld.epilog:
        return None
    return epilogs_verdict(cfg, job, targets, min(deadline, clock() + WAIT_FOR_EPILOGS), clock, sleep)


def _judge(cfg: SlurmConfig, job: JobEnd, logs: Sequence[LogText], status: tuple[int | None, str | None],
           targets: Sequence[Target], deadline: float, clock: Callable[[], float]) -> TriageSummary | None:
    from robustd.cli.client import Client, CliError

    req = request_of(logs, status)
    for node, target in targets[:ASK_NODES]:
        if (left := deadline - clock()) < 1:
            break
        try:
            got = Client(None, target, min(RPC_TIMEOUT, left), tls=cfg.ctld.tls).call("Triage", req,
                                                                                     service="Diagnostics")
        except CliError as e:
            log.info("job %s: triage by %s failed: %s", job.job, node, e)
            continue
        t = summary_of(got, f"the job's output, judged by {node}")
        log.warning("job %s: triage of %d log(s) by %s: %s, infra %s, next %s: %s", job.job, len(logs), node,
                    t.klass, t.infra, t.next, getattr(got, "reason", ""))
        return t
    try:
        from robustd.triage import triage

        verdict = triage(list(logs), exit_code=status[0], signal=status[1])
    except Exception as e:  # noqa: BLE001 - fail open
        log.error("job %s: triage failed (%s: %s); infra unknown", job.job, type(e).__name__, e)
        return None
    t = summary_of(verdict, "the job's output, judged by the controller")
    log.warning("job %s: triage of %d log(s) here (no node answered): %s, infra %s, next %s: %s", job.job,
                len(logs), t.klass, t.infra, t.next, verdict.reason)
    return t


def epilogs_verdict(cfg: SlurmConfig, job: JobEnd, targets: Sequence[Target], until: float,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> TriageSummary | None:
    """The verdicts the job's node epilogs recorded, asked of each node until each has answered (a node epilog
    that read no log records that too) or `until`; of several, the one that blames the machine most (an NCCL
    error on one node outweighs a SIGTERM elsewhere)."""
    from robustd.api.v1 import robustd_pb2 as pb
    from robustd.cli.client import Client, CliError

    pending = dict(targets)
    found: list[TriageSummary] = []
    while pending:
        for node, target in list(pending.items()):
            client = Client(None, target, min(RPC_TIMEOUT, max(0.5, until - clock())), tls=cfg.ctld.tls)
            try:
                got = client.call("GetTriage", pb.GetTriageRequest(job_id=job.job), service="Diagnostics")
            except CliError as e:
                if not str(e).startswith("NOT_FOUND"):  # unreachable or refusing: asking again will not help
                    log.info("job %s: %s's triage: %s", job.job, node, e)
                    del pending[node]
                continue
            del pending[node]
            if got.HasField("verdict"):
                found.append(summary_of(got.verdict, f"node {node}'s epilog"))
        if not pending or clock() + POLL > until:
            break
        sleep(POLL)
    if pending:
        log.info("job %s: no triage from %s within the wait", job.job, ", ".join(pending))
    if not found:
        log.info("job %s: no node epilog left a triage verdict", job.job)
        return None
    best = min(found, key=lambda t: (_INFRA_RANK.get(t.infra, 1), t.next != "diagnose"))
    log.warning("job %s: triage from %s: %s, infra %s, next %s (%d node(s) had one)", job.job, best.source,
                best.klass, best.infra, best.next, len(found))
    return best
