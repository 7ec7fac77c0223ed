"""The inventory of what a failed job's libraries print (robustd/triage/inventory/<printer>.yaml), with triage's
verdict on each message: the kernel inventory's other half (checks/rules/inventory.py), for the job's logs.

The triage rules (robustd/triage/rules.yaml) are written from real lines; the inventory holds them to what the
printers' source can print: one entry per message format of the library (PyTorch's c10d and elastic agent, NCCL,
the CUDA runtime's error strings as PyTorch raises them, the training libraries' loss-scale and NaN checks), the
line rendered from the format with plausible values, and the verdict: the triage class the line means (with the
tier when it matters), or `benign` (no failure line: triage must not claim it). tests/test_triage_inventory.py
triages each rendered line alone, as a one-line log, and checks the verdict.

A file:

    printer: nccl
    sources: ["NVIDIA/nccl src/init.cc ncclGetErrorString (v2.18-v2.30)"]
    entries:
      - source: src/transport/net_ib.cc ncclIbTest (v2.18)
        prefix: "node7:33155:33455 [3] transport/net_ib.cc:1295 NCCL WARN "  # what the logger adds
        format: "NET/IB : Got completion from peer %s with error %d, opcode %d, len %d, vendor err %d (%s)"
        args: ["10.1.2.3<34312>", 12, 0, 0, 129, "Recv"]
        verdict: nccl        # a triage class (robustd/triage/model.py CLASSES), or benign
        tier: cause          # optional: the tier the claiming rule must have
        why: "an InfiniBand work completion failed (12: transport retry counter exceeded)"

`style` (on the file, or an entry) says how `format` is read: `printf` (the default: C's printf and Python's
%-formatting of logging calls, rendered by checks/rules/inventory.py's printf) or `python` (`{}`/`{name}` as
str.format, f-strings and C++'s fmt print them; `args` a list, or a mapping for named fields). A format is one
line: a message the printer writes over several lines has one entry per line that matters.

This module sits in checks/ (not in robustd/triage/) because it renders with the kernel inventory's printf:
robustd.triage is a layer below checks and may not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checks.rules.inventory import read_yaml
from checks.rules.inventory import render as render_printf
from robustd.triage.model import CLASSES, LogText
from robustd.triage.rules import RuleSet, shipped
from robustd.triage.scan import Hit, scan

INVENTORY_DIR = Path(__file__).resolve().parents[2] / "robustd" / "triage" / "inventory"
STYLES = ("printf", "python")
TIERS = ("cause", "symptom", "context")
_KEYS = {"source", "style", "prefix", "format", "args", "verdict", "tier", "why"}


@dataclass(frozen=True)
class Entry:
    printer: str
    source: str
    format: str
    verdict: str  # a triage class, or "benign"
    why: str
    style: str = "printf"
    prefix: str = ""
    args: Any = ()
    tier: str = ""
    where: str = ""  # file and index, for test ids and messages

    @property
    def line(self) -> str:
        """The line as the log shows it: the logger's prefix and the format filled in, without a newline."""
        if self.style == "python":
            body = (self.format.format(**self.args) if isinstance(self.args, dict)
                    else self.format.format(*self.args))
        else:
            body = render_printf(self.format, tuple(self.args))
        return (self.prefix + body).rstrip("\n")


def judge_line(line: str, rules: RuleSet | None = None) -> list[Hit]:
    """What triage finds in `line` alone: the hits of a one-line log (gates, the launcher's prefix stripped,
    the rules in order, a bare `SomeError:` line), as robustd/triage/scan.py finds them in a job's log."""
    return scan(LogText(name="inventory.log", data=(line + "\n").encode()), 0, rules or shipped())


def load(path: Path) -> list[Entry]:
    """One inventory file's entries; ValueError naming the file and entry on a bad one."""
    data = read_yaml(path)
    if not isinstance(data, dict) or not data.get("printer") or not isinstance(data.get("entries"), list) \
            or not data.get("sources"):
        raise ValueError(f"{path}: needs `printer:`, `sources:` and a list of `entries:`")
    style = data.get("style", "printf")
    out = []
    for i, e in enumerate(data["entries"]):
        where = f"{path.name}[{i}]"
        if not isinstance(e, dict) or set(e) - _KEYS:
            raise ValueError(f"{where}: an entry is a mapping of {sorted(_KEYS)}")
        missing = [k for k in ("source", "format", "verdict", "why") if not e.get(k)]
        verdict, tier, st = e.get("verdict"), e.get("tier") or "", e.get("style", style)
        if missing or (verdict != "benign" and verdict not in CLASSES) or st not in STYLES \
                or (tier and (tier not in TIERS or verdict == "benign")):
            raise ValueError(f"{where}: needs source, format, verdict (a class of {', '.join(CLASSES)}, or "
                             f"benign), why; style {'/'.join(STYLES)}; a tier ({'/'.join(TIERS)}) only with a "
                             f"class (missing: {missing})")
        args = e.get("args") or ()
        out.append(Entry(printer=str(data["printer"]), source=str(e["source"]), format=str(e["format"]),
                         verdict=str(verdict), why=str(e["why"]), style=st, prefix=str(e.get("prefix") or ""),
                         args=args if isinstance(args, dict) else tuple(args), tier=tier, where=where))
    return out


def load_all(directory: Path = INVENTORY_DIR) -> list[Entry]:
    return [e for p in sorted(directory.glob("*.yaml")) for e in load(p)]
