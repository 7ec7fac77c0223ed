"""robustd's composition root: config → store → checks → policy → engine → API → READY.

The daemon answers only once every enabled check has started (the kmsg reader is positioned)
and the signal handlers are installed; READY=1 goes out at that moment.

This module is the lifecycle (start, tick, stop, signals, reload); the parts it assembles live beside it:
checkset.py (which checks run, their code table, what they publish), server.py (the gRPC and /metrics
listeners), startup.py (the state lock, ports, the socket path), reload.py (what SIGHUP applies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Mapping

import grpc
from grpc_health.v1 import health, health_pb2

from robustd import __version__, checkset, reload, server
from robustd.api.diagnostics import DiagnosticsServicer
from robustd.api.diagnostics_convert import migrate_reports
from robustd.api.evidence import EvidenceServicer
from robustd.api.servicer import NodeHealthServicer
from robustd.api.tracer import TracerServicer
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.watch_slots import WatchSlots
from robustd.authz import Authorizer
from robustd.boots import BootHistory
from robustd.check import Check, CheckConfig, CheckContext
from robustd.checkset import discover_checks
from robustd.cli.args import examples
from robustd.config import ConfigError, Schema, Settings, levels_note, load_config, load_config_or_defaults
from robustd.cpuinfo import cpu_model
from robustd.diagnostics.manager import DiagnosticsManager
from robustd.diagnostics.shelf import Shelf
from robustd.engine import Engine
from robustd.evidence import EvidenceStore, message_fit
from robustd.inventory import GpuInventory
from robustd.model import Event, Severity, worst
from robustd.owned import Owned
from robustd.policy import Policy
from robustd.reads import ThreadReads
from robustd.roots import DEFAULT_CONFIG, read_boot_id
from robustd.runner import Runner, on_grid
from robustd.sdnotify import Notifier, fatal, setup_logging
from robustd.startup import StartError, lock_state_dir, prepare_socket_path
from robustd.store import Store
from robustd.writer import ThreadWriter

log = logging.getLogger("robustd")

NODE_SERVICE = "robustd.node"  # grpc.health.v1 name: SERVING unless the node is CRITICAL
# Hold-down clears, watchdog pings and STATUS= run at this pace; each wake of the loop costs ~100 µs of
# CPU, so not faster than clears need (issue 15's budget).
TICK = 0.5
PRUNE_EVERY = 60.0
SHUTDOWN_BUDGET = 1.5  # seconds for an orderly stop, all steps together
SHUTDOWN_BACKSTOP = 8.0  # if the stop itself hangs (a call that ignores every limit), exit anyway
# A reload reads the config and the files it names (listen.tls's, extra rule files) in a thread, within this:
# a file on a dead NFS server must not hold the event loop, nor the reload forever.
RELOAD_READ_TIMEOUT = 10.0


class Daemon:
    def __init__(self, settings: Settings, check_types: Mapping[str, type[Check]], config_path: str,
                 overrides: Mapping[str, Any], schema: Schema):
        self.settings = settings
        self.check_types = check_types
        self.schema = schema  # what a reload validates: the same as the start
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = Notifier()
        self.stop_requested = asyncio.Event()
        self.stop_count = 0
        self.reloading: asyncio.Task[None] | None = None
        self.reading: asyncio.Future[Settings] | None = None  # a reload's read of the config, in a thread
        self.ticker: asyncio.Task[None] | None = None
        self.server: grpc.aio.Server | None = None
        self.metrics_server: Any = None
        self.last_watchdog: float | None = None  # time.monotonic() of the last WATCHDOG=1 (robustd/metrics.py)
        self.socket_id: tuple[int, int] | None = None
        self.state_lock: int | None = None
        self._message_bytes = settings.config.listen.max_message_bytes  # the server's, set again when it starts

    # -- composition ---------------------------------------------------------------------------
    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, stop: 0 after a signal, 1 when the start failed.

        Stopping is bounded whatever holds on (Watch streams, a running stop-time test, a poll stuck in
        NVML, idle relay connections, a state disk that does not answer): each step has a time limit
        within SHUTDOWN_BUDGET, and main() exits the process without waiting on threads stuck in the kernel.
        """
        self._install_signals()  # first: a signal during the start ends the start
        starting = asyncio.ensure_future(self._start())
        stopping = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if not starting.done():
            log.info("stop requested while starting")
            starting.cancel()
            await asyncio.wait({starting}, timeout=SHUTDOWN_BUDGET / 3)
        elif (err := starting.exception()) is not None:
            log.error("cannot start: %s", _one_line(err))
            if not isinstance(err, StartError):
                log.debug("start failure", exc_info=err)
            code = 1
        else:
            await stopping
        stopping.cancel()
        if code == 0:
            log.info("stopping")
        await self._stop()
        return code

    async def _start(self) -> None:
        cfg = self.settings.config
        self.state_lock = lock_state_dir(cfg.state_dir)  # a second daemon on this state fails here, at once
        try:
            self.boot_id = read_boot_id(cfg.roots.boot_id)
        except (OSError, ValueError) as e:
            raise StartError(f"roots.boot_id: cannot read {cfg.roots.boot_id}: {getattr(e, 'strerror', None) or e}"
                             ) from None
        self.store = Store(cfg.state_dir)  # never fails for the state disk: a read-only one means degraded
        migrate_reports(self.store)  # diagnostic reports of earlier versions, before anything else writes
        self._start_cursors = self.store.cursors()  # read once: the checks start from them, the journal keeps them
        self.runner = self._make_runner(self.settings)
        await self.runner.start_sources()
        table = checkset.code_table(self.runner.states, self.settings)
        owned = Owned(lambda: self.settings.roots().sys, lambda: [g.bus_id for g in self._gpu_inventory().devices])
        self.policy = Policy(table, self.boot_id, boots=BootHistory(self.store.raised_in_boots()), owned=owned)
        self.policy.configure(table, cfg.policy)
        standing = self.store.conditions()  # read once: the policy takes the conditions, the journal their seqs
        self.policy.load(standing, time.time())
        self.engine = Engine(self.policy, self.store, writer=ThreadWriter(asyncio.get_running_loop()),
                             standing=standing, reads=ThreadReads(), cursors=self._start_cursors)
        if self.store.open_error:
            log.error("state_dir %s: the event log cannot be written (%s); serving verdicts from memory and "
                      "retrying every second", cfg.state_dir, self.store.open_error)
        if self.store.meta("boot_id") != self.boot_id:
            cleared = self.engine.reboot(self.boot_id)
            log.info("boot id is %s (new boot); cleared %d conditions of the previous boot", self.boot_id,
                     len(cleared))
        self.engine.prune(cfg.retention.max_age, cfg.retention.max_events)
        shelf = Shelf(self.store, self.engine.journal, self.engine.reads)
        self.diag = DiagnosticsManager(shelf, self.engine.view, self.engine.submit,
                                       lambda: self.settings.config.diagnostics, cfg.node_name, cfg.state_dir,
                                       self._gpu_inventory, cpu_model(self.settings.roots()))
        await self.diag.recover()
        self._start_metrics()  # before the socket: a port in use fails the start before any client connects
        self.health = health.aio.HealthServicer()
        self.server = await self._serve()
        self.runner.run()
        self.engine.listeners.append(self._on_events)
        await self._update_health()
        self.notifier.ready(self._summary())
        log.info("robustd %s ready on %s (node %s, %d checks; %s)", __version__, cfg.listen.unix, cfg.node_name,
                 len(self.runner.states), levels_note(cfg.diagnostics))
        self.ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="tick")

    async def _stop(self) -> None:
        """Tear down whatever was started, each step bounded; safe after a partial start."""
        self.notifier.stopping()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_BUDGET
        backstop = threading.Timer(SHUTDOWN_BACKSTOP, _forced_exit, (f"shutdown did not finish within "
                                                                     f"{SHUTDOWN_BACKSTOP:g}s",))
        backstop.daemon = True
        backstop.start()
        if self.ticker is not None:
            self.ticker.cancel()
        engine: Engine | None = getattr(self, "engine", None)
        if engine is not None:
            engine.end_watches()  # Watch streams end now; their clients resume by seq
        diag: DiagnosticsManager | None = getattr(self, "diag", None)
        if diag is not None and diag.running is not None:
            await _bounded("the running diagnostic", diag.cancel(diag.running.id), deadline, 0.5)
        health_servicer = getattr(self, "health", None)
        if health_servicer is not None:
            await _bounded("health", health_servicer.enter_graceful_shutdown(), deadline, 0.2)
        if self.server is not None:
            await _bounded("the gRPC server", self.server.stop(grace=0.25), deadline, 0.5)
        front = getattr(self, "front", None)
        if front is not None:
            await _bounded("the Unix socket relay", front.close(), deadline, 0.3)
            self._remove_socket()
        authz: Authorizer | None = getattr(self, "authz", None)
        if authz is not None:
            authz.close()  # the refusals still counted are logged, not lost
        watches: WatchSlots | None = getattr(self, "watches", None)
        if watches is not None:
            watches.close()
        runner: Runner | None = getattr(self, "runner", None)
        if runner is not None:
            await _bounded("the checks", runner.stop(), deadline, 0.5)
        if self.metrics_server is not None:
            self.metrics_server.server_close()  # its serving thread is a daemon thread
        if engine is not None:
            await engine.close(max(0.3, deadline - loop.time()))
        elif getattr(self, "store", None) is not None:
            self.store.close()
        backstop.cancel()

    def _remove_socket(self) -> None:
        """Unlink the public socket if it is still the one this daemon made (never another's)."""
        path = self.settings.config.listen.unix
        try:
            st = os.lstat(path)
        except OSError:
            return
        if self.socket_id == (st.st_dev, st.st_ino):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _make_runner(self, settings: Settings) -> Runner:
        instances = [(cls(), settings.checks[name]) for name, cls in self.check_types.items()]
        return Runner(instances, self._context, lambda report: self.engine.submit(report),
                      standing=lambda component, code: self.engine.view.standing(component, code))

    def _context(self, check: Check, cfg: CheckConfig) -> CheckContext:
        return CheckContext(name=check.name, node_name=self.settings.config.node_name, roots=self.settings.roots(),
                            config=cfg, state_dir=self.settings.config.state_dir,
                            cursor=self._cursor(check.name), log=logging.getLogger(f"robustd.checks.{check.name}"),
                            traffic_source=lambda: checkset.traffic(self.runner.states))

    def _cursor(self, check: str) -> dict[str, str]:
        """Where a stream check resumes: the log's cursors read once at start, and once the journal runs, its
        memory of them, seeded from that same read (a reload must not read the log on the event loop)."""
        engine: Engine | None = getattr(self, "engine", None)
        return dict(self._start_cursors.get(check, {})) if engine is None else engine.view.cursor(check)

    def _gpu_inventory(self) -> GpuInventory:
        """What the running GPU check published (no GPUs without one)."""
        return checkset.gpu_inventory(self.runner.states)

    async def _serve(self) -> grpc.aio.Server:
        cfg = self.settings.config
        listen = cfg.listen
        self._message_bytes = listen.max_message_bytes  # a reload does not change a listening server's limit
        prepare_socket_path(listen.unix)
        self.front = server.unix_front(listen)
        self.authz = Authorizer(lambda: self.settings.config.authz, self.front)
        grpc_server = server.grpc_server(listen, self.authz)
        self.watches = WatchSlots(self.authz.identify, listen.max_watches_per_uid, listen.max_watches)
        server.add_services(
            grpc_server,
            NodeHealthServicer(self.engine.view, self.engine.acknowledge, cfg.node_name, self.boot_id,
                               lambda: self.runner.states, listen.max_message_bytes, self.watches),
            DiagnosticsServicer(self.diag),
            TracerServicer(cfg.node_name, lambda: self.settings.config.tracer, lambda: self.settings.roots(),
                           lambda: self._gpu_inventory().compute_pids),
            self.health,
            EvidenceServicer(self.engine.view, EvidenceStore(cfg.state_dir, self._evidence_limits), self.diag,
                             self._gpu_inventory, cfg.node_name, self.boot_id, lambda: self.settings.config.evidence,
                             self.authz, listen.max_message_bytes))
        await server.start_listening(grpc_server, self.front, listen)
        st = os.lstat(listen.unix)
        self.socket_id = (st.st_dev, st.st_ino)
        server.warn_unknown_groups(cfg.authz.disruptive.unix_groups)
        return grpc_server

    def _evidence_limits(self) -> tuple[int, int, int]:
        """(keep, max_bundle_bytes, max_bytes) of the running config: a reload applies them at the next bundle.
        A bundle never exceeds what one gRPC message carries (the listener's max_message_bytes, fixed at start),
        or Get could not return it."""
        e = self.settings.config.evidence
        return e.keep, min(e.max_bundle_bytes, message_fit(self._message_bytes)), e.max_bytes

    def _start_metrics(self) -> None:
        from robustd.metrics import DaemonProbe

        probe = DaemonProbe(watchdog_interval=lambda: self.notifier.watchdog_interval,
                            last_watchdog=lambda: self.last_watchdog, last_tick=lambda: self.runner.last_tick,
                            diagnostic_outcomes=lambda: self.diag.outcomes,
                            diagnostic_running=lambda: self.diag.running is not None)
        metrics = self.settings.config.metrics
        self.metrics_server = server.start_metrics(metrics.address or "", self.engine.view,
                                                   self.settings.config.node_name, lambda: self.runner.states,
                                                   metrics.max_condition_series, probe)

    # -- running -------------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        last_prune = last_dog = time.monotonic()
        last_status = ""
        while True:
            await on_grid(TICK)  # on the runner heartbeat's grid: one wake serves both
            now = time.monotonic()
            self.engine.tick()
            if now - last_prune >= PRUNE_EVERY:
                ret = self.settings.config.retention
                self.engine.prune(ret.max_age, ret.max_events)
                last_prune = now
            dog = self.notifier.watchdog_interval
            # Ping only while checks are being scheduled: a wedged runner must let systemd restart us.
            if dog and now - last_dog >= dog and now - self.runner.last_tick < max(dog, 2.0):
                self.notifier.watchdog()
                self.last_watchdog = last_dog = now
            status = self._summary()
            if status != last_status:
                self.notifier.status(status)
                last_status = status

    def _on_events(self, events: list[Event]) -> None:
        asyncio.get_running_loop().create_task(self._update_health())

    async def _update_health(self) -> None:
        severity, _ = worst(self.engine.view.conditions())
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        for name in ("NodeHealth", "Evidence"):
            await self.health.set(pb.DESCRIPTOR.services_by_name[name].full_name, serving)
        await self.health.set(NODE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING
                              if severity is Severity.CRITICAL else serving)

    def _summary(self) -> str:
        view = self.engine.view
        conds = view.conditions()
        severity, action = worst(conds)
        failing = [st.name for st in self.runner.states if st.status.failing]
        text = f"{severity.name}" + (f" ({action.name})" if conds else "") + f", {len(conds)} conditions"
        text += f"; checks failing: {', '.join(failing)}" if failing else ""
        return text + (f"; EVENT LOG NOT WRITABLE, {view.events_held} changes held" if view.store_error else "")

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_stop)
        loop.add_signal_handler(signal.SIGINT, self._on_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload)

    def _on_stop(self) -> None:
        self.stop_count += 1
        if self.stop_count > 1:  # a second signal: the operator means it
            log.warning("second stop signal: exiting now")
            os._exit(1)
        self.stop_requested.set()

    def _on_reload(self) -> None:
        if self.reloading and not self.reloading.done():
            log.warning("SIGHUP ignored: a reload is already in progress")
            return
        self.reloading = asyncio.get_running_loop().create_task(self._reload())

    async def _reload(self) -> None:
        new = await self._read_config()
        if new is None:
            return
        merged, applied = reload.merge(self.settings, new)
        self.notifier.send("RELOADING=1")
        try:
            await self.runner.stop()
            self.settings = merged
            self.authz.refresh()  # logs which certificate names changed meaning, now rather than at the next call
            self.runner = self._make_runner(self.settings)
            await self.runner.start_sources()
            self.engine.reload(checkset.code_table(self.runner.states, self.settings), new.config.policy)
            logging.getLogger().setLevel(new.config.log_level.upper())
            self.runner.run()
        except Exception:  # noqa: BLE001 - a reload that breaks must not leave systemd waiting in "reloading"
            log.exception("reload from %s failed part way", self.config_path)
            # If the checks are not running now, the watchdog pings stop and systemd restarts robustd.
            self.notifier.send(f"READY=1\nSTATUS=reload failed part way (see the log); {self._summary()}")
            return
        self.notifier.send(f"READY=1\nSTATUS={self._summary()}")
        log.info("config reloaded from %s: %s; %s", self.config_path,
                 f"applied {', '.join(sorted(set(applied)))}" if applied else "no changes to apply",
                 levels_note(merged.config.diagnostics))

    async def _read_config(self) -> Settings | None:
        """The config file validated, read off the event loop within RELOAD_READ_TIMEOUT; None (logged, the
        running config stays) when it is invalid, unreadable, or its reading did not end in time. A read that
        overran keeps its thread until it ends: the next reload is refused until then, so stuck reads never
        pile up."""
        if self.reading is not None and not self.reading.done():
            problems = f"{self.config_path}: the previous reload is still reading it (or a file it names)"
        else:
            loop = asyncio.get_running_loop()
            self.reading = loop.run_in_executor(None, load_config, self.config_path, self.schema, self.overrides)
            self.reading.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even when late
            try:
                return await asyncio.wait_for(asyncio.shield(self.reading), RELOAD_READ_TIMEOUT)
            except ConfigError as e:
                problems = str(e)
            except TimeoutError:
                problems = (f"{self.config_path}: reading it and the files it names took longer than "
                            f"{RELOAD_READ_TIMEOUT:g}s")
                self.reading.add_done_callback(lambda _: log.warning(
                    "%s: the reload's read that overran has ended (its result is dropped); SIGHUP reloads again",
                    self.config_path))
            except Exception as e:  # noqa: BLE001 - a loader bug: one line, never "Task exception was never retrieved"
                log.debug("reading the config", exc_info=e)
                problems = f"{self.config_path}: cannot load it: {_one_line(e)}"
        log.error("reload rejected; the running config stays:\n%s", problems)
        self.notifier.status(f"reload rejected: {problems.splitlines()[0]}")
        return None


