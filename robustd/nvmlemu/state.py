"""The NVML emulator's state file: what the emulated GPUs report, and which faults they have.

The emulator (`nvml_emulator.c`) reads this file at nvmlInit and again whenever it changes
(it stats the file on every call), so tests and `robustctl sim` edit a running node by
rewriting it. Writes are atomic (a temp file renamed over the old one), so the emulator
never reads half a file.

Format (text, one `key = value` a line, `#` comments; numbers may be hex with 0x)::

    driver_version = 550.54.15
    nvml_version = 12.550.54.15
    init_error = 0                # a non-zero NVML return code makes nvmlInit fail with it
    [gpu 0]
    name = NVIDIA H100 80GB HBM3
    uuid = GPU-...
    bus_id = 00000000:1B:00.0     # as NVML prints it: 8-digit domain, upper-case hex
    temperature = 35
    ...
    power_mw = 72000              # nvmlDeviceGetPowerUsage (-1: the reading fails)
    sm_clock_mhz = 345            # nvmlDeviceGetClockInfo(NVML_CLOCK_SM or GRAPHICS); -1: NOT_SUPPORTED
    utilization_gpu = 0           # nvmlDeviceGetUtilizationRates
    nvlink_down = 3,7             # links that report inactive
    nvlink_errors = 3:2:12        # link:counter:value (counter = nvmlNvLinkErrorCounter_t)
    processes = 4242:1073741824   # pid:used bytes, the compute processes
    faults = lost,hang            # lost | hang | vanish act in C; the rest are recorded here
    event_types = 0xfe9f          # nvmlDeviceGetSupportedEventTypes (0: this GPU supports no events)
    recovery_action = 0           # field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvmlDeviceGpuRecoveryAction_t)
    events = 7:0x8:79:1700000000000000000   # seq:type:data:time_ns, the GPU's newest EVENTS_KEPT events
    event_floor = 0               # events at or below this seq are discarded (`clear`)
    fabric_state = 3              # nvmlDeviceGetGpuFabricInfoV: NVML_GPU_FABRIC_STATE_* (0 no fabric, 1 not
                                  # started, 2 in progress, 3 completed); -1: the call itself is NOT_SUPPORTED
    fabric_status = 0             # its status (an nvmlReturn_t; read by callers only once completed)
    fabric_clique = 1             # cliqueId
    fabric_cluster_uuid = 5ef1a7c0-0b3e-4f6d-9a21-7c0de0000001   # clusterUuid: 32 hex digits, dashes allowed
    fabric_health_mask = 0xaa     # healthMask (NVML_GPU_FABRIC_HEALTH_MASK_*): 0xaa says every field healthy

`lost`, `hang` and `vanish` are interpreted by the emulator. The metric faults (ecc-dbe,
remap-pending, ...) are applied by `apply_fault` as changes to the metrics themselves and
recorded in `faults` so that `clear` can undo them.

Event faults (xid, unavailable, retirement-failure, poison, recovery-action; ecc-dbe too) append
an event with the next `event_seq` (top level) and the wall-clock time. The emulator hands each
new event to the event sets that had registered that GPU and type by then, never to later ones,
and `clear` raises the GPU's `event_floor` so its undelivered events are dropped.

NVLink fabric (NVSwitch systems): a healthy node's GPUs have registered with the fabric (state
completed, status success, one clique and cluster). `fault gpu N fabric not-started|in-progress|error|
degraded` changes what nvmlDeviceGetGpuFabricInfoV answers; `clear` puts it back to completed.
`healthy_node(n, fabric=False)` (`sim init --no-fabric`) is a node of PCIe cards: state NOT_SUPPORTED.

Load, clocks and power are plain values (`sim set gpu N utilization_gpu 95`, `sm_clock_mhz 1400`,
`power_mw 420000`, `clocks_event_reasons 0x4`); `under_load` puts a GPU where a training step keeps it.
Settings (app_clock_*, power_limit_mw, persistence_mode, compute_mode, ecc_mode/ecc_pending, mig_mode/
mig_pending; -1 makes the getter NOT_SUPPORTED): the emulator's setters write them back into this file,
and anything else (a test's fake dcgmi) may change them with `set_value`; `set_error` makes the setters fail.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, fields

from robustd import atomicfile

ENV_VAR = "ROBUSTD_NVML_EMULATOR_STATE"
MAX_GPUS = 16
MAX_NVLINKS = 18

# nvmlClocksEventReason* bits
REASON_GPU_IDLE = 0x1
REASON_HW_SLOWDOWN = 0x8
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80
HEALTHY_TEMPERATURE = 35
IDLE_POWER_MW = 72_000
IDLE_SM_CLOCK_MHZ = 345  # an idle H100 SXM's SM clock
BOOST_SM_CLOCK_MHZ = 1980  # its maximum SM clock, where it sits under load unless held down
LOADED_POWER_MW = 650_000  # an H100 SXM (700 W limit) in a training step

# nvmlEventType bits (nvml.h)
EVENT_DBE = 0x2
EVENT_XID = 0x8
EVENT_DRAM_RETIREMENT_FAILURE = 0x800
EVENT_FATAL_POISON = 0x2000
EVENT_GPU_UNAVAILABLE = 0x4000
EVENT_GPU_RECOVERY_ACTION = 0x8000
EVENT_TYPES_ALL = 0xFE9F  # nvmlEventTypeAll: what an emulated GPU supports unless told otherwise
EVENTS_KEPT = 64  # per GPU in the file (the emulator's EMU_MAX_EVENTS)
# NVML_GPU_FABRIC_STATE_* (nvml.h); FABRIC_CALL_UNSUPPORTED is the emulator's own: the call answers NOT_SUPPORTED
FABRIC_CALL_UNSUPPORTED = -1
FABRIC_NOT_SUPPORTED, FABRIC_NOT_STARTED, FABRIC_IN_PROGRESS, FABRIC_COMPLETED = 0, 1, 2, 3
# healthMask with every field the driver reports "not degraded / not in recovery / healthy" (each field is
# 2 bits; value 2 is FALSE): degraded bandwidth, route recovery, route unhealthy, access timeout recovery
FABRIC_HEALTHY_MASK = 0xAA
FABRIC_DEGRADED_BW = 0x1  # NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE at shift 0 (width 0x3)
NVML_ERROR_UNKNOWN = 999
# `robustctl sim fault gpu N fabric STATE`
FABRIC_FAULTS = ("not-started", "in-progress", "error", "degraded")
# nvmlDeviceGpuRecoveryAction_t, by the names `robustctl sim fault gpu N recovery-action NAME` takes
RECOVERY_ACTIONS = {"none": 0, "gpu-reset": 1, "node-reboot": 2, "drain-p2p": 3, "drain-and-reset": 4,
                    "recover-imex-domain": 5, "bus-reset": 6, "system-reboot": 7}

FAULTS = ("lost", "hang", "vanish", "ecc-dbe", "remap-pending", "remap-failure", "hw-slowdown",
          "nvlink-down", "nvlink-errors", "pcie-width", "pcie-replay", "power-unreadable",
          "xid", "retirement-failure", "unavailable", "poison", "recovery-action", "fabric")
FAULTS_WITH_VALUE = {"xid": "XID", "recovery-action": "ACTION", "fabric": "STATE"}  # `fault gpu N xid 79`
# DGX H100 GPU bus numbers; GPUs beyond eight get made-up ones.
_DGX_BUSES = (0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF)


@dataclass
class GpuState:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    bus_id: str = ""
    pci_device_id: int = 0x233010DE
    temperature: int = HEALTHY_TEMPERATURE
    temp_slowdown: int = 87
    temp_shutdown: int = 92
    temp_gpu_max: int = 85
    clocks_event_reasons: int = REASON_GPU_IDLE
    ecc_sbe_volatile: int = 0
    ecc_dbe_volatile: int = 0
    ecc_sbe_aggregate: int = 0
    ecc_dbe_aggregate: int = 0
    remap_correctable: int = 0
    remap_uncorrectable: int = 0
    remap_pending: int = 0
    remap_failure: int = 0
    pcie_width: int = 16
    pcie_max_width: int = 16
    pcie_gen: int = 5
    pcie_max_gen: int = 5
    pcie_gpu_max_gen: int = 5
    pcie_replay: int = 0
    nvlink_count: int = MAX_NVLINKS
    nvlink_down: str = ""
    nvlink_errors: str = ""
    power_mw: int = IDLE_POWER_MW  # -1: the power reading fails (NVML_ERROR_UNKNOWN)
    sm_clock_mhz: int = IDLE_SM_CLOCK_MHZ  # nvmlDeviceGetClockInfo(NVML_CLOCK_SM); -1: NOT_SUPPORTED
    utilization_gpu: int = 0
    utilization_memory: int = 0
    processes: str = ""
    faults: str = ""
    event_types: int = EVENT_TYPES_ALL
    recovery_action: int = 0
    events: str = ""
    event_floor: int = 0
    fabric_state: int = FABRIC_COMPLETED
    fabric_status: int = 0
    fabric_clique: int = 1
    fabric_cluster_uuid: str = "5ef1a7c0-0b3e-4f6d-9a21-7c0de0000001"
    fabric_health_mask: int = FABRIC_HEALTHY_MASK
    # Settings a stop-time test may change (-1: NOT_SUPPORTED); H100 SXM defaults
    app_clock_graphics: int = 1980  # MHz, nvmlDeviceGetApplicationsClock / SetApplicationsClocks
    app_clock_mem: int = 2619
    app_clock_default_graphics: int = 1980  # what ResetApplicationsClocks goes back to
    app_clock_default_mem: int = 2619
    power_limit_mw: int = 700_000  # nvmlDeviceGetPowerManagementLimit (= the enforced limit here)
    persistence_mode: int = 1  # nvmlEnableState_t
    compute_mode: int = 0  # nvmlComputeMode_t: 0 DEFAULT, 2 PROHIBITED, 3 EXCLUSIVE_PROCESS
    ecc_mode: int = 1  # nvmlDeviceGetEccMode current; changes only at a GPU reset
    ecc_pending: int = 1  # ... and pending
    mig_mode: int = 0  # nvmlDeviceGetMigMode current
    mig_pending: int = 0
    set_error: int = 0  # non-zero nvmlReturn_t: every setter fails with it (4 NO_PERMISSION: not root)

    @property
    def fault_list(self) -> list[str]:
        return [f for f in self.faults.split(",") if f]


@dataclass
class EmulatorState:
    driver_version: str = "550.54.15"
    nvml_version: str = "12.550.54.15"
    init_error: int = 0
    event_seq: int = 0  # the last event's seq (events are numbered across GPUs)
    gpus: list[GpuState] = field(default_factory=list)


_GPU_FIELDS = {f.name: f.type for f in fields(GpuState)}
_TOP_FIELDS = {"driver_version": "str", "nvml_version": "str", "init_error": "int", "event_seq": "int"}
_NOT_SETTABLE = ("faults", "events", "event_floor")  # changed by fault and clear only
_HEX_FIELDS = ("pci_device_id", "clocks_event_reasons", "event_types", "fabric_health_mask")


def healthy_gpu(index: int) -> GpuState:
    bus = _DGX_BUSES[index] if index < len(_DGX_BUSES) else 0x20 + index
    return GpuState(uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'robustd-emulated-gpu-{index}')}",
                    bus_id=f"00000000:{bus:02X}:00.0")


def healthy_node(gpus: int, fabric: bool = True) -> EmulatorState:
    """A healthy H100-like node: idle GPUs, PCIe Gen5 x16, 18 NVLinks each, no errors, every GPU registered
    with the NVLink fabric (an HGX board's NVSwitches). `fabric=False`: PCIe cards, no fabric (NOT_SUPPORTED)."""
    if not 0 <= gpus <= MAX_GPUS:
        raise ValueError(f"the emulator holds 0 to {MAX_GPUS} GPUs, not {gpus}")
    node = EmulatorState(gpus=[healthy_gpu(i) for i in range(gpus)])
    if not fabric:
        for g in node.gpus:
            g.fabric_state, g.fabric_clique, g.fabric_health_mask = FABRIC_NOT_SUPPORTED, 0, 0
            g.fabric_cluster_uuid = "00000000-0000-0000-0000-000000000000"
    return node


# -- text form ---------------------------------------------------------------------------------
def dumps(state: EmulatorState) -> str:
    lines = ["# robustd NVML emulator state; edit with `robustctl sim`, read by libnvidia-ml.so.1 (emulated)",
             f"driver_version = {state.driver_version}", f"nvml_version = {state.nvml_version}",
             f"init_error = {state.init_error}", f"event_seq = {state.event_seq}"]
    for i, gpu in enumerate(state.gpus):
        lines.append(f"[gpu {i}]")
        for name in _GPU_FIELDS:
            value = getattr(gpu, name)
            lines.append(f"{name} = {hex(value) if name in _HEX_FIELDS else value}")
    return "\n".join(lines) + "\n"


def loads(text: str, source: str = "<state>") -> EmulatorState:
    state = EmulatorState()
    gpu: GpuState | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            parts = line[1:-1].split()
            if len(parts) != 2 or parts[0] != "gpu" or not parts[1].isdigit() or int(parts[1]) != len(state.gpus):
                raise ValueError(f"{source}:{n}: expected [gpu {len(state.gpus)}], got {line!r}")
            if len(state.gpus) >= MAX_GPUS:
                raise ValueError(f"{source}:{n}: at most {MAX_GPUS} GPUs")
            gpu = GpuState()
            state.gpus.append(gpu)
            continue
        key, sep, value = (s.strip() for s in line.partition("="))
        if not sep:
            raise ValueError(f"{source}:{n}: expected key = value, got {line!r}")
        kinds = _GPU_FIELDS if gpu is not None else _TOP_FIELDS
        if key not in kinds:
            raise ValueError(f"{source}:{n}: unknown key {key!r}")
        try:
            parsed: object = int(value, 0) if kinds[key] == "int" else value
        except ValueError:
            raise ValueError(f"{source}:{n}: {key} must be a number, got {value!r}") from None
        setattr(gpu if gpu is not None else state, key, parsed)
    return state


def load(path: str) -> EmulatorState:
    with open(path, encoding="utf-8") as f:
        return loads(f.read(), path)


def save(path: str, state: EmulatorState) -> None:
    """Atomic replace: the emulator sees the old file or the new one, never a mix."""
    atomicfile.write_bytes(path, dumps(state).encode("utf-8"))


# -- edits -------------------------------------------------------------------------------------
def _gpu(state: EmulatorState, index: int) -> GpuState:
    if not 0 <= index < len(state.gpus):
        raise ValueError(f"no GPU {index}: the state has {len(state.gpus)} GPUs")
    return state.gpus[index]


def set_value(state: EmulatorState, index: int, key: str, value: str) -> None:
    """Set one metric of one GPU (`temperature`, `utilization_gpu`, ...); dashes read as underscores."""
    key = key.replace("-", "_")
    gpu = _gpu(state, index)
    if key not in _GPU_FIELDS or key in _NOT_SETTABLE:
        known = ", ".join(k for k in _GPU_FIELDS if k not in _NOT_SETTABLE)
        raise ValueError(f"unknown GPU key {key!r} (known: {known})")
    if _GPU_FIELDS[key] == "int":
        try:
            setattr(gpu, key, int(value, 0))
        except ValueError:
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    else:
        setattr(gpu, key, value)


def under_load(state: EmulatorState, index: int, utilization: int = 95) -> None:
    """GPU `index` as in a training step: busy, at its boost SM clock, drawing a loaded GPU's power, and no
    longer idle among its clock event reasons (other reasons, e.g. a HW slowdown fault, stay)."""
    gpu = _gpu(state, index)
    gpu.utilization_gpu, gpu.sm_clock_mhz, gpu.power_mw = utilization, BOOST_SM_CLOCK_MHZ, LOADED_POWER_MW
    gpu.clocks_event_reasons &= ~REASON_GPU_IDLE


def _links(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def push_event(state: EmulatorState, index: int, event_type: int, data: int = 0) -> int:
    """Record one NVML event on GPU `index` now; returns its seq. The emulator delivers it to the
    event sets registered for it at this moment (and to no set registered later)."""
    gpu = _gpu(state, index)
    state.event_seq += 1
    entries = [e for e in gpu.events.split(",") if e][-(EVENTS_KEPT - 1):]
    gpu.events = ",".join([*entries, f"{state.event_seq}:{event_type:#x}:{data}:{time.time_ns()}"])
    return state.event_seq


def recovery_action(value: str) -> int:
    """`gpu-reset`, `node_reboot`, `2` -> the nvmlDeviceGpuRecoveryAction_t value."""
    name = value.strip().lower().replace("_", "-")
    if name in RECOVERY_ACTIONS:
        return RECOVERY_ACTIONS[name]
    try:
        number = int(name, 0)
    except ValueError:
        number = -1
    if number not in RECOVERY_ACTIONS.values():
        raise ValueError(f"unknown recovery action {value!r} (known: {', '.join(RECOVERY_ACTIONS)}, or 0-7)")
    return number


def _event_fault(state: EmulatorState, index: int, fault: str, value: str | None) -> str:
    """The event faults: each pushes its NVML event (and changes what a real one changes). Returns the
    name the fault is recorded under."""
    gpu = _gpu(state, index)
    if fault == "xid":
        try:
            xid = int(value or "", 0)
        except ValueError:
            raise ValueError(f"fault xid needs an Xid number (e.g. `xid 79`), got {value!r}") from None
        if not 0 < xid < 10_000:
            raise ValueError(f"an Xid is 1-9999, not {xid}")
        push_event(state, index, EVENT_XID, xid)
        return f"xid{xid}"
    if fault == "fabric":
        return _fabric_fault(gpu, value or "")
    if fault == "recovery-action":
        action = recovery_action(value or "")
        gpu.recovery_action = action
        push_event(state, index, EVENT_GPU_RECOVERY_ACTION)  # eventData 0: the reader looks the field up
        return f"recovery-action{action}"
    if fault == "retirement-failure":
        gpu.remap_failure = 1
        push_event(state, index, EVENT_DRAM_RETIREMENT_FAILURE)
    elif fault == "unavailable":
        push_event(state, index, EVENT_GPU_UNAVAILABLE)
        return "lost"  # the GPU is gone: its calls answer GPU_IS_LOST from now on
    elif fault == "poison":
        push_event(state, index, EVENT_FATAL_POISON)
    return fault


def _fabric_fault(gpu: GpuState, value: str) -> str:
    """What nvmlDeviceGetGpuFabricInfoV answers for a GPU whose fabric registration is stuck, failed or
    degraded; recorded as `fabric-<value>`."""
    if value not in FABRIC_FAULTS:
        raise ValueError(f"unknown fabric fault {value!r} (known: {', '.join(FABRIC_FAULTS)})")
    if gpu.fabric_state in (FABRIC_CALL_UNSUPPORTED, FABRIC_NOT_SUPPORTED):
        raise ValueError("this GPU has no NVLink fabric (fabric_state NOT_SUPPORTED): nothing to fail")
    if value == "not-started":
        gpu.fabric_state = FABRIC_NOT_STARTED
    elif value == "in-progress":
        gpu.fabric_state = FABRIC_IN_PROGRESS
    elif value == "error":
        gpu.fabric_state, gpu.fabric_status = FABRIC_COMPLETED, NVML_ERROR_UNKNOWN
    else:
        gpu.fabric_state = FABRIC_COMPLETED
        gpu.fabric_health_mask = (gpu.fabric_health_mask & ~0x3) | FABRIC_DEGRADED_BW
    return f"fabric-{value}"


def apply_fault(state: EmulatorState, index: int, fault: str, link: int = 0, value: str | None = None) -> None:
    """Inject one fault into GPU `index`; metric faults change the metrics a real fault would, event
    faults also push the NVML event the driver sends (`value`: the Xid, or the recovery action)."""
    gpu = _gpu(state, index)
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
    if fault in FAULTS_WITH_VALUE and value is None:
        raise ValueError(f"fault {fault} needs a value: `{fault} {FAULTS_WITH_VALUE[fault]}`")
    if fault not in FAULTS_WITH_VALUE and value is not None:
        raise ValueError(f"fault {fault} takes no value (got {value!r})")
    if fault in ("xid", "retirement-failure", "unavailable", "poison", "recovery-action", "fabric"):
        fault = _event_fault(state, index, fault, value)
    elif fault == "ecc-dbe":
        gpu.ecc_dbe_volatile += 1
        gpu.ecc_dbe_aggregate += 1
        push_event(state, index, EVENT_DBE)
    elif fault == "remap-pending":
        gpu.remap_uncorrectable += 1
        gpu.remap_pending = 1
    elif fault == "remap-failure":
        gpu.remap_failure = 1
    elif fault == "hw-slowdown":
        gpu.clocks_event_reasons = (gpu.clocks_event_reasons | REASON_HW_SLOWDOWN) & ~REASON_GPU_IDLE
    elif fault == "nvlink-down":
        if not 0 <= link < gpu.nvlink_count:
            raise ValueError(f"GPU {index} has links 0-{gpu.nvlink_count - 1}, not {link}")
        gpu.nvlink_down = ",".join(str(x) for x in sorted(set(_links(gpu.nvlink_down)) | {link}))
    elif fault == "nvlink-errors":
        entries = [e for e in gpu.nvlink_errors.split(",") if e]
        counts = {tuple(map(int, e.split(":")[:2])): int(e.split(":")[2]) for e in entries}
        counts[(link, 2)] = counts.get((link, 2), 0) + 10  # DL_CRC_FLIT
        gpu.nvlink_errors = ",".join(f"{lk}:{c}:{v}" for (lk, c), v in sorted(counts.items()))
    elif fault == "pcie-width":
        gpu.pcie_width = max(1, gpu.pcie_max_width // 2)
    elif fault == "pcie-replay":
        gpu.pcie_replay += 1000
    elif fault == "power-unreadable":
        gpu.power_mw = -1
    if fault not in gpu.fault_list:
        gpu.faults = ",".join([*gpu.fault_list, fault])


def clear(state: EmulatorState, index: int) -> None:
    """Undo GPU `index`'s faults as a GPU reset would: volatile ECC, pending remaps, links, width.

    Aggregate counters (lifetime ECC, remapped rows, replays, NVLink errors) stay, as on hardware;
    the temperature goes back to an idle GPU's. Events not yet delivered are discarded, and the
    recovery action goes back to none, and a GPU with a fabric is registered again (completed, healthy).
    """
    gpu = _gpu(state, index)
    if gpu.fabric_state not in (FABRIC_CALL_UNSUPPORTED, FABRIC_NOT_SUPPORTED):
        gpu.fabric_state, gpu.fabric_status = FABRIC_COMPLETED, 0
        gpu.fabric_health_mask = (gpu.fabric_health_mask & ~0x3) | (FABRIC_HEALTHY_MASK & 0x3)
    gpu.faults = ""
    gpu.events = ""
    gpu.event_floor = state.event_seq
    gpu.recovery_action = 0
    gpu.ecc_dbe_volatile = gpu.ecc_sbe_volatile = 0
    gpu.remap_pending = gpu.remap_failure = 0
    gpu.clocks_event_reasons &= ~(REASON_HW_SLOWDOWN | REASON_HW_THERMAL | REASON_HW_POWER_BRAKE)
    if gpu.utilization_gpu == 0:
        gpu.clocks_event_reasons |= REASON_GPU_IDLE
    gpu.nvlink_down = ""
    gpu.pcie_width = gpu.pcie_max_width
    gpu.power_mw = IDLE_POWER_MW if gpu.power_mw < 0 else gpu.power_mw
    gpu.temperature = HEALTHY_TEMPERATURE
