"""The /metrics HTTP endpoint: prometheus_client's WSGI app on a server with bounded connections.

prometheus_client's own `start_http_server` starts one thread per connection, without limit, and a
connection that sends nothing holds its thread forever. Here at most MAX_CONNECTIONS are served at
once (a connection beyond them is closed at once: Prometheus retries at the next scrape interval),
and a connection that does not finish its request within IDLE_TIMEOUT seconds is closed.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

from robustd.startup import split_address

log = logging.getLogger("robustd")
MAX_CONNECTIONS = 16  # scrapes served at once (a Prometheus HA pair needs 2)
IDLE_TIMEOUT = 10.0  # seconds a connection may take to send its request and read the answer


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (an unresolvable name is not)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


class _QuietHandler(WSGIRequestHandler):
    """No access log; a socket timeout, so a silent client cannot hold its thread."""

    timeout = IDLE_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `max_connections` at once; the rest are closed unanswered."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    refused = 0  # connections closed because all slots were taken

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # the thread did not start
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(address: str, collector: Collector, max_connections: int = MAX_CONNECTIONS,
          timeout: float = IDLE_TIMEOUT, key: str = "metrics.address") -> Any:
    """Start the /metrics endpoint on host:port in a daemon thread; returns the HTTP server (to close it).
    Raises OSError when the address cannot be listened on. An address beyond loopback is served, with a
    warning: the endpoint is plain HTTP without authentication."""
    host, port = split_address(address)
    if not is_loopback(host):
        log.warning("%s %s is reachable from other hosts: /metrics is plain HTTP without "
                    "authentication and shows this node's conditions (components, codes, actions), its checks, "
                    "its diagnostics and the robustd version to anyone who can connect; bind it to 127.0.0.1 "
                    "or allow only the Prometheus servers in a firewall", key, address)
    registry = CollectorRegistry()
    registry.register(collector)
    family, bind = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM,
                                      flags=socket.AI_PASSIVE)[0][::4]
    server_class = type("MetricsServer", (BoundedServer,), {"address_family": family,
                                                            "max_connections": max_connections})
    handler = type("MetricsHandler", (_QuietHandler,), {"timeout": timeout})
    server = make_server(bind[0], port, make_wsgi_app(registry), server_class, handler_class=handler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server