async def _bounded(what: str, step: Any, deadline: float, limit: float) -> None:
    """Await one shutdown step for at most `limit` seconds and never past `deadline`; log an overrun."""
    loop = asyncio.get_running_loop()
    timeout = max(0.05, min(limit, deadline - loop.time()))
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        log.warning("stopping: %s did not finish within %.2fs; going on without it", what, timeout)
    elif not task.cancelled() and (err := task.exception()) is not None:
        log.warning("stopping: %s failed: %s", what, _one_line(err))


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _forced_exit(why: str) -> None:
    log.error("%s; exiting now", why)
    _exit(1)


def _exit(code: int) -> None:
    """Leave without waiting on threads: a poll stuck in a driver call (NVML hangs with the GPU) or a
    write stuck in fsync cannot be joined, and Python's exit would join executor threads forever."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="robustd", description="Node health daemon for GPU training hosts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples("robustd --check-config --config /etc/robustd/robustd.yaml",
                        "robustd --config etc/robustd.dev-emulated.yaml   # what `make run` starts",
                        "systemctl reload robustd                         "
                        "# SIGHUP: re-read the config, log what changed"))
    p.add_argument("--config", help=f"config file (default {DEFAULT_CONFIG})")
    p.add_argument("--socket", help="override listen.unix")
    p.add_argument("--state-dir", help="override state_dir")
    p.add_argument("--node-name", help="override node_name")
    p.add_argument("--check-config", action="store_true", help="validate the config and exit 0 (valid) or 1")
    p.add_argument("--version", action="version", version=f"robustd {__version__}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {k: v for k, v in (("listen.unix", args.socket), ("state_dir", args.state_dir),
                                   ("node_name", args.node_name)) if v}
    setup_logging("info")
    check_types = discover_checks()
    schema = checkset.config_schema(check_types)
    path = args.config or DEFAULT_CONFIG
    try:
        settings = load_config_or_defaults(args.config, schema, overrides)
    except ConfigError as e:
        fatal(f"robustd: invalid config:\n{e}")
        return 1
    if args.check_config:
        print(f"{settings.source}: config OK ({len(settings.checks)} checks)")
        return 0
    setup_logging(settings.config.log_level)
    _exit(run_daemon(Daemon(settings, check_types, path, overrides, schema)))
    return 1  # not reached


def run_daemon(daemon: Daemon) -> int:
    """The event loop, without asyncio.run's unbounded ending (it waits for every task to honour
    cancellation and for every executor thread to return)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        code = loop.run_until_complete(daemon.run())
    except Exception as e:  # noqa: BLE001 - one line, never a traceback on the way out
        log.error("stopped by an internal error: %s", _one_line(e))
        log.debug("internal error", exc_info=True)
        code = 1
    leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in leftovers:
        t.cancel()
    if leftovers:
        _, pending = loop.run_until_complete(asyncio.wait(leftovers, timeout=0.3))
        if pending:
            log.debug("exiting with %d tasks that ignored cancellation: %s", len(pending),
                      ", ".join(sorted(t.get_name() for t in pending)))
    return code


if __name__ == "__main__":
    sys.exit(main())
