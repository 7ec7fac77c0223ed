"""`robustctl fleet`: many daemons at once (status, stack aggregation) and fleet planning that needs no
daemon (dual-phase replay, warm-standby sizing).

Bad layouts or inputs raise ValueError (robustd.fleet.replay.LayoutError is one); robustctl turns them
into exit 64 with the message on one line of stderr.

Exit codes of `fleet status`: 2 if any host is CRITICAL, else 3 if any is unreachable, else 1 if any
is WARNING, else 0. Of `fleet stacks`: 0 no outlier, 1 suspects named, 3 no host answered. Of `fleet
diagnose`: robustd/cli/fleet_diagnose.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from robustd.api.v1 import robustd_pb2 as pb
from robustd.cli import output, remote, render, trace
from robustd.cli.args import AddGlobals, positive_duration, verbs
from robustd.cli.client import Client
from robustd.fleet import replay, standby
from robustd.fleet.stacks import Aggregation, Layout, ParallelGroup, aggregate, fail_slow


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "fleet_command", add_globals)

    def layout(v: argparse.ArgumentParser) -> argparse.ArgumentParser:
        v.add_argument("--machines", type=int, required=True, metavar="N", help="machines in the job")
        v.add_argument("--pp", type=int, required=True, metavar="P", help="pipeline-parallel size (kept)")
        v.add_argument("--k", type=int, required=True, metavar="K", help="DP size of each replay group")
        return v

    def hosts(v: argparse.ArgumentParser) -> argparse.ArgumentParser:
        v.add_argument("hosts", nargs="*", metavar="HOST",
                       help="HOST[:PORT] (TCP, port 7070), unix:PATH or /path/to.sock")
        v.add_argument("--hosts-file", metavar="FILE", help="more hosts, one per line (# comments)")
        return v

    from robustd.cli import fleet_diagnose

    fleet_diagnose.add_arguments(verb(
        "diagnose", "the stop-time tests across a job's machines: local tests on each, one all-gather across "
                    "all, then pairs along a ring; names the slow or broken machine, or link", fleet_diagnose.EXAMPLE))
    hosts(verb("status", "every host's verdict in one table (concurrent GetVerdict; unreachable hosts listed)",
               "robustctl fleet status node1 node2:7070 unix:/run/robustd/robustd.sock\n"
               "robustctl fleet status --hosts-file hosts.txt --json"))
    st = hosts(verb("stacks", "capture the training processes' stacks on every host and name the parallel "
                              "group the outlier ranks share",
                    "robustctl fleet stacks --hosts-file hosts.txt --layout tp=8,pp=4,dp=16 --fail-slow"))
    st.add_argument("--layout", required=True, type=parse_layout, metavar="tp=T,pp=P,dp=D[,order=tp-dp-pp]",
                    help="parallel layout; rank order fastest first (Megatron's default tp-dp-pp)")
    st.add_argument("--fail-slow", action="store_true", help="fail-slow mode: 5 rounds 10 s apart, evict the "
                                                              "group flagged most often")
    st.add_argument("--rounds", type=int, default=None, metavar="N", help="rounds (default 1; 5 with --fail-slow)")
    st.add_argument("--interval", type=positive_duration, default=10.0, metavar="DURATION",
                    help="time between rounds (default 10s)")
    st.add_argument("--native", action="store_true", help="include native frames")
    st.add_argument("--capture-timeout", type=positive_duration, default=None, metavar="DURATION",
                    help="per-process py-spy deadline (default: each daemon's tracer.timeout)")
    layout(verb("replay-plan", "dual-phase replay: the horizontal and vertical groupings "
                               "(m = k*PP machines per group, n = machines/m groups, m <= n)",
                "robustctl fleet replay-plan --machines 64 --pp 4 --k 2"))
    loc = layout(verb("replay-locate", "dual-phase replay: the machine in both failing groups",
                      "robustctl fleet replay-locate --machines 64 --pp 4 --k 2 --failed-horizontal 3 "
                      "--failed-vertical 5"))
    loc.add_argument("--failed-horizontal", type=int, required=True, metavar="I", help="failing phase-1 group")
    loc.add_argument("--failed-vertical", type=int, required=True, metavar="J", help="failing phase-2 group")
    s = verb("standby", "warm spares covering a quantile (P99) of a binomial model of daily failures",
             "robustctl fleet standby --machines 1024 --failure-prob 0.001")
    s.add_argument("--machines", type=int, required=True, metavar="N", help="machines in the job")
    s.add_argument("--failure-prob", type=float, required=True, metavar="P",
                   help="per-machine failure probability over the period (e.g. daily)")
    s.add_argument("--quantile", type=float, default=0.99, metavar="Q", help="coverage (default 0.99)")


def run(args: argparse.Namespace) -> int:
    cmd = args.fleet_command
    if cmd == "diagnose":
        from robustd.cli import fleet_diagnose

        return fleet_diagnose.run(args)
    if cmd == "status":
        return _status(args)
    if cmd == "stacks":
        return _stacks(args)
    if cmd == "replay-plan":
        plan = replay.plan(args.machines, args.pp, args.k)
        if args.json:
            output.out(json.dumps({"m": plan.m, "n": plan.n, "horizontal": [list(g) for g in plan.horizontal],
                                   "vertical": [list(g) for g in plan.vertical]}), exact=True)
        else:
            output.out(_plan_text(plan))
        return 0
    if cmd == "replay-locate":
        x = replay.locate(args.machines, args.pp, args.k, args.failed_horizontal, args.failed_vertical)
        if args.json:
            output.out(json.dumps({"machine": x, "horizontal_group": args.failed_horizontal,
                                   "vertical_group": args.failed_vertical}), exact=True)
        else:
            output.out(f"faulty machine: {x} (in horizontal group {args.failed_horizontal} "
                       f"and vertical group {args.failed_vertical})")
        return 0
    s = standby.spares(args.machines, args.failure_prob, args.quantile)
    if args.json:
        output.out(json.dumps({"spares": s, "machines": args.machines, "failure_prob": args.failure_prob,
                               "quantile": args.quantile}), exact=True)
    else:
        output.out(f"{s} spares (P{args.quantile * 100:g} of Binomial({args.machines}, {args.failure_prob:g}) "
                   f"simultaneous failures)")
    return 0


def _plan_text(plan: replay.ReplayPlan) -> str:
    lines = [f"{plan.machines} machines, PP {plan.pp}, k {plan.k}: m = {plan.m} machines per group, "
             f"n = {plan.n} groups per phase",
             "phase 1 (horizontal, machine x in group x // m):"]
    lines += [f"  H{i}: {' '.join(map(str, g))}" for i, g in enumerate(plan.horizontal)]
    lines.append("phase 2 (vertical, machine x in group x mod n):")
    lines += [f"  V{j}: {' '.join(map(str, g))}" for j, g in enumerate(plan.vertical)]
    return "\n".join(lines)


def parse_layout(text: str) -> Layout:
    """`tp=8,pp=4,dp=32[,order=tp-dp-pp]` → Layout (node names come from the hosts' answers)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("tp", "pp", "dp", "order") or key in fields:
            raise argparse.ArgumentTypeError(f"{text!r}: expected tp=T,pp=P,dp=D[,order=...], each once")
        fields[key] = value.strip()
    missing = [k for k in ("tp", "pp", "dp") if k not in fields]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r}: missing {', '.join(missing)}")
    try:
        sizes = {k: int(fields[k]) for k in ("tp", "pp", "dp")}
        return Layout(**sizes, ranks_per_node=1, order=fields.get("order", "tp-dp-pp"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


# ---- fleet status -------------------------------------------------------------------------------

def _status(args: argparse.Namespace) -> int:
    hosts = remote.hosts_from(args.hosts, args.hosts_file)
    start = time.monotonic()
    outcomes = remote.fan_out(hosts, lambda c: c.call("GetVerdict", pb.GetVerdictRequest()), args.timeout,
                              remote.tls_of(args))
    wall = time.monotonic() - start
    if args.json:
        output.out(json.dumps(_status_json(outcomes, wall), indent=2), exact=True)
    else:
        colour = output.use_colour(sys.stdout)
        output.out(status_text(outcomes, wall, output.width(), colour), colour=colour)
    return status_exit(outcomes)


def status_exit(outcomes: list[remote.Outcome[Any]]) -> int:
    sev = [o.value.severity for o in outcomes if o.value is not None]
    if pb.SEVERITY_CRITICAL in sev:
        return 2
    if any(o.value is None for o in outcomes):
        return 3
    return 1 if pb.SEVERITY_WARNING in sev else 0


def _counts(outcomes: list[remote.Outcome[Any]]) -> dict[str, int]:
    counts = {"ok": 0, "warning": 0, "critical": 0, "unreachable": 0, "error": 0}
    for o in outcomes:
        if o.value is None:
            counts["unreachable" if o.unreachable else "error"] += 1
        else:
            key = render.severity_name(o.value.severity).lower()
            counts[key] = counts.get(key, 0) + 1
    return counts


def status_text(outcomes: list[remote.Outcome[Any]], wall: float, width: int | None = render.DEFAULT_WIDTH,
                colour: bool = False) -> str:
    """A summary line, then a row per host; with `colour`, its severity painted as `robustctl status` does."""
    rows = []
    for o in outcomes:
        if o.value is None:
            reason = o.error.split(": ", 1)[1] if o.error.startswith("cannot reach robustd at ") else o.error
            rows.append([o.host, "-", "UNREACHABLE" if o.unreachable else "ERROR", "-", "-", reason])
            continue
        v = o.value
        worst = sorted(v.conditions, key=lambda c: (-c.severity, c.component, c.code))
        summary = ", ".join(f"{c.component} {c.code}" for c in worst) or "-"
        rows.append([o.host, v.node, render.severity_name(v.severity), render.action_name(v.action),
                     str(len(v.conditions)), summary])
    counts = _counts(outcomes)
    head = (f"{render.plural(len(outcomes), 'host')} in {wall:.2f} s: " +
            ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    return head + "\n" + render.table(["HOST", "NODE", "SEVERITY", "ACTION", "CONDITIONS", "WORST"], rows, width,
                                       colour_column=2, colour=colour)


def _status_json(outcomes: list[remote.Outcome[Any]], wall: float) -> dict[str, Any]:
    hosts = []
    for o in outcomes:
        entry: dict[str, Any] = {"host": o.host, "reachable": o.value is not None, "error": o.error,
                                 "seconds": round(o.seconds, 4)}
        if o.value is not None:
            entry.update(render.to_dict(o.value))
        hosts.append(entry)
    return {"hosts": hosts, "summary": _counts(outcomes), "wall_seconds": round(wall, 4)}


# ---- fleet stacks -------------------------------------------------------------------------------

def _stacks(args: argparse.Namespace) -> int:
    hosts = remote.hosts_from(args.hosts, args.hosts_file)
    layout: Layout = args.layout
    rounds = args.rounds if args.rounds is not None else (5 if args.fail_slow else 1)
    if rounds < 1:
        raise ValueError("--rounds must be at least 1")
    req, allowance = trace.request(args.native, args.capture_timeout)
    results: list[dict[str, Any]] = []
    aggs: list[Aggregation] = []
    answered = 0
    for i in range(rounds):
        if i:
            time.sleep(args.interval)
        start = time.monotonic()
        outcomes = remote.fan_out(hosts, lambda c: _capture(c, req, allowance), args.timeout, remote.tls_of(args))
        answers = [(o.host, o.value) for o in outcomes if o.value is not None]
        answered = max(answered, len(answers))
        stacks, host_of, notes = trace.ranks_of(answers)
        bad = sorted(r for r in stacks if r >= layout.world)
        if bad:
            raise ValueError(f"rank {bad[0]} (on {host_of[bad[0]]}) is outside the layout's world of {layout.world}")
        placed = Layout(layout.tp, layout.pp, layout.dp, node_of=lambda r, h=host_of: h.get(r, "?"), order=layout.order)
        agg = aggregate(stacks, placed)
        aggs.append(agg)
        results.append({"agg": agg, "notes": notes, "seconds": time.monotonic() - start,
                        "unreachable": [(o.host, o.error) for o in outcomes if o.value is None]})
        if not args.json:
            output.out(_round_text(i, rounds, agg, results[-1], layout))  # a gone reader: still the verdict's exit
    verdict = fail_slow(aggs) if rounds > 1 else None
    if args.json:
        output.out(json.dumps(_stacks_json(layout, results, verdict), indent=2), exact=True)
    elif verdict is not None:
        output.out(_fail_slow_text(verdict))
    if answered == 0:
        return 3
    flagged = verdict.suspect is not None if verdict is not None else bool(aggs[-1].suspects)
    return 1 if flagged else 0


def _capture(client: Client, req: pb.CaptureRequest, allowance: float) -> pb.CaptureResponse:
    return client.call("CaptureStacks", req, service="Tracer", timeout=client.timeout + allowance)


def _group_text(g: ParallelGroup) -> str:
    return (f"{g.kind} group {g.index}: ranks {_ranks(g.ranks)} on {', '.join(g.machines)} "
            f"({len(g.outliers)} outlier{'s' if len(g.outliers) != 1 else ''})")


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    """`0-3, 8, 10-11`: runs of consecutive ranks."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out) or "none"


def _round_text(i: int, rounds: int, agg: Aggregation, r: dict[str, Any], layout: Layout) -> str:
    captured = sum(len(g.ranks) for g in agg.groups)
    lines = [f"{'round ' + str(i + 1) + '/' + str(rounds) + ': ' if rounds > 1 else ''}"
             f"{captured} of {layout.world} ranks captured in {r['seconds']:.2f} s "
             f"(layout tp={layout.tp} pp={layout.pp} dp={layout.dp}, order {layout.order})"]
    for host, err in r["unreachable"]:
        lines.append(f"  unreachable: {host}: {err}")
    lines += [f"  note: {n}" for n in r["notes"]]
    top = set(agg.groups[0].signature) if agg.groups else set()
    for i, g in enumerate(agg.groups):
        mark = "healthy" if g.healthy else "OUTLIER"
        lines.append(f"  {len(g.ranks):>6} ranks  {mark:<8} {_telling_thread(g.signature, set() if i == 0 else top)}")
        if not g.healthy:
            lines.append(f"                         ranks {_ranks(g.ranks)}")
    if agg.missing:
        lines.append(f"  missing (no stack): ranks {_ranks(agg.missing)}")
    if not agg.suspects:
        lines.append("  no outliers: no suspects")
    else:
        lines.append(f"  SUSPECTS ({agg.suspect_kind}): evict {', '.join(agg.suspect_machines)}")
        lines += [f"    {_group_text(g)}" for g in agg.suspects]
    return render.lines(lines)  # hosts, errors, notes and frames came from the fleet


def _telling_thread(signature: tuple[str, ...], common: set[str]) -> str:
    """The innermost frames of the thread that sets this group apart (else its deepest thread)."""
    own = [t for t in signature if t not in common] or list(signature)
    if not own:
        return "(no stack)"
    thread = max(own, key=lambda t: t.count(";"))
    return " <- ".join(thread.split(";")[:3])


def _fail_slow_text(v: Any) -> str:
    if v.suspect is None:
        return f"fail-slow: no group flagged in {v.rounds} rounds"
    return render.printable(f"fail-slow: {_group_text(v.suspect)} flagged in {v.flags} of {v.rounds} rounds: "
                            f"evict {', '.join(v.suspect.machines)}")


def _group_json(g: ParallelGroup) -> dict[str, Any]:
    return {"kind": g.kind, "index": g.index, "ranks": list(g.ranks), "machines": list(g.machines),
            "outliers": list(g.outliers)}


def _stacks_json(layout: Layout, results: list[dict[str, Any]], verdict: Any) -> dict[str, Any]:
    rounds = []
    for r in results:
        agg: Aggregation = r["agg"]
        rounds.append({
            "seconds": round(r["seconds"], 4),
            "unreachable": [{"host": h, "error": e} for h, e in r["unreachable"]],
            "notes": r["notes"],
            "groups": [{"ranks": list(g.ranks), "healthy": g.healthy, "signature": list(g.signature)}
                       for g in agg.groups],
            "outliers": list(agg.outliers), "missing": list(agg.missing),
            "suspect_kind": agg.suspect_kind, "suspects": [_group_json(g) for g in agg.suspects],
            "suspect_machines": list(agg.suspect_machines),
            "evidence": {k: [_group_json(g) for g in gs] for k, gs in agg.evidence.items()},
        })
    out: dict[str, Any] = {"layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "order": layout.order},
                           "rounds": rounds}
    last = results[-1]["agg"]
    if verdict is not None:
        out["fail_slow"] = {"suspect": _group_json(verdict.suspect) if verdict.suspect else None,
                            "flags": verdict.flags, "rounds": verdict.rounds}
        out["suspect_machines"] = list(verdict.suspect.machines) if verdict.suspect else []
    else:
        out["suspect_machines"] = list(last.suspect_machines)
    return out
