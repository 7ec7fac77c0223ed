"""What systemd's notify socket receives from robustd-slurm: READY=1 "connecting", then "connected to robustd"
once the Watch is open (the unit's status line used to stay "connecting to robustd" after it connected)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def test_the_status_line_says_connected_once_the_watch_is_open(make_daemon: Any, short_tmp: Path) -> None:
    d = make_daemon({"slurm": {"node_name": "gpu-notify"}})
    d.start()
    path = str(short_tmp / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    env = {**os.environ, "NOTIFY_SOCKET": path, "PYTHONPATH": str(REPO), "SLURM_CONF": "/nonexistent/slurm.conf"}
    proc = subprocess.Popen([sys.executable, "-m", "robustd.adapters.slurm.agent", "--config", str(d.config_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            cwd=REPO, env=env)
    got: list[str] = []
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any("connected to robustd" in m for m in got):
            with contextlib.suppress(TimeoutError):
                got.append(sock.recv(4096).decode())
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        sock.close()
    assert got and got[0].startswith("READY=1\n") and "connecting to robustd" in got[0], got
    assert any(m.startswith("STATUS=node gpu-notify: connected to robustd (seq ") for m in got), got
