"""`robustctl fleet diagnose` wall time, per phase, for 2, 4 and 6 hosts, healthy and with one slow host.

    .venv/bin/python bench/fleet_diagnose.py [--hosts 2,4,6] [--runs 3] [--size-mb 0.1] [--slow-fraction 0.5]

Root: each host is a real daemon in its own network namespace on one bridge (tests/netns_fabric.py, as
the netns tests build it), gloo on CPU. `healthy`: nothing wrong; `slow`: host 1's link behind an 8 mbit
token bucket in both directions. Each (hosts, scenario) gets a fresh fabric and daemons, then `--runs`
diagnoses (`--tests all_to_all,all_gather --json`); the table shows the p50 of each phase's seconds as
the JSON reports them, the p50 and max of the whole command's wall time (interpreter start included),
and in how many runs the diagnosis said what was injected (healthy: PASS with no suspect; slow: host 1
the only suspect, `kind: host`; n/a with two hosts: their one pair has no median to be slow against, so
only a failure or a hang is found there). Targets on the 2-core machine: 4 hosts healthy <= 60 s, slow
host found <= 120 s.

`--slow-fraction` defaults to the CLI's 0.5. On two cores the pairs of one round compete for the CPU; the
collectives' bandwidth comes from their median iteration on CPU ranks, and a pair slow in its round is
re-tested alone before it is judged (robustd/fleet/rings.py). Healthy pairs here still measure up to 2.05
times apart (the cores set their speed, not the links), so at 0.5 a run can name a healthy link: the
`right` column counts it. The 8 mbit pairs sit at about 0.005 of the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from netns_fabric import Fabric  # noqa: E402

from bench._harness import REPO, BenchDaemon, percentile  # noqa: E402
from checks import BUILTIN  # noqa: E402

SLOW = 1  # the host behind the token bucket
PHASES = ("local", "inter", "pairs")


def daemons(fabric: Fabric, size_mb: float, timeout: str) -> list[BenchDaemon]:
    out: list[BenchDaemon] = []
    try:
        for i in range(len(fabric.hosts)):
            out.append(BenchDaemon({"node_name": f"node-{i}", "checks": {c.name: {"enabled": False} for c in BUILTIN},
                                    "diagnostics": {"collectives": {"size_mb": size_mb, "cpu_ranks": 2,
                                                                    "timeout": timeout}}},
                                   wait=False, wrap=fabric.netns_exec(i)))
        for d in out:
            d.wait_ready()
    except BaseException:
        for d in out:
            d.close()
        raise
    return out


def diagnose(hosts_file: str, slow_fraction: float) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "fleet", "diagnose", "--hosts-file",
                        hosts_file, "--tests", "all_to_all,all_gather", "--slow-fraction", str(slow_fraction),
                        "--timeout", "10m", "--json"], capture_output=True, text=True, timeout=900, cwd=REPO,
                       stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    try:
        return wall, json.loads(r.stdout)
    except ValueError:
        raise SystemExit(f"fleet diagnose exited {r.returncode} without its JSON:\n{r.stdout}\n{r.stderr}") from None


def right(doc: dict[str, Any], hosts: list[str], scenario: str) -> bool | None:
    """Did the diagnosis say what was injected? None: nothing could (two hosts, one slow: a lone pair's
    bandwidth has no median to be slow against)."""
    named = sorted((s["kind"], s["host"]) for s in doc["suspects"])
    if scenario == "healthy":
        return doc["outcome"] == "PASS" and not named
    if len(hosts) == 2:
        return None
    return named == [("host", hosts[SLOW])]


def scenario_runs(n: int, scenario: str, runs: int, size_mb: float, slow_fraction: float,
                  timeout: str) -> list[tuple[float, dict[str, Any]]]:
    with Fabric(n, prefix="rdbf") as fabric:
        nodes = daemons(fabric, size_mb, timeout)
        try:
            if scenario == "slow":
                fabric.slow_host(SLOW)
            hosts_file = nodes[0].dir / "hosts"
            hosts_file.write_text("".join(f"unix:{d.socket} {h.addr}\n"
                                          for d, h in zip(nodes, fabric.hosts, strict=True)))
            hosts = [f"unix:{d.socket}" for d in nodes]
            out = []
            for k in range(runs):
                wall, doc = diagnose(str(hosts_file), slow_fraction)
                phases = {p["name"]: p["seconds"] for p in doc["phases"]}
                named = ", ".join(f"{s['kind']} {hosts.index(s['host']) if s['host'] in hosts else s['host']}"
                                  for s in doc["suspects"]) or "none"
                print(f"  {n} hosts {scenario} run {k + 1}: {wall:.1f} s ("
                      + ", ".join(f"{p} {phases.get(p, 0):.1f}" for p in PHASES)
                      + f"), {doc['outcome']}, suspects: {named}"
                      + ("  <- not what was injected" if right(doc, hosts, scenario) is False else ""), flush=True)
                out.append((wall, {**doc, "right": right(doc, hosts, scenario)}))
            return out
        finally:
            for d in nodes:
                d.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="2,4,6", help="host counts, comma-separated")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--size-mb", type=float, default=0.1, help="diagnostics.collectives.size_mb of every daemon")
    p.add_argument("--slow-fraction", type=float, default=0.5)
    p.add_argument("--collective-timeout", default="20s", help="diagnostics.collectives.timeout")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("fleet diagnose: skipped (needs root for network namespaces and tc)")
        return 0
    counts = [int(x) for x in args.hosts.split(",")]
    rows = []
    for n in counts:
        for scenario in ("healthy", "slow"):
            results = scenario_runs(n, scenario, args.runs, args.size_mb, args.slow_fraction,
                                    args.collective_timeout)
            walls = [w for w, _ in results]
            phase = {name: statistics.median(next((x["seconds"] for x in doc["phases"] if x["name"] == name), 0.0)
                                             for _, doc in results) for name in PHASES}
            said = [doc["right"] for _, doc in results]
            rows.append((n, scenario, phase, percentile(walls, 50), max(walls),
                         "n/a" if None in said else f"{sum(said)}/{len(said)}"))
    print(f"fleet diagnose, {args.size_mb:g} MB per rank and iteration, gloo on CPU, one netns per host, "
          f"--slow-fraction {args.slow_fraction:g}; p50 of {args.runs} runs "
          "(targets: 4 hosts healthy <= 60 s, slow host found <= 120 s)")
    print(f"{'hosts':>5} {'scenario':<8} {'local s':>8} {'inter s':>8} {'pairs s':>8} {'p50 s':>7} {'max s':>7} "
          f"{'right':>6}")
    for n, scenario, phase, p50, top, said in rows:
        print(f"{n:>5} {scenario:<8} {phase['local']:8.1f} {phase['inter']:8.1f} {phase['pairs']:8.1f} "
              f"{p50:7.1f} {top:7.1f} {said:>6}")
    if 2 in counts:
        print("right: runs whose suspects were what was injected; n/a: two hosts, one slow (one pair, no median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
