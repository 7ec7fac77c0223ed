"""Triage patterns as data: load, validate and compile `robustd/triage/rules.yaml`.

A rule says what one log line *is*: a class (gpu_hw, nccl, ...), and whether the line names a
root cause (`tier: cause`), a consequence that decides only when no cause is found anywhere
(`symptom`: watchdog timeouts, aborted communicators, a launcher's child-failed summary), or
context that decides only when nothing else does (`context`: Slurm's time-limit banner).

Logs come from outside and can be large, so a rule is found through its `anchors` (literal
substrings, searched with bytes.find over the whole tail: a memchr-speed scan) and only the lines
holding an anchor are matched against its regex (bytes, ASCII). Every example must contain an
anchor and be claimed by its own rule (first rule wins), and no counter-example may be claimed by
any rule: the loader runs both, so a rule file that contradicts its own examples does not load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from robustd import yamlpos
from robustd.config import ConfigError
from robustd.triage.model import CLASSES, INFRA, NEXT
from robustd.yamlpos import where as _where

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when there: the CLI loads this file at every start
SHIPPED = str(Path(__file__).parent / "rules.yaml")
TESTS = ("eud", "all_to_all", "all_gather", "minigpt")  # what a `level` may name, in this order of cost
MAX_LINE = 4096  # bytes of a line matched; a longer line is matched on its head


class RuleError(ConfigError):
    """A triage rule file that cannot be used; each problem reads `file:line: key: message`."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _level(value: str | None) -> str | None:
    if value is None:
        return None
    names = [v.strip() for v in value.split(",")]
    bad = [n for n in names if n not in TESTS]
    if bad or not names:
        raise ValueError(f"unknown stop-time test {bad[0] if bad else value!r} (known: {', '.join(TESTS)})")
    return ",".join(names)


class ClassSpec(_Strict):
    infra: Literal["likely", "unlikely", "unknown"]
    next: Literal["diagnose", "restart", "rollback", "none"]
    level: str | None = None
    priority: int = Field(ge=0, le=1000)
    description: str

    _check_level = field_validator("level")(lambda cls, v: _level(v))


class RuleSpec(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")
    klass: str = Field(alias="class")
    tier: Literal["cause", "symptom", "context"]
    anchors: list[str] = Field(min_length=1, max_length=32)
    pattern: str
    description: str
    source: str
    infra: Literal["likely", "unlikely", "unknown"] | None = None
    next: Literal["diagnose", "restart", "rollback", "none"] | None = None
    level: str | None = None
    priority: int | None = Field(default=None, ge=0, le=1000)
    examples: list[str] = Field(min_length=1)
    counter_examples: list[str] = Field(default_factory=list)

    _check_level = field_validator("level")(lambda cls, v: _level(v))

    @field_validator("klass")
    @classmethod
    def _known_class(cls, value: str) -> str:
        if value not in CLASSES:
            raise ValueError(f"unknown class {value!r} (known: {', '.join(CLASSES)})")
        return value

    @field_validator("anchors")
    @classmethod
    def _ascii(cls, value: list[str]) -> list[str]:
        for a in value:
            if len(a) < 3 or not a.isascii():
                raise ValueError(f"anchor {a!r} must be ASCII and at least 3 characters")
        return value


class TracebackSpec(_Strict):
    """How a Python traceback that no rule explains becomes user_code."""

    not_user_code: list[str]  # exception types (last dotted part) that never mean user code
    handled_after: int = Field(ge=1, le=100_000)  # this many lines of the same rank after it: handled, not fatal
    source: str


class RuleFile(_Strict):
    # Short literals searched over the whole tail (bytes.find: about 0.5 ms per MiB each); only lines
    # holding one are tried against the rules. Every example must hold a gate.
    gates: list[str] = Field(min_length=1, max_length=48)
    classes: dict[str, ClassSpec]
    traceback: TracebackSpec
    rules: list[RuleSpec]
    benign: list[str] = Field(default_factory=list)  # real lines that no rule may claim


@dataclass(frozen=True)
class Rule:
    name: str
    klass: str
    tier: str
    anchors: tuple[bytes, ...]
    regex: re.Pattern[bytes]
    infra: str
    next: str
    level: str | None
    priority: int
    description: str
    index: int  # order in the file: the first rule that claims a line wins


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...]
    classes: dict[str, ClassSpec]
    gates: tuple[bytes, ...]
    not_user_code: frozenset[str]
    handled_after: int

    def claim(self, body: bytes) -> Rule | None:
        """The first rule (in file order) with an anchor in `body` whose pattern matches it."""
        body = body[:MAX_LINE]
        for rule in self.rules:
            if any(a in body for a in rule.anchors) and rule.regex.search(body):
                return rule
        return None


class _Lines:
    """`file:line` of a key in the rule file, from the nodes yamlpos.load composed while reading it."""

    def __init__(self, root: yaml.Node | None, path: str):
        self._root, self.path = root, path

    def __call__(self, *loc: Any) -> str:
        return _where(self._root, loc, self.path)


