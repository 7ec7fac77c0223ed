"""The table of stop-time tests is the one list: every entry has its child, its config section and its codes."""

from __future__ import annotations

import importlib.util

from robustd.codes import CodeTable
from robustd.config import DiagnosticsConfig
from robustd.diagnostics import table


def test_every_entry_names_a_child_a_section_and_the_codes_its_fails_raise() -> None:
    cfg = DiagnosticsConfig()
    codes = CodeTable([table.codes()])
    for name, test in table.TESTS.items():
        assert test.name == name and test.module == f"stoptests.{name}"
        assert importlib.util.find_spec(test.module) is not None, test.module
        assert getattr(cfg, test.section).timeout > 0, test.section
        assert any(codes.rules_for(test.failed_code)), test.failed_code
    for level, tests in cfg.levels.items():
        assert set(tests) <= set(table.TESTS), level
