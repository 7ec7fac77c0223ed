"""What slurmd runs: `robustctl slurm healthcheck | prolog | epilog`, and the operator's `robustctl slurm status`.

Each hook reads the same config file and shares the agent's state file (hold-down, flap counts,
what robustd drained), applies the same decisions once, and fails open: when robustd cannot be
reached, the config cannot be read or anything else goes wrong, it changes nothing and lets the
job run (exit 0), because a hook that failed closed would drain or block a whole fleet at once.

- healthcheck (HealthCheckProgram): the cached verdict (GetVerdict; never runs diagnostics), one
  pass of the decisions; always exits 0 and ends within `slurm.hook_timeout` (Slurm kills it at 60 s).
- prolog (Prolog): drains the node itself with robustd's reason when the rules would, and exits 1
  so that slurmd refuses the job (Slurm requeues it, held, and keeps the node drained); 0 otherwise.
- epilog (Epilog): after a failed job (SLURM_JOB_EXIT_CODE non-zero) first triages its logs
  (`slurm.triage`: StdOut/StdErr and `slurm.triage_logs`, read as root only when the job's user owns
  them), logs the verdict, captures the stacks of a hung job's leftover processes (Tracer), and runs
  `slurm.epilog_diagnostics` through Diagnostics.Run within `slurm.epilog_timeout` only when the
  machine may be to blame (infra likely or unknown, next step diagnose; never for user_code, oom_gpu,
  oom_host); a FAIL drains the node with the report id and the triage class in the reason. Always
  exits 0 (a failing epilog would make Slurm drain the node for its own reason).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import re
import signal
import sys
import time
from dataclasses import asdict
from types import FrameType
from typing import TYPE_CHECKING, Any, Mapping

from robustd.adapters.common import client
from robustd.adapters.common.statefile import LockTimeout
from robustd.adapters.common.watch import load_settings
from robustd.adapters.slurm.actor import Actor, Result
from robustd.adapters.slurm.agent import node_name, state_path
from robustd.adapters.slurm.config import SCHEMA, SlurmConfig
from robustd.adapters.slurm.decide import Health, assess, fault_text, recent_resumes, respected
from robustd.adapters.slurm.hung_job import capture_hang
from robustd.adapters.slurm.jobs import job_failed, job_logs, job_status, worth_diagnosing
from robustd.adapters.slurm.model import AgentState, AgentStateFile, NodeView
from robustd.adapters.slurm.slurmcli import Slurm, SlurmError
from robustd.roots import DEFAULT_DEV

if TYPE_CHECKING:
    from robustd.triage import LogText, Triage

log = logging.getLogger("robustd.slurm")

EXIT_OK = 0
EXIT_REFUSE = 1  # prolog: Slurm drains the node (robustd already did) and requeues the job
EXIT_WARNING = 1  # status: SLURM_DRAIN_SUPPRESSED or flapping stands
EXIT_CONFIG = 78  # status: the config cannot be used (sysexits EX_CONFIG; 1 would read as a warning)


class _OutOfTime(BaseException):
    """The hook's backstop alarm: whatever still runs is abandoned (fail open)."""


class Hook:
    """One hook's view: the config, the node, the daemon's socket, a Slurm bounded by the hook's budget."""

    def __init__(self, verb: str, config_path: str | None, socket: str | None, rpc_timeout: float):
        self.verb = verb
        self.settings = load_settings(config_path, SCHEMA)  # ConfigError: the caller fails open
        self.cfg: SlurmConfig = self.settings.section("slurm")
        self.socket = socket or self.settings.config.listen.unix
        self.node = node_name(self.cfg)
        self.budget = self.cfg.epilog_timeout + 30 if verb == "epilog" else self.cfg.hook_timeout
        self.deadline = time.monotonic() + self.budget
        self.rpc_timeout = rpc_timeout
        self.slurm = Slurm(self.cfg.scontrol, self.cfg.sinfo, self.cfg.command_timeout)
        self.slurm.deadline = self.deadline
        self.state_file = AgentStateFile(state_path(self.settings))
        self.actor = Actor(self.cfg, self.slurm, self.state_file, self.node,
                           lock_timeout=max(0.1, self.remaining() / 2), socket=self.socket,
                           evidence_timeout=max(0.1, min(self.rpc_timeout, self.remaining() / 4)))

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def health(self) -> Health:
        v = client.get_verdict(self.socket, max(0.1, min(self.rpc_timeout, self.remaining())))
        return assess([client.cond(c) for c in v.conditions], self.cfg, int(v.seq), v.boot_id)


