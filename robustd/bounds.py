"""Size limits for every text that reaches a condition, and the functions that apply them.

Kernel lines, check messages, diagnostic details and operators' acknowledgements all end up in
conditions, and every condition ends up in an event that the log keeps and the API sends whole
(Watch, ListEvents, GetVerdict). An event too big to send would be written once and then break
every reader at its seq, so the limits are applied in two places:

- where data enters the policy (robustd/policy.py): findings, their source, the (component, code)
  of an acknowledgement, the boot id, and the texts the policy builds itself (merged evidence,
  fold-over messages, why a condition cleared). Only the policy makes conditions, so every event the
  engine writes is bounded, and the store writes what it is handed;
- where a condition is read back from the log (store.condition_from_json), so that rows written by a
  version before these bounds are sendable too.

The limits below give a condition of at most `MAX_CONDITION_BYTES` serialised (tests check it), so
the policy's default caps (1,000 conditions, 64 fold-overs and one catch-all: policy.py) make a
GetVerdict of about 2.2 MB at worst, half of the default 4 MiB `listen.max_message_bytes`.

Every function here is idempotent: bounding a bounded value returns it unchanged (the very object,
for a condition), so a condition that was bounded when made costs one cheap check when read back.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Collection, Mapping

from robustd.model import Condition, Finding

MAX_COMPONENT = 128  # bytes; gpu/<bus id>, ib/<dev>/<port>, disk/<mount>, ...
MAX_CODE = 64  # UPPER_SNAKE codes (XID_79, DIAG_ALL_TO_ALL_FAILED)
MAX_SOURCE = 64  # check names
MAX_BOOT_ID = 64  # a kernel boot id is 36
MAX_MESSAGE = 512  # one condition's message
MAX_REASON = 512  # an Acknowledge reason (it becomes one evidence value, so no larger than one)
MAX_EVIDENCE_ENTRIES = 16
MAX_EVIDENCE_KEY = 64
MAX_EVIDENCE_VALUE = 512
MAX_EVIDENCE_BYTES = 1024  # keys and values of one condition together
# Serialised pb.Condition with every text at its limit, every number at its largest (tests/test_bounds.py).
MAX_CONDITION_BYTES = 2100
MAX_ECHO = 80  # characters of caller input an error message may quote

TRUNCATED_ENTRIES = "truncated_entries"  # evidence key: how many entries did not fit
_MIN_MARKED = 40  # below this many bytes a text is cut without the marker (the marker would not fit)


def text(value: str, limit: int) -> str:
    """`value` in at most `limit` UTF-8 bytes; a cut one ends with "… [truncated N bytes]"."""
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a lenient decode): protobuf would refuse it
        raw = value.encode("utf-8", "replace")
        value = raw.decode("utf-8")
    if len(raw) <= limit:
        return value
    if limit < _MIN_MARKED:
        return _cut(raw, limit)
    keep = limit - len(_marker(len(raw)).encode())
    head = _cut(raw, keep)
    return head + _marker(len(raw) - len(head.encode()))


def token(value: str, limit: int) -> str:
    """`value` as a printable-ASCII token (no spaces) of at most `limit` bytes, never empty.

    Every byte outside 0x21..0x7e is written `\\xNN` (of its UTF-8 encoding). A token that is too
    long keeps its start and ends with `~` and 16 hex digits of its hash, so distinct long values
    stay distinct and the same value always maps to the same token.
    """
    if not value:
        return "-"
    if is_token(value, limit):
        return value
    escaped = "".join(ch if "!" <= ch <= "~" else "".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "replace"))
                      for ch in value)
    if len(escaped) <= limit:
        return escaped
    digest = hashlib.blake2b(value.encode("utf-8", "replace"), digest_size=8).hexdigest()
    return escaped[:max(0, limit - 17)] + "~" + digest[:max(0, min(16, limit - 1))]


def is_token(value: str, limit: int) -> bool:
    """Whether `value` is already a token (what an API caller must send for component and code)."""
    return 0 < len(value) <= limit and value.isascii() and value.isprintable() and " " not in value


def echo(value: str) -> str:
    """Caller input quoted in an error message: repr'd, and at most `MAX_ECHO` characters of it."""
    if len(value) <= MAX_ECHO:
        return repr(value)
    return f"{value[:MAX_ECHO]!r}… ({len(value)} characters)"


