"""The thermal check's parsers: hwmon attribute text, pure functions of strings."""

from __future__ import annotations


def parse_millidegrees(text: str) -> float | None:
    """`45000\\n` → 45.0; None for text that is not an integer. (A threshold of 0 or below means
    "not set" on many boards; `judge` ignores those.)"""
    try:
        return int(text.strip()) / 1000.0
    except ValueError:
        return None


def sensor_id(label: str | None, index: str) -> str:
    """A sensor's component part: its label with blanks as `_` (`Package_id_0`), else `temp<N>`."""
    return "_".join(label.split()) if label and label.strip() else f"temp{index}"
