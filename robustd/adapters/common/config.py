"""The pieces of an adapter's config section that every adapter spells the same way.

A scheduler's section names robustd's actions (`slurm.drain_actions`, `k8s.quarantine.actions`); they are
read into robustd.model.Action, so the adapter decides on the enum the daemon sent, never on a string.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

from robustd.model import Action, Severity

ACTIONS = tuple(Action.__members__)  # least to most drastic
EXIT_CONFIG = 78  # EX_CONFIG (sysexits.h): a bad config; the units' RestartPreventExitStatus= names it


def _action(name: Any) -> Action:
    if isinstance(name, Action):
        return name
    if not isinstance(name, str):
        raise ValueError(f"expected an action name, got {type(name).__name__}")
    value = name.strip().upper().removeprefix("ACTION_")
    if value not in ACTIONS:
        raise ValueError(f"unknown action {name!r} (known: {', '.join(ACTIONS)})")
    return Action[value]


ActionName = Annotated[Action, BeforeValidator(_action), PlainSerializer(lambda a: a.name, when_used="json")]
"""An Action written by its name (`REBOOT`, `reboot`, `ACTION_REBOOT`)."""


def _threshold(name: Any) -> Severity:
    if isinstance(name, Severity) and name is not Severity.OK:
        return name
    value = name.strip().upper().removeprefix("SEVERITY_") if isinstance(name, str) else None
    if value not in ("WARNING", "CRITICAL"):
        raise ValueError(f"expected WARNING or CRITICAL, got {name!r}")
    return Severity[value]


Threshold = Annotated[Severity, BeforeValidator(_threshold), PlainSerializer(lambda s: s.name, when_used="json")]
"""A severity a scheduler acts at: WARNING or CRITICAL (OK would be every condition)."""
