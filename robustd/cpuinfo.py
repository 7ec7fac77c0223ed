"""What /proc/cpuinfo says about this host's CPUs."""

from __future__ import annotations

from robustd.roots import Roots


def cpu_model(roots: Roots) -> str:
    """`model name` from cpuinfo: MiniGPT digests on CPU are only comparable on one CPU model."""
    try:
        with open(roots.proc_path("cpuinfo"), encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return ""
