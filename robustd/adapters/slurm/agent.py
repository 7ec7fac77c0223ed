"""robustd-slurm: the agent on each Slurm node that drains it when robustd says so, and resumes what it drained.

    robustd-slurm --config /etc/robustd/robustd.yaml     (the `slurm:` section, `listen.unix`, `state_dir`)

It is an ordinary Watch client of the local robustd. It keeps the node's conditions as a GetVerdict
snapshot moved forward by Watch events, saved in its state file with the seq of the last event it
handled, so after a restart of either side it resumes right after that seq: nothing is missed and
nothing is handled twice (a seq the daemon no longer has is OUT_OF_RANGE: it takes a new snapshot).
Slurm is read and written only when the drain-worthy faults change, when a timer is due (the
resume hold-down, a retry after a failed scontrol) and every `slurm.reconcile_interval` (and at
start), when Slurm's state is compared with the verdict and the state file: a drain that failed
because slurmctld was down is redone, a drain whose faults cleared while the agent was down is
resumed after the hold-down, an operator's resume is noticed and respected.

While robustd cannot be reached the agent changes nothing in Slurm: a down daemon must not drain
(or resume) a fleet. Exit status: 0 after SIGTERM/SIGINT, 1 for a bad config.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

from robustd import __version__
from robustd.adapters.common import client
from robustd.adapters.common.model import Table
from robustd.adapters.common.statefile import LockTimeout
from robustd.adapters.common.watch import RPC_TIMEOUT, WatchAgent, WatchStream, agent_parser, start
from robustd.adapters.slurm.actor import Actor
from robustd.adapters.slurm.config import SCHEMA, SlurmConfig
from robustd.adapters.slurm.decide import Do, Health, assess
from robustd.adapters.slurm.model import AgentStateFile, SelfCheck
from robustd.adapters.slurm.slurmcli import NodeNotFound, Slurm, SlurmError

log = logging.getLogger("robustd.slurm")

TICK = 0.25  # the longest the loop sleeps between looks at the stop flag
SAVE_EVERY = 1.0  # the Watch position is saved at most this often (and after every pass and at exit)


def node_name(cfg: SlurmConfig) -> str:
    """slurm.node_name, else what slurmd calls this node in a hook's environment, else the short host name."""
    return cfg.node_name or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def state_path(settings: Any) -> str:
    return settings.section("slurm").state_file or os.path.join(settings.config.state_dir, "slurm.json")


