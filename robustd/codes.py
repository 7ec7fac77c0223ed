"""The meaning of condition codes: severity, action, stickiness, tolerance, hold-down.

Matching never judges: a check says *what* it saw (a code); this table says what that means.
Tables come from rule files (e.g. checks/kernel/rules.yaml `codes:`), then `policy.codes` in
robustd.yaml overrides them key by key. A key ending in `*` covers every code with that prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Mapping

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from robustd.durations import Duration
from robustd.flags import Flag
from robustd.model import Action, Severity


def _enum_by_name(enum_type: type) -> Any:
    def parse(value: Any) -> Any:
        if isinstance(value, enum_type):
            return value
        if isinstance(value, str):
            name = value.strip().upper()
            for prefix in ("SEVERITY_", "ACTION_"):
                name = name.removeprefix(prefix)
            if name in enum_type.__members__:
                return enum_type[name]
        allowed = ", ".join(enum_type.__members__)
        raise ValueError(f"must be one of {allowed}, got {value!r}")

    return BeforeValidator(parse)


SeverityName = Annotated[Severity, _enum_by_name(Severity)]
ActionName = Annotated[Action, _enum_by_name(Action)]


class Tolerate(BaseModel):
    """Stay WARNING until `count` occurrences within `window`, then take the full severity.

    A state (a link that stays down) also takes the full severity once it has lasted
    `persist` (default: the window) without recovering.
    """

    model_config = ConfigDict(extra="forbid")
    count: int = Field(ge=2)
    window: Duration
    persist: Duration | None = None


class CodeRule(BaseModel):
    """The meaning of one code. Unset fields fall through to the next table, then defaults."""

    model_config = ConfigDict(extra="forbid")
    severity: SeverityName | None = None
    action: ActionName | None = None
    sticky: Flag | None = None
    tolerate: Tolerate | None = None
    clear_after: Duration | None = None
    escalate_after_reboots: int | None = Field(default=None, ge=1)
    description: str | None = None


@dataclass(frozen=True)
class Meaning:
    """A code's resolved meaning for one finding."""

    severity: Severity
    action: Action
    sticky: bool
    tolerate: Tolerate | None
    clear_after: float
    escalate_after_reboots: int | None


class CodeTable:
    """Layers of code rules, most specific last; lookups merge field by field."""

    def __init__(self, layers: list[Mapping[str, CodeRule]]):
        self._layers = layers

    def rules_for(self, code: str) -> tuple[list[CodeRule], list[CodeRule]]:
        """(wildcard rules, exact rules) that apply to `code`, each weakest first."""
        wild: list[CodeRule] = []
        exact: list[CodeRule] = []
        for layer in self._layers:
            keys = sorted((k for k in layer if k.endswith("*") and code.startswith(k[:-1])), key=len)
            wild += [layer[k] for k in keys]
            if code in layer:
                exact.append(layer[code])
        return wild, exact

    def resolve(self, code: str, *, hint_severity: Severity | None, hint_action: Action | None,
                default_clear_after: float, default_escalate: int) -> Meaning:
        """Exact entries beat the check's hint (e.g. an SXid's "Fatal"), the hint beats a wildcard."""
        wild, exact = self.rules_for(code)
        merged: dict[str, Any] = {}
        for rule in wild:
            merged.update(_set_fields(rule))
        if hint_severity is not None:
            merged["severity"] = hint_severity
        if hint_action is not None:
            merged["action"] = hint_action
        for rule in exact:
            merged.update(_set_fields(rule))
        severity = merged.get("severity", Severity.WARNING)
        action = merged.get("action", Action.NONE)
        escalate = merged.get("escalate_after_reboots")
        if escalate is None and action in (Action.REBOOT, Action.RESET_GPU):
            escalate = default_escalate
        return Meaning(
            severity=severity,
            action=action,
            sticky=merged.get("sticky", False),
            tolerate=merged.get("tolerate"),
            clear_after=merged.get("clear_after", default_clear_after),
            escalate_after_reboots=escalate,
        )


def _set_fields(rule: CodeRule) -> dict[str, Any]:
    return {k: v for k in type(rule).model_fields if (v := getattr(rule, k)) is not None}


def load_codes(path: str) -> dict[str, CodeRule]:
    """The `codes:` table of a YAML rule file; errors name the file, the code and the line."""
    import yaml
    from pydantic import ValidationError

    from robustd import yamlpos

    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        root, data, problems = yamlpos.load(text, path)
    except yaml.YAMLError as e:
        raise ValueError(yamlpos.malformed(e, path)) from None
    data = data or {}
    out: dict[str, CodeRule] = {}
    for code, rule in (data.get("codes") or {}).items():
        try:
            out[code] = CodeRule.model_validate(rule or {})
        except ValidationError as e:
            at = yamlpos.where(root, ("codes", code), path)
            problems += [f"{at}: codes.{code}.{'.'.join(map(str, err['loc']))}: {err['msg']}"
                         for err in e.errors()]
    if problems:
        raise ValueError("\n".join(problems))
    return out
