"""Every outside path robustd reads, in one place, so tests can point each at a fixture.

Nothing else in the daemon or the checks spells a literal /proc, /sys or /dev path; a test
enforces that. `Roots` is built from the config's `roots:` section alone (robustd/config.py folds
the older keys that named some of these paths into it). Production uses the defaults; `make run`
and the tests override them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_PROC = "/proc"
DEFAULT_SYS = "/sys"
DEFAULT_DEV = "/dev"
DEFAULT_KMSG = "/dev/kmsg"
DEFAULT_BOOT_ID = "/proc/sys/kernel/random/boot_id"
DEFAULT_DCGMI = "dcgmi"  # DCGM's command-line tool, looked up on $PATH
DEFAULT_NVML_LIBRARY = "libnvidia-ml.so.1"  # the driver's NVML, found by the dynamic loader
PROC_LOCKS = "/proc/locks"  # the kernel's file locks (who holds a state directory); always the real host's
PROC_SELF_FD = "/proc/self/fd"  # this process's descriptors by number (robustd/tls.py hands ssl in-memory files)
DEFAULT_CONFIG = "/etc/robustd/robustd.yaml"
DEFAULT_SOCKET = "/run/robustd/robustd.sock"
DEFAULT_STATE_DIR = "/var/lib/robustd"


@dataclass(frozen=True)
class Roots:
    proc: str = DEFAULT_PROC
    sys: str = DEFAULT_SYS
    dev: str = DEFAULT_DEV
    kmsg: str = DEFAULT_KMSG
    boot_id: str = DEFAULT_BOOT_ID
    dcgmi: str = DEFAULT_DCGMI
    nvml_library: str = DEFAULT_NVML_LIBRARY

    def proc_path(self, *parts: str) -> str:
        return os.path.join(self.proc, *parts)

    def sys_path(self, *parts: str) -> str:
        return os.path.join(self.sys, *parts)


def read_boot_id(path: str) -> str:
    """The kernel's boot id (a new one every boot); the reboot marker for sticky conditions."""
    with open(path, encoding="ascii") as f:
        value = f.read().strip()
    if not value:
        raise ValueError(f"{path} is empty; expected a boot id")
    return value
