"""NVML events for the GPU check: faults the driver pushes, turned into findings at once.

One event set over every GPU, each GPU registered for the types it supports among those robustd
acts on (`nvmlDeviceGetSupportedEventTypes`); one daemon thread waits on it with a bounded timeout
(WAIT_MS), so a stop is seen within that and the set is freed by the thread that waits on it.

What each event becomes (the same codes and components as the kernel check and the poll, so the
policy keeps one condition whichever source saw the fault first):

- Xid critical error -> `XID_<n>` on `gpu/<bus id>` (eventData is the Xid; 999 means "unknown");
  Xid 154 is read like a recovery-action event;
- double-bit ECC -> GPU_ECC_DBE; DRAM retirement failure -> GPU_ROW_REMAP_FAILURE; fatal poison ->
  GPU_FATAL_POISON; GPU unavailable -> GPU_LOST;
- recovery action -> XID_154 with the severity and action the kernel rule XID_154 gives the same
  action (its hints, applied to `0x<n> (<label>)`); back to NONE resolves XID_154, as the kernel
  line "... to 0x0 (None)" does. eventData is 0 for these: the action is read from the field
  NVML_FI_DEV_GET_GPU_RECOVERY_ACTION.

A wait (or a field read) that does not return within its timeout plus the poll deadline is a hang:
`hang_findings` reports NVML_HANG on `host` (an event set spans every GPU) while the thread stays stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from checks.kernel import xid
from robustd.model import Action, Finding, FindingKind, Severity

log = logging.getLogger("robustd.checks.gpu")

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
RETIREMENT_FAILURE = pynvml.nvmlEventTypeDramRetirementFailure
FATAL_POISON = pynvml.nvmlEventTypeFatalPoisonError
UNAVAILABLE = pynvml.nvmlEventTypeGpuUnavailableError
RECOVERY = pynvml.nvmlEventTypeGpuRecoveryAction
WANTED = XID | DBE | RETIREMENT_FAILURE | FATAL_POISON | UNAVAILABLE | RECOVERY
TYPE_NAMES = {XID: "xid", DBE: "dbe", RETIREMENT_FAILURE: "dram_retirement_failure", FATAL_POISON: "fatal_poison",
              UNAVAILABLE: "gpu_unavailable", RECOVERY: "gpu_recovery_action"}
EVENT_CODES = {DBE: ("GPU_ECC_DBE", "double-bit (uncorrectable) ECC error"),
               RETIREMENT_FAILURE: ("GPU_ROW_REMAP_FAILURE", "DRAM retirement (row remapping) failed"),
               FATAL_POISON: ("GPU_FATAL_POISON", "fatal poison error: corrupted data was consumed"),
               UNAVAILABLE: ("GPU_LOST", "the GPU became unavailable")}
RECOVERY_XID = 154
UNKNOWN_XID = 999  # eventData for an Xid the driver does not know
RECOVERY_LABELS = {0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required", 3: "Drain P2P",
                   4: "Drain and Reset", 5: "Recover IMEX Domain", 6: "Bus Reset Required", 7: "System Reboot Required"}
WAIT_MS = 500  # each wait's bound: a stop is seen within this
REPEAT_WINDOW = 10.0  # an Xid 154 event and a recovery-action event with the same action are one report (paired)
NO_INSTANCE = 0xFFFFFFFF

MakeFinding = Callable[..., Finding]  # GpuCheck._finding(component, code, message, severity, action, kind, **ev)


def recovery_meaning(action: int) -> tuple[str, Severity | None, Action | None]:
    """`0x4 (Drain and Reset)`, and the severity and action the kernel rule XID_154 gives that text
    (checks/kernel/xid.py: one mapping of actions for both sources)."""
    text = f"0x{action:x} ({RECOVERY_LABELS.get(action, 'Unknown')})"
    return (text, *xid.recovery(text))


class EventWatcher:
    """The event set and its waiting thread. Built and registered on the poll thread (so a hung
    registration is the poll's NVML_HANG); `run` starts the thread; `stop` is seen within WAIT_MS."""

    def __init__(self, gpus: Sequence[tuple[Any, str, int | None]], make: MakeFinding,
                 emit: Callable[[list[Finding]], None], call: Callable[..., Any]):
        """gpus: (handle, bus id, handle address) of every GPU; call: GpuCheck._call (hang tracking)."""
        self._make = make
        self._emit = emit
        self._stop = threading.Event()
        self._in_call: tuple[str, float, float] | None = None  # (call, since, allowed seconds)
        self._by_address = {addr: bus for _, bus, addr in gpus}
        self._recent: dict[tuple[str, int], tuple[float, int]] = {}  # (bus, action) -> (when, event type)
        self.registered: list[str] = []
        self.unsupported: list[str] = []  # "<bus>: <why>"
        self._set = call("host", pynvml.nvmlEventSetCreate)
        for handle, bus, _ in gpus:
            self._register(call, handle, bus)
        self.thread: threading.Thread | None = None

    def _register(self, call: Callable[..., Any], handle: Any, bus: str) -> None:
        comp = f"gpu/{bus}"
        try:
            types = call(comp, pynvml.nvmlDeviceGetSupportedEventTypes, handle) & WANTED
            if not types:
                self.unsupported.append(f"{bus}: no supported event types")
                return
            call(comp, pynvml.nvmlDeviceRegisterEvents, handle, types, self._set)
        except pynvml.NVMLError as e:
            self.unsupported.append(f"{bus}: {e}")
            return
        missing = [name for bit, name in TYPE_NAMES.items() if not types & bit]
        self.registered.append(bus + (f" (without {','.join(missing)})" if missing else ""))

    def note(self) -> str:
        """One line for ListChecks: which GPUs push events, and which do not (polled only)."""
        if not self.unsupported:
            return ""
        head = "NVML events NOT_SUPPORTED on " + (
            "any GPU" if not self.registered else f"{len(self.unsupported)} of "
            f"{len(self.unsupported) + len(self.registered)} GPUs") + "; polling only there"
        return f"{head} ({'; '.join(self.unsupported)})"

    def run(self) -> None:
        if not self.registered:
            self.free()
            return
        self.thread = threading.Thread(target=self._loop, name="gpu-events", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def free(self) -> None:
        try:
            pynvml.nvmlEventSetFree(self._set)
        except pynvml.NVMLError as e:
            log.debug("nvmlEventSetFree: %s", e)

    # -- hang -----------------------------------------------------------------------------------
    def hang_findings(self, grace: float) -> list[Finding]:
        """NVML_HANG while a wait or a field read has overrun its bound by `grace` seconds."""
        now = self._in_call
        if now is None or self._stop.is_set():
            return []
        call, since, allowed = now
        waited = time.monotonic() - since
        if waited < allowed + grace:
            return []
        return [self._make("host", "NVML_HANG", f"NVML call {call} has not returned for {waited:.1f}s "
                           f"(bounded to {allowed:g}s)", call=call, stuck_for=f"{waited:.1f}s")]

    def _calling(self, allowed: float, fn: Callable[..., Any], *args: Any) -> Any:
        self._in_call = (fn.__name__, time.monotonic(), allowed)
        try:
            return fn(*args)
        finally:
            self._in_call = None

    # -- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        last_error = ""
        try:
            while not self._stop.is_set():
                try:
                    data = self._calling(WAIT_MS / 1000, pynvml.nvmlEventSetWait_v2, self._set, WAIT_MS)
                except pynvml.NVMLError_Timeout:
                    continue
                except pynvml.NVMLError as e:  # e.g. GPU_IS_LOST: the poll reports the GPU; do not spin
                    if str(e) != last_error:
                        log.warning("NVML event wait failed: %s (retrying every %dms)", e, WAIT_MS)
                        last_error = str(e)
                    self._stop.wait(WAIT_MS / 1000)
                    continue
                findings = self._findings(data)
                if findings and not self._stop.is_set():
                    self._emit(findings)
        except Exception:  # noqa: BLE001 - the poll goes on without events; say why once
            log.exception("the NVML event watcher stopped")
        finally:
            self.free()

    def _findings(self, data: Any) -> list[Finding]:
        bus = self._by_address.get(address(data.device))
        if bus is None:
            log.warning("NVML event %#x for a GPU not in the inventory; ignored", data.eventType)
            return []
        comp = f"gpu/{bus}"
        kind = int(data.eventType)
        ev = {"bdf": bus, "event": TYPE_NAMES.get(kind, hex(kind)), "source": "nvml_event"}
        if data.gpuInstanceId != NO_INSTANCE:
            ev["gpu_instance"] = str(data.gpuInstanceId)
        if data.computeInstanceId != NO_INSTANCE:
            ev["compute_instance"] = str(data.computeInstanceId)
        if kind == RECOVERY or (kind == XID and data.eventData == RECOVERY_XID):
            return self._recovery(data.device, comp, bus, ev, kind)
        if kind == XID:
            xid = int(data.eventData)
            ev["xid"] = str(xid)
            what = "an Xid the driver does not know" if xid == UNKNOWN_XID else f"Xid {xid}"
            return [self._make(comp, f"XID_{xid}", f"{what} on GPU {bus} (NVML event)",
                               kind=FindingKind.OCCURRENCE, **ev)]
        if kind == DBE:
            # The volatile count as of this event: the poll may have read (and reported) the same error first,
            # and GpuCheck.watch drops an event whose count the poll has already seen (one error, counted once).
            try:
                ev["count"] = str(int(self._calling(WAIT_MS / 1000, pynvml.nvmlDeviceGetTotalEccErrors, data.device,
                                                    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                    pynvml.NVML_VOLATILE_ECC)))
            except pynvml.NVMLError as e:
                ev["count_error"] = str(e)
        if kind in EVENT_CODES:
            code, text = EVENT_CODES[kind]
            return [self._make(comp, code, f"{text} on GPU {bus} (NVML event)", kind=FindingKind.OCCURRENCE, **ev)]
        return []

    def _recovery(self, handle: Any, comp: str, bus: str, ev: dict[str, str], kind: int) -> list[Finding]:
        try:
            [field] = self._calling(WAIT_MS / 1000, pynvml.nvmlDeviceGetFieldValues, handle,
                                    [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
        except pynvml.NVMLError as e:
            field, ev["field_error"] = None, str(e)
        if field is None or field.nvmlReturn != pynvml.NVML_SUCCESS:
            action = -1  # unreadable: the kernel rule's default meaning for XID_154 decides
            ev.setdefault("field_error", str(pynvml.NVMLError(field.nvmlReturn)) if field is not None else "")
        else:
            action = int(field.value.uiVal)
        now = time.monotonic()
        self._recent = {k: v for k, v in self._recent.items() if now - v[0] < REPEAT_WINDOW}
        other = self._recent.pop((bus, action), None)
        if other is not None and other[1] != kind:
            return []  # the Xid 154 event and the recovery-action event of one change: reported once
        self._recent[(bus, action)] = (now, kind)
        ev["xid"] = str(RECOVERY_XID)
        if action == pynvml.NVML_GPU_RECOVERY_ACTION_NONE:
            return [self._make(comp, "XID_154", f"GPU {bus} needs no recovery action any more (NVML event)",
                               kind=FindingKind.RESOLVED, **ev)]
        text, severity, act = recovery_meaning(action) if action >= 0 else ("unreadable", None, None)
        ev["recovery"] = text
        return [self._make(comp, "XID_154", f"driver requires recovery action {text} on GPU {bus} (NVML event)",
                           severity, act, kind=FindingKind.OCCURRENCE, **ev)]


def address(handle: Any) -> int | None:
    """A device handle's identity (NVML hands out the same pointer for the same GPU)."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[list[Finding]]) -> Callable[[list[Finding]], None]:
    """From the watcher thread to the check's `reports` on the event loop; nothing after the loop closed."""

    def put(findings: list[Finding]) -> None:
        try:
            queue.put_nowait(findings)
        except asyncio.QueueFull:
            log.warning("NVML events arrive faster than they are handled; %d findings dropped", len(findings))

    def emit(findings: list[Finding]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is stopping
            loop.call_soon_threadsafe(put, findings)

    return emit
