"""Evidence bundles (issue 31): a real daemon on the NVML emulator and the real /dev/kmsg, asked over its real
Unix socket (root, as the adapters) and over TCP without an identity (an unprivileged caller); the bounds of
the directory and of one bundle on real files."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from conftest import Daemon, free_port, inject_kmsg, need_root

from checks.gpu.parse import normalize_bus_id
from robustd import __version__
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.evidence import ID, EvidenceStore, Summary, fit, message_fit
from robustd.nvmlemu import build
from robustd.nvmlemu import state as emu

BUS = normalize_bus_id(emu.healthy_gpu(0).bus_id)  # 0000:1b:00.0
GPU = f"gpu/{BUS}"
XID = f"NVRM: Xid (PCI:{BUS[:-2]}): 79, pid=4242, name=python, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Daemon, int]]:
    """One daemon for the module: the GPU check on the emulator, the kernel check on the real kernel log, a
    TCP listener without TLS (callers there have no identity), keep 3, 2 creates a minute for such callers."""
    need_root("writing /dev/kmsg")
    root = Path(tempfile.mkdtemp(prefix="rd-ev-", dir="/tmp"))
    lib = build.build_emulator(str(root / "nvmlemu"))
    state = str(root / "nvml.state")
    emu.save(state, emu.healthy_node(2))
    port = free_port()
    (root / "d").mkdir()
    d = Daemon(root / "d", {"listen": {"tcp": f"127.0.0.1:{port}", "insecure": True},
                            "evidence": {"keep": 3, "max_creates_per_minute": 2},
                            "checks": {"gpu": {"enabled": True, "backend": "emulator", "emulator_state": state,
                                               "emulator_library": lib, "interval": "200ms"}}})
    d.start()
    try:
        yield d, port
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def expect(code: grpc.StatusCode, call: Any, req: Any) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(req, timeout=10)
    assert err.value.code() == code, err.value
    return err.value.details() or ""


def test_a_bundle_holds_the_verdict_events_kernel_lines_gpu_readings_and_versions(node: tuple[Daemon, int]) -> None:
    d, _ = node
    inject_kmsg(XID)
    d.wait_for(lambda v: any(c.code == "XID_79" and c.component == GPU for c in v.conditions), timeout=10)
    d.wait_for(lambda v: v.emulated, timeout=10)  # the GPU check has polled: its readings are published
    with d.channel() as ch:
        ev = pb_grpc.EvidenceStub(ch)
        made = ev.Create(pb.CreateEvidenceRequest(components=[GPU], codes=["XID_79"], reason="drain: XID_79"),
                         timeout=10)
        assert ID.fullmatch(made.id) and made.reason == "drain: XID_79" and list(made.components) == [GPU]
        got = ev.Get(pb.GetEvidenceRequest(id=made.id), timeout=10)
        listed = ev.List(pb.ListEvidenceRequest(), timeout=10)
        assert listed.bundles[0].id == made.id  # newest first
        assert "INVALID_ARGUMENT" not in expect(grpc.StatusCode.INVALID_ARGUMENT, ev.Get,
                                                pb.GetEvidenceRequest(id="../../etc/passwd"))
        expect(grpc.StatusCode.NOT_FOUND, ev.Get, pb.GetEvidenceRequest(id="ev-20000101T000000.000Z-000000"))
        expect(grpc.StatusCode.INVALID_ARGUMENT, ev.Create, pb.CreateEvidenceRequest(components=["a b"]))
    bundle = json.loads(got.json)
    assert bundle == json.loads((Path(d.state_dir) / "evidence" / f"{made.id}.json").read_text())
    assert bundle["id"] == made.id and bundle["verdict"]["severity"] == "CRITICAL"
    assert any(c["code"] == "XID_79" and c["component"] == GPU for c in bundle["verdict"]["conditions"])
    assert [e["kind"] for e in bundle["events"] if e["condition"]["code"] == "XID_79"] == ["RAISED"]
    assert [r["line"] for r in bundle["kernel_log"]] == [XID] and bundle["kernel_log"][0]["rule"]
    [gpu] = [g for g in bundle["gpus"]["devices"] if g["involved"]]
    assert gpu["bus_id"] == BUS and gpu["readings"]["temperature_c"] > 0 and "power_w" in gpu["readings"]
    assert all("readings" not in g for g in bundle["gpus"]["devices"] if not g["involved"])
    assert bundle["versions"] == {"robustd": __version__, "driver": bundle["gpus"]["driver"]}
    assert bundle["versions"]["driver"] and bundle["trimmed"] == {}


def test_unprivileged_callers_read_and_create_within_their_share_and_keep_is_kept(node: tuple[Daemon, int]) -> None:
    d, port = node
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # no identity: the read-only methods only
        ev = pb_grpc.EvidenceStub(ch)
        ids = [b.id for b in ev.List(pb.ListEvidenceRequest(), timeout=10).bundles]
        for _ in range(2):
            ev.Create(pb.CreateEvidenceRequest(reason="curious"), timeout=10)
        assert "max_creates_per_minute" in expect(grpc.StatusCode.RESOURCE_EXHAUSTED, ev.Create,
                                                  pb.CreateEvidenceRequest(reason="flood"))
        if ids:
            assert json.loads(ev.Get(pb.GetEvidenceRequest(id=ids[0]), timeout=10).json)["id"] == ids[0]
    with d.channel() as ch:  # root on the socket (the adapters) is not limited
        for _ in range(2):
            pb_grpc.EvidenceStub(ch).Create(pb.CreateEvidenceRequest(reason="drain"), timeout=10)
        kept = [b.id for b in pb_grpc.EvidenceStub(ch).List(pb.ListEvidenceRequest(), timeout=10).bundles]
    assert len(kept) == 3 and kept == sorted(kept, reverse=True)  # evidence.keep: the newest 3
    assert sorted(os.listdir(Path(d.state_dir) / "evidence")) == sorted(f"{i}.json" for i in kept)


def test_the_directory_and_each_bundle_are_bounded_in_bytes(tmp_path: Path) -> None:
    limits = [10, 20_000, 60_000]
    store = EvidenceStore(str(tmp_path), lambda: tuple(limits))  # type: ignore[arg-type]
    line = {"seq": 1, "at": 0.0, "kind": "RAISED", "condition": {"component": GPU, "evidence": {"line": "x" * 500}}}
    made = [store.write({"reason": f"r{i}", "events": [dict(line, seq=n) for n in range(100)],
                         "diagnostics": [{"id": "diag-1"}]}) for i in range(6)]
    for s in made:
        assert ID.fullmatch(s.id)
    kept = store.ids()
    assert kept == sorted(s.id for s in made)[-len(kept):] and len(kept) < 6  # the oldest went first
    assert sum(os.path.getsize(tmp_path / "evidence" / f"{i}.json") for i in kept) <= 60_000
    bundle = json.loads(store.read(kept[-1]) or "")
    assert os.path.getsize(tmp_path / "evidence" / f"{kept[-1]}.json") <= 20_000
    assert bundle["trimmed"]["events"] > 0 and bundle["events"][-1]["seq"] == 99  # the newest events stay
    limits[:] = [2, 1 << 20, 1 << 30]
    store.write({"reason": "one more"})
    assert len(store.ids()) == 2
    with pytest.raises(ValueError):
        store.read("../state/events.db")
    assert not list((tmp_path / "evidence").glob(".*"))  # no temporary file left behind
    assert re.fullmatch(r"ev-\d{8}T\d{6}\.\d{3}Z-[0-9a-f]{6}", made[0].id)


def test_list_parses_each_bundle_once_and_sees_a_changed_or_removed_one(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A List of the newest 1000 must not read a gigabyte each call: a file is parsed once, again when it
    changes, and forgotten when it goes."""
    store = EvidenceStore(str(tmp_path), lambda: (100, 1 << 20, 1 << 30))
    big = [{"seq": n, "line": "x" * 400} for n in range(200)]  # about 100 KB each
    made = [store.write({"reason": f"r{i}", "components": [GPU], "events": list(big)}) for i in range(5)]
    reads: list[str] = []
    real = store.read
    monkeypatch.setattr(store, "read", lambda ident: reads.append(ident) or real(ident))
    first = store.list(10)
    assert [s.id for s in first] == [s.id for s in reversed(made)] and first[0].reason == "r4"
    assert first[0].components == (GPU,) and reads == []  # what write() made is known without reading it
    fresh = EvidenceStore(str(tmp_path), lambda: (100, 1 << 20, 1 << 30))  # a restarted daemon
    real_fresh = fresh.read
    monkeypatch.setattr(fresh, "read", lambda ident: reads.append(ident) or real_fresh(ident))
    assert fresh.list(10) == first and len(reads) == 5
    assert fresh.list(10) == first and len(reads) == 5  # the second listing reads nothing
    path = Path(fresh.path(made[2].id))
    doc = json.loads(path.read_text())
    doc["reason"] = "edited by hand"
    path.write_text(json.dumps(doc))
    os.unlink(fresh.path(made[0].id))
    again = fresh.list(10)
    assert [s.id for s in again] == [s.id for s in reversed(made[1:])] and reads[5:] == [made[2].id]
    assert next(s for s in again if s.id == made[2].id).reason == "edited by hand"
    assert made[0].id not in fresh._summaries  # a removed bundle is forgotten
    garbage = Path(fresh.path("ev-20000101T000000.000Z-abcdef"))
    garbage.write_text("[1, 2]")  # well named, not robustd's JSON: listed with what can be said
    assert fresh.list(1000)[-1] == Summary("ev-20000101T000000.000Z-abcdef", 0.0, "", ())


