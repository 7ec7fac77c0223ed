"""The daemon's listeners: the gRPC server (Unix socket relay, optional TCP with TLS) and /metrics.

Built once at start from `listen` and `metrics` (a reload does not rebuild them: those keys need a
restart). Every failure to listen is a StartError with one line naming the key.
"""

from __future__ import annotations

import grp
import logging
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from robustd.api.diagnostics import DiagnosticsServicer
from robustd.api.evidence import EvidenceServicer
from robustd.api.requests import RequestInterceptor
from robustd.api.servicer import NodeHealthServicer
from robustd.api.tracer import TracerServicer
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.authz import Authorizer, AuthzInterceptor
from robustd.config import ListenConfig
from robustd.engine import EngineView
from robustd.relay import UnixFront
from robustd.runner import CheckState
from robustd.startup import StartError, check_port
from robustd.tls import server_credentials

log = logging.getLogger("robustd")
SERVICES = ("NodeHealth", "Diagnostics", "Tracer", "Evidence")  # robustd.v1 services, listed by reflection


def unix_front(listen: ListenConfig) -> UnixFront:
    """The public Unix socket's relay (robustd/relay.py); it reads each caller's credentials."""
    return UnixFront(listen.unix, listen.unix_mode, listen.unix_group, max_connections=listen.max_connections,
                     max_connections_per_uid=listen.max_connections_per_uid,
                     handshake_timeout=listen.handshake_timeout)


def grpc_server(listen: ListenConfig, authz: Authorizer) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=[AuthzInterceptor(authz), RequestInterceptor()],
        options=[("grpc.max_receive_message_length", listen.max_message_bytes),
                 ("grpc.max_send_message_length", listen.max_message_bytes),
                 ("grpc.max_concurrent_streams", listen.max_concurrent_streams)])


def add_services(server: grpc.aio.Server, node_health: NodeHealthServicer, diagnostics: DiagnosticsServicer,
                 tracer: TracerServicer, health_servicer: health.aio.HealthServicer,
                 evidence: EvidenceServicer) -> None:
    """robustd.v1's services, grpc.health.v1 and server reflection."""
    add_node_health(server, node_health)
    pb_grpc.add_DiagnosticsServicer_to_server(diagnostics, server)
    pb_grpc.add_TracerServicer_to_server(tracer, server)
    pb_grpc.add_EvidenceServicer_to_server(evidence, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*(pb.DESCRIPTOR.services_by_name[s].full_name for s in SERVICES),
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)


def add_node_health(server: grpc.aio.Server, servicer: NodeHealthServicer) -> None:
    """NodeHealth as the generated code registers it, from the service's descriptor (so no method is left out),
    except that a method may return its answer already encoded: GetVerdict shares the standing conditions'
    bytes across callers (robustd/api/servicer.py), and the generated serializer takes messages only."""
    service = pb.DESCRIPTOR.services_by_name["NodeHealth"]
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        assert not method.client_streaming, f"{method.full_name}: client streaming is not registered here"
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=getattr(pb, method.input_type.name).FromString,
                                     response_serializer=_encoded)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _encoded(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


async def start_listening(server: grpc.aio.Server, front: UnixFront, listen: ListenConfig) -> None:
    """gRPC on the relay's inner socket and, when configured, on TCP (TLS, or plaintext if insecure); then the relay."""
    server.add_insecure_port(front.inner_address)
    if listen.tcp:
        if listen.tls is not None:
            check_port("listen.tcp", listen.tcp)
            credentials = server_credentials(listen.tls.cert, listen.tls.key, listen.tls.client_ca)
            if server.add_secure_port(listen.tcp, credentials) == 0:
                raise StartError(f"listen.tcp: cannot listen on {listen.tcp}")
            log.info("gRPC over TLS on %s%s", listen.tcp,
                     " (mutual TLS: client certificates required)" if listen.tls.client_ca else "")
        else:
            log.warning("listen.insecure: gRPC on %s is PLAINTEXT and unauthenticated: anyone who can reach "
                        "it reads this node's state; configure listen.tls", listen.tcp)
            check_port("listen.tcp", listen.tcp)
            if server.add_insecure_port(listen.tcp) == 0:
                raise StartError(f"listen.tcp: cannot listen on {listen.tcp}")
    await server.start()
    await front.start()


def warn_unknown_groups(names: Sequence[str]) -> None:
    for name in names:
        try:
            grp.getgrnam(name)
        except KeyError:
            log.warning("authz.disruptive.unix_groups: no group named %r on this host", name)


def start_metrics(address: str, view: EngineView, node_name: str, states: Callable[[], Sequence[CheckState]],
                  max_condition_series: int = 1000, probe: Any = None) -> Any:
    """The /metrics endpoint (its HTTP server, to close at stop), or None when `metrics.address` is empty.
    `probe` is a robustd.metrics.DaemonProbe (the watchdog, the scheduler, the diagnostics)."""
    if not address:
        return None
    from robustd.metrics import StateCollector, serve

    try:
        server = serve(address, StateCollector(view, node_name, states, max_condition_series, probe))
    except OSError as e:
        raise StartError(f"metrics: cannot listen on {address}: {e.strerror or e}") from None
    log.info("metrics on http://%s/metrics", address)
    return server
