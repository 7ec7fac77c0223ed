"""robustd-k8s: the agent on each Kubernetes node that shows robustd's verdict on the Node object.

    robustd-k8s --config /etc/robustd/robustd.yaml [--kubeconfig PATH]   (the `k8s:` section, `listen.unix`)

An ordinary Watch client of the local robustd, built from robustd-slurm's parts: the same gRPC
client, the same condition table (a GetVerdict snapshot moved forward by Watch events) and the same
Watch thread, resuming after the seq saved in its state file, so after a restart of either side
nothing is missed and nothing is posted twice. Each turn the reconciler (reconciler.py) brings the
Node toward the table: conditions, Events, quarantine. While robustd cannot be reached nothing is
decided; after three heartbeats without it robustd's conditions become Unknown. Exit status: 0 after
SIGTERM/SIGINT, 78 (EX_CONFIG) for a bad config (with or without --check-config: the unit does not restart
on it), 1 for an unusable kubeconfig (a service account token may yet be mounted: worth a restart).

It acts only on its current view: after a (re)connect the events robustd logged meanwhile are replayed
for their Events, but nothing else is decided until the table has caught up with the verdict read at
connect, so a fault raised and cleared while the agent was away changes nothing; and a fault whose news
is older than `k8s.max_event_age` cordons nothing. SIGHUP re-reads the config (a bad one is logged, key
and line, and the old one kept); `k8s.mode` moves between act and shadow without a restart.

    robustd-k8s --status [--config PATH]   the mode and the recent decisions, from the state file
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
from typing import Any, Callable

import grpc

from robustd import __version__
from robustd.adapters.common import client
from robustd.adapters.common.config import EXIT_CONFIG
from robustd.adapters.common.model import CLEARED, Table
from robustd.adapters.common.watch import WatchAgent, WatchStream, agent_parser, start
from robustd.adapters.k8s import families
from robustd.adapters.k8s.config import SCHEMA, K8sConfig
from robustd.adapters.k8s.kube import Kube, api_client
from robustd.adapters.k8s.reconciler import Reconciler, news_key, rfc3339
from robustd.adapters.k8s.state import DECISIONS, K8sState, K8sStateFile
from robustd.api.v1 import robustd_pb2 as pb

log = logging.getLogger("robustd.k8s")

TICK = 0.25  # the longest the loop sleeps between looks at the stop flag
SAVE_EVERY = 1.0
UNKNOWN_AFTER = 3  # heartbeats without robustd before its conditions become Unknown
CATCH_UP_LIMIT = 30.0  # seconds a replay after a connect may take before the agent decides on what it has
RESTART_KEYS = ("node_name", "kubeconfig", "state_file", "request_timeout", "metrics_address")  # read at start
EVIDENCE_TIMEOUT = 5.0  # seconds robustd has to make the bundle for a cordon (as robustd-slurm gives it for a drain)


def node_name(cfg: K8sConfig) -> str:
    """k8s.node_name, else $NODE_NAME (the downward API in the DaemonSet), else the host name."""
    return cfg.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


def state_path(settings: Any) -> str:
    return settings.section("k8s").state_file or os.path.join(settings.config.state_dir, "k8s.json")


class Agent(WatchAgent):
    def __init__(self, settings: Any, kube: Kube, clock: Callable[[], float] = time.time):
        c = settings.config
        self.cfg: K8sConfig = settings.section("k8s")
        self.socket: str = c.listen.unix
        self.node = node_name(self.cfg)
        self.state_file = K8sStateFile(state_path(settings))
        self.state = K8sState()
        self.clock = clock
        self.reconciler = Reconciler(self.cfg, kube, self.node, self.state_file, self.state, clock,
                                     evidence=self._evidence)
        self.events: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self.stopping = threading.Event()
        self.stream: WatchStream | None = None
        self.unreachable_since: float | None = clock()  # wall clock; None while robustd answers
        self.saved_seq = -1
        self.last_save = 0.0
        self._last_error = ""
        self.gap: tuple[Table, str] | None = None  # the table an OUT_OF_RANGE dropped, and why
        self.config_path: str = settings.source
        self.reload_requested = False
        self.current_from = 0  # the verdict's seq read at connect: decided on once the table has reached it
        self.connected_at = 0.0  # monotonic
        from robustd.sdnotify import Notifier

        self.notifier = Notifier()
        self.log = log

    @property
    def table(self) -> Table | None:
        return self.state.table

    @table.setter
    def table(self, table: Table | None) -> None:
        self.state.table = table

    def _resume(self) -> None:
        saved = self.state_file.read()
        if saved.node in ("", self.node):
            self.state.__dict__.update(saved.__dict__)  # the reconciler holds this object
        self.state.node = self.node
        if self.table is not None:
            self.saved_seq = self.table.seq
        log.info("robustd-k8s %s: Node %s, robustd at %s, state %s%s", __version__, self.node, self.socket,
                 self.state_file.path, f", resuming after seq {self.table.seq}" if self.table else "")

    def run(self) -> int:
        signal.signal(signal.SIGHUP, self._on_hup)
        if self.cfg.metrics_address:
            self._serve_metrics(self.cfg.metrics_address)
        return super().run()

    def _serve_metrics(self, address: str) -> None:
        """/metrics on k8s.metrics_address (the daemon's bounded server, robustd/metrics_http.py); a port that
        cannot be had is logged, and the agent runs on without it (its decisions do not depend on it)."""
        from robustd.metrics_http import serve

        try:
            serve(address, Metrics(self), key="k8s.metrics_address")
            log.info("metrics on http://%s/metrics", address)
        except OSError as e:
            log.error("k8s.metrics_address %s: cannot listen (%s): no metrics", address, e)

    def _on_hup(self, signum: int, frame: Any) -> None:
        self.reload_requested = True

    def reload(self) -> bool:
        """Re-read the config file: the new `k8s:` section takes effect at once (mode included); a bad file
        keeps the old config (logged with key and line); keys read only at start are said to need a restart."""
        from robustd.adapters.common.watch import load_settings
        from robustd.config import ConfigError

        self.reload_requested = False
        try:
            new: K8sConfig = load_settings(self.config_path, SCHEMA).section("k8s")
        except ConfigError as e:
            log.error("reload of %s refused, the config in force is kept:\n%s", self.config_path, e)
            return False
        old = self.cfg
        later = [k for k in RESTART_KEYS if getattr(new, k) != getattr(old, k)]
        if later:
            log.warning("reload: %s take effect at the next restart", ", ".join(f"k8s.{k}" for k in later))
            new = new.model_copy(update={k: getattr(old, k) for k in later})
        self.cfg = new
        self.reconciler.reconfigure(new)
        log.info("reloaded %s (k8s.mode %s)", self.config_path, new.mode)
        return True

    def _turn(self) -> None:
        if self.reload_requested:
            self.reload()
        if self.stream is None and time.monotonic() >= self.next_connect:
            self._connect()
        # Only a live Watch's table is acted on: a saved one may be stale while robustd does not answer; and
        # while the Watch replays what happened before the connect, only its Events are posted.
        live = self.table if self.stream is not None and self._caught_up() else None
        wait = self.reconciler.step(live, self._down_why())
        self._save_position()
        if self.stream is None:
            wait = min(wait, max(0.0, self.next_connect - time.monotonic()))
        for kind, item, source in self._take(min(wait, TICK)):
            self._handle(kind, item, source)

    def _caught_up(self) -> bool:
        if self.table is None or self.table.seq >= self.current_from:
            return True
        if time.monotonic() - self.connected_at > CATCH_UP_LIMIT:
            log.warning("the replay after the connect has not reached seq %d within %gs (at seq %d): deciding on "
                        "the table as it is", self.current_from, CATCH_UP_LIMIT, self.table.seq)
            self.current_from = self.table.seq
            return True
        return False

    def _down_why(self) -> str | None:
        since = self.unreachable_since
        if since is None or self.clock() - since < UNKNOWN_AFTER * self.cfg.heartbeat:
            return None
        return f"robustd-k8s cannot reach robustd at {self.socket} since {rfc3339(since)}: its verdict is unknown"

    def _evidence(self, component: str, code: str, reason: str) -> str | None:
        """robustd's evidence bundle for a cordon (at most EVIDENCE_TIMEOUT: the cordon never waits longer)."""
        return client.evidence(self.socket, [component], [code], reason, EVIDENCE_TIMEOUT)

    def _handle(self, kind: str, item: Any, source: WatchStream) -> None:
        if kind == "event":
            table = self.table
            if table is None:
                return
            cond = client.cond(item.condition)
            prev = table.conditions.get(cond.key)
            seq = int(item.seq)
            applied = table.apply(int(item.kind), cond, seq)
            if applied:
                if int(item.kind) == CLEARED:
                    self.state.seen.pop(news_key(cond), None)
                else:
                    self.state.seen[news_key(cond)] = _seconds(item.at) or self.clock()
            if applied and seq > self.state.events_seq:
                kind_ = int(item.kind)
                spec = families.event_for(kind_, prev if kind_ == CLEARED and prev else cond, seq, prev)
                if spec is not None:
                    self.reconciler.queue(spec)
            return
        if source is not self.stream:
            return
        self.unreachable_since = self.clock()
        before = self.table
        self._stream_lost(kind, item, f"node {self.node}: robustd unreachable",
                          " (the new snapshot's Events stand for the changes in between)")
        if self.table is None and before is not None:  # OUT_OF_RANGE: the next snapshot is told against it
            self.gap = (before, str(item.details() or "").split(";")[0] if isinstance(item, grpc.RpcError) else "")

    def _connect(self) -> None:
        v = self._open_watch(f"its conditions become Unknown after {UNKNOWN_AFTER} heartbeats")
        if v is None:
            return
        self.current_from = int(v.seq)
        self.connected_at = time.monotonic()
        self.unreachable_since = None
        self.notifier.status(f"node {self.node}: watching robustd")

    def _sync(self, v: pb.Verdict) -> bool:
        """As every adapter does; a new snapshot also queues the Events the Watch events it stands for would
        have had: against the table before it (after an OUT_OF_RANGE or a reset of robustd's log, with an
        EventsSkipped Event saying so), or every standing condition at a first start. The time of each
        condition's news is its last sighting (a snapshot's), unless a Watch event said later."""
        before, why = self.gap or (self.table, "")
        if self.table is not None and v.seq < self.table.seq:
            why = f"robustd's event log was reset: its newest seq {v.seq} is below {self.table.seq}"
        fresh = super()._sync(v)
        if fresh:
            self.state.seen = {}
        for c in v.conditions:
            self.state.seen.setdefault(news_key(client.cond(c)), _seconds(c.last_seen) or self.clock())
        if not fresh:
            return False
        self.gap = None
        assert self.table is not None
        specs = families.snapshot_events(before.conditions.values() if before else None,
                                         self.table.conditions.values(), int(v.seq))
        if before is not None:
            specs.append(families.skipped_event(before.seq, int(v.seq), why or "robustd no longer has them",
                                                len(specs)))
        for spec in specs:
            self.reconciler.queue(spec)
        self.state.events_seq = max(self.state.events_seq, int(v.seq))
        return True

    def _save_position(self) -> None:
        """The Watch position (and the Events queued with it) at most once a second; at exit always."""
        if self.table is None or self.table.seq == self.saved_seq:
            return
        now = time.monotonic()
        if now - self.last_save < SAVE_EVERY and not self.stopping.is_set():
            return
        self.reconciler.save()
        self.saved_seq = self.table.seq
        self.last_save = now

    def _shutdown(self) -> None:
        self._end_stream()
        self.last_save = 0.0
        self._save_position()
        log.info("robustd-k8s stopped (watch position seq %s)", self.table.seq if self.table else 0)


class Metrics:
    """robustd_k8s_decisions_total{mode,decision} (from the state file's counts, so they survive a restart)
    and robustd_k8s_shadow_mode (1 while k8s.mode is shadow), read at each scrape."""

    def __init__(self, agent: Agent):
        self.agent = agent

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        decisions = CounterMetricFamily("robustd_k8s_decisions", "Decisions robustd-k8s made (act: carried out; "
                                        "shadow: logged as 'would ...')", labels=["mode", "decision"])
        counts = {m: dict(kinds) for m, kinds in list(self.agent.state.decisions.items())}
        for mode in ("act", "shadow"):
            kinds = counts.get(mode, {})
            for kind in [*DECISIONS, *sorted(set(kinds) - set(DECISIONS))]:
                decisions.add_metric([mode, kind], kinds.get(kind, 0))
        yield decisions
        shadow = GaugeMetricFamily("robustd_k8s_shadow_mode", "1 while k8s.mode is shadow (nothing is written to the "
                                   "API server), 0 in act")
        shadow.add_metric([], 1.0 if self.agent.cfg.mode == "shadow" else 0.0)
        yield shadow


def _seconds(ts: Any) -> float:
    """A protobuf Timestamp as wall-clock seconds (0.0 when unset)."""
    return float(ts.seconds) + ts.nanos / 1e9


def status_text(path: str, node: str, mode: str) -> str:
    """`robustd-k8s --status`: the mode in force, the decisions counted per mode and kind, the recent ones
    (shadow's prefixed "would"), read from the state file alone (no API server, no robustd)."""
    st = K8sStateFile(path).read()
    lines = [f"robustd-k8s on Node {st.node or node}: mode {mode} (state {path})"]
    for m in ("act", "shadow"):
        kinds = st.decisions.get(m) or {}
        if kinds:
            order = [k for k in DECISIONS if k in kinds] + sorted(set(kinds) - set(DECISIONS))
            lines.append(f"decisions ({m}): " + ", ".join(f"{k} {kinds[k]}" for k in order))
    if not st.decisions:
        lines.append("decisions: none yet")
    if st.quarantine is not None:
        q = st.quarantine
        lines.append(f"quarantine{' (decided in shadow: nothing on the Node)' if q.shadow else ''}: {q.fault}, "
                     f"action {q.action}, since {rfc3339(q.since)}")
    if st.recent:
        lines.append("recent:")
        lines += [f"  {rfc3339(d.at)} {d.words}" for d in st.recent]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from kubernetes.config import ConfigException

    from robustd.sdnotify import fatal, setup_logging

    p = agent_parser("robustd-k8s", "Show robustd's verdict on this Kubernetes Node (conditions, events; "
                     "quarantine when configured).", "robustd-k8s --check-config --config /etc/robustd/robustd.yaml",
                     "robustd-k8s --config /etc/robustd/robustd.yaml --kubeconfig ~/.kube/config",
                     "systemctl enable --now robustd-k8s",
                     "robustd-k8s --status --config /etc/robustd/robustd.yaml",
                     "systemctl reload robustd-k8s   # SIGHUP: k8s.mode shadow/act and the k8s: section, no restart")
    p.add_argument("--kubeconfig", default=None, help="a kubeconfig file (default: k8s.kubeconfig, else in-cluster)")
    p.add_argument("--status", action="store_true",
                   help="print the mode and the recent decisions (from the state file) and exit")
    args = p.parse_args(argv)
    settings = start("robustd-k8s", args.config, SCHEMA)
    if settings is None:
        return EXIT_CONFIG
    cfg: K8sConfig = settings.section("k8s")
    if args.check_config:
        print(f"{settings.source}: config OK (Node {node_name(cfg)}, state {state_path(settings)})")
        return 0
    if args.status:
        print(status_text(state_path(settings), node_name(cfg), cfg.mode))
        return 0
    setup_logging(settings.config.log_level, identifier="robustd-k8s")
    kubeconfig = args.kubeconfig or cfg.kubeconfig
    try:
        api = api_client(kubeconfig)
    except (ConfigException, OSError, ValueError) as e:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
        fatal(f"robustd-k8s: cannot use {where}: {e}")
        return 1
    return Agent(settings, Kube(api, cfg.request_timeout)).run()


if __name__ == "__main__":
    sys.exit(main())