class Agent(WatchAgent):
    def __init__(self, settings: Any, slurm: Slurm | None = None):
        c = settings.config
        self.cfg: SlurmConfig = settings.section("slurm")
        self.socket: str = c.listen.unix
        self.node = node_name(self.cfg)
        self.state_file = AgentStateFile(state_path(settings))
        self.slurm = slurm or Slurm(self.cfg.scontrol, self.cfg.sinfo, self.cfg.command_timeout)
        self.actor = Actor(self.cfg, self.slurm, self.state_file, self.node, socket=self.socket)
        self.diag_timeout = float(c.diagnostics.timeout)
        self.events: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self.stopping = threading.Event()
        self.stream: WatchStream | None = None
        self.table: Table | None = None
        self.summary: tuple[bool, int, str] | None = None  # the faults the last successful pass acted on
        self.saved_seq = -1
        self.last_save = 0.0
        self.next_reconcile = 0.0  # at start
        self.next_retry: float | None = None
        self.retry_backoff = 1.0
        self.wake_at: float | None = None
        self.self_check_after = 0.0
        self.diag_calls: list[Any] = []
        self._last_error = ""
        from robustd.sdnotify import Notifier

        self.notifier = Notifier()
        self.log = log

    # --- the loop -------------------------------------------------------------------------------

    def _resume(self) -> None:
        saved = self.state_file.read()
        if saved.table is not None and saved.node in ("", self.node):
            self.table = saved.table
            self.saved_seq = saved.table.seq
        log.info("robustd-slurm %s: Slurm node %s, robustd at %s, state %s%s", __version__, self.node, self.socket,
                 self.state_file.path, f", resuming after seq {self.table.seq}" if self.table else "")

    def _turn(self) -> None:
        now = time.monotonic()
        connected = False
        if self.stream is None and now >= self.next_connect:
            connected = self._connect()
        if self.stream is None:  # nothing but a reconnect is worth waking for: nothing is decided meanwhile
            due = [self.next_connect]
        else:
            due = [t for t in (self.next_reconcile, self.next_retry, self.wake_at) if t is not None]
        timeout = max(0.0, min([*due, now + TICK]) - now)
        for kind, item, source in self._take(timeout):
            self._handle(kind, item, source)
        if self.stopping.is_set() or self.stream is None or self.table is None:
            return
        now = time.monotonic()
        reconcile = now >= self.next_reconcile
        if reconcile:
            self.next_reconcile = now + self.cfg.reconcile_interval
            if not connected and not self._probe():  # a connect this turn has just done what the probe does
                return
        h = self._health()
        summary = (h.bad, h.newest_fault_seq, h.boot_id)
        timers = [t for t in (self.next_retry, self.wake_at) if t is not None and t <= now]
        if summary != self.summary or timers or reconcile:
            self._pass(h, summary)
        self._save_position()

    def _handle(self, kind: str, item: Any, source: WatchStream) -> None:
        if kind == "event":
            if self.table is not None:
                self.table.apply(int(item.kind), client.cond(item.condition), int(item.seq))
            return
        if source is not self.stream:
            return  # the end of a stream we already replaced
        self._stream_lost(kind, item, f"node {self.node}: robustd unreachable, changing nothing")

    def _connect(self) -> bool:
        """GetVerdict, then Watch from the table's seq; False (and a backoff) when robustd does not answer."""
        if self._open_watch("changing nothing in Slurm until it answers") is None:
            return False
        self.summary = None  # look at Slurm once connected (at start: the reconcile on start)
        return True

    def _probe(self) -> bool:
        """At each reconcile: robustd still answers (else change nothing), and its boot id is current."""
        try:
            v = client.get_verdict(self.socket, RPC_TIMEOUT)
        except client.Unreachable as e:
            self._error(f"reconcile skipped: robustd unreachable ({e})")
            return False
        if self._sync(v):  # the daemon's log was reset under a live stream
            if self.stream is not None:
                self.stream.cancel()
            return False
        return True

    def _health(self) -> Health:
        assert self.table is not None
        return assess(list(self.table.conditions.values()), self.cfg, self.table.seq, self.table.boot_id)

    def _pass(self, h: Health, summary: tuple[bool, int, str]) -> None:
        """One pass of the decisions; every timer that was due is consumed (a failure sets the retry timer)."""
        now = time.monotonic()
        self.wake_at = None
        self.next_retry = None
        self.summary = summary  # taken up: a failure below is retried by its timer, not at every turn
        try:
            r = self.actor.step(h, table=self.table)
        except (SlurmError, LockTimeout) as e:
            level = logging.ERROR if isinstance(e, NodeNotFound) else logging.WARNING
            self._error(f"cannot read node {self.node} from Slurm ({e}); will try again", level)
            self._retry_later(now)
            return
        self.saved_seq = self.table.seq if self.table else self.saved_seq
        self.last_save = now
        self._last_error = ""
        if r.error:
            self._retry_later(now)
            return
        self.retry_backoff = 1.0
        if r.plan.do is Do.WAIT and r.plan.wake_at is not None:
            self.wake_at = now + max(0.0, r.plan.wake_at - time.time())
        elif r.plan.do is Do.SELF_CHECK:
            self._self_check(h)
        self._status(r.state)

    def _retry_later(self, now: float) -> None:
        self.next_retry = now + self.retry_backoff
        self.retry_backoff = min(self.retry_backoff * 2, 30.0, self.cfg.reconcile_interval)

    def _self_check(self, h: Health) -> None:
        """slurm.resume_check after the reboot robustd asked for; only a PASS lets the node resume."""
        now = time.monotonic()
        if now < self.self_check_after:
            self.wake_at = self.self_check_after
            return
        level = self.cfg.resume_check or ""
        log.info("node %s rebooted (boot %s): running the %r diagnostics before it may resume", self.node, h.boot_id,
                 level)
        self.notifier.status(f"node {self.node}: self-check {level} after reboot")
        try:
            report = client.run_diagnostic(self.socket, level, self.diag_timeout, holder=self.diag_calls)
            outcome = client.OUTCOMES.get(report.outcome, "ERROR")
            message = client.report_summary(report) if outcome == "FAIL" else report.message
            result = SelfCheck(boot_id=h.boot_id, outcome=outcome, report_id=report.id, at=time.time(),
                               message=message)
        except (client.Unreachable, client.DiagnosticRefused) as e:
            result = SelfCheck(boot_id=h.boot_id, outcome="ERROR", report_id="", at=time.time(), message=str(e))
        finally:
            self.diag_calls.clear()
        if self.stopping.is_set():
            return
        if result.outcome != "PASS":
            self.self_check_after = time.monotonic() + self.cfg.reconcile_interval
        try:
            self.actor.record_self_check(h, result, table=self.table)
        except (SlurmError, LockTimeout) as e:
            self._error(f"recording the self-check: {e}")
        self.summary = None  # PASS: the next turn resumes (decide.py says when); else look again later

    def _save_position(self) -> None:
        if self.table is None or self.table.seq == self.saved_seq:
            return
        now = time.monotonic()
        if now - self.last_save < SAVE_EVERY:
            return
        try:
            self.actor.save_table(self.table)
            self.saved_seq = self.table.seq
            self.last_save = now
        except (OSError, LockTimeout) as e:
            self._error(f"cannot save the state file {self.state_file.path}: {e}")

    def _status(self, st: Any) -> None:
        if st is None:
            return
        if st.suppressed is not None:
            text = st.suppressed.text()
        elif st.drain is not None:
            text = f"drained by robustd: {st.drain.reason}"
        else:
            text = "in service"
            if st.respect_until_seq:
                text += " (a fault stands; an operator's resume is respected)"
        self.notifier.status(f"node {self.node}: {text}")

    # --- stopping --------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        super()._on_signal(signum, frame)
        for call in list(self.diag_calls):
            call.cancel()

    def _shutdown(self) -> None:
        self._end_stream()
        if self.table is not None and self.table.seq != self.saved_seq:
            try:
                self.actor.lock_timeout = 2.0
                self.actor.save_table(self.table)
            except (OSError, LockTimeout) as e:
                log.error("cannot save the state file %s at exit: %s", self.state_file.path, e)
        log.info("robustd-slurm stopped (watch position seq %s)", self.table.seq if self.table else 0)


def main(argv: list[str] | None = None) -> int:
    from robustd.sdnotify import setup_logging

    args = agent_parser("robustd-slurm", "Drain and resume this Slurm node on robustd's verdicts (the `slurm:` "
                        "section of the config).", "robustd-slurm --check-config --config /etc/robustd/robustd.yaml",
                        "systemctl enable --now robustd-slurm",
                        "robustctl slurm status   # what it drained and why").parse_args(argv)
    settings = start("robustd-slurm", args.config, SCHEMA)
    if settings is None:
        return 1
    if args.check_config:
        print(f"{settings.source}: config OK (Slurm node {node_name(settings.section('slurm'))}, "
              f"state {state_path(settings)})")
        return 0
    setup_logging(settings.config.log_level, identifier="robustd-slurm")  # journald: our own SYSLOG_IDENTIFIER
    return Agent(settings).run()


if __name__ == "__main__":
    sys.exit(main())
