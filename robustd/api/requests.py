"""Requests at the API edge: parsed inside the call, checked field by field, errors short.

grpc-aio parses a request before the servicer runs; a corrupt one raises inside grpc, which
logs a traceback and answers UNKNOWN. `RequestInterceptor` takes the parsing over: each unary
request arrives as raw bytes and is parsed in the handler, so a corrupt one is INVALID_ARGUMENT
with one short line, and nothing in the log.

Register it after the authorization interceptor: `interceptors=[AuthzInterceptor(...),
RequestInterceptor(...)]` makes the authz check the outer wrapper, so a disruptive call is
authorized before its request is even parsed.

The checks below turn protobuf's unbounded fields into the ranges robustd can use; each raises
`Invalid` with a message that quotes no more than `bounds.MAX_ECHO` characters of the input.
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from robustd import bounds

MAX_SEQ = (1 << 63) - 1  # seqs are SQLite integers
MIN_TIMESTAMP = -62135596800  # 0001-01-01T00:00:00Z, protobuf's Timestamp range
MAX_TIMESTAMP = 253402300799  # 9999-12-31T23:59:59Z
MAX_DURATION = 315576000000  # 10,000 years, protobuf's Duration range

class Invalid(ValueError):
    """A request field out of range; the message is the INVALID_ARGUMENT details."""


def seq(value: int, name: str) -> int:
    """A uint64 seq field: seqs are SQLite integers, so 2^63 and above can never name one."""
    if value > MAX_SEQ:
        raise Invalid(f"{name} must be below 2^63 (got {value})")
    return value


def timestamp(ts: Timestamp, name: str) -> float:
    """Seconds since the epoch of a Timestamp in protobuf's range (years 1 to 9999, nanos 0..999999999)."""
    if not MIN_TIMESTAMP <= ts.seconds <= MAX_TIMESTAMP:
        raise Invalid(f"{name}.seconds must be between {MIN_TIMESTAMP} and {MAX_TIMESTAMP} "
                      f"(years 1 to 9999); got {ts.seconds}")
    if not 0 <= ts.nanos <= 999_999_999:
        raise Invalid(f"{name}.nanos must be between 0 and 999999999; got {ts.nanos}")
    return ts.seconds + ts.nanos / 1e9


def duration(d: Duration, name: str) -> float:
    """Seconds of a Duration in protobuf's range (±10,000 years; nanos of the seconds' sign)."""
    if not -MAX_DURATION <= d.seconds <= MAX_DURATION:
        raise Invalid(f"{name}.seconds must be within ±{MAX_DURATION}; got {d.seconds}")
    if not -999_999_999 <= d.nanos <= 999_999_999 or (d.seconds > 0 > d.nanos) or (d.seconds < 0 < d.nanos):
        raise Invalid(f"{name}.nanos must be within ±999999999 and of the same sign as seconds; got {d.nanos}")
    return d.seconds + d.nanos / 1e9


def ascii_token(value: str, name: str, limit: int) -> str:
    """A component or code as conditions carry them: printable ASCII without spaces, 1..limit bytes."""
    if not bounds.is_token(value, limit):
        if not value:
            raise Invalid(f"{name} is required")
        raise Invalid(f"{name} must be 1 to {limit} printable ASCII characters without spaces; "
                      f"got {bounds.echo(value)}")
    return value


def text(value: str, name: str, limit: int) -> str:
    """A free text field of at most `limit` UTF-8 bytes."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise Invalid(f"{name} is {size} bytes; at most {limit} are accepted")
    return value


Handler = Callable[[Any, grpc.aio.ServicerContext], Any]


class RequestInterceptor(grpc.aio.ServerInterceptor):
    """Parses unary requests inside the handler: a corrupt one is INVALID_ARGUMENT."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler  # streamed requests (reflection) keep grpc's own parsing
        parse = handler.request_deserializer
        name = details.method.rpartition("/")[2] or details.method

        async def request(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception:  # noqa: BLE001 - DecodeError, or whatever a deserializer raises on bad bytes
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{name}: the request is not a valid protobuf message ({len(raw)} bytes)")

        if handler.unary_unary is not None:
            inner_uu: Handler = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                result = inner_uu(await request(raw, context), context)
                return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)

        inner_us: Handler = handler.unary_stream
        if inspect.isasyncgenfunction(inner_us):
            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for msg in inner_us(await request(raw, context), context):
                    yield msg

            return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)

        async def unary_stream_writer(raw: bytes, context: grpc.aio.ServicerContext) -> None:
            """For handlers that write with context.write (grpc's health Watch) instead of yielding."""
            result = inner_us(await request(raw, context), context)
            if inspect.isawaitable(result):
                await result

        return grpc.unary_stream_rpc_method_handler(unary_stream_writer, None, handler.response_serializer)
