"""Findings in, condition changes out: the rules a scheduler needs, and nothing else.

The policy keeps the standing conditions in memory and returns the events each input causes;
it never touches disk or sockets and never waits on them, so it is tested with plain lists and a
clock. The engine hands its events to the journal, which commits them before anyone is told;
what the log made of them (seqs) is the journal's, and the policy's conditions carry no seq. The one
thing the policy learns from the log is the reboot facts (robustd/boots.py: in which boots each
fault was raised): handed over as data at start, then kept current from the committed events and
retention (`logged`, `pruned`), never read from SQLite while deciding.

Standing conditions are bounded, because a fault storm (a driver printing garbage bus ids) can
name any number of components, and every condition is in every GetVerdict:

- at most `max_conditions_per_code` conditions per code and `max_conditions` in all are a
  component's own ("ordinary") conditions;
- a finding that would raise one more folds into the **fold-over** condition of its code on
  `<family>/*` (`gpu/*`: the component up to its first `/`; `*` for a component without one): same
  code, the worst severity and action it folded, sticky if any folded one is, and the number of
  distinct components folded in its message and in evidence (`folded`, with the first ones folded in
  `examples` and the newest in `newest`: a flood's start and what it is doing now);
- at most `max_foldovers` fold-overs stand at once; past that, findings fold into the single
  catch-all condition `*` / `CONDITIONS_OVERFLOW`, which names the codes it folded;
- a component the node really has (`owned`: the GPUs NVML lists, the devices sysfs shows; see
  robustd/owned.py) is never folded while fewer than 2 x max_conditions ordinary conditions stand:
  folding is for names the node does not have, and a real GPU's XID_79 must stand on its own bus id
  however many made-up ones a flood raised first. Made-up names can take at most max_conditions, so
  the node's own always have the other max_conditions.

So at most 2 x max_conditions + max_foldovers + 1 conditions stand (2,065 with the defaults), and no
finding is ever dropped: it is in its own condition, a fold-over or the catch-all. A fold-over is
refreshed by each finding it folds and clears by its own hold-down (the longest of the codes it
folded), or by acknowledgement or reboot like any condition; it never clears because one folded
component recovered. Tolerate-N counts all the occurrences a fold-over folded together, and reboot
escalation applies to ordinary conditions only (a fold-over already takes the worst it folded).

**One fault, two sources.** Some faults reach robustd twice: the driver prints an Xid to the kernel
log and posts the same Xid as an NVML event (the kernel check and the GPU check both report
`XID_<n>` on `gpu/<bus id>`). An occurrence from one source and one from another source on the same
(component, code) within SAME_FAULT_WINDOW (10 s) are one occurrence: the second adds its evidence
(`also_seen_by`) but no count, no tolerate-N step and no RAISED event. Sightings pair one to one,
oldest first, and only across sources: two lines from the same source are two faults and both
count. This lives here, in the policy's per-(component, code) state, because only the policy sees
every source's findings for a condition, in arrival order, before it counts and raises: each check
sees its own source only, and the engine merely forwards. 10 s because both copies come from one
driver interrupt and arrive milliseconds apart, yet a kmsg reader that fell behind (a daemon
restart, a stalled disk) may deliver its copy seconds late; a real repeat from the same source is
never merged, however soon it comes.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from robustd import bounds
from robustd.boots import BootHistory
from robustd.codes import CodeTable, Meaning
from robustd.model import Action, Condition, Event, EventKind, Finding, FindingKind, Severity

Key = tuple[str, str]
RECENT_KEEP = 7 * 86400.0  # how long occurrence times of a cleared condition count toward `tolerate`

CATCH_ALL: Key = ("*", "CONDITIONS_OVERFLOW")
FOLD_EXAMPLES = 3  # components (and, for the catch-all, codes) a fold-over names
# Distinct folded components are told apart by a 64-bit hash; this many are remembered in all
# (about 5 MB), after which `folded` stops growing and reads as a lower bound.
MAX_FOLD_TRACKED = 65_536
RECENT_KEYS_PER_CONDITION = 2  # occurrence histories kept, per allowed condition (cleared ones included)
SAME_FAULT_WINDOW = 10.0  # seconds within which two sources' occurrences of one (component, code) are one fault
MAX_SIGHTING_KEYS = 4096  # (component, code) pairs whose recent sightings are kept for pairing (oldest dropped)


def fold_component(component: str) -> str:
    """The component a fold-over stands on: `gpu/0000:3b:00.0` -> `gpu/*`; `host` -> `*`."""
    family, slash, _ = component.partition("/")
    return f"{family}/*" if slash else "*"


def is_fold_component(component: str) -> bool:
    return component == "*" or component.endswith("/*")


@dataclass
class _Track:
    """What the policy remembers about one condition beyond the condition itself."""

    meaning: Meaning
    seen_at: float  # last sighting, for the hold-down (never earlier than daemon start)
    last_event_at: float = 0.0
    dirty: bool = False  # repeats not yet published (coalesced to one UPDATED per interval)
    state: bool = False  # raised by a STATE finding (persistence counts toward tolerate)
    earned: bool = False  # reached its full severity through `tolerate` (kept if sticky)


@dataclass
class _Distinct:
    """Distinct values a fold-over stands for, counted by hash; the first FOLD_EXAMPLES and the newest
    FOLD_EXAMPLES are named in its text."""

    count: int = 0  # a lower bound once MAX_FOLD_TRACKED is spent
    hashes: set[int] = field(default_factory=set)
    examples: list[str] = field(default_factory=list)
    newest: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=FOLD_EXAMPLES))

    def text(self) -> str:
        return ", ".join(self.examples) + (", ..." if self.count > len(self.examples) else "")

    def newest_text(self) -> str:
        """The newest values, newest first ("" while they are all among the first)."""
        return ", ".join(reversed(self.newest)) if self.count > len(self.examples) else ""

    @classmethod
    def restored(cls, listed: str, count: str | None = None, newest: str = "") -> _Distinct:
        """From a committed condition's evidence: its examples, the newest, and the count it had reached."""
        examples = [e for e in listed.split(", ") if e and e != "..."][:FOLD_EXAMPLES]
        n = int(count) if count is not None and count.isdigit() else len(examples)
        recent = collections.deque(reversed([e for e in newest.split(", ") if e][:FOLD_EXAMPLES]),
                                   maxlen=FOLD_EXAMPLES)
        return cls(count=n, hashes={hash(x) for x in examples}, examples=examples, newest=recent)


