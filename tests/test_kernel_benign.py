"""Benign kernel lines from healthy GPU hosts raise nothing (issue 12).

tests/fixtures/kmsg-benign/*.txt hold real lines (driver banners, NIC and PCIe port init, link up,
corrected-error detail lines, ...) with their sources. A healthy host prints them every boot; a
rule that claims one would drain healthy nodes. Blank lines and `#` lines are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import bdf, inject_kmsg, need_root

from checks.kernel.rules import SHIPPED_RULE_FILES, RuleSet, load_rules
from robustd.api.v1 import robustd_pb2 as pb
from robustd.model import FindingKind

CORPUS_DIR = Path(__file__).parent / "fixtures" / "kmsg-benign"


def corpus() -> list[tuple[str, str]]:
    """(file name, line) for every line of every corpus file, in file order."""
    out = []
    for path in sorted(CORPUS_DIR.glob("*.txt")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                out.append((path.name, line))
    return out


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules(SHIPPED_RULE_FILES)


def test_corpus_is_there() -> None:
    files = {name for name, _ in corpus()}
    assert "devices.txt" in files
    assert sum(1 for name, _ in corpus() if name == "devices.txt") >= 40


def test_no_shipped_rule_raises_a_benign_line(rules: RuleSet) -> None:
    """Each line alone, and the corpus as one stream (so multi-line rules see their neighbours): no
    rule may make an occurrence of it. A line that resolves a fault ("Link up") only clears one."""
    raised = []
    window: list[str] = []
    for name, line in corpus():
        window = (window + [line])[-rules.max_lines:]
        for lines in ([line], window):
            raised += [(name, line, f.code, f.evidence["rule"]) for f in rules.match(lines)
                       if f.kind is not FindingKind.RESOLVED]
    assert not raised, raised


def test_benign_corpus_raises_nothing_through_the_daemon(make_daemon) -> None:
    """Every line written to the real /dev/kmsg, then a sentinel Xid the rules do match: once the daemon
    has raised the sentinel it has read every line before it, and none of them may stand as a condition.
    The kernel log is shared with whatever else runs on this host, so a condition counts against the
    corpus when its evidence is a corpus line; check/* (e.g. a truthful KMSG_OVERRUN) is not a fault."""
    need_root("writing /dev/kmsg")
    d = make_daemon()
    d.start()
    lines = [line for _, line in corpus()]
    bus = bdf()
    sentinel = f"NVRM: Xid (PCI:{bus}): 13, pid=1, name=benign-sentinel, Graphics Exception: ESR 0x0=0x0"
    inject_kmsg(*lines, sentinel)
    v = d.wait_for(lambda v: any(c.component == f"gpu/{bus}.0" and c.code == "XID_13" for c in v.conditions),
                   timeout=30)
    ours = {line.rstrip() for line in lines}
    raised = [(c.component, c.code, c.evidence.get("line", "")) for c in v.conditions
              if not c.component.startswith("check/") and c.component != f"gpu/{bus}.0"
              and any(part.rstrip() in ours for part in c.evidence.get("line", "").split("\n"))]
    assert not raised, raised
    assert v.severity in (pb.SEVERITY_WARNING, pb.SEVERITY_CRITICAL)  # the sentinel counted: the verdict is live
