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
(or resume) a fleet. SIGHUP re-reads the config (`slurm.mode` shadow -> act among it; see `_reload`).
Exit status: 0 after SIGTERM/SIGINT, 78 (EX_CONFIG) for a bad config.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

from robustd import __version__
from robustd.adapters.common import client
from robustd.adapters.common.config import EXIT_CONFIG
from robustd.adapters.common.model import CLEARED, Cond, Table
from robustd.adapters.common.statefile import LockTimeout
from robustd.adapters.common.watch import RPC_TIMEOUT, WatchAgent, WatchStream, agent_parser, load_settings, start
from robustd.adapters.slurm.actor import Actor
from robustd.adapters.slurm.config import SCHEMA, SlurmConfig
from robustd.adapters.slurm.decide import Do, Health, assess, drain_worthy
from robustd.adapters.slurm.model import AgentStateFile, SelfCheck
from robustd.adapters.slurm.slurmcli import NodeNotFound, Slurm, SlurmError
from robustd.config import ConfigError

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
        self.settings = settings
        self.reload_requested = threading.Event()
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
        self.summary: tuple[bool, int, str, int] | None = None  # the faults the last successful pass acted on
        self.saved_seq = -1
        self.last_save = 0.0
        self.next_reconcile = 0.0  # at start
        self.next_retry: float | None = None
        self.retry_backoff = 1.0
        self.wake_at: float | None = None
        self.self_check_after = 0.0
        self.diag_calls: list[Any] = []
        self._last_error = ""
        self.stale: set[tuple[str, str, int]] = set()  # faults read as stale news (slurm.max_event_age)
        self.stale_events = 0
        self.shadow_counts: dict[str, int] = {}  # as in the state file, for /metrics
        self.metrics_server: Any = None
        self.catch_up: tuple[int, float] | None = None  # (robustd's seq at connect, until when) while replaying
        from robustd.sdnotify import Notifier

        self.notifier = Notifier()
        self.log = log

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGHUP, lambda signum, frame: self.reload_requested.set())
        self._serve_metrics()
        return super().run()

    def _serve_metrics(self) -> None:
        """slurm.metrics_address: robustd_slurm_mode and robustd_slurm_shadow_decisions_total{kind} (the counts kept
        in the state file, so they survive a restart) on /metrics. A failure to listen is logged, not fatal."""
        if not self.cfg.metrics_address:
            return
        from robustd.metrics_http import serve

        try:
            self.metrics_server = serve(self.cfg.metrics_address, _Metrics(self))
        except OSError as e:
            log.error("slurm.metrics_address %s: cannot listen (%s); no metrics", self.cfg.metrics_address, e)
            return
        log.info("metrics on http://%s/metrics", self.cfg.metrics_address)

    def _reload(self) -> None:
        """SIGHUP (`systemctl reload`): the `slurm:` section re-read and used from the next pass on. A bad file
        keeps the old config (its key and line logged). Shadow -> act carries out only what is decided after the
        switch: act's own state never learnt the shadow's would-drains, so nothing of the past is replayed, and a
        fault still standing is drained by the next pass as act decides on its current view (unless it was read
        as stale news). What the socket, node name, state file and Slurm commands need is a restart."""
        self.reload_requested.clear()
        path = self.settings.source
        try:
            settings = load_settings(path, SCHEMA)
        except ConfigError as e:
            log.error("reload: invalid config, keeping the one in use:\n%s", e)
            return
        new: SlurmConfig = settings.section("slurm")
        old = self.cfg
        fixed = [k for k in ("node_name", "state_file", "scontrol", "sinfo", "command_timeout", "metrics_address")
                 if getattr(new, k) != getattr(old, k)]
        if settings.config.listen.unix != self.socket:
            fixed.append("listen.unix")
        if fixed:
            log.warning("reload: %s changed; takes effect at the next restart (keeping the old value)",
                        ", ".join(fixed))
            new = new.model_copy(update={k: getattr(old, k) for k in fixed if k != "listen.unix"})
        self.cfg = new
        self.actor.cfg = new
        self.next_reconcile = min(self.next_reconcile, time.monotonic() + new.reconcile_interval)
        self.summary = None  # a pass under the new config
        log.info("reloaded %s: slurm.mode %s%s", path, new.mode, f" (was {old.mode})" if new.mode != old.mode else "")

    def _resume(self) -> None:
        saved = self.state_file.read()
        if saved.table is not None and saved.node in ("", self.node):
            self.table = saved.table
            self.saved_seq = saved.table.seq
            self.stale = set(saved.stale)
            self.shadow_counts = dict(saved.shadow.counts) if saved.shadow else {}
            self.stale_events = saved.stale_events
        log.info("robustd-slurm %s: Slurm node %s, robustd at %s, state %s%s", __version__, self.node, self.socket,
                 self.state_file.path, f", resuming after seq {self.table.seq}" if self.table else "")

    def _turn(self) -> None:
        if self.reload_requested.is_set():
            self._reload()
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
        if self.catch_up is not None:
            # Act on the current view only: not on a replayed fault whose clearing is still on its way.
            if self.table.seq < self.catch_up[0] and now < self.catch_up[1]:
                return
            self.catch_up = None
        reconcile = now >= self.next_reconcile
        if reconcile:
            self.next_reconcile = now + self.cfg.reconcile_interval
            if not connected and not self._probe():  # a connect this turn has just done what the probe does
                return
        h = self._health()
        summary = (h.bad, h.newest_fault_seq, h.boot_id, len(h.stale))
        timers = [t for t in (self.next_retry, self.wake_at) if t is not None and t <= now]
        if summary != self.summary or timers or reconcile:
            self._pass(h, summary)
        self._save_position()

    def _handle(self, kind: str, item: Any, source: WatchStream) -> None:
        if kind == "event":
            if self.table is not None:
                c = client.cond(item.condition)
                if self.table.apply(int(item.kind), c, int(item.seq)):
                    self._age(int(item.kind), c, item)
            return
        if source is not self.stream:
            return  # the end of a stream we already replaced
        self._stream_lost(kind, item, f"node {self.node}: robustd unreachable, changing nothing")

    def _age(self, kind: int, c: Cond, ev: Any) -> None:
        """An event older than slurm.max_event_age when read starts no drain: the fault it raised is marked stale
        (logged, counted) until its next change, which is news again."""
        self.stale = {k for k in self.stale if k[:2] != c.key}
        if kind == CLEARED or not drain_worthy(c, self.cfg):
            return
        age = time.time() - ev.at.ToNanoseconds() / 1e9
        if age > self.cfg.max_event_age:
            self.stale.add((c.component, c.code, c.seq))
            self.stale_events += 1
            log.warning("stale event seq %d: %s on %s (action %s) happened %.0fs ago, more than slurm.max_event_age "
                        "%gs: no drain for it", c.seq, c.code, c.component, c.action.name, age,
                        self.cfg.max_event_age)

    def _connect(self) -> bool:
        """GetVerdict, then Watch from the table's seq; False (and a backoff) when robustd does not answer."""
        v = self._open_watch("changing nothing in Slurm until it answers")
        if v is None:
            return False
        # Not "connecting" any more, even while Slurm does not answer yet (the next pass then tells the node's state).
        self.notifier.status(f"node {self.node}: connected to robustd (seq {v.seq}, boot {v.boot_id})")
        self.summary = None  # look at Slurm once connected (at start: the reconcile on start)
        self.catch_up = (int(v.seq), time.monotonic() + RPC_TIMEOUT)  # first the replay up to robustd's head
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
        return assess(list(self.table.conditions.values()), self.cfg, self.table.seq, self.table.boot_id,
                      frozenset(self.stale))

    def _pass(self, h: Health, summary: tuple[bool, int, str, int]) -> None:
        """One pass of the decisions; every timer that was due is consumed (a failure sets the retry timer)."""
        now = time.monotonic()
        self.wake_at = None
        self.next_retry = None
        self.summary = summary  # taken up: a failure below is retried by its timer, not at every turn
        try:
            r = self.actor.step(h, table=self.table, stale_events=self.stale_events)
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
        if r.state is not None and r.state.shadow is not None:
            self.shadow_counts = dict(r.state.shadow.counts)
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
        if self.cfg.mode == "shadow" and st.shadow is not None:
            sh = st.shadow.state
            last = st.shadow.recent[-1]["text"] if st.shadow.recent else "no decision yet"
            held = f"would hold it drained: {sh.drain.reason}" if sh.drain is not None else "would keep it in service"
            self.notifier.status(f"node {self.node}: shadow mode, {held} (last: {last})")
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
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.table is not None and self.table.seq != self.saved_seq:
            try:
                self.actor.lock_timeout = 2.0
                self.actor.save_table(self.table)
            except (OSError, LockTimeout) as e:
                log.error("cannot save the state file %s at exit: %s", self.state_file.path, e)
        log.info("robustd-slurm stopped (watch position seq %s)", self.table.seq if self.table else 0)


