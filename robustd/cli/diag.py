"""`robustctl diag`: run stop-time diagnostics with a live progress bar; list, show, cancel; goldens.

Exit codes (robustd/cli/exitcodes.py): 0 PASS, 1 FAIL of WARNING severity, 2 FAIL of CRITICAL severity,
5 ERROR, 6 CANCELLED, 9 still running (show); a run the daemon will not start: 7 another is running,
8 refused (GPU processes alive, state disk), 64 a level, test or GPU it does not know; 3 unreachable and
4 any other RPC error as for every verb.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from typing import Any

import grpc

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.cli import exitcodes, output, render
from robustd.cli.args import AddGlobals, verbs
from robustd.cli.client import CliError
from robustd.durations import format_duration, parse_duration

TESTS = ("eud", "all_to_all", "all_gather", "minigpt")
STATUS = {pb.RESULT_PASS: "PASS", pb.RESULT_FAIL: "FAIL", pb.RESULT_SKIPPED: "SKIPPED", pb.RESULT_ERROR: "ERROR"}


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "diag_command", add_globals)
    r = verb("run", "run diagnostics now (the job must be stopped on this node)",
             "robustctl diag run --level quick\nrobustctl diag run --tests eud,all_to_all --gpus 0000:1b:00.0 "
             "--no-stop-on-failure")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--tests", type=test_list, help=f"comma-separated, in order: {','.join(TESTS)}")
    g.add_argument("--level", help="a named list from config: quick, standard, full")
    r.add_argument("--gpus", type=lambda s: [x for x in s.split(",") if x], default=[], help="bus ids (default all)")
    r.add_argument("--no-stop-on-failure", action="store_true", help="run every test even after a failure")
    r.add_argument("--run-timeout", type=parse_duration, metavar="DURATION", help="limit for the whole run")
    r.add_argument("--force", action="store_true", help="run even while GPU compute processes are alive")
    r.add_argument("--rendezvous", type=_rendezvous, metavar="ADDR:PORT,WORLD,RANK[,RUN_ID]",
                   help="for all_gather: master address:port, nodes, this node's rank, a run id")
    r.add_argument("--run-id", default="", metavar="ID",
                   help="a tag kept in the report and shown by `diag list` (default: the rendezvous's run id)")
    verb("list", "recent diagnostic reports", "robustctl diag list --limit 5").add_argument(
        "--limit", type=int, default=20)
    verb("show", "one report", "robustctl diag show diag-20261130-154045-5d9ab3").add_argument("id")
    verb("cancel", "cancel a running diagnostic (kills its child processes)",
         "robustctl diag cancel diag-20261130-154045-5d9ab3").add_argument("id")
    gold = verb("golden", "golden MiniGPT digests for (GPU model, driver, torch version)")
    golden = verbs(gold, "golden_command", add_globals)
    golden("record", "record the node digest of a passing MiniGPT report (default: newest)").add_argument(
        "id", nargs="?", default="")
    golden("show", "the recorded golden digests")


def run(client: Any, args: argparse.Namespace) -> int:
    cmd = args.diag_command
    if cmd == "run":
        return _run(client, args)
    if cmd == "list":
        resp = client.call("List", pb.ListDiagnosticsRequest(limit=args.limit), "Diagnostics")
        output.out(render.to_json(resp) if args.json else _list_text(resp.reports, output.width()), exact=args.json)
        return 0
    if cmd in ("show", "cancel"):
        method, req = ("Get", pb.GetDiagnosticRequest(id=args.id)) if cmd == "show" else \
            ("Cancel", pb.CancelDiagnosticRequest(id=args.id))
        report = client.call(method, req, "Diagnostics")
        output.out(render.to_json(report) if args.json else report_text(report, output.width()), exact=args.json)
        return exit_code(report)
    if args.golden_command == "record":
        golden = client.call("RecordGolden", pb.RecordGoldenRequest(report_id=args.id), "Diagnostics")
        done = render.printable(f"recorded {golden.digest} for {golden.key}")
        output.out(render.to_json(golden) if args.json else done, exact=args.json)
        return 0
    resp = client.call("ListGoldens", pb.ListGoldensRequest(), "Diagnostics")
    rows = [[g.key, g.digest[:16], g.report_id, render.local_time(g.recorded_at)] for g in resp.goldens]
    output.out(render.to_json(resp) if args.json else
               (render.table(["KEY", "DIGEST", "REPORT", "RECORDED"], rows, output.width()) if rows
                else "no golden digests"),
               exact=args.json)
    return 0


def _run(client: Any, args: argparse.Namespace) -> int:
    req = pb.RunRequest(tests=args.tests or [], level=args.level or "", gpus=args.gpus, force=args.force)
    if args.no_stop_on_failure:
        req.stop_on_failure = False
    if args.run_timeout:
        req.timeout.FromNanoseconds(int(args.run_timeout * 1e9))
    if args.rendezvous:
        req.rendezvous.CopyFrom(args.rendezvous)
    req.run_id = args.run_id
    channel = client.open()
    report = None
    live = Live(sys.stderr.isatty())
    call = pb_grpc.DiagnosticsStub(channel).Run(req)  # no deadline: runs take minutes
    messages: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=_pump, args=(call, messages), name="diag-run", daemon=True).start()
    try:
        while True:
            # The stream is read on a thread so that the running test's elapsed time keeps moving
            # between messages (a child that reports nothing sends nothing for minutes).
            try:
                msg = messages.get(timeout=live.tick)
            except queue.Empty:
                if not args.json:
                    live.redraw()
                continue
            if msg is _END:
                break
            if isinstance(msg, grpc.RpcError):
                raise _refusal(client.error(msg, channel), msg) from None
            # A reader that goes away (| head) does not stop the run (the daemon finishes it anyway);
            # robustctl follows it to the report so that its exit status is the outcome's.
            if args.json:
                output.out(render.to_json(msg, indent=None), exact=True)
            else:
                live.show(msg)
            if msg.phase == pb.DiagnosticProgress.PHASE_DONE:
                report = msg.report
    finally:
        call.cancel()
        channel.close()
    if report is None:
        raise CliError(exitcodes.RPC, "the run's stream ended without its report; see `robustctl diag list`")
    if not args.json:
        output.out(report_text(report, output.width()))
    return exit_code(report)


_END = object()


def _pump(call: Any, messages: queue.Queue[Any]) -> None:
    """Move the Run stream's messages onto `messages`, then _END or the RpcError that ended it."""
    try:
        for msg in call:
            messages.put(msg)
        messages.put(_END)
    except grpc.RpcError as err:
        messages.put(err if err.code() != grpc.StatusCode.CANCELLED else _END)