def evidence(items: Mapping[str, str], keep: Collection[str] = ()) -> dict[str, str]:
    """At most `MAX_EVIDENCE_ENTRIES` entries in `MAX_EVIDENCE_BYTES`; what is dropped is counted.

    Entries keep their order (the first ones win a place), keys become tokens, and when the values
    together are too long the longest ones are cut to a common length, so short entries (a seq, a
    bus id) survive a long kernel line beside them. Values of the keys in `keep` (why a condition
    cleared, an operator's reason) are cut only if they alone do not fit.
    """
    pairs = [(token(str(k), MAX_EVIDENCE_KEY), text(str(v), MAX_EVIDENCE_VALUE)) for k, v in items.items()]
    if len(pairs) <= MAX_EVIDENCE_ENTRIES and _size(pairs) <= MAX_EVIDENCE_BYTES and \
            len({k for k, _ in pairs}) == len(pairs):
        return dict(pairs)
    merged = dict(pairs)  # keys that became equal: the later value wins, as in a dict update
    earlier = merged.pop(TRUNCATED_ENTRIES, "0")  # a count from an earlier bounding carries on
    dropped = int(earlier) if earlier.isdigit() else 0
    kept: list[tuple[str, str]] = []
    key_bytes = 0
    room = MAX_EVIDENCE_ENTRIES - 1  # one place for the count of dropped entries
    for k, v in merged.items():
        # Keys take at most half the budget, so every kept value has room for its first bytes.
        if len(kept) < room and key_bytes + len(k) <= MAX_EVIDENCE_BYTES // 2:
            kept.append((k, v))
            key_bytes += len(k)
        else:
            dropped += 1
    if dropped:
        kept.append((TRUNCATED_ENTRIES, str(dropped)))
        key_bytes += len(TRUNCATED_ENTRIES)
    budget = MAX_EVIDENCE_BYTES - key_bytes
    sizes = [len(v.encode()) for _, v in kept]
    if sum(sizes) > budget:
        fixed = sum(n for (k, _), n in zip(kept, sizes, strict=True) if k in keep)
        if fixed > budget:
            keep = ()
            fixed = 0
        cap = _water_level([n for (k, _), n in zip(kept, sizes, strict=True) if k not in keep], budget - fixed)
        kept = [(k, v if n <= cap or k in keep else text(v, cap)) for (k, v), n in zip(kept, sizes, strict=True)]
    return dict(kept)


def finding(f: Finding) -> Finding:
    """A finding with a bounded component, code, message and evidence (the policy's input)."""
    component, code = token(f.component, MAX_COMPONENT), token(f.code, MAX_CODE)
    message = text(f.message, MAX_MESSAGE)
    if (component, code, message) == (f.component, f.code, f.message) and _evidence_ok(f.evidence):
        return f
    return replace(f, component=component, code=code, message=message, evidence=evidence(f.evidence))


def condition(c: Condition) -> Condition:
    """`c` with every text within its limit; `c` itself when it already is (the common case)."""
    fields = (token(c.component, MAX_COMPONENT), token(c.code, MAX_CODE), text(c.message, MAX_MESSAGE),
              token(c.source, MAX_SOURCE) if c.source else "", token(c.boot_id, MAX_BOOT_ID) if c.boot_id else "")
    if fields == (c.component, c.code, c.message, c.source, c.boot_id) and _evidence_ok(c.evidence):
        return c
    component, code, message, source, boot_id = fields
    return replace(c, component=component, code=code, message=message, source=source, boot_id=boot_id,
                   evidence=evidence(c.evidence))


# -- internals -------------------------------------------------------------------------------------
def _marker(dropped: int) -> str:
    return f"… [truncated {dropped} bytes]"


def _cut(raw: bytes, limit: int) -> str:
    """The longest prefix of `raw` in `limit` bytes that ends on a character boundary."""
    return raw[:max(0, limit)].decode("utf-8", "ignore")


def _size(pairs: list[tuple[str, str]]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in pairs)


def _evidence_ok(items: Mapping[str, str]) -> bool:
    """Cheap test that `evidence(items)` would return the same entries."""
    if len(items) > MAX_EVIDENCE_ENTRIES:
        return False
    total = 0
    for k, v in items.items():
        if not isinstance(k, str) or not isinstance(v, str) or not is_token(k, MAX_EVIDENCE_KEY):
            return False
        try:
            n = len(v.encode("utf-8"))
        except UnicodeEncodeError:
            return False
        if n > MAX_EVIDENCE_VALUE:
            return False
        total += len(k) + n
    return total <= MAX_EVIDENCE_BYTES


def _water_level(sizes: list[int], budget: int) -> int:
    """The largest cap with sum(min(size, cap)) <= budget."""
    ordered = sorted(sizes)
    spent = 0
    for i, n in enumerate(ordered):
        left = len(ordered) - i  # values at least this long share what remains
        if spent + n * left > budget:
            return max(0, (budget - spent) // left)
        spent += n
    return ordered[-1] if ordered else 0
