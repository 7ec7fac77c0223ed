"""Stop-time test 1: NVIDIA EUD through `dcgmi diag -r eud -j` (child process, see PROTOCOL.md).

    python -m stoptests.eud --spec SPEC.json

Runs `spec["eud"]["command"]` with the spec's timeout, reads stdout whatever the exit status (205 and 226
still carry JSON) and has stoptests/dcgmi.py turn the DCGM 3.x or 4.x document into one result per
GPU (`gpu/<bus_id>`), plus `host` for anything not tied to one GPU. Standard library only (psutil is used
when present).
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import time
from typing import Any

from stoptests.dcgmi import EUD_TESTS, DcgmiOutputError, canonical_test, parse_dcgmi_json
from stoptests.protocol import (
    ERROR,
    FAIL,
    MAX_TIMEOUT,
    Result,
    SpecError,
    bounded_float,
    bounded_list,
    cannot_run,
    emit_progress,
    emit_result,
    load_spec,
)

DEFAULT_COMMAND = ["dcgmi", "diag", "-r", "eud", "-j"]
DEFAULT_TIMEOUT = 3600.0
MAX_ARGS = 256
MAX_ARG_LEN = 4096
TAIL = 2000


# ---------------------------------------------------------------- child


def requests_eud(command: list[str]) -> bool:
    """True when the command's -r/--run list names eud or cpu_eud (not a numbered level)."""
    for i, arg in enumerate(command):
        value = None
        if arg in ("-r", "--run") and i + 1 < len(command):
            value = command[i + 1]
        elif arg.startswith("--run="):
            value = arg.split("=", 1)[1]
        elif arg.startswith("-r") and len(arg) > 2 and not arg.startswith("--"):
            value = arg[2:].lstrip("=")
        if value and any(canonical_test(v) in EUD_TESTS for v in value.split(",")):
            return True
    return False


def _tail(data: bytes | str | None) -> str:
    if not data:
        return ""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text[-TAIL:].strip()


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Kill the command and whatever it started (it shares our process group, so a daemon Cancel reaches it)."""
    victims = []
    try:
        import psutil

        victims = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process gone: kill what we can
        victims = []
    for p in [proc, *victims]:
        with contextlib.suppress(Exception):
            p.kill()


def run_command(command: list[str], timeout: float) -> tuple[int | None, bytes, bytes, float]:
    """Run `command`; (exit code or None when killed at the timeout, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out: list[bytes] = []
    err: list[bytes] = []
    while True:
        elapsed = time.monotonic() - start
        remaining = timeout - elapsed
        if remaining <= 0:
            _kill_tree(proc)
            try:
                o, e = proc.communicate(timeout=5)
                out.append(o or b"")
                err.append(e or b"")
            except subprocess.TimeoutExpired:
                pass  # a grandchild keeps the pipes open; give up on the rest of the output
            proc.wait()
            return None, b"".join(out), b"".join(err), time.monotonic() - start
        try:
            o, e = proc.communicate(timeout=min(remaining, 10.0))
            return proc.returncode, o or b"", e or b"", time.monotonic() - start
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - start
            emit_progress(min(95.0, 100.0 * elapsed / timeout), f"dcgmi diag running, {elapsed:.0f} s")


def eud_settings(spec: dict[str, Any]) -> tuple[list[str], float]:
    """The command and its timeout from the spec, bounded; raises SpecError."""
    eud_spec = spec.get("eud") or {}
    if not isinstance(eud_spec, dict):
        raise SpecError("eud must be an object")
    command = eud_spec.get("command") or DEFAULT_COMMAND
    if isinstance(command, str):
        if len(command) > MAX_ARGS * MAX_ARG_LEN:
            raise SpecError("eud.command is too long")
        command = shlex.split(command)
    command = [str(c) for c in bounded_list(command, "eud.command", MAX_ARGS)]
    if any(len(c) > MAX_ARG_LEN for c in command):
        raise SpecError(f"an argument of eud.command is longer than {MAX_ARG_LEN} characters")
    timeout = bounded_float(eud_spec.get("timeout") or spec.get("timeout") or None, "eud.timeout", DEFAULT_TIMEOUT,
                            1e-3, MAX_TIMEOUT)
    return command, timeout


def run_eud(spec: dict[str, Any]) -> list[Result]:
    command, timeout = eud_settings(spec)
    base = {"command": command}
    emit_progress(0.0, "running " + shlex.join(command))
    try:
        rc, out, err, seconds = run_command(command, timeout)
    except FileNotFoundError:
        # The configured command is not there: the harness cannot run the test (an ERROR, not a SKIP a
        # full diagnostic could pass with): install DCGM or point diagnostics.eud.command at dcgmi.
        return [Result("host", ERROR, f"dcgmi not found: {command[0]} does not exist or is not on PATH (install "
                                      "DCGM or set diagnostics.eud.command)",
                       details=dict(base, reason="dcgmi_not_found"))]
    except OSError as e:  # not executable, not a program, ...
        return [Result("host", ERROR, f"cannot run {command[0]}: {e.strerror or e}", details=base)]
    figures = {"duration_s": round(seconds, 3)}
    if rc is None:
        return [Result("host", ERROR, f"dcgmi diag hung: no result after {timeout:g} s, killed", figures,
                       dict(base, timeout_s=timeout, hung=True, stderr_tail=_tail(err), stdout_tail=_tail(out)))]
    emit_progress(98.0, f"dcgmi diag exited {rc} after {seconds:.0f} s")
    text = out.decode("utf-8", "replace")
    try:
        results = parse_dcgmi_json(text, spec.get("gpus") or [], require_eud=requests_eud(command))
    except DcgmiOutputError as e:
        what = f"dcgmi diag exited {rc} without JSON" if rc else f"dcgmi diag printed no usable JSON ({e})"
        stderr = _tail(err)
        return [Result("host", ERROR, what + (f": {stderr.splitlines()[-1]}" if stderr else ""), figures,
                       dict(base, exit_code=rc, stderr_tail=stderr, stdout_tail=_tail(out)))]
    for r in results:
        r.figures.update(figures)
        r.details["exit_code"] = rc
    if rc in (205, 226) and not any(r.status in (FAIL, ERROR) for r in results):
        results.append(Result("host", ERROR, f"dcgmi diag exited {rc} (errors found) but its JSON shows no failure",
                              figures, dict(base, exit_code=rc, stderr_tail=_tail(err))))
    return results


def main(argv: list[str] | None = None) -> int:
    try:
        spec = load_spec(argv)
        results = run_eud(spec)
    except SpecError as e:
        return cannot_run(f"bad spec: {e}")
    for r in results:
        emit_result(r)
    emit_progress(100.0, "dcgmi diag done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
