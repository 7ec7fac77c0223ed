"""Kernel-log rules as data: load, validate and match `checks/kernel/rules*.yaml` and an operator's files.

A rule says *what* a line is (a code on a component); the `codes:` table in the same file says
what that code means (severity, action, ...), and the policy applies it. Matching keeps no state:
the caller hands in the last few lines and gets findings for the newest one.

Kernel lines come from outside, so matching is bounded and ASCII-only: every pattern,
shipped or an operator's, is compiled with `re.ASCII` (`\\d` is `[0-9]`, never Arabic-Indic
digits), only the first `MAX_LINE_CHARS` of a line are matched, a code a rule produces must be an
ASCII UPPER_SNAKE token or the rule does not claim the line, and a component is escaped to a
printable-ASCII token (`robustd.bounds.token`) so no control character from a device name reaches
a condition. The raw (clipped) line stays in evidence. A number that goes into a code is written
without its leading zeros (`Xid ...: 079` is `XID_79`, the code the table knows), whatever the line
padded it with; its length stays the one the rule's pattern bounds.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from robustd import yamlpos
from robustd.bounds import MAX_CODE, MAX_COMPONENT, is_token, token
from robustd.codes import ActionName, CodeRule, SeverityName
from robustd.config import ConfigError
from robustd.model import Action, Finding, FindingKind, Severity

SHIPPED_RULES = str(Path(__file__).with_name("rules.yaml"))  # GPUs, NVSwitch, NVLink, PCIe, NICs
# Every shipped rule file, by domain; loaded together before any operator file (which is tried first).
SHIPPED_RULE_FILES = (SHIPPED_RULES, str(Path(__file__).with_name("rules-host.yaml")))

# The kernel keeps at most 1,024 bytes of text per record (PRINTKRB_RECORD_MAX since 6.1, 992 before;
# a longer write to /dev/kmsg fails EINVAL, checked on 6.18), so no real printk line is longer and
# clipping there changes no real match. Longer lines come only from joined continuation fragments
# or forged input; their head is matched and their tail is replaced by a marker, so a rule anchored
# at the line's end cannot match a cut line by accident. This is what bounds the cost of a match.
MAX_LINE_CHARS = 1024

_CODE = re.compile(r"[A-Z][A-Z0-9_]*", re.ASCII)
_CODE_KEY = re.compile(r"[A-Z][A-Z0-9_]*\*?", re.ASCII)
_FLAGS = re.compile(r"\(\?[aiLmsux]+\)")
_UNICODE_FLAG = re.compile(r"(?<!\\)\(\?[aiLmsux]*[uL][aiLmsux]*(?:-[imsx]+)?[:)]")
_UNION_TAGS = {"str", "Example"}  # pydantic puts union members into error locations
_BDF = re.compile(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})(?:\.([0-7]))?")


class RuleError(ConfigError):
    """A rule file that cannot be used; each problem reads `file:line: key.path: message`."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hint(_Strict):
    """Severity/action suggested by a captured group (e.g. an SXid's `Fatal`)."""

    group: str
    match: str
    severity: SeverityName | None = None
    action: ActionName | None = None


class Example(_Strict):
    """A real line (or several, newline-joined) the rule must match, with what it must yield."""

    line: str
    code: str | None = None
    component: str | None = None


class Rule(_Strict):
    name: str | None = None
    code: str | None = None
    pattern: str
    component: str = "host"
    lines: int = Field(default=1, ge=1, le=32)
    message: str = ""
    kind: Literal["occurrence", "resolved"] = "occurrence"
    resolves: str | None = None
    hints: list[Hint] = Field(default_factory=list)
    examples: list[str | Example] = Field(default_factory=list)
    counter_examples: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _kind_fields(self) -> Rule:
        if self.kind == "occurrence" and not self.code:
            raise ValueError("an occurrence rule needs `code`")
        if self.kind == "resolved" and not self.resolves:
            raise ValueError("a resolved rule needs `resolves` (the code it clears)")
        return self


class RuleFile(_Strict):
    codes: dict[str, CodeRule] = Field(default_factory=dict)
    rules: list[Rule] = Field(default_factory=list)


def normalize_bdf(text: str) -> str:
    """`0000:3b:00` / `3b:00.0` / `00000000:3B:00.0` -> `0000:3b:00.0` (NVML/sysfs form)."""
    m = _BDF.fullmatch(text.strip().lower())
    if not m:
        return text.strip().lower()
    domain = int(m.group(1), 16) if m.group(1) else 0
    return f"{domain:04x}:{m.group(2)}:{m.group(3)}.{m.group(4) or '0'}"


