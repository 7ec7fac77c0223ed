"""robustd's composition root: config → store → checks → policy → engine → API → READY.

The daemon answers only once every enabled check has started (the kmsg reader is positioned)
and the signal handlers are installed; READY=1 goes out at that moment.
"""

from __future__ import annotations

import argparse
import asyncio
import grp
import logging
import os
import signal
import socket
import sqlite3
import stat
import sys
import time
from importlib.metadata import entry_points
from typing import Any, Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from robustd import __version__
from robustd.api.diagnostics import DiagnosticsServicer
from robustd.api.servicer import NodeHealthServicer
from robustd.api.tracer import TracerServicer
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.authz import Authorizer, AuthzInterceptor, UnixFront
from robustd.check import Check, CheckConfig, CheckContext
from robustd.codes import CodeRule, CodeTable
from robustd.config import ConfigError, Settings, TlsConfig, load_config
from robustd.diag.manager import DiagManager, GpuView
from robustd.diag.manager import codes as diag_codes
from robustd.engine import Engine
from robustd.model import Event, Severity, worst
from robustd.policy import Policy
from robustd.roots import DEFAULT_CONFIG, Roots, read_boot_id
from robustd.runner import Runner
from robustd.sdnotify import Notifier, setup_logging
from robustd.store import Store

log = logging.getLogger("robustd")

# Codes the daemon itself raises about its checks. Rule files and policy.codes may override.
BUILTIN_CODES: dict[str, CodeRule] = {
    "CHECK_TIMEOUT": CodeRule(severity="WARNING", action="NONE", clear_after="10s",
                              description="a check's poll overran its deadline; the check is blind until it returns"),
    "CHECK_ERROR": CodeRule(severity="WARNING", action="NONE", clear_after="10s",
                            description="a check raised or its watcher failed"),
}
NODE_SERVICE = "robustd.node"  # grpc.health.v1 name: SERVING unless the node is CRITICAL
TICK = 0.25
PRUNE_EVERY = 60.0


def discover_checks() -> dict[str, type[Check]]:
    """Built-in checks in their fixed order, then third-party ones from the `robustd.checks` group."""
    from checks import BUILTIN

    found: dict[str, type[Check]] = {c.name: c for c in BUILTIN}
    for ep in entry_points(group="robustd.checks"):
        try:
            cls = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not stop the daemon
            log.error("cannot load check plugin %s (%s): %s", ep.name, ep.value, e)
            continue
        name = getattr(cls, "name", "") or ep.name
        if name in found:
            log.error("check plugin %s (%s) ignored: a check named %r already exists", ep.name, ep.value, name)
            continue
        found[name] = cls
    return found


