"""In which boots each fault was raised, as the event log holds it: the facts reboot escalation needs.

A reboot-fixable fault that comes back after `escalate_after_reboots` reboots is escalated to
HW_INSPECT (robustd/policy.py). The policy asks this record, in memory, while it decides; it never
reads the log then. The record is loaded from the log once at start (Store.raised_in_boots), is kept
current from the events the log has committed (`logged`), and forgets a boot once retention has
deleted that boot's last RAISED of the fault (`pruned`), so it always says what a query of the log
would: the distinct boots with a RAISED of (component, code) still in the log.

It is as large as the log allows (one entry per fault and boot with a RAISED in it: retention bounds
it), and it is keyed by boot id, so a boot id that changes while the daemon runs changes nothing here.
"""

from __future__ import annotations

import collections
from typing import Iterable

from robustd.model import Event, EventKind

Key = tuple[str, str]


class BootHistory:
    def __init__(self, raised: Iterable[tuple[str, str, str, int]] = ()):
        """`raised`: (component, code, boot id, seq of its newest RAISED in that boot), in any order."""
        # (component, code, boot id) -> seq of the newest RAISED, least recent first: the order retention deletes
        self._newest: collections.OrderedDict[tuple[str, str, str], int] = collections.OrderedDict()
        self._boots: dict[Key, set[str]] = {}
        for component, code, boot_id, seq in sorted(raised, key=lambda r: r[3]):
            self._add(component, code, boot_id, seq)

    def earlier(self, key: Key, boot_id: str) -> int:
        """In how many boots other than `boot_id` a RAISED of `key` is in the log."""
        boots = self._boots.get(key)
        return 0 if not boots else len(boots) - (boot_id in boots)

    def logged(self, events: Iterable[Event]) -> None:
        """Events the log has just committed (with their seqs)."""
        for ev in events:
            if ev.kind is EventKind.RAISED:
                c = ev.condition
                self._add(c.component, c.code, c.boot_id, ev.seq)

    def pruned(self, through: int) -> None:
        """Retention deleted every event up to seq `through`."""
        newest = self._newest
        while newest:
            entry, seq = next(iter(newest.items()))
            if seq > through:
                return
            del newest[entry]
            key, boots = entry[:2], self._boots[entry[:2]]
            boots.discard(entry[2])
            if not boots:
                del self._boots[key]

    def _add(self, component: str, code: str, boot_id: str, seq: int) -> None:
        entry = (component, code, boot_id)
        if entry in self._newest:
            self._newest.move_to_end(entry)
        self._newest[entry] = seq
        self._boots.setdefault((component, code), set()).add(boot_id)