class _Metrics:
    """The agent's /metrics, read at each scrape (a prometheus_client Collector)."""

    KINDS = ("drain", "down", "reboot", "resume", "set_reason")

    def __init__(self, agent: Agent):
        self.agent = agent

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        mode = GaugeMetricFamily("robustd_slurm_mode", "robustd-slurm's slurm.mode: 1 = shadow, 0 = act")
        mode.add_metric([], 1.0 if self.agent.cfg.mode == "shadow" else 0.0)
        yield mode
        would = CounterMetricFamily("robustd_slurm_shadow_decisions",
                                    "Decisions shadow mode logged and did not carry out, by kind", labels=["kind"])
        counts = dict(self.agent.shadow_counts)
        for kind in sorted(set(self.KINDS) | set(counts)):
            would.add_metric([kind], float(counts.get(kind, 0)))
        yield would


def main(argv: list[str] | None = None) -> int:
    from robustd.sdnotify import setup_logging

    args = agent_parser("robustd-slurm", "Drain and resume this Slurm node on robustd's verdicts (the `slurm:` "
                        "section of the config).", "robustd-slurm --check-config --config /etc/robustd/robustd.yaml",
                        "systemctl enable --now robustd-slurm",
                        "robustctl slurm status   # what it drained and why").parse_args(argv)
    settings = start("robustd-slurm", args.config, SCHEMA)
    if settings is None:
        # Distinct from a crash, --check-config (ExecStartPre=) included: the unit does not restart on it.
        return EXIT_CONFIG
    if args.check_config:
        print(f"{settings.source}: config OK (Slurm node {node_name(settings.section('slurm'))}, "
              f"state {state_path(settings)})")
        return 0
    setup_logging(settings.config.log_level, identifier="robustd-slurm")  # journald: our own SYSLOG_IDENTIFIER
    return Agent(settings).run()


if __name__ == "__main__":
    sys.exit(main())
