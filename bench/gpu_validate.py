"""Validate robustd on a host with a real NVIDIA GPU and driver; run by scripts/gpu-validate.sh.

Bounded (every step has a limit, the whole run `--budget`, default 300 s) and needs no build tools:
the shell wrapper makes a venv from the wheelhouse and runs this from the checkout. Steps:

1. nvml: NVML through the pinned pynvml, as the GPU check calls it: the inventory, every field the
   poll reads per GPU (value, NOT_SUPPORTED or error), the event types each GPU supports, and the NVLink
   fabric info (state, status, clique, cluster uuid, health mask; NOT_SUPPORTED where the GPU has no fabric,
   by the call or by its state), and the settings the diagnostics restore after a run (application clocks,
   power limits, persistence, compute, ECC and MIG modes; robustd/diagnostics/gpustate.py);
2. daemon: robustd with `checks.gpu.backend: nvml`: the GPU check's status and note (events
   NOT_SUPPORTED anywhere), the verdict on this (presumably healthy) node, the inventory it logged;
3. diag: the `all_to_all` and `minigpt` stop-time tests on the NCCL/CUDA path, twice: both PASS,
   and the MiniGPT digests of the two runs equal bit for bit;
4. dcgmi: `dcgmi discovery -l` and `dcgmi diag -r 1 -j`, when dcgmi is installed;
5. tracer: Tracer.CaptureStacks of a CUDA process (a torch child holding a CUDA context).

It prints a summary table and writes the same as JSON (`--out`). Without a driver every GPU step
is SKIP with what it would check: that is what the CPU-side test runs (tests/test_gpu_validate.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STEPS = ("nvml", "daemon", "diag", "dcgmi", "tracer")
WOULD = {
    "nvml": "inventory, every poll field per GPU (NOT_SUPPORTED ones named), supported NVML event types",
    "daemon": "robustd on the real NVML: GPU check status and note, verdict, logged inventory and event watch",
    "diag": "all_to_all and minigpt on NCCL/CUDA, twice: both PASS, MiniGPT digests equal bit for bit",
    "dcgmi": "dcgmi discovery -l and dcgmi diag -r 1 -j",
    "tracer": "Tracer.CaptureStacks of a torch process holding a CUDA context",
}
# pynvml calls the GPU check makes per GPU (checks/gpu/check.py _static and _poll_gpu), with their arguments.
POLL_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("temperature", "nvmlDeviceGetTemperatureV", ("NVML_TEMPERATURE_GPU",)),
    ("temperature_legacy", "nvmlDeviceGetTemperature", ("NVML_TEMPERATURE_GPU",)),
    ("temp_slowdown", "nvmlDeviceGetTemperatureThreshold", ("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",)),
    ("temp_shutdown", "nvmlDeviceGetTemperatureThreshold", ("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN",)),
    ("clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", ()),
    ("sm_clock_mhz", "nvmlDeviceGetClockInfo", ("NVML_CLOCK_SM",)),  # the relative checks (checks/gpu/outliers.py)
    ("ecc_dbe_volatile", "nvmlDeviceGetTotalEccErrors", ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC")),
    ("remapped_rows", "nvmlDeviceGetRemappedRows", ()),
    ("utilization", "nvmlDeviceGetUtilizationRates", ()),
    ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", ()),
    ("pcie_max_width", "nvmlDeviceGetMaxPcieLinkWidth", ()),
    ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration", ()),
    ("pcie_max_gen", "nvmlDeviceGetMaxPcieLinkGeneration", ()),
    ("pcie_replay", "nvmlDeviceGetPcieReplayCounter", ()),
    ("nvlink0_state", "nvmlDeviceGetNvLinkState", ("0",)),
    ("nvlink0_crc_flit", "nvmlDeviceGetNvLinkErrorCounter", ("0", "NVML_NVLINK_ERROR_DL_CRC_FLIT")),
    ("power_mw", "nvmlDeviceGetPowerUsage", ()),
    ("compute_processes", "nvmlDeviceGetComputeRunningProcesses", ()),
    ("supported_event_types", "nvmlDeviceGetSupportedEventTypes", ()),
)


@dataclass
class Row:
    step: str
    status: str  # PASS FAIL SKIP INFO
    detail: str
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def has_driver() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - any failure means no usable NVML here
        return False


def _value(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, (int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    if hasattr(v, "_fields_"):
        return {name: _value(getattr(v, name)) for name, *_ in v._fields_}
    return str(v)


def field_batch_agrees(n: Any, handle: Any) -> dict[str, Any]:
    """checks/gpu/nvml_fields.py's array against pynvml's own nvmlDeviceGetFieldValues, field by field:
    the GPU check reads NVLink state through the former, so its layout must be the driver's."""
    from checks.gpu.nvml_fields import _MEMBER, FieldBatch

    asked = [(n.NVML_FI_DEV_NVLINK_GET_STATE, 0), (n.NVML_FI_DEV_NVLINK_GET_STATE, 1),
             (n.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 0), (n.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 0),
             (n.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 0)]
    ours = FieldBatch(asked).nvmlDeviceGetFieldValues(handle)
    theirs = []
    for v in n.nvmlDeviceGetFieldValues(handle, asked):  # the union member by value type, as the batch reads it
        value = int(getattr(v.value, _MEMBER.get(v.valueType, "uiVal"))) if v.nvmlReturn == n.NVML_SUCCESS else 0
        theirs.append((int(v.nvmlReturn), value))
    return {"asked": asked, "ours": ours, "pynvml": theirs, "same": ours == theirs}


