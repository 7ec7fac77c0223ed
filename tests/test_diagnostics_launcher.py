"""The daemon's end of a stop-time child (robustd/diagnostics/launcher.py): what a child prints is outside input.

Each test runs a real child process in place of a stop-time test (diagnostics.python pointing at a
small script), as a broken or hostile interpreter would be, and checks the results the report gets.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

from robustd.diagnostics.launcher import MAX_LINE, MAX_MESSAGE, MAX_RESULTS, Child, run_child
from robustd.diagnostics.model import Status, TestResult


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable that ignores `-m stoptests.<test> --spec PATH` and runs `body` instead."""
    script = tmp_path / "body.py"
    script.write_text(textwrap.dedent(body))
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def run(tmp_path: Path, body: str, timeout: float = 20.0) -> tuple[list[TestResult], list[tuple[float, str]]]:
    progress: list[tuple[float, str]] = []
    spec = {"test": "all_to_all", "timeout": timeout}
    results = asyncio.run(run_child(Child(test="all_to_all"), fake_python(tmp_path, body), spec,
                                    str(tmp_path / "spec.json"), lambda p, m: progress.append((p, m))))
    return results, progress


def test_overlong_lines_and_too_many_results_are_dropped_and_said(tmp_path: Path) -> None:
    results, progress = run(tmp_path, f"""
        import json, sys
        w = sys.stdout.write
        w("x" * {4 * MAX_LINE} + "\\n")  # no JSON, longer than a line may be
        w(json.dumps({{"type": "result", "component": "rank/0", "status": "PASS", "message": "y" * {4 * MAX_LINE}}})
          + "\\n")
        w(json.dumps({{"type": "progress", "percent": "NaN", "message": "m" * 10000}}) + "\\n")
        w(json.dumps({{"type": "progress", "percent": float("inf")}}) + "\\n")
        for i in range({MAX_RESULTS + 10}):
            w(json.dumps({{"type": "result", "component": "c" * 1000, "status": "PASS", "message": "z" * 5000,
                          "figures": {{"f%d" % j: j for j in range(200)}}, "details": {{"d": "v" * 5000}}}}) + "\\n")
        w(json.dumps({{"type": "result", "status": "FAIL", "component": "rank/1"}}))  # last line, no newline
    """)
    *kept, last = results
    assert len(kept) == MAX_RESULTS
    assert all(r.status == Status.PASS and len(r.component) <= 256 and len(r.message) == MAX_MESSAGE
               and len(r.figures) <= 64 and len(r.details["d"]) <= 4000 for r in kept)
    assert (last.component, last.status) == ("host", Status.ERROR) and "dropped" in last.message
    assert "13 lines or results" in last.message  # 2 overlong lines + 10 results + the 1 past the limit
    assert [p for p, _ in progress] == [0.0, 0.0] and len(progress[0][1]) == MAX_MESSAGE


def test_a_child_that_cannot_run_is_an_error_with_its_reason(tmp_path: Path) -> None:
    results, _ = run(tmp_path, """
        import sys
        sys.stderr.write("Traceback (most recent call last):\\n  ...\\n")
        sys.stderr.write("bad spec: rendezvous.master_port must be between 1 and 65535, not 70000\\n")
        sys.exit(2)
    """)
    assert [(r.component, r.status) for r in results] == [("host", Status.ERROR)]
    assert results[0].message == ("all_to_all could not run: bad spec: rendezvous.master_port must be between 1 "
                                  "and 65535, not 70000")
    assert "Traceback" in results[0].details["stderr"]


def test_a_crash_says_its_last_words_and_silence_is_no_pass(tmp_path: Path) -> None:
    results, _ = run(tmp_path, "raise SystemExit('Segmentation fault in libfoo')")
    assert [(r.status, r.message) for r in results] == [
        (Status.ERROR, "all_to_all exited with status 1: Segmentation fault in libfoo")]
    results, _ = run(tmp_path, "print('hello')")
    assert [(r.status, r.message) for r in results] == [(Status.ERROR, "all_to_all finished without a result")]


def test_a_hung_child_is_killed_at_its_timeout(tmp_path: Path) -> None:
    # KILL_GRACE (10 s) after the spec's timeout; the message says so and no FAIL is made of it.
    results, _ = run(tmp_path, "import time; time.sleep(600)", timeout=0.5)
    assert [(r.status, r.message) for r in results] == [(Status.ERROR, "all_to_all did not finish within 10.5s")]


def test_an_interpreter_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    results = asyncio.run(run_child(Child(test="minigpt"), str(tmp_path / "no-python"), {"timeout": 5},
                                    str(tmp_path / "spec.json"), lambda p, m: None))
    assert [(r.status, r.component) for r in results] == [(Status.ERROR, "host")]
    assert results[0].message.startswith("minigpt could not start: No such file or directory")