def clip_line(line: str) -> str:
    """`line` if it is at most `MAX_LINE_CHARS` long, else its head and a marker, that long in all."""
    if len(line) <= MAX_LINE_CHARS:
        return line
    keep = MAX_LINE_CHARS - len(f"...[{len(line)} more chars]")  # the count never has more digits
    return f"{line[:keep]}...[{len(line) - keep} more chars]"


def _fields(template: str) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}


@functools.cache
def _code_fields(template: str) -> frozenset[str]:
    return frozenset(_fields(template))


def _unpadded(value: str) -> str:
    """`079` -> `79`, `0000` -> `0`: one number, one code. Anything but ASCII digits is left as it is."""
    return (value.lstrip("0") or "0") if value.isascii() and value.isdigit() else value


@dataclass(frozen=True)
class CompiledRule:
    """One rule, ready to match; `where` is `file:line` of its definition."""

    name: str
    code: str  # template; for a resolved rule, the code it resolves
    regex: re.Pattern[str]
    component: str
    lines: int
    message: str
    kind: FindingKind
    hints: tuple[tuple[str, re.Pattern[str], Severity | None, Action | None], ...]
    where: str
    literal: str = ""  # text every match contains (`required_literal`); a line without it is skipped

    def match_text(self, text: str) -> Finding | None:
        """A finding if `text`, the last `lines` lines of a window, matches through its end.

        Each line is clipped to `MAX_LINE_CHARS` and the lines are newline-joined by the caller
        (`RuleSet.first`). A code that comes out as anything but an ASCII UPPER_SNAKE token (a
        captured group the rule did not restrict) means the rule does not describe this line: no
        finding, and the next rule may claim it. A component is made a printable-ASCII token
        instead, because the fault is real even if a device name is odd.
        """
        if self.literal not in text:
            return None
        m = self.regex.search(text)
        if m is None:
            return None
        groups = {k: v for k, v in m.groupdict().items() if v is not None}
        if "bdf" in groups:
            groups["bdf"] = normalize_bdf(groups["bdf"])
        for k in _code_fields(self.code) & groups.keys():  # a number in the code: one spelling (`079` -> `79`)
            groups[k] = _unpadded(groups[k])
        values = {k: groups.get(k, "") for k in self.regex.groupindex}
        severity: Severity | None = None
        action: Action | None = None
        for group, rx, sev, act in self.hints:
            if group in groups and rx.search(groups[group]):
                severity = severity or sev
                action = action or act
        code = self.code.format_map(values)
        if not (code.isascii() and len(code) <= MAX_CODE and _CODE.fullmatch(code.upper())):
            return None
        return Finding(
            component=token(self.component.format_map(values), MAX_COMPONENT),
            code=code.upper(),
            message=self.message.format_map(values) if self.message else text,
            evidence={**groups, "line": text, "rule": self.name},
            kind=self.kind,
            severity=severity,
            action=action,
        )


@dataclass(frozen=True)
class RuleSet:
    """Compiled rules in match order, and the merged meaning table of their codes."""

    rules: tuple[CompiledRule, ...]
    codes: Mapping[str, CodeRule]
    sources: tuple[str, ...] = ()

    @property
    def max_lines(self) -> int:
        return max((r.lines for r in self.rules), default=1)

    def match(self, window: Sequence[str]) -> list[Finding]:
        """Findings for the newest line of `window` (oldest first); the first matching rule wins."""
        hit = self.first(window)
        return [hit[1]] if hit else []

    def first(self, window: Sequence[str]) -> tuple[CompiledRule, Finding] | None:
        """The rule that claims the newest line of `window`, and its finding."""
        window = window if isinstance(window, (list, tuple)) else list(window)  # a deque cannot slice
        texts: dict[int, str] = {}  # the clipped, joined last n lines, made once for all rules of n lines
        for rule in self.rules:
            if len(window) < rule.lines:
                continue
            text = texts.get(rule.lines)
            if text is None:
                text = texts[rule.lines] = "\n".join(clip_line(line) for line in window[-rule.lines:])
            found = rule.match_text(text)
            if found is not None:
                return rule, found
        return None


