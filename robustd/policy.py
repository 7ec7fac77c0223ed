"""Findings in, condition changes out: the rules a scheduler needs, and nothing else.

The policy keeps the standing conditions in memory and returns the events each input causes;
it never touches disk or sockets (the engine commits the events, then publishes them), so it
is tested with plain lists and a clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping

from robustd.codes import CodeTable, Meaning
from robustd.model import Action, Condition, Event, EventKind, Finding, FindingKind, Severity

Key = tuple[str, str]
RECENT_KEEP = 7 * 86400.0  # how long occurrence times of a cleared condition count toward `tolerate`
PriorBoots = Callable[[str, str, str], int]  # (component, code, current boot) -> earlier boots it was seen in


@dataclass
class _Track:
    """What the policy remembers about one condition beyond the condition itself."""

    meaning: Meaning
    seen_at: float  # last sighting, for the hold-down (never earlier than daemon start)
    last_event_at: float = 0.0
    dirty: bool = False  # repeats not yet published (coalesced to one UPDATED per interval)
    state: bool = False  # raised by a STATE finding (persistence counts toward tolerate)


@dataclass
class Policy:
    table: CodeTable
    boot_id: str
    default_clear_after: float = 300.0
    update_interval: float = 1.0
    escalate_after_reboots: int = 2
    prior_boots: PriorBoots = lambda component, code, boot: 0  # noqa: E731
    conditions: dict[Key, Condition] = field(default_factory=dict)
    _tracks: dict[Key, _Track] = field(default_factory=dict)
    _recent: dict[Key, collections.deque[float]] = field(default_factory=dict)

    # -- state from the event log ------------------------------------------------------------
    def load(self, conditions: Iterable[Condition], now: float) -> None:
        """Adopt the conditions committed before a restart; their hold-downs restart now."""
        for c in conditions:
            self.conditions[c.key] = c
            meaning = self.meaning(c.code, c.severity, c.action)
            self._tracks[c.key] = _Track(meaning=meaning, seen_at=max(c.last_seen, now), last_event_at=now)

    def reboot(self, now: float) -> list[Event]:
        """The boot id changed: clear every condition from an earlier boot before anyone asks."""
        return [self._clear(k, now, {"cleared_by": "reboot", "new_boot_id": self.boot_id})
                for k, c in list(self.conditions.items()) if c.boot_id != self.boot_id]

    def meaning(self, code: str, severity: Severity | None = None, action: Action | None = None) -> Meaning:
        return self.table.resolve(code, hint_severity=severity, hint_action=action,
                                  default_clear_after=self.default_clear_after,
                                  default_escalate=self.escalate_after_reboots)

    # -- inputs --------------------------------------------------------------------------------
    def apply(self, findings: Iterable[Finding], source: str, now: float) -> list[Event]:
        events: list[Event] = []
        for f in findings:
            ev = self._one(f, source, now)
            if ev is not None:
                events.append(ev)
        return events

    def acknowledge(self, component: str, code: str, reason: str, now: float) -> Event:
        """An operator says the fault is handled; raises KeyError if there is no such condition."""
        key = (component, code)
        if key not in self.conditions:
            raise KeyError(key)
        return self._clear(key, now, {"cleared_by": "acknowledge", "reason": reason})

    def tick(self, now: float) -> list[Event]:
        """Time passing: hold-downs expire, coalesced repeats go out, tolerated states escalate."""
        events: list[Event] = []
        for key, seen in list(self._recent.items()):  # occurrence history outlives a clear (flaps), not forever
            if key not in self.conditions and now - seen[-1] > RECENT_KEEP:
                del self._recent[key]
        for key, c in list(self.conditions.items()):
            t = self._tracks[key]
            if not c.sticky and now - t.seen_at >= t.meaning.clear_after:
                events.append(self._clear(key, now, {"cleared_by": "hold-down"}))
                continue
            severity = self._severity(key, t, c, now)
            if severity != c.severity:
                events.append(self._update(key, replace(c, severity=severity), now))
            elif t.dirty and now - t.last_event_at >= self.update_interval:
                events.append(self._update(key, c, now))
        return events

    def committed(self, events: Iterable[Event]) -> None:
        """Record the seqs the store gave; a cleared condition is gone for good."""
        for ev in events:
            key = ev.condition.key
            if ev.kind is EventKind.CLEARED:
                continue
            if key in self.conditions:
                self.conditions[key] = self.conditions[key].with_seq(ev.seq, ev.at)

    # -- internals -----------------------------------------------------------------------------
    def _one(self, f: Finding, source: str, now: float) -> Event | None:
        key = (f.component, f.code)
        existing = self.conditions.get(key)
        if f.kind is FindingKind.RESOLVED:
            if existing is not None and not existing.sticky:
                return self._clear(key, now, {"cleared_by": "resolved", "line": f.evidence.get("line", f.message)})
            return None
        at = f.at if f.at is not None else now
        meaning = self.meaning(f.code, f.severity, f.action)
        is_state = f.kind is FindingKind.STATE
        if existing is None or not is_state:
            self._recent.setdefault(key, collections.deque(maxlen=64)).append(now)
        if existing is None:
            action = meaning.action
            evidence = dict(f.evidence)
            n = meaning.escalate_after_reboots
            if n is not None and meaning.action is not Action.HW_INSPECT:
                earlier = self.prior_boots(f.component, f.code, self.boot_id)
                if earlier >= n:
                    action = Action.HW_INSPECT
                    evidence["escalated"] = f"seen in {earlier} earlier boots (limit {n}); was {meaning.action.name}"
            track = _Track(meaning=meaning, seen_at=now, last_event_at=now, state=is_state)
            self._tracks[key] = track
            cond = Condition(component=f.component, code=f.code, severity=meaning.severity, action=action,
                             message=f.message, evidence=evidence, first_seen=at, last_seen=at, count=1,
                             sticky=meaning.sticky, source=source, boot_id=self.boot_id)
            cond = replace(cond, severity=self._severity(key, track, cond, now))
            self.conditions[key] = cond
            return Event(EventKind.RAISED, cond, now)

        t = self._tracks[key]
        t.seen_at = now
        t.meaning = meaning
        if is_state:
            cond = replace(existing, last_seen=at, message=f.message or existing.message,
                           evidence={**existing.evidence, **f.evidence})
        else:
            cond = replace(existing, last_seen=max(at, existing.last_seen), count=existing.count + 1,
                           message=f.message or existing.message,
                           evidence={**existing.evidence, **f.evidence}, boot_id=self.boot_id)
        cond = replace(cond, severity=self._severity(key, t, cond, now),
                       action=max(existing.action, meaning.action))
        self.conditions[key] = cond
        if (cond.severity, cond.action) != (existing.severity, existing.action):
            return self._update(key, cond, now)
        if not is_state:
            if now - t.last_event_at >= self.update_interval:
                return self._update(key, cond, now)
            t.dirty = True
        return None

    def _severity(self, key: Key, t: _Track, c: Condition, now: float) -> Severity:
        tol = t.meaning.tolerate
        full = t.meaning.severity
        if tol is None or full <= Severity.WARNING:
            return full
        recent = [x for x in self._recent.get(key, ()) if now - x <= tol.window]
        persist = tol.persist if tol.persist is not None else tol.window
        if len(recent) >= tol.count or (t.state and now - c.first_seen >= persist):
            return full
        return Severity.WARNING

    def _update(self, key: Key, cond: Condition, now: float) -> Event:
        t = self._tracks[key]
        t.dirty = False
        t.last_event_at = now
        self.conditions[key] = cond
        return Event(EventKind.UPDATED, cond, now)

    def _clear(self, key: Key, now: float, why: Mapping[str, str]) -> Event:
        cond = self.conditions.pop(key)
        self._tracks.pop(key, None)
        return Event(EventKind.CLEARED, replace(cond, evidence={**cond.evidence, **why}), now)