@dataclass
class _Fold:
    """What a fold-over condition stands for, beyond the condition itself."""

    limit: str  # the cap that made it fold, e.g. "policy.max_conditions_per_code=64"
    components: _Distinct = field(default_factory=_Distinct)  # distinct components folded
    codes: _Distinct = field(default_factory=_Distinct)  # the catch-all's distinct codes
    exact: bool = True


@dataclass
class Policy:
    table: CodeTable
    boot_id: str
    default_clear_after: float = 300.0
    update_interval: float = 1.0
    escalate_after_reboots: int = 2
    boots: BootHistory = field(default_factory=BootHistory)  # in which boots each fault was raised (the log's)
    max_conditions_per_code: int = 64  # policy.max_conditions_per_code
    max_conditions: int = 1000  # policy.max_conditions
    max_foldovers: int = 64  # fold-over conditions standing at once (the catch-all comes on top)
    owned: Callable[[str], bool] = field(default=lambda component: False)  # the node has it: never folded
    conditions: dict[Key, Condition] = field(default_factory=dict)
    _tracks: dict[Key, _Track] = field(default_factory=dict)
    _recent: dict[Key, collections.deque[float]] = field(default_factory=dict)  # oldest use first
    _folds: dict[Key, _Fold] = field(default_factory=dict)
    _per_code: collections.Counter[str] = field(default_factory=collections.Counter)  # ordinary conditions
    _tracked: int = 0  # hashes held by all fold-overs together
    # Occurrences of the last SAME_FAULT_WINDOW per key: (when, source, paired with another source's).
    _sightings: dict[Key, collections.deque[list[Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Conditions carry the boot id bounded; comparing against the same form keeps reboots exact.
        self.boot_id = bounds.token(self.boot_id, bounds.MAX_BOOT_ID)

    # -- state from the event log ------------------------------------------------------------
    def load(self, conditions: Iterable[Condition], now: float) -> None:
        """Adopt the conditions committed before a restart; their hold-downs restart now.

        All of them stand again even past the caps (a lowered cap folds new findings only). They come
        bounded (the store bounds what it reads back, rows of older versions included). Their seqs stay
        behind: seqs are the journal's (robustd/journal.py), and the policy's conditions carry none.
        """
        for c in conditions:
            c = replace(c, seq=0, changed_at=0.0)
            if c.key in self.conditions:
                continue
            self.conditions[c.key] = c
            meaning = self.meaning(c.code, c.severity, c.action)
            if is_fold_component(c.component):
                meaning = replace(meaning, severity=c.severity, action=c.action, sticky=c.sticky, tolerate=None)
                fold = self._folds[c.key] = _restored_fold(c)
                self._tracked += len(fold.codes.hashes)  # released again when it clears
            else:
                self._per_code[c.code] += 1
            self._tracks[c.key] = _Track(meaning=meaning, seen_at=max(c.last_seen, now), last_event_at=now,
                                         earned=c.severity >= meaning.severity)

    def reboot(self, now: float, boot_id: str | None = None) -> list[Event]:
        """The boot id changed (to `boot_id`, if given): clear every condition from an earlier boot before
        anyone asks."""
        if boot_id is not None:
            self.boot_id = bounds.token(boot_id, bounds.MAX_BOOT_ID)
        return [self._clear(k, now, {"cleared_by": "reboot", "new_boot_id": self.boot_id})
                for k, c in list(self.conditions.items()) if c.boot_id != self.boot_id]

    def configure(self, table: CodeTable, settings: Any) -> None:
        """Take a code table and the `policy` section's keys (robustd.config.PolicyConfig or alike): at start
        and at every reload."""
        self.table = table
        self.default_clear_after = settings.clear_after
        self.update_interval = settings.update_interval
        self.escalate_after_reboots = settings.escalate_after_reboots
        self.max_conditions_per_code = settings.max_conditions_per_code
        self.max_conditions = settings.max_conditions

    def meaning(self, code: str, severity: Severity | None = None, action: Action | None = None) -> Meaning:
        return self.table.resolve(code, hint_severity=severity, hint_action=action,
                                  default_clear_after=self.default_clear_after,
                                  default_escalate=self.escalate_after_reboots)

    # -- inputs --------------------------------------------------------------------------------
    def apply(self, findings: Iterable[Finding], source: str, now: float) -> list[Event]:
        events: list[Event] = []
        source = bounds.token(source, bounds.MAX_SOURCE)
        for f in findings:
            ev = self._one(bounds.finding(f), source, now)
            if ev is not None:
                events.append(ev)
        return events

    def acknowledge(self, component: str, code: str, reason: str, now: float) -> Event:
        """An operator says the fault is handled; raises KeyError if there is no such condition.

        A fold-over is acknowledged like any condition (`gpu/*` and its code); its components'
        next findings raise their own conditions again while there is room.
        """
        key = self._key(component, code)
        if key not in self.conditions:
            raise KeyError(key)
        return self._clear(key, now, {"cleared_by": "acknowledge", "reason": reason})

    def stands(self, component: str, code: str) -> bool:
        """Whether a condition stands for (component, code), keyed as the policy keys findings. Safe from any
        thread: one dict lookup."""
        return self._key(component, code) in self.conditions

    def tick(self, now: float) -> list[Event]:
        """Time passing: hold-downs expire, coalesced repeats go out, tolerated states escalate."""
        events: list[Event] = []
        for key, sightings in list(self._sightings.items()):
            if now - sightings[-1][0] > SAME_FAULT_WINDOW:
                del self._sightings[key]
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

    # -- what the event log did ---------------------------------------------------------------
    def logged(self, events: Iterable[Event]) -> None:
        """Events the log has committed: the reboot facts follow them (a RAISED now belongs to this boot).
        The conditions do not: their seqs are the journal's."""
        self.boots.logged(events)

    def pruned(self, through: int) -> None:
        """Retention deleted the events up to seq `through`: boots known only from those no longer count."""
        self.boots.pruned(through)

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _key(component: str, code: str) -> Key:
        """A caller's (component, code) as findings are keyed (bounds.finding)."""
        return bounds.token(component, bounds.MAX_COMPONENT), bounds.token(code, bounds.MAX_CODE)

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
        if not is_state and self._seen_by_another_source(key, source, now) and existing is not None:
            return self._corroborate(key, existing, meaning, f.evidence, source, now)
        if existing is None:
            target = self._fold_target(key)
            if target is not None:
                return self._fold(target, f, meaning, source, at, now)
        if existing is None or not is_state:
            self._note(key, now)
        if existing is None:
            action = meaning.action
            evidence = dict(f.evidence)
            n = meaning.escalate_after_reboots
            if n is not None and meaning.action is not Action.HW_INSPECT:
                earlier = self.boots.earlier(key, self.boot_id)
                if earlier >= n:
                    action = Action.HW_INSPECT
                    evidence["escalated"] = f"seen in {earlier} earlier boots (limit {n}); was {meaning.action.name}"
            self._per_code[f.code] += 1
            return self._raise(key, meaning, action, f.message, evidence, source, at, now, is_state)
        return self._repeat(key, existing, meaning, f.message, f.evidence, at, now, is_state, count=not is_state)

    def _raise(self, key: Key, meaning: Meaning, action: Action, message: str, evidence: Mapping[str, str],
               source: str, at: float, now: float, is_state: bool) -> Event:
        track = _Track(meaning=meaning, seen_at=now, last_event_at=now, state=is_state)
        self._tracks[key] = track
        cond = bounds.condition(Condition(
            component=key[0], code=key[1], severity=meaning.severity, action=action, message=message,
            evidence=evidence, first_seen=at, last_seen=at, count=1, sticky=meaning.sticky, source=source,
            boot_id=self.boot_id))
        cond = replace(cond, severity=self._severity(key, track, cond, now))
        self.conditions[key] = cond
        return Event(EventKind.RAISED, cond, now)

    def _repeat(self, key: Key, existing: Condition, meaning: Meaning, message: str, evidence: Mapping[str, str],
                at: float, now: float, is_state: bool, count: bool) -> Event | None:
        """One more sighting of a standing condition: refresh it, publish at once only what matters."""
        t = self._tracks[key]
        t.seen_at = now
        t.meaning = meaning
        merged = bounds.evidence({**existing.evidence, **evidence})
        if is_state:
            cond = replace(existing, last_seen=at, message=message or existing.message, evidence=merged,
                           count=existing.count + 1 if count else existing.count)
        else:
            cond = replace(existing, last_seen=max(at, existing.last_seen), count=existing.count + 1,
                           message=message or existing.message, evidence=merged, boot_id=self.boot_id)
        sticky = existing.sticky or meaning.sticky if key in self._folds else existing.sticky  # a fold-over's worst
        cond = replace(cond, severity=self._severity(key, t, cond, now), action=max(existing.action, meaning.action),
                       sticky=sticky)
        self.conditions[key] = cond
        if (cond.severity, cond.action) != (existing.severity, existing.action):
            return self._update(key, cond, now)
        if cond.count != existing.count or not is_state:
            if now - t.last_event_at >= self.update_interval:
                return self._update(key, cond, now)
            t.dirty = True
        return None

    # -- one fault, two sources ----------------------------------------------------------------
    def _seen_by_another_source(self, key: Key, source: str, now: float) -> bool:
        """Whether another source reported this occurrence within SAME_FAULT_WINDOW (that sighting is then
        paired and pairs no more); else this one is recorded for a later source to pair with."""
        sightings = self._sightings.pop(key, None) or collections.deque(maxlen=16)
        while sightings and now - sightings[0][0] > SAME_FAULT_WINDOW:
            sightings.popleft()
        self._sightings[key] = sightings  # re-inserted: the dict runs from least to most recently used
        for sighting in sightings:
            if not sighting[2] and sighting[1] != source:
                sighting[2] = True
                return True
        sightings.append([now, source, False])
        if len(self._sightings) > MAX_SIGHTING_KEYS:
            del self._sightings[next(iter(self._sightings))]
        return False

    def _corroborate(self, key: Key, existing: Condition, meaning: Meaning, evidence: Mapping[str, str],
                     source: str, now: float) -> Event | None:
        """A second source's report of an occurrence already counted: its evidence joins the condition (published
        with the next coalesced UPDATED), a more drastic action takes effect; the count stays."""
        t = self._tracks[key]
        t.seen_at = now
        added = {k: v for k, v in evidence.items() if k not in existing.evidence}
        cond = replace(existing, evidence=bounds.evidence({**existing.evidence, **added, "also_seen_by": source}),
                       action=max(existing.action, meaning.action))
        self.conditions[key] = cond
        if cond.action != existing.action:
            return self._update(key, cond, now)
        t.dirty = t.dirty or cond.evidence != existing.evidence
        return None

    # -- folding -------------------------------------------------------------------------------
    def _fold_target(self, key: Key) -> Key | None:
        """None while `key` may have a condition of its own; else the fold-over that takes it."""
        component, code = key
        ordinary = len(self.conditions) - len(self._folds)
        if ordinary < self.max_conditions and self._per_code[code] < self.max_conditions_per_code:
            return None
        if ordinary < 2 * self.max_conditions and self.owned(component):
            return None
        fold = (fold_component(component), code)
        if fold in self._folds or (fold not in self.conditions and
                                   len(self._folds) - (CATCH_ALL in self._folds) < self.max_foldovers):
            return fold
        return CATCH_ALL

    def _fold(self, key: Key, f: Finding, meaning: Meaning, source: str, at: float, now: float) -> Event | None:
        """Count `f` into the fold-over `key`, raising it first if it is not standing."""
        fold = self._folds.get(key)
        if fold is None:
            per_code = self._per_code[f.code] >= self.max_conditions_per_code and key != CATCH_ALL
            limit = (f"policy.max_conditions_per_code={self.max_conditions_per_code}" if per_code else
                     f"policy.max_conditions={self.max_conditions}" +
                     (f" and {self.max_foldovers} fold-overs" if key == CATCH_ALL else ""))
            fold = self._folds[key] = _Fold(limit=limit)
            if key in self.conditions:  # a check named a component `*` itself: it becomes the catch-all
                self._per_code[key[1]] -= 1
        new_component = self._remember(fold, f.component)
        new_code = key == CATCH_ALL and self._remember_code(fold, f.code)
        is_state = f.kind is FindingKind.STATE
        if not is_state or new_component:
            self._note(key, now)
        existing = self.conditions.get(key)
        if existing is None:
            message, evidence = _fold_text(key, fold)
            return self._raise(key, meaning, meaning.action, message, evidence, source, at, now, is_state)
        # The text only changes when something new was folded: a storm of repeats does not rebuild it.
        message, evidence = _fold_text(key, fold) if new_component or new_code else (existing.message, {})
        t = self._tracks[key]
        worst = replace(meaning, severity=max(meaning.severity, t.meaning.severity),
                        action=max(meaning.action, t.meaning.action), sticky=meaning.sticky or t.meaning.sticky,
                        clear_after=max(meaning.clear_after, t.meaning.clear_after),
                        tolerate=t.meaning.tolerate or meaning.tolerate)
        t.state = t.state or is_state
        return self._repeat(key, existing, worst, message, evidence, at, now, is_state,
                            count=not is_state or new_component)

    def _remember_code(self, fold: _Fold, code: str) -> bool:
        """Whether `code` is new to the catch-all."""
        return self._remember_in(fold.codes, code) is True

    def _remember(self, fold: _Fold, component: str) -> bool:
        """Whether `component` is new to `fold` (counted once however often it is folded)."""
        new = self._remember_in(fold.components, component)
        if new is None:
            fold.exact = False  # cannot tell new from seen any more: the count stays a lower bound
        return new is True

    def _remember_in(self, seen: _Distinct, value: str) -> bool | None:
        """True: `value` is new to `seen` (now counted); False: seen before; None: the tracking budget is spent."""
        h = hash(value)
        if h in seen.hashes:
            return False
        if self._tracked >= MAX_FOLD_TRACKED:
            if value not in seen.newest:  # new or not, it is what the flood names now
                seen.newest.append(value)
            return None
        seen.hashes.add(h)
        self._tracked += 1
        seen.count += 1
        if len(seen.examples) < FOLD_EXAMPLES:
            seen.examples.append(value)
        seen.newest.append(value)
        return True

    # -- shared --------------------------------------------------------------------------------
    def _note(self, key: Key, now: float) -> None:
        """Record an occurrence for `tolerate`; histories of cleared conditions are kept boundedly."""
        seen = self._recent.pop(key, None)
        if seen is None:
            seen = collections.deque(maxlen=64)
        seen.append(now)
        self._recent[key] = seen  # re-inserted: the dict runs from least to most recently used
        keep = RECENT_KEYS_PER_CONDITION * (self.max_conditions + self.max_foldovers + 1)
        if len(self._recent) > keep:
            for old in [k for k in self._recent if k not in self.conditions][:len(self._recent) - keep * 3 // 4]:
                del self._recent[old]

    def _severity(self, key: Key, t: _Track, c: Condition, now: float) -> Severity:
        tol = t.meaning.tolerate
        full = t.meaning.severity
        if tol is None or full <= Severity.WARNING:
            return full
        recent = [x for x in self._recent.get(key, ()) if now - x <= tol.window]
        persist = tol.persist if tol.persist is not None else tol.window
        if len(recent) >= tol.count or (t.state and now - c.first_seen >= persist):
            t.earned = True
            return full
        if c.sticky and t.earned:  # a sticky fault that earned its full severity keeps it until reboot or
            return full            # acknowledgement (a soft lockup that repeated), however old the repeats
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
        fold = self._folds.pop(key, None)
        if fold is not None:
            self._tracked -= len(fold.components.hashes) + len(fold.codes.hashes)
        else:
            self._per_code[key[1]] -= 1
            if self._per_code[key[1]] <= 0:
                del self._per_code[key[1]]
        # Why it cleared goes first and keeps its length: the condition's older evidence makes room.
        evidence = bounds.evidence({**why, **{k: v for k, v in cond.evidence.items() if k not in why}}, keep=why)
        return Event(EventKind.CLEARED, replace(cond, evidence=evidence), now)


def _fold_text(key: Key, fold: _Fold) -> tuple[str, dict[str, str]]:
    """A fold-over's message and evidence, from what it has folded so far."""
    component, code = key
    folded = fold.components.count
    n = f"{folded}" if fold.exact else f"at least {folded}"
    examples = fold.components.text()
    if key == CATCH_ALL:
        codes = fold.codes.text()
        message = (f"{n} components over {fold.limit} folded here, with {fold.codes.count} codes ({codes}); "
                   f"e.g. {examples}")
        evidence = {"folded": str(folded), "limit": fold.limit, "examples": examples, "codes": codes}
    else:
        family = "components" if component == "*" else f"{component[:-2]} components"
        message = f"{n} more {family} with {code} than {fold.limit} allows, folded here; e.g. {examples}"
        evidence = {"folded": str(folded), "limit": fold.limit, "examples": examples}
    if newest := fold.components.newest_text():
        message += f"; newest {newest}"
        evidence["newest"] = newest
    if not fold.exact:
        evidence["folded_exact"] = "false"
    return bounds.text(message, bounds.MAX_MESSAGE), evidence


def _restored_fold(c: Condition) -> _Fold:
    """A fold-over from the event log: its count goes on from the committed one."""
    components = _Distinct.restored(c.evidence.get("examples", ""), c.evidence.get("folded", "0"),
                                    c.evidence.get("newest", ""))
    components.hashes = set()  # the committed examples are not re-counted: only the count goes on
    return _Fold(limit=c.evidence.get("limit", ""), components=components,
                 codes=_Distinct.restored(c.evidence.get("codes", "")))
