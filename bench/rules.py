"""Kernel-rule matcher cost: µs per line over the whole shipped rule set, on a mixed corpus.

The corpus is every example and counter-example of the shipped rule files (multi-line examples as
the window the daemon would hold) plus every line of tests/fixtures/kmsg-benign/*.txt: faults and
the benign lines a healthy GPU host prints. Each line is matched through `RuleSet.match`, as the
kernel check does for every /dev/kmsg line; its cost is the median of `--repeat` runs. Prints
p50/p99/mean over the lines and the worst line with its cost. No root needed.

`--rules FILE ...` times another rule set on the same corpus (e.g. a previous rules.yaml taken
with `git show REV:checks/kernel/rules.yaml`), so a rule change can be compared before/after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import yaml  # noqa: E402
from _harness import percentile  # noqa: E402

from checks.kernel.rules import SHIPPED_RULE_FILES, RuleSet, load_rules  # noqa: E402

BENIGN = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "kmsg-benign"


def corpus() -> list[list[str]]:
    """Windows (oldest line first) whose newest line is the one timed."""
    out: list[list[str]] = []
    for path in SHIPPED_RULE_FILES:
        for rule in yaml.safe_load(Path(path).read_text())["rules"]:
            for ex in rule.get("examples", []) + rule.get("counter_examples", []):
                out.append((ex if isinstance(ex, str) else ex["line"]).rstrip("\n").split("\n"))
    for path in sorted(BENIGN.glob("*.txt")):
        out += [[line] for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return out


def cost_us(rules: RuleSet, window: list[str], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        rules.match(window)
        runs.append(time.perf_counter_ns() - t0)
    return statistics.median(runs) / 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", nargs="+", default=list(SHIPPED_RULE_FILES), help="rule files (default: shipped)")
    ap.add_argument("--repeat", type=int, default=51, help="runs per line; its median is the line's cost")
    args = ap.parse_args()
    rules = load_rules(args.rules)
    windows = corpus()
    for w in windows[:50]:  # warm up the regex caches and the interpreter
        rules.match(w)
    costs = [(cost_us(rules, w, args.repeat), w) for w in windows]
    values = [c for c, _ in costs]
    worst, worst_window = max(costs, key=lambda cw: cw[0])
    print(f"rules: {len(rules.rules)} rules from {', '.join(Path(p).name for p in args.rules)}; "
          f"{len(windows)} corpus lines (rule examples, counter-examples, benign corpus)")
    print(f"  matcher cost per line: p50 {percentile(values, 50):.1f} us  p99 {percentile(values, 99):.1f} us  "
          f"mean {statistics.fmean(values):.1f} us")
    print(f"  worst line {worst:.1f} us: {worst_window[-1][:120]!r}")


if __name__ == "__main__":
    main()