def fabric_info(n: Any, handle: Any) -> dict[str, Any]:
    """The GPU check's read of the NVLink fabric (checks/gpu/fabric.py), and the call's own answer: which of
    its fields this driver and GPU give (the state NOT_SUPPORTED on PCIe cards; the call on pre-Hopper)."""
    from checks.gpu.fabric import nvmlDeviceGetGpuFabricInfoV

    try:
        info = nvmlDeviceGetGpuFabricInfoV(handle)
    except n.NVMLError as e:
        return {"call": "NOT_SUPPORTED" if e.value == n.NVML_ERROR_NOT_SUPPORTED else f"error: {e}"}
    return {"call": "ok", "state": info.state_name, "status": info.status_name, "clique": info.clique,
            "cluster_uuid": info.cluster, "health_mask": "NOT_SUPPORTED" if info.health_mask is None
            else hex(info.health_mask), "problems": info.problems()}


def gpu_settings(n: Any, handle: Any, index: int, unsupported: dict[str, list[str]]) -> dict[str, Any]:
    """The settings the diagnostics compare before and after a run (robustd/diagnostics/gpustate.py), read
    as they read them: application clocks, power limits, persistence, compute, ECC and MIG modes."""
    from robustd.diagnostics.gpustate import read_settings

    values, errors, missing = read_settings(n, handle)
    for name in missing:
        unsupported.setdefault(name, []).append(str(index))
    return {**values, **dict.fromkeys(missing, "NOT_SUPPORTED"), **{f: f"error: {e}" for f, e in errors.items()}}


