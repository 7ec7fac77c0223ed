"""Find the failure lines in one log: rule matches and Python tracebacks no rule explains.

Cost is bounded by the tail read (1 MiB by default), not the file: the gates are searched with
bytes.find over the tail, only the lines holding one are decoded and matched, each line at most
`MAX_LINE` bytes, and each gate yields at most `MAX_LINES_PER_GATE` lines (a rank that printed
the same warning 100,000 times shows its first ones). A timestamp missing from a matched line is
borrowed from the nearest earlier line of the same rank that has one (`LOOKBACK` lines at most).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from robustd.triage.lines import clean, rank_in, rank_of_file, split_prefix_weighted, stamp
from robustd.triage.model import LogText
from robustd.triage.rules import MAX_LINE, Rule, RuleSet

TRACEBACK = b"Traceback (most recent call last)"
CHAIN = (b"During handling of the above exception", b"The above exception was the direct cause")
# torchrun's shutdown of the other workers once one failed (torch/distributed/elastic/multiprocessing/api.py,
# 'Sending process %s closing signal %s'): what follows it is the job ending
SHUTDOWN = b" closing signal SIG"
MAX_LINES_PER_GATE = 2000
MAX_TRACEBACKS = 200
MAX_TRACEBACK_LINES = 400  # a traceback longer than this (deep recursion) is judged on what was read
LOOKBACK = 40
BARE_EXCEPTION_PRIORITY = 15  # above a launcher's summary (10), below a hang (20) and NCCL (40)
_EXCEPTION = re.compile(rb"((?:[A-Za-z_][A-Za-z0-9_]{0,60}\.){0,8}[A-Z][A-Za-z0-9_]{0,60}(?:Error|Exception))(?::|\Z)")


@dataclass
class Hit:
    """One failure line: what claimed it, where it is, who printed it and when."""

    klass: str
    tier: str
    priority: int
    infra: str
    next: str
    level: str | None
    description: str
    rule: str
    log: int  # index of the log in the triage
    name: str
    line: int
    offset: int
    text: bytes
    rank: int | None
    ts: float | None
    rank_weight: int = 0  # 2: a global rank (prefix, [Rank N], file name); 1: a local rank or srun task
    extra: list[tuple[int, int, bytes]] = field(default_factory=list)  # (line, offset, text) shown with it


class LogScan:
    """One log's tail, split into lines on demand."""

    def __init__(self, log: LogText, index: int, rules: RuleSet):
        self.log, self.index, self.rules = log, index, rules
        self.data = log.data
        self.start = 0
        if not log.whole:  # the tail begins inside a line: that line is not judged
            nl = self.data.find(b"\n")
            self.start = len(self.data) if nl == -1 else nl + 1
        self.file_rank = rank_of_file(log.name)
        self._counted = (self.start, 1)  # (position, its line number): counting resumes from here

    # --- lines -------------------------------------------------------------------------------

    def line_start(self, i: int) -> int:
        j = self.data.rfind(b"\n", self.start, i)
        return self.start if j == -1 else j + 1

    def line_end(self, ls: int) -> int:
        j = self.data.find(b"\n", ls)
        return len(self.data) if j == -1 else j

    def line_no(self, ls: int) -> int:
        pos, n = self._counted
        if ls < pos:
            pos, n = self.start, 1
        n += self.data.count(b"\n", pos, ls)
        self._counted = (ls, n)
        return n

    def parts(self, ls: int) -> tuple[bytes, int | None, bytes, int]:
        """(prefix, prefix rank, cleaned body, end) of the line starting at `ls`."""
        le = self.line_end(ls)
        prefix, rank, body, _ = split_prefix_weighted(self.data[ls:min(le, ls + MAX_LINE)])
        return prefix, rank, clean(body), le

    def rank(self, ls: int, body: bytes) -> tuple[int | None, int]:
        """(rank, weight) of the line at `ls`: its prefix's, else one it names, else the file's."""
        prefix, rank, _, weight = split_prefix_weighted(self.data[ls:ls + 128])
        named = rank_in(body)
        if rank is not None and (weight == 2 or named is None or named[1] < 2):
            return rank, weight
        if named is not None:
            return named
        if body.lstrip().startswith(b"exitcode") and ls > self.start:  # torchrun's table: "rank : 3" above
            above = rank_in(self.parts(self.line_start(ls - 1))[2])
            if above is not None:
                return above
        return (self.file_rank, 2) if self.file_rank is not None else (None, 0)

    def stamp_at(self, ls: int, prefix: bytes, body: bytes) -> float | None:
        """This line's timestamp, else the nearest earlier one printed under the same prefix."""
        ts = stamp(body)
        n = 0
        while ts is None and ls > self.start and n < LOOKBACK:
            ls = self.line_start(ls - 1)
            p, _, b, _ = self.parts(ls)
            n += 1
            if p == prefix:
                ts = stamp(b)
        return ts

    # --- failure lines -----------------------------------------------------------------------

    def candidate_lines(self) -> tuple[list[int], list[int]]:
        """(starts of the lines holding a gate, starts of the lines holding a traceback header), in order."""
        gated: set[int] = set()
        tracebacks: set[int] = set()
        for gate in (*self.rules.gates, TRACEBACK):
            into = tracebacks if gate is TRACEBACK else gated
            i = self.data.find(gate, self.start)
            n = 0
            while i != -1 and n < (MAX_TRACEBACKS if gate is TRACEBACK else MAX_LINES_PER_GATE):
                into.add(self.line_start(i))
                n += 1
                i = self.data.find(gate, self.line_end(i))
        return sorted(gated), sorted(tracebacks)

    def hits(self) -> list[Hit]:
        out: list[Hit] = []
        claimed: set[int] = set()
        gated, tracebacks = self.candidate_lines()
        for ls in gated:
            prefix, _, body, _ = self.parts(ls)
            rule = self.rules.claim(body)
            if rule is None:
                bare = self._bare_exception(ls, prefix, body)
                if bare is not None:
                    out.append(bare)
                continue
            claimed.add(ls)
            out.append(self._hit(rule, ls, prefix, body))
        head = self._headless()
        if head is not None:
            tracebacks.insert(0, head)
        judged: set[int] = set()  # exception lines of tracebacks: judged with their traceback, not alone
        for ls in tracebacks:
            hit = self._traceback(ls, claimed, judged)
            if hit is not None:
                out.append(hit)
        return [h for h in out if h.rule != "python-exception" or h.offset - self.log.offset not in judged]

    def _found(self, at: int, body: bytes, prefix: bytes, stamped: tuple[int, bytes], *, klass: str, tier: str,
               priority: int, infra: str, next: str, level: str | None, description: str, rule: str) -> Hit:
        """A failure line at `at`: where it is, who printed it, and when (the timestamp of `stamped`,
        (line start, body), or of the nearest earlier line printed under `prefix`)."""
        rank, weight = self.rank(at, body)
        return Hit(klass=klass, tier=tier, priority=priority, infra=infra, next=next, level=level,
                   description=description, rule=rule, log=self.index, name=self.log.name, line=self.line_no(at),
                   offset=self.log.offset + at, text=self.text(at), rank=rank, rank_weight=weight,
                   ts=self.stamp_at(stamped[0], prefix, stamped[1]))

    def _hit(self, rule: Rule, ls: int, prefix: bytes, body: bytes) -> Hit:
        return self._found(ls, body, prefix, (ls, body), klass=rule.klass, tier=rule.tier, priority=rule.priority,
                           infra=rule.infra, next=rule.next, level=rule.level, description=rule.description,
                           rule=rule.name)

    def text(self, ls: int) -> bytes:
        """The whole line as printed (prefix included, colours removed), for evidence."""
        return clean(self.data[ls:min(self.line_end(ls), ls + MAX_LINE)])

    def _bare_exception(self, ls: int, prefix: bytes, body: bytes) -> Hit | None:
        """`SomeError: message` on a line of its own, no rule claiming it: weak evidence of user code.

        Its traceback may be cut off (an excerpt, a tail) or printed elsewhere; a symptom of low
        priority, it decides only over a launcher's "child failed" summary, never over a hang or an
        NCCL failure seen elsewhere.
        """
        m = _EXCEPTION.match(body)
        if m is None:
            return None
        kind = m.group(1).rsplit(b".", 1)[-1].decode("ascii")
        if kind in self.rules.not_user_code:
            return None
        spec = self.rules.classes["user_code"]
        return self._found(ls, body, prefix, (ls, body), klass="user_code", tier="symptom",
                           priority=BARE_EXCEPTION_PRIORITY, infra=spec.infra, next=spec.next, level=None,
                           description=f"{kind} raised (its traceback is not in the logs)", rule="python-exception")

    def _headless(self) -> int | None:
        """-1 when the log begins inside a traceback (its header cut off by the tail): frames first."""
        pos = self.start
        for _ in range(3):
            if pos >= len(self.data):
                return None
            _, _, body, end = self.parts(pos)
            if body.strip():
                return -1 if body.lstrip().startswith(b'File "') else None
            pos = end + 1
        return None

    def _traceback(self, ls: int, claimed: set[int], judged: set[int]) -> Hit | None:
        """A traceback whose exceptions no rule claimed: user_code, unless it was handled or is a launcher's."""
        if ls == -1:  # the window starts in the traceback's frames
            prefix, prank, head, le = self.parts(self.start)[:2] + (b"", self.start - 1)
        else:
            prefix, prank, head, le = self.parts(ls)
        base = len(head) - len(head.lstrip(b" "))
        exceptions: list[tuple[int, bytes]] = []  # (line start, body) of each exception in the chain
        frame: tuple[int, bytes] | None = None
        pos, n, after = le + 1, 0, None
        while pos < len(self.data) and n < MAX_TRACEBACK_LINES:
            p, r, body, end = self.parts(pos)
            n += 1
            here, pos = pos, end + 1
            if p != prefix and (r is not None or prank is not None):
                continue  # another rank's line, interleaved
            text = body.strip(b" \t")
            if not text:
                continue
            indent = len(body) - len(body.lstrip(b" "))
            if after is not None:  # an exception was read: only a chain marker continues the traceback
                if text.startswith(CHAIN) or text.startswith(TRACEBACK):
                    after = None
                    continue
                after += 1
                if after > 20:
                    break
                continue
            if text.startswith(TRACEBACK) or text.startswith(CHAIN):
                continue
            if text.startswith(b'File "'):  # a frame, however an excerpt indented it
                frame = (here, body)
                continue
            if indent > base or text.startswith(b"^") or text.startswith(b"~"):
                continue
            exceptions.append((here, body))
            after = 0
        judged.update(at for at, _ in exceptions)
        if not exceptions or any(at in claimed for at, _ in exceptions):
            return None
        at, body = exceptions[-1]
        kind = body.strip().split(b":", 1)[0].rsplit(b".", 1)[-1].decode("ascii", "replace")
        if not kind.isidentifier() or kind in self.rules.not_user_code:
            return None
        tier = "context" if self._lines_after(at, prefix) >= self.rules.handled_after else "cause"
        spec = self.rules.classes["user_code"]
        hit = self._found(at, body, prefix, (max(ls, self.start), head), klass="user_code", tier=tier,
                          priority=spec.priority, infra=spec.infra, next=spec.next, level=None,
                          description=f"{kind} raised in the job's code" if tier == "cause"
                          else f"{kind} raised and handled (the job printed more after it)", rule="python-traceback")
        if frame is not None:
            hit.extra.append((self.line_no(frame[0]), self.log.offset + frame[0], self.text(frame[0])))
        return hit

    def _lines_after(self, ls: int, prefix: bytes) -> int:
        """Lines printed under the same prefix after `ls` and before the launcher began shutting the job
        down (up to the handled_after bound): the other ranks' output while torchrun SIGTERMs them is the
        end of the job, not the job carrying on after a handled exception."""
        limit = self.rules.handled_after
        end = self.data.find(SHUTDOWN, ls)
        end = len(self.data) if end == -1 else end
        if not prefix:
            return min(limit, self.data.count(b"\n", ls, end) - self.data.count(b" NCCL INFO ", ls, end))
        n, pos = 0, self.line_end(ls) + 1
        needle = b"\n" + prefix
        while n < limit:
            pos = self.data.find(needle, pos, end)
            if pos == -1:
                break
            n += 1
            pos += len(needle)
        return n


def scan(log: LogText, index: int, rules: RuleSet) -> list[Hit]:
    return LogScan(log, index, rules).hits()
