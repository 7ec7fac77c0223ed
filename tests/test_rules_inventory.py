"""The inventory of what drivers print (checks/rules/inventory/*.yaml) against the shipped kernel rules: every
message format judged a fault is claimed by a rule giving its code, every one judged benign by none, each
rendered from its format with plausible values (checks/rules/inventory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from checks.kernel.rules import SHIPPED_RULE_FILES, RuleSet, load_rules
from checks.rules.inventory import Entry, FormatError, load, load_all, render
from robustd.model import FindingKind

ENTRIES = [e for inv in load_all() for e in inv.entries]


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules(SHIPPED_RULE_FILES)


def test_render_prints_c_formats_as_the_kernel_does() -> None:
    assert render("mlx5_cmd_out_err:%d:(pid %d): %s(0x%x) op_mod(0x%x) failed, status %s(0x%x), "
                  "syndrome (0x%x), err(%d)\n", [838, 1234, "TEARDOWN_HCA", 0x103, 0, "bad resource", 5,
                                                 0x5A4F, -5]) == (
        "mlx5_cmd_out_err:838:(pid 1234): TEARDOWN_HCA(0x103) op_mod(0x0) failed, status bad resource(0x5), "
        "syndrome (0x5a4f), err(-5)\n")
    assert render("%llu pages %zu %lx %5.2s|%-4d|%04X %pI4 %pV %% %c", ["12", 7, 255, "abc", 3, 0xbeef,
                                                                    "10.0.0.1", "inner", "yes"]) == \
        "12 pages 7 ff    ab|3   |BEEF 10.0.0.1 inner % y"
    assert render("%*d|%.*s", [4, 7, 2, "xyz"]) == "   7|xy"
    # The alternate forms as lib/vsprintf.c number() prints them: base 16 always gets its 0x, even for 0
    # (ISO C would print "0"; the kernel's RCU stall line reads "f0x0"), octal gets one leading 0.
    assert render("f%#x %#llx %#X %#06x %#x", [0, 0, 0, 0, 0x402]) == "f0x0 0x0 0X0 0x0000 0x402"
    assert render("%#o|%#o|%#5o|%#.4o", [0, 8, 8, 8]) == "0|010|  010|0010"
    with pytest.raises(FormatError, match="no value"):
        render("%s %s", ["one"])
    with pytest.raises(FormatError, match="left over"):
        render("%s", ["one", "two"])
    with pytest.raises(FormatError, match="takes a number"):
        render("%d", ["many"])


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys without a word: an entry's second `verdict:` would silently win,
    and the test below would hold the rules to a verdict nobody meant."""
    path = tmp_path / "x.yaml"
    path.write_text("subsystem: x\nsources: [s]\nentries:\n  - source: s\n    level: err\n    format: f\n"
                    "    verdict: fault\n    code: X\n    verdict: benign\n    why: w\n")
    with pytest.raises(ValueError, match=r"x\.yaml:9: entries\.0\.verdict: duplicate key \(also at line 7\)"):
        load(path)
    path.write_text("subsystem: x\nsources: [s\nentries: []\n")
    with pytest.raises(ValueError, match=r"x\.yaml:[0-9]+: malformed YAML"):
        load(path)


def _claims(rules: RuleSet, e: Entry) -> list[tuple[str, FindingKind]]:
    return [(f.code, f.kind) for f in rules.match([e.line])]


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e.where}:{e.code or 'benign'}" for e in ENTRIES])
def test_each_message_a_driver_prints_is_judged_as_the_inventory_says(rules: RuleSet, entry: Entry) -> None:
    got = _claims(rules, entry)
    if entry.verdict == "benign":
        assert all(kind is FindingKind.RESOLVED for _code, kind in got), (entry.line, got, entry.why)
    elif entry.verdict == "resolved":
        assert got and got[0] == (entry.code, FindingKind.RESOLVED), (entry.line, got)
    else:
        assert got and got[0][0] == entry.code and got[0][1] is not FindingKind.RESOLVED, (entry.line, got)
