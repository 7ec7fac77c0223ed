"""Tracer service: capture the stacks of this node's training processes (py-spy), one call per node."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, status_pb2
from grpc_status import rpc_status

from robustd import tracer
from robustd.api.convert import dur, ts
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.config import TracerConfig
from robustd.roots import Roots

MAX_TIMEOUT = 600.0


class TracerServicer(pb_grpc.TracerServicer):
    def __init__(self, node: str, config: Callable[[], TracerConfig], roots: Callable[[], Roots],
                 gpu_pids: Callable[[], Iterable[int]]):
        self.node = node
        self.config = config
        self.roots = roots
        self.gpu_pids = gpu_pids

    async def CaptureStacks(self, request: pb.CaptureRequest, context: grpc.aio.ServicerContext) -> pb.CaptureResponse:
        cfg = self.config()
        timeout = cfg.timeout
        if request.HasField("timeout"):
            asked = request.timeout.ToNanoseconds() / 1e9
            if asked < 0 or asked > MAX_TIMEOUT:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"timeout must be between 0 and {MAX_TIMEOUT:g} s (0: tracer.timeout)")
            timeout = asked or timeout
        try:
            py_spy = tracer.find_py_spy(cfg.py_spy)
        except tracer.NoPySpy as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        targets = tracer.select(self.roots(), cfg, self.gpu_pids())
        try:
            targets = tracer.narrow(targets, list(request.selector.pids), list(request.selector.ranks))
        except tracer.NotTraceable as e:
            await context.abort(*_not_traceable(e))
        captured_at = time.time()
        captures = await tracer.capture_all(py_spy, targets, request.native, timeout, cfg.concurrency)
        return pb.CaptureResponse(node=self.node, captured_at=ts(captured_at),
                                  processes=[_process(c) for c in captures])


def _not_traceable(e: tracer.NotTraceable) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
    """NOT_FOUND whose status details (google.rpc.Status, the gRPC rich error model) name the pids and ranks."""
    detail = any_pb2.Any()
    detail.Pack(pb.NotTraceable(pids=e.pids, ranks=e.ranks))
    status = rpc_status.to_status(status_pb2.Status(code=code_pb2.NOT_FOUND, message=str(e), details=[detail]))
    return status.code, status.details, tuple(status.trailing_metadata)


def _process(c: tracer.Capture) -> pb.ProcessStacks:
    t = c.target
    msg = pb.ProcessStacks(pid=t.pid, command=t.command, selected_by=t.selected_by, error=c.error,
                           timed_out=c.timed_out, duration=dur(c.seconds), threads=[_thread(th) for th in c.threads])
    for name in ("rank", "local_rank", "world_size"):
        value = getattr(t, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def _thread(th: dict[str, Any]) -> pb.ThreadStack:
    return pb.ThreadStack(
        thread_id=int(th.get("thread_id") or 0) & 0xFFFFFFFFFFFFFFFF, os_thread_id=int(th.get("os_thread_id") or 0),
        name=str(th.get("thread_name") or ""), active=bool(th.get("active")), owns_gil=bool(th.get("owns_gil")),
        frames=[pb.StackFrame(function=str(f.get("name") or "?"), file=str(f.get("filename") or ""),
                              line=max(0, min(int(f.get("line") or 0), 2**31 - 1)), native=tracer.is_native(f))
                for f in th.get("frames") or ()])
