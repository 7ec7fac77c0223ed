"""SIGTERM → process exit, under the load that used to hold shutdown (target p99 ≤ 2 s).

Two scenarios, one after the other in the same run, each `--runs` times (default 20):
- `idle`: the kernel check alone;
- `loaded`: an emulated 4-GPU node with one GPU's NVML call hung, an EUD stop-time test that never
  returns (fake dcgmi), 3 Watch streams, a `robustctl watch` process and 20 idle connections to the
  Unix-socket relay.
Each run starts a fresh daemon, loads it, sends SIGTERM and times until waitpid returns; it also
checks the exit status (0) and that the socket is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
from _harness import REPO, BenchDaemon, percentile  # noqa: E402

from robustd.api.v1 import robustd_pb2 as pb  # noqa: E402
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc  # noqa: E402
from robustd.nvmlemu import build  # noqa: E402
from robustd.nvmlemu import state as emu  # noqa: E402

FAKE_DCGMI = str(REPO / "tests" / "fakes" / "dcgmi")


def drain(it: Any) -> None:
    try:
        for _ in it:
            pass
    except grpc.RpcError:
        pass


def load(d: BenchDaemon, nvml_state: str) -> list[Any]:
    held: list[Any] = []
    for _ in range(3):
        ch = grpc.insecure_channel(d.target)
        call = pb_grpc.NodeHealthStub(ch).Watch(pb.WatchRequest())
        call.initial_metadata()
        threading.Thread(target=drain, args=(call,), daemon=True).start()
        held.append(ch)
    held.append(subprocess.Popen([sys.executable, "-m", "robustd.cli.robustctl", "--socket", d.socket, "watch"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO))
    for _ in range(20):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket)
        held.append(s)
    ch = grpc.insecure_channel(d.target)
    threading.Thread(target=drain, args=(pb_grpc.DiagnosticsStub(ch).Run(pb.RunRequest(tests=["eud"])),),
                     daemon=True).start()
    held.append(ch)
    st = emu.load(nvml_state)
    emu.apply_fault(st, 2, "hang")
    emu.save(nvml_state, st)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the hang is seen and the diagnostic is running
        with grpc.insecure_channel(d.target) as c:
            v = pb_grpc.NodeHealthStub(c).GetVerdict(pb.GetVerdictRequest(), timeout=5)
            runs = pb_grpc.DiagnosticsStub(c).List(pb.ListDiagnosticsRequest(), timeout=5).reports
        if any(x.code == "NVML_HANG" for x in v.conditions) and runs and runs[0].outcome == pb.OUTCOME_RUNNING:
            break
        time.sleep(0.1)
    time.sleep(0.3)
    return held


def release(held: list[Any]) -> None:
    for h in held:
        if isinstance(h, subprocess.Popen):
            h.terminate()
            h.wait(10)
        else:
            h.close()


def one_run(config: dict[str, Any], loaded: bool, nvml_state: str) -> float:
    d = BenchDaemon(config)
    held = load(d, nvml_state) if loaded else []
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(60)
    took = time.monotonic() - t0
    release(held)
    if code != 0 or os.path.exists(d.socket):
        raise SystemExit(f"exit status {code}, socket left: {os.path.exists(d.socket)}:\n"
                         f"{(d.dir / 'log').read_text()}")
    d.close()
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    os.environ["FAKE_DCGMI_MODE"] = "hang"
    tmp = Path(tempfile.mkdtemp(prefix="rdb-shutdown-"))
    lib = build.build_emulator(str(tmp))
    scenarios = {"idle": False, "loaded": True}
    print(f"SIGTERM -> exit, {args.runs} runs each (target p99 <= 2 s)")
    print(f"{'scenario':<8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, loaded in scenarios.items():
        times = []
        for i in range(args.runs):
            nvml = str(tmp / f"nvml-{name}-{i}.state")
            emu.save(nvml, emu.healthy_node(4))
            config: dict[str, Any] = {"checks": {"kernel": {"lookback": "0s"}}}
            if loaded:
                config = {"checks": {"kernel": {"enabled": False},
                                     "gpu": {"backend": "emulator", "emulator_state": nvml, "emulator_library": lib,
                                             "interval": "200ms"}},
                          "diagnostics": {"eud": {"command": [FAKE_DCGMI, "diag", "-r", "eud", "-j"],
                                                  "timeout": "10m"}}}
            times.append(one_run(config, loaded, nvml) * 1000)
        print(f"{name:<8} {percentile(times, 50):8.0f} {percentile(times, 99):8.0f} {max(times):8.0f}")


if __name__ == "__main__":
    main()
