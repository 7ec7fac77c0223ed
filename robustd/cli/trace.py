"""`robustctl trace`: the stacks of this node's training processes, as py-spy prints them.

Exit 0 when every selected process was captured, 1 when some could not be (each says why); no
training process on the node is not an error (exit 0, one line saying so).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from robustd.api.v1 import robustd_pb2 as pb
from robustd.cli import render

# The RPC deadline when the daemon picks the per-process timeout (tracer.timeout, 10 s by default):
# room for a few waves of captures on a node with many processes.
DEFAULT_CAPTURE_ALLOWANCE = 60.0


def add_arguments(v: argparse.ArgumentParser, duration: Any) -> None:
    v.add_argument("--pid", type=int, action="append", default=[], metavar="PID",
                   help="only this training process (repeatable; must be one the daemon traces)")
    v.add_argument("--rank", type=int, action="append", default=[], metavar="RANK",
                   help="only the process with this RANK (repeatable)")
    v.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    v.add_argument("--capture-timeout", type=duration, default=None, metavar="DURATION",
                   help="per-process py-spy deadline (default: the daemon's tracer.timeout)")


def request(native: bool, capture_timeout: float | None, pids: Sequence[int] = (),
            ranks: Sequence[int] = ()) -> tuple[pb.CaptureRequest, float]:
    """The CaptureRequest and the extra RPC deadline its captures need."""
    req = pb.CaptureRequest(selector=pb.ProcessSelector(pids=pids, ranks=ranks), native=native)
    allowance = DEFAULT_CAPTURE_ALLOWANCE
    if capture_timeout:
        req.timeout.FromNanoseconds(int(capture_timeout * 1e9))
        allowance = 2 * capture_timeout
    return req, allowance


def exit_code(resp: pb.CaptureResponse) -> int:
    return 1 if any(p.error for p in resp.processes) else 0


def rank_label(p: pb.ProcessStacks) -> str:
    if not p.HasField("rank"):
        return "rank ?"
    parts = [f"rank {p.rank}"]
    if p.HasField("local_rank"):
        parts.append(f"local {p.local_rank}")
    if p.HasField("world_size"):
        parts.append(f"world {p.world_size}")
    return ", ".join(parts)


def text(resp: pb.CaptureResponse) -> str:
    """py-spy's own dump layout per process, under a header naming the process, its rank and why it was traced.

    Nothing is cut to the terminal's width: a stack is read whole or not at all. Command lines, thread
    names and frames come from the traced processes, so each line is made `printable`.
    """
    if not resp.processes:
        return render.printable(f"{resp.node}: no training processes (none holds a GPU compute context or matches "
                                "tracer.process_patterns)")
    failed = sum(1 for p in resp.processes if p.error)
    n = len(resp.processes)
    lines = [f"{resp.node}: {n} training process{'' if n == 1 else 'es'}"
             + (f", {failed} not captured" if failed else "")]
    for p in resp.processes:
        lines.append("")
        lines.append(f"Process {p.pid} ({rank_label(p)}; {p.selected_by}): {p.command}")
        if p.error:
            lines.append(f"    NOT CAPTURED: {p.error}")
            continue
        for t in p.threads:
            state = "active" if t.active else "idle"
            lines.append(f"Thread {t.os_thread_id} ({state}{', gil' if t.owns_gil else ''}): \"{t.name}\"")
            for f in t.frames:
                where = f"{_short(f.file)}:{f.line}" if f.line else _short(f.file)
                lines.append(f"    {f.function} ({where})")
    return render.lines(lines)


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1] if path else "?"


def aggregation_threads(p: pb.ProcessStacks) -> list[dict[str, Any]]:
    """One process's threads in the input shape of robustd.fleet.stacks.aggregate."""
    return [{"name": t.name, "frames": [{"function": f.function, "file": f.file, "line": f.line} for f in t.frames]}
            for t in p.threads]


def ranks_of(responses: Sequence[tuple[str, pb.CaptureResponse]]) -> tuple[dict[int, list[dict[str, Any]]],
                                                                                dict[int, str], list[str]]:
    """Stacks by global rank and rank → host, from many nodes' answers; notes on what could not be placed."""
    stacks: dict[int, list[dict[str, Any]]] = {}
    host_of: dict[int, str] = {}
    notes: list[str] = []
    for host, resp in responses:
        for p in resp.processes:
            if not p.HasField("rank"):
                notes.append(f"{host}: pid {p.pid} has no RANK in its environment; left out")
                continue
            if p.rank in host_of:
                notes.append(f"{host}: pid {p.pid} claims rank {p.rank}, already seen on {host_of[p.rank]}; left out")
                continue
            host_of[p.rank] = host
            if p.error:
                notes.append(f"{host}: rank {p.rank} (pid {p.pid}) not captured: {p.error}")
                continue  # a rank without stacks counts as an outlier in the aggregation
            stacks[p.rank] = aggregation_threads(p)
    return stacks, host_of, notes
