"""The inventory of kernel-log messages: every message format a subsystem robustd claims can print, read from
the source that prints it, with robustd's verdict on it.

The rules (checks/kernel/rules*.yaml) are written from real lines, one at a time; on their own they know the
lines someone once saw. The inventory is the other half: for each subsystem (a file
`checks/rules/inventory/<subsystem>.yaml`), one entry per message format of warning level or worse in the
driver's or the kernel's own source, with the verdict — `fault` (with the code a rule must give), `resolved`
(a rule must clear something with it) or `benign` (no rule may claim it, with why). tests/test_rules_inventory.py
renders each format with plausible values into a line and checks the shipped rules against the verdict, so a
message nobody has seen in a real log yet is still judged, and a rule that starts claiming a benign message
is caught.

A file:

    subsystem: bonding
    sources: ["torvalds/linux drivers/net/bonding/bond_main.c (v6.12)"]
    entries:
      - source: drivers/net/bonding/bond_main.c bond_miimon_commit
        level: info                      # the printk level the source prints it at
        prefix: "bond0: (slave eth1): "  # what the printing macro adds (netdev_*, dev_*, pr_fmt)
        format: "link status definitely down, disabling slave\\n"
        args: []                         # plausible values for the conversions, in order
        verdict: fault                   # fault | resolved | benign
        code: BOND_SLAVE_DOWN            # fault/resolved: the code the rule gives (or clears)
        why: "a bond member lost its link: the bond runs degraded"

Formats are C printf formats as the kernel reads them: flags, width, precision, the length modifiers
(hh, h, l, ll, z, t, j) and the kernel's %p extensions (%pV, %pI4, %pM, %pS, ...: each takes one value,
printed as given). `%#x` of 0 is "0x0": the kernel's vsprintf (lib/vsprintf.c number()) always writes the
0x of base 16, unlike ISO C's "0" (a real RCU line reads "f0x0"); `%#o` is C's leading 0, not Python's 0o.
This is a small printf of our own because no kept library renders C formats with the
kernel's %p extensions; Python's % operator takes neither the length modifiers nor %p.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from robustd import yamlpos

INVENTORY_DIR = Path(__file__).with_name("inventory")
VERDICTS = ("fault", "resolved", "benign")
_SPEC = re.compile(r"%(?P<flags>[-+ #0]*)(?P<width>\*|[0-9]+)?(?:\.(?P<prec>\*|[0-9]+))?"
                   r"(?P<length>hh|h|ll|l|z|t|j|L)?(?P<conv>[diouxXcspn%])(?P<ext>(?<=p)[A-Za-z][A-Za-z0-9]*)?")


class FormatError(ValueError):
    """A format and its values do not fit together (the message says where)."""


@dataclass(frozen=True)
class Entry:
    subsystem: str
    source: str
    level: str
    format: str
    verdict: Literal["fault", "resolved", "benign"]
    why: str
    prefix: str = ""
    args: tuple[Any, ...] = ()
    code: str = ""
    where: str = ""  # file and index, for test ids and messages

    @property
    def line(self) -> str:
        """The message as the kernel log shows it: the prefix, the format rendered, without the newline."""
        return (self.prefix + render(self.format, self.args)).rstrip("\n")


@dataclass
class Inventory:
    subsystem: str
    sources: list[str]
    entries: list[Entry] = field(default_factory=list)


def render(fmt: str, args: tuple[Any, ...] | list[Any]) -> str:
    """`fmt` filled with `args` as the kernel's printf would print them."""
    out: list[str] = []
    values = list(args)
    pos = 0
    for m in _SPEC.finditer(fmt):
        out.append(fmt[pos:m.start()])
        pos = m.end()
        if m["conv"] == "%":
            out.append("%")
            continue
        flags, width, prec = m["flags"], m["width"], m["prec"]
        if width == "*":
            width = str(_take(values, fmt, m))
        if prec == "*":
            prec = str(_take(values, fmt, m))
        value = _take(values, fmt, m)
        conv = m["conv"]
        if conv == "p":
            conv, value = "s", str(value)  # %p and its extensions: the value as the caller wrote it
        elif conv in "diouxX":
            conv = "d" if conv in "iu" else conv
            try:
                value = int(value, 0) if isinstance(value, str) else int(value)
            except ValueError:
                raise FormatError(f"{m.group(0)!r} in {fmt!r} takes a number, not {value!r}") from None
            if conv == "o" and "#" in flags:
                # C's and the kernel's alternate octal form is one leading 0 ("010"; 0 stays "0"), which
                # Python writes "0o10" / "0o0": ask for one more digit of precision instead.
                flags = flags.replace("#", "")
                if value:
                    prec = str(max(int(prec or 0), len(f"{abs(value):o}") + 1))
        elif conv == "c":
            value = str(value)[:1]
        elif conv == "n":
            raise FormatError(f"%n in {fmt!r}")
        spec = "%" + flags + (width or "") + (f".{prec}" if prec is not None else "") + conv
        out.append(spec % (value,))
    if values:
        raise FormatError(f"{len(values)} values left over for {fmt!r}")
    out.append(fmt[pos:])
    return "".join(out)


def _take(values: list[Any], fmt: str, m: re.Match[str]) -> Any:
    if not values:
        raise FormatError(f"no value for {m.group(0)!r} in {fmt!r}")
    return values.pop(0)


def read_yaml(path: Path) -> Any:
    """`path`'s YAML document, read through robustd/yamlpos.py as the kernel and triage rules are: a key written
    twice in one mapping (YAML keeps the last without a word, so an entry's second `verdict:` or `format:`
    would silently replace the first) and malformed YAML are a ValueError naming the file and the lines."""
    try:
        _root, data, twice = yamlpos.load(path.read_text(encoding="utf-8"), str(path))
    except yaml.YAMLError as e:
        raise ValueError(yamlpos.malformed(e, str(path))) from None
    if twice:
        raise ValueError("; ".join(twice))
    return data


def load(path: Path) -> Inventory:
    """One inventory file; ValueError naming the file and entry on a bad one."""
    data = read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list) or not data.get("subsystem"):
        raise ValueError(f"{path}: needs `subsystem:`, `sources:` and a list of `entries:`")
    inv = Inventory(subsystem=str(data["subsystem"]), sources=[str(s) for s in data.get("sources") or []])
    known = {"source", "level", "prefix", "format", "args", "verdict", "code", "why"}
    for i, e in enumerate(data["entries"]):
        where = f"{path.name}[{i}]"
        if not isinstance(e, dict) or set(e) - known:
            raise ValueError(f"{where}: an entry is a mapping of {sorted(known)}")
        missing = [k for k in ("source", "level", "format", "verdict", "why") if not e.get(k)]
        if missing or e["verdict"] not in VERDICTS or (e["verdict"] != "benign" and not e.get("code")):
            raise ValueError(f"{where}: needs source, level, format, verdict ({'/'.join(VERDICTS)}), why, "
                             f"and a code unless benign (missing: {missing})")
        inv.entries.append(Entry(subsystem=inv.subsystem, source=str(e["source"]), level=str(e["level"]),
                                 format=str(e["format"]), verdict=e["verdict"], why=str(e["why"]),
                                 prefix=str(e.get("prefix") or ""), args=tuple(e.get("args") or ()),
                                 code=str(e.get("code") or ""), where=where))
    return inv


def load_all(directory: Path = INVENTORY_DIR) -> list[Inventory]:
    return [load(p) for p in sorted(directory.glob("*.yaml"))]
