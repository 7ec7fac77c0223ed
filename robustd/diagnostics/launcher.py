"""The child launcher: one stop-time test child, started in its own process group, read line by line, killed whole.

The protocol is in stoptests/PROTOCOL.md; the module a test runs is its entry in table.py.
The daemon never imports torch; everything heavy happens in these children, and a child that hangs
is killed with its whole tree.

A child that cannot start or run (no interpreter, no torch, a bad spec, a crash) is an ERROR result
whose message says why; only the child's own FAIL lines, which carry evidence, make a FAIL. What the
child prints is bounded here (line length, result count, field sizes): it is outside input too.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from robustd.diagnostics.model import Status, TestResult
from robustd.diagnostics.table import TESTS
from stoptests.protocol import EXIT_CANNOT_RUN  # stdlib only; cannot_run's last stderr line says why

KILL_GRACE = 10.0  # seconds past the test's own timeout before the daemon kills the tree
STDERR_KEEP = 4000
# Bounds on what a child's stdout may make the daemon hold.
MAX_LINE = 1 << 16
MAX_RESULTS = 1024
MAX_COMPONENT = 256
MAX_MESSAGE = 2000
MAX_ENTRIES = 64  # figures and details per result
MAX_KEY = 64
MAX_VALUE = 4000
REASON_KEEP = 500
# The directory holding the `stoptests` package: the children are `python -m stoptests.<test>`,
# found whatever the daemon's working directory and whichever interpreter diagnostics.python names.
def _stoptests_root() -> str:
    spec = importlib.util.find_spec("stoptests")  # located, not imported
    assert spec is not None and spec.origin is not None, "the stoptests package is not installed"
    return os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))


STOPTESTS_ROOT = _stoptests_root()


@dataclass
class Child:
    """A running test child; `kill()` ends it and every process it started."""

    test: str
    proc: asyncio.subprocess.Process | None = None
    killed: str = ""  # why the daemon killed it, if it did
    stderr: bytearray = field(default_factory=bytearray)
    dropped: int = 0  # stdout lines or results past the bounds

    def kill(self, why: str) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.killed = self.killed or why
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # start_new_session: pgid == pid


async def run_child(child: Child, python: str, spec: dict[str, Any], spec_path: str,
                    on_progress: Callable[[float, str], None]) -> list[TestResult]:
    """Run one test to its results; a crash, a kill, a timeout or a failed start becomes an ERROR result."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = STOPTESTS_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        child.proc = await asyncio.create_subprocess_exec(
            python, "-m", TESTS[child.test].module, "--spec", spec_path,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env=env, limit=MAX_LINE)
    except OSError as e:  # no such interpreter, not executable, the state dir unwritable
        return [_error(child.test, f"{child.test} could not start: {e.strerror or e}"
                                   + (f": {e.filename}" if e.filename else ""))]
    results: list[TestResult] = []
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
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(err_task, 5)
        child.kill("")  # whatever it left behind in its process group
    tail = child.stderr[-STDERR_KEEP:].decode("utf-8", "replace").strip()
    details = {"stderr": tail} if tail else {}
    if child.killed or code != 0:
        reason = _last_line(tail)
        if child.killed:
            message = f"{child.test} {child.killed}"
        elif code == EXIT_CANNOT_RUN and reason:
            message = f"{child.test} could not run: {reason}"
        else:
            message = f"{child.test} exited with status {code}" + (f": {reason}" if reason else "")
        results.append(_error(child.test, message, details))
    elif not results:
        results.append(_error(child.test, f"{child.test} finished without a result", details))
    if child.dropped:
        results.append(_error(child.test, f"{child.test} printed {child.dropped} lines or results past the "
                                          f"daemon's limits ({MAX_RESULTS} results, {MAX_LINE} bytes a line); "
                                          "they were dropped"))
    return results


def _error(test: str, message: str, details: dict[str, str] | None = None) -> TestResult:
    return TestResult(test=test, component="host", status=Status.ERROR, message=message[:MAX_MESSAGE],
                      details=details or {})


def _last_line(text: str) -> str:
    """The last non-empty line of a child's stderr: where cannot_run() and tracebacks put the reason."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:REASON_KEEP] if lines else ""


async def _read(child: Child, results: list[TestResult], on_progress: Callable[[float, str], None]) -> None:
    assert child.proc is not None and child.proc.stdout is not None
    stream = child.proc.stdout
    skipping = False  # inside a line longer than MAX_LINE
    while True:
        try:
            raw = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            raw = e.partial  # the last line, without its newline (or nothing at EOF)
            if raw and not skipping:
                _handle(child, raw, results, on_progress)
            return
        except asyncio.LimitOverrunError as e:
            await stream.read(max(1, e.consumed))
            if not skipping:
                child.dropped += 1
            skipping = True
            continue
        if skipping:
            skipping = False  # the rest of the overlong line
            continue
        _handle(child, raw, results, on_progress)


def _handle(child: Child, raw: bytes, results: list[TestResult], on_progress: Callable[[float, str], None]) -> None:
    try:
        msg = json.loads(raw)
    except ValueError:
        return  # anything else on stdout is ignored
    if not isinstance(msg, dict):
        return
    if msg.get("type") == "progress":
        on_progress(_number(msg.get("percent")), str(msg.get("message", ""))[:MAX_MESSAGE])
    elif msg.get("type") == "result":
        if len(results) >= MAX_RESULTS:
            child.dropped += 1
            return
        results.append(parse_result(child.test, msg))


def _finite(value: Any) -> bool:
    """A JSON number that is finite (not a bool, not NaN or an infinity)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _number(value: Any) -> float:
    return float(value) if _finite(value) else 0.0


def parse_result(test: str, msg: dict[str, Any]) -> TestResult:
    """One result line of a child (PROTOCOL.md), bounded; an unknown status is an ERROR."""
    figures_in = msg.get("figures") if isinstance(msg.get("figures"), dict) else {}
    details_in = msg.get("details") if isinstance(msg.get("details"), dict) else {}
    figures = {str(k)[:MAX_KEY]: float(v) for k, v in list(figures_in.items())[:MAX_ENTRIES] if _finite(v)}
    details = {str(k)[:MAX_KEY]: str(v)[:MAX_VALUE] for k, v in list(details_in.items())[:MAX_ENTRIES]}
    status = str(msg.get("status", "")).upper()
    return TestResult(test=test, component=str(msg.get("component") or "host")[:MAX_COMPONENT],
                      status=Status[status] if status in Status.__members__ else Status.ERROR,
                      message=str(msg.get("message", ""))[:MAX_MESSAGE], figures=figures, details=details)


async def _drain(child: Child) -> None:
    assert child.proc is not None and child.proc.stderr is not None
    while chunk := await child.proc.stderr.read(65536):
        child.stderr += chunk
        del child.stderr[:-STDERR_KEEP * 4]