class Daemon:
    def __init__(self, settings: Settings, check_types: Mapping[str, type[Check]], config_path: str,
                 overrides: Mapping[str, Any]):
        self.settings = settings
        self.check_types = check_types
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = Notifier()
        self.stop_requested = asyncio.Event()
        self.stop_count = 0
        self.reloading: asyncio.Task[None] | None = None

    # -- composition ---------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.settings.config
        self.boot_id = read_boot_id(cfg.boot_id_path)
        self.store = Store(cfg.state_dir)
        self.runner = self._make_runner(self.settings)
        await self.runner.start_sources()
        self.policy = Policy(self._code_table(self.settings), self.boot_id,
                             default_clear_after=cfg.policy.clear_after, update_interval=cfg.policy.update_interval,
                             escalate_after_reboots=cfg.policy.escalate_after_reboots,
                             prior_boots=self.store.boots_with)
        self.policy.load(self.store.conditions(), time.time())
        self.engine = Engine(self.policy, self.store)
        if self.store.meta("boot_id") != self.boot_id:
            cleared = self.engine.commit_events(self.policy.reboot(time.time()))
            log.info("boot id is %s (new boot); cleared %d conditions of the previous boot", self.boot_id,
                     len(cleared))
            self.store.set_meta("boot_id", self.boot_id)
        self.store.prune(time.time(), cfg.retention.max_age, cfg.retention.max_events)
        self.diag = DiagManager(self.engine, lambda: self.settings.config.diagnostics, cfg.node_name, cfg.state_dir,
                                self._gpu_view, cpu_model(self.settings.roots()))
        self.diag.recover()
        self.runner.run()
        self._install_signals()
        self.health = health.aio.HealthServicer()
        server = await self._serve()
        self.engine.listeners.append(self._on_events)
        await self._update_health()
        self._start_metrics()
        self.notifier.ready(self._summary())
        log.info("robustd %s ready on %s (node %s, %d checks)", __version__, cfg.listen.unix, cfg.node_name,
                 len(self.runner.states))
        ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        await self.stop_requested.wait()

        log.info("stopping")
        self.notifier.stopping()
        ticker.cancel()
        if self.diag.running is not None:
            await self.diag.cancel(self.diag.running.id)
        await self.health.enter_graceful_shutdown()
        await server.stop(grace=2)
        await self.front.close()
        await self.runner.stop()
        if self.engine.backlog:
            self.engine.commit_events([])  # one last try
        if self.engine.backlog:
            log.error("stopping with %d events not written to the event log (%s); the checks will report "
                      "standing faults again after the restart", len(self.engine.backlog), self.engine.store_error)
        self.store.close()
        return 0

    def _make_runner(self, settings: Settings) -> Runner:
        instances = [(cls(), settings.checks[name]) for name, cls in self.check_types.items()]
        return Runner(instances, self._context, lambda report: self.engine.submit(report))

    def _context(self, check: Check, cfg: CheckConfig) -> CheckContext:
        return CheckContext(name=check.name, node_name=self.settings.config.node_name, roots=self.settings.roots(),
                            config=cfg, state_dir=self.settings.config.state_dir,
                            cursor=self.store.cursor(check.name), log=logging.getLogger(f"robustd.checks.{check.name}"))

    def _code_table(self, settings: Settings) -> CodeTable:
        layers: list[Mapping[str, CodeRule]] = [BUILTIN_CODES]
        for st in self.runner.states:
            if st.status not in ("DISABLED", "UNSUPPORTED"):
                try:
                    layers.append(st.check.codes())
                except Exception as e:  # noqa: BLE001 - e.g. rules failed to load; the check already reported it
                    log.warning("check %s has no code table: %s", st.name, e)
        layers.append(diag_codes())
        layers.append(settings.config.policy.codes)
        return CodeTable(layers)

    def _gpu_view(self) -> GpuView:
        """The GPU check's inventory and its last-seen compute processes (empty without one)."""
        for st in self.runner.states:
            if st.name == "gpu" and st.status not in ("DISABLED", "UNSUPPORTED"):
                check: Any = st.check
                gpus = [{"index": i, "bus_id": g.bus, "uuid": g.uuid, "name": g.name}
                        for i, g in enumerate(getattr(check, "inventory", []))]
                return GpuView(gpus=gpus, driver=getattr(check, "driver_version", ""),
                               busy_pids=getattr(check, "compute_pids", frozenset()),
                               emulated=bool(check.emulated()))
        return GpuView()

    async def _serve(self) -> grpc.aio.Server:
        cfg = self.settings.config
        listen = cfg.listen
        path = listen.unix
        _prepare_socket_path(path)
        self.front = UnixFront(path, listen.unix_mode, listen.unix_group)
        authz = Authorizer(lambda: self.settings.config.authz, self.front)
        server = grpc.aio.server(
            interceptors=[AuthzInterceptor(authz)],
            options=[("grpc.max_receive_message_length", listen.max_message_bytes),
                     ("grpc.max_send_message_length", listen.max_message_bytes),
                     ("grpc.max_concurrent_streams", listen.max_concurrent_streams)])
        servicer = NodeHealthServicer(self.engine, cfg.node_name, self.boot_id, lambda: self.runner.states)
        pb_grpc.add_NodeHealthServicer_to_server(servicer, server)
        pb_grpc.add_DiagnosticsServicer_to_server(DiagnosticsServicer(self.diag), server)
        pb_grpc.add_TracerServicer_to_server(
            TracerServicer(cfg.node_name, lambda: self.settings.config.tracer, lambda: self.settings.roots(),
                           lambda: self._gpu_view().busy_pids), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (pb.DESCRIPTOR.services_by_name["NodeHealth"].full_name,
                 pb.DESCRIPTOR.services_by_name["Diagnostics"].full_name,
                 pb.DESCRIPTOR.services_by_name["Tracer"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        server.add_insecure_port(self.front.inner_address)
        if listen.tcp:
            if listen.tls is not None:
                if server.add_secure_port(listen.tcp, _tls_credentials(listen.tls)) == 0:
                    raise RuntimeError(f"listen.tcp: cannot listen on {listen.tcp}")
                log.info("gRPC over TLS on %s%s", listen.tcp,
                         " (mutual TLS: client certificates required)" if listen.tls.client_ca else "")
            else:
                log.warning("listen.insecure: gRPC on %s is PLAINTEXT and unauthenticated: anyone who can reach "
                            "it reads this node's state; configure listen.tls", listen.tcp)
                if server.add_insecure_port(listen.tcp) == 0:
                    raise RuntimeError(f"listen.tcp: cannot listen on {listen.tcp}")
        await server.start()
        await self.front.start()
        for name in cfg.authz.disruptive.unix_groups:
            try:
                grp.getgrnam(name)
            except KeyError:
                log.warning("authz.disruptive.unix_groups: no group named %r on this host", name)
        return server

    def _start_metrics(self) -> None:
        address = self.settings.config.metrics.address
        if not address:
            return
        from robustd.metrics import StateCollector, serve

        serve(address, StateCollector(self.engine, self.settings.config.node_name, lambda: self.runner.states))
        log.info("metrics on http://%s/metrics", address)

    # -- running -------------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        last_prune = last_dog = time.monotonic()
        last_status = ""
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            self.engine.tick()
            if now - last_prune >= PRUNE_EVERY:
                ret = self.settings.config.retention
                try:
                    self.store.prune(time.time(), ret.max_age, ret.max_events)
                except (sqlite3.Error, OSError) as e:  # a full disk must not stop the ticks (and the watchdog)
                    log.error("event log retention could not run: %s", e)
                last_prune = now
            dog = self.notifier.watchdog_interval
            # Ping only while checks are being scheduled: a wedged runner must let systemd restart us.
            if dog and now - last_dog >= dog and now - self.runner.last_tick < max(dog, 2.0):
                self.notifier.watchdog()
                last_dog = now
            status = self._summary()
            if status != last_status:
                self.notifier.status(status)
                last_status = status

    def _on_events(self, events: list[Event]) -> None:
        asyncio.get_running_loop().create_task(self._update_health())

    async def _update_health(self) -> None:
        severity, _ = worst(list(self.policy.conditions.values()))
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set(pb.DESCRIPTOR.services_by_name["NodeHealth"].full_name, serving)
        await self.health.set(NODE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING
                              if severity is Severity.CRITICAL else serving)

    def _summary(self) -> str:
        conds = list(self.policy.conditions.values())
        severity, action = worst(conds)
        failing = [st.name for st in self.runner.states if st.status in ("ERROR", "TIMEOUT")]
        text = f"{severity.name}" + (f" ({action.name})" if conds else "") + f", {len(conds)} conditions"
        text += f"; checks failing: {', '.join(failing)}" if failing else ""
        return text + (f"; EVENT LOG NOT WRITABLE, {len(self.engine.backlog)} changes held" if self.engine.store_error
                       else "")

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
        try:
            new = load_config(self.config_path, {n: c.Config for n, c in self.check_types.items()}, self.overrides)
        except ConfigError as e:
            log.error("reload rejected; the running config stays:\n%s", e)
            self.notifier.status(f"reload rejected: {e.problems[0]}")
            return
        old = self.settings.config
        for key in ("node_name", "state_dir", "boot_id_path", "listen", "metrics"):
            if getattr(old, key) != getattr(new.config, key):
                log.warning("%s changed: that takes effect at the next restart", key)
        self.notifier.send("RELOADING=1")
        await self.runner.stop()
        self.settings = Settings(config=old.model_copy(update={"retention": new.config.retention,
                                                                "authz": new.config.authz,
                                                                "policy": new.config.policy,
                                                                "roots": new.config.roots,
                                                                "log_level": new.config.log_level}),
                                 checks=new.checks, source=new.source)
        self.runner = self._make_runner(self.settings)
        await self.runner.start_sources()
        self.policy.table = self._code_table(self.settings)
        self.policy.default_clear_after = new.config.policy.clear_after
        self.policy.update_interval = new.config.policy.update_interval
        self.policy.escalate_after_reboots = new.config.policy.escalate_after_reboots
        logging.getLogger().setLevel(new.config.log_level.upper())
        self.runner.run()
        self.notifier.send(f"READY=1\nSTATUS={self._summary()}")
        log.info("config reloaded from %s", self.config_path)


def _tls_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    def read(key: str, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise RuntimeError(f"listen.tls.{key}: cannot read {path}: {e.strerror}") from e

    pair = (read("key", tls.key), read("cert", tls.cert))
    if tls.client_ca:
        return grpc.ssl_server_credentials([pair], root_certificates=read("client_ca", tls.client_ca),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def cpu_model(roots: Roots) -> str:
    """`model name` from cpuinfo: MiniGPT digests on CPU are only comparable on one CPU model."""
    try:
        with open(roots.proc_path("cpuinfo"), encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return ""


def _prepare_socket_path(path: str) -> None:
    """Create the socket's directory; remove a stale socket, but never steal a live one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover from a crash
        return
    finally:
        probe.close()
    raise RuntimeError(f"another process is already listening on {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="robustd", description="Node health daemon for GPU training hosts.")
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
    types = {n: c.Config for n, c in check_types.items()}
    path = args.config or DEFAULT_CONFIG
    try:
        if args.config is None and not os.path.exists(path):
            log.warning("%s not found: running on built-in defaults", path)
            from robustd.config import parse_config

            settings = parse_config("", "(defaults)", types, overrides)
        else:
            settings = load_config(path, types, overrides)
    except ConfigError as e:
        print(f"robustd: invalid config:\n{e}", file=sys.stderr)
        return 1
    if args.check_config:
        print(f"{settings.source}: config OK ({len(settings.checks)} checks)")
        return 0
    setup_logging(settings.config.log_level)
    try:
        return asyncio.run(Daemon(settings, check_types, path, overrides).run())
    except (OSError, RuntimeError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
