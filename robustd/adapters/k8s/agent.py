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
"""

from __future__ import annotations

import logging
import os
import queue
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
from robustd.adapters.k8s.reconciler import Reconciler, rfc3339
from robustd.adapters.k8s.state import K8sState, K8sStateFile
from robustd.api.v1 import robustd_pb2 as pb

log = logging.getLogger("robustd.k8s")

TICK = 0.25  # the longest the loop sleeps between looks at the stop flag
SAVE_EVERY = 1.0
UNKNOWN_AFTER = 3  # heartbeats without robustd before its conditions become Unknown


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
        self.reconciler = Reconciler(self.cfg, kube, self.node, self.state_file, self.state, clock)
        self.events: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self.stopping = threading.Event()
        self.stream: WatchStream | None = None
        self.unreachable_since: float | None = clock()  # wall clock; None while robustd answers
        self.saved_seq = -1
        self.last_save = 0.0
        self._last_error = ""
        self.gap: tuple[Table, str] | None = None  # the table an OUT_OF_RANGE dropped, and why
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

    def _turn(self) -> None:
        if self.stream is None and time.monotonic() >= self.next_connect:
            self._connect()
        # Only a live Watch's table is acted on: a saved one may be stale while robustd does not answer.
        wait = self.reconciler.step(self.table if self.stream is not None else None, self._down_why())
        self._save_position()
        if self.stream is None:
            wait = min(wait, max(0.0, self.next_connect - time.monotonic()))
        for kind, item, source in self._take(min(wait, TICK)):
            self._handle(kind, item, source)

    def _down_why(self) -> str | None:
        since = self.unreachable_since
        if since is None or self.clock() - since < UNKNOWN_AFTER * self.cfg.heartbeat:
            return None
        return f"robustd-k8s cannot reach robustd at {self.socket} since {rfc3339(since)}: its verdict is unknown"

    def _handle(self, kind: str, item: Any, source: WatchStream) -> None:
        if kind == "event":
            table = self.table
            if table is None:
                return
            cond = client.cond(item.condition)
            prev = table.conditions.get(cond.key)
            seq = int(item.seq)
            if table.apply(int(item.kind), cond, seq) and seq > self.state.events_seq:
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
        if self._open_watch(f"its conditions become Unknown after {UNKNOWN_AFTER} heartbeats") is None:
            return
        self.unreachable_since = None
        self.notifier.status(f"node {self.node}: watching robustd")

    def _sync(self, v: pb.Verdict) -> bool:
        """As every adapter does; a new snapshot also queues the Events the Watch events it stands for would
        have had: against the table before it (after an OUT_OF_RANGE or a reset of robustd's log, with an
        EventsSkipped Event saying so), or every standing condition at a first start."""
        before, why = self.gap or (self.table, "")
        if self.table is not None and v.seq < self.table.seq:
            why = f"robustd's event log was reset: its newest seq {v.seq} is below {self.table.seq}"
        if not super()._sync(v):
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


def main(argv: list[str] | None = None) -> int:
    from kubernetes.config import ConfigException

    from robustd.sdnotify import fatal, setup_logging

    p = agent_parser("robustd-k8s", "Show robustd's verdict on this Kubernetes Node (conditions, events; "
                     "quarantine when configured).", "robustd-k8s --check-config --config /etc/robustd/robustd.yaml",
                     "robustd-k8s --config /etc/robustd/robustd.yaml --kubeconfig ~/.kube/config",
                     "systemctl enable --now robustd-k8s")
    p.add_argument("--kubeconfig", default=None, help="a kubeconfig file (default: k8s.kubeconfig, else in-cluster)")
    args = p.parse_args(argv)
    settings = start("robustd-k8s", args.config, SCHEMA)
    if settings is None:
        return EXIT_CONFIG
    cfg: K8sConfig = settings.section("k8s")
    if args.check_config:
        print(f"{settings.source}: config OK (Node {node_name(cfg)}, state {state_path(settings)})")
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
