"""Helpers every stop-time child uses: read the spec, write progress and result lines (PROTOCOL.md).

Standard library only: the EUD, collectives and MiniGPT children all import this, and the daemon may too.

A spec is read with bounds (its size, and every number or list a child sizes something by), so a bad
value is a clear "bad spec" error (the daemon's ERROR result), never a child that grows until the OOM
killer stops it or a verdict that blames hardware for a harness problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

PASS = "PASS"
FAIL = "FAIL"
SKIPPED = "SKIPPED"
ERROR = "ERROR"
STATUSES = (PASS, FAIL, SKIPPED, ERROR)

MAX_SPEC_BYTES = 1 << 20  # the daemon writes a few KiB
EXIT_CANNOT_RUN = 2  # PROTOCOL.md: non-zero = the test itself could not run
# Bounds every child puts on a spec's `timeout` (seconds) and on the ranks (GPUs or CPU ranks) of one node.
MAX_TIMEOUT = 7 * 86400.0
MAX_LOCAL_RANKS = 1024


class SpecError(ValueError):
    """The spec is not one this child can run; the message names the key and the allowed range."""


@dataclass
class Result:
    """One verdict on one component (`gpu/<bus_id>`, `rank/<i>`, `node/<name>` or `host`)."""

    component: str
    status: str
    message: str
    figures: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "result", "component": self.component, "status": self.status, "message": self.message,
                "figures": dict(self.figures), "details": dict(self.details)}


def load_spec(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse `--spec PATH` from argv (default sys.argv[1:]) and return the spec as a dict.

    Other arguments are left alone, so a child may parse its own (e.g. a worker's rank) too.
    """
    parser = argparse.ArgumentParser(description="robustd stop-time test child", add_help=False)
    parser.add_argument("--spec", required=True, help="path of the SPEC.json written by the daemon")
    args, _ = parser.parse_known_args(argv)
    try:
        with open(args.spec, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"cannot read {args.spec}: {e.strerror or e}") from e
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{args.spec} is larger than {MAX_SPEC_BYTES} bytes")
    try:
        spec = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise SpecError(f"{args.spec} is not JSON: {e}") from e
    if not isinstance(spec, dict):
        raise SpecError(f"{args.spec}: the spec must be a JSON object")
    return spec


def bounded_int(value: Any, key: str, default: int, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi]; None (absent) is `default`. Raises SpecError naming `key`."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise SpecError(f"{key} must be an integer, not {str(value)[:40]!r}")
    if not lo <= int(value) <= hi:
        raise SpecError(f"{key} must be between {lo} and {hi}, not {int(value)}")
    return int(value)


def bounded_float(value: Any, key: str, default: float, lo: float, hi: float) -> float:
    """`value` as a float in [lo, hi]; None (absent) is `default`. Raises SpecError naming `key`."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN
        raise SpecError(f"{key} must be a number, not {str(value)[:40]!r}")
    if not lo <= float(value) <= hi:
        raise SpecError(f"{key} must be between {lo:g} and {hi:g}, not {float(value):g}")
    return float(value)


def bounded_str(value: Any, key: str, default: str, max_len: int) -> str:
    """`value` as a string of at most `max_len` characters; None (absent) is `default`."""
    if value is None:
        return default
    if not isinstance(value, str):
        raise SpecError(f"{key} must be a string")
    if len(value) > max_len:
        raise SpecError(f"{key} is longer than {max_len} characters")
    return value


def bounded_list(value: Any, key: str, max_items: int) -> list[Any]:
    """`value` as a list of at most `max_items` items; None (absent) is []."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{key} must be a list")
    if len(value) > max_items:
        raise SpecError(f"{key} has {len(value)} items, at most {max_items} are allowed")
    return value


def spec_gpus(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """spec.gpus: at most `MAX_LOCAL_RANKS` objects; absent is []. Raises SpecError."""
    gpus = bounded_list(spec.get("gpus"), "gpus", MAX_LOCAL_RANKS)
    if not all(isinstance(g, dict) for g in gpus):
        raise SpecError("gpus must be a list of objects")
    return gpus


def spec_faults(spec: dict[str, Any]) -> dict[str, Any]:
    """spec.faults (test-only fault injection): an object; absent is {}. Raises SpecError."""
    faults = spec.get("faults") or {}
    if not isinstance(faults, dict):
        raise SpecError("faults must be an object")
    return faults


def spec_timeout(spec: dict[str, Any], default: float) -> float:
    """spec.timeout in seconds, up to `MAX_TIMEOUT`; absent (or 0) is `default`. Raises SpecError."""
    return bounded_float(spec.get("timeout") or None, "timeout", default, 1e-3, MAX_TIMEOUT)


def cannot_run(why: str) -> int:
    """The test could not run at all: say why on stderr's last line (the daemon's ERROR message)."""
    sys.stderr.write(" ".join(why.split()) + "\n")
    sys.stderr.flush()
    return EXIT_CANNOT_RUN


def rank_component(spec: dict[str, Any], rank: int) -> str:
    """Rank `rank` as a component: `gpu/<bus_id>` of spec.gpus[rank] with GPUs, else `rank/<rank>`."""
    gpus = spec.get("gpus") or []
    if not gpus:
        return f"rank/{rank}"
    if 0 <= rank < len(gpus) and gpus[rank].get("bus_id"):
        return f"gpu/{gpus[rank]['bus_id']}"
    return f"rank/{rank}"


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def emit_progress(percent: float, message: str) -> None:
    """One progress line: {"type": "progress", "percent": ..., "message": ...}."""
    _emit({"type": "progress", "percent": float(percent), "message": message})


def emit_result(component: str | Result, status: str | None = None, message: str = "",
                figures: dict[str, Any] | None = None, details: dict[str, Any] | None = None) -> None:
    """One result line; pass either the fields or a `Result`."""
    if isinstance(component, Result):
        _emit(component.to_dict())
        return
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, not {status!r}")
    _emit(Result(component, status, message, dict(figures or {}), dict(details or {})).to_dict())