def test_a_bundle_always_fits_one_message_and_one_that_does_not_is_named_with_its_file(make_daemon: Any,
                                                                                        short_tmp: Path) -> None:
    """listen.max_message_bytes below evidence.max_bundle_bytes: a new bundle is cut to what Get can return;
    one written before under a larger limit answers RESOURCE_EXHAUSTED with where it is, not gRPC's own error."""
    lib = build.build_emulator(str(short_tmp / "nvmlemu"))
    state = str(short_tmp / "nvml.state")
    emu.save(state, emu.healthy_node(8))
    d = make_daemon({"listen": {"max_message_bytes": 4096},
                     "checks": {"kernel": {"enabled": False},
                                "gpu": {"enabled": True, "backend": "emulator", "emulator_state": state,
                                        "emulator_library": lib, "interval": "200ms"}}})
    d.start()
    gpus = [f"gpu/{normalize_bus_id(emu.healthy_gpu(i).bus_id)}" for i in range(8)]
    time.sleep(1.0)  # a few polls: the GPUs' readings are published
    with d.channel() as ch:
        ev = pb_grpc.EvidenceStub(ch)
        made = ev.Create(pb.CreateEvidenceRequest(reason="r" * 200, components=gpus), timeout=10)
        path = Path(d.state_dir) / "evidence" / f"{made.id}.json"
        assert path.stat().st_size <= message_fit(4096)
        got = json.loads(ev.Get(pb.GetEvidenceRequest(id=made.id), timeout=10).json)
        assert got["id"] == made.id and got["trimmed"], got  # cut to fit, and it says what went
        old = "ev-20000101T000000.000Z-0a0b0c"
        (path.parent / f"{old}.json").write_text(json.dumps({"id": old, "reason": "earlier",
                                                             "events": ["x" * 100] * 400}))
        assert old in [b.id for b in ev.List(pb.ListEvidenceRequest(), timeout=10).bundles]
        msg = expect(grpc.StatusCode.RESOURCE_EXHAUSTED, ev.Get, pb.GetEvidenceRequest(id=old))
        assert "listen.max_message_bytes 4096" in msg and str(path.parent / f"{old}.json") in msg, msg


