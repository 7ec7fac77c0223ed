"""Failure triage: read a failed job's logs and exit status, name the root cause, pick the next step.

A pure library (no daemon, no root): `robustctl triage` calls it on files, `Diagnostics.Triage`
on bytes a scheduler sends, and the Slurm epilog before it decides to run stop-time tests.

    from robustd.triage import read_log, triage, to_json
    answer = triage([read_log("rank3.log")], exit_code=1)
    print(to_json(answer))   # {"class": "nccl", "infra": "likely", "next": "diagnose", ...}

Names are loaded on first use (PEP 562): the judge's rule file and pydantic cost about 0.1 s to
import, which `robustctl` must not pay for verbs that never triage (tests time `robustctl sim`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from robustd.triage.files import Unreadable, triage_files
    from robustd.triage.judge import triage
    from robustd.triage.model import CLASSES, INFRA, MAX_LOG_BYTES, MAX_LOGS, NEXT, Evidence, LogText, Triage
    from robustd.triage.reader import read_log
    from robustd.triage.render import to_json, to_text

_WHERE = {
    "Unreadable": "files", "triage_files": "files", "triage": "judge", "read_log": "reader", "to_json": "render",
    "to_text": "render", **{name: "model" for name in ("CLASSES", "INFRA", "MAX_LOG_BYTES", "MAX_LOGS", "NEXT",
                                                        "Evidence", "LogText", "Triage")},
}
__all__ = ["CLASSES", "INFRA", "MAX_LOG_BYTES", "MAX_LOGS", "NEXT", "Evidence", "LogText", "Triage", "Unreadable",
           "read_log", "to_json", "to_text", "triage", "triage_files"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'robustd.triage' has no attribute {name!r}")
    return getattr(importlib.import_module(f"robustd.triage.{_WHERE[name]}"), name)
