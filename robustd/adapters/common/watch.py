"""What every adapter does the same way: read robustd.yaml, follow the daemon's Watch stream, live as a
service (`WatchAgent`), and start as a console script (`--config`, `--check-config`, `--version`, examples).

robustd-slurm and robustd-k8s each keep the node's conditions as a GetVerdict snapshot moved forward
by Watch events (`table_from`, `WatchStream`); only what they do with it differs.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import threading
import time
from types import FrameType
from typing import Any

import grpc

from robustd import __version__
from robustd.adapters.common import client
from robustd.adapters.common.model import Table
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.cli.args import examples as cli_examples
from robustd.config import ConfigError, Schema, Settings, load_config_or_defaults
from robustd.roots import DEFAULT_CONFIG

RPC_TIMEOUT = 5.0  # GetVerdict on the local socket
CONNECT_BACKOFF = (0.2, 5.0)  # seconds between tries while robustd does not answer: first, most


def table_from(v: pb.Verdict) -> Table:
    """A GetVerdict snapshot as the adapters' plain table of conditions."""
    conds = [client.cond(c) for c in v.conditions]
    return Table(seq=int(v.seq), boot_id=v.boot_id, conditions={c.key: c for c in conds})


class WatchStream(threading.Thread):
    """Watch(from_seq) in a thread, its events and its end put on the agent's queue."""

    def __init__(self, sock: str, from_seq: int, out: queue.Queue[tuple[str, Any, Any]]):
        super().__init__(name="watch", daemon=True)
        self.sock = sock
        self.from_seq = from_seq
        self.out = out
        self.call: Any = None
        self.lock = threading.Lock()
        self.cancelled = False

    def run(self) -> None:
        channel = None
        try:
            channel = client.open_channel(self.sock)
            with self.lock:
                if self.cancelled:
                    return
                self.call = pb_grpc.NodeHealthStub(channel).Watch(pb.WatchRequest(from_seq=self.from_seq))
            for ev in self.call:
                self.out.put(("event", ev, self))
            self.out.put(("end", "the daemon closed the stream", self))
        except grpc.RpcError as e:
            self.out.put(("error", e, self))
        except client.Unreachable as e:
            self.out.put(("end", str(e), self))
        finally:
            if channel is not None:
                channel.close()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.call is not None:
                self.call.cancel()


def load_settings(path: str | None, schema: Schema) -> Settings:
    """What an adapter reads of robustd.yaml (its section and the core keys in `schema`), validated as the
    daemon validates them (ConfigError names key and line); the checks and the rest are the daemon's.
    None: the default path, whose absence means built-in defaults as for robustd (load_config_or_defaults)."""
    return load_config_or_defaults(path, schema)


def agent_parser(prog: str, description: str, *examples: str) -> argparse.ArgumentParser:
    """An adapter's command line: --config, --check-config, --version, and its examples in --help."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=cli_examples(*examples))
    p.add_argument("--config", default=None, help=f"robustd's config file (default {DEFAULT_CONFIG}; "
                   "built-in defaults when that does not exist)")
    p.add_argument("--check-config", action="store_true",
                   help="validate the config and exit 0 (valid) or 78 (EX_CONFIG)")
    p.add_argument("--version", action="version", version=f"{prog} {__version__}")
    return p


def start(prog: str, config_path: str | None, schema: Schema) -> Settings | None:
    """Logging under `prog`'s name and the validated settings; None (reason told, err in the journal) if bad."""
    from robustd.sdnotify import fatal, setup_logging

    setup_logging("info", identifier=prog)
    try:
        return load_settings(config_path, schema)
    except ConfigError as e:
        fatal(f"{prog}: invalid config:\n{e}")
        return None


