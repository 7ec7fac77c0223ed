"""Durations as operators write them: `500ms`, `1s`, `5m`, `2h`, `30d` (also `1m30s`)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, PlainSerializer

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> float:
    """Seconds in `text`; raises ValueError naming the accepted forms."""
    s = text.strip()
    if s.startswith("-"):
        raise ValueError(f"duration {text!r} is negative; it must be zero or more")
    pos, total = 0, 0.0
    for m in _PART.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise ValueError(f"invalid duration {text!r}: write a number and a unit, e.g. 500ms, 1s, 5m, 2h, 30d")
    return total


def format_duration(seconds: float) -> str:
    """The shortest exact spelling, for messages and `robustctl checks`."""
    if seconds == 0:
        return "0s"
    for unit in ("d", "h", "m", "s"):
        n = seconds / _UNITS[unit]
        if n >= 1 and abs(n - round(n)) < 1e-9:
            return f"{int(round(n))}{unit}"
    return f"{seconds * 1000:g}ms"


def _coerce(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 1s, got a boolean")
    if isinstance(value, (int, float)):
        raise ValueError(f"duration {value!r} has no unit: write e.g. {value}s or {value}ms")
    if isinstance(value, str):
        return parse_duration(value)
    raise ValueError(f"expected a duration such as 1s, got {type(value).__name__}")


Duration = Annotated[float, BeforeValidator(_coerce), PlainSerializer(format_duration, return_type=str)]
"""A pydantic field type: accepts the text forms above, holds seconds."""


def _positive(seconds: float) -> float:
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


PositiveDuration = Annotated[Duration, AfterValidator(_positive)]
"""A Duration that must be more than zero (an interval, a timeout)."""
