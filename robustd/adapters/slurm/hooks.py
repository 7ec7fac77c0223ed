"""What slurmd runs: `robustctl slurm healthcheck | prolog | epilog`, and the operator's `robustctl slurm status`.

Each hook reads the same config file and shares the agent's state file (hold-down, flap counts,
what robustd drained), applies the same rules once, and fails open: when robustd cannot be
reached, the config cannot be read or anything else goes wrong, it changes nothing and lets the
job run (exit 0), because a hook that failed closed would drain or block a whole fleet at once.

- healthcheck (HealthCheckProgram): the cached verdict (GetVerdict; never runs diagnostics), one
  pass of the rules; always exits 0 and ends within `slurm.hook_timeout` (Slurm kills it at 60 s).
- prolog (Prolog): drains the node itself with robustd's reason when the rules would, and exits 1
  so that slurmd refuses the job (Slurm requeues it, held, and keeps the node drained); 0 otherwise.
- epilog (Epilog): after a failed job (SLURM_JOB_EXIT_CODE non-zero) runs `slurm.epilog_diagnostics`
  through Diagnostics.Run within `slurm.epilog_timeout`; a FAIL drains the node with the report id
  in the reason. Always exits 0 (a failing epilog would make Slurm drain the node for its own reason).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import signal
import sys
import time
from dataclasses import asdict
from types import FrameType
from typing import Any, Mapping

from robustd.adapters.slurm import client
from robustd.adapters.slurm.actor import Actor, Result
from robustd.adapters.slurm.agent import load_settings, node_name, state_path
from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.model import AgentState, NodeView
from robustd.adapters.slurm.rules import Health, assess, fault_text, recent_resumes, respected
from robustd.adapters.slurm.slurmcli import Slurm, SlurmError
from robustd.adapters.slurm.statefile import LockTimeout, StateFile
from robustd.roots import DEFAULT_DEV

log = logging.getLogger("robustd.slurm")

EXIT_OK = 0
EXIT_REFUSE = 1  # prolog: Slurm drains the node (robustd already did) and requeues the job
EXIT_WARNING = 1  # status: SLURM_DRAIN_SUPPRESSED or flapping stands


class _OutOfTime(BaseException):
    """The hook's backstop alarm: whatever still runs is abandoned (fail open)."""


class Hook:
    """One hook's view: the config, the node, the daemon's socket, a Slurm bounded by the hook's budget."""

    def __init__(self, verb: str, config_path: str, socket: str | None, rpc_timeout: float):
        self.verb = verb
        self.settings = load_settings(config_path)  # ConfigError: the caller fails open
        self.cfg: SlurmConfig = self.settings.config.slurm
        self.socket = socket or self.settings.config.listen.unix
        self.node = node_name(self.cfg)
        self.budget = self.cfg.epilog_timeout + 30 if verb == "epilog" else self.cfg.hook_timeout
        self.deadline = time.monotonic() + self.budget
        self.rpc_timeout = rpc_timeout
        self.slurm = Slurm(self.cfg.scontrol, self.cfg.sinfo, self.cfg.command_timeout)
        self.slurm.deadline = self.deadline
        self.store = StateFile(state_path(self.settings))
        self.actor = Actor(self.cfg, self.slurm, self.store, self.node, lock_timeout=max(0.1, self.remaining() / 2))

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


def run(verb: str, config_path: str, socket: str | None, rpc_timeout: float, as_json: bool = False,
        env: Mapping[str, str] | None = None) -> int:
    setup_logging(verb)
    from robustd.config import ConfigError

    try:
        hook = Hook(verb, config_path, socket, rpc_timeout)
    except ConfigError as e:
        log.error("invalid config %s; changing nothing:\n%s", config_path, e)
        return 1 if verb == "status" else EXIT_OK
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
    log.error("refusing the job: node %s is CRITICAL (%s); drained: %s", hook.node, fault_text(h),
              (r.state.drain.reason if r and r.state and r.state.drain else "by someone else, or not yet"))
    return EXIT_REFUSE


def job_failed(env: Mapping[str, str]) -> bool | None:
    """Slurm's epilog environment: SLURM_JOB_EXIT_CODE (a wait status), else SLURM_JOB_EXIT_CODE2 (`code:signal`)."""
    raw = env.get("SLURM_JOB_EXIT_CODE", "").strip()
    if raw.lstrip("-").isdigit():
        return int(raw) != 0
    two = env.get("SLURM_JOB_EXIT_CODE2", "").strip()
    if two:
        try:
            return any(int(p) != 0 for p in two.split(":"))
        except ValueError:
            return None
    return None


def epilog(hook: Hook, env: Mapping[str, str]) -> int:
    level = hook.cfg.epilog_diagnostics
    job = env.get("SLURM_JOB_ID", "?")
    if not level:
        return EXIT_OK
    failed = job_failed(env)
    if failed is None:
        log.warning("job %s: no exit status in the epilog's environment; not diagnosing", job)
        return EXIT_OK
    if not failed:
        return EXIT_OK
    log.warning("job %s failed (exit %s): running the %r diagnostics", job,
                env.get("SLURM_JOB_EXIT_CODE2") or env.get("SLURM_JOB_EXIT_CODE"), level)
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
    try:
        hook.actor.diagnosis(h, report.id, client.report_summary(report), job)
    except (SlurmError, LockTimeout, OSError) as e:
        log.error("diagnostic %s FAILED, but node %s could not be drained: %s", report.id, hook.node, e)
    return EXIT_OK


def status(hook: Hook, as_json: bool) -> int:
    """What robustd-slurm did to this node and why, beside Slurm's own view of it."""
    st = hook.store.read()
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

    lines = [f"node {name}: Slurm " + (node.describe() if node else f"unknown ({slurm_error})")]
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
    lines.append(f"watch position: after seq {st.table.seq if st.table else 0}")
    return render.lines(lines)
