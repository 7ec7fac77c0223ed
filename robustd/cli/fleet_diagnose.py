"""`robustctl fleet diagnose`: the stop-time hierarchy across a job's machines (robustd/fleet/diagnose.py),
with a progress line per phase on stderr and a table, or one JSON object, on stdout.

Exit codes: 0 PASS, 1 suspects named (a host or a link), 3 no suspect but hosts that did not answer,
4 the diagnosis could not run (in full), 64 usage. Ctrl-C cancels every run it started and exits 130;
SIGTERM (a scheduler's time limit) does the same and exits 143.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from robustd.cli import output, remote, render, signals
from robustd.cli.args import positive_duration, whole_number
from robustd.cli.diag import test_list
from robustd.durations import format_duration
from robustd.fleet.diagnose import DEFAULT_PORT, DEFAULT_TIMEOUT, Diagnosis, PhaseProgress, diagnose, parse_target

EXAMPLE = ("robustctl fleet diagnose node1 node2 node3 node4 --level quick\n"
           "robustctl fleet diagnose --hosts-file hosts.txt --tests all_to_all --timeout 10m --json")


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("hosts", nargs="*", metavar="HOST",
                   help="HOST[:PORT] (TCP, port 7070), unix:PATH or /path/to.sock")
    v.add_argument("--hosts-file", metavar="FILE",
                   help="more hosts, `HOST [ADDR]` a line (ADDR: where the other hosts reach it for the "
                        "collectives; default: a TCP HOST's host part, 127.0.0.1 for a Unix socket)")
    g = v.add_mutually_exclusive_group()
    g.add_argument("--level", help="the local tests: a named list from the daemons' config (quick, standard, full)")
    g.add_argument("--tests", type=test_list, metavar="T,...", help="the local tests, comma-separated "
                   "(all_gather is the collectives' own; default: what `diag run` runs)")
    v.add_argument("--port", type=whole_number(1), default=DEFAULT_PORT, metavar="N",
                   help=f"first rendezvous port; each collective takes the next (default {DEFAULT_PORT})")
    # After the verb --timeout bounds the whole diagnosis (it replaces the global option there); robustctl's
    # --timeout before the verb stays each unary request's deadline (GetVerdict, Cancel, List).
    options = v._optionals  # argparse keeps the conflict rule per group; "resolve" drops the global --timeout
    options.conflict_handler = "resolve"
    v.add_argument("--timeout", dest="diagnose_timeout", type=lambda s: positive_duration(s, "--timeout"),
                   default=DEFAULT_TIMEOUT, metavar="DURATION",
                   help=f"the whole diagnosis, every phase a share of it (default {format_duration(DEFAULT_TIMEOUT)})")
    options.conflict_handler = "error"
    v.add_argument("--slow-fraction", type=_fraction, default=0.5, metavar="F",
                   help="a pair below F times the median pair's bus bandwidth is bad (default 0.5)")
    v.add_argument("--no-pairs", action="store_true", help="skip the pairs: a quick pass/fail that may not "
                   "tell a slow machine from its peers")
    v.add_argument("--test-faults", action="append", default=[], metavar="HOST=JSON",
                   help="tests only: RunRequest.test_faults_json for HOST (its daemon must set "
                        "diagnostics.test_faults)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 and at most 1")
    return value


def targets_of(args: argparse.Namespace) -> list[Any]:
    entries = [(h, None) for h in args.hosts] + (remote.read_entries(args.hosts_file) if args.hosts_file else [])
    seen: dict[str, str | None] = {}
    for host, addr in entries:
        if host in seen and addr is not None and seen[host] not in (None, addr):
            raise ValueError(f"host {host} is given twice with different addresses")
        seen[host] = addr if addr is not None else seen.get(host)
    return [parse_target(h, a) for h, a in seen.items()]


def faults_of(args: argparse.Namespace) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in args.test_faults:
        host, sep, text = item.partition("=")
        if not sep or not host:
            raise ValueError(f"--test-faults {item!r}: expected HOST=JSON")
        try:
            if not isinstance(json.loads(text), dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise ValueError(f"--test-faults {host}: {e}") from None
        out[host] = text
    return out


def run(args: argparse.Namespace) -> int:
    targets = targets_of(args)
    faults = faults_of(args)
    if unknown := sorted(set(faults) - {t.host for t in targets}):
        raise ValueError(f"--test-faults names {unknown[0]}, which is not one of the hosts")
    live = Live(sys.stderr.isatty())
    signal.signal(signal.SIGTERM, signals.stop)  # robustctl's main() puts the previous handler back
    try:
        d = diagnose(targets, level=args.level, tests=args.tests, port=args.port, timeout=args.diagnose_timeout,
                     slow_fraction=args.slow_fraction, pairs=not args.no_pairs, request_timeout=args.timeout,
                     tls=remote.tls_of(args), progress=live.show, test_faults=faults)
    except (KeyboardInterrupt, signals.Terminated) as e:
        live.end()
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated (SIGTERM)"
        output.err(f"robustctl: fleet diagnose {why}: every run it started was cancelled")
        if isinstance(e, KeyboardInterrupt):
            raise
        return signals.EXIT_TERMINATED
    live.end()
    if args.json:
        output.out(json.dumps(d.to_json(), indent=2), exact=True)
    else:
        output.out(text(d, output.width()))
    return d.exit_code


class Live:
    """The phases on stderr: on a terminal one line redrawn every second; in a pipe or a log a line when a phase
    starts and ends and one every 30 s while it runs."""

    def __init__(self, tty: bool, clock: Any = time.monotonic):
        self.tty = tty
        self.clock = clock
        self.last = 0.0
        self.open = False  # a redrawn line is on the terminal

    def show(self, p: PhaseProgress) -> None:
        where = f"{p.phase}" + (f" round {p.round}/{p.rounds}" if p.rounds and p.round else "")
        if p.state == "started":
            self._line(f"{p.phase}: started" + (f" on {render.plural(p.total, 'host')}" if p.total else
                                                f", {render.plural(p.rounds, 'round')}" if p.rounds else ""),
                       final=True)
            self.last = self.clock()
        elif p.state == "running":
            now = self.clock()
            if self.tty or now - self.last >= 30:
                self.last = now
                self._line(f"{where}: {p.done}/{p.total} runs done, {format_duration(int(p.seconds))}",
                           final=not self.tty)
        else:
            self._line(f"{p.phase}: {p.outcome} after {p.seconds:.1f} s", final=True)

    def _line(self, line: str, final: bool) -> None:
        if self.tty and not final:
            output.err(f"{line[:120]:<120}", end="", cr=True)
            self.open = True
            return
        output.err(f"{line:<120}".rstrip() if self.tty else line, cr=self.tty)
        self.open = False

    def end(self) -> None:
        if self.open:
            output.err("")
            self.open = False


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} GB/s"


def text(d: Diagnosis, width: int | None = render.DEFAULT_WIDTH) -> str:
    """The table: a row per host (its phases, bandwidth, verdict, reason), then the suspects and notes."""
    by_host: dict[str, tuple[str, str]] = {}
    for s in d.suspects:
        if s.kind == "link":
            for h in (s.host, *s.peers):
                by_host.setdefault(h, ("LINK", s.reason))
        else:
            by_host.setdefault(s.host, ("SUSPECT" if s.kind == "host" else "UNREACHABLE", s.reason))
    rows = []
    for h in d.hosts:
        verdict, reason = by_host.get(h.host, ("ERROR", "; ".join(h.notes)) if h.notes else ("OK", "-"))
        rows.append([h.host, h.addr, h.local, h.inter, h.pairs, _gbps(h.busbw_gbps), verdict, reason])
    phases = ", ".join(f"{p.name} {p.outcome}" + (f" {p.seconds:.1f} s" if p.outcome != "SKIPPED" else "")
                       for p in d.phases)
    named = [s for s in d.suspects if s.kind != "unreachable"]
    gone = len(d.suspects) - len(named)
    head = (f"fleet diagnose {d.run_id}: {d.outcome} in {d.seconds:.1f} s ({phases}); "
            + (f"{render.plural(len(named), 'suspect')}" if named else "no suspects")
            + (f", {gone} unreachable" if gone else ""))
    out = head + "\n" + render.table(["HOST", "ADDR", "LOCAL", "INTER", "PAIRS", "BUSBW", "VERDICT", "REASON"],
                                     rows, width)
    if named:
        out += "\n\nsuspects:\n" + render.lines(
            f"  {s.kind} {s.host}" + (f" - {', '.join(s.peers)}" if s.kind == "link" else "") + f": {s.reason}"
            for s in named)
    if d.notes:
        out += "\n\nnotes:\n" + render.lines(f"  {n}" for n in d.notes)
    return out
