"""A triage answer for people (`robustctl triage`) and programs (`--json`, a public contract)."""

from __future__ import annotations

from typing import Any

from robustd.triage.model import Triage


def to_json(t: Triage) -> dict[str, Any]:
    """The `--json` object: class, infra, next, level (only with diagnose), evidence, ranks, reason."""
    out: dict[str, Any] = {"class": t.klass, "infra": t.infra, "next": t.next}
    if t.next == "diagnose" and t.level:
        out["level"] = t.level
    out["evidence"] = [{"file": e.file, "line": e.line, "text": e.text, "offset": e.offset}
                       | ({"rank": e.rank} if e.rank is not None else {}) for e in t.evidence]
    if t.ranks:
        out["ranks"] = list(t.ranks)
    out["reason"] = t.reason
    if t.partial:
        out["partial"] = list(t.partial)
    return out


def to_text(t: Triage) -> str:
    """What an on-call engineer reads first: the verdict, the next step, then the lines behind it."""
    step = t.next + (f" ({t.level})" if t.next == "diagnose" and t.level else "")
    lines = [f"class:    {t.klass}", f"infra:    {t.infra}", f"next:     {step}"]
    if t.ranks:
        lines.append("ranks:    " + ", ".join(str(r) for r in t.ranks))
    if t.reason:
        lines.append(f"reason:   {t.reason}")
    if t.evidence:
        lines.append("evidence:")
        for e in t.evidence:
            where = f"{e.file}:{e.line}" + (" (from the tail)" if e.file in t.partial else "")
            lines.append(f"  {where}: {e.text}")
    return "\n".join(lines)
