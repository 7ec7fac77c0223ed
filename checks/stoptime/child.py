"""Helpers every stop-time child uses: read the spec, write progress and result lines (PROTOCOL.md).

Standard library only: the EUD, collectives and MiniGPT children all import this, and the daemon may too.
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
    with open(args.spec, encoding="utf-8") as f:
        spec = json.load(f)
    if not isinstance(spec, dict):
        raise ValueError(f"{args.spec}: the spec must be a JSON object")
    return spec


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
