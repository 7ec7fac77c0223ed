"""robustctl: ask a robustd daemon what it thinks of this node.

Exit codes are a contract scripts rely on (robustd/cli/exitcodes.py holds every verb's): 0/1/2 mirror
OK/WARNING/CRITICAL for `status`, 3 means the daemon could not be reached, 4 any other RPC error, 64 a
usage error (argparse's usual 2 would read as CRITICAL). Errors are one line on stderr, never a traceback.

Whatever starts robustctl, it stops the same way: Ctrl-C (SIGINT) works even when inherited as
ignored (a background job of a script), SIGTERM ends `watch` as cleanly as Ctrl-C, and a reader
that goes away (`| head`) ends output quietly without changing the exit status (see output.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn

import grpc

from robustd import __version__
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.cli import completion, exitcodes, output, render
from robustd.cli.args import duration, examples, positive, verbs, whole_number
from robustd.cli.client import EXIT_RPC, EXIT_UNREACHABLE, EXIT_USAGE, Client, CliError
from robustd.cli.signals import Terminated, stop
from robustd.roots import DEFAULT_SOCKET

_SEVERITY_EXIT = {pb.SEVERITY_WARNING: exitcodes.WARNING, pb.SEVERITY_CRITICAL: exitcodes.CRITICAL}
# A broken Watch with one of these codes is worth resuming; anything else is the server's answer.
_RESUMABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
_BACKOFF_MAX = 5.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        """Help and usage text too must not fail on a closed pipe (`robustctl --help | head -1`)."""
        if message:
            output.write(message, file or sys.stderr)


_timeout = positive("timeout")


def _severity(text: str) -> int:
    name = "SEVERITY_" + text.strip().upper().removeprefix("SEVERITY_")
    try:
        value = int(pb.Severity.Value(name))
    except ValueError:
        value = 0
    if value == pb.SEVERITY_UNSPECIFIED:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of ok, warning, critical")
    return value


def _add_globals(p: argparse.ArgumentParser, defaults: bool) -> None:
    """Global options, accepted before and after the verb; after it they must not reset earlier ones."""
    d: Callable[[Any], Any] = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    p.add_argument("--socket", default=d(None), metavar="PATH",
                   help=f"daemon's Unix socket (default: $ROBUSTD_SOCKET or {DEFAULT_SOCKET})")
    p.add_argument("--address", default=d(None), metavar="HOST:PORT", help="daemon's TCP address instead")
    p.add_argument("--tls-ca", default=d(None), metavar="PEM", help="CA that signed the daemon's certificate "
                   "(TLS on --address; plaintext without it)")
    p.add_argument("--tls-cert", default=d(None), metavar="PEM", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=d(None), metavar="PEM", help="client private key (mutual TLS)")
    p.add_argument("--timeout", type=_timeout, default=d(5.0), metavar="DURATION",
                   help="deadline for each request (default 5s)")
    p.add_argument("--json", action="store_true", default=d(False), help="print JSON instead of tables")


def _wide(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--wide", action="store_true", help="full messages on a terminal too: do not cut the last column "
                   "to its width (a pipe or a file always gets them whole)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="robustctl", description="Query the robustd node health daemon.",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog=examples("export ROBUSTD_SOCKET=$PWD/run/robustd.sock   # the daemon `make run` starts",
                                     "robustctl status", "robustctl events --since 1h --min-severity warning",
                                     "robustctl ack gpu/0000:1b:00.0 XID_79 --reason 'GPU reseated'")
                     + "\n\nexit status: " + exitcodes.COMMON + "\n\n"
                       "environment: ROBUSTD_SOCKET (the daemon's socket), NO_COLOR (no colour even on a terminal)")
    _add_globals(parser, defaults=True)
    parser.add_argument("--version", action="version", version=f"robustctl {__version__}")
    verb = verbs(parser, "command", _add_globals)

    s = verb("status", "the node's verdict; exit 0 OK, 1 WARNING, 2 CRITICAL",
             "robustctl status\nrobustctl status --wide || echo 'not OK: exit status' $?")
    _wide(s)
    w = verb("watch", "stream condition changes as they happen",
             "robustctl watch\nrobustctl watch --json --from-seq 1   # every event in the log, then live ones")
    w.add_argument("--from-seq", type=whole_number(0), default=0, metavar="N",
                   help="resume after event N (default: a snapshot, then live events)")
    e = verb("events", "list past events",
             "robustctl events --since 1h\nrobustctl events --component gpu/ --min-severity warning --limit 20 --wide")
    _wide(e)
    e.add_argument("--since", type=duration, metavar="DURATION", help="only events newer than now minus this")
    e.add_argument("--component", default="", help="exact component, or a prefix ending in / (gpu/)")
    e.add_argument("--min-severity", type=_severity, default=0, metavar="{ok,warning,critical}")
    e.add_argument("--limit", type=whole_number(0), default=0, metavar="N", help="newest N matches (default 100)")
    _wide(verb("checks", "the checks and how their last runs went", "robustctl checks --wide"))
    a = verb("ack", "acknowledge (clear) a condition, e.g. a sticky fault after repair",
             "robustctl ack gpu/0000:1b:00.0 XID_79 --reason 'GPU reseated, RMA 1234'")
    completion.live(a.add_argument("component", help="as `robustctl status` shows it (completes from the verdict)"),
                    "component")
    completion.live(a.add_argument("code", help="the condition's code, e.g. XID_79 (completes from the verdict)"),
                    "code")
    a.add_argument("--reason", default="", help="why, for the event log")
    from robustd.cli import sim

    sim.add_parser(verb("sim", "edit the NVML emulator's state file (hosts without GPUs; no daemon needed)",
                        "robustctl sim --state var/nvml.state fault gpu 3 ecc-dbe\n"
                        "robustctl sim --state var/nvml.state clear gpu 3"))
    from robustd.cli import diag

    diag.add_parser(verb("diag", "stop-time diagnostics: run, list, show, cancel; golden digests",
                         "robustctl diag run --level quick\nrobustctl diag list"), _add_globals)
    from robustd.cli import evidence

    evidence.add_parser(verb("evidence", "evidence bundles (what robustd knew when a node was drained or cordoned): "
                                         "list, show, export (tar.gz for an RMA), create",
                             "robustctl evidence list\nrobustctl evidence export ev-20261203T061500.123Z-a1b2c3 "
                             "rma.tar.gz"), _add_globals)
    from robustd.cli import fleet

    fleet.add_parser(verb("fleet", "many daemons: status, stacks (outlier parallel groups); planning: "
                                   "dual-phase replay plan/locate, warm-standby sizing",
                          "robustctl fleet status unix:run/robustd.sock\n"
                          "robustctl fleet standby --machines 1024 --failure-prob 0.001"), _add_globals)
    from robustd.cli import stragglers

    stragglers.add_parser(verb("stragglers", "straggler what-if analysis of a training trace: slowdown, "
                                             "per-worker/stage attribution, causes (no daemon needed)",
                               "robustctl stragglers analyze --metadata tests/fixtures/stragglers/meta-AR.yaml "
                               "--trace tests/fixtures/stragglers/trace-AR.parquet"), _add_globals)
    from robustd.cli import slurm

    slurm.add_parser(verb("slurm", "Slurm hooks (healthcheck, prolog, epilog, epilog-ctld, prolog-ctld) and "
                          "robustd-slurm's status",
                          "robustctl slurm status"), _add_globals)
    from robustd.cli import trace

    trace.add_arguments(verb("trace", "stacks of this node's training processes (py-spy; authorized callers only)",
                             "robustctl trace\nrobustctl trace --rank 3 --native"), _timeout)
    from robustd.cli import triage

    triage.add_arguments(verb("triage", "why a job failed, from its logs and exit status: failure class, whether "
                                        "infrastructure is to blame, the next step (no daemon needed)",
                              "robustctl triage --exit-code 1 examples/triage/nccl-ib/", local=True))
    exitcodes.annotate(parser)
    return parser


def _width(args: argparse.Namespace | None = None) -> int | None:
    """The table width (output.width): --wide or no terminal never cut."""
    return output.width(args is not None and getattr(args, "wide", False))


def _colour() -> bool:
    return output.use_colour(sys.stdout)


def _print(text: str, exact: bool = False) -> bool:
    """One block of output; `exact` for JSON. False once stdout's reader has gone away."""
    return output.out(text, exact=exact)


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    v: pb.Verdict = client.call("GetVerdict", pb.GetVerdictRequest())
    if args.json:
        _print(render.to_json(v), exact=True)
    else:
        now = v.at.ToNanoseconds() / 1e9 if v.HasField("at") else time.time()
        colour = _colour()
        output.out(render.verdict_text(v, now, _width(args), colour), colour=colour)
    return _SEVERITY_EXIT.get(v.severity, 0)


