"""SIGTERM → process exit, under the load that used to hold shutdown (target p99 ≤ 2 s).

Two scenarios, one after the other in the same run, each `--runs` times (default 20):
- `idle`: the kernel check alone;
- `loaded`: an emulated 4-GPU node with one GPU's NVML call hung, an EUD stop-time test that never
  returns (fake dcgmi), 3 Watch streams, a `robustctl watch` process and 20 idle connections to the
  Unix-socket relay.
Each run starts a fresh daemon, loads it, sends SIGTERM and times until waitpid returns; it also
checks the exit status (0) and that the socket is gone.

A third, `frozen` (root: a loop-mounted ext4 state disk): the disk is frozen with fsfreeze, a fault
line is written to /dev/kmsg (its write sleeps in the kernel) and a ListEvents is made (its read
sleeps too), then SIGTERM. Nobody can end a thread asleep in a frozen file system, so it is timed in
two parts: SIGTERM → socket gone (target ≤ 2 s), and thaw → process gone (target ≤ 1 s), exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
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
from _harness import REPO, BenchDaemon, kmsg_write, percentile  # noqa: E402

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


def frozen_run() -> tuple[float, float]:
    """One frozen-disk run: (SIGTERM -> socket gone, thaw -> exit) in seconds."""
    tmp = Path(tempfile.mkdtemp(prefix="rdb-frozen-", dir="/tmp"))
    image, mnt = tmp / "disk.img", tmp / "disk"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "32M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    frozen = False
    try:
        d = BenchDaemon({"state_dir": str(mnt / "state"), "checks": {"kernel": {"lookback": "0s"}}})
        subprocess.run(["fsfreeze", "-f", str(mnt)], check=True)
        frozen = True
        kmsg_write(f"NVRM: Xid (PCI:{os.getpid() % 0xffff:04x}:7f:00): 79, pid=1, name=bench, frozen disk")
        with grpc.insecure_channel(d.target) as ch, contextlib.suppress(grpc.RpcError):
            # UNAVAILABLE: the reader thread is asleep in the kernel now
            pb_grpc.NodeHealthStub(ch).ListEvents(pb.ListEventsRequest(), timeout=1.5)
        time.sleep(0.3)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        while os.path.exists(d.socket) and time.monotonic() - t0 < 30:
            time.sleep(0.005)
        gone = time.monotonic() - t0
        subprocess.run(["fsfreeze", "-u", str(mnt)], check=True)
        frozen = False
        t1 = time.monotonic()
        code = d.proc.wait(60)
        exited = time.monotonic() - t1
        if code != 0:
            raise SystemExit(f"frozen: exit status {code}:\n{(d.dir / 'log').read_text()}")
        d.close()
        return gone, exited
    finally:
        if frozen:
            subprocess.run(["fsfreeze", "-u", str(mnt)], check=False)
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


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
    if os.geteuid() != 0:
        print("frozen: skipped (needs root for a loop device and fsfreeze)")
        return
    runs = [frozen_run() for _ in range(max(1, args.runs // 2))]
    print(f"frozen state disk, {len(runs)} runs (targets: socket gone <= 2 s after SIGTERM, exit <= 1 s after thaw)")
    print(f"{'step':<22} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for label, values in (("SIGTERM -> socket gone", [g * 1000 for g, _ in runs]),
                          ("thaw -> exit 0", [e * 1000 for _, e in runs])):
        print(f"{label:<22} {percentile(values, 50):8.0f} {percentile(values, 99):8.0f} {max(values):8.0f}")


if __name__ == "__main__":
    main()
