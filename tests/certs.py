"""Real X.509 certificates for the tests, made by `openssl` (tests/test_security.py, tests/fixtures/slurm/multi.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

# The extensions of a CA and of a leaf; a leaf adds its extendedKeyUsage and subjectAltName.
CA = "basicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
LEAF = "basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\n"


def openssl(*args: str) -> None:
    r = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def make_cert(d: Path, name: str, cn: str, ext: str, ca: str | None = None) -> None:
    """d/name.pem and d/name.key (P-256), self-signed when ca is None, else signed by d/ca.{pem,key}."""
    cfg = d / f"{name}.cnf"
    cfg.write_text(f"[req]\ndistinguished_name = dn\n[dn]\n[ext]\n{ext}\n")
    args = ["req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem"), "-days", "2", "-subj", f"/CN={cn}",
            "-config", str(cfg), "-extensions", "ext"]
    if ca:
        args += ["-CA", str(d / f"{ca}.pem"), "-CAkey", str(d / f"{ca}.key")]
    openssl(*args)


def server_cert(d: Path, name: str, san: str, ca: str = "ca") -> None:
    """A server certificate signed by d/ca, for `san` (e.g. `IP:10.77.3.1` or `DNS:localhost, IP:127.0.0.1`)."""
    make_cert(d, name, name, LEAF + f"extendedKeyUsage = serverAuth\nsubjectAltName = {san}\n", ca=ca)


def client_cert(d: Path, name: str, san: str, ca: str = "ca") -> None:
    """A client certificate signed by d/ca whose identity is `san` (e.g. `DNS:slurmctld.example`)."""
    make_cert(d, name, name, LEAF + f"extendedKeyUsage = clientAuth\nsubjectAltName = {san}\n", ca=ca)
