"""The kmsg parser on literal records, and the reader and KernelCheck on the real /dev/kmsg."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import KMSG, REAL_BOOT_ID, need_root

from checks.kernel import KernelCheck
from checks.kernel.kmsg import Joiner, KmsgReader
from checks.kernel.parse import KmsgRecord, parse_record
from robustd.check import CheckContext
from robustd.model import FindingBatch
from robustd.roots import Roots, read_boot_id

# --- parser -----------------------------------------------------------------------------------


def test_parse_plain_record_ignores_dictionary() -> None:
    raw = b"6,1234,5678901,-;pcieport 0000:00:01.0: AER: Corrected error\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:01.0\n"
    rec = parse_record(raw)
    assert rec == KmsgRecord(seq=1234, ts_usec=5678901, facility=0, level=6,
                             message="pcieport 0000:00:01.0: AER: Corrected error", flags="-")


def test_parse_facility_level_and_extra_header_fields() -> None:
    rec = parse_record(b"14,7,99,-,caller=T123;hello; world\n")
    assert rec is not None
    assert (rec.facility, rec.level, rec.seq, rec.ts_usec, rec.message) == (1, 6, 7, 99, "hello; world")


def test_parse_unescapes_and_splits_lines() -> None:
    rec = parse_record(b"4,1,2,-;a\\x5cb\\x0aNVRM: second line \\xe2\\x9c\\x93\n")
    assert rec is not None
    assert rec.message == "a\\b\nNVRM: second line \u2713"
    assert rec.lines() == ["a\\b", "NVRM: second line \u2713"]


@pytest.mark.parametrize("raw", [b"", b"no header here\n", b"6,x,1,-;bad seq\n", b"6,1;short\n"])
def test_parse_rejects_garbage(raw: bytes) -> None:
    assert parse_record(raw) is None


def test_continuation_fragments_join() -> None:
    j = Joiner()
    first = parse_record(b"6,10,100,c;NVRM: Xid (PCI:0000:3b:00): 79, \n")
    more = parse_record(b"6,11,101,+;GPU has fallen off the bus.\n")
    after = parse_record(b"6,12,102,-;next\n")
    assert first and more and after
    assert j.add(first) == [] and j.holding
    assert j.add(more) == []
    out = j.add(after)
    assert [r.message for r in out] == ["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", "next"]
    assert (out[0].seq, out[0].ts_usec, out[0].flags) == (11, 100, "-")
    assert j.add(first) == [] and [r.seq for r in j.flush()] == [10] and not j.holding


# --- the real /dev/kmsg -----------------------------------------------------------------------


def write_kmsg(*lines: str) -> None:
    """One write per record; the trailing newline matters: an unterminated record stays
    invisible to readers until the next one arrives."""
    for line in lines:
        fd = os.open(KMSG, os.O_WRONLY)
        try:
            os.write(fd, (line.rstrip("\n") + "\n").encode())
        finally:
            os.close(fd)


def test_real_kmsg_roundtrip() -> None:
    need_root("reading and writing /dev/kmsg")
    token = f"robustd-test-{uuid.uuid4()}"
    with KmsgReader(KMSG) as reader:
        reader.read_available()
        write_kmsg(f"{token} hello")
        deadline = time.monotonic() + 2
        got: list[KmsgRecord] = []
        while not got and time.monotonic() < deadline:
            got = [r for r in reader.read_available() if token in r.message]
            time.sleep(0.01)
    assert len(got) == 1
    rec = got[0]
    assert rec.message == f"{token} hello" and rec.facility == 1
    assert abs(rec.ts_usec / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 5


def test_builtin_list() -> None:
    from checks import BUILTIN  # here, not at the top: a stale editable install sees `checks` as a namespace

    assert BUILTIN[0] is KernelCheck  # the kernel watcher starts first
    names = [c.name for c in BUILTIN]
    assert len(names) == len(set(names)), names
    assert KernelCheck.name == "kernel" and KernelCheck.mode == "watch"


def make_ctx(tmp_path: Path, cursor: dict[str, str] | None = None, **cfg: object) -> CheckContext:
    boot = tmp_path / "boot_id"
    boot.write_text(Path(REAL_BOOT_ID).read_text())
    return CheckContext(name="kernel", node_name="test", roots=Roots(boot_id=str(boot)),
                        config=KernelCheck.Config.model_validate(cfg), state_dir=str(tmp_path),
                        cursor=cursor or {})


async def next_report(it: AsyncIterator[FindingBatch], timeout: float) -> FindingBatch:
    return await asyncio.wait_for(anext(it), timeout)


async def wait_for(it: AsyncIterator[FindingBatch], pred, timeout: float) -> FindingBatch:
    deadline = time.monotonic() + timeout
    while True:
        rep = await next_report(it, max(0.01, deadline - time.monotonic()))
        if any(pred(f) for f in rep.findings):
            return rep


@pytest.mark.asyncio
async def test_kernel_check_reports_injected_xid_79(tmp_path: Path) -> None:
    need_root("reading and writing /dev/kmsg")
    check = KernelCheck()
    ctx = make_ctx(tmp_path, lookback="0s")
    assert check.supported(ctx) is None
    await check.start(ctx)
    try:
        assert "XID_79" in check.codes()
        it = check.watch()
        first = await next_report(it, 1)
        boot = read_boot_id(ctx.roots.boot_id)
        assert first.check == "kernel" and first.cursor and first.cursor["boot_id"] == boot
        name = f"rdt{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        write_kmsg(f"NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name={name}, GPU has fallen off the bus.")
        rep = await wait_for(it, lambda f: f.evidence.get("name") == name, 1.0)
        assert time.monotonic() - t0 < 1.0
        f = next(f for f in rep.findings if f.evidence.get("name") == name)
        assert (f.code, f.component) == ("XID_79", "gpu/0000:3b:00.0")
        assert f.at is not None and abs(f.at - time.time()) < 5
        assert rep.cursor is not None and int(rep.cursor["seq"]) >= int(f.evidence["seq"])
    finally:
        await check.close()


def _token_rules(tmp_path: Path, token: str) -> str:
    """A rule file matching only this test's lines, so the test injects no real-looking faults."""
    p = tmp_path / "test-rules.yaml"
    p.write_text(
        "rules:\n"
        f"  - code: 'RDT_{{n}}'\n    pattern: '{token} line (?P<n>\\d+)'\n"
        f"  - code: RDT_PAIR\n    lines: 2\n    pattern: '{token} first\\n{token} second'\n")
    return str(p)


