"""GPUs left changed by a stop-time test: each GPU's settings read before a run and after it, what the run
changed set back where NVML can, and GPU_STATE_CHANGED where it cannot.

Why: a stop-time test runs as root with NVIDIA's tools, and those change GPU settings. NVIDIA's EUD has been
seen releasing the GPUs' frequency locks and leaving them downclocked (ByteRobust); a job restarted on such a
node runs slow and nothing raises a fault. So the manager reads the settings before the first test and after
the last, restores the fields that differ, reads them a third time, and names what is still not as it was.

What NVML reads back, and so what is compared: application clocks (graphics and memory,
nvmlDeviceGetApplicationsClock; nvmlDeviceGetClock's APP_CLOCK_TARGET where NVML 13 dropped it), the power
management limit and the enforced power limit, persistence mode, compute mode, ECC mode and MIG mode (each
current and pending). Fields a GPU answers NOT_SUPPORTED (or a
driver FUNCTION_NOT_FOUND) for are left out on that GPU. NOT readable: locked GPU and memory clocks
(nvmlDeviceSetGpuLockedClocks / SetMemoryLockedClocks have no getter in nvml.h, and nvmlDeviceGetClock's
clock ids are the current clock, the application clock target and default, and the customer boost maximum),
so a released clock lock is not seen here and not re-applied; the README says so.

Restored: application clocks (nvmlDeviceSetApplicationsClocks with both values from before), the power limit
(SetPowerManagementLimit), persistence mode and compute mode. Never restored: ECC and MIG modes (a change is
pending until the next GPU reset; setting it back is the operator's call, with that reset), and the enforced
limit, which follows the power limit and is verified like the rest. A field still different after the
restore is GPU_STATE_CHANGED (WARNING, RESET_GPU) on `gpu/<bus id>`, naming each field before → after.

The NVML calls run in a child process (`python -m robustd.diagnostics.gpustate`, on the daemon's own
interpreter, loading the library the GPU check loaded), in its own process group, killed at TIMEOUT: a driver
call that hangs ends the child, not the run. A child that fails, or an NVML error reading a GPU, is
robustd's own failure to look: an ERROR result with the reason, never a verdict on the hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
from typing import Any, Callable

from robustd.codes import CodeRule
from robustd.diagnostics.model import Status, TestResult

TEST = "gpu_state"  # the results' test name in the report (not a test one can ask for)
CODE = "GPU_STATE_CHANGED"
TIMEOUT = 20.0  # seconds for one child: nvmlInit without persistence mode can take seconds per GPU
MAX_OUTPUT = 1 << 20

# The fields, in report order; RESTORABLE are set back, the rest only compared.
FIELDS = ("app_clock_graphics", "app_clock_memory", "power_limit", "enforced_power_limit", "persistence_mode",
          "compute_mode", "ecc_mode_current", "ecc_mode_pending", "mig_mode_current", "mig_mode_pending")
RESTORABLE = ("app_clock_graphics", "app_clock_memory", "power_limit", "persistence_mode", "compute_mode")
_UNITS = {"app_clock_graphics": " MHz", "app_clock_memory": " MHz", "power_limit": " mW",
          "enforced_power_limit": " mW"}
_ENABLED = {0: "disabled", 1: "enabled"}
_COMPUTE = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


def codes() -> dict[str, CodeRule]:
    """GPU_STATE_CHANGED: a WARNING (the GPU works, as something other than what the operator set: slower,
    another power cap, ECC off after the next reset) with RESET_GPU (a reset applies or clears what is pending,
    and the operator sets the rest again). Raised once per run; held a day after it (no later run sees the
    difference again: its "before" is already the changed state)."""
    return {CODE: CodeRule(severity="WARNING", action="RESET_GPU", clear_after="1d",
                           description="a stop-time test left GPU settings changed that robustd could not set back "
                                       "(the fields before → after are in the evidence)")}


def show(field: str, value: int) -> str:
    """A value as an operator reads it: clocks in MHz, limits in mW, modes by name."""
    if field in ("persistence_mode", "ecc_mode_current", "ecc_mode_pending", "mig_mode_current",
                 "mig_mode_pending"):
        return _ENABLED.get(value, str(value))
    if field == "compute_mode":
        return _COMPUTE.get(value, str(value))
    return f"{value}{_UNITS.get(field, '')}"


# -- the daemon's side -------------------------------------------------------------------------
Snapshot = dict[str, dict[str, dict[str, Any]]]  # bus -> {"values": {field: int}, "errors": {field: str}}


async def _child(library: str, command: str, buses: list[str], stdin: bytes, timeout: float
                 ) -> tuple[dict[str, Any] | None, str]:
    """Run the NVML child to its JSON answer; (None, why) when it could not."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"]
                                               if os.environ.get("PYTHONPATH") else "")}
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "robustd.diagnostics.gpustate", command, "--library", library,
            "--gpus", ",".join(buses), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env=env)
    except OSError as e:
        return None, f"the NVML child could not start: {e}"
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate(stdin)
    except TimeoutError:
        return None, f"NVML did not answer within {timeout:g}s (the child was killed)"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: pgid == pid
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(proc.wait(), 5)
    try:
        answer = json.loads(out[-MAX_OUTPUT:].decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = err.decode("utf-8", "replace").strip().splitlines()
        return None, f"the NVML child exited {proc.returncode}" + (f": {tail[-1][:500]}" if tail else "")
    if not isinstance(answer, dict):
        return None, "the NVML child printed no JSON object"
    if answer.get("error"):
        return None, str(answer["error"])[:500]
    return answer, ""


def _errors(snapshot: Snapshot, when: str) -> list[TestResult]:
    """ERROR results for the GPUs whose settings NVML could not read (robustd's failure, not the GPU's)."""
    out = []
    for bus, gpu in snapshot.items():
        if errors := gpu.get("errors") or {}:
            what = "; ".join(f"{f}: {e}" for f, e in sorted(errors.items()))
            out.append(TestResult(test=TEST, component=f"gpu/{bus}", status=Status.ERROR,
                                  message=f"could not read this GPU's settings {when} the run ({what}); "
                                          "they are not compared", details={"errors": what[:4000]}))
    return out


async def record(library: str, buses: list[str], timeout: float = TIMEOUT) -> tuple[Snapshot | None, list[TestResult]]:
    """The settings before a run, and ERROR results for what could not be read."""
    answer, why = await _child(library, "read", buses, b"", timeout)
    if answer is None:
        return None, [TestResult(test=TEST, component="host", status=Status.ERROR,
                                 message=f"could not read the GPUs' settings before the run: {why}; "
                                         "nothing will be restored after it")]
    snapshot: Snapshot = answer.get("state") or {}
    return snapshot, _errors(snapshot, "before")


async def restore(library: str, before: Snapshot, timeout: float = TIMEOUT) -> list[TestResult]:
    """After a run: read, set back what changed, read again; the results say what was restored and what not."""
    answer, why = await _child(library, "restore", sorted(before), json.dumps(before).encode(), timeout)
    if answer is None:
        return [TestResult(test=TEST, component="host", status=Status.ERROR,
                           message=f"could not read or restore the GPUs' settings after the run: {why}")]
    return judge(before, answer.get("after") or {}, answer.get("attempts") or {}, answer.get("final") or {})


def judge(before: Snapshot, after: Snapshot, attempts: dict[str, dict[str, str]], final: Snapshot
          ) -> list[TestResult]:
    """One result per GPU the run changed: PASS when all was set back (what, in details), FAIL naming each
    field still different (GPU_STATE_CHANGED); ERRORs where the reads after the run failed."""
    results = _errors({b: g for b, g in after.items() if b in before}, "after")
    for bus in sorted(before):
        was = (before[bus].get("values") or {})
        now = (after.get(bus, {}).get("values") or {})
        end = (final.get(bus, {}).get("values") or {})
        tried = attempts.get(bus, {})
        restored, left = {}, {}
        for f in FIELDS:
            if f not in was or f not in now or was[f] == now[f]:
                continue
            change = f"{show(f, was[f])} → {show(f, now[f])}"
            if end.get(f) == was[f]:
                restored[f] = change
            elif f not in RESTORABLE and f != "enforced_power_limit":  # ECC, MIG
                left[f] = f"{change} (applies at the next GPU reset; not set back)"
            elif f == "enforced_power_limit":
                left[f] = f"{change} (follows the power limit; reads {show(f, end[f]) if f in end else 'nothing'})"
            elif tried.get(f):
                left[f] = f"{change} (setting it back failed: {tried[f]})"
            else:
                left[f] = f"{change} (set back, but reads {show(f, end[f]) if f in end else 'nothing'})"
        if not restored and not left:
            continue
        details = {f: f"{v}; restored" for f, v in restored.items()} | left
        said = "; ".join(f"{f} {v}" for f, v in restored.items())
        if left:
            message = ("the stop-time run left GPU settings changed: " + "; ".join(f"{f} {v}" for f, v in left.items())
                       + (f"; restored: {said}" if said else ""))
            results.append(TestResult(test=TEST, component=f"gpu/{bus}", status=Status.FAIL, message=message,
                                      details=details))
        else:
            results.append(TestResult(test=TEST, component=f"gpu/{bus}", status=Status.PASS,
                                      message=f"restored what the stop-time run changed: {said}", details=details))
    return results


# -- the child -----------------------------------------------------------------------------------
def _app_clock(n: Any, handle: Any, clock: int) -> int:
    """nvmlDeviceGetApplicationsClock, deprecated in NVML 13: where it is gone, the same target through
    nvmlDeviceGetClock(NVML_CLOCK_ID_APP_CLOCK_TARGET)."""
    try:
        return int(n.nvmlDeviceGetApplicationsClock(handle, clock))
    except n.NVMLError as e:
        if e.value not in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
            raise
        return int(n.nvmlDeviceGetClock(handle, clock, n.NVML_CLOCK_ID_APP_CLOCK_TARGET))


def _readers(n: Any) -> list[tuple[tuple[str, ...], Callable[[Any], tuple[int, ...]]]]:
    return [
        (("app_clock_graphics",), lambda h: (_app_clock(n, h, n.NVML_CLOCK_GRAPHICS),)),
        (("app_clock_memory",), lambda h: (_app_clock(n, h, n.NVML_CLOCK_MEM),)),
        (("power_limit",), lambda h: (n.nvmlDeviceGetPowerManagementLimit(h),)),
        (("enforced_power_limit",), lambda h: (n.nvmlDeviceGetEnforcedPowerLimit(h),)),
        (("persistence_mode",), lambda h: (n.nvmlDeviceGetPersistenceMode(h),)),
        (("compute_mode",), lambda h: (n.nvmlDeviceGetComputeMode(h),)),
        (("ecc_mode_current", "ecc_mode_pending"), lambda h: tuple(n.nvmlDeviceGetEccMode(h))),
        (("mig_mode_current", "mig_mode_pending"), lambda h: tuple(n.nvmlDeviceGetMigMode(h))),
    ]


def read_settings(n: Any, handle: Any) -> tuple[dict[str, int], dict[str, str], list[str]]:
    """One GPU's settings through pynvml `n`: (values, errors by field, the fields NOT_SUPPORTED here). Also
    bench/gpu_validate.py's read, so a real-GPU run shows which of these a driver answers."""
    unsupported = (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND)
    values: dict[str, int] = {}
    errors: dict[str, str] = {}
    missing: list[str] = []
    for names, read in _readers(n):
        try:
            values.update(zip(names, (int(v) for v in read(handle)), strict=True))
        except n.NVMLError as e:
            name = names[0].removesuffix("_current")
            if e.value in unsupported:
                missing.append(name)
            else:
                errors[name] = str(e)
    return values, errors, missing


def _read(n: Any, handles: dict[str, Any], buses: list[str], unnamed: list[str]) -> Snapshot:
    out: Snapshot = {}
    for bus in buses:
        if bus not in handles:
            why = "NVML does not list this GPU" + (f" ({'; '.join(unnamed)[:300]})" if unnamed else "")
            out[bus] = {"values": {}, "errors": {"gpu": why}}
            continue
        values, errors, _ = read_settings(n, handles[bus])
        out[bus] = {"values": values, "errors": errors}
    return out


def _restore(n: Any, handles: dict[str, Any], before: Snapshot, after: Snapshot) -> dict[str, dict[str, str]]:
    """Set back each restorable field that differs; {bus: {field: "" or the NVML error}}."""
    out: dict[str, dict[str, str]] = {}
    for bus, gpu in before.items():
        was, now, h = gpu.get("values") or {}, (after.get(bus) or {}).get("values") or {}, handles.get(bus)
        if h is None:
            continue
        tried = out.setdefault(bus, {})
        changed = [f for f in RESTORABLE if f in was and f in now and was[f] != now[f]]
        clocks = ("app_clock_graphics", "app_clock_memory")
        if any(f in changed for f in clocks) and all(f in was for f in clocks):
            tried.update(dict.fromkeys(clocks, _attempt(n, n.nvmlDeviceSetApplicationsClocks, h,
                                                        was["app_clock_memory"], was["app_clock_graphics"])))
        if "power_limit" in changed:
            tried["power_limit"] = _attempt(n, n.nvmlDeviceSetPowerManagementLimit, h, was["power_limit"])
        if "persistence_mode" in changed:
            tried["persistence_mode"] = _attempt(n, n.nvmlDeviceSetPersistenceMode, h, was["persistence_mode"])
        if "compute_mode" in changed:
            tried["compute_mode"] = _attempt(n, n.nvmlDeviceSetComputeMode, h, was["compute_mode"])
    return out


def _attempt(n: Any, fn: Callable[..., Any], *args: Any) -> str:
    """One NVML setter: "" when it took, else NVML's error (a daemon not root: Insufficient Permissions)."""
    try:
        fn(*args)
    except n.NVMLError as e:
        return str(e)
    return ""


def child(argv: list[str]) -> dict[str, Any]:
    """`read` or `restore` (the before snapshot on stdin) over the GPUs named, as one JSON object."""
    p = argparse.ArgumentParser(prog="python -m robustd.diagnostics.gpustate")
    p.add_argument("command", choices=("read", "restore"))
    p.add_argument("--library", default="")
    p.add_argument("--gpus", default="")
    args = p.parse_args(argv)
    if args.library:
        ctypes.CDLL(args.library, mode=ctypes.RTLD_GLOBAL)  # before pynvml's dlopen of the same SONAME
    import pynvml as n

    from checks.gpu.parse import normalize_bus_id, nvml_text

    try:
        n.nvmlInit()
    except n.NVMLError as e:
        return {"error": f"nvmlInit: {e}"}
    try:
        handles: dict[str, Any] = {}
        unnamed: list[str] = []  # GPUs NVML lists but that cannot say who they are (lost since)
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            try:
                handles[normalize_bus_id(nvml_text(n.nvmlDeviceGetPciInfo(h).busId))] = h
            except n.NVMLError as e:
                unnamed.append(f"NVML index {i}: {e}")
        buses = [b for b in args.gpus.split(",") if b]
        if args.command == "read":
            return {"state": _read(n, handles, buses, unnamed)}
        before: Snapshot = json.load(sys.stdin)
        after = _read(n, handles, buses, unnamed)
        attempts = _restore(n, handles, before, after)
        return {"after": after, "attempts": attempts, "final": _read(n, handles, buses, unnamed)}
    except n.NVMLError as e:
        return {"error": f"NVML: {e}"}
    finally:
        with contextlib.suppress(n.NVMLError):
            n.nvmlShutdown()


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1:])))