class Live:
    """What `diag run` shows on stderr while it runs: one line per test with its elapsed time.

    On a terminal the running test's line is redrawn every second (the bar, the percentage, the
    test, how long it has run, its last progress message) and stays, with its result and time, when
    the test finishes. In a pipe or a log each test gets a line when it starts, one every 30 s while it
    runs, and one when it finishes: enough to see that it is alive, never a flood.
    """

    def __init__(self, tty: bool, clock: Any = time.monotonic):
        self.tty = tty
        self.tick = 1.0 if tty else 30.0
        self.clock = clock
        self.test = ""
        self.started = 0.0
        self.percent = 0.0
        self.message = ""

    def show(self, msg: pb.DiagnosticProgress) -> None:
        self.percent = msg.percent
        if msg.phase == pb.DiagnosticProgress.PHASE_STARTED:
            self.test, self.started, self.message = msg.test, self.clock(), ""
            self._line(self._running(), final=not self.tty)
        elif msg.phase == pb.DiagnosticProgress.PHASE_PROGRESS:
            self.message = msg.message
            if self.tty:
                self._line(self._running(), final=False)
        elif msg.phase == pb.DiagnosticProgress.PHASE_FINISHED:
            self._line(self._finished(msg), final=True)
            for reason in failure_reasons(msg.results):
                output.err(render.printable(f"    {reason}"))
            self.test = ""
        elif msg.phase == pb.DiagnosticProgress.PHASE_DONE:
            self._line(f"{self._bar()}  done: {msg.message.removeprefix('OUTCOME_') or 'report follows'}", final=True)

    def redraw(self) -> None:
        """The clock moved and no message came: refresh the running test's elapsed time."""
        if self.test:
            self._line(self._running(), final=not self.tty)

    def _bar(self) -> str:
        filled = int(max(0.0, min(self.percent, 100.0)) / 5)
        return f"[{'#' * filled}{'.' * (20 - filled)}] {self.percent:5.1f}%"

    def _elapsed(self) -> str:
        return format_duration(int(max(0.0, self.clock() - self.started)))

    def _running(self) -> str:
        return f"{self._bar()}  {self.test} running {self._elapsed()}  {self.message}".rstrip()

    def _finished(self, msg: pb.DiagnosticProgress) -> str:
        worst = max((r.status for r in msg.results), default=pb.RESULT_PASS,
                    key=lambda s: (s == pb.RESULT_FAIL, s == pb.RESULT_ERROR, s == pb.RESULT_SKIPPED))
        return f"{self._bar()}  {msg.test} finished: {STATUS.get(worst, '?')} after {self._elapsed()}"

    def _line(self, text: str, final: bool) -> None:
        """A line on stderr; on a terminal it overwrites the running line (the only raw CR we print).

        The running line is cut to the terminal's width less one (a line that wrapped could not be
        redrawn) and padded to it, and so is the final one: whatever the running line showed past the
        final text's end is blanked, never left behind (`... PASS after 4sfinished`).
        """
        line = render.printable(text)
        if not self.tty:
            output.err(line)
            return
        width = _columns(sys.stderr) - 1
        shown = line if final else line[:width]
        output.err(shown.ljust(width), end="\n" if final else "", cr=True)


