"""TLS, mutual TLS and authorization on the real daemon, with real certificates made by `openssl` here."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from certs import CA, LEAF, make_cert
from conftest import REPO, Daemon, need_root
from grpc_health.v1 import health_pb2, health_pb2_grpc

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

FAKE_DCGMI = str(REPO / "tests" / "fakes" / "dcgmi")
ALLOWED = "scheduler.example"
ALLOWED_GROUP = "adm"  # exists on Debian; the tests add no group to the host


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_cert(d, "ca", "robustd test CA", CA)
    make_cert(d, "other_ca", "unrelated CA", CA)
    make_cert(d, "server", "robustd server", LEAF + "extendedKeyUsage = serverAuth\n"
              "subjectAltName = DNS:localhost, IP:127.0.0.1\n", ca="ca")
    client = LEAF + "extendedKeyUsage = clientAuth\n"
    make_cert(d, "allowed", "ops", client + f"subjectAltName = DNS:{ALLOWED}\n", ca="ca")
    make_cert(d, "denied", "intruder", client + "subjectAltName = DNS:intruder.example\n", ca="ca")
    make_cert(d, "stranger", "stranger", client + f"subjectAltName = DNS:{ALLOWED}\n", ca="other_ca")
    for name, (cn, san) in TYPED_CERTS.items():
        make_cert(d, name, cn, client + (f"subjectAltName = {san}\n" if san else ""), ca="ca")
    return d


SPIFFE = "spiffe://example.org/ns/ops/sa/scheduler"
# name: (CN, subjectAltName or None for a certificate without SANs)
TYPED_CERTS = {
    "email_san": ("mail", f"email:{ALLOWED}"),  # an email SAN spelling the allowed host name
    "uri_san": ("uri", f"URI:{ALLOWED}"),  # a URI SAN spelling it
    "cn_with_sans": (ALLOWED, "DNS:other.example"),  # the CN spells it, but the certificate has SANs
    "cn_only": (ALLOWED, None),  # the CN of a certificate without SANs
    "upper_dns": ("upper", "DNS:Scheduler.EXAMPLE"),  # DNS names compare case-insensitively
    "spiffe": ("workload", f"URI:{SPIFFE}"),
    "email": ("mail", "email:ops@example.com"),
    "ip": ("ip", "IP:10.1.2.3, DNS:unlisted.example"),
    "https_uri": ("agent", "URI:https://ops.example/agent"),
    "robot": ("robot", "email:robot@example.com"),  # allowed only by a plain entry: no longer matches
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tls_channel(pki: Path, port: int, client: str | None, trust: str = "ca") -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / f"{trust}.pem").read_bytes(),
        private_key=(pki / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(pki / f"{client}.pem").read_bytes() if client else None)
    return grpc.secure_channel(f"localhost:{port}", creds)


def code_of(call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def verdict(ch: grpc.Channel) -> Any:
    return lambda: pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=5)


def acknowledge(ch: grpc.Channel) -> Any:
    return lambda: pb_grpc.NodeHealthStub(ch).Acknowledge(
        pb.AcknowledgeRequest(component="gpu/index0", code="XID_79"), timeout=5)


def run_eud(ch: grpc.Channel) -> Any:
    return lambda: list(pb_grpc.DiagnosticsStub(ch).Run(pb.RunRequest(tests=["eud"]), timeout=60))


def reports(d: Daemon) -> list[Any]:
    with d.channel() as ch:
        return list(pb_grpc.DiagnosticsStub(ch).List(pb.ListDiagnosticsRequest(), timeout=5).reports)


def secured_daemon(make_daemon: Any, pki: Path, port: int, **listen: Any) -> Daemon:
    tls = {"cert": str(pki / "server.pem"), "key": str(pki / "server.key"), "client_ca": str(pki / "ca.pem")}
    d = make_daemon({"listen": {"tcp": f"127.0.0.1:{port}", "tls": tls, **listen},
                     "authz": {"disruptive": {"identities": [ALLOWED], "unix_groups": [ALLOWED_GROUP]}},
                     "diagnostics": {"eud": {"command": [FAKE_DCGMI, "diag", "-r", "eud", "-j"], "timeout": "20s"}},
                     "checks": {"kernel": {"enabled": False}}},
                    env={"FAKE_DCGMI_MODE": "pass4"})
    d.start()
    return d


def test_mutual_tls_admits_only_verified_clients_and_only_allowed_ones_disrupt(make_daemon: Any, pki: Path) -> None:
    port = free_port()
    d = secured_daemon(make_daemon, pki, port)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # plaintext against the TLS port
        assert code_of(verdict(ch)) == grpc.StatusCode.UNAVAILABLE
    with tls_channel(pki, port, "stranger") as ch:  # a client certificate from an unrelated CA
        assert code_of(verdict(ch)) == grpc.StatusCode.UNAVAILABLE
    with tls_channel(pki, port, "allowed", trust="other_ca") as ch:  # the client does not trust the server
        assert code_of(verdict(ch)) == grpc.StatusCode.UNAVAILABLE
    with tls_channel(pki, port, None) as ch:  # no client certificate at all
        assert code_of(verdict(ch)) == grpc.StatusCode.UNAVAILABLE

    with tls_channel(pki, port, "denied") as ch:  # authenticated, not allowed: reads yes, disrupts no
        assert pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=5).node == "test-node"
        assert pb_grpc.NodeHealthStub(ch).ListChecks(pb.ListChecksRequest(), timeout=5).checks
        assert pb_grpc.DiagnosticsStub(ch).List(pb.ListDiagnosticsRequest(), timeout=5).reports == []
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert code_of(acknowledge(ch)) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(run_eud(ch)) == grpc.StatusCode.PERMISSION_DENIED
        diag = pb_grpc.DiagnosticsStub(ch)
        assert code_of(lambda: diag.Cancel(pb.CancelDiagnosticRequest(id="x"), timeout=5)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: diag.RecordGolden(pb.RecordGoldenRequest(report_id="x"), timeout=5)) == \
            grpc.StatusCode.PERMISSION_DENIED
    assert reports(d) == []  # nothing ran
    assert "Diagnostics/Run refused: certificate intruder.example" in d.log()

    with tls_channel(pki, port, "allowed") as ch:
        assert code_of(acknowledge(ch)) == grpc.StatusCode.NOT_FOUND  # past authorization, no such condition
        msgs = run_eud(ch)()
    assert msgs[-1].phase == pb.DiagnosticProgress.PHASE_DONE
    assert msgs[-1].report.outcome == pb.OUTCOME_PASS
    assert [r.id for r in reports(d)] == [msgs[-1].report.id]
    with d.channel() as ch:  # root on the Unix socket is allowed
        assert code_of(acknowledge(ch)) == grpc.StatusCode.NOT_FOUND

    # The allowlist reloads on SIGHUP.
    d.write_config({"authz": {"disruptive": {"identities": ["dns:intruder.example"]}}})
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "config reloaded" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    with tls_channel(pki, port, "denied") as ch:
        assert code_of(acknowledge(ch)) == grpc.StatusCode.NOT_FOUND
    with tls_channel(pki, port, "allowed") as ch:
        assert code_of(acknowledge(ch)) == grpc.StatusCode.PERMISSION_DENIED


def test_certificate_names_match_only_their_own_type(make_daemon: Any, pki: Path) -> None:
    """RFC 6125: a plain name is a DNS SAN (or the CN of a certificate without SANs); other types are written."""
    port = free_port()
    identities = [ALLOWED, SPIFFE, "email:ops@example.com", "ip:10.1.2.3", "uri:https://ops.example/agent",
                  "robot@example.com"]
    d = make_daemon({"listen": {"tcp": f"127.0.0.1:{port}", "tls": {
        "cert": str(pki / "server.pem"), "key": str(pki / "server.key"), "client_ca": str(pki / "ca.pem")}},
        "authz": {"disruptive": {"identities": identities}}, "checks": {"kernel": {"enabled": False}}})
    d.start()
    expect = {"allowed": "NOT_FOUND", "cn_only": "NOT_FOUND", "upper_dns": "NOT_FOUND", "spiffe": "NOT_FOUND",
              "email": "NOT_FOUND", "ip": "NOT_FOUND", "https_uri": "NOT_FOUND",
              "email_san": "PERMISSION_DENIED", "uri_san": "PERMISSION_DENIED", "cn_with_sans": "PERMISSION_DENIED",
              "robot": "PERMISSION_DENIED", "denied": "PERMISSION_DENIED"}
    got = {}
    for cert in expect:
        with tls_channel(pki, port, cert) as ch:
            got[cert] = code_of(acknowledge(ch)).name  # NOT_FOUND: past authorization, no such condition
    assert got == expect
    # Which plain names changed meaning is said at start; the email-like one with the entry to write.
    log = d.log()
    assert "'robot@example.com' now matches only a DNS SAN, or the CN of a certificate without SANs; write " \
        "'email:robot@example.com'" in log, log
    assert f"'{ALLOWED}' now matches only a DNS SAN" in log, log
    assert "Acknowledge refused: certificate other.example, CN=scheduler.example is not allowed" in log, log

    # `uri:` written out works the same as a bare spiffe:// entry; `dns:` matches a DNS SAN next to a CN.
    d.write_config({"authz": {"disruptive": {"identities": [f"uri:{SPIFFE}", "DNS:other.example"]}}})
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "config reloaded" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    for cert, code in {"spiffe": "NOT_FOUND", "cn_with_sans": "NOT_FOUND", "allowed": "PERMISSION_DENIED",
                       "cn_only": "PERMISSION_DENIED"}.items():
        with tls_channel(pki, port, cert) as ch:
            assert code_of(acknowledge(ch)).name == code, cert


def test_unknown_identity_type_is_a_config_error(make_daemon: Any) -> None:
    d = make_daemon({"authz": {"disruptive": {"identities": ["dns:ok.example", "ldap:ops", "ip:10.0.0.300"]}}})
    lines = d.config_path.read_text().splitlines()
    r = subprocess.run(d.command("--check-config"), capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 1, r.stdout + r.stderr
    ldap = lines.index("    - ldap:ops") + 1
    bad_ip = lines.index("    - ip:10.0.0.300") + 1
    assert f"{d.config_path}:{ldap}: authz.disruptive.identities.1: unknown identity type 'ldap:'" in r.stderr, \
        r.stderr
    assert f"{d.config_path}:{bad_ip}: authz.disruptive.identities.2: '10.0.0.300' is not an IP address" in r.stderr
    assert "Traceback" not in r.stderr


CLIENT = """
import json, sys, grpc
from robustd.api.v1 import robustd_pb2 as pb, robustd_pb2_grpc as pb_grpc
def code(f):
    try:
        f()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"