class WatchAgent:
    """The life of an adapter process: signals, READY=1, turns until a stop signal, an orderly end.

    A subclass sets `events`, `stopping`, `stream`, `notifier`, `node`, `socket`, `table`, `log` and
    `_last_error`, and implements `_resume` (read its state file, log what it resumes), `_turn` (one pass
    of its loop) and `_shutdown`.
    """

    events: queue.Queue[tuple[str, Any, Any]]
    stopping: threading.Event
    stream: WatchStream | None
    notifier: Any
    node: str
    socket: str
    table: Table | None
    connect_backoff: float = CONNECT_BACKOFF[0]
    next_connect: float = 0.0
    log: logging.Logger
    _last_error: str

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._resume()
        self.notifier.ready(f"node {self.node}: connecting to robustd")
        try:
            while not self.stopping.is_set():
                self._turn()
        finally:
            self._shutdown()
        return 0

    def _resume(self) -> None:
        raise NotImplementedError

    def _turn(self) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        raise NotImplementedError

    def _take(self, timeout: float) -> list[tuple[str, Any, Any]]:
        """What the Watch thread queued, waiting at most `timeout` for the first (at most 10,000 at once)."""
        items = []
        try:
            items.append(self.events.get(timeout=timeout))
            while len(items) < 10_000:
                items.append(self.events.get_nowait())
        except queue.Empty:
            pass
        return items

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping.is_set():
            os._exit(1)  # a second signal: the operator means it
        self.stopping.set()

    def _error(self, text: str, level: int = logging.WARNING) -> None:
        """Log `text` once, not again while the same error repeats (`_last_error = ""` once it is over)."""
        if text != self._last_error:
            self.log.log(level, "%s", text)
            self._last_error = text

    def _open_watch(self, unreachable: str) -> pb.Verdict | None:
        """GetVerdict, the table brought up to it (`_sync`), then Watch from the table's seq. None, with
        `unreachable` and the reason logged once and the next try backed off, when robustd does not answer."""
        try:
            v = client.get_verdict(self.socket, RPC_TIMEOUT)
        except client.Unreachable as e:
            self._error(f"robustd unreachable ({e}); {unreachable}")
            self.next_connect = time.monotonic() + self.connect_backoff
            self.connect_backoff = min(self.connect_backoff * 2, CONNECT_BACKOFF[1])
            return None
        self._sync(v)
        assert self.table is not None
        self.stream = WatchStream(self.socket, self.table.seq, self.events)
        self.stream.start()
        self.connect_backoff = CONNECT_BACKOFF[0]
        self._last_error = ""
        self.log.info("watching robustd from seq %d (node verdict seq %d, boot %s)", self.table.seq, v.seq,
                      v.boot_id)
        return v

    def _sync(self, v: pb.Verdict) -> bool:
        """Bring the table up to the daemon's verdict `v`: its boot id, or a new snapshot when there is no
        table yet or the daemon's newest seq is below ours (its event log was reset). True: a new snapshot."""
        if self.table is not None and v.seq >= self.table.seq:
            self.table.boot_id = v.boot_id
            return False
        if self.table is not None:
            self.log.warning("robustd's newest seq %d is below ours (%d): its event log was reset; new snapshot",
                             v.seq, self.table.seq)
        self.table = table_from(v)
        return True

    def _stream_lost(self, kind: str, item: Any, status: str, gap_note: str = "") -> None:
        """The live Watch stream ended: reconnect after the backoff and say so (`status` to systemd). An
        OUT_OF_RANGE means robustd pruned past the table's seq: a new snapshot at once (`gap_note` says
        what the adapter cannot replay of the span in between)."""
        self.stream = None
        seq = self.table.seq if self.table else 0
        if kind == "error" and isinstance(item, grpc.RpcError) and item.code() == grpc.StatusCode.OUT_OF_RANGE:
            self.next_connect = time.monotonic()
            self.log.warning("robustd no longer has the events after seq %s (%s): taking a new snapshot%s",
                             seq, item.details(), gap_note)
            self.table = None
            return
        self.next_connect = time.monotonic() + self.connect_backoff
        why = f"{item.code().name}: {item.details()}" if kind == "error" else item
        if not self.stopping.is_set():
            self.log.warning("watch stream lost (%s); reconnecting to resume after seq %s", why, seq)
            self.notifier.status(status)

    def _end_stream(self) -> None:
        """STOPPING=1 to systemd, and the Watch stream cancelled (its thread given 2 s)."""
        self.notifier.stopping()
        if self.stream is not None:
            self.stream.cancel()
            self.stream.join(timeout=2)
