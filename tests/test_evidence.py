"""Evidence bundles (issue 31): a real daemon on the NVML emulator and the real /dev/kmsg, asked over its real
Unix socket (root, as the adapters) and over TCP without an identity (an unprivileged caller); the bounds of
the directory and of one bundle on real files."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from conftest import Daemon, free_port, inject_kmsg, need_root

from checks.gpu.parse import normalize_bus_id
from robustd import __version__
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.evidence import ID, EvidenceStore
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
