"""The triage rule file is data that checks itself: every example claimed by its rule, no counter-example,
no benign line claimed by any rule, and a broken file names its line and key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from robustd.triage.model import CLASSES
from robustd.triage.rules import SHIPPED, RuleError, load

GOOD = """
gates: [rror]
classes:
""" + "".join(f"  {c}: {{infra: unknown, next: diagnose, level: eud, priority: 1, description: d}}\n"
              for c in CLASSES) + """
traceback: {not_user_code: [SystemExit], handled_after: 10, source: s}
rules:
  - name: ecc
    class: gpu_hw
    tier: cause
    anchors: [ECC error]
    pattern: 'uncorrectable ECC error'
    description: d
    source: s
    examples: ["RuntimeError: CUDA error: uncorrectable ECC error encountered"]
    counter_examples: ["RuntimeError: CUDA error: an illegal memory access was encountered"]
benign: ["RuntimeError: nothing here"]
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return str(path)


def problems(tmp_path: Path, text: str) -> str:
    with pytest.raises(RuleError) as e:
        load(write(tmp_path, text))
    return str(e.value)


def test_the_shipped_rules_load_and_cover_every_class_and_a_source_each() -> None:
    rules = load(SHIPPED)
    classes = {r.klass for r in rules.rules}
    assert classes >= set(CLASSES) - {"user_code", "unknown"}  # user_code also comes from tracebacks
    raw = yaml.safe_load(Path(SHIPPED).read_text())
    assert all(r["source"].strip() and r["examples"] for r in raw["rules"])
    assert len(raw["benign"]) >= 15


def test_a_good_file_loads(tmp_path: Path) -> None:
    assert [r.name for r in load(write(tmp_path, GOOD)).rules] == ["ecc"]


@pytest.mark.parametrize("change, expect", [
    (("'uncorrectable ECC error'", "'uncorrectable ECC errors'"), ":25: rule ecc: example claimed by no rule"),
    (("an illegal memory access was encountered", "uncorrectable ECC error encountered"),
     ":26: rule ecc: counter-example claimed by it"),
    (("nothing here", "uncorrectable ECC error"), ":27: benign line claimed by rule ecc"),
    (("'uncorrectable ECC error'", "'uncorrectable (ECC error'"), ":18: rules.0 (ecc): bad pattern"),
    (("class: gpu_hw", "class: gpu_broken"), ":19: rules.0.class: unknown class 'gpu_broken'"),
    (("tier: cause", "tier: root"), ":20: rules.0.tier: Input should be"),
    (("gates: [rror]", "gates: [NVLink]"), ":25: rule ecc: example holds none of the gates"),
    (("anchors: [ECC error]", "anchors: [NVLink]"), ":25: rule ecc: example holds none of its anchors"),
    (("    source: s\n", ""), ":18: rules.0.source: required key is missing"),
    (("level: eud, priority: 1", "level: \"eud,burn\", priority: 1"),
     ":4: classes.gpu_hw.level: unknown stop-time test 'burn'"),
])
def test_a_broken_file_names_the_line_and_the_problem(tmp_path: Path, change: tuple[str, str], expect: str) -> None:
    text = GOOD.replace(*change, 1)
    assert text != GOOD
    assert expect in problems(tmp_path, text)


def test_a_key_written_twice_names_both_lines(tmp_path: Path) -> None:
    # YAML keeps the last `pattern` silently: the rule would claim what its author did not read in the file.
    text = GOOD.replace("    pattern:", "    pattern: 'first'\n    pattern:", 1)
    assert text != GOOD
    found = problems(tmp_path, text)
    assert "duplicate key (also at line" in found and ".pattern: duplicate key" in found, found


def test_malformed_yaml_and_a_missing_file(tmp_path: Path) -> None:
    assert "rules.yaml:3: malformed YAML" in problems(tmp_path, "gates: [rror]\nclasses:\n  - : :\n bad")
    with pytest.raises(RuleError, match="cannot read triage rules"):
        load(str(tmp_path / "nope.yaml"))
