"""The Xid table: what each NVIDIA Xid means, read once from the kernel rule file, for both checks that raise
Xids: the kernel check (from /dev/kmsg) and the GPU check (from NVML events, where /dev/kmsg may not be
readable). One reading, one meaning, whichever source saw the fault.

- `codes()`: the `XID_*` entries of the shipped rules' `codes:` table (severity, action, ...);
- `recovery(text)`: the severity and action the rule XID_154 gives a recovery action written as the
  driver writes it (`0x1 (GPU Reset Required)`): the hints on its `recovery` group, so an NVML
  recovery-action event and the kernel line about the same action mean the same.

Both come from `shipped_rules()` (checks/kernel/rules.py), which loads and verifies the shipped rule files
once per process; an operator's extra rule files (`checks.kernel.rules`) are the kernel check's own.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from types import MappingProxyType

from checks.kernel.rules import shipped_rules
from robustd.codes import CodeRule
from robustd.model import Action, Severity

PREFIX = "XID_"
RECOVERY_RULE = "XID_154"  # the rule that reads a recovery action, and its group that holds it
RECOVERY_GROUP = "recovery"


@functools.cache
def codes() -> Mapping[str, CodeRule]:
    """`XID_<n>` → its meaning, as the shipped kernel rules give it."""
    return MappingProxyType({code: rule for code, rule in shipped_rules().codes.items() if code.startswith(PREFIX)})


@functools.cache
def _recovery_hints() -> tuple[tuple[re.Pattern[str], Severity | None, Action | None], ...]:
    rule = next(r for r in shipped_rules().rules if r.name == RECOVERY_RULE)
    return tuple((rx, sev, act) for group, rx, sev, act in rule.hints if group == RECOVERY_GROUP)


def recovery(text: str) -> tuple[Severity | None, Action | None]:
    """The severity and action of recovery action `text` (`0x4 (Drain and Reset)`); the first hint that
    names each wins, as in the kernel line's match. (None, None): the code table's XID_154 decides."""
    severity: Severity | None = None
    action: Action | None = None
    for rx, sev, act in _recovery_hints():
        if rx.search(text):
            severity, action = severity or sev, action or act
    return severity, action