def test_fit_cuts_to_any_limit_and_says_what_went() -> None:
    bundle = {"id": "ev-x", "created": "t", "reason": "r", "components": [GPU], "versions": {"robustd": "1"},
              "verdict": {"severity": "CRITICAL", "action": "REBOOT",
                          "conditions": [{"component": GPU, "evidence": {"line": "y" * 300}}] * 20},
              "involved_conditions": [{"component": GPU, "evidence": {"line": "y" * 300}}],
              "events": [{"seq": n} for n in range(100)], "kernel_log": [{"line": "z" * 200}] * 10,
              "gpus": {"gpus": [{"bus": BUS, "readings": {"t": 1}}] * 50}, "diagnostics": [{"id": "d"}] * 5,
              "notes": ["n" * 100] * 5}
    for limit in (8000, 4096, 768, 400, 128):
        data = fit(json.loads(json.dumps(bundle)), limit)
        assert len(data) <= limit, (limit, len(data))
        got = json.loads(data)
        assert got["id"] == "ev-x" and got["trimmed"], got
    assert json.loads(fit(json.loads(json.dumps(bundle)), 400))["trimmed"] == {"all": 1}
    assert json.loads(fit(json.loads(json.dumps(bundle)), 1 << 20))["trimmed"] == {}


def test_robustctl_evidence_create_list_show_export(node: tuple[Daemon, int], tmp_path: Path) -> None:
    d, _ = node
    made = d.robustctl("evidence", "create", "--component", GPU, "--code", "XID_79", "--reason", "before RMA")
    assert made.returncode == 0 and ID.fullmatch(made.stdout.strip()), made
    ident = made.stdout.strip()
    listed = d.robustctl("evidence", "list", "--wide")
    assert listed.returncode == 0 and listed.stdout.split("\n")[0].split() == ["ID", "CREATED", "COMPONENTS", "REASON"]
    assert listed.stdout.split("\n")[1].startswith(ident) and "before RMA" in listed.stdout, listed.stdout
    shown = d.robustctl("evidence", "show", ident)
    assert shown.returncode == 0 and json.loads(shown.stdout)["reason"] == "before RMA"
    out = tmp_path / "rma.tar.gz"
    r = d.robustctl("evidence", "export", ident, str(out))
    assert r.returncode == 0, r.stderr
    import tarfile

    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == sorted([f"{ident}/{ident}.json", f"{ident}/README.txt"])
        assert json.load(tar.extractfile(f"{ident}/{ident}.json"))["id"] == ident  # type: ignore[arg-type]
        assert b"before RMA" in tar.extractfile(f"{ident}/README.txt").read()  # type: ignore[union-attr]
    bad = d.robustctl("evidence", "show", "../x")
    assert bad.returncode == 4 and "INVALID_ARGUMENT" in bad.stderr, bad
    gone = d.robustctl("evidence", "show", "ev-20000101T000000.000Z-000000")
    assert gone.returncode == 4 and "NOT_FOUND" in gone.stderr, gone
    unwritable = d.robustctl("evidence", "export", ident, str(tmp_path / "no" / "such" / "dir.tar.gz"))
    assert unwritable.returncode == 73 and "Traceback" not in unwritable.stderr, unwritable


def test_the_adapters_helper_gives_an_id_or_none_within_its_timeout(node: tuple[Daemon, int], tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import socket
    import time

    from robustd.adapters.common.client import evidence

    d, _ = node
    ident = evidence(d.socket, [GPU], ["XID_79"], "drain: XID_79", timeout=10)
    assert ident is not None and ID.fullmatch(ident)
    assert json.loads(pb_grpc.EvidenceStub(d.channel()).Get(pb.GetEvidenceRequest(id=ident), timeout=10).json)[
        "reason"] == "drain: XID_79"
    assert evidence(str(tmp_path / "none.sock"), [], [], "drain", timeout=1) is None
    mute = socket.socket(socket.AF_UNIX)  # accepts connections, never answers: a wedged daemon
    mute.bind(str(tmp_path / "mute.sock"))
    mute.listen(8)
    try:
        t = time.monotonic()
        assert evidence(str(tmp_path / "mute.sock"), [GPU], [], "drain", timeout=0.5) is None
        assert time.monotonic() - t < 3
    finally:
        mute.close()
    assert "no evidence bundle for 'drain'" in caplog.text and "DEADLINE_EXCEEDED" in caplog.text