def setup_logging(verb: str) -> None:
    """stderr, and syslog where there is one: slurmd keeps nothing a HealthCheckProgram prints."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(logging.Formatter(f"robustctl slurm {verb}: %(message)s"))
    root.addHandler(err)
    dev_log = os.path.join(DEFAULT_DEV, "log")
    if os.path.exists(dev_log):
        try:
            sys_handler = logging.handlers.SysLogHandler(address=dev_log,
                                                         facility=logging.handlers.SysLogHandler.LOG_DAEMON)
            sys_handler.setFormatter(logging.Formatter(f"robustctl-slurm[{os.getpid()}]: {verb}: %(message)s"))
            sys_handler.setLevel(logging.WARNING)
            root.addHandler(sys_handler)
        except OSError:
            pass


def run(verb: str, config_path: str | None, socket: str | None, rpc_timeout: float, as_json: bool = False,
        env: Mapping[str, str] | None = None) -> int:
    setup_logging(verb)
    from robustd.config import ConfigError

    if verb in ("epilog-ctld", "prolog-ctld"):
        return _ctld(verb, config_path, os.environ if env is None else env)
    try:
        hook = Hook(verb, config_path, socket, rpc_timeout)
    except ConfigError as e:
        log.error("invalid config; changing nothing:\n%s", e)  # e names the file
        return EXIT_CONFIG if verb == "status" else EXIT_OK
    if verb == "status":
        return status(hook, as_json)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(hook.budget) + 3)
    try:
        if verb == "healthcheck":
            return healthcheck(hook)
        if verb == "prolog":
            return prolog(hook)
        return epilog(hook, os.environ if env is None else env)
    except _OutOfTime:
        log.error("did not finish within %.0fs; changing nothing more", hook.budget)
        return EXIT_OK
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _ctld(verb: str, config_path: str | None, env: Mapping[str, str]) -> int:
    """The controller's hooks (robustd/adapters/slurm/ctld_hook.py): fail open, and exit 0 whatever happens,
    but for prolog-ctld's 1 when its preflight drained a suspect (Slurm then requeues the job)."""
    from robustd.config import ConfigError

    try:
        cfg: SlurmConfig = load_settings(config_path, SCHEMA).section("slurm")
    except ConfigError as e:
        log.error("invalid config; holding nothing:\n%s", e)  # e names the file
        return EXIT_OK
    from robustd.adapters.slurm import ctld_hook
    from robustd.adapters.slurm.ctld_triage import TRIAGE_WAIT, job_triage
    from robustd.fleet.diagnose import diagnose

    epilog = verb == "epilog-ctld"
    budget = (cfg.ctld.timeout if epilog else cfg.ctld.preflight_timeout) + 30
    slurm = Slurm(cfg.scontrol, cfg.sinfo, cfg.command_timeout)
    slurm.deadline = time.monotonic() + budget
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(budget) + 3)
    try:
        if not epilog:
            return ctld_hook.prolog_ctld(cfg, env, slurm, diagnose)
        wait = min(TRIAGE_WAIT, cfg.ctld.timeout / 5)
        return ctld_hook.epilog_ctld(
            cfg, env, slurm, diagnose,
            triage=lambda job, targets: job_triage(cfg, slurm, env, job, targets, time.monotonic() + wait))
    except _OutOfTime:
        log.error("did not finish within %.0fs; changing nothing more", budget)
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - the controller's hooks fail open
        log.error("%s: %s; changing nothing more", type(e).__name__, e)
        return EXIT_OK
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _OutOfTime