def step_nvml() -> Row:
    import pynvml as n

    from checks.gpu.events import TYPE_NAMES, WANTED
    from checks.gpu.outliers import decode_reasons

    n.nvmlInit()
    try:
        gpus = []
        unsupported: dict[str, list[str]] = {}
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            gpu: dict[str, Any] = {"index": i, "name": _value(n.nvmlDeviceGetName(h)),
                                   "uuid": _value(n.nvmlDeviceGetUUID(h)),
                                   "bus_id": _value(n.nvmlDeviceGetPciInfo(h).busId), "fields": {}}
            for label, call, args in POLL_FIELDS:
                try:
                    gpu["fields"][label] = _value(getattr(n, call)(h, *(getattr(n, a) if a.startswith("NVML") else
                                                                        int(a) for a in args)))
                except n.NVMLError as e:
                    gpu["fields"][label] = "NOT_SUPPORTED" if e.value == n.NVML_ERROR_NOT_SUPPORTED else f"error: {e}"
                    if e.value == n.NVML_ERROR_NOT_SUPPORTED:
                        unsupported.setdefault(label, []).append(str(i))
            types = gpu["fields"].get("supported_event_types")
            gpu["event_types"] = ([name for bit, name in TYPE_NAMES.items() if types & bit]
                                  if isinstance(types, int) else types)
            gpu["events_watched"] = bool(isinstance(types, int) and types & WANTED)
            reasons = gpu["fields"].get("clocks_event_reasons")
            gpu["clock_event_reasons"] = decode_reasons(reasons) if isinstance(reasons, int) else reasons
            gpu["field_batch"] = field_batch_agrees(n, h)
            gpu["fabric"] = fabric_info(n, h)
            if gpu["fabric"].get("state") in ("NOT_SUPPORTED", None):
                unsupported.setdefault("fabric", []).append(str(i))
            gpu["settings"] = gpu_settings(n, h, i, unsupported)
            gpus.append(gpu)
        batch_ok = all(g["field_batch"]["same"] for g in gpus)
        detail = (f"{len(gpus)} GPUs, driver {_value(n.nvmlSystemGetDriverVersion())}; NOT_SUPPORTED: "
                  + (", ".join(f"{k} (GPU {','.join(v)})" for k, v in unsupported.items()) or "none")
                  + f"; field batch {'agrees with' if batch_ok else 'DIFFERS from'} pynvml")
        return Row("nvml", "PASS" if gpus and batch_ok else "FAIL", detail,
                   {"gpus": gpus, "not_supported": unsupported})
    finally:
        n.nvmlShutdown()


@contextlib.contextmanager
def daemon(tmp: Path, torch_python: str | None) -> Iterator[tuple[Any, subprocess.Popen[bytes], Path]]:
    """robustd from this checkout on the real NVML; yields (grpc channel, process, log path)."""
    import grpc
    import yaml

    sock = tmp / "robustd.sock"
    kmsg_ok = os.access("/dev/kmsg", os.R_OK)
    cfg: dict[str, Any] = {
        "node_name": "gpu-validate", "state_dir": str(tmp / "state"), "listen": {"unix": str(sock)},
        "checks": {"gpu": {"enabled": True, "backend": "nvml"}, "kernel": {"enabled": kmsg_ok, "lookback": "0s"}},
    }
    if torch_python:
        cfg["diagnostics"] = {"python": torch_python}
    (tmp / "robustd.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp / "robustd.log"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "robustd.daemon", "--config", str(tmp / "robustd.yaml")],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    channel = grpc.insecure_channel(f"unix://{sock}")
    try:
        from robustd.api.v1 import robustd_pb2 as pb
        from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

        deadline = time.monotonic() + 30
        while True:
            try:
                pb_grpc.NodeHealthStub(channel).GetVerdict(pb.GetVerdictRequest(), timeout=2)
                break
            except grpc.RpcError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"robustd did not start:\n{log.read_text(errors='replace')[-3000:]}") from None
                time.sleep(0.1)
        yield channel, proc, log
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def step_daemon(channel: Any, log: Path, gpu: bool) -> Row:
    from robustd.api.v1 import robustd_pb2 as pb
    from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

    stub = pb_grpc.NodeHealthStub(channel)
    deadline = time.monotonic() + 15
    while True:  # the first poll inventories the GPUs and registers the event set
        [check] = [c for c in stub.ListChecks(pb.ListChecksRequest()).checks if c.name == "gpu"]
        if check.runs >= 1 or check.status == pb.CHECK_STATUS_UNSUPPORTED or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    v = stub.GetVerdict(pb.GetVerdictRequest())
    lines = [x for x in log.read_text(errors="replace").splitlines() if "GPU inventory" in x or "NVML events" in x]
    data = {"gpu_check": {"status": pb.CheckStatus.Name(check.status), "note": check.note,
                          "last_error": check.last_error, "runs": check.runs},
            "verdict": pb.Severity.Name(v.severity),
            "conditions": [f"{c.component} {c.code} {pb.Severity.Name(c.severity)}: {c.message}" for c in v.conditions],
            "log": lines[-4:], "emulated": list(v.emulated)}
    if not gpu:
        ok = check.status == pb.CHECK_STATUS_UNSUPPORTED and not v.emulated
        return Row("daemon", "SKIP" if ok else "FAIL", f"no NVIDIA driver: the GPU check says {check.last_error!r}; "
                   f"would check: {WOULD['daemon']}", data)
    ok = check.status in (pb.CHECK_STATUS_OK, pb.CHECK_STATUS_WATCHING) and not v.emulated
    detail = f"GPU check {data['gpu_check']['status']}, verdict {data['verdict']}, {len(v.conditions)} conditions"
    return Row("daemon", "PASS" if ok else "FAIL", detail + (f"; {check.note}" if check.note else ""), data)