def cmd_events(client: Client, args: argparse.Namespace) -> int:
    req = pb.ListEventsRequest(component=args.component, min_severity=args.min_severity, limit=args.limit)
    if args.since is not None:
        req.since.FromNanoseconds(int((time.time() - args.since) * 1e9))
    resp: pb.ListEventsResponse = client.call("ListEvents", req)
    if args.json:
        _print(render.to_json(resp), exact=True)
    else:
        colour = _colour()
        output.out(render.events_text(resp, _width(args), colour), colour=colour)
    return 0


def cmd_checks(client: Client, args: argparse.Namespace) -> int:
    resp: pb.ListChecksResponse = client.call("ListChecks", pb.ListChecksRequest())
    _print(render.to_json(resp) if args.json else render.checks_text(resp, time.time(), _width(args)),
           exact=args.json)
    return 0


def cmd_ack(client: Client, args: argparse.Namespace) -> int:
    req = pb.AcknowledgeRequest(component=args.component, code=args.code, reason=args.reason)
    resp: pb.AcknowledgeResponse = client.call("Acknowledge", req)
    if args.json:
        _print(render.to_json(resp.event), exact=True)
    else:
        colour = _colour()
        output.out(render.event_line(resp.event, colour), colour=colour)
    return 0


def cmd_watch(client: Client, args: argparse.Namespace) -> int:
    """Print events until Ctrl-C, SIGTERM or the reader going away, each a normal end (exit 0)."""
    signal.signal(signal.SIGTERM, stop)  # main() puts the previous handler back
    try:
        return _watch(client, args)
    except (KeyboardInterrupt, Terminated):
        return 0


