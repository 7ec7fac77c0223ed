"""Diagnostics.Triage through a real daemon: the same answers as `robustctl triage`, bounded input, a short
INVALID_ARGUMENT for what is out of bounds, RESOURCE_EXHAUSTED for a request over listen.max_message_bytes,
open to every caller (read-only), and a daemon that keeps answering while triages run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, Daemon, free_port, need_root

from robustd.api.triage import response_json
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.triage import MAX_LOG_BYTES, MAX_LOGS

MAX_DETAILS = 300

KEYERROR = (b"step 1200 | loss 2.3141 | lr 3.0e-04\nTraceback (most recent call last):\n"
            b"  File \"/home/alice/proj/train.py\", line 187, in main\n    labels = collate(batch, \"labels\")\n"
            b"  File \"/home/alice/proj/train.py\", line 42, in collate\n    return [sample[key] for sample in batch]\n"
            b"KeyError: 'labels'\n")
NCCL = (b"node-17:2345:2406 [3] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
        b"10.0.0.2<42174> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 "
        b"remoteGid ::ffff:10.0.0.2\n"
        b"RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system "
        b"error, NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, malloc) or external library call "
        b"failed or device error.\n")


@pytest.fixture
def daemon(make_daemon: Any) -> Daemon:
    d: Daemon = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    return d


def diag(d: Daemon) -> pb_grpc.DiagnosticsStub:
    return pb_grpc.DiagnosticsStub(d.channel())


def expect(code: grpc.StatusCode, call: Any, request: Any) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    assert err.value.code() == code, (err.value.code(), (err.value.details() or "")[:500])
    details = err.value.details() or ""
    assert len(details) <= MAX_DETAILS, details[:500]
    return details


def cli(*args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "triage", "--json", *args], capture_output=True,
                       text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def no_traceback(d: Daemon) -> None:
    log = d.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Unexpected" not in log, log[-3000:]


def test_the_rpc_answers_as_the_cli_does(daemon: Daemon, tmp_path: Path) -> None:
    big = b"".join(b"step %d | loss 2.%04d | tokens/s 81234\n" % (i, i % 9999) for i in range(60_000)) + KEYERROR
    assert len(big) > MAX_LOG_BYTES  # the RPC keeps its tail, as the CLI reads only the tail
    cases: list[tuple[dict[str, bytes], list[str], dict[str, Any]]] = [
        ({"rank0.log": KEYERROR}, ["--exit-code", "1"], {"exit_code": 1}),
        ({"rank3.log": NCCL, "rank0.log": b"step 1 | loss 2.1\n"}, ["--exit-code", "1"], {"exit_code": 1}),
        ({"job.out": big}, [], {}),
        ({"empty.log": b""}, ["--signal", "kill"], {"signal": "9"}),
        ({"garbage.bin": os.urandom(200_000) + b"\xff\xfe\n" + NCCL[:80]}, ["--exit-code", "137"], {"exit_code": 137}),
    ]
    stub = diag(daemon)
    for files, flags, fields in cases:
        names = []
        for name, data in files.items():
            (tmp_path / name).write_bytes(data)
            names.append(str(tmp_path / name))
        want = cli(*flags, *names)
        req = pb.TriageRequest(logs=[pb.TriageLog(name=str(tmp_path / n), data=data) for n, data in files.items()],
                               **fields)
        got = response_json(stub.Triage(req, timeout=30))
        assert got == want, (files.keys(), got, want)
        for f in files:
            (tmp_path / f).unlink()
    no_traceback(daemon)


def test_the_answer_names_what_the_caller_sent(daemon: Daemon) -> None:
    resp = diag(daemon).Triage(pb.TriageRequest(exit_code=1, logs=[
        pb.TriageLog(name="node-17/rank3.log", data=NCCL), pb.TriageLog(name="node-02/rank0.log", data=b"ok\n")]),
        timeout=30)
    assert getattr(resp, "class") == "nccl" and resp.infra == "likely" and resp.next == "diagnose", resp
    assert resp.level and any(e.file == "node-17/rank3.log" for e in resp.evidence), resp
    resp = diag(daemon).Triage(pb.TriageRequest(logs=[pb.TriageLog(name="tail.log", data=KEYERROR, offset=10_000)]),
                               timeout=30)
    assert list(resp.partial) == ["tail.log"], resp  # a non-zero offset: a tail, line numbers from its first line
    assert all(e.offset >= 10_000 for e in resp.evidence), resp


def test_out_of_bounds_requests_are_invalid_argument(daemon: Daemon) -> None:
    call = diag(daemon).Triage
    ok = pb.TriageLog(name="a.log", data=b"x\n")
    bad = [
        (pb.TriageRequest(logs=[pb.TriageLog(name=f"r{i}", data=b"") for i in range(MAX_LOGS + 1)]),
         f"at most {MAX_LOGS}"),
        (pb.TriageRequest(logs=[pb.TriageLog(name="", data=b"x")]), "logs[0].name is required"),
        (pb.TriageRequest(logs=[ok, pb.TriageLog(name="n" * 257, data=b"x")]), "logs[1].name is 257 characters"),
        (pb.TriageRequest(logs=[pb.TriageLog(name="a\nb", data=b"x")]), "printable"),
        (pb.TriageRequest(logs=[pb.TriageLog(name="\u202eevil", data=b"x")]), "printable"),
        (pb.TriageRequest(logs=[ok, ok]), "unique"),
        (pb.TriageRequest(logs=[pb.TriageLog(name="a", data=b"x", offset=2**63)]), "offset must be below 2^63"),
        (pb.TriageRequest(exit_code=256, logs=[ok]), "exit_code"),
        (pb.TriageRequest(exit_code=-9, logs=[ok]), "give the signal instead"),
        (pb.TriageRequest(exit_code=-2**31), "exit_code"),
        (pb.TriageRequest(signal="SIGFOO", logs=[ok]), "unknown signal 'SIGFOO'"),
        (pb.TriageRequest(signal="0"), "signal"),
        (pb.TriageRequest(signal="K" * 10_000), "signal"),
    ]
    for req, words in bad:
        details = expect(grpc.StatusCode.INVALID_ARGUMENT, call, req)
        assert words in details, (words, details)
    # The edges are fine.
    edge = pb.TriageRequest(exit_code=255, signal="SIGRTMAX",
                            logs=[pb.TriageLog(name=f"{i:0256d}", data=b"") for i in range(MAX_LOGS)])
    assert getattr(call(edge, timeout=60), "class")
    assert getattr(call(pb.TriageRequest(), timeout=30), "class") == "unknown"  # nothing to read: unknown
    raw = daemon.channel().unary_unary("/robustd.v1.Diagnostics/Triage")
    for body in (b"\xff\xff\xff", b"\x1a\x05\x0a\xff", b"\x1a\x10short"):
        assert "not a valid protobuf message" in expect(grpc.StatusCode.INVALID_ARGUMENT, raw, body)
    no_traceback(daemon)


def test_a_request_over_the_message_limit_is_resource_exhausted(daemon: Daemon) -> None:
    call = diag(daemon).Triage
    limit = 4 << 20  # listen.max_message_bytes' default
    details = expect(grpc.StatusCode.RESOURCE_EXHAUSTED, call,
                     pb.TriageRequest(logs=[pb.TriageLog(name="huge.log", data=b"x" * (limit + 1))]))
    assert details
    near = pb.TriageRequest(logs=[pb.TriageLog(name="big.log", data=b"y" * (limit - 4096) + b"\n" + KEYERROR)])
    resp = call(near, timeout=60)  # within the limit: judged from its last MiB
    assert list(resp.partial) == ["big.log"] and getattr(resp, "class") == "user_code", resp
    assert daemon.verdict().node == "test-node"
    no_traceback(daemon)


def test_the_daemon_keeps_answering_while_triages_run(daemon: Daemon) -> None:
    """Three callers send 2 MiB triages back to back (more than run at once: some wait their turn) while
    GetVerdict is timed: the judge runs in worker threads, never on the event loop."""
    per = (2 << 20) // 512 - 64
    line = NCCL.split(b"\n")[0] + b"\n"
    data = (line * (per // len(line) + 1))[:per]
    raw = pb.TriageRequest(exit_code=1, logs=[pb.TriageLog(name=f"rank{i}.log", data=data)
                                              for i in range(512)]).SerializeToString()  # once: not the client's CPU
    answers: list[Any] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    in_flight = [0]
    lock = threading.Lock()

    def caller() -> None:
        try:
            with daemon.channel() as ch:
                call = ch.unary_unary("/robustd.v1.Diagnostics/Triage",
                                      response_deserializer=pb.TriageResponse.FromString)
                while not stop.is_set():
                    with lock:
                        in_flight[0] += 1
                    try:
                        answers.append(call(raw, timeout=300))
                    finally:
                        with lock:
                            in_flight[0] -= 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    latencies = []
    t0 = time.monotonic()
    with daemon.channel() as ch:
        nh = pb_grpc.NodeHealthStub(ch)
        nh.GetVerdict(pb.GetVerdictRequest(), timeout=5)
        while time.monotonic() - t0 < 5 or not answers:
            assert time.monotonic() - t0 < 240, "no triage finished within 240 s"
            t = time.monotonic()
            nh.GetVerdict(pb.GetVerdictRequest(), timeout=5)
            if in_flight[0]:
                latencies.append(time.monotonic() - t)
            time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert answers and all(getattr(a, "class") == getattr(answers[0], "class") for a in answers)
    assert len(latencies) >= 20, len(latencies)  # timed while triages were running
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    no_traceback(daemon)


# --- who may call it ------------------------------------------------------------------------------------


def test_every_rpc_is_classified_and_triage_is_read_only() -> None:
    from robustd.authz import DISRUPTIVE, READ_ONLY

    methods = {f"/{s.full_name}/{m.name}" for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert "/robustd.v1.Diagnostics/Triage" in READ_ONLY
    assert not DISRUPTIVE & READ_ONLY
    assert methods == DISRUPTIVE | READ_ONLY, (methods - DISRUPTIVE - READ_ONLY, (DISRUPTIVE | READ_ONLY) - methods)


def test_anyone_the_listener_admits_may_triage(make_daemon: Any) -> None:
    port = free_port()
    d = make_daemon({"listen": {"tcp": f"127.0.0.1:{port}", "insecure": True},
                     "checks": {"kernel": {"enabled": False}}})
    d.start()
    req = pb.TriageRequest(exit_code=1, logs=[pb.TriageLog(name="rank0.log", data=KEYERROR)])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # no identity at all: reads yes, disrupts no
        assert getattr(pb_grpc.DiagnosticsStub(ch).Triage(req, timeout=30), "class") == "user_code"
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.NodeHealthStub(ch).Acknowledge(pb.AcknowledgeRequest(component="gpu/0", code="X"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


CLIENT = """
import json, sys, grpc
from robustd.api.v1 import robustd_pb2 as pb, robustd_pb2_grpc as pb_grpc
ch = grpc.insecure_channel("unix://" + sys.argv[1])
out = {}
try:
    r = pb_grpc.DiagnosticsStub(ch).Triage(pb.TriageRequest(exit_code=1, logs=[pb.TriageLog(name="r0", data=b"x")]),
                                           timeout=30)
    out["triage"] = "OK:" + getattr(r, "class")