def _step(hook: Hook, h: Health) -> Result | None:
    try:
        return hook.actor.step(h)
    except (SlurmError, LockTimeout, OSError) as e:
        log.error("node %s: %s; changing nothing", hook.node, e)
        return None


def _health(hook: Hook, what: str) -> Health | None:
    """The daemon's verdict; None (logged: "...; `what`") when robustd cannot be reached."""
    try:
        return hook.health()
    except client.Unreachable as e:
        log.warning("%s; %s", e, what)
        return None


def healthcheck(hook: Hook) -> int:
    h = _health(hook, "changing nothing")
    if h is not None:
        _step(hook, h)
    return EXIT_OK


def prolog(hook: Hook) -> int:
    h = _health(hook, "letting the job start")
    if h is None:
        return EXIT_OK
    r = _step(hook, h)  # a good verdict too: keeps the hold-down and ownership current, like the healthcheck
    if not h.bad:
        return EXIT_OK
    if r is not None and (r.suppressed is not None or (r.state is not None and respected(r.state, h))):
        return EXIT_OK  # the breaker, or an operator's resume, keeps this node in service
    if hook.actor.shadow:
        log.warning("would refuse the job: node %s is CRITICAL (%s); slurm.mode is shadow: letting it start",
                    hook.node, fault_text(h))
        return EXIT_OK
    log.error("refusing the job: node %s is CRITICAL (%s); drained: %s", hook.node, fault_text(h),
              (r.state.drain.reason if r and r.state and r.state.drain else "by someone else, or not yet"))
    return EXIT_REFUSE


def epilog(hook: Hook, env: Mapping[str, str]) -> int:
    level = hook.cfg.epilog_diagnostics
    job = env.get("SLURM_JOB_ID", "?")
    if not level and not hook.cfg.triage:
        return EXIT_OK
    failed = job_failed(env)
    if failed is None:
        log.warning("job %s: no exit status in the epilog's environment; not diagnosing", job)
        return EXIT_OK
    if not failed:
        return EXIT_OK
    if hook.cfg.ctld.epilog and (nodes := job_nodes(hook, env)) >= 2:
        return defer_to_ctld(hook, env, job, nodes)
    verdict = epilog_triage(hook, env, job) if hook.cfg.triage else None
    if verdict is not None and not worth_diagnosing(verdict):
        log.warning("job %s: not diagnosing: triage says %s (infra %s, next %s)", job, verdict.klass, verdict.infra,
                    verdict.next)
        return EXIT_OK
    if not level:
        if verdict is not None:
            log.info("job %s: triage suggests diagnostics (%s), but slurm.epilog_diagnostics is not set", job,
                     verdict.level or "any")
        return EXIT_OK
    log.warning("job %s failed (exit %s): running the %r diagnostics%s", job,
                env.get("SLURM_JOB_EXIT_CODE2") or env.get("SLURM_JOB_EXIT_CODE"), level,
                f" (triage: {verdict.klass}, infra {verdict.infra}; it would test {verdict.level or 'anything'})"
                if verdict is not None else "")
    try:
        report = client.run_diagnostic(hook.socket, level, hook.cfg.epilog_timeout)
    except client.Unreachable as e:
        log.warning("%s; not diagnosing", e)
        return EXIT_OK
    except client.DiagnosticRefused as e:
        log.warning("diagnostics refused: %s", e)
        return EXIT_OK
    outcome = client.OUTCOMES.get(report.outcome, "ERROR")
    if outcome != "FAIL":
        log.info("job %s: diagnostic %s: %s %s", job, report.id, outcome, report.message)
        return EXIT_OK
    try:
        h = hook.health()
    except client.Unreachable:
        h = Health(faults=(), seq=0, boot_id="")
    summary = client.report_summary(report) + (f"; triage {verdict.klass}" if verdict is not None else "")
    try:
        hook.actor.diagnosis(h, report.id, summary, job)
    except (SlurmError, LockTimeout, OSError) as e:
        log.error("diagnostic %s FAILED, but node %s could not be drained: %s", report.id, hook.node, e)
    return EXIT_OK