def _watch(client: Client, args: argparse.Namespace) -> int:
    """Print events forever; on a broken stream resume after the last seq printed, so none is lost or doubled."""
    last = args.from_seq
    colour = not args.json and _colour()
    established = False
    backoff = 0.1
    while True:
        channel: grpc.Channel | None = None
        try:
            channel = client.open()
            stub = pb_grpc.NodeHealthStub(channel)
            # A unary probe bounds the connect by --timeout (a stream has no deadline), and with from_seq 0
            # its seq is a safe resume point: the snapshot that follows already reflects every event up to it.
            head = stub.GetVerdict(pb.GetVerdictRequest(), timeout=client.timeout).seq
            if established:
                output.err(f"robustctl: reconnected; resuming after seq {last}")
            stream = stub.Watch(pb.WatchRequest(from_seq=last))
            if last == 0 or (head == 0 and last == 1):
                last = head  # a snapshot's seqs, or an empty log where --from-seq 1 means "every event from here"
            established, backoff = True, 0.1
            for ev in stream:
                if not ev.snapshot and ev.seq <= last:
                    continue  # already printed before a reconnect
                last = max(last, ev.seq)
                text = render.to_json(ev, indent=None) if args.json else render.event_line(ev, colour)
                if not output.out(text, exact=args.json, colour=colour):
                    return 0  # nobody reads any more (| head): the one way a watch ends by itself
            reason = "the daemon closed the stream"
        except grpc.RpcError as err:
            code = err.code()
            if code == grpc.StatusCode.OUT_OF_RANGE:
                raise CliError(EXIT_RPC, f"OUT_OF_RANGE: cannot resume after seq {last}: {err.details()}") from None
            if not established or code not in _RESUMABLE:
                raise client.error(err, channel) from None
            reason = f"{code.name}: {err.details()}"
        except CliError as err:
            if not established or err.code != EXIT_UNREACHABLE:
                raise
            reason = str(err)
        finally:
            if channel is not None:
                channel.close()
        if backoff == 0.1:
            output.err(f"robustctl: watch stream lost ({reason}); reconnecting to resume after seq {last}")
        time.sleep(backoff)
        backoff = min(backoff * 2, _BACKOFF_MAX)


