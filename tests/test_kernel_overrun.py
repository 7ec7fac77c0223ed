"""Kernel-log records lost to a ring overrun are reported, not dropped silently (issue 11, item 16).

When the reader falls behind, the kernel's ring overwrites records it has not read and read(2)
fails EPIPE. Sequence numbers are consecutive, so the gap says how many records were lost. The
unit tests script EPIPE through the reader's read seam; the last test stalls a real daemon with
SIGSTOP, wraps the real /dev/kmsg ring past it, and reads the KMSG_OVERRUN condition from
GetVerdict.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from conftest import KMSG, REAL_BOOT_ID, cond, inject_kmsg, need_root

from checks.kernel import KernelCheck
from checks.kernel.check import OVERRUN_BURST_S
from checks.kernel.kmsg import MAX_PENDING_OVERRUNS, KmsgReader
from robustd.api.v1 import robustd_pb2 as pb
from robustd.check import CheckContext
from robustd.codes import CodeTable
from robustd.model import Action, Finding, FindingKind, Severity
from robustd.roots import Roots

EPIPE = BrokenPipeError(32, "Broken pipe")


def record(seq: int, text: str = "line") -> bytes:
    return f"6,{seq},{seq * 1000},-;{text} {seq}\n".encode()


class ScriptedReader(KmsgReader):
    """A KmsgReader whose read(2) results come from a script (records and EPIPEs), then EAGAIN.

    Its descriptor is a FIFO nobody writes, so an event loop may watch it and never wake.
    """

    def __init__(self, script: list[bytes | BaseException]):
        self.script = script
        self._pipe = os.pipe()
        super().__init__(f"/proc/self/fd/{self._pipe[0]}")

    def _read(self, fd: int) -> bytes:
        if not self.script:
            raise BlockingIOError
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        super().close()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = ()


# --- the reader -------------------------------------------------------------------------------


def test_reader_counts_records_lost_in_each_overrun() -> None:
    with ScriptedReader([record(10), record(11), EPIPE, record(20), record(21), EPIPE, EPIPE, record(30)]) as r:
        got = r.read_available()
        assert [rec.seq for rec in got] == [10, 11, 20, 21, 30]
        gaps = r.take_overruns()
        assert [(g.after_seq, g.next_seq, g.lost) for g in gaps] == [(11, 20, 8), (21, 30, 8)]
        assert (r.overruns, r.records_lost, r.last_seq) == (2, 16, 30)
        assert r.take_overruns() == []  # taken once


def test_reader_epipe_before_any_record_is_an_unknown_loss() -> None:
    with ScriptedReader([EPIPE, record(500)]) as r:
        r.read_available()
        (gap,) = r.take_overruns()
        assert gap.lost is None and (r.overruns, r.records_lost) == (1, 0)


def test_reader_limit_leaves_the_rest_for_the_next_call() -> None:
    with ScriptedReader([record(i) for i in range(1, 11)]) as r:
        assert [rec.seq for rec in r.read_available(limit=4)] == [1, 2, 3, 4]
        assert [rec.seq for rec in r.read_available()] == list(range(5, 11))
        assert r.overruns == 0


def test_reader_keeps_a_bounded_list_but_exact_counters() -> None:
    seqs = [*range(0, MAX_PENDING_OVERRUNS * 30, 10), 100_000]
    script: list[bytes | BaseException] = []
    for seq in seqs[:-1]:
        script += [record(seq), EPIPE]
    with ScriptedReader([*script, record(seqs[-1])]) as r:
        r.read_available()
        assert len(r.take_overruns()) == MAX_PENDING_OVERRUNS
        assert r.overruns == len(seqs) - 1 == MAX_PENDING_OVERRUNS * 3
        assert r.records_lost == sum(b - a - 1 for a, b in itertools.pairwise(seqs))


# --- the check --------------------------------------------------------------------------------


def make_ctx(tmp_path: Path) -> CheckContext:
    boot = tmp_path / "boot_id"
    boot.write_text(Path(REAL_BOOT_ID).read_text())
    return CheckContext(name="kernel", node_name="test", roots=Roots(boot_id=str(boot)),
                        config=KernelCheck.Config.model_validate({"lookback": "0s"}), state_dir=str(tmp_path),
                        cursor={})


class ScriptedCheck(KernelCheck):
    def __init__(self, script: list[bytes | BaseException]):
        super().__init__()
        self.script = script

    def _open_reader(self, path: str) -> KmsgReader:
        return ScriptedReader(self.script)


def overrun(findings: tuple[Finding, ...] | list[Finding]) -> Finding:
    (f,) = [f for f in findings if f.code == "KMSG_OVERRUN"]
    return f


@pytest.mark.asyncio
async def test_check_reports_overrun_with_counts_and_logs_once_per_burst(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    check = ScriptedCheck([record(10), record(11), EPIPE, record(20), record(21)])
    ctx = make_ctx(tmp_path)
    caplog.set_level(logging.WARNING, logger=ctx.log.name)
    await check.start(ctx)
    try:
        it = check.watch()
        first = await asyncio.wait_for(anext(it), 1)
        f = overrun(first.findings)
        assert (f.component, f.kind) == ("check/kernel", FindingKind.OCCURRENCE)
        assert f.evidence["records_lost"] == "8" and f.evidence["records_lost_total"] == "8"
        assert (f.evidence["last_seq_before"], f.evidence["first_seq_after"]) == ("11", "20")
        assert "8 records were overwritten" in f.message and "(seq 12..19)" in f.message
        assert f.at is not None and abs(f.at - time.time()) < 5
        assert (check.overruns, check.records_lost) == (1, 8)

        check.script += [record(22), EPIPE, record(40), EPIPE, record(45)]  # two more, one wake-up
        check._on_readable()
        f = overrun((await asyncio.wait_for(anext(it), 1)).findings)
        assert (f.evidence["records_lost"], f.evidence["overruns"]) == ("21", "2")
        assert (f.evidence["records_lost_total"], f.evidence["overruns_total"]) == ("29", "3")
        assert (check.overruns, check.records_lost) == (3, 29)
        assert len([r for r in caplog.records if "overwritten" in r.getMessage()]) == 1  # one burst

        check._last_overrun -= OVERRUN_BURST_S  # quiet long enough: the next overrun is a new burst
        check.script += [EPIPE, record(50)]
        check._on_readable()
        f = overrun((await asyncio.wait_for(anext(it), 1)).findings)
        assert f.evidence["records_lost"] == "4" and (check.overruns, check.records_lost) == (4, 33)
        lines = [r.getMessage() for r in caplog.records if "overwritten" in r.getMessage()]
        assert len(lines) == 2 and "33 records lost in 4 overruns" in lines[1]
    finally:
        await check.close()


@pytest.mark.asyncio
async def test_no_overrun_no_finding(tmp_path: Path) -> None:
    check = ScriptedCheck([record(i) for i in range(1, 6)])
    await check.start(make_ctx(tmp_path))
    try:
        first = await asyncio.wait_for(anext(check.watch()), 1)
        assert [f for f in first.findings if f.code == "KMSG_OVERRUN"] == []
        assert (check.overruns, check.records_lost) == (0, 0)
    finally:
        await check.close()


def test_overrun_code_means_warning_none_not_sticky() -> None:
    codes = KernelCheck().codes()
    assert codes["KMSG_OVERRUN"].description
    m = CodeTable([codes]).resolve("KMSG_OVERRUN", hint_severity=None, hint_action=None,
                                   default_clear_after=300, default_escalate=2)
    assert (m.severity, m.action, m.sticky, m.clear_after) == (Severity.WARNING, Action.NONE, False, 300)


# --- a real overrun through a real daemon ---------------------------------------------------------


def _seqs() -> tuple[int, int]:
    """The oldest and newest seq the kernel still holds."""
    with KmsgReader(KMSG) as r:
        recs = r.read_available() + r.flush()
    return recs[0].seq, recs[-1].seq


def _seq_of(text: str) -> int:
    with KmsgReader(KMSG) as r:
        return next(rec.seq for rec in r.read_available() if rec.message == text)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_real_overrun_while_daemon_is_stalled_reaches_getverdict(make_daemon, tmp_path: Path) -> None:
    need_root("stalling a daemon and flooding /dev/kmsg")
    token = f"rdt{uuid.uuid4().hex[:12]}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"rules:\n  - code: RDT_READY\n    pattern: '{token} ready'\n")
    d = make_daemon({"checks": {"kernel": {"rules": [str(rules)]}}})
    d.start()
    inject_kmsg(f"{token} ready")
    d.wait_for(lambda v: any(c.code == "RDT_READY" for c in v.conditions), timeout=10)
    ready = _seq_of(f"{token} ready")  # the daemon has read at least this far
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while not _stopped(d.proc.pid):
            assert time.monotonic() < deadline, "the daemon did not stop"
            time.sleep(0.01)
        inject_kmsg(f"{token} stalled")  # written after the daemon stopped reading
        stalled = _seq_of(f"{token} stalled")
        filler = f"robustd-test overrun filler {token} " + "x" * 800
        for i in range(100_000):  # until the ring no longer holds the first record the daemon missed
            inject_kmsg(f"{filler} {i}")
            if i % 64 == 63 and _seqs()[0] > stalled:
                break
        else:
            raise AssertionError("the kernel ring never wrapped after 80 MB of lines")
        oldest = _seqs()[0]
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    v = d.wait_for(lambda v: cond(v, "KMSG_OVERRUN", "check/kernel") is not None, timeout=15)
    c = cond(v, "KMSG_OVERRUN", "check/kernel")
    assert c is not None
    assert (c.severity, c.action, c.sticky) == (pb.SEVERITY_WARNING, pb.ACTION_NONE, False)
    lost = int(c.evidence["records_lost_total"])
    newest = _seqs()[1]
    # The daemon read `ready` and never `stalled`; it resumed at `oldest` or later.
    assert oldest - stalled <= lost <= newest - ready - 1, (oldest, stalled, lost, newest, ready)
    assert f"{c.evidence['records_lost']} records were overwritten" in c.message
    logged = [line for line in d.log().splitlines() if "records were overwritten" in line]
    assert 1 <= len(logged) <= 2, logged  # one line per burst, not one per record
