"""The GPU check's parsers: what NVML hands back as text (bus ids, names), pure functions."""

from __future__ import annotations

from typing import Any


def normalize_bus_id(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` as the kernel writes it: `0000:3b:00.0`."""
    domain, _, rest = bus_id.strip().rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("0", "", domain)
    return f"{int(domain or '0', 16):04x}:{bus.lower()}:{rest.lower()}"


def nvml_text(value: Any) -> str:
    """A string NVML returned (bytes from older pynvml), as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
