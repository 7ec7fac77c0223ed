"""What robustctl prints when the text is hostile or the reader leaves early.

Control characters in a kernel line (a device or process name under an attacker's control) must
reach the operator's terminal escaped, never raw; JSON keeps the exact text. A reader that goes
away (`| head -c 10`, `| true`) ends robustctl quietly, with the exit status the verb would have
had anyway, however the race between writer and reader falls.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, Daemon, inject_kmsg, plugin_env

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.cli import diag, fleet, remote, render, sim, trace
from robustd.nvmlemu import state as emu

ROBUSTCTL = [sys.executable, "-m", "robustd.cli.robustctl"]

# The detail of an Xid line: the rule copies it into the condition's message. ESC starts a colour
# change, ESC ] ... BEL retitles the window, CR returns to the line's start, U+009B is the 8-bit CSI,
# U+202E reverses what follows on screen, U+2066 opens a bidi isolate.
HOSTILE = "GPU has \x1b[31mfallen\x07 off\tthe\rbus\x7f \x9b2J \x1b]0;pwned\x07 \u202eevil\u2066."
HOSTILE_SHOWN = r"GPU has \x1b[31mfallen\x07 off\tthe\rbus\x7f \x9b2J \x1b]0;pwned\x07 \u202eevil\u2066."


def unsafe_characters(text: str) -> list[str]:
    """Characters a terminal would act on instead of showing; a newline between lines is fine."""
    return [f"U+{ord(ch):04X}" for ch in text
            if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def has(component: str) -> Callable[[pb.Verdict], bool]:
    return lambda v: any(c.component == component for c in v.conditions)


# ---- control characters ---------------------------------------------------------------------------

def test_kernel_text_with_control_characters_is_escaped_for_people_and_exact_in_json(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # robustctl's tables cut the message to the terminal's width
    component = "gpu/0000:e5:00.0"
    inject_kmsg(f"NVRM: Xid (PCI:0000:e5:00): 79, pid=1, name=py\x1b]0;pwned\x07thon, {HOSTILE}")
    daemon.wait_for(has(component))

    for verb in ("status", "events"):
        r = daemon.robustctl(verb)
        assert r.returncode in (0, 2), r.stderr
        assert unsafe_characters(r.stdout) == [], f"{verb} printed raw control characters: {r.stdout!r}"
        row = next(line for line in r.stdout.splitlines() if component in line)
        assert HOSTILE_SHOWN in row  # escaped, on the condition's own row

    watch = subprocess.Popen([*ROBUSTCTL, "--socket", daemon.socket, "watch"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert watch.stdout is not None
        line = watch.stdout.readline()  # the snapshot of the only condition
    finally:
        watch.terminate()
        out, err = watch.communicate(timeout=10)
    assert watch.returncode == 0 and err == ""
    assert unsafe_characters(line + out) == [] and component in line and HOSTILE_SHOWN in line

    status = daemon.robustctl("status", "--json")
    events = daemon.robustctl("events", "--json")
    for r in (status, events):
        assert r.stdout.isascii() and unsafe_characters(r.stdout) == []  # JSON's own \u001b escapes
    [cond] = [c for c in json.loads(status.stdout)["conditions"] if c["component"] == component]
    assert cond["message"].endswith(HOSTILE)  # the exact text, control characters and all
    assert cond["evidence"]["name"] == "py\x1b]0;pwned\x07thon"
    [event] = [e for e in json.loads(events.stdout)["events"] if e["condition"]["component"] == component]
    assert event["condition"]["message"] == cond["message"]


class HostileServer(pb_grpc.NodeHealthServicer):
    """A peer that answers every GetVerdict with an error whose details would retitle and clear a terminal."""

    DETAILS = "disk \x1b]0;pwned\x07\x1b[2J\nfull"

    def GetVerdict(self, request: pb.GetVerdictRequest, context: grpc.ServicerContext) -> pb.Verdict:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.DETAILS)
        raise AssertionError("abort returns only by raising")


@pytest.fixture
def hostile_socket(short_tmp: Path) -> Iterator[str]:
    path = str(short_tmp / "hostile.sock")
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_NodeHealthServicer_to_server(HostileServer(), server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield path
    server.stop(0)


def test_server_details_in_error_lines_are_escaped(hostile_socket: str) -> None:
    shown = r"disk \x1b]0;pwned\x07\x1b[2J\nfull"
    r = subprocess.run([*ROBUSTCTL, "--socket", hostile_socket, "status"], capture_output=True, text=True,
                       timeout=30, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 4 and r.stdout == ""
    assert r.stderr == f"robustctl: FAILED_PRECONDITION: {shown}\n"  # one line, nothing raw

    r = subprocess.run([*ROBUSTCTL, "fleet", "status", f"unix:{hostile_socket}"], capture_output=True, text=True,
                       timeout=30, cwd=REPO, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    assert unsafe_characters(r.stdout) == [] and len(r.stdout.splitlines()) == 3, r.stdout
    assert shown in r.stdout.splitlines()[2] and "ERROR" in r.stdout


def test_printable_escapes_c0_c1_bidi_and_format_characters_only() -> None:
    p = render.printable
    assert p("plain ASCII, 100% (ok) \\ kept") == "plain ASCII, 100% (ok) \\ kept"
    assert p("été 東京 ✓ 😀 naïve\u00a0space") == "été 東京 ✓ 😀 naïve\u00a0space"  # drawn, not acted on
    assert p("\x00\x07\x08\x1b[1m\x7f") == r"\x00\x07\x08\x1b[1m\x7f"
    assert p("a\nb\tc\rd") == r"a\nb\tc\rd"
    assert p("\x80\x85\x9b\x9f") == r"\x80\x85\x9b\x9f"  # C1, including NEL and the 8-bit CSI
    assert p("\u202e\u202a\u2066\u2067\u2068\u2069\u200b\u200f\u00ad\ufeff") == \
        r"\u202e\u202a\u2066\u2067\u2068\u2069\u200b\u200f\xad\ufeff"
    assert p("\u2028\u2029") == r"\u2028\u2029"  # line and paragraph separators
    assert p("\U000e0041") == r"\U000e0041"  # a tag character: invisible text
    assert p("bad byte \udc80") == r"bad byte \udc80"  # a lone surrogate would make print() raise
    hostile = HOSTILE + "\u2028" + "\udcff"
    assert p(p(hostile)) == p(hostile) and unsafe_characters(p(hostile)) == []


def test_table_rows_stay_one_line_and_cuts_never_leave_half_an_escape() -> None:
    text = render.table(["A", "MESSAGE"], [["x\ny", "first\nsecond\tthird"], ["\x1b[2J", "ok"]], width=80)
    assert text.splitlines() == ["A        MESSAGE", r"x\ny     first\nsecond\tthird", r"\x1b[2J  ok"]
    for width in range(4, 16):
        cut = render.truncate("abcdefgh\x1b[31m\x1b[0m", width)
        assert len(cut) <= width and (cut.endswith("...") or cut == r"abcdefgh\x1b[31m\x1b[0m")
        body = cut.removesuffix("...")
        assert not body.endswith(("\\", "\\x", "\\x1")), cut


def test_every_human_renderer_escapes_outside_text() -> None:
    evil = "e\x1b]0;t\x07\n\u202e"
    cond = pb.Condition(component="gpu/" + evil, code="C" + evil, severity=pb.SEVERITY_CRITICAL, message=evil,
                        evidence={"k": evil}, source=evil)
    verdict = pb.Verdict(node=evil, severity=pb.SEVERITY_CRITICAL, conditions=[cond], emulated=[evil],
                         event_log_error=evil)
    event = pb.Event(seq=1, condition=cond)
    check = pb.CheckInfo(name=evil, mode=evil, last_error=evil)
    stacks = pb.CaptureResponse(node=evil, processes=[
        pb.ProcessStacks(pid=1, rank=0, command=evil, selected_by=evil, threads=[
            pb.ThreadStack(name=evil, frames=[pb.StackFrame(function=evil, file="/x/" + evil, line=1)])]),
        pb.ProcessStacks(pid=2, command=evil, error=evil)])
    result = pb.TestResult(test=evil, component=evil, message=evil, figures={evil: 1.0})
    report = pb.DiagnosticReport(id=evil, node=evil, outcome=pb.OUTCOME_FAIL, suspects=[evil], message=evil,
                                 results=[result], tests=[evil])
    outcomes: list[remote.Outcome[Any]] = [remote.Outcome(evil, verdict), remote.Outcome("h" + evil, None, evil, True)]
    state = emu.healthy_node(1)
    state.gpus[0].name = evil
    state.driver_version = evil

    texts = {
        "status": render.verdict_text(verdict, now=0.0),
        "event line": render.event_line(event),
        "events": render.events_text(pb.ListEventsResponse(events=[event])),
        "checks": render.checks_text(pb.ListChecksResponse(checks=[check]), now=0.0),
        "trace": trace.text(stacks),
        "diag show": diag.report_text(report),
        "diag list": diag._list_text([report]),
        "fleet status": fleet.status_text(outcomes, 0.1),
        "sim show": sim.show_text(state),
    }
    for name, text in texts.items():
        assert unsafe_characters(text) == [], f"{name}: {text!r}"
        assert r"\x1b]0;t\x07\n\u202e" in text, f"{name} lost the escaped text: {text!r}"
    assert len(texts["events"].splitlines()) == 2 and len(texts["fleet status"].splitlines()) == 4


# ---- a reader that goes away ----------------------------------------------------------------------

def into_leaving_reader(cmd: Sequence[str], take: int, then: Callable[[], None] | None = None,
                        stderr_too: bool = False, timeout: float = 20.0) -> tuple[int, str]:
    """Run `cmd` with stdout into a pipe whose reader takes `take` bytes, then closes it (`| head -c take`).

    `then` runs after the reader left (to make a `watch` write again); returns the exit status and stderr.
    """
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=w, text=True, cwd=REPO,
                                stderr=w if stderr_too else subprocess.PIPE)
    finally:
        os.close(w)
    got, deadline = b"", time.monotonic() + timeout
    try:
        while len(got) < take:
            ready, _, _ = select.select([r], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise AssertionError(f"{cmd}: fewer than {take} bytes within {timeout}s: {got!r}")
            chunk = os.read(r, take - len(got))
            if not chunk:
                break
            got += chunk
    finally:
        os.close(r)
    if then is not None:
        then()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{cmd} still running {timeout}s after its reader left") from None
    return proc.returncode, err or ""


@pytest.fixture
def critical_node(make_daemon: Any, short_tmp: Path) -> tuple[Daemon, Path]:
    """A daemon with one CRITICAL condition for as long as its flag file exists (no kernel log needed)."""
    flag = short_tmp / "flag"
    flag.touch()
    d = make_daemon({"checks": {"kernel": {"enabled": False}, "hang": {"enabled": False},
                                "boom": {"enabled": False}, "tick": {"interval": "100ms", "flag_file": str(flag)}},
                     "policy": {"codes": {"TICK_FLAG": {"severity": "CRITICAL", "action": "REBOOT",
                                                        "clear_after": "200ms"}}}}, env=plugin_env(short_tmp))
    d.start()
    d.wait_for(has("host"))
    return d, flag


@pytest.mark.parametrize("verb, status", [("status", 2), ("events", 0), ("checks", 0)])
def test_reader_leaving_is_quiet_and_keeps_the_exit_status(critical_node: tuple[Daemon, Path], verb: str,
                                                           status: int) -> None:
    d, _ = critical_node
    for i in range(20):
        take = 0 if i % 2 == 0 else 10  # `| true` and `| head -c 10`
        args = [verb, "--json"] if i % 4 >= 2 else [verb]
        rc, err = into_leaving_reader([*ROBUSTCTL, "--socket", d.socket, *args], take)
        assert (rc, err) == (status, ""), f"{args} into a reader that took {take} bytes"


def test_fleet_reader_leaving_is_quiet_and_keeps_the_exit_status(critical_node: tuple[Daemon, Path]) -> None:
    d, _ = critical_node
    hosts = [f"unix:{d.socket}", *(f"/nonexistent/{i}.sock" for i in range(30))]
    for i in range(20):
        rc, err = into_leaving_reader([*ROBUSTCTL, "fleet", "status", *hosts], 0 if i % 2 == 0 else 10)
        assert (rc, err) == (2, ""), "a CRITICAL host outranks the unreachable ones, read or not"
    rc, err = into_leaving_reader([*ROBUSTCTL, "fleet", "replay-plan", "--machines", "256", "--pp", "4", "--k", "2"], 0)
    assert (rc, err) == (0, "")


def test_watch_ends_quietly_when_its_reader_leaves(critical_node: tuple[Daemon, Path]) -> None:
    d, flag = critical_node
    for i in range(20):
        d.wait_for(has("host"))  # a snapshot to print at once
        if i % 2 == 0:
            rc, err = into_leaving_reader([*ROBUSTCTL, "--socket", d.socket, "watch"], 0)
        else:
            # The snapshot line fits the pipe before the reader leaves: watch notices at its next event.
            rc, err = into_leaving_reader([*ROBUSTCTL, "--socket", d.socket, "watch"], 10, then=flag.unlink)
            d.wait_for(lambda v: not has("host")(v), timeout=10)
            flag.touch()
        assert (rc, err) == (0, ""), f"watch, reader took {0 if i % 2 == 0 else 10} bytes"


def test_no_daemon_output_into_a_leaving_reader(tmp_path: Path) -> None:
    state = str(tmp_path / "nvml.state")
    emu.save(state, emu.healthy_node(16))
    for i in range(20):
        take = 0 if i % 2 == 0 else 10
        for cmd, status in (([*ROBUSTCTL, "sim", "--state", state, "show"], 0), ([*ROBUSTCTL, "--help"], 0),
                            ([*ROBUSTCTL, "diag", "--help"], 0)):
            rc, err = into_leaving_reader(cmd, take)
            assert (rc, err) == (status, ""), f"{cmd[3:]} into a reader that took {take} bytes"
    # The error line itself into a closed pipe (`2>&1 | true`): still the unreachable status.
    rc, _ = into_leaving_reader([*ROBUSTCTL, "--socket", str(tmp_path / "none.sock"), "status"], 0, stderr_too=True)
    assert rc == 3
