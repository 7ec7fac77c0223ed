"""Network traffic counters, raw: the NIC check publishes them, the GPU check's stall detection reads them.

TRAINING_STALLED needs "RDMA/NIC traffic about zero". The NIC check already reads every link's counters
each poll (one netlink dump; the IB ports from sysfs), so it publishes one immutable `TrafficSnapshot` per
poll — every link but `lo` and every InfiniBand port under its IB root, whatever `checks.nic.interfaces`
or `ib_ports` watch, since a stall is about all traffic — and the GPU check computes its rates between
two snapshots (deltas poll-to-poll of the NIC check). The counters are not read a second time.

When the NIC check does not run (disabled, unsupported, failing, or before its first poll), the GPU check
still needs the counters: `read_traffic` reads the same links from sysfs at the moment it is asked, which
is exactly what the GPU check did before the NIC check published anything, so a node without the NIC
check behaves as before. With the NIC check, a rate is as fine-grained as its interval (1 s by default)
and a stall is judged once per new snapshot; `TRAINING_STALLED` holds for its clear_after (30 s) between.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

IB_WORD = 4  # port_xmit_data / port_rcv_data count 4-byte words (IBA PortCounters)


@dataclass(frozen=True)
class TrafficSnapshot:
    at: float  # time.monotonic() when the counters were read
    links: Mapping[str, int] = field(default_factory=dict)  # nic/<ifname>: rx+tx bytes; ib/<dev>/<port>: bytes

    @property
    def total(self) -> int:
        """Bytes both ways over every link; counters restart with a driver, so only a delta means anything."""
        return sum(self.links.values())


@runtime_checkable
class TrafficProvider(Protocol):
    """A check that publishes traffic counters (checks/nic/)."""

    def traffic_snapshot(self) -> TrafficSnapshot | None:
        """The last published snapshot (None before the first poll)."""
        ...


def _int(path: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def ib_bytes(ib_root: str) -> dict[str, int]:
    """ib/<dev>/<port> → bytes sent plus received, for every port under `ib_root` (class/infiniband)."""
    out: dict[str, int] = {}
    for counters in sorted(glob.glob(os.path.join(ib_root, "*", "ports", "*", "counters"))):
        port_dir = os.path.dirname(counters)
        dev = os.path.basename(os.path.dirname(os.path.dirname(port_dir)))
        words = _int(os.path.join(counters, "port_xmit_data")) + _int(os.path.join(counters, "port_rcv_data"))
        out[f"ib/{dev}/{os.path.basename(port_dir)}"] = IB_WORD * words
    return out


def read_traffic(sys_root: str) -> TrafficSnapshot:
    """The counters from sysfs, now: every net link but `lo` (statistics/rx_bytes + tx_bytes) and every IB port."""
    links = ib_bytes(os.path.join(sys_root, "class", "infiniband"))
    for stats in sorted(glob.glob(os.path.join(sys_root, "class", "net", "*", "statistics"))):
        name = os.path.basename(os.path.dirname(stats))
        if name != "lo":
            links[f"nic/{name}"] = _int(os.path.join(stats, "rx_bytes")) + _int(os.path.join(stats, "tx_bytes"))
    return TrafficSnapshot(at=time.monotonic(), links=links)
