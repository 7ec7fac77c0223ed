"""`robustctl diag`: run stop-time diagnostics with a live progress bar; list, show, cancel; goldens.

Exit codes of `diag run` and `diag show`: 0 PASS, 1 FAIL of WARNING severity, 2 FAIL of CRITICAL
severity, 4 ERROR or CANCELLED (and other RPC errors), 3 daemon unreachable.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.cli import output, render
from robustd.cli.args import AddGlobals, verbs
from robustd.durations import parse_duration

TESTS = ("eud", "all_to_all", "all_gather", "minigpt")
STATUS = {pb.RESULT_PASS: "PASS", pb.RESULT_FAIL: "FAIL", pb.RESULT_SKIPPED: "SKIPPED", pb.RESULT_ERROR: "ERROR"}


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "diag_command", add_globals)
    r = verb("run", "run diagnostics now (the job must be stopped on this node)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--tests", type=_tests, help=f"comma-separated, in order: {','.join(TESTS)}")
    g.add_argument("--level", help="a named list from config: quick, standard, full")
    r.add_argument("--gpus", type=lambda s: [x for x in s.split(",") if x], default=[], help="bus ids (default all)")
    r.add_argument("--no-stop-on-failure", action="store_true", help="run every test even after a failure")
    r.add_argument("--run-timeout", type=parse_duration, metavar="DURATION", help="limit for the whole run")
    r.add_argument("--force", action="store_true", help="run even while GPU compute processes are alive")
    r.add_argument("--rendezvous", type=_rendezvous, metavar="ADDR:PORT,WORLD,RANK[,RUN_ID]",
                   help="for all_gather: master address:port, nodes, this node's rank, a run id")
    verb("list", "recent diagnostic reports").add_argument("--limit", type=int, default=20)
    verb("show", "one report").add_argument("id")
    verb("cancel", "cancel a running diagnostic (kills its child processes)").add_argument("id")
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
        output.out(render.to_json(resp) if args.json else _list_text(resp.reports), exact=args.json)
        return 0
    if cmd in ("show", "cancel"):
        method, req = ("Get", pb.GetDiagnosticRequest(id=args.id)) if cmd == "show" else \
            ("Cancel", pb.CancelDiagnosticRequest(id=args.id))
        report = client.call(method, req, "Diagnostics")
        output.out(render.to_json(report) if args.json else report_text(report), exact=args.json)
        return exit_code(report)
    if args.golden_command == "record":
        golden = client.call("RecordGolden", pb.RecordGoldenRequest(report_id=args.id), "Diagnostics")
        done = render.printable(f"recorded {golden.digest} for {golden.key}")
        output.out(render.to_json(golden) if args.json else done, exact=args.json)
        return 0
    resp = client.call("ListGoldens", pb.ListGoldensRequest(), "Diagnostics")
    rows = [[g.key, g.digest[:16], g.report_id, render.local_time(g.recorded_at)] for g in resp.goldens]
    output.out(render.to_json(resp) if args.json else
               (render.table(["KEY", "DIGEST", "REPORT", "RECORDED"], rows) if rows else "no golden digests"),
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
    channel = client.open()
    report = None
    tty = sys.stderr.isatty()
    try:
        for msg in pb_grpc.DiagnosticsStub(channel).Run(req):  # no deadline: runs take minutes
            # A reader that goes away (| head) does not stop the run (the daemon finishes it anyway);
            # robustctl follows it to the report so that its exit status is the outcome's.
            if args.json:
                output.out(render.to_json(msg, indent=None), exact=True)
            else:
                _progress(msg, tty)
            if msg.phase == pb.DiagnosticProgress.PHASE_DONE:
                report = msg.report
    except grpc.RpcError as err:
        raise client.error(err, channel) from None
    finally:
        channel.close()
    if report is None:
        return 4
    if not args.json:
        output.out(report_text(report))
    return exit_code(report)


def _progress(msg: pb.DiagnosticProgress, tty: bool) -> None:
    """One progress line on stderr; on a terminal, PROGRESS lines redraw in place (the only raw CR we print)."""
    bar = "#" * int(msg.percent / 5) + "." * (20 - int(msg.percent / 5))
    line = render.printable(f"[{bar}] {msg.percent:5.1f}%  {msg.test or ''} {msg.message}".rstrip())
    if msg.phase == pb.DiagnosticProgress.PHASE_FINISHED:
        worst = max((r.status for r in msg.results), default=pb.RESULT_PASS,
                    key=lambda s: (s == pb.RESULT_FAIL, s == pb.RESULT_ERROR, s == pb.RESULT_SKIPPED))
        line = render.printable(f"[{bar}] {msg.percent:5.1f}%  {msg.test} finished: {STATUS.get(worst, '?')}")
    if tty and msg.phase == pb.DiagnosticProgress.PHASE_PROGRESS:
        output.err(f"{line[:120]:<120}", end="", cr=True)
    else:
        output.err(line, cr=tty)


def report_text(r: pb.DiagnosticReport) -> str:
    head = [f"diagnostic {r.id} on {r.node}: {pb.Outcome.Name(r.outcome).removeprefix('OUTCOME_')}"
            + (f" ({render.severity_name(r.severity)}, action {render.action_name(r.action)})"
               if r.outcome == pb.OUTCOME_FAIL else "")]
    if r.suspects:
        head.append(f"suspects: {', '.join(r.suspects)}")
    if r.message:
        head.append(r.message)
    rows = [[x.test, x.component, STATUS.get(x.status, "?"),
             " ".join(f"{k}={v:.3g}" for k, v in sorted(x.figures.items())), x.message] for x in r.results]
    text = render.lines(head)
    return text + ("\n" + render.table(["TEST", "COMPONENT", "RESULT", "FIGURES", "MESSAGE"], rows) if rows else "")


def _list_text(reports: Any) -> str:
    if not reports:
        return "no diagnostics"
    rows = [[r.id, render.local_time(r.started), ",".join(r.tests), pb.Outcome.Name(r.outcome).removeprefix("OUTCOME_"),
             ", ".join(r.suspects)] for r in reports]
    return render.table(["ID", "STARTED", "TESTS", "OUTCOME", "SUSPECTS"], rows)


def exit_code(r: pb.DiagnosticReport) -> int:
    if r.outcome == pb.OUTCOME_PASS:
        return 0
    if r.outcome == pb.OUTCOME_FAIL:
        return 2 if r.severity == pb.SEVERITY_CRITICAL else 1
    return 4


def _tests(text: str) -> list[str]:
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
