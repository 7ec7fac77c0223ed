"""The config sections other processes own, found by name: robustd.yaml's `slurm:` (robustd-slurm and the
Slurm hooks) and `k8s:` (robustd-k8s), and any a third party adds.

A section registers its pydantic model under the entry-point group `robustd.sections` (robustd's own in
pyproject.toml), the way a check registers its `Config`: so the daemon validates the whole file, naming the
key and line of a bad value in any section, without knowing which schedulers there are, and never acts on
what it validated. Each adapter validates its own section itself (robustd.config.Schema).
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from pydantic import BaseModel

from robustd.config import Config

log = logging.getLogger("robustd")

GROUP = "robustd.sections"


def discover_sections() -> dict[str, type[BaseModel]]:
    """Every registered section's model by its key; one that cannot be loaded is logged and left out (its
    key is then an unknown key of the file)."""
    found: dict[str, type[BaseModel]] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        if ep.name in Config.model_fields or ep.name in found:  # a core key, or registered twice
            log.error("config section %s (%s) ignored: the key %r is taken", ep.name, ep.value, ep.name)
            continue
        try:
            model = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not stop the daemon
            log.error("cannot load config section %s (%s): %s", ep.name, ep.value, e)
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            log.error("config section %s (%s) ignored: not a pydantic model", ep.name, ep.value)
            continue
        found[ep.name] = model
    return found
