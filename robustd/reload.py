"""What a reload (SIGHUP) applies: every section but the ones read once at start.

The daemon re-reads the file, keeps the running values of RESTART_KEYS (logging each change, which takes
effect at the next restart), and rebuilds the checks, code table, policy and authz from the rest. The
registered sections (robustd/sections.py: `slurm:`, `k8s:`) are validated and their changes logged, but the
daemon applies nothing in them: their own processes read them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from robustd.config import Settings

log = logging.getLogger("robustd")

# Keys read once at start; a reload reports their changes instead of applying them. So is the boot id's
# path (roots.boot_id, or the older boot_id_path folded into it): the daemon read the boot id at start.
RESTART_KEYS = ("node_name", "state_dir", "listen", "metrics")


def changed_keys(old: Any, new: Any, keys: tuple[str, ...]) -> list[str]:
    """Dotted names of the leaves that differ under `keys` (e.g. `listen.max_connections`)."""
    out: list[str] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(f"{prefix}.{k}", a.get(k), b.get(k))
        elif a != b:
            out.append(prefix)

    before, after = old.model_dump(), new.model_dump()
    for key in keys:
        walk(key, before.get(key), after.get(key))
    return out


MAX_LOGGED_CHANGES = 40  # a reload that rewrites the whole file says how many more, not every one
MAX_VALUE_CHARS = 80


def diff(old: Settings, new: Settings) -> tuple[list[str], list[str], list[str]]:
    """Dotted keys added, removed and changed between two loaded configs (checks under `checks.`).

    Compared as loaded, defaults included: a key written out with its default value is no change, and a
    new entry in a map (a diagnostic level, a code override) is an added key.
    """
    added: list[str] = []
    removed: list[str] = []
    changed: list[str] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                key = f"{prefix}.{k}" if prefix else str(k)
                if k not in a:
                    added.append(f"{key}={_short(b[k])}")
                elif k not in b:
                    removed.append(key)
                else:
                    walk(key, a[k], b[k])
        elif a != b:
            changed.append(f"{prefix}: {_short(a)} -> {_short(b)}")

    def dump(s: Settings) -> dict[str, Any]:
        out = s.config.model_dump(mode="json")
        out["checks"] = {name: c.model_dump(mode="json") for name, c in s.checks.items()}
        out.update({name: section.model_dump(mode="json") for name, section in s.sections.items()})
        return out

    walk("", dump(old), dump(new))
    return added, removed, changed


def describe(added: list[str], removed: list[str], changed: list[str]) -> str:
    """One log line: `added a.b=1; removed c; changed d: 1 -> 2`, cut after MAX_LOGGED_CHANGES items."""
    items = [f"added {k}" for k in added] + [f"removed {k}" for k in removed] + [f"changed {k}" for k in changed]
    if not items:
        return "no keys changed"
    more = len(items) - MAX_LOGGED_CHANGES
    return "; ".join(items[:MAX_LOGGED_CHANGES]) + (f"; and {more} more" if more > 0 else "")


def _short(value: Any) -> str:
    """A value as the log shows it: a string bare (`5m`), anything else as JSON; long ones cut."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def merge(running: Settings, new: Settings) -> tuple[Settings, list[str]]:
    """The settings to run after a reload (`new`, with the running RESTART_KEYS) and the sections it applies.

    Logs what changed in the file, key by key, before anything is applied.
    """
    log.info("config changes: %s", describe(*diff(running, new)))
    old = running.config
    for key in changed_keys(old, new.config, RESTART_KEYS):
        log.warning("%s changed: that takes effect at the next restart", key)
    if old.roots.boot_id != new.config.roots.boot_id:
        log.warning("roots.boot_id changed: that takes effect at the next restart")
    kept = {k: getattr(old, k) for k in RESTART_KEYS}
    kept["roots"] = new.config.roots.model_copy(update={"boot_id": old.roots.boot_id})
    kept["boot_id_path"] = old.boot_id_path
    config = new.config.model_copy(update=kept)
    applied = [k for k in type(old).model_fields if getattr(old, k) != getattr(config, k)]
    if dict(running.checks) != dict(new.checks):
        applied.append("checks")
    merged = Settings(config=config, checks=new.checks, source=new.source, sections=new.sections)
    return merged, applied
