"""The inventory of what a job's libraries print (robustd/triage/inventory/*.yaml) against the shipped triage rules:
every message judged a class is claimed, alone in a log, by a rule giving that class (and tier, where the entry
says), every benign one by none, each rendered from its format with plausible values
(checks/rules/triage_inventory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from checks.rules.triage_inventory import INVENTORY_DIR, Entry, judge_line, load, load_all

ENTRIES = load_all()


def test_the_inventory_covers_the_printers_triage_reads() -> None:
    printers = {e.printer for e in ENTRIES}
    assert printers >= {"pytorch_c10d", "nccl", "cuda_runtime", "training_libs"}
    assert len(ENTRIES) >= 60
    assert {e.verdict for e in ENTRIES} >= {"gpu_hw", "cuda", "oom_gpu", "nan", "nccl", "hang", "launcher",
                                            "user_code", "benign"}
    assert all(p.stem == load(p)[0].printer for p in INVENTORY_DIR.glob("*.yaml"))


def test_a_line_renders_in_either_style(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("printer: x\nsources: [s]\nentries:\n"
                    "  - {source: s, prefix: 'p: ', format: 'a %d %lu %s', args: [1, 2, b], verdict: benign, why: w}\n"
                    "  - {source: s, style: python, format: 'a {} {}', args: [1, 2], verdict: nccl, why: w}\n"
                    "  - {source: s, style: python, format: 'a {n}', args: {n: 3}, verdict: hang, tier: symptom, "
                    "why: w}\n")
    assert [e.line for e in load(path)] == ["p: a 1 2 b", "a 1 2", "a 3"]
    path.write_text("printer: x\nsources: [s]\nentries:\n  - {source: s, format: f, verdict: benign, tier: cause, "
                    "why: w}\n")
    with pytest.raises(ValueError, match=r"x.yaml\[0\]"):
        load(path)


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys without a word: an entry's second `verdict:` would silently win."""
    path = tmp_path / "x.yaml"
    path.write_text("printer: x\nsources: [s]\nentries:\n  - source: s\n    format: f\n    verdict: nccl\n"
                    "    verdict: benign\n    why: w\n")
    with pytest.raises(ValueError, match=r"x\.yaml:7: entries\.0\.verdict: duplicate key \(also at line 6\)"):
        load(path)
    path.write_text("printer: x\nsources: [s\nentries: []\n")
    with pytest.raises(ValueError, match=r"x\.yaml:[0-9]+: malformed YAML"):
        load(path)


def _claims(e: Entry) -> list[tuple[str, str, str]]:
    return [(h.klass, h.tier, h.rule) for h in judge_line(e.line)]


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e.where}:{e.verdict}" for e in ENTRIES])
def test_each_message_a_library_prints_is_judged_as_the_inventory_says(entry: Entry) -> None:
    assert "\n" not in entry.line, (entry.where, "one line per entry")
    got = _claims(entry)
    if entry.verdict == "benign":
        assert not got, (entry.line, got, entry.why)
        return
    assert got, (entry.line, "claimed by no rule", entry.why)
    klass, tier, rule = got[0]
    assert klass == entry.verdict and (not entry.tier or tier == entry.tier), (entry.line, got, entry.why)
    # a class is a rule's word on the line; a bare `SomeError:` line (python-exception) is user_code by default
    assert rule != "python-exception" or entry.verdict == "user_code", (entry.line, got)
