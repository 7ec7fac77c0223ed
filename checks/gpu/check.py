"""The GPU check: NVML polled every interval, each GPU's faults as findings on `gpu/<bus id>`.

Backends: `nvml` (the host's libnvidia-ml.so.1) or `emulator` (robustd/nvmlemu, loaded ahead of
pynvml so that glibc hands pynvml the emulator for the same SONAME; only when config says so).
Every NVML call announces which GPU and which call it is (`_Current`), so a call that hangs is
reported by `timeout_findings` as NVML_HANG on that GPU while the poll thread stays stuck.

Faults NVML pushes (Xids, DBE, DRAM retirement failure, fatal poison, GPU unavailable, recovery
action) arrive through `checks/gpu/events.py`: the first poll, once the inventory is known,
registers one event set over every GPU and starts its waiting thread; `reports` hands its findings
to the daemon as they come (the watch half of mode "both"). GPUs or drivers without events are
named once in ListChecks (`note`) and stay polled. The poll keeps everything NVML does not push.

Each poll also reads every GPU's NVLink fabric registration (`checks/gpu/fabric.py`; GPUs without a fabric
are named once in the note and not asked again) and compares NVML's GPUs with the NVIDIA GPUs the PCI bus
shows (`checks/gpu/pci.py`): one on the bus that NVML does not list is GPU_MISSING on `gpu/<bdf>`. With the
emulator that comparison needs `roots.sys` to be a fixture tree (the emulated GPUs are not on this host's bus).

Under load the poll also compares the GPUs with each other (`checks/gpu/outliers.py`): SM clock and power draw
against the median of the loaded GPUs, from the readings it takes anyway plus one clock read per loaded GPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import pynvml

from checks.gpu.config import RULES, GpuConfig, GpuThresholds, thresholds
from checks.gpu.device import _Current, _Gpu
from checks.gpu.events import EventWatcher, address, emitter
from checks.gpu.fabric import FabricInfo, cliques, nvmlDeviceGetGpuFabricInfoV
from checks.gpu.nvml_fields import FieldBatch
from checks.gpu.outliers import below_median, decode_reasons
from checks.gpu.parse import normalize_bus_id, nvml_text
from checks.gpu.pci import PciGpus
from checks.kernel import xid
from robustd.check import Check, CheckContext
from robustd.codes import CodeRule
from robustd.inventory import NO_GPUS, GpuDevice, GpuInventory
from robustd.model import Action, Finding, FindingBatch, FindingKind, Severity
from robustd.roots import DEFAULT_NVML_LIBRARY, DEFAULT_SYS

log = logging.getLogger("robustd.checks.gpu")

HW_REASONS = {0x8: "hw_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}
NVLINK_COUNTERS = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}
_UNSUPPORTED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


class GpuCheck(Check):
    name = "gpu"
    mode = "both"  # polled every interval; NVML events pushed by the watcher thread
    Config = GpuConfig
    rule_file = RULES

    def __init__(self) -> None:
        self.current = _Current()
        self.inventory: list[_Gpu] = []
        self.compute_pids: frozenset[int] = frozenset()
        self.driver_version = ""
        self._published = NO_GPUS
        self._thresholds: GpuThresholds = thresholds()  # its rule file's (read once per process)
        self._initialized = False
        self._emulated = False
        self._polls = 0
        self._stall_since: float | None = None
        self._traffic: tuple[float, int] | None = None
        self._events: EventWatcher | None = None
        self._events_lock = threading.Lock()  # the poll thread starts the watcher, the event loop stops it
        self._events_note = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[list[Finding]] | None = None
        self._hang_grace = 1.0
        self._no_fabric: list[str] = []  # bus ids of GPUs without an NVLink fabric (said once in the note)
        self._pci: PciGpus | None = None  # None: no PCI comparison (the emulator on this host's own /sys)
        self._library = ""  # the libnvidia-ml loaded ahead of pynvml's (published: diagnostics' children load it)

    def borrowed_codes(self) -> Mapping[str, CodeRule]:
        """The Xid table (checks/kernel/xid.py): NVML Xid events raise the kernel check's codes, also where the
        kernel check does not run (a container without CAP_SYSLOG)."""
        return xid.codes()

    def note(self) -> str:
        """Shown once in ListChecks: GPUs whose driver pushes no NVML events (they stay polled), and GPUs
        without an NVLink fabric (PCIe cards: nothing about the fabric is raised for them)."""
        fabric = ""
        if self._no_fabric:
            total = len(self.inventory)
            fabric = (f"NVLink fabric NOT_SUPPORTED on {'all ' if len(self._no_fabric) == total else ''}"
                      f"{len(self._no_fabric)} of {total} GPUs (PCIe cards or no NVSwitch): fabric not checked there")
        return "; ".join(n for n in (self._events_note, fabric) if n)

    def gpu_inventory(self) -> GpuInventory:
        """robustd.inventory.GpuInventoryProvider: what the last poll published."""
        return self._published

    def _publish(self) -> None:
        devices = tuple(GpuDevice(index=i, bus_id=g.bus, uuid=g.uuid, name=g.name, readings=_readings(g))
                        for i, g in enumerate(self.inventory))
        self._published = GpuInventory(devices=devices, driver=self.driver_version, compute_pids=self.compute_pids,
                                       emulated=self._emulated, polled_at=time.time(), nvml_library=self._library)

    def emulated(self) -> str | None:
        """Shown in every verdict, so an emulated node is never taken for a real one."""
        if not self._emulated:
            return None
        return f"NVML emulator, {len(self.inventory)} GPUs, driver {self.driver_version}"

    @staticmethod
    def _config(ctx: CheckContext) -> GpuConfig:
        return ctx.config if isinstance(ctx.config, GpuConfig) else GpuConfig()

    def supported(self, ctx: CheckContext) -> str | None:
        cfg = self._config(ctx)
        if cfg.backend == "emulator":
            from robustd.nvmlemu.build import BuildError

            try:  # built here, before the first poll and its deadline
                self._emulator_library(ctx, cfg)
            except BuildError as e:
                return f"backend emulator: {e}"
            return None
        if cfg.expected_gpus:
            return None  # a host that expects GPUs reports a missing driver as NVML_UNAVAILABLE
        try:
            ctypes.CDLL(ctx.roots.nvml_library)
        except OSError:
            return (f"no NVIDIA driver ({ctx.roots.nvml_library} not found) and checks.gpu.expected_gpus is not "
                    "set")
        return None

    # -- findings ------------------------------------------------------------------------------
    def _finding(self, component: str, code: str, message: str, severity: Severity | None = None,
                 action: Action | None = None, kind: FindingKind = FindingKind.STATE, **evidence: str) -> Finding:
        if self._emulated:
            evidence["emulated"] = "true"
        return Finding(component=component, code=code, message=message, evidence=evidence,
                       kind=kind, severity=severity, action=action)

    def timeout_findings(self, ctx: CheckContext, stuck_for: float) -> Sequence[Finding] | None:
        now = self.current.get()
        if now is None:
            return None
        component, call, since = now
        waited = time.monotonic() - since
        if not self._initialized and waited < self._config(ctx).init_timeout:
            return None  # nvmlInit without persistence mode can take seconds per GPU: CHECK_TIMEOUT only
        return [self._finding(component, "NVML_HANG", f"NVML call {call} has not returned for {waited:.1f}s",
                              call=call, stuck_for=f"{waited:.1f}s")]

    def _call(self, component: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.current.set(component, fn.__name__)
        try:
            return fn(*args)
        finally:
            self.current.clear()

    # -- NVML events (the watch half) -----------------------------------------------------------
    async def start(self, ctx: CheckContext) -> None:
        """Only remembers the loop: NVML is initialised by the first poll, which then starts the watcher."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(maxsize=1024)
        self._hang_grace = self._config(ctx).deadline

    async def watch(self) -> AsyncIterator[FindingBatch]:
        """The watcher's findings as they come (a hung wait is found by the runner's heartbeat: stuck_findings)."""
        queue = self._queue
        assert queue is not None, "start() first"
        while True:
            batch = tuple(f for f in await queue.get() if not self._polled_already(f))
            if batch:
                yield FindingBatch(self.name, batch)

    def _polled_already(self, f: Finding) -> bool:
        """An event for a fault the poll has already reported: one fault is one occurrence, whichever of the two
        saw it first (an extra count is an UPDATED, which an adapter takes as a new fault and re-drains on).
        - a DBE event whose volatile count the poll has already read (right after a GPU reset zeroed the count, an
          event may be dropped until the next poll reads the new count, which then reports it);
        - a retirement-failure event while the poll reports the remap failure standing (the flag stays until a
          reset, so the poll's state carries it);
        - an unavailable event for a GPU the poll already holds as lost (it reports it on every poll)."""
        bus = f.component.removeprefix("gpu/")
        g = next((g for g in self.inventory if g.bus == bus), None)
        if g is None:
            return False
        if f.code == "GPU_ECC_DBE":
            count = f.evidence.get("count", "")
            return count.isdigit() and g.dbe_polled >= int(count) > 0
        if f.code == "GPU_ROW_REMAP_FAILURE":
            return g.readings.get("remap_failure") == 1
        if f.code == "GPU_LOST":
            return g.lost
        return False

    def stuck_findings(self) -> Sequence[Finding] | None:
        """NVML_HANG on `host` while the event wait (or a field read of the watcher) is stuck past its bound."""
        watcher = self._events
        return watcher.hang_findings(self._hang_grace) if watcher is not None else None

    async def close(self) -> None:
        """Stop the watcher: its thread sees it within one bounded wait and frees the set (never joined)."""
        with self._events_lock:
            if self._events is not None:
                self._events.stop()
            self._events, self._loop = None, None

    def _watch_events(self, ctx: CheckContext) -> None:
        """On the poll thread, once NVML is up: register every GPU, start the waiting thread."""
        with self._events_lock:
            loop, queue = self._loop, self._queue
            if loop is None or queue is None:
                return
            gpus = [(g.handle, g.bus, address(g.handle)) for g in self.inventory if not g.lost]
            try:
                watcher = EventWatcher(gpus, self._finding, emitter(loop, queue), self._call)
            except pynvml.NVMLError as e:  # no event sets at all on this driver
                self._events_note = f"NVML events NOT_SUPPORTED here ({e}); polling only"
                ctx.log.warning("GPU check: %s", self._events_note)
                self._events = None
                self._loop = None  # said once; not tried again until a restart or reload
                return
            self._events = watcher
            self._events_note = watcher.note()
            watcher.run()
        ctx.log.info("NVML events: watching %d GPUs%s", len(watcher.registered),
                     f"; {self._events_note}" if self._events_note else "")

    # -- NVML setup ----------------------------------------------------------------------------
    @staticmethod
    def _emulator_library(ctx: CheckContext, cfg: GpuConfig) -> str:
        from robustd.nvmlemu.build import build_emulator

        return cfg.emulator_library or build_emulator(os.path.join(ctx.state_dir, "nvml-emulator"))

    def _pci_gpus(self, ctx: CheckContext, cfg: GpuConfig) -> PciGpus | None:
        """What to compare NVML's GPUs with: the host's PCI bus, or with the emulator a fixture tree only
        (emulated GPUs are not on this host's bus; comparing them with it would be a false alarm)."""
        if cfg.backend == "emulator" and ctx.roots.sys == DEFAULT_SYS:
            return None
        visible = os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
        if visible and visible.lower() != "all":
            # In a container given some of the host's GPUs, NVML lists those while /sys shows the whole bus.
            log.info("NVIDIA_VISIBLE_DEVICES=%s: the GPUs are not compared with the PCI bus", visible[:100])
            return None
        return PciGpus(ctx.roots.sys_path("bus", "pci", "devices"))

    def _init(self, ctx: CheckContext, cfg: GpuConfig) -> None:
        self._pci = self._pci_gpus(ctx, cfg)
        if cfg.backend == "emulator":
            from robustd.nvmlemu.state import ENV_VAR

            lib = self._emulator_library(ctx, cfg)
            os.environ[ENV_VAR] = os.path.abspath(cfg.emulator_state or "")
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)  # before pynvml's dlopen of the same SONAME
            self._emulated, self._library = True, os.path.abspath(lib)
        elif ctx.roots.nvml_library != DEFAULT_NVML_LIBRARY:  # roots.nvml_library names another copy: load it
            ctypes.CDLL(ctx.roots.nvml_library, mode=ctypes.RTLD_GLOBAL)  # first, as for the emulator
            self._library = ctx.roots.nvml_library
        self._call("host", pynvml.nvmlInit)
        self.driver_version = nvml_text(self._call("host", pynvml.nvmlSystemGetDriverVersion))
        self.inventory = self._enumerate()
        ctx.log.info("GPU inventory%s: %d GPUs, driver %s: %s", " (EMULATED NVML)" if self._emulated else "",
                     len(self.inventory), self.driver_version,
                     "; ".join(f"{g.bus} {g.name} {g.uuid}" for g in self.inventory))
        for g in self.inventory:
            try:
                self._static(g)
            except pynvml.NVMLError_GpuIsLost:
                g.lost = True  # the first poll reports it
        self._initialized = True
        self._publish()

    def _enumerate(self) -> list[_Gpu]:
        out = []
        for i in range(self._call("host", pynvml.nvmlDeviceGetCount)):
            h = self._call("host", pynvml.nvmlDeviceGetHandleByIndex, i)
            try:
                bus = normalize_bus_id(nvml_text(self._call(f"gpu/index{i}", pynvml.nvmlDeviceGetPciInfo, h).busId))
                comp = f"gpu/{bus}"
                out.append(_Gpu(handle=h, bus=bus, name=nvml_text(self._call(comp, pynvml.nvmlDeviceGetName, h)),
                                uuid=nvml_text(self._call(comp, pynvml.nvmlDeviceGetUUID, h))))
            except pynvml.NVMLError:  # lost before we could read who it is: known by its index
                out.append(_Gpu(handle=h, bus=f"index{i}", name="", uuid="", lost=True))
        return out

    def _static(self, g: _Gpu) -> None:
        """Per-GPU facts read once: thresholds, link maxima, which NVLinks are active at start."""
        comp = f"gpu/{g.bus}"
        g.slowdown = self._opt(comp, pynvml.nvmlDeviceGetTemperatureThreshold, g.handle,
                               pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        g.shutdown = self._opt(comp, pynvml.nvmlDeviceGetTemperatureThreshold, g.handle,
                               pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
        g.max_width = self._opt(comp, pynvml.nvmlDeviceGetMaxPcieLinkWidth, g.handle)
        g.max_gen = self._opt(comp, pynvml.nvmlDeviceGetMaxPcieLinkGeneration, g.handle)
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = self._call(comp, pynvml.nvmlDeviceGetNvLinkState, g.handle, link)
            except pynvml.NVMLError:
                break  # past the last link (INVALID_ARGUMENT) or no NVLink (NOT_SUPPORTED)
            if state == pynvml.NVML_FEATURE_ENABLED:
                g.active_links.append(link)

    def _opt(self, component: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A call whose NOT_SUPPORTED means "no such feature here": None. Lost GPUs still raise."""
        try:
            return self._call(component, fn, *args)
        except pynvml.NVMLError as e:
            if e.value in _UNSUPPORTED:
                return None
            raise

    # -- the poll ------------------------------------------------------------------------------
    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        cfg = self._config(ctx)
        if not self._initialized:
            try:
                self._init(ctx, cfg)
            except pynvml.NVMLError as e:
                on_bus = self._on_bus()
                if cfg.expected_gpus or on_bus:  # GPUs expected, or on the PCI bus: the driver is missing
                    return [self._finding("host", "NVML_UNAVAILABLE", f"NVML unavailable: {e}", error=str(e),
                                          expected_gpus=str(cfg.expected_gpus or ""), pci_gpus=str(len(on_bus)))]
                ctx.log.info("NVML unavailable (%s); no GPUs expected or on the PCI bus", e)
                return []
        if self._events is None and self._loop is not None:
            self._watch_events(ctx)
        findings: list[Finding] = []
        now = time.monotonic()
        self._polls += 1
        count = self._call("host", pynvml.nvmlDeviceGetCount)
        if count != len(self.inventory):
            present = {address(self._call("host", pynvml.nvmlDeviceGetHandleByIndex, i)) for i in range(count)}
            for g in self.inventory:
                if address(g.handle) not in present:
                    g.lost = True
                    findings.append(self._finding(f"gpu/{g.bus}", "GPU_LOST", f"GPU {g.bus} vanished from NVML",
                                                  reason="vanished", uuid=g.uuid))
        if cfg.expected_gpus and count < cfg.expected_gpus:
            findings.append(self._finding("host", "GPU_LOST", f"NVML sees {count} GPUs, {cfg.expected_gpus} expected",
                                          reason="count", found=str(count), expected=str(cfg.expected_gpus)))
        pids: set[int] = set()
        utils: list[int] = []
        fabrics: dict[str, FabricInfo] = {}
        for g in self.inventory:
            if g.lost and any(f.component == f"gpu/{g.bus}" for f in findings):
                continue
            try:
                findings += self._poll_gpu(g, cfg, now, pids, utils)
                findings += self._fabric(ctx, g, cfg, now, fabrics)
            except pynvml.NVMLError_GpuIsLost:
                g.lost = True
                findings.append(self._finding(f"gpu/{g.bus}", "GPU_LOST", f"NVML: GPU {g.bus} is lost",
                                              reason="NVML_ERROR_GPU_IS_LOST", uuid=g.uuid))
        findings += self._clique_mismatch(fabrics) + self._missing_on_pci() + self._outliers(cfg, now)
        findings += self._stall(ctx, cfg, now, pids, utils)
        self.compute_pids = frozenset(pids)
        self._publish()  # read by the diagnostics (a busy node refuses a Run) and the tracer
        return findings

    def _poll_gpu(self, g: _Gpu, cfg: GpuConfig, now: float, pids: set[int], utils: list[int]) -> list[Finding]:
        """One GPU's readings, each fault as a finding; its compute pids and utilization are gathered too."""
        comp = f"gpu/{g.bus}"
        g.util = g.sm_clock = g.power_mw = g.reasons = None  # this poll's, for the relative checks
        g.readings = {}
        out = self._temp_high(g, comp, cfg) + self._hw_slowdown(g, comp, cfg, now) + self._memory_errors(g, comp)
        util = self._opt(comp, pynvml.nvmlDeviceGetUtilizationRates, g.handle)
        if util is not None:
            utils.append(util.gpu)
            g.util = int(util.gpu)
            if g.util >= cfg.outlier_utilization:  # the one call the relative checks add, and only under load
                clock = self._opt(comp, pynvml.nvmlDeviceGetClockInfo, g.handle, pynvml.NVML_CLOCK_SM)
                g.sm_clock = None if clock is None else int(clock)
        out += self._pcie_link(g, comp, cfg, util.gpu if util is not None else 0)
        out += self._pcie_replays(g, comp, cfg, now) + self._nvlink(g, comp, cfg) + self._power(g, comp)
        procs = self._opt(comp, pynvml.nvmlDeviceGetComputeRunningProcesses, g.handle) or []
        pids.update(int(p.pid) for p in procs)
        return out

    # -- NVLink fabric and the PCI bus ------------------------------------------------------------
    def _fabric(self, ctx: CheckContext, g: _Gpu, cfg: GpuConfig, now: float,
                registered: dict[str, FabricInfo]) -> list[Finding]:
        """GPU_FABRIC_NOT_READY past fabric_grace, GPU_FABRIC_ERROR for a completed registration that failed or
        whose health mask says degraded; a healthy registration goes into `registered` (clique comparison).

        A GPU that answers NOT_SUPPORTED (the call, or the state) has no fabric: named once in the note and
        not asked again, and nothing about the fabric is ever raised for it.
        """
        if g.has_fabric is False:
            return []
        comp = f"gpu/{g.bus}"
        info = self._opt(comp, nvmlDeviceGetGpuFabricInfoV, g.handle)
        if info is None or info.state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
            g.has_fabric = False
            self._no_fabric.append(g.bus)
            ctx.log.info("GPU %s: NVLink fabric NOT_SUPPORTED (no NVSwitch fabric): not checked", g.bus)
            return []
        g.has_fabric = True
        ev = {"state": info.state_name, "clique": str(info.clique), "cluster_uuid": info.cluster}
        if info.state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
            g.fabric_since = now if g.fabric_since is None else g.fabric_since
            waited = now - g.fabric_since
            if waited < cfg.fabric_grace:
                return []
            return [self._finding(comp, "GPU_FABRIC_NOT_READY",
                                  f"NVLink fabric registration {info.state_name} for {waited:.0f}s "
                                  f"(grace {cfg.fabric_grace:g}s): CUDA cannot use this GPU's NVLinks",
                                  waited=f"{waited:.0f}s", **ev)]
        g.fabric_since = None
        problems = info.problems()
        if problems:
            if info.health_mask is not None:
                ev["health_mask"] = hex(info.health_mask)
            return [self._finding(comp, "GPU_FABRIC_ERROR", f"NVLink fabric registration completed with "
                                  f"{', '.join(problems)}", status=info.status_name, problems=",".join(problems),
                                  **ev)]
        registered[g.bus] = info
        return []

    def _clique_mismatch(self, registered: dict[str, FabricInfo]) -> list[Finding]:
        """GPUs of one node registered in different NVLink partitions (cluster uuid or clique id): they cannot
        reach each other over NVLink, and a job spanning them falls back to PCIe or fails."""
        groups = cliques(registered)
        if len(groups) < 2:
            return []
        parts = [f"cluster {cluster} clique {clique}: {','.join(buses)}"
                 for (cluster, clique), buses in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
        return [self._finding("host", "GPU_FABRIC_CLIQUE_MISMATCH",
                              f"this node's GPUs are in {len(groups)} NVLink fabric cliques: {'; '.join(parts)}",
                              cliques=" | ".join(parts))]

    def _on_bus(self) -> list[str]:
        """The NVIDIA GPUs on the PCI bus ([] where it is not compared or cannot be read)."""
        if self._pci is None:
            return []
        try:
            return self._pci.scan()
        except OSError:
            return []

    def _missing_on_pci(self) -> list[Finding]:
        """GPU_MISSING: an NVIDIA GPU on the PCI bus, unbound or bound to nvidia, that NVML does not list.

        One bound to another driver (vfio-pci for a VM, nouveau) is not NVML's by the host's choice: skipped.
        """
        pci = self._pci
        if pci is None:
            return []
        listed = {g.bus for g in self.inventory}
        out = []
        for bdf in self._on_bus():
            if bdf in listed:
                continue
            driver = pci.driver(bdf)
            if driver not in ("", "nvidia"):
                continue
            bound = "bound to nvidia" if driver else "no driver bound"
            out.append(self._finding(f"gpu/{bdf}", "GPU_MISSING",
                                     f"GPU {bdf} is on the PCI bus ({bound}) but NVML does not list it",
                                     driver=driver or "none", nvml_gpus=str(len(listed)), **pci.ids(bdf)))
        return out

    def _temp_high(self, g: _Gpu, comp: str, cfg: GpuConfig) -> list[Finding]:
        """Against the GPU's own thresholds; the severity and action of each level (and the margins the config
        does not set) are in its rules.yaml."""
        temp = self._temperature(comp, g.handle)
        if temp is None:
            return []
        g.readings["temperature_c"] = temp
        levels = self._thresholds.temperature
        if g.shutdown and temp >= g.shutdown - cfg.temp_critical_margin:
            lv = levels.near_shutdown
            return [self._finding(comp, "GPU_TEMP_HIGH", f"GPU at {temp} °C, shutdown at {g.shutdown} °C", lv.severity,
                                  lv.action, temperature=str(temp), shutdown=str(g.shutdown), slowdown=str(g.slowdown))]
        if g.slowdown and temp >= g.slowdown - cfg.temp_warn_margin:
            lv = levels.at_slowdown
            return [self._finding(comp, "GPU_TEMP_HIGH", f"GPU at {temp} °C, slowdown threshold {g.slowdown} °C",
                                  lv.severity, lv.action, temperature=str(temp), slowdown=str(g.slowdown))]
        return []

    def _hw_slowdown(self, g: _Gpu, comp: str, cfg: GpuConfig, now: float) -> list[Finding]:
        """HW slowdown reasons raise only once they have held for slowdown_window (not a blip)."""
        g.reasons = self._opt(comp, pynvml.nvmlDeviceGetCurrentClocksEventReasons, g.handle)  # outliers' evidence
        reasons = g.reasons or 0
        hw = [name for bit, name in HW_REASONS.items() if reasons & bit]
        if not hw:
            g.slowdown_since = None
            return []
        g.slowdown_since = now if g.slowdown_since is None else g.slowdown_since
        held = now - g.slowdown_since
        if held < cfg.slowdown_window:
            return []
        return [self._finding(comp, "GPU_HW_SLOWDOWN", f"clocks held down by {', '.join(hw)} for {held:.0f}s",
                              reasons=",".join(hw), mask=hex(reasons), since=f"{held:.0f}s")]

    def _memory_errors(self, g: _Gpu, comp: str) -> list[Finding]:
        out: list[Finding] = []
        dbe = self._opt(comp, pynvml.nvmlDeviceGetTotalEccErrors, g.handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        pynvml.NVML_VOLATILE_ECC)
        if dbe is not None:
            g.readings["ecc_uncorrected_volatile"] = g.dbe_polled = int(dbe)
        if dbe:
            out.append(self._finding(comp, "GPU_ECC_DBE", f"{dbe} uncorrectable ECC errors since the last GPU reset",
                                     count=str(dbe)))
        rows = self._opt(comp, pynvml.nvmlDeviceGetRemappedRows, g.handle)
        if rows is not None:
            corr, unc, pending, failure = rows
            g.readings.update(remapped_rows_correctable=corr, remapped_rows_uncorrectable=unc,
                              remap_pending=int(bool(pending)), remap_failure=int(bool(failure)))
            ev = {"correctable_rows": str(corr), "uncorrectable_rows": str(unc)}
            if pending:
                out.append(self._finding(comp, "GPU_ROW_REMAP_PENDING", "row remap pending: reset the GPU to apply it",
                                         **ev))
            if failure:
                out.append(self._finding(comp, "GPU_ROW_REMAP_FAILURE", "row remapping failed", **ev))
        return out

    def _pcie_link(self, g: _Gpu, comp: str, cfg: GpuConfig, busy: int) -> list[Finding]:
        """A narrower link always counts; a lower generation only while the GPU is busy (it idles down)."""
        width = self._opt(comp, pynvml.nvmlDeviceGetCurrPcieLinkWidth, g.handle)
        gen = self._opt(comp, pynvml.nvmlDeviceGetCurrPcieLinkGeneration, g.handle)
        g.readings.update({k: int(v) for k, v in (("pcie_width", width), ("pcie_gen", gen)) if v is not None})
        if width is not None and g.max_width and width < g.max_width:
            return [self._finding(comp, "GPU_PCIE_WIDTH_DEGRADED", f"PCIe link x{width}, max x{g.max_width}",
                                  width=str(width), max_width=str(g.max_width), generation=str(gen))]
        if gen is not None and g.max_gen and gen < g.max_gen and busy > cfg.busy_utilization:
            return [self._finding(comp, "GPU_PCIE_WIDTH_DEGRADED",
                                  f"PCIe Gen{gen} while busy ({busy}%), max Gen{g.max_gen}", generation=str(gen),
                                  max_generation=str(g.max_gen), utilization=str(busy))]
        return []

    def _pcie_replays(self, g: _Gpu, comp: str, cfg: GpuConfig, now: float) -> list[Finding]:
        replay = self._opt(comp, pynvml.nvmlDeviceGetPcieReplayCounter, g.handle)
        if replay is None:
            return []
        g.replays.append((now, replay))
        while g.replays and now - g.replays[0][0] > cfg.replay_window:
            g.replays.popleft()
        rise = replay - g.replays[0][1]
        per_lane = cfg.replay_per_lane_per_min or self._replay_per_lane(g.max_gen)
        limit = per_lane * (g.max_width or self._thresholds.pcie_replay.width_unknown) * cfg.replay_window / 60.0
        if rise <= limit:
            return []
        return [self._finding(comp, "GPU_PCIE_REPLAY_RISING",
                              f"{rise} PCIe replays in {cfg.replay_window:g}s (limit {limit:.0f})",
                              replays=str(rise), window=f"{cfg.replay_window:g}s", counter=str(replay))]

    def _replay_per_lane(self, max_gen: int | None) -> float:
        """DCGM's replay rate per lane and minute for the link's maximum generation (the rule file's)."""
        t = self._thresholds.pcie_replay
        return t.per_lane_per_min_at_gen4 * t.per_gen ** ((max_gen or t.gen_unknown) - 4)

    def _nvlink(self, g: _Gpu, comp: str, cfg: GpuConfig) -> list[Finding]:
        """Links active at start that went down; error counters (every nvlink_counters_every-th poll) rising."""
        rising: list[str] = []
        counters = self._polls % cfg.nvlink_counters_every == 0
        down = [str(link) for link in self._links_down(g, comp)]
        for link in g.active_links if counters else ():
            for counter, cname in NVLINK_COUNTERS.items():
                value = self._opt(comp, pynvml.nvmlDeviceGetNvLinkErrorCounter, g.handle, link, counter)
                if value is None:
                    continue
                before = g.nvlink_errors.get((link, counter))
                g.nvlink_errors[(link, counter)] = value
                if before is not None and value > before:
                    rising.append(f"link{link}.{cname}+{value - before}")
        out: list[Finding] = []
        if down:
            out.append(self._finding(comp, "GPU_NVLINK_DOWN", f"NVLink {', '.join(down)} inactive (active at start)",
                                     links=",".join(down)))
        if rising:
            out.append(self._finding(comp, "GPU_NVLINK_ERRORS", f"NVLink errors rising: {', '.join(rising)}",
                                     increases=",".join(rising)))
        return out

    def _links_down(self, g: _Gpu, comp: str) -> list[int]:
        """The links active at start that are inactive now.

        One nvmlDeviceGetFieldValues call per GPU (NVML_FI_DEV_NVLINK_GET_STATE, link in scopeId)
        instead of one nvmlDeviceGetNvLinkState per link: on an 18-link GPU that is 1 call a poll
        instead of 18, and NVML calls are most of this check's cost (issue 15's CPU budget). A driver
        that does not know the field gets the per-link calls from then on; a poll where an entry fails
        otherwise (a GPU falling off the bus) uses them too, so their errors are the poll's.
        """
        if not g.active_links:
            return []
        if g.link_fields is not False:
            if g.link_batch is None or len(g.link_batch.asked) != len(g.active_links):
                g.link_batch = FieldBatch([(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, link) for link in g.active_links])
            try:
                values: list[tuple[int, int]] | None = self._call(comp, g.link_batch.nvmlDeviceGetFieldValues,
                                                                   g.handle)
            except pynvml.NVMLError as e:
                if e.value not in _UNSUPPORTED:
                    raise
                values = None
            if values is not None and all(ret == pynvml.NVML_SUCCESS for ret, _ in values):
                g.link_fields = True
                return [link for link, (_, state) in zip(g.active_links, values, strict=True)
                        if state == pynvml.NVML_NVLINK_STATE_INACTIVE]
            if values is None or any(ret in _UNSUPPORTED for ret, _ in values):
                g.link_fields = False  # this driver does not answer the field: link by link from now on
        return [link for link in g.active_links
                if self._opt(comp, pynvml.nvmlDeviceGetNvLinkState, g.handle, link) == pynvml.NVML_FEATURE_DISABLED]

    def _power(self, g: _Gpu, comp: str) -> list[Finding]:
        """GPU_POWER_UNREADABLE; the draw read goes to the relative checks (`g.power_mw`)."""
        try:
            g.power_mw = int(self._call(comp, pynvml.nvmlDeviceGetPowerUsage, g.handle))
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError as e:
            return [self._finding(comp, "GPU_POWER_UNREADABLE", f"power draw unreadable: {e}", error=str(e))]
        return []

    # -- relative checks across the node's GPUs ----------------------------------------------------
    def _outliers(self, cfg: GpuConfig, now: float) -> list[Finding]:
        """GPU_CLOCK_OUTLIER / GPU_POWER_OUTLIER: a loaded GPU below the loaded GPUs' median by more than the
        tolerance for outlier_window (checks/gpu/outliers.py says why relative). A GPU that is idle, lost or
        without a reading has its window reset, and so has every GPU while fewer than outlier_min_gpus are
        loaded (no median worth the name). Uses this poll's readings only: no NVML call of its own."""
        loaded = [g for g in self.inventory if not g.lost and g.util is not None and g.util >= cfg.outlier_utilization]
        ids = {id(g) for g in loaded}  # by identity: _Gpu compares by value
        for g in self.inventory:
            if id(g) not in ids or len(loaded) < cfg.outlier_min_gpus:
                g.clock_low_since = g.power_low_since = None
        if len(loaded) < cfg.outlier_min_gpus:
            return []
        out: list[Finding] = []
        clocks = [float(g.sm_clock) for g in loaded if g.sm_clock is not None]
        powers = [float(g.power_mw) for g in loaded if g.power_mw is not None]
        for g in loaded:
            out += self._outlier(g, "clock", g.sm_clock, clocks, cfg.clock_tolerance, cfg, now)
            out += self._outlier(g, "power", g.power_mw, powers, cfg.power_tolerance, cfg, now)
        return out

    def _outlier(self, g: _Gpu, what: str, value: int | None, values: list[float], tolerance: float,
                 cfg: GpuConfig, now: float) -> list[Finding]:
        """One GPU, one quantity: its window below the median kept on `g`, a finding once it has held."""
        since_attr = f"{what}_low_since"
        low = (below_median(values, float(value), tolerance)
               if value is not None and len(values) >= cfg.outlier_min_gpus else None)
        if low is None:
            setattr(g, since_attr, None)
            return []
        since = getattr(g, since_attr)
        since = now if since is None else since
        setattr(g, since_attr, since)
        held = now - since
        if held < cfg.outlier_window:
            return []
        reasons = decode_reasons(g.reasons)
        code, label, unit, scale = (("GPU_CLOCK_OUTLIER", "SM clock", "MHz", 1.0) if what == "clock"
                                    else ("GPU_POWER_OUTLIER", "power draw", "W", 1000.0))  # NVML gives mW

        def num(x: float) -> str:
            return f"{x / scale:.1f}".removesuffix(".0")

        held_by = (f"clock event reasons: {', '.join(reasons)}" if reasons else "no clock event reason reported"
                   if g.reasons is not None else "clock event reasons NOT_SUPPORTED")
        return [self._finding(f"gpu/{g.bus}", code,
                              f"{label} {num(low.value)} {unit} is {low.below:.0f}% below the median "
                              f"{num(low.median)} {unit} of {low.peers} loaded GPUs (tolerance {tolerance:g}%) "
                              f"for {held:.0f}s; {held_by}",
                              value=f"{num(low.value)} {unit}", median=f"{num(low.median)} {unit}",
                              below=f"{low.below:.1f}%", tolerance=f"{tolerance:g}%", loaded_gpus=str(low.peers),
                              utilization=f"{g.util}%", since=f"{held:.0f}s",
                              reasons=",".join(reasons) or ("none" if g.reasons is not None else "NOT_SUPPORTED"),
                              reasons_mask="NOT_SUPPORTED" if g.reasons is None else hex(g.reasons))]

    def _temperature(self, comp: str, h: Any) -> int | None:
        try:
            return int(self._call(comp, pynvml.nvmlDeviceGetTemperatureV, h, pynvml.NVML_TEMPERATURE_GPU))
        except pynvml.NVMLError as e:
            if e.value not in _UNSUPPORTED:
                raise
        value = self._opt(comp, pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        return None if value is None else int(value)

    # -- hang signal ---------------------------------------------------------------------------
    def _stall(self, ctx: CheckContext, cfg: GpuConfig, now: float, pids: set[int], utils: list[int]) -> list[Finding]:
        """TRAINING_STALLED: processes alive, every GPU ~idle and RDMA/NIC traffic ~0 for stall_after."""
        if not pids or not utils or max(utils) > cfg.stall_utilization:
            self._stall_since, self._traffic = None, None
            return []
        # The NIC check's counters at its last poll, or sysfs read now without it (robustd/traffic.py).
        snap = ctx.traffic()
        prev, self._traffic = self._traffic, (snap.at, snap.total)
        if prev is None or snap.at <= prev[0]:  # no new snapshot since the last poll
            return []
        rate = (snap.total - prev[1]) / (snap.at - prev[0])
        if rate < 0 or rate > cfg.stall_traffic_bytes_per_s:
            self._stall_since = None
            return []
        self._stall_since = prev[0] if self._stall_since is None else self._stall_since
        idle = now - self._stall_since
        if idle < cfg.stall_after:
            return []
        return [self._finding("host", "TRAINING_STALLED",
                              f"{len(pids)} GPU processes alive, GPUs idle and network quiet for {idle:.0f}s",
                              pids=",".join(str(p) for p in sorted(pids)), max_utilization=f"{max(utils)}%",
                              traffic_bytes_per_s=f"{rate:.0f}", idle_for=f"{idle:.0f}s")]


def _readings(g: _Gpu) -> dict[str, float]:
    """One GPU's readings of its last poll, for robustd.inventory.GpuDevice.readings (evidence bundles)."""
    out = dict(g.readings)
    for key, value in (("utilization_pct", g.util), ("sm_clock_mhz", g.sm_clock),
                       ("power_w", None if g.power_mw is None else g.power_mw / 1000.0),
                       ("clocks_event_reasons", g.reasons)):
        if value is not None:
            out[key] = value
    return out