ch = grpc.insecure_channel("unix://" + sys.argv[1])
nh, dg = pb_grpc.NodeHealthStub(ch), pb_grpc.DiagnosticsStub(ch)
print(json.dumps({
    "verdict": code(lambda: nh.GetVerdict(pb.GetVerdictRequest(), timeout=5)),
    "list": code(lambda: dg.List(pb.ListDiagnosticsRequest(), timeout=5)),
    "ack": code(lambda: nh.Acknowledge(pb.AcknowledgeRequest(component="gpu/index0", code="XID_79"), timeout=5)),
    "cancel": code(lambda: dg.Cancel(pb.CancelDiagnosticRequest(id="x"), timeout=5)),
    "run": code(lambda: list(dg.Run(pb.RunRequest(tests=["eud"]), timeout=30))),
}))
"""


def as_user(d: Daemon, *groups: str) -> dict[str, str]:
    who = ["--groups", ",".join(groups)] if groups else ["--clear-groups"]
    r = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", *who, sys.executable, "-c", CLIENT,
                        d.socket], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_unix_socket_peer_credentials(make_daemon: Any, pki: Path) -> None:
    need_root("running clients as another uid")
    d = secured_daemon(make_daemon, pki, free_port(), unix_mode=0o666)
    for p in (d.root, d.root.parent):
        os.chmod(p, 0o711)  # let `nobody` reach the socket
    got = as_user(d)
    assert got == {"verdict": "OK", "list": "OK", "ack": "PERMISSION_DENIED", "cancel": "PERMISSION_DENIED",
                   "run": "PERMISSION_DENIED"}, got
    assert reports(d) == []
    assert "uid 65534" in d.log()
    got = as_user(d, ALLOWED_GROUP)  # a supplementary group in authz.disruptive.unix_groups
    assert got["ack"] == "NOT_FOUND" and got["cancel"] == "NOT_FOUND" and got["run"] == "OK", got
    assert len(reports(d)) == 1


FLOOD = """
import sys, grpc
from robustd.api.v1 import robustd_pb2 as pb, robustd_pb2_grpc as pb_grpc
denied = 0
with grpc.insecure_channel("unix://" + sys.argv[1]) as ch:
    nh = pb_grpc.NodeHealthStub(ch)
    for _ in range(int(sys.argv[2])):
        try:
            nh.Acknowledge(pb.AcknowledgeRequest(component="gpu/index0", code="XID_79"), timeout=5)
        except grpc.RpcError as e:
            denied += e.code() == grpc.StatusCode.PERMISSION_DENIED