def job_nodes(hook: Hook, env: Mapping[str, str]) -> int:
    """How many nodes the job ran on: slurmd 22.05 gives the node Epilog SLURM_NODELIST (`n[1-3]`; the
    controller's hooks get SLURM_JOB_NODELIST); one plain name is one node, a list or range is expanded by
    `scontrol show hostnames`; neither: 1 (the node epilog then does what it does for one node)."""
    nodelist = (env.get("SLURM_JOB_NODELIST", "") or env.get("SLURM_NODELIST", "")).strip()
    if not nodelist:
        return 1
    if not re.search(r"[\[,]", nodelist):
        return 1
    try:
        return len(hook.slurm.hostnames(nodelist))
    except SlurmError as e:
        log.warning("cannot expand SLURM_JOB_NODELIST %r: %s; taken as one node", nodelist[:200], e)
        return 1


def defer_to_ctld(hook: Hook, env: Mapping[str, str], job: str, nodes: int) -> int:
    """A failed multi-node job with the controller's hook on (`slurm.ctld.epilog`): the controller diagnoses
    the job's nodes together, so this node runs no test of its own (never two runs racing for one node). It
    still triages what this node can read and leaves the verdict in its robustd (Diagnostics.RecordTriage),
    where the controller's hook looks when it cannot read the job's output itself."""
    log.warning("job %s failed on %d nodes: the controller's EpilogSlurmctld diagnoses it (slurm.ctld.epilog); "
                "no diagnostics here", job, nodes)
    verdict = None
    if hook.cfg.triage:  # a verdict only from logs this node read: none is "no log here", not "unknown"
        try:
            logs = job_logs(hook.cfg, hook.slurm, env, job)
        except Exception as e:  # noqa: BLE001 - fail open: the controller then treats infra as unknown
            log.error("job %s: reading its logs failed (%s: %s)", job, type(e).__name__, e)
            logs = []
        verdict = epilog_triage(hook, env, job, logs) if logs else None
        if not logs:
            log.info("job %s: no log of the job readable on this node", job)
    from robustd.api.triage import response

    try:
        client.record_triage(hook.socket, job, response(verdict) if verdict is not None else None,
                             max(0.1, min(hook.rpc_timeout, hook.remaining())))
    except client.Unreachable as e:
        log.warning("job %s: triage verdict not left for the controller: %s", job, e)
    return EXIT_OK


# --- the epilog's triage ---------------------------------------------------------------------------------

def epilog_triage(hook: Hook, env: Mapping[str, str], job: str, logs: list[LogText] | None = None) -> Triage | None:
    """Triage the failed job (logged, whatever it says); a hang's leftover processes get their stacks captured.

    None when triage itself failed (logged): the epilog then diagnoses as it did before triage existed.
    """
    try:
        from robustd.triage import triage

        status = job_status(env) or (None, None)
        if logs is None:
            logs = job_logs(hook.cfg, hook.slurm, env, job)
        verdict = triage(logs, exit_code=status[0], signal=status[1])
    except Exception as e:  # noqa: BLE001 - fail open: a bug in the judge must not change what the epilog does
        log.error("job %s: triage failed (%s: %s); diagnosing as without triage", job, type(e).__name__, e)
        return None
    log.warning("%s", verdict_line(job, verdict, len(logs)))
    if verdict.klass == "hang":
        try:
            capture_hang(job, hook.socket, hook.settings.roots(), hook.settings.config.tracer,
                         hook.settings.config.state_dir, hook.remaining())
        except Exception as e:  # noqa: BLE001 - fail open
            log.error("job %s: stack capture failed (%s: %s)", job, type(e).__name__, e)
    return verdict