def step_diag(channel: Any, runs: int = 2) -> Row:
    from robustd.api.v1 import robustd_pb2 as pb
    from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

    stub = pb_grpc.DiagnosticsStub(channel)
    reports = []
    for _ in range(runs):
        report = None
        for msg in stub.Run(pb.RunRequest(tests=["all_to_all", "minigpt"], stop_on_failure=False), timeout=110):
            if msg.phase == pb.DiagnosticProgress.PHASE_DONE:
                report = msg.report
        if report is None:
            return Row("diag", "FAIL", "a run ended without a report")
        reports.append(report)
    digests = [sorted({r.details.get("digest", "") for r in rep.results if r.test == "minigpt"}) for rep in reports]
    outcomes = [pb.Outcome.Name(r.outcome) for r in reports]
    busbw = [f"{r.component}={r.figures.get('busbw_gbps', 0):.1f}"
             for r in reports[0].results if r.test == "all_to_all"]
    same = len({tuple(d) for d in digests}) == 1 and all(digests)
    ok = all(o == "OUTCOME_PASS" for o in outcomes) and same
    data = {"outcomes": outcomes, "minigpt_digests": digests, "all_to_all_busbw_gbps": busbw,
            "messages": [r.message for r in reports]}
    return Row("diag", "PASS" if ok else "FAIL", f"{'/'.join(outcomes)}; MiniGPT digests "
               f"{'equal' if same else 'DIFFER'} across {runs} runs; busbw {', '.join(busbw) or '-'}", data)


def step_dcgmi() -> Row:
    dcgmi = shutil.which("dcgmi")
    if dcgmi is None:
        return Row("dcgmi", "SKIP", "dcgmi not installed; would run " + WOULD["dcgmi"])
    out: dict[str, Any] = {}
    for name, args, limit in (("discovery", ["discovery", "-l"], 20), ("diag_r1", ["diag", "-r", "1", "-j"], 90)):
        try:
            p = subprocess.run([dcgmi, *args], capture_output=True, text=True, timeout=limit)
            out[name] = {"rc": p.returncode, "stdout": p.stdout[-4000:], "stderr": p.stderr[-1000:]}
        except subprocess.TimeoutExpired:
            out[name] = {"rc": None, "error": f"timed out after {limit}s"}
    ok = all(v.get("rc") == 0 for v in out.values())
    return Row("dcgmi", "PASS" if ok else "FAIL", ", ".join(f"{k} rc={v.get('rc')}" for k, v in out.items()), out)


