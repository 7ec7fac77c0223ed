"""One stop-time test child: started in its own process group, read line by line, killed whole.

The protocol is in checks/stoptime/PROTOCOL.md. The daemon never imports torch; everything
heavy happens in these children, and a child that hangs is killed with its whole tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from robustd.api.v1 import robustd_pb2 as pb

MODULES = {"eud": "eud", "all_to_all": "collectives", "all_gather": "collectives", "minigpt": "minigpt"}
STATUS = {"PASS": pb.RESULT_PASS, "FAIL": pb.RESULT_FAIL, "SKIPPED": pb.RESULT_SKIPPED, "ERROR": pb.RESULT_ERROR}
KILL_GRACE = 10.0  # seconds past the test's own timeout before the daemon kills the tree
STDERR_KEEP = 4000


@dataclass
class Child:
    """A running test child; `kill()` ends it and every process it started."""

    test: str
    proc: asyncio.subprocess.Process | None = None
    killed: str = ""  # why the daemon killed it, if it did
    stderr: bytearray = field(default_factory=bytearray)

    def kill(self, why: str) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.killed = self.killed or why
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # start_new_session: pgid == pid


async def run_child(child: Child, python: str, spec: dict[str, Any], spec_path: str,
                    on_progress: Callable[[float, str], None]) -> list[pb.TestResult]:
    """Run one test to its results; a crash, a kill or a timeout becomes an ERROR result."""
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    child.proc = await asyncio.create_subprocess_exec(
        python, "-m", f"checks.stoptime.{MODULES[child.test]}", "--spec", spec_path,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    results: list[pb.TestResult] = []
    err_task = asyncio.get_running_loop().create_task(_drain(child))
    limit = float(spec["timeout"]) + KILL_GRACE
    try:
        async with asyncio.timeout(limit):
            await _read(child, results, on_progress)
            await child.proc.wait()  # stdout closed; the exit status follows
    except TimeoutError:
        child.kill(f"did not finish within {limit:g}s")
    finally:
        if child.proc.returncode is None:
            child.kill("stopped")  # cancelled from outside
        code = await child.proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(err_task, 5)
        child.kill("")  # whatever it left behind in its process group
    if child.killed or code != 0:
        why = child.killed or f"exited with status {code}"
        tail = child.stderr[-STDERR_KEEP:].decode("utf-8", "replace").strip()
        results.append(pb.TestResult(test=child.test, component="host", status=pb.RESULT_ERROR,
                                     message=f"{child.test} {why}", details={"stderr": tail} if tail else {}))
    return results


async def _read(child: Child, results: list[pb.TestResult], on_progress: Callable[[float, str], None]) -> None:
    assert child.proc is not None and child.proc.stdout is not None
    async for raw in child.proc.stdout:
        try:
            msg = json.loads(raw)
        except ValueError:
            continue  # anything else on stdout is ignored
        if not isinstance(msg, dict):
            continue
        if msg.get("type") == "progress":
            on_progress(float(msg.get("percent", 0.0)), str(msg.get("message", "")))
        elif msg.get("type") == "result":
            results.append(_result(child.test, msg))


def _result(test: str, msg: dict[str, Any]) -> pb.TestResult:
    figures = {str(k): float(v) for k, v in (msg.get("figures") or {}).items() if isinstance(v, (int, float))}
    details = {str(k): str(v) for k, v in (msg.get("details") or {}).items()}
    return pb.TestResult(test=test, component=str(msg.get("component") or "host"),
                         status=STATUS.get(str(msg.get("status", "")).upper(), pb.RESULT_ERROR),
                         message=str(msg.get("message", "")), figures=figures, details=details)


async def _drain(child: Child) -> None:
    assert child.proc is not None and child.proc.stderr is not None
    while chunk := await child.proc.stderr.read(65536):
        child.stderr += chunk
        del child.stderr[:-STDERR_KEEP * 4]
