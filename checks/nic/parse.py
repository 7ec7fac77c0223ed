"""The NIC check's parsers: InfiniBand port sysfs text (state, rate, counters), pure functions."""

from __future__ import annotations

import re
from typing import NamedTuple

_STATE = re.compile(r"^\s*(\d+)\s*:\s*(\S.*?)\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:Gb/sec\b.*)?$")


class PortState(NamedTuple):
    code: int
    name: str


def parse_ib_state(text: str) -> PortState:
    """`state` ("4: ACTIVE") or `phys_state` ("5: LinkUp") → (4, "ACTIVE")."""
    m = _STATE.match(text)
    if not m:
        raise ValueError(f"not an IB port state: {text!r} (expected e.g. '4: ACTIVE')")
    return PortState(int(m.group(1)), m.group(2))


def parse_rate(text: str | float | int) -> float:
    """`rate` ("400 Gb/sec (4X NDR)"), a config value ("400 Gb/sec", "400") or a number → Gb/s."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"not an IB rate: {text!r} (expected e.g. '400 Gb/sec (4X NDR)')")
    return float(m.group(1))


def parse_counter(text: str) -> int:
    return int(text.strip())