def step_tracer(channel: Any, torch_python: str) -> Row:
    from robustd.api.v1 import robustd_pb2 as pb
    from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

    child = subprocess.Popen([torch_python, "-c", "import time, torch\nx = torch.ones(1, device='cuda')\n"
                              "torch.cuda.synchronize()\nprint('ready', flush=True)\ntime.sleep(120)\n"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            why = child.stderr.read()[-500:] if child.stderr else ""
            return Row("tracer", "FAIL", f"the CUDA child did not start: {why}")
        time.sleep(1.5)  # the GPU check's next poll sees the compute process
        resp = pb_grpc.TracerStub(channel).CaptureStacks(
            pb.CaptureRequest(selector=pb.ProcessSelector(pids=[child.pid])), timeout=30)
        procs = list(resp.processes)
        frames = sum(len(t.frames) for p in procs for t in p.threads)
        ok = bool(procs) and frames > 0 and not procs[0].error
        first = procs[0] if procs else None
        detail = (f"pid {child.pid}: {len(procs)} process, {frames} frames, selected by "
                  f"{first.selected_by if first else '-'}{'; ' + first.error if first and first.error else ''}")
        return Row("tracer", "PASS" if ok else "FAIL", detail)
    finally:
        child.kill()
        child.wait(5)


def timed(fn: Callable[[], Row], step: str) -> Row:
    t0 = time.monotonic()
    try:
        row = fn()
    except Exception as e:  # noqa: BLE001 - one step's failure is a row, the others still run
        row = Row(step, "FAIL", f"{type(e).__name__}: {e}"[:500])
    row.seconds = round(time.monotonic() - t0, 1)
    return row


def find_torch_python(given: str | None) -> str | None:
    """An interpreter that imports torch with CUDA: --torch-python, $TORCH_PYTHON, then python3 on PATH."""
    for cand in (given, os.environ.get("TORCH_PYTHON"), shutil.which("python3")):
        if not cand:
            continue
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            p = subprocess.run([cand, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                               capture_output=True, text=True, timeout=60)
            if p.returncode == 0 and p.stdout.split()[-1] == "True":
                return cand
    return None


def table(rows: list[Row]) -> str:
    width = max(len(r.step) for r in rows)
    lines = [f"{'STEP'.ljust(width)}  STATUS  SECS   DETAIL"]
    lines += [f"{r.step.ljust(width)}  {r.status.ljust(6)}  {r.seconds:5.1f}  {r.detail}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-validate.json", help="the summary as JSON (default gpu-validate.json)")
    ap.add_argument("--torch-python", help="an interpreter with CUDA torch for the diagnostics and tracer children")
    ap.add_argument("--skip", default="", help=f"comma-separated steps to leave out ({','.join(STEPS)})")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    started = time.monotonic()
    gpu = has_driver()
    torch_python = find_torch_python(args.torch_python) if gpu and skip.isdisjoint({"diag", "tracer"}) else None
    rows: list[Row] = []

    def skipped(step: str, why: str) -> Row:
        return Row(step, "SKIP", f"{why}; would check: {WOULD[step]}")

    rows.append(timed(step_nvml, "nvml") if gpu and "nvml" not in skip else
                skipped("nvml", "skipped" if "nvml" in skip else "no NVIDIA driver (nvmlInit failed)"))
    tmp = Path(tempfile.mkdtemp(prefix="rd-gpuval-", dir="/tmp"))
    try:
        if "daemon" in skip:
            rows += [skipped(s, "skipped") for s in ("daemon", "diag", "tracer")]
        else:
            with daemon(tmp, torch_python) as (channel, _proc, log):
                rows.append(timed(lambda: step_daemon(channel, log, gpu), "daemon"))
                for step, fn in (("diag", lambda: step_diag(channel)),
                                 ("tracer", lambda: step_tracer(channel, torch_python or ""))):
                    if step in skip:
                        rows.append(skipped(step, "skipped"))
                    elif not gpu:
                        rows.append(skipped(step, "no NVIDIA driver"))
                    elif torch_python is None:
                        rows.append(skipped(step, "no interpreter with CUDA torch (--torch-python)"))
                    else:
                        rows.append(timed(fn, step))
    except Exception as e:  # noqa: BLE001 - a daemon that cannot start is a FAIL row
        rows.append(Row("daemon", "FAIL", f"{type(e).__name__}: {e}"[:800]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows.append(timed(step_dcgmi, "dcgmi") if "dcgmi" not in skip else skipped("dcgmi", "skipped"))
    summary = {"host": os.uname().nodename, "python": sys.version.split()[0], "gpu": gpu,
               "torch_python": torch_python, "seconds": round(time.monotonic() - started, 1),
               "ok": all(r.status != "FAIL" for r in rows), "steps": [asdict(r) for r in rows]}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(table(rows))
    print(f"{'OK' if summary['ok'] else 'FAILED'} in {summary['seconds']}s; JSON: {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
