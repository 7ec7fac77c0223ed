"""Start a real robustd for a benchmark: temp state, its own socket, the real /dev/kmsg."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent


class BenchDaemon:
    def __init__(self, config: dict[str, Any] | None = None, wait: bool = True, wrap: list[str] | None = None):
        """`wrap`: a command prefix for the daemon, e.g. `ip netns exec NS` to run it in a network namespace."""
        self.dir = Path(tempfile.mkdtemp(prefix="rdb-", dir="/tmp"))
        self.socket = str(self.dir / "robustd.sock")
        cfg: dict[str, Any] = {"node_name": "bench", "state_dir": str(self.dir / "state"),
                               "listen": {"unix": self.socket}, "log_level": "warning",
                               "checks": {"kernel": {"lookback": "0s"}}}
        config = dict(config or {})
        cfg["listen"].update(config.pop("listen", {}))  # a bench's listen keys beside the socket
        cfg.update(config)
        (self.dir / "robustd.yaml").write_text(yaml.safe_dump(cfg))
        self.proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", "robustd.daemon", "--config",
                                      str(self.dir / "robustd.yaml")], cwd=REPO,
                                     stderr=open(self.dir / "log", "wb"))  # noqa: SIM115
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with grpc.insecure_channel(f"unix://{self.socket}") as ch:
                    pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"robustd did not start:\n{(self.dir / 'log').read_text()}") from None
                time.sleep(0.05)

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        shutil.rmtree(self.dir, ignore_errors=True)


def kmsg_write(line: str) -> None:
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())  # a record is readable once its newline is in
    finally:
        os.close(fd)


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]
