"""`robustctl fleet`: fleet analysis that needs no daemon (dual-phase replay planning, warm-standby sizing).

Bad layouts or inputs raise ValueError (robustd.fleet.replay.LayoutError is one); robustctl turns them
into exit 64 with the message on one line of stderr.
"""

from __future__ import annotations

import argparse
import json

from robustd.cli.args import AddGlobals, verbs
from robustd.fleet import replay, standby


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "fleet_command", add_globals)

    def layout(v: argparse.ArgumentParser) -> argparse.ArgumentParser:
        v.add_argument("--machines", type=int, required=True, metavar="N", help="machines in the job")
        v.add_argument("--pp", type=int, required=True, metavar="P", help="pipeline-parallel size (kept)")
        v.add_argument("--k", type=int, required=True, metavar="K", help="DP size of each replay group")
        return v

    layout(verb("replay-plan", "dual-phase replay: the horizontal and vertical groupings "
                               "(m = k*PP machines per group, n = machines/m groups, m <= n)"))
    loc = layout(verb("replay-locate", "dual-phase replay: the machine in both failing groups"))
    loc.add_argument("--failed-horizontal", type=int, required=True, metavar="I", help="failing phase-1 group")
    loc.add_argument("--failed-vertical", type=int, required=True, metavar="J", help="failing phase-2 group")
    s = verb("standby", "warm spares covering a quantile (P99) of a binomial model of daily failures")
    s.add_argument("--machines", type=int, required=True, metavar="N", help="machines in the job")
    s.add_argument("--failure-prob", type=float, required=True, metavar="P",
                   help="per-machine failure probability over the period (e.g. daily)")
    s.add_argument("--quantile", type=float, default=0.99, metavar="Q", help="coverage (default 0.99)")


def run(args: argparse.Namespace) -> int:
    cmd = args.fleet_command
    if cmd == "replay-plan":
        plan = replay.plan(args.machines, args.pp, args.k)
        if args.json:
            print(json.dumps({"m": plan.m, "n": plan.n, "horizontal": [list(g) for g in plan.horizontal],
                              "vertical": [list(g) for g in plan.vertical]}), flush=True)
        else:
            print(_plan_text(plan), flush=True)
        return 0
    if cmd == "replay-locate":
        x = replay.locate(args.machines, args.pp, args.k, args.failed_horizontal, args.failed_vertical)
        if args.json:
            print(json.dumps({"machine": x, "horizontal_group": args.failed_horizontal,
                              "vertical_group": args.failed_vertical}), flush=True)
        else:
            print(f"faulty machine: {x} (in horizontal group {args.failed_horizontal} "
                  f"and vertical group {args.failed_vertical})", flush=True)
        return 0
    s = standby.spares(args.machines, args.failure_prob, args.quantile)
    if args.json:
        print(json.dumps({"spares": s, "machines": args.machines, "failure_prob": args.failure_prob,
                          "quantile": args.quantile}), flush=True)
    else:
        print(f"{s} spares (P{args.quantile * 100:g} of Binomial({args.machines}, {args.failure_prob:g}) "
              f"simultaneous failures)", flush=True)
    return 0


def _plan_text(plan: replay.ReplayPlan) -> str:
    lines = [f"{plan.machines} machines, PP {plan.pp}, k {plan.k}: m = {plan.m} machines per group, "
             f"n = {plan.n} groups per phase",
             "phase 1 (horizontal, machine x in group x // m):"]
    lines += [f"  H{i}: {' '.join(map(str, g))}" for i, g in enumerate(plan.horizontal)]
    lines.append("phase 2 (vertical, machine x in group x mod n):")
    lines += [f"  V{j}: {' '.join(map(str, g))}" for j, g in enumerate(plan.vertical)]
    return "\n".join(lines)