def _offline(verb: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
             file_exit: int = exitcodes.SIM_FILE) -> int:
    """A verb that reads files, not a daemon: bad input exits 64, an unreadable file `file_exit`, one line each."""
    try:
        return run(args)
    except ValueError as e:
        raise CliError(EXIT_USAGE, f"{verb}: {e}") from None
    except BrokenPipeError:
        raise  # a closed stdout is not an unreadable input file; main() ends quietly
    except OSError as e:
        raise CliError(file_exit, f"{verb}: {e.filename or ''}: {e.strerror or e}") from None


def cmd_sim(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import sim

    return _offline("sim", sim.run, args)


def cmd_diag(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import diag

    return diag.run(client, args)


def cmd_stragglers(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import stragglers

    try:
        return _offline("stragglers", stragglers.run, args, file_exit=exitcodes.UNREADABLE)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("numpy", "pyarrow", "matplotlib"):
            raise CliError(exitcodes.MISSING_PACKAGE, f"stragglers: needs {e.name}, which this installation lacks: "
                              "pip install -r requirements-analysis.txt (or robustd[analysis])") from None
        raise


def cmd_trace(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import trace

    req, allowance = trace.request(args.native, args.capture_timeout, args.pid, args.rank)
    resp: pb.CaptureResponse = client.call("CaptureStacks", req, service="Tracer", timeout=client.timeout + allowance)
    _print(render.to_json(resp) if args.json else trace.text(resp), exact=args.json)
    return trace.exit_code(resp)


def cmd_triage(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import triage

    return _offline("triage", triage.run, args, file_exit=triage.EXIT_UNREADABLE)


def cmd_slurm(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import slurm

    return slurm.run(args)


def cmd_evidence(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import evidence

    return evidence.run(client, args)


def cmd_fleet(client: Client, args: argparse.Namespace) -> int:
    from robustd.cli import fleet

    return _offline("fleet", fleet.run, args, file_exit=EXIT_USAGE)  # an unreadable --hosts-file is a usage error


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "status": cmd_status, "watch": cmd_watch, "events": cmd_events, "checks": cmd_checks, "ack": cmd_ack,
    "sim": cmd_sim, "diag": cmd_diag, "fleet": cmd_fleet, "evidence": cmd_evidence,
    "trace": cmd_trace, "stragglers": cmd_stragglers, "slurm": cmd_slurm, "triage": cmd_triage,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; Ctrl-C works even when robustctl was started with SIGINT ignored.

    A background job of a non-interactive shell starts with SIGINT ignored, and Python then leaves it
    ignored; an operator's Ctrl-C (or a test's SIGINT) must still stop `watch`.
    """
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, stop)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED  # `watch` returns 0 itself: Ctrl-C is how it ends
    except BrokenPipeError:
        # A write that did not go through output (none should): still no traceback, no "Exception ignored".
        output.discard(sys.stdout)
        output.discard(sys.stderr)
        return 0
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    completion.autocomplete(parser)  # returns at once unless the shell asked for completions
    args = parser.parse_args(argv)
    if args.socket and args.address:
        parser.error("give --socket or --address, not both")
    socket = None if args.address else (args.socket or os.environ.get("ROBUSTD_SOCKET") or DEFAULT_SOCKET)
    if (args.tls_cert or args.tls_key) and not args.tls_ca:
        parser.error("--tls-cert/--tls-key need --tls-ca")
    client = Client(socket, args.address, args.timeout, (args.tls_ca, args.tls_cert, args.tls_key))
    try:
        return _COMMANDS[args.command](client, args)
    except CliError as err:
        output.err(f"robustctl: {err}")  # escaped: the message may quote the server's status details
        return err.code


if __name__ == "__main__":
    sys.exit(main())