def load_rules(paths: Iterable[str], *, verify: bool = True) -> RuleSet:
    """Load rule files in order; later files' codes override earlier ones field by field, and their
    rules are tried first (so an operator's file can refine a shipped match). With `verify`,
    within each file every example must be claimed first by its own rule, and no
    counter-example by it."""
    problems: list[str] = []
    per_file: list[list[_Pending]] = []
    codes: dict[str, CodeRule] = {}
    sources: list[str] = []
    names: set[str] = set()
    for path in paths:
        sources.append(path)
        parsed = _load_file(path, problems)
        if parsed is None:
            continue
        data, root = parsed
        for key, meaning in data.codes.items():
            codes[key] = _merge_code(codes.get(key), meaning)
        for key in data.codes:
            if not _CODE_KEY.fullmatch(key):
                problems.append(f"{yamlpos.where(root, ('codes', key), path)}: codes.{key}: "
                                f"codes are UPPER_SNAKE, optionally ending in '*'")
        pending: list[_Pending] = []
        for i, rule in enumerate(data.rules):
            c = _compile(rule, i, path, root, problems, names)
            if c is not None:
                pending.append(_Pending(c, rule, i, path, root))
        per_file.append(pending)
    ruleset = RuleSet(rules=tuple(p.compiled for pending in reversed(per_file) for p in pending),
                      codes=codes, sources=tuple(sources))
    if verify and not problems:
        for pending in per_file:  # each file's order is checked on its own: overrides are intended
            own = RuleSet(rules=tuple(p.compiled for p in pending), codes={})
            for p in pending:
                problems += _verify(own, p)
    if problems:
        raise RuleError(problems)
    return ruleset


@functools.cache
def shipped_rules() -> RuleSet:
    """The shipped rule files, loaded and verified once per process (they do not change while it runs):
    the kernel check without extra rule files, and the Xid table (checks/kernel/xid.py), read this.
    Its code table is read-only: every reader shares it."""
    rs = load_rules(SHIPPED_RULE_FILES)
    return replace(rs, codes=MappingProxyType(dict(rs.codes)))


def _merge_code(old: CodeRule | None, new: CodeRule) -> CodeRule:
    """A later file's entry overrides the fields it sets and keeps the rest."""
    if old is None:
        return new
    return CodeRule.model_validate({**old.model_dump(exclude_none=True), **new.model_dump(exclude_none=True)})


def _load_file(path: str, problems: list[str]) -> tuple[RuleFile, yaml.Node | None] | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        problems.append(f"{path}: cannot read rule file: {e.strerror}")
        return None
    try:
        root, data, twice = yamlpos.load(text, path)
    except yaml.YAMLError as e:
        problems.append(yamlpos.malformed(e, path))
        return None
    if twice:
        problems += twice
        return None
    data = data or {}
    try:
        return RuleFile.model_validate(data), root
    except ValidationError as e:
        for item in e.errors():
            loc = tuple(p for p in item["loc"] if p not in _UNION_TAGS)
            key = ".".join(str(p) for p in loc) or "(top level)"
            msg = {"extra_forbidden": "unknown key", "missing": "required key is missing"}.get(
                item["type"], item["msg"].removeprefix("Value error, "))
            problems.append(f"{yamlpos.where(root, loc, path)}: {key}: {msg}")
        return None