except grpc.RpcError as e:
    out["triage"] = e.code().name
try:
    pb_grpc.NodeHealthStub(ch).Acknowledge(pb.AcknowledgeRequest(component="gpu/0", code="XID_79"), timeout=5)
    out["ack"] = "OK"
except grpc.RpcError as e:
    out["ack"] = e.code().name
print(json.dumps(out))
"""


def test_an_unprivileged_unix_caller_may_triage(make_daemon: Any) -> None:
    need_root("running a client as another uid")
    d = make_daemon({"listen": {"unix_mode": 0o666}, "checks": {"kernel": {"enabled": False}}})
    d.start()
    for p in (d.root, d.root.parent):
        os.chmod(p, 0o711)  # let `nobody` reach the socket
    r = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", sys.executable, "-c",
                        CLIENT, d.socket], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["triage"].startswith("OK:") and got["ack"] == "PERMISSION_DENIED", got


# --- a node epilog's verdict, kept for the controller (RecordTriage / GetTriage) --------------------------


def test_a_recorded_verdict_is_read_back_by_job_and_only_a_privileged_caller_records(make_daemon: Any) -> None:
    """The node epilog (root on the socket) records; the controller reads it over TCP (any admitted caller);
    a caller without an identity may read but not record: a planted `user_code` would spare a job's nodes."""
    port = free_port()
    d = make_daemon({"listen": {"tcp": f"127.0.0.1:{port}", "insecure": True},
                     "checks": {"kernel": {"enabled": False}}})
    d.start()
    verdict = pb_grpc.DiagnosticsStub(d.channel()).Triage(
        pb.TriageRequest(exit_code=1, logs=[pb.TriageLog(name="slurm-42.out", data=NCCL)]), timeout=30)
    assert getattr(verdict, "class") == "nccl"
    with d.channel() as ch:
        stub = pb_grpc.DiagnosticsStub(ch)
        expect(grpc.StatusCode.NOT_FOUND, stub.GetTriage, pb.GetTriageRequest(job_id="42"))
        stub.RecordTriage(pb.RecordTriageRequest(job_id="42", verdict=verdict), timeout=5)
        stub.RecordTriage(pb.RecordTriageRequest(job_id="43"), timeout=5)  # this node read no log of job 43
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.DiagnosticsStub(ch)
        got = stub.GetTriage(pb.GetTriageRequest(job_id="42"), timeout=5)
        assert got.job_id == "42" and getattr(got.verdict, "class") == "nccl" and got.verdict.infra == verdict.infra
        assert list(got.verdict.evidence) == list(verdict.evidence)[:8]
        assert abs(got.recorded_at.ToSeconds() - time.time()) < 60
        none = stub.GetTriage(pb.GetTriageRequest(job_id="43"), timeout=5)
        assert not none.HasField("verdict")
        with pytest.raises(grpc.RpcError) as err:
            stub.RecordTriage(pb.RecordTriageRequest(job_id="42"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert getattr(pb_grpc.DiagnosticsStub(d.channel()).GetTriage(pb.GetTriageRequest(job_id="42"), timeout=5)
                   .verdict, "class") == "nccl"  # the refused call changed nothing


@pytest.mark.parametrize("request_, words", [
    (pb.RecordTriageRequest(), "job_id is required"),
    (pb.RecordTriageRequest(job_id="4 2"), "without spaces"),
    (pb.RecordTriageRequest(job_id="9" * 65), "1 to 64"),
    (pb.RecordTriageRequest(job_id="42", verdict=pb.TriageResponse(**{"class": "cosmic_ray"}, infra="likely",
                                                                     next="diagnose")), "verdict.class"),
    (pb.RecordTriageRequest(job_id="42", verdict=pb.TriageResponse(**{"class": "nccl"}, infra="maybe",
                                                                     next="diagnose")), "verdict.infra"),
])
def test_a_bad_record_is_invalid_argument_and_keeps_nothing(daemon: Daemon, request_: Any, words: str) -> None:
    with daemon.channel() as ch:
        stub = pb_grpc.DiagnosticsStub(ch)
        assert words in expect(grpc.StatusCode.INVALID_ARGUMENT, stub.RecordTriage, request_)
        expect(grpc.StatusCode.NOT_FOUND, stub.GetTriage, pb.GetTriageRequest(job_id="42"))


def test_recorded_verdicts_are_bounded_in_count_size_and_age() -> None:
    from robustd.api.triage import KEEP_FOR, MAX_JOBS, MAX_KEPT_TEXT, JobTriages

    now = [1000.0]
    store = JobTriages(clock=lambda: now[0])
    big = pb.TriageResponse(**{"class": "hang"}, infra="likely", next="diagnose", reason="r" * 100_000,
                            evidence=[pb.TriageEvidence(file="f", line=i, text="t" * 5000) for i in range(100)])
    for i in range(MAX_JOBS + 10):
        store.record(pb.RecordTriageRequest(job_id=str(i), verdict=big))
    assert store.get("0") is None and store.get("9") is None  # the oldest went first
    kept = store.get(str(MAX_JOBS + 9))
    assert kept is not None and len(kept.verdict.reason) == MAX_KEPT_TEXT and len(kept.verdict.evidence) == 8
    assert all(len(e.text) <= MAX_KEPT_TEXT for e in kept.verdict.evidence)
    now[0] += KEEP_FOR + 1
    assert store.get(str(MAX_JOBS + 9)) is None  # an hour later nobody asks for it
