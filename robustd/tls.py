"""TLS for the gRPC TCP listener: the files `listen.tls` names, checked when the config is loaded, and the
server's credentials made from them at start.

Each file is read as the listener reads it: bounded (MAX_PEM_BYTES) and only when it is a regular file, as a
FIFO or a device would hold the reader, or never end. Its PEM blocks are found and their base64 decoded
strictly here, and the standard library's `ssl` (OpenSSL) parses what they hold: the certificates, the
private key, and that the key belongs to the first certificate. (`cryptography` is not a dependency; `ssl`
reads the same PEM that gRPC's TLS library does.) So a file that is not a PEM certificate or key is a config
error naming its key and line at `--check-config`, at start and at a reload, rather than gRPC's bare failure
to bind when the listener starts.

Every problem is a ValueError whose text does not repeat the path: the config's error line shows it.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import ssl
import stat
from typing import Any

from robustd.roots import PROC_SELF_FD

MAX_PEM_BYTES = 1 << 20  # a certificate chain, a key or a CA bundle (all of Mozilla's CAs are about 220 KB)
CERTIFICATE = "CERTIFICATE"
PRIVATE_KEYS = ("PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY")  # PKCS#8, PKCS#1, SEC 1
_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END ([A-Z0-9 ]+)-----", re.S)
_FILE_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_pem(path: str) -> bytes:
    """The bytes of a regular file of at most MAX_PEM_BYTES; never waits on a FIFO (it is opened non-blocking
    and refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot read it: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_TYPES if test(mode)), "not a plain file")
            raise ValueError(f"not a regular file ({kind})")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_PEM_BYTES and (chunk := os.read(fd, MAX_PEM_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise ValueError(f"cannot read it: {e.strerror}") from None
    finally:
        os.close(fd)
    if size > MAX_PEM_BYTES:
        raise ValueError(f"larger than {MAX_PEM_BYTES >> 10} KiB, too large for a PEM file")
    return b"".join(chunks)


def pem_blocks(data: bytes) -> list[tuple[str, bytes]]:
    """(label, DER) of each `-----BEGIN label-----` block, in order; the base64 between is decoded strictly."""
    out = []
    for m in _BLOCK.finditer(data):
        label = m.group(1).decode()
        if m.group(3) != m.group(1):
            raise ValueError(f"its PEM block BEGIN {label} ends with END {m.group(3).decode()}")
        body = b"".join(line.strip() for line in m.group(2).splitlines()
                        if line.strip() and b":" not in line)  # RFC 1421 headers (Proc-Type: ...) skipped
        try:
            der = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"its PEM block {label} is not valid base64") from None
        out.append((label, der))
    return out


def check_certificates(data: bytes) -> int:
    """How many certificates a PEM certificate file (a chain, a CA bundle) holds; ValueError if none, or one
    that does not parse as X.509."""
    ders = [der for label, der in pem_blocks(data) if label == CERTIFICATE]
    if not ders:
        raise ValueError(f"not a PEM certificate: no -----BEGIN {CERTIFICATE}----- block")
    for i, der in enumerate(ders, 1):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=der)
        except ssl.SSLError:
            raise ValueError(f"certificate {i} of {len(ders)} is not a valid X.509 certificate") from None
    return len(ders)


def check_private_key(data: bytes) -> None:
    """ValueError unless a PEM file holds exactly one unencrypted private key (other blocks, such as the EC
    PARAMETERS `openssl ecparam` writes, may sit beside it)."""
    labels = [label for label, _ in pem_blocks(data)]
    if "ENCRYPTED PRIVATE KEY" in labels or b"Proc-Type: 4,ENCRYPTED" in data:
        raise ValueError("the private key is encrypted; the listener needs it unencrypted (protect the file "
                         "with its mode instead)")
    keys = [label for label in labels if label in PRIVATE_KEYS]
    if not keys:
        raise ValueError("not a PEM private key: no -----BEGIN PRIVATE KEY----- block (nor RSA or EC PRIVATE KEY)")
    if len(keys) > 1:
        raise ValueError(f"{len(keys)} private keys in one file; the listener takes one")


def check_pair(cert: bytes, key: bytes) -> None:
    """ValueError unless OpenSSL loads `key` as the private key of the first certificate of `cert` (both
    already passed their own checks). They are handed over as in-memory files: ssl reads only paths."""
    fds = []
    try:
        for data in (cert, key):
            fds.append(os.memfd_create("robustd-tls", os.MFD_CLOEXEC))
            os.write(fds[-1], data)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(os.path.join(PROC_SELF_FD, str(fds[0])), os.path.join(PROC_SELF_FD, str(fds[1])))
        except ssl.SSLError as e:
            if e.reason in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):  # the latter: another key type
                raise ValueError("not the private key of the certificate in listen.tls.cert") from None
            raise ValueError(f"OpenSSL cannot use it as the key of listen.tls.cert: {e.reason or e}") from None
    except OSError:
        return  # no memfd here (or no /proc): the files were checked one by one, gRPC checks the pair
    finally:
        for fd in fds:
            os.close(fd)


def server_credentials(cert: str, key: str, client_ca: str | None) -> Any:
    """grpc.ServerCredentials for the key pair, and with `client_ca` mutual TLS: a client without a
    certificate signed by it fails the handshake. A file that cannot be read now (it was checked at load) is
    a RuntimeError naming its key (`listen.tls.cert: /path: cannot read it: ...`)."""
    import grpc

    def read(name: str, path: str) -> bytes:
        try:
            return read_pem(path)
        except ValueError as e:
            raise RuntimeError(f"listen.tls.{name}: {path}: {e}") from None

    pair = (read("key", key), read("cert", cert))
    if client_ca:
        return grpc.ssl_server_credentials([pair], root_certificates=read("client_ca", client_ca),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([pair])
