"""What a reload (SIGHUP) applies: every section but the ones read once at start.

The daemon re-reads the file, keeps the running values of RESTART_KEYS (logging each change, which takes
effect at the next restart), and rebuilds the checks, code table, policy and authz from the rest.
"""

from __future__ import annotations

import logging
from typing import Any

from robustd.config import Settings

log = logging.getLogger("robustd")

# Keys read once at start; a reload reports their changes instead of applying them.
RESTART_KEYS = ("node_name", "state_dir", "boot_id_path", "listen", "metrics")
ADAPTER_KEYS = ("slurm",)  # read by the adapters from the same file; the daemon itself uses nothing in them


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


def merge(running: Settings, new: Settings) -> tuple[Settings, list[str]]:
    """The settings to run after a reload (`new`, with the running RESTART_KEYS) and the sections it applies."""
    old = running.config
    for key in changed_keys(old, new.config, RESTART_KEYS):
        log.warning("%s changed: that takes effect at the next restart", key)
    applied = [k for k in type(old).model_fields
               if k not in (*RESTART_KEYS, *ADAPTER_KEYS) and getattr(old, k) != getattr(new.config, k)]
    if dict(running.checks) != dict(new.checks):
        applied.append("checks")
    merged = Settings(config=new.config.model_copy(update={k: getattr(old, k) for k in RESTART_KEYS}),
                      checks=new.checks, source=new.source)
    return merged, applied
