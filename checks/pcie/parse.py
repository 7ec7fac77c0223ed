"""The PCIe check's parsers: sysfs attribute text (AER counters, link speed, hex ids), pure functions."""

from __future__ import annotations

import re
from typing import NamedTuple

_HEX = re.compile(r"^(?:0x)?([0-9a-fA-F]+)$")


class AerCounters(NamedTuple):
    """One `aer_dev_*` file: the TOTAL_ERR_* line and every named counter."""

    total: int
    counters: dict[str, int]


def parse_aer(text: str) -> AerCounters:
    """`RxErr 0\\nBadTLP 2\\n…\\nTOTAL_ERR_COR 2` → AerCounters(2, {...}).

    Kernels before the TOTAL_ERR_* line was added get the sum of the named counters.
    Raises ValueError on a line that is not `<name> <count>`.
    """
    counters: dict[str, int] = {}
    total: int | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"not an AER counter line: {line!r}")
        name, value = parts[0], int(parts[1])
        if name.startswith("TOTAL_ERR_"):
            total = value
        else:
            counters[name] = value
    return AerCounters(total if total is not None else sum(counters.values()), counters)


def parse_link_speed(text: str) -> float | None:
    """`32.0 GT/s PCIe` (or older `8 GT/s`) → 32.0; `Unknown` → None."""
    m = re.match(r"\s*([0-9.]+)\s*GT/s", text)
    return float(m.group(1)) if m else None


def parse_hex(text: str) -> str:
    """`0x030200\\n` → `030200` (lower case); raises ValueError on anything else."""
    m = _HEX.match(text.strip())
    if not m:
        raise ValueError(f"not a hex id: {text.strip()!r}")
    return m.group(1).lower()
