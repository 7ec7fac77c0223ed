"""The kernel check's settings (`checks.kernel` in robustd.yaml: the look-back, extra rule files, and the kmsg
path's older key, which the loader folds into roots.kmsg)."""

from __future__ import annotations

from pydantic import Field, field_validator

from checks.kernel.rules import SHIPPED_RULE_FILES, RuleError, load_rules
from robustd.check import CheckConfig
from robustd.durations import Duration
from robustd.paths import AbsPath
from robustd.roots import DEFAULT_KMSG


class KernelConfig(CheckConfig):
    """`checks.kernel`."""

    root_aliases = {"kmsg_path": "kmsg"}

    kmsg_path: AbsPath = DEFAULT_KMSG  # an older name for roots.kmsg, folded into it at load
    lookback: Duration = 300.0  # backlog of this boot scanned when there is no cursor for it
    rules: list[AbsPath] = Field(default_factory=list)  # extra rule files, tried before the shipped one
    buffer_lines: int = Field(default=8, ge=1, le=256)  # ring buffer for multi-line rules

    @field_validator("rules")
    @classmethod
    def _rules_load(cls, paths: list[str]) -> list[str]:
        """A bad extra rule file is a config error (so a reload with one is rejected whole)."""
        if paths:
            try:
                load_rules([*SHIPPED_RULE_FILES, *paths])
            except RuleError as e:
                raise ValueError("; ".join(e.problems)) from e
        return paths