def _compile(spec: RuleSpec, i: int, classes: dict[str, ClassSpec], lines: _Lines, problems: list[str]) -> Rule | None:
    if spec.klass not in classes:
        problems.append(f"{lines('rules', i)}: rules.{i} ({spec.name}): class {spec.klass!r} has no entry "
                        "under classes:")
        return None
    try:
        regex = re.compile(spec.pattern.encode("ascii"))
    except (re.error, UnicodeEncodeError) as e:
        problems.append(f"{lines('rules', i)}: rules.{i} ({spec.name}): bad pattern: {e}")
        return None
    cls = classes[spec.klass]
    nxt = spec.next or cls.next
    return Rule(name=spec.name, klass=spec.klass, tier=spec.tier, anchors=tuple(a.encode() for a in spec.anchors),
                regex=regex, infra=spec.infra or cls.infra, next=nxt,
                level=(spec.level or cls.level) if nxt == "diagnose" else None,
                priority=cls.priority if spec.priority is None else spec.priority,
                description=spec.description, index=i)


def load(path: str = SHIPPED) -> RuleSet:
    """The rule set in `path`, its examples and counter-examples checked; RuleError lists every problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        root, data, twice = yamlpos.load(text, path)
    except OSError as e:
        raise RuleError([f"{path}: cannot read triage rules: {e.strerror}"]) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise RuleError([f"{path}:{mark.line + 1 if mark else 1}: malformed YAML: {e}"]) from e
    if twice:  # YAML keeps the last one silently: a rule would do what its author did not read in the file
        raise RuleError(twice)
    try:
        spec = RuleFile.model_validate(data)
    except ValidationError as e:
        lines = _Lines(root, path)
        problems = []
        for item in e.errors():
            key = ".".join(str(p) for p in item["loc"])
            msg = {"extra_forbidden": "unknown key", "missing": "required key is missing"}.get(
                item["type"], item["msg"].removeprefix("Value error, "))
            problems.append(f"{lines(*item['loc'])}: {key}: {msg}")
        raise RuleError(problems) from e
    lines = _Lines(root, path)
    problems: list[str] = []
    missing = [c for c in CLASSES if c not in spec.classes]
    if missing:
        problems.append(f"{path}:1: classes: missing {', '.join(missing)}")
    for name, c in spec.classes.items():
        if name not in CLASSES or c.infra not in INFRA or c.next not in NEXT:
            problems.append(f"{lines('classes', name)}: classes.{name}: unknown class")
    rules: list[Rule] = []
    names: set[str] = set()
    for i, r in enumerate(spec.rules):
        if r.name in names:
            problems.append(f"{lines('rules', i)}: rules.{i} ({r.name}): duplicate rule name")
        names.add(r.name)
        compiled = _compile(r, i, spec.classes, lines, problems)
        if compiled:
            rules.append(compiled)
    ruleset = RuleSet(rules=tuple(rules), classes=dict(spec.classes),
                      gates=tuple(g.encode() for g in spec.gates),
                      not_user_code=frozenset(spec.traceback.not_user_code),
                      handled_after=spec.traceback.handled_after)
    if not problems:
        problems += _check_examples(ruleset, spec, lines)
    if problems:
        raise RuleError(problems)
    return ruleset


def _check_examples(rs: RuleSet, spec: RuleFile, lines: _Lines) -> list[str]:
    from robustd.triage.lines import split_prefix  # the judge's own view of a line: prefix stripped

    out = []
    for i, (r, rule) in enumerate(zip(spec.rules, rs.rules, strict=True)):
        for j, ex in enumerate(r.examples):
            body = split_prefix(ex.encode("utf-8", "replace"))[2]
            got = rs.claim(body)
            if not any(a in body for a in rule.anchors):
                out.append(f"{lines('rules', i, 'examples', j)}: rule {r.name}: example holds "
                           f"none of its anchors: {ex!r}")
            elif not any(g in body for g in rs.gates):
                out.append(f"{lines('rules', i, 'examples', j)}: rule {r.name}: example holds "
                           f"none of the gates, so a log would never show it to the rule: {ex!r}")
            elif got is not rule:
                who = f"rule {got.name}" if got else "no rule"
                out.append(f"{lines('rules', i, 'examples', j)}: rule {r.name}: example claimed by "
                           f"{who}: {ex!r}")
        for j, ex in enumerate(r.counter_examples):
            body = split_prefix(ex.encode("utf-8", "replace"))[2]
            if rs.claim(body) is rule:
                out.append(f"{lines('rules', i, 'counter_examples', j)}: rule {r.name}: "
                           f"counter-example claimed by it: {ex!r}")
    for j, ex in enumerate(spec.benign):
        got = rs.claim(split_prefix(ex.encode("utf-8", "replace"))[2])
        if got is not None:
            out.append(f"{lines('benign', j)}: benign line claimed by rule {got.name}: {ex!r}")
    return out


@lru_cache(maxsize=4)
def shipped() -> RuleSet:
    return load(SHIPPED)
