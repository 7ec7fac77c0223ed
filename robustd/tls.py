"""TLS for the gRPC TCP listener: the server's credentials from the files `listen.tls` names."""

from __future__ import annotations

import grpc

from robustd.config import TlsConfig


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The key pair, and with `client_ca` mutual TLS: a client without a certificate signed by it fails the
    handshake. An unreadable file is a RuntimeError naming its key (`listen.tls.cert: cannot read ...`)."""
    def read(key: str, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise RuntimeError(f"listen.tls.{key}: cannot read {path}: {e.strerror}") from e

    pair = (read("key", tls.key), read("cert", tls.cert))
    if tls.client_ca:
        return grpc.ssl_server_credentials([pair], root_certificates=read("client_ca", tls.client_ca),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([pair])
