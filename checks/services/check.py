"""The services check: the systemd units of the NVIDIA host services, pushed by systemd over D-Bus.

Which units, and only where the node needs them (a peer raised these on single-node and idle systems
that had no use for them, so every rule here errs towards silence):
- `nvidia-fabricmanager.service` where an NVIDIA NVSwitch (PCI vendor 0x10de, class 0x0680) is on the
  PCI bus (`<sys>/bus/pci/devices`): without it CUDA fails on every GPU of an NVSwitch node. GB200 compute
  trays see no NVSwitch on their PCI bus (the switch trays run the fabric) and so do not watch it.
- `nvidia-persistenced.service` where it is enabled (`UnitFileState` enabled): a node that leaves it
  disabled chose so.
- `nvidia-imex.service` where an IMEX domain is configured: `checks.services.imex_nodes_config` lists at
  least one node (a line that is neither blank nor a comment).
`checks.services.<service>: always` watches a unit wherever it is installed, `never` not at all. A unit
that is not installed (`LoadState` not-found) raises nothing in any mode.

How: one connection to the system bus (jeepney, pure Python, asyncio) on the daemon's loop. At start,
systemd's Manager.Subscribe (systemd sends unit signals on the bus only while someone is subscribed), an
AddMatch for PropertiesChanged of each watched unit's object, then one GetAll of the unit's properties
(after the match, so no change falls between). From then on nothing is asked: each PropertiesChanged
updates the unit's ActiveState, SubState and Result, and a change of verdict is pushed at once:
NVIDIA_SERVICE_DOWN on `host/<unit>` (STATE) when the unit is failed, inactive with no job queued (an
operator's `systemctl restart` passes through inactive with its restart job queued, and a blip of a CRITICAL
would drain the node), or activating in `auto-restart` (a crash loop), its RESOLVED when it is not.
The poll, each interval, only re-reports the units that are down from memory (no D-Bus call), which keeps
their conditions from the hold-down. A lost bus connection ends the watch with an error; the runner starts
it again, which reads every unit anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from checks.common.sysfs import read_text
from checks.services.config import RULES, Level, ServicesConfig, levels
from robustd.check import Check, CheckContext
from robustd.model import Finding, FindingBatch, FindingKind

CODE = "NVIDIA_SERVICE_DOWN"
SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
PROPS_IFACE = "org.freedesktop.DBus.Properties"
NVIDIA_VENDOR = "0x10de"
NVSWITCH_CLASS = "0x0680"  # bridge, other: how NVSwitches enumerate (class 0x068000)
CALL_TIMEOUT_S = 10.0
_CLOSED = object()
# ServicesConfig key → the unit it names.
UNITS = {"fabricmanager": "nvidia-fabricmanager.service", "persistenced": "nvidia-persistenced.service",
         "imex": "nvidia-imex.service"}
ENABLED = ("enabled", "enabled-runtime", "static", "alias", "indirect", "generated", "transient")


@dataclass
class Unit:
    """What the check knows of one watched unit: why it watches it, and systemd's last word on it."""

    key: str  # fabricmanager | persistenced | imex
    name: str
    why: str
    path: str = ""
    props: dict[str, str] = field(default_factory=dict)

    @property
    def component(self) -> str:
        return "host/" + self.name.removesuffix(".service")

    @property
    def down(self) -> bool:
        """Failed; inactive with no job queued (`systemctl restart` passes through inactive with its job still
        queued: not down); or between the restarts of a crash loop (`activating (auto-restart)`)."""
        active, sub = self.props.get("ActiveState", ""), self.props.get("SubState", "")
        idle = self.props.get("Job", "0") == "0"
        restarting = active == "activating" and sub == "auto-restart"
        return active == "failed" or (active == "inactive" and idle) or restarting

    def shown(self) -> tuple[str, ...]:
        """What the verdict shows of the unit: a change of any of it is pushed."""
        return tuple(self.props.get(k, "") for k in ("LoadState", "UnitFileState", "ActiveState", "SubState",
                                                       "Result", "ExecMainStatus")) + (str(self.down),)


def nvswitches(ctx: CheckContext) -> list[str]:
    """PCI addresses of the NVIDIA NVSwitches on the bus (`<sys>/bus/pci/devices/*/{vendor,class}`)."""
    base = ctx.roots.sys_path("bus", "pci", "devices")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for bdf in names:
        try:
            vendor = read_text(os.path.join(base, bdf, "vendor")).strip().lower()
            cls = read_text(os.path.join(base, bdf, "class")).strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and cls.startswith(NVSWITCH_CLASS):
            out.append(bdf)
    return out