def _compile(rule: Rule, i: int, path: str, root: yaml.Node | None,
             problems: list[str], names: set[str]) -> CompiledRule | None:
    name = rule.name or rule.code or f"resolve {rule.resolves}"
    name = name if name not in names else f"{name}#{i}"
    names.add(name)
    at = f"{yamlpos.where(root, ('rules', i), path)}: rules.{i} ({name})"
    if _UNICODE_FLAG.search(rule.pattern):
        problems.append(f"{yamlpos.where(root, ('rules', i, 'pattern'), path)}: rules.{i}.pattern: "
                        f"rule {name}: the u and L flags are not allowed; kernel rules match ASCII only")
        return None
    try:
        flags = _FLAGS.match(rule.pattern)  # global flags must stay in front of the wrapper
        lead = flags.group(0) if flags else ""
        regex = re.compile(f"{lead}(?:{rule.pattern[len(lead):]})[ \\t]*\\Z", re.ASCII)
    except (re.error, ValueError) as e:
        problems.append(f"{yamlpos.where(root, ('rules', i, 'pattern'), path)}: rules.{i}.pattern: "
                        f"bad regex in rule {name}: {e}")
        return None
    groups = set(regex.groupindex)
    code = rule.resolves if rule.kind == "resolved" else rule.code
    assert code is not None
    ok = True
    for key, template in (("code", code), ("component", rule.component), ("message", rule.message)):
        try:
            missing = _fields(template) - groups
        except ValueError as e:
            problems.append(f"{at}: {key}: bad template {template!r}: {e}")
            ok = False
            continue
        if missing:
            problems.append(f"{at}: {key}: {template!r} names groups the pattern lacks: {sorted(missing)}")
            ok = False
    if not _CODE.fullmatch(re.sub(r"\{[^}]*\}", "X", code)):
        problems.append(f"{at}: code: {code!r} is not UPPER_SNAKE")
        ok = False
    literal = re.sub(r"\{[^}]*\}", "", rule.component)
    if not is_token(literal, MAX_COMPONENT):
        problems.append(f"{at}: component: {rule.component!r} must be printable ASCII without spaces")
        ok = False
    hints = []
    for j, h in enumerate(rule.hints):
        if h.group not in groups:
            problems.append(f"{at}: hints.{j}.group: the pattern has no group {h.group!r}")
            ok = False
            continue
        try:
            hints.append((h.group, re.compile(h.match, re.ASCII), h.severity, h.action))
        except (re.error, ValueError) as e:
            problems.append(f"{at}: hints.{j}.match: bad regex: {e}")
            ok = False
    if not ok:
        return None
    kind = FindingKind.RESOLVED if rule.kind == "resolved" else FindingKind.OCCURRENCE
    return CompiledRule(name=name, code=code, regex=regex, component=rule.component, lines=rule.lines,
                        message=rule.message, kind=kind, hints=tuple(hints), where=at,
                        literal=required_literal(regex))


def required_literal(regex: re.Pattern[str]) -> str:
    """The longest run of literal characters that every match of `regex` contains, or "".

    A line without it cannot match, so the matcher skips the regex search with one substring test:
    with dozens of rules most of a line's cost was searches that could never succeed. Only what is
    certain counts: literals outside any branch, optional part, lookaround or case-insensitive
    part. Anything this cannot read (another Python's parser) gives "", which skips nothing.
    """
    try:
        from re import _constants as c
        from re import _parser

        parsed = _parser.parse(regex.pattern, regex.flags)
    except Exception:  # noqa: BLE001 - a private module; without it the prefilter is off, not wrong
        return ""
    if parsed.state.flags & re.IGNORECASE:
        return ""
    repeats = {c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)}
    runs: list[str] = []

    def walk(items: Any) -> None:
        run: list[str] = []
        for op, av in items:
            if op is c.LITERAL:
                run.append(chr(av))
                continue
            runs.append("".join(run))
            run = []
            if op is c.SUBPATTERN and not av[1] & re.IGNORECASE:  # (group, add_flags, del_flags, items)
                walk(av[3])
            elif op in repeats and av[0] >= 1:  # (min, max, items): present at least once
                walk(av[2])
            elif op is getattr(c, "ATOMIC_GROUP", None):
                walk(av)
        runs.append("".join(run))

    walk(parsed)
    return max(runs, key=len, default="")


@dataclass(frozen=True)
class _Pending:
    compiled: CompiledRule
    rule: Rule
    index: int
    path: str
    root: yaml.Node | None


def _verify(rs: RuleSet, p: _Pending) -> list[str]:
    """Examples must be claimed by this rule (first match wins); counter-examples must not."""
    out = []
    c = p.compiled
    for j, ex in enumerate(p.rule.examples):
        e = Example(line=ex) if isinstance(ex, str) else ex
        where = f"{yamlpos.where(p.root, ('rules', p.index, 'examples', j), p.path)}: rule {c.name}"
        hit = rs.first(e.line.rstrip("\n").split("\n"))
        if hit is None:
            out.append(f"{where}: example matches no rule: {e.line!r}")
        elif hit[0] is not c:
            out.append(f"{where}: example is claimed first by rule {hit[0].name} ({hit[0].where}): {e.line!r}")
        elif e.code and hit[1].code != e.code:
            out.append(f"{where}: example gave code {hit[1].code}, expected {e.code}")
        elif e.component and hit[1].component != e.component:
            out.append(f"{where}: example gave component {hit[1].component}, expected {e.component}")
    for j, line in enumerate(p.rule.counter_examples):
        hit = rs.first(line.rstrip("\n").split("\n"))
        if hit is not None and hit[0] is c:
            where = yamlpos.where(p.root, ("rules", p.index, "counter_examples", j), p.path)
            out.append(f"{where}: rule {c.name}: counter-example matches: {line!r}")
    return out