@pytest.mark.asyncio
async def test_resume_reports_only_lines_after_cursor(tmp_path: Path) -> None:
    need_root("reading and writing /dev/kmsg")
    token = f"rdt{uuid.uuid4().hex[:12]}"
    rules = _token_rules(tmp_path, token)
    with KmsgReader(KMSG) as reader:
        reader.read_available()
        write_kmsg(f"{token} line 1")
        seen: list[KmsgRecord] = []
        while not seen:
            seen = [r for r in reader.read_available() if token in r.message]
    write_kmsg(f"{token} line 2", f"{token} line 3")
    boot = Path(REAL_BOOT_ID).read_text().strip()

    async def backlog(cursor: dict[str, str] | None, lookback: str) -> list[str]:
        check = KernelCheck()
        await check.start(make_ctx(tmp_path, cursor, lookback=lookback, rules=[rules]))
        try:
            first = await next_report(check.watch(), 1)
            return [f.code for f in first.findings if f.code.startswith("RDT_")]
        finally:
            await check.close()

    assert await backlog({"boot_id": boot, "seq": str(seen[0].seq)}, "0s") == ["RDT_2", "RDT_3"]
    assert await backlog(None, "5m") == ["RDT_1", "RDT_2", "RDT_3"]
    assert await backlog({"boot_id": "another-boot", "seq": str(seen[0].seq)}, "0s") == []


@pytest.mark.asyncio
async def test_multi_line_record_and_quiet_cursor(tmp_path: Path) -> None:
    need_root("reading and writing /dev/kmsg")
    token = f"rdt{uuid.uuid4().hex[:12]}"
    check = KernelCheck()
    await check.start(make_ctx(tmp_path, lookback="0s", rules=[_token_rules(tmp_path, token)]))
    try:
        it = check.watch()
        await next_report(it, 1)
        write_kmsg(f"{token} first\n{token} second")  # one record carrying two lines
        rep = await wait_for(it, lambda f: f.code == "RDT_PAIR", 1.0)
        assert rep.cursor is not None
        write_kmsg(f"{token} nothing to see")  # no finding: the cursor still goes out within ~1 s
        quiet = await next_report(it, 3)
        while quiet.findings:
            quiet = await next_report(it, 3)
        assert quiet.cursor is not None and int(quiet.cursor["seq"]) > int(rep.cursor["seq"])
    finally:
        await check.close()