print(denied)
"""


def refuse_as(d: Daemon, uid: int, calls: int) -> int:
    """`calls` Acknowledge calls as `uid` (no groups) over one connection; how many were PERMISSION_DENIED."""
    r = subprocess.run(["setpriv", "--reuid", str(uid), "--regid", "nogroup", "--clear-groups", sys.executable, "-c",
                        FLOOD, d.socket, str(calls)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


def test_a_flood_of_refused_calls_is_summarised_per_caller(make_daemon: Any) -> None:
    """Thousands of refused disruptive calls make a few log lines that say how many and whose; another caller's
    refusal is still logged at once, and the count still pending at shutdown is logged then."""
    need_root("running clients as another uid")
    d = make_daemon({"listen": {"unix_mode": 0o666}, "checks": {"kernel": {"enabled": False}}})
    d.start()
    for p in (d.root, d.root.parent):
        os.chmod(p, 0o711)  # let other uids reach the socket
    t = time.monotonic()
    assert refuse_as(d, 65534, 3000) == 3000
    print(f"3000 refused Acknowledge calls as nobody in {time.monotonic() - t:.1f}s")
    assert refuse_as(d, 60001, 1) == 1  # within nobody's window: a caller of its own, logged at once
    refusals = [line for line in d.log().splitlines() if "refused" in line]
    assert any("Acknowledge refused: uid 60001 (pid" in line for line in refusals), refusals
    assert d.stop() == 0
    refusals = [line for line in d.log().splitlines() if "refused" in line]
    assert len(refusals) <= 5, f"{len(refusals)} lines for 3001 refused calls:\n" + "\n".join(refusals[:10])
    first = [line for line in refusals if "Acknowledge refused: uid 65534 (pid" in line]
    more = [int(m.group(1)) for line in refusals if (m := re.search(
        r"(\d+) more refused calls to /robustd.v1.NodeHealth/Acknowledge from uid 65534 in the last 10s", line))]
    assert first and more, refusals
    assert len(first) + sum(more) == 3000, refusals  # every refusal is in a line or in a count


def test_plaintext_tcp_needs_insecure_and_warns(make_daemon: Any, pki: Path) -> None:
    port = free_port()
    d = make_daemon({"listen": {"tcp": f"127.0.0.1:{port}"}, "checks": {"kernel": {"enabled": False}}})
    r = subprocess.run(d.command(), capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 1 and "listen.tcp" in r.stderr and "insecure" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    d.write_config({"listen": {"insecure": True}})
    d.start()
    assert "WARNING" in d.log() and "PLAINTEXT" in d.log()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # reads work; nobody is identified to disrupt
        assert code_of(verdict(ch)) == grpc.StatusCode.OK
        assert code_of(acknowledge(ch)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(run_eud(ch)) == grpc.StatusCode.UNAUTHENTICATED
    d.restart()
    assert d.log().count("PLAINTEXT") == 2  # at every start

    # The Unix relay's private directory goes with the daemon; one a killed daemon left is swept.
    d.kill()
    assert len(list(d.root.glob(".robustd-*"))) == 1
    d.start()
    assert len(list(d.root.glob(".robustd-*"))) == 1
    d.stop()
    assert list(d.root.glob(".robustd-*")) == []


def test_unreadable_tls_files_are_config_errors(make_daemon: Any, pki: Path) -> None:
    d = make_daemon({"listen": {"tcp": f"127.0.0.1:{free_port()}",
                                "tls": {"cert": str(pki / "missing.pem"), "key": str(pki / "server.key")}},
                     "checks": {"kernel": {"enabled": False}}})
    r = subprocess.run(d.command("--check-config"), capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 1 and "listen.tls.cert" in r.stderr and "missing.pem" in r.stderr, r.stderr


def test_tls_without_client_ca_and_bounded_messages(make_daemon: Any, pki: Path) -> None:
    port = free_port()
    d = make_daemon({"listen": {"tcp": f"127.0.0.1:{port}", "max_message_bytes": 4096,
                                "tls": {"cert": str(pki / "server.pem"), "key": str(pki / "server.key")}},
                     "checks": {"kernel": {"enabled": False}}})
    d.start()
    with tls_channel(pki, port, None) as ch:  # server-only TLS: anonymous callers read, never disrupt
        assert code_of(verdict(ch)) == grpc.StatusCode.OK
        assert code_of(acknowledge(ch)) == grpc.StatusCode.UNAUTHENTICATED
    with tls_channel(pki, port, "denied") as ch:  # a certificate the server did not ask to verify: no identity
        assert code_of(acknowledge(ch)) == grpc.StatusCode.UNAUTHENTICATED
    with d.channel() as ch:
        nh = pb_grpc.NodeHealthStub(ch)
        big = pb.AcknowledgeRequest(component="gpu/index0", code="XID_79", reason="x" * 8192)
        assert code_of(lambda: nh.Acknowledge(big, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_socket_group_lets_its_members_connect_and_no_one_else(make_daemon: Any, pki: Path) -> None:
    import grp

    need_root("running clients as another uid")
    d = secured_daemon(make_daemon, pki, free_port(), unix_mode=0o660, unix_group=ALLOWED_GROUP)
    for p in (d.root, d.root.parent):
        os.chmod(p, 0o711)
    assert os.stat(d.socket).st_gid == grp.getgrnam(ALLOWED_GROUP).gr_gid
    member = as_user(d, ALLOWED_GROUP)
    assert member["verdict"] == "OK" and member["run"] == "OK", member
    r = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", sys.executable, "-c",
                        CLIENT, d.socket], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 or json.loads(r.stdout)["verdict"] != "OK"  # not in the group: cannot even connect


def test_robustctl_over_mutual_tls(make_daemon: Any, pki: Path) -> None:
    port = free_port()
    secured_daemon(make_daemon, pki, port)

    def ctl(*args: str, who: str | None = "allowed") -> subprocess.CompletedProcess[str]:
        tls = ["--tls-ca", str(pki / "ca.pem")]
        if who:
            tls += ["--tls-cert", str(pki / f"{who}.pem"), "--tls-key", str(pki / f"{who}.key")]
        return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "--address", f"127.0.0.1:{port}",
                               *tls, *args], capture_output=True, text=True, timeout=60, cwd=REPO)

    r = ctl("status")
    assert r.returncode == 0 and "node test-node: OK" in r.stdout, r.stderr
    r = ctl("diag", "run", "--tests", "eud")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    r = ctl("diag", "run", "--tests", "eud", who="denied")
    assert r.returncode == 4 and "PERMISSION_DENIED" in r.stderr
    r = ctl("status", who=None)  # no client certificate: the handshake fails
    assert r.returncode == 3 and "Traceback" not in r.stderr
    plain = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "--address", f"127.0.0.1:{port}",
                            "status"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert plain.returncode == 3
