"""Hostile and careless input against a real daemon: every answer is the right status, short, and
nothing a caller or the kernel sends can make the event log or the verdict unsendable."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
from conftest import Daemon, inject_kmsg, need_root

from robustd import bounds
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

MAX_DETAILS = 300  # an error's details: one short line, whatever the input was
DEFAULT_LIMIT = 4 << 20


def domain() -> str:
    """A PCI domain no other test uses (8 digits, no leading zero: robustd writes domains without one)."""
    return f"{0x1000_0000 + uuid.uuid4().int % 0xefff_ffff:08x}"


def xid_line(bdf: str, n: int, detail: str) -> str:
    return f"NVRM: Xid (PCI:{bdf}): {n}, pid=4242, name=python, {detail}"


def expect(code: grpc.StatusCode, call: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=10, **kw)
        if hasattr(result, "__next__"):
            next(result)
    assert err.value.code() == code, (err.value.code(), (err.value.details() or "")[:500])
    details = err.value.details() or ""
    assert len(details) <= MAX_DETAILS, details[:500]
    return details


def feed(d: Daemon, lines: list[str], progress: Callable[[pb.Verdict], int], step: int) -> None:
    """Write `lines` in steps the 128 KiB kernel ring holds, each once the daemon has read the last.

    A step lost because another process flooded the ring meanwhile (the reader skips what was
    overwritten) is written again; `progress` must count a repeated line at most once more.
    """
    for start in range(0, len(lines), step):
        for _ in range(3):
            inject_kmsg(*lines[start:start + step])
            deadline = time.monotonic() + 15
            while progress(d.verdict()) < start + step and time.monotonic() < deadline:
                time.sleep(0.02)
            if progress(d.verdict()) >= start + step:
                break
        else:
            raise AssertionError(f"the daemon did not read lines {start}..{start + step}:\n{d.log()}")


def no_traceback(d: Daemon) -> None:
    log = d.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Unexpected" not in log, log[-3000:]


def test_corrupt_request_bytes_are_invalid_argument_not_a_traceback(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    with d.channel() as ch:
        for method in ("ListEvents", "Acknowledge", "GetVerdict"):
            raw = ch.unary_unary(f"/robustd.v1.NodeHealth/{method}")  # bytes in, bytes out
            for body in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x22\x05ab"):
                details = expect(grpc.StatusCode.INVALID_ARGUMENT, raw, body)
                assert "not a valid protobuf message" in details
        watch = ch.unary_stream("/robustd.v1.NodeHealth/Watch")
        expect(grpc.StatusCode.INVALID_ARGUMENT, watch, b"\xff\xff")
        diag = ch.unary_unary("/robustd.v1.Diagnostics/Get")
        expect(grpc.StatusCode.INVALID_ARGUMENT, diag, b"\x0a\x10short")
        # Well-formed requests on the same channel still work.
        assert pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=5).node == "test-node"
    no_traceback(d)


def test_numbers_and_times_out_of_range_are_invalid_argument(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    stub = d.stub()
    for seq in (2**63, 2**64 - 1):
        assert "after_seq must be below 2^63" in expect(grpc.StatusCode.INVALID_ARGUMENT, stub.ListEvents,
                                                        pb.ListEventsRequest(after_seq=seq))
    assert "from_seq" in expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Watch, pb.WatchRequest(from_seq=2**64 - 1))
    far, negative = pb.ListEventsRequest(), pb.ListEventsRequest()
    far.since.seconds = 2**62
    negative.since.seconds, negative.since.nanos = 5, -5
    assert "since.seconds" in expect(grpc.StatusCode.INVALID_ARGUMENT, stub.ListEvents, far)
    assert "since.nanos" in expect(grpc.StatusCode.INVALID_ARGUMENT, stub.ListEvents, negative)
    # The edges themselves are fine.
    assert list(stub.ListEvents(pb.ListEventsRequest(after_seq=2**63 - 1), timeout=5).events) == []
    edge = pb.ListEventsRequest()
    edge.since.seconds, edge.since.nanos = 253402300799, 999_999_999
    assert list(stub.ListEvents(edge, timeout=5).events) == []
    no_traceback(d)


def test_huge_strings_are_refused_in_one_short_line(make_daemon: Any) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    stub = d.stub()
    big = "x" * 100 * 1024
    details = expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Acknowledge,
                     pb.AcknowledgeRequest(component=big, code="XID_79"))
    assert "component" in details and "102400 characters" in details
    expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Acknowledge, pb.AcknowledgeRequest(component="gpu/*", code=big))
    expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Acknowledge,
           pb.AcknowledgeRequest(component="gpu/0 with spaces", code="XID_79"))
    expect(grpc.StatusCode.INVALID_ARGUMENT, stub.ListEvents, pb.ListEventsRequest(component=big))
    details = expect(grpc.StatusCode.NOT_FOUND, stub.Acknowledge,
                     pb.AcknowledgeRequest(component="gpu/" + "9" * 120, code="XID_79"))
    assert "no standing condition" in details
    diag = pb_grpc.DiagnosticsStub(d.channel())
    expect(grpc.StatusCode.NOT_FOUND, diag.Get, pb.GetDiagnosticRequest(id=big))
    expect(grpc.StatusCode.NOT_FOUND, diag.Cancel, pb.CancelDiagnosticRequest(id=big))
    no_traceback(d)


def test_an_oversized_acknowledge_is_refused_and_the_event_log_stays_readable(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    d = make_daemon()
    d.start()
    bdf = f"{domain()}:3b:00"
    inject_kmsg(xid_line(bdf, 79, "GPU has fallen off the bus."))
    d.wait_for(lambda v: any(c.component == f"gpu/{bdf}.0" for c in v.conditions))
    stub = d.stub()
    for size in (1 << 20, (4 << 20) - (64 << 10)):  # both fit in a request (listen.max_message_bytes is 4 MiB)
        details = expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Acknowledge,
                         pb.AcknowledgeRequest(component=f"gpu/{bdf}.0", code="XID_79", reason="r" * size))
        assert "reason" in details
    with pytest.raises(grpc.RpcError) as err:  # over the message limit: grpc refuses it before robustd sees it
        stub.Acknowledge(pb.AcknowledgeRequest(component=f"gpu/{bdf}.0", code="XID_79", reason="r" * (4 << 20)),
                         timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert any(c.component == f"gpu/{bdf}.0" for c in d.verdict().conditions)  # nothing was acknowledged
    last = stub.ListEvents(pb.ListEventsRequest(limit=1), timeout=5)
    assert len(last.events) == 1 and last.events[0].kind == pb.EVENT_KIND_RAISED
    # A reason at the limit goes through, and every reader still gets every event.
    ack = stub.Acknowledge(pb.AcknowledgeRequest(component=f"gpu/{bdf}.0", code="XID_79",
                                                 reason="é" * (bounds.MAX_REASON // 2)), timeout=5)
    assert ack.event.condition.evidence["reason"] == "é" * (bounds.MAX_REASON // 2)
    events = list(stub.ListEvents(pb.ListEventsRequest(limit=1), timeout=5).events)
    assert events[0].seq == ack.event.seq
    watch = stub.Watch(pb.WatchRequest(from_seq=ack.event.seq - 1), timeout=5)
    assert next(watch).seq == ack.event.seq
    watch.cancel()
    no_traceback(d)


def test_a_huge_kernel_message_is_stored_and_sent_bounded(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    d = make_daemon()
    d.start()
    bdf = f"{domain()}:3b:00"
    detail = "Graphics Exception: ESR " + " ".join(f"0x{i:06x}=0x{i * 7:08x}" for i in range(45))  # ~950 bytes
    inject_kmsg(xid_line(bdf, 13, detail))
    # The verdict shows a condition as soon as it is decided, its seq once its event is on disk (0 until then):
    # the log is read after that, as a scheduler that follows GetVerdict's seqs would.
    v = d.wait_for(lambda v: any(c.component == f"gpu/{bdf}.0" and c.seq > 0 for c in v.conditions))
    [c] = [c for c in v.conditions if c.component == f"gpu/{bdf}.0"]
    assert len(c.message.encode()) <= bounds.MAX_MESSAGE and "[truncated" in c.message and c.message.endswith("bytes]")
    assert c.message.startswith(f"Xid 13 on GPU {bdf}.0: Graphics Exception: ESR 0x000000")  # the start is kept
    assert all(len(value.encode()) <= bounds.MAX_EVIDENCE_VALUE for value in c.evidence.values())
    assert "[truncated" in c.evidence["line"] and c.evidence["xid"] == "13"
    assert sum(len(k) + len(x.encode()) for k, x in c.evidence.items()) <= bounds.MAX_EVIDENCE_BYTES
    [ev] = d.stub().ListEvents(pb.ListEventsRequest(component=f"gpu/{bdf}.0"), timeout=5).events
    assert ev.condition.message == c.message and dict(ev.condition.evidence) == dict(c.evidence)
    db = sqlite3.connect(f"file:{Path(d.state_dir) / 'robustd.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT condition FROM events WHERE component = ?", (f"gpu/{bdf}.0",)).fetchall()
    finally:
        db.close()
    assert len(rows) == 1 and json.loads(rows[0][0])["message"] == c.message
    no_traceback(d)


def test_list_events_pages_within_the_message_limit_and_every_event_comes_once(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    limit = 256 << 10
    d = make_daemon({"listen": {"max_message_bytes": limit}, "policy": {"update_interval": "0s"}})
    d.start()
    dom = domain()
    detail = "Graphics Exception: ESR " + " ".join(f"0x{i:06x}=0x{i * 7:08x}" for i in range(45))
    lines = [xid_line(f"{dom}:{i % 3:02x}:00", 13, detail) for i in range(300)]  # ~1.7 KiB events each
    feed(d, lines, lambda v: sum(c.count for c in v.conditions if c.component.startswith(f"gpu/{dom}")), step=50)
    stub = d.stub()
    head = d.verdict().seq
    seen: list[int] = []
    after, pages = 0, 0
    while True:
        resp = stub.ListEvents(pb.ListEventsRequest(limit=10_000, after_seq=after), timeout=10)
        pages += 1
        assert resp.ByteSize() <= limit
        seen += [e.seq for e in resp.events]
        if not resp.truncated:
            break
        assert resp.next_after_seq == resp.events[-1].seq
        after = resp.next_after_seq
    assert pages >= 2
    assert seen == list(range(1, seen[-1] + 1)) and seen[-1] >= head  # every event, in order, exactly once
    no_traceback(d)


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_storm_of_ten_thousand_gpus_folds_and_the_verdict_stays_small(make_daemon: Any) -> None:
    need_root("writing /dev/kmsg")
    d = make_daemon()
    d.start()
    assert d.proc is not None
    dom = domain()
    mine = f"gpu/{dom}:"
    # Long enough that 10,000 unbounded conditions would not fit in one 4 MiB message.
    lines = [xid_line(f"{dom}:{i // 100:02x}:{i % 100:02x}", 79,
                      "GPU has fallen off the bus. " + "Bus id storm from a misbehaving driver. " * 4)
             for i in range(10_000)]

    def seen(v: pb.Verdict) -> int:
        own = sum(1 for c in v.conditions if c.component.startswith(mine))
        fold = next((c for c in v.conditions if c.component == "gpu/*" and c.code == "XID_79"), None)
        return own + (int(fold.evidence["folded"]) if fold is not None else 0)

    time.sleep(0.5)
    rss_before = vm_rss_kib(d.proc.pid)
    t0 = time.monotonic()
    feed(d, lines, seen, step=200)  # ~250-byte lines: 50 KiB a step, well inside the ring
    storm_s = time.monotonic() - t0
    v = d.verdict()
    assert v.ByteSize() < DEFAULT_LIMIT // 4
    xid79 = [c for c in v.conditions if c.code == "XID_79" and c.component != "gpu/*"]
    assert len(xid79) <= 64
    [fold] = [c for c in v.conditions if c.component == "gpu/*" and c.code == "XID_79"]
    assert int(fold.evidence["folded"]) >= 10_000 - 64
    assert f"{fold.evidence['folded']} more gpu components with XID_79" in fold.message
    assert (fold.severity, fold.action, fold.sticky) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT, True)
    assert fold.evidence["examples"].startswith(mine)
    r = d.robustctl("status")
    assert r.returncode == 2, r.stderr
    assert "gpu/*" in r.stdout and fold.evidence["folded"] in r.stdout
    growth_mib = (vm_rss_kib(d.proc.pid) - rss_before) / 1024
    assert growth_mib < 64, f"RSS grew {growth_mib:.0f} MiB over a {storm_s:.1f}s storm"
    # The operator acknowledges the whole storm at once.
    ack = d.stub().Acknowledge(pb.AcknowledgeRequest(component="gpu/*", code="XID_79", reason="driver fixed"),
                               timeout=5)
    assert ack.event.kind == pb.EVENT_KIND_CLEARED
    assert not any(c.component == "gpu/*" for c in d.verdict().conditions)
    no_traceback(d)


def test_a_real_gpus_fault_stands_on_its_own_after_a_flood_of_made_up_bus_ids(make_daemon: Any,
                                                                              short_tmp: Path) -> None:
    need_root("writing /dev/kmsg")
    from robustd.nvmlemu import build
    from robustd.nvmlemu import state as emu

    dom = domain()
    real = f"{0x1000_0000 + uuid.uuid4().int % 0xefff_ffff:08x}:3b:00.0"  # the one GPU NVML lists
    st = emu.healthy_node(1)
    st.gpus[0].bus_id = f"{real[:-4].upper()}:00.0"  # NVML's form of the same address
    nvml = str(short_tmp / "nvml.state")
    emu.save(nvml, st)
    d = make_daemon({"checks": {"gpu": {"enabled": True, "backend": "emulator", "emulator_state": nvml,
                                        "emulator_library": build.build_emulator(str(short_tmp / "emu")),
                                        "interval": "200ms"}}})
    d.start()
    d.wait_for(lambda v: any(c.name == "gpu" and c.status == pb.CHECK_STATUS_OK
                             for c in d.stub().ListChecks(pb.ListChecksRequest(), timeout=5).checks), timeout=15)
    fakes = [f"{dom}:{i:02x}:00" for i in range(100)]  # a flood of bus ids this node does not have

    def folded(v: pb.Verdict) -> int:
        own = sum(1 for c in v.conditions if c.component.startswith(f"gpu/{dom}:"))
        fold = next((c for c in v.conditions if c.component == "gpu/*" and c.code == "XID_79"), None)
        return own + (int(fold.evidence["folded"]) if fold is not None else 0)

    feed(d, [xid_line(b, 79, "GPU has fallen off the bus.") for b in fakes], folded, step=50)
    inject_kmsg(xid_line(real[:-2], 79, "GPU has fallen off the bus."))
    v = d.wait_for(lambda v: any(c.component == f"gpu/{real}" for c in v.conditions), timeout=5)
    [mine] = [c for c in v.conditions if c.component == f"gpu/{real}"]
    assert (mine.code, mine.severity, mine.action, mine.sticky) == ("XID_79", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT,
                                                                     True)
    [fold] = [c for c in v.conditions if c.component == "gpu/*" and c.code == "XID_79"]
    assert f"gpu/{fakes[-1]}.0" in fold.message and fold.evidence["newest"].startswith(f"gpu/{fakes[-1]}.0")
    assert f"gpu/{real}" not in fold.message
    r = d.robustctl("ack", f"gpu/{real}", "XID_79", "--reason", "GPU replaced")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(c.component == f"gpu/{real}" for c in d.verdict().conditions)
    no_traceback(d)