def imex_nodes(path: str) -> int:
    """How many nodes the IMEX nodes config lists (0: no file, empty, or only comments)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if line.strip() and not line.lstrip().startswith("#"))
    except OSError:
        return 0


def _value(variant: Any) -> str:
    """A D-Bus variant as jeepney gives it, `(signature, value)`, as text."""
    return str(variant[1]) if isinstance(variant, tuple) and len(variant) == 2 else str(variant)


class ServicesCheck(Check):
    """NVIDIA host services (fabric manager, persistence daemon, IMEX) through systemd's D-Bus signals."""

    name = "services"
    mode = "both"
    Config = ServicesConfig
    rule_file = RULES

    def __init__(self) -> None:
        self._units: dict[str, Unit] = {}  # by object path, once start() resolved them
        self._conn: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._first: list[Finding] = []
        self._note = ""
        self._down: tuple[Finding, ...] = ()  # the units down now, as the poll re-reports them

    @staticmethod
    def _config(ctx: CheckContext) -> ServicesConfig:
        return ctx.config if isinstance(ctx.config, ServicesConfig) else ServicesConfig()

    def wanted(self, ctx: CheckContext) -> list[Unit]:
        """The units this node needs, by the config and what the node has (the module doc)."""
        cfg = self._config(ctx)
        out: list[Unit] = []
        for key, unit in UNITS.items():
            when = getattr(cfg, key)
            if when == "never":
                continue
            why = "checks.services." + key + ": always"
            if when == "auto" and key == "fabricmanager":
                switches = nvswitches(ctx)
                if not switches:
                    continue
                why = f"{len(switches)} NVSwitch(es) on the PCI bus ({', '.join(switches[:4])})"
            elif when == "auto" and key == "imex":
                n = imex_nodes(cfg.imex_nodes_config)
                if not n:
                    continue
                why = f"IMEX domain of {n} node(s) in {cfg.imex_nodes_config}"
            elif when == "auto":
                why = "enabled"  # decided once systemd said so (start)
            out.append(Unit(key=key, name=unit, why=why))
        return out

    def supported(self, ctx: CheckContext) -> str | None:
        try:
            import jeepney  # noqa: F401 - only whether it is there
        except ImportError:
            return "the jeepney D-Bus library is not installed"
        from jeepney.bus import get_bus

        bus = self._config(ctx).bus
        try:
            path = get_bus(bus)
        except (KeyError, RuntimeError, StopIteration) as e:  # SESSION without $DBUS_SESSION_BUS_ADDRESS
            return f"no D-Bus address for {bus}: {e}"
        if not path.startswith("\0") and not os.path.exists(path):
            return f"no D-Bus system bus at {path} (systemd's API is reached through it)"
        if not self.wanted(ctx):
            return "no NVIDIA host service to watch here (no NVSwitch, no IMEX domain, persistenced off by config)"
        return None

    def note(self) -> str:
        return self._note

    # -- D-Bus -----------------------------------------------------------------------------------
    async def _call(self, msg: Any) -> tuple[Any, ...]:
        """Send one method call and read until its reply; signals read meanwhile are handled in order."""
        from jeepney import HeaderFields, MessageType
        from jeepney.wrappers import unwrap_msg

        serial = next(self._conn.outgoing_serial)
        await self._conn.send(msg, serial=serial)
        async with asyncio.timeout(CALL_TIMEOUT_S):
            while True:
                reply = await self._conn.receive()
                if reply.header.fields.get(HeaderFields.reply_serial) == serial and reply.header.message_type in (
                        MessageType.method_return, MessageType.error):
                    return tuple(unwrap_msg(reply))
                self._on_message(reply)

    async def start(self, ctx: CheckContext) -> None:
        from jeepney import DBusAddress, MatchRule, Properties, message_bus, new_method_call
        from jeepney.io.asyncio import open_dbus_connection

        cfg = self._config(ctx)
        self._units, self._down = {}, ()
        self._queue = asyncio.Queue()
        async with asyncio.timeout(CALL_TIMEOUT_S):
            self._conn = await open_dbus_connection(cfg.bus)
        try:
            manager = DBusAddress(MANAGER_PATH, SYSTEMD, f"{SYSTEMD}.Manager")
            await self._call(new_method_call(manager, "Subscribe"))
            notes = []
            for unit in self.wanted(ctx):
                (unit.path,) = await self._call(new_method_call(manager, "LoadUnit", "s", (unit.name,)))
                self._units[unit.path] = unit
                rule = MatchRule(type="signal", sender=SYSTEMD, interface=PROPS_IFACE, member="PropertiesChanged",
                                 path=unit.path)
                await self._call(message_bus.AddMatch(rule))
                for iface in (UNIT_IFACE, SERVICE_IFACE):
                    (props,) = await self._call(Properties(DBusAddress(unit.path, SYSTEMD, iface)).get_all())
                    self._update(unit, props)
                if unit.props.get("LoadState") != "loaded":
                    notes.append(f"{unit.name} not installed ({unit.props.get('LoadState', '?')}): not watched")
                elif unit.why == "enabled" and unit.props.get("UnitFileState") not in ENABLED:
                    notes.append(f"{unit.name} is {unit.props.get('UnitFileState', '?')}: not watched")
            self._note = "; ".join(notes)
            self._first = [f for u in self._units.values() for f in self._verdict(u)]
            self._down = tuple(f for f in self._first if f.kind is FindingKind.STATE)
            self._reader = asyncio.create_task(self._read())
        except BaseException:
            await self._close_conn()
            raise

    def _update(self, unit: Unit, props: Mapping[str, Any]) -> None:
        for k in ("LoadState", "ActiveState", "SubState", "UnitFileState", "Result", "ExecMainStatus"):
            if k in props:
                unit.props[k] = _value(props[k])
        if "Job" in props:  # (uo): the queued job's id and path, (0, "/") for none
            job = props["Job"][1] if isinstance(props["Job"], tuple) and len(props["Job"]) == 2 else props["Job"]
            unit.props["Job"] = str(job[0]) if isinstance(job, (tuple, list)) and job else "0"

    def _watched(self, unit: Unit) -> bool:
        if unit.props.get("LoadState") != "loaded":
            return False  # not installed: raises nothing
        return unit.why != "enabled" or unit.props.get("UnitFileState") in ENABLED

    def _verdict(self, unit: Unit) -> list[Finding]:
        """NVIDIA_SERVICE_DOWN (STATE) for a watched unit that is down, its RESOLVED for one that is not."""
        if not self._watched(unit):
            return []
        p = unit.props
        evidence = {"unit": unit.name, "active_state": p.get("ActiveState", ""), "sub_state": p.get("SubState", ""),
                    "result": p.get("Result", ""), "load_state": p.get("LoadState", ""),
                    "unit_file_state": p.get("UnitFileState", ""), "watched_because": unit.why}
        if not unit.down:
            return [Finding(unit.component, CODE, f"{unit.name} is {p.get('ActiveState')}", evidence,
                            FindingKind.RESOLVED)]
        level: Level = getattr(levels(), unit.key)
        status = p.get("ExecMainStatus", "")
        if status:
            evidence["exec_main_status"] = status
        return [Finding(unit.component, CODE,
                        f"{unit.name} is {p.get('ActiveState')} ({p.get('SubState')}), result {p.get('Result')}",
                        evidence, FindingKind.STATE, severity=level.severity, action=level.action)]

    def _on_message(self, msg: Any) -> None:
        """A PropertiesChanged of a watched unit: update it, and queue its verdict if that changed."""
        from jeepney import HeaderFields, MessageType

        if msg.header.message_type != MessageType.signal:
            return
        unit = self._units.get(msg.header.fields.get(HeaderFields.path, ""))
        if unit is None or msg.header.fields.get(HeaderFields.member) != "PropertiesChanged" or len(msg.body) < 2:
            return
        was = unit.shown()
        self._update(unit, msg.body[1])
        if unit.shown() == was or self._reader is None:
            return  # nothing the verdict shows changed (or start() still reads: its first batch says it)
        findings = self._verdict(unit)
        others = tuple(f for f in self._down if f.component != unit.component)
        self._down = others + tuple(f for f in findings if f.kind is FindingKind.STATE)
        if findings:
            self._queue.put_nowait(findings)

    async def _read(self) -> None:
        try:
            while True:
                self._on_message(await self._conn.receive())
        except asyncio.CancelledError:
            raise
        except EOFError:
            self._queue.put_nowait(ConnectionError("the system bus closed robustd's connection"))
        except Exception as e:  # raised from watch(), where the runner turns it into a finding and retries
            self._queue.put_nowait(e)

    # -- the runner's side -------------------------------------------------------------------------
    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        now = ctx.clock()
        return [replace(f, at=now) for f in self._down]

    def watch(self) -> AsyncIterator[FindingBatch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[FindingBatch]:
        yield FindingBatch(check=self.name, findings=tuple(self._first))
        while True:
            item = await self._queue.get()
            if item is _CLOSED:
                return
            if isinstance(item, BaseException):
                raise item
            yield FindingBatch(check=self.name, findings=tuple(item))

    async def _close_conn(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError, RuntimeError):
                await self._conn.close()
            self._conn = None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        await self._close_conn()
        self._queue.put_nowait(_CLOSED)
