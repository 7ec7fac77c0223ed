"""Turn API messages into text: human tables and JSON.

Pure functions of protobuf messages plus an explicit `now` and `width`, so every layout is testable
without a daemon, a clock or a terminal.

Every text in a message came from outside robustctl: a kernel line, a process's command line, a
peer's error. Human output passes each such field through `printable` (table cells and `lines` do it
for their callers), so an escape sequence in a device name cannot recolour, retitle or rewrite the
operator's terminal, and a newline in a message cannot break a table row. JSON needs none of this:
json.dumps escapes control characters itself and stays the exact data.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from robustd.api.v1 import robustd_pb2 as pb
from robustd.durations import format_duration

DEFAULT_WIDTH = 80
_MIN_MESSAGE = 20  # a message column narrower than this is useless; let the line overflow instead
_ELLIPSIS = "..."

# Unicode categories a terminal acts on instead of drawing: Cc (C0 controls, DEL, C1 controls: ESC
# sequences, BEL, CR, backspace, and the 8-bit CSI U+009B), Cf (invisible format characters: bidi
# overrides and isolates that reorder what is shown, zero-width characters, tag characters), Cs
# (lone surrogates from undecodable bytes, which would make print() raise), Zl and Zp (line breaks).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")  # candidates only; printable ASCII is never looked at twice
_CUT_ESCAPE = re.compile(r"\\(?:x[0-9a-f]?|u[0-9a-f]{0,3}|U[0-9a-f]{0,7})?$")

# Colour marks severities only (robustctl turns it on for a terminal without NO_COLOR). These SGR
# sequences are the only raw escapes robustctl ever prints: `plain` strips exactly them, so output.py
# can check that everything else in a coloured block was escaped like any other human output.
_SEVERITY_SGR = {"CRITICAL": "\x1b[1;31m", "WARNING": "\x1b[33m", "OK": "\x1b[32m"}
_RESET = "\x1b[0m"
_OUR_SGR = re.compile(r"\x1b\[(?:1;31|33|32|0)m")


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    if unicodedata.category(ch) not in _UNSAFE_CATEGORIES:
        return ch
    if ch in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """One field of outside text made safe for a terminal, on one line.

    Control and invisible format characters become Python-style escapes (`\\x1b`, `\\n`, `\\u202e`) that
    the operator can read and report; everything a terminal merely draws (accents, CJK, emoji) is kept.
    Backslashes are left alone, so ordinary text is unchanged and printable(printable(x)) == printable(x).
    """
    if text.isascii() and text.isprintable():
        return text
    return _NOT_PLAIN.sub(_escape, text)


def terminal(text: str) -> str:
    """Whole output made safe: its own line breaks kept, anything else `printable` would escape escaped.

    The last line of defence at print time, for a renderer that forgot a field; the fields themselves
    are escaped where they are laid out, so a newline inside one never splits a row.
    """
    return "\n".join(printable(line) for line in text.split("\n"))


def paint(name: str, colour: bool) -> str:
    """A severity name (`CRITICAL`, `WARNING`, `OK`) in its colour when `colour`; anything else as it is."""
    sgr = _SEVERITY_SGR.get(name) if colour else None
    return f"{sgr}{name}{_RESET}" if sgr else name


def plain(text: str) -> str:
    """`text` without the colour `paint` added (and nothing else removed)."""
    return _OUR_SGR.sub("", text)


def lines(parts: Iterable[str]) -> str:
    """Join lines that embed outside fields, each made `printable`: a field cannot start a new line."""
    return "\n".join(printable(line) for line in parts)


def to_dict(msg: Message) -> dict[str, Any]:
    """ProtoJSON with proto field names, enum names, RFC 3339 times, and integers that jq can compare."""
    return json_format.MessageToDict(msg, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True, unquote_int64_if_possible=True)


def to_json(msg: Message, indent: int | None = 2) -> str:
    """One message as JSON text; `indent=None` gives the one-line form `watch --json` streams."""
    return json.dumps(to_dict(msg), indent=indent, sort_keys=False)


def short_enum(enum_type: Any, value: int) -> str:
    """`SEVERITY_CRITICAL` -> `CRITICAL`: the prefix is noise in a table."""
    try:
        name: str = enum_type.Name(value)
    except ValueError:
        return str(value)
    prefix = enum_type.DESCRIPTOR.values[0].name.removesuffix("UNSPECIFIED")
    return name.removeprefix(prefix)


def severity_name(value: int) -> str:
    return short_enum(pb.Severity, value)


def action_name(value: int) -> str:
    return short_enum(pb.Action, value)


def kind_name(value: int) -> str:
    return short_enum(pb.EventKind, value)


def relative(ts: Timestamp, now: float) -> str:
    """`3s ago`, `5m ago`: what an operator reads at a glance; `never` for an unset time."""
    if ts.seconds == 0 and ts.nanos == 0:
        return "never"
    delta = now - ts.ToNanoseconds() / 1e9
    ahead = delta < -1.0  # clock skew between client and daemon; say so rather than lie
    secs = int(abs(delta))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            text = f"{secs // size}{unit}"
            break
    else:
        text = f"{secs}s"
    return f"in {text}" if ahead else f"{text} ago"


def local_time(ts: Timestamp) -> str:
    """Local wall-clock time to the millisecond, for event lines."""
    if ts.seconds == 0 and ts.nanos == 0:
        return "-"
    dt = datetime.fromtimestamp(ts.ToNanoseconds() / 1e9)
    return dt.strftime("%Y-%m-%d %H:%M:%S.") + f"{dt.microsecond // 1000:03d}"


def duration(d: Duration) -> str:
    if d.seconds == 0 and d.nanos == 0:
        return "-"
    return format_duration(round(d.ToNanoseconds() / 1e9, 6))


def truncate(text: str, width: int) -> str:
    """One line of at most `width` characters (`printable`, so a newline cannot break the table)."""
    text = printable(text)
    if len(text) <= width:
        return text
    if width <= len(_ELLIPSIS):
        return text[:width]
    # Never end on half an escape such as `\x1`: it would read as a different character.
    return _CUT_ESCAPE.sub("", text[: width - len(_ELLIPSIS)]) + _ELLIPSIS


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None = DEFAULT_WIDTH,
          colour_column: int | None = None, colour: bool = False) -> str:
    """Left-aligned columns; the last column is cut so each line fits `width` when it can (None: never cut,
    `--wide`). With `colour`, the severity names in `colour_column` are painted after the padding.

    Every cell is made `printable` here, so no caller can forget an outside field.
    """
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(cell))
    fixed = sum(widths[:-1]) + 2 * (len(headers) - 1)
    last_width = None if width is None else max(width - fixed, _MIN_MESSAGE)
    out = []
    for n, row in enumerate([list(headers), *rows]):
        cells = [paint(cell, colour and n > 0 and i == colour_column) + " " * (widths[i] - len(cell))
                 for i, cell in enumerate(row[:-1])]
        cells.append(row[-1] if last_width is None else truncate(row[-1], last_width))
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def verdict_summary(v: pb.Verdict, colour: bool = False) -> str:
    """The one line a person or a log grep needs: node, severity, action, how many, where in the log."""
    sev = severity_name(v.severity)
    action = "" if v.action in (pb.ACTION_NONE, pb.ACTION_UNSPECIFIED) else f" (action {action_name(v.action)})"
    first = (printable(f"node {v.node}: ") + paint(sev, colour)
             + printable(f"{action}, {plural(len(v.conditions), 'condition')}, seq {v.seq}"))
    out: list[str] = []
    if v.emulated:
        out.append(f"EMULATED: {', '.join(v.emulated)} (not real hardware)")
    if v.event_log_error:
        out.append(f"EVENT LOG NOT WRITABLE: {v.event_log_error}; {plural(v.events_held, 'change')} held in memory "
                   "(conditions below are current)")
    if v.conditions_omitted or v.conditions_trimmed:
        out.append(f"TOO BIG TO SEND WHOLE: {plural(v.conditions_omitted, 'condition')} left out, "
                   f"{v.conditions_trimmed} shown without evidence or message (the severity counts them all)")
    return "\n".join([first, lines(out)]) if out else first


def verdict_text(v: pb.Verdict, now: float, width: int | None = DEFAULT_WIDTH, colour: bool = False) -> str:
    """Summary line, then the conditions worst first."""
    summary = verdict_summary(v, colour)
    if not v.conditions:
        return summary
    conds = sorted(v.conditions, key=lambda c: (-c.severity, c.component, c.code))
    rows = [[severity_name(c.severity), c.component, c.code, action_name(c.action), str(c.count),
             relative(c.last_seen, now), "sticky" if c.sticky else "", c.message] for c in conds]
    headers = ["SEVERITY", "COMPONENT", "CODE", "ACTION", "COUNT", "LAST SEEN", "STICKY", "MESSAGE"]
    return summary + "\n" + table(headers, rows, width, colour_column=0, colour=colour)


def event_line(e: pb.Event, colour: bool = False) -> str:
    """One event per line for `watch` and `ack`: time, seq, kind, severity, component, code, message."""
    c = e.condition
    mark = " [snapshot]" if e.snapshot else ""
    head = printable(f"{local_time(e.at)}  seq {e.seq}  {kind_name(e.kind)}{mark}  ")
    tail = printable(f"  {c.component}  {c.code}  {c.message}").rstrip()
    return head + paint(severity_name(c.severity), colour) + tail


def events_text(resp: pb.ListEventsResponse, width: int | None = DEFAULT_WIDTH, colour: bool = False) -> str:
    if not resp.events:
        return "no events"
    rows = [[local_time(e.at), str(e.seq), kind_name(e.kind), severity_name(e.condition.severity),
             e.condition.component, e.condition.code, e.condition.message] for e in resp.events]
    headers = ["TIME", "SEQ", "KIND", "SEVERITY", "COMPONENT", "CODE", "MESSAGE"]
    more = (f"\n(cut at the message limit: {plural(len(resp.events), 'event')} shown; newer ones follow seq "
            f"{resp.next_after_seq}, e.g. robustctl watch --from-seq {resp.next_after_seq})" if resp.truncated else "")
    return table(headers, rows, width, colour_column=3, colour=colour) + more


def checks_text(resp: pb.ListChecksResponse, now: float, width: int | None = DEFAULT_WIDTH) -> str:
    if not resp.checks:
        return "no checks"
    rows = [[c.name, "yes" if c.enabled else "no", c.mode or "-", duration(c.interval),
             short_enum(pb.CheckStatus, c.status), relative(c.last_run, now), duration(c.last_duration),
             str(c.runs), str(c.failures), "; ".join(x for x in (c.last_error, c.note) if x)] for c in resp.checks]
    headers = ["NAME", "ENABLED", "MODE", "INTERVAL", "STATUS", "LAST RUN", "LAST DURATION", "RUNS", "FAILURES",
               "LAST ERROR / NOTE"]
    return table(headers, rows, width)
