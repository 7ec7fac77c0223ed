"""NodeHealth: reads the engine's state and the event log; it never computes health itself."""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable, Iterator, Sequence

import grpc

from robustd.api import convert
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.engine import Engine
from robustd.model import Event, Severity, worst
from robustd.runner import CheckState
from robustd.store import iter_batches

MAX_LIMIT = 10_000


class NodeHealthServicer(pb_grpc.NodeHealthServicer):
    def __init__(self, engine: Engine, node: str, boot_id: str, checks: Callable[[], Sequence[CheckState]]):
        self.engine = engine
        self.node = node
        self.boot_id = boot_id
        self.checks = checks

    async def GetVerdict(self, request: pb.GetVerdictRequest, context: grpc.aio.ServicerContext) -> pb.Verdict:
        conds, head = self.engine.snapshot()
        severity, action = worst(conds)
        return pb.Verdict(node=self.node, severity=int(severity), action=int(action),
                          conditions=[convert.condition(c) for c in conds], seq=head, at=convert.ts(time.time()),
                          boot_id=self.boot_id, emulated=self._emulated(),
                          event_log_error=self.engine.store_error, events_held=len(self.engine.backlog))

    def _emulated(self) -> list[str]:
        labels = []
        for st in self.checks():
            if st.status not in ("DISABLED", "UNSUPPORTED") and (label := st.check.emulated()):
                labels.append(f"{st.name}: {label}")
        return labels

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Event]:
        store = self.engine.store
        sub = self.engine.hub.subscribe()  # before reading the log: nothing falls between the two
        try:
            # Headers go out at once, so a client knows its stream is registered before any event.
            await context.send_initial_metadata((("robustd-head-seq", str(store.head_seq())),))
            last = request.from_seq
            if last == 0:
                conds, head = self.engine.snapshot()
                for c in conds:
                    yield pb.Event(seq=c.seq, at=convert.ts(c.changed_at), kind=pb.EVENT_KIND_RAISED,
                                   condition=convert.condition(c), snapshot=True)
                last = head
            else:
                head, pruned = store.head_seq(), store.pruned_through()
                if last > head:
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                        f"from_seq {last} is ahead of this node's event log (newest seq {head}); "
                                        "its state was reset: re-snapshot with from_seq=0")
                if last < pruned:
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                        f"events after seq {last} up to {pruned} are past retention; "
                                        "re-snapshot with from_seq=0 (or GetVerdict, then watch from its seq)")
            for ev in self._log_after(last):
                yield convert.event(ev)
                last = ev.seq
            while True:
                if sub.lagged:  # fell behind the live queue: drop it and re-read the log
                    while not sub.queue.empty():
                        sub.queue.get_nowait()
                    sub.lagged = False
                    for ev in self._log_after(last):
                        yield convert.event(ev)
                        last = ev.seq
                    continue
                if sub.queue.empty():
                    sub.wake.clear()
                    await sub.wake.wait()
                    continue
                ev = sub.queue.get_nowait()
                if ev.seq > last:
                    yield convert.event(ev)
                    last = ev.seq
        finally:
            self.engine.hub.unsubscribe(sub)

    def _log_after(self, last: int) -> Iterator[Event]:
        for batch in iter_batches(self.engine.store, last):
            yield from batch

    async def ListEvents(self, request: pb.ListEventsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListEventsResponse:
        if request.limit < 0 or request.limit > MAX_LIMIT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be between 0 and {MAX_LIMIT}")
        if request.min_severity and request.min_severity not in (s.value for s in Severity):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown min_severity {request.min_severity}")
        since = request.since.ToNanoseconds() / 1e9 if request.HasField("since") else None
        store = self.engine.store
        events = store.query(since=since, component=request.component, min_severity=request.min_severity,
                             limit=request.limit or 100, after_seq=request.after_seq)
        return pb.ListEventsResponse(events=[convert.event(e) for e in events], oldest_seq=store.oldest_seq(),
                                     head_seq=store.head_seq())

    async def ListChecks(self, request: pb.ListChecksRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListChecksResponse:
        return pb.ListChecksResponse(checks=[convert.check_info(st) for st in self.checks()])

    async def Acknowledge(self, request: pb.AcknowledgeRequest,
                          context: grpc.aio.ServicerContext) -> pb.AcknowledgeResponse:
        if not request.component or not request.code:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "component and code are both required")
        try:
            ev = self.engine.acknowledge(request.component, request.code, request.reason or "acknowledged")
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no standing condition {request.code} on {request.component}")
        return pb.AcknowledgeResponse(event=convert.event(ev))