def verdict_line(job: str, t: Triage, logs: int) -> str:
    from robustd.cli.render import printable

    step = t.next + (f" ({t.level})" if t.next == "diagnose" and t.level else "")
    line = f"job {job} triage of {logs} log{'' if logs == 1 else 's'}: {t.klass}, infra {t.infra}, next {step}"
    if t.ranks:
        line += ", ranks " + ",".join(str(r) for r in t.ranks[:8]) + (" ..." if len(t.ranks) > 8 else "")
    if t.reason:
        line += f": {t.reason}"
    if t.evidence:
        e = t.evidence[0]
        line += f"; evidence {e.file}:{e.line}: {e.text[:300]}"
    return printable(line)


def status(hook: Hook, as_json: bool) -> int:
    """What robustd-slurm did to this node and why, beside Slurm's own view of it."""
    st = hook.state_file.read()
    node: NodeView | None = None
    slurm_error = ""
    try:
        node = hook.slurm.node(hook.node)
    except SlurmError as e:
        slurm_error = str(e)
    warning = st.suppressed is not None or (st.flapping and st.drain is not None)
    if as_json:
        doc: dict[str, Any] = st.to_json()
        doc.pop("watch", None)
        doc["watch_seq"] = st.table.seq if st.table else 0
        doc["node"] = hook.node
        doc["mode"] = hook.cfg.mode
        doc["slurm"] = ({"state": node.state, "flags": sorted(node.flags), "reason": node.reason,
                         "partitions": list(node.partitions)} if node else {"error": slurm_error})
        if st.suppressed:
            doc["warning"] = {"code": "SLURM_DRAIN_SUPPRESSED", **asdict(st.suppressed)}
        print(json.dumps(doc, indent=2))
        return EXIT_WARNING if warning else EXIT_OK
    print(status_text(hook.node, hook.cfg, st, node, slurm_error, time.time()))
    return EXIT_WARNING if warning else EXIT_OK


def status_text(name: str, cfg: SlurmConfig, st: AgentState, node: NodeView | None, slurm_error: str,
                now: float) -> str:
    from robustd.cli import render

    def when(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

    lines = [f"node {name}: Slurm " + (node.describe() if node else f"unknown ({slurm_error})"), f"mode: {cfg.mode}"]
    if st.drain:
        lines.append(f"drained by robustd ({st.drain.mode}) since {when(st.drain.at)}: {st.drain.reason}")
        if st.flapping:
            lines.append("flapping: held drained until someone resumes it")
        elif st.ok_since is not None:
            lines.append(f"verdict below the drain threshold since {when(st.ok_since)}; resume due "
                         f"{when(st.ok_since + cfg.resume_after)}")
        if st.self_check:
            sc = st.self_check
            lines.append(f"self-check after reboot: {sc.outcome} {sc.report_id} {sc.message}".rstrip())
    else:
        lines.append("not drained by robustd")
    recent = recent_resumes(st, now)
    lines.append(f"resumes by robustd in the last 24h: {len(recent)} (slurm.max_resumes {cfg.max_resumes})")
    if st.respect_until_seq:
        lines.append(f"someone resumed robustd's drain while a fault stood: faults up to seq {st.respect_until_seq} "
                     "are left alone until a new fault event")
    if st.suppressed:
        lines.append(f"WARNING {st.suppressed.text()} (since {when(st.suppressed.since)})")
    if st.stale_events:
        lines.append(f"stale events read (older than slurm.max_event_age {cfg.max_event_age:g}s, no drain for them): "
                     f"{st.stale_events}")
    if st.shadow is not None and (cfg.mode == "shadow" or st.shadow.counts):
        sh = st.shadow
        counts = ", ".join(f"{k} {v}" for k, v in sorted(sh.counts.items())) or "none yet"
        lines.append(f"shadow decisions (would, not carried out): {counts}")
        lines.extend(f"  {when(r['at'])} {r['text']}" for r in sh.recent)
        if sh.state.drain is not None:
            lines.append(f"shadow: would hold {name} drained since {when(sh.state.drain.at)}: {sh.state.drain.reason}")
        if sh.state.suppressed is not None:
            lines.append(f"shadow: {sh.state.suppressed.text()}")
    lines.append(f"watch position: after seq {st.table.seq if st.table else 0}")
    return render.lines(lines)