def _columns(stream: Any) -> int:
    """The terminal's width (80 when it does not say), at most 200: the running line is redrawn within it."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        columns = 0
    return min(columns or 80, 200)


STDERR_LINES = 5  # of a failing child's stderr tail, shown under its result


def failure_reasons(results: Any) -> list[str]:
    """For each FAIL or ERROR result: what failed and why, with the child's last stderr lines if it left any."""
    out = []
    for x in results:
        if x.status not in (pb.RESULT_FAIL, pb.RESULT_ERROR):
            continue
        out.append(f"{x.test} {x.component} {STATUS.get(x.status, '?')}: {x.message or 'no message'}")
        tail = [line for line in x.details.get("stderr", "").splitlines() if line.strip()][-STDERR_LINES:]
        if tail:
            out.append(f"  last stderr lines of {x.test}:")
            out.extend(f"  | {line}" for line in tail)
    return out


def report_text(r: pb.DiagnosticReport, width: int | None = render.DEFAULT_WIDTH) -> str:
    head = [f"diagnostic {r.id} on {r.node}: {pb.Outcome.Name(r.outcome).removeprefix('OUTCOME_')}"
            + (f" ({render.severity_name(r.severity)}, action {render.action_name(r.action)})"
               if r.outcome == pb.OUTCOME_FAIL else "") + (f" (run id {r.run_id})" if r.run_id else "")]
    if r.suspects:
        head.append(f"suspects: {', '.join(r.suspects)}")
    if r.message:
        head.append(r.message)
    rows = [[x.test, x.component, STATUS.get(x.status, "?"),
             " ".join(f"{k}={v:.3g}" for k, v in sorted(x.figures.items())), x.message] for x in r.results]
    text = render.lines(head)
    if rows:
        text += "\n" + render.table(["TEST", "COMPONENT", "RESULT", "FIGURES", "MESSAGE"], rows, width)
    reasons = failure_reasons(r.results)
    return text + ("\n\nwhy:\n" + render.lines(reasons) if reasons else "")


def _list_text(reports: Any, width: int | None = render.DEFAULT_WIDTH) -> str:
    if not reports:
        return "no diagnostics"
    rows = [[r.id, render.local_time(r.started), r.run_id or "-", ",".join(r.tests),
             pb.Outcome.Name(r.outcome).removeprefix("OUTCOME_"), ", ".join(r.suspects)] for r in reports]
    return render.table(["ID", "STARTED", "RUN", "TESTS", "OUTCOME", "SUSPECTS"], rows, width)


# Why the daemon would not start a run, as Run's status codes say (robustd/api/diagnostics.py).
_REFUSALS = {grpc.StatusCode.ABORTED: exitcodes.DIAG_BUSY, grpc.StatusCode.FAILED_PRECONDITION: exitcodes.DIAG_REFUSED,
             grpc.StatusCode.INVALID_ARGUMENT: exitcodes.USAGE}
_OUTCOMES = {pb.OUTCOME_PASS: exitcodes.OK, pb.OUTCOME_ERROR: exitcodes.DIAG_ERROR,
             pb.OUTCOME_CANCELLED: exitcodes.DIAG_CANCELLED, pb.OUTCOME_RUNNING: exitcodes.DIAG_RUNNING}


def _refusal(error: CliError, err: grpc.RpcError) -> CliError:
    """Run's refusals get their own codes: busy, refused, or a request the daemon cannot use (a usage error)."""
    if error.code == exitcodes.RPC and err.code() in _REFUSALS:
        error.code = _REFUSALS[err.code()]
    return error


def exit_code(r: pb.DiagnosticReport) -> int:
    """A report's outcome as `diag run`/`show`/`cancel` exit (robustd/cli/exitcodes.py)."""
    if r.outcome == pb.OUTCOME_FAIL:
        return exitcodes.DIAG_FAIL_CRITICAL if r.severity == pb.SEVERITY_CRITICAL else exitcodes.DIAG_FAIL_WARNING
    return _OUTCOMES.get(r.outcome, exitcodes.RPC)


def test_list(text: str) -> list[str]:
    """`eud,all_to_all`: known test names, in order (an argparse type)."""
    tests = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tests if t not in TESTS]
    if bad or not tests:
        raise argparse.ArgumentTypeError(f"unknown tests {bad}; choose from {', '.join(TESTS)}")
    return tests


def _rendezvous(text: str) -> pb.Rendezvous:
    try:
        parts = text.split(",")
        addr, _, port = parts[0].rpartition(":")
        return pb.Rendezvous(master_addr=addr, master_port=int(port), world_size=int(parts[1]),
                             node_rank=int(parts[2]), run_id=parts[3] if len(parts) > 3 else "")
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError("expected ADDR:PORT,WORLD_SIZE,NODE_RANK[,RUN_ID]") from None
