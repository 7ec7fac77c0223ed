"""NodeHealth: reads the engine's state and the event log; it never computes health itself.

Every answer fits in one message (`max_message_bytes`, listen.max_message_bytes): events are
bounded when their conditions are made (bounds.py), ListEvents stops before the limit and says where
to go on, and GetVerdict abridges its least severe conditions if the caps were raised past what fits.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from robustd import bounds
from robustd.api import convert, requests
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.api.watch_slots import WatchSlots
from robustd.engine import EngineView, NotWritten
from robustd.model import Event, EventKind, Severity, worst
from robustd.reads import Unreadable
from robustd.runner import CheckState

MAX_LIMIT = 10_000
HEADROOM = 64  # bytes of a response beside what is measured (scalars set after the measuring)


class NodeHealthServicer(pb_grpc.NodeHealthServicer):
    def __init__(self, view: EngineView, acknowledge: Callable[[str, str, str], Awaitable[Event]], node: str,
                 boot_id: str, checks: Callable[[], Sequence[CheckState]], max_message_bytes: int = 4 << 20,
                 watches: WatchSlots | None = None):
        self.view = view
        self.acknowledge = acknowledge  # Engine.acknowledge: the one change this service makes
        self.limit = max_message_bytes  # the largest message a call may send (listen.max_message_bytes)
        self.node = node
        self.boot_id = boot_id
        self.checks = checks
        self._serialised = convert.SerialisedConditions()
        self.watches = watches  # Watch streams per caller (listen.max_watches_per_uid); None: not counted

    async def GetVerdict(self, request: pb.GetVerdictRequest,
                         context: grpc.aio.ServicerContext) -> pb.Verdict | bytes:
        """The verdict, as a Verdict or as its encoding: the standing conditions' bytes are made once per change
        and shared by every caller (convert.SerialisedConditions); only the few header fields are per call.
        Protobuf's encoding lets the two be concatenated; robustd/server.py's serializer sends bytes as they are."""
        await self.view.settled()  # writes in flight get their seqs first; a stuck disk delays this little
        conds, head = self.view.snapshot()
        severity, action = worst(conds)
        v = pb.Verdict(node=self.node, severity=int(severity), action=int(action), seq=head, at=convert.ts(time.time()),
                       boot_id=self.boot_id, emulated=self._emulated(),
                       event_log_error=convert.label(self.view.store_error), events_held=self.view.events_held)
        budget = self.limit - v.ByteSize() - HEADROOM
        shared = self._serialised.joined(conds)
        if len(shared) <= budget:  # always, with the default caps and message limit
            return v.SerializeToString() + shared
        msgs, v.conditions_trimmed, v.conditions_omitted = convert.fit_conditions(conds, budget)
        v.conditions.extend(msgs)
        return v

    def _emulated(self) -> list[str]:
        labels = []
        for st in self.checks():
            if st.status.active and (label := st.check.emulated()):
                labels.append(convert.label(f"{st.name}: {label}"))
        return labels

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Event]:
        slot = await self.watches.admit(context) if self.watches else None  # RESOURCE_EXHAUSTED past the caps
        view = self.view
        sub = view.subscribe()  # before reading the log: nothing falls between the two
        try:
            # Headers go out at once, so a client knows its stream is registered before any event.
            await context.send_initial_metadata((("robustd-head-seq", str(view.head_seq())),))
            try:
                last = requests.seq(request.from_seq, "from_seq")
            except requests.Invalid as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            limit = self.limit
            if last == 0:
                await self.view.settled()
                conds, head = self.view.snapshot()
                for c in conds:
                    yield convert.event_within(Event(EventKind.RAISED, c, c.changed_at, c.seq), limit, snapshot=True)
                last = head
            else:
                head, pruned = view.head_seq(), view.pruned_through()
                if head == 0 and last == 1:
                    last = 0  # an empty log: "after the first event" is "nothing yet", stream every event from here
                elif last > head:
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                        f"from_seq {last} is ahead of this node's event log (newest seq {head}); "
                                        "its state was reset: re-snapshot with from_seq=0")
                if last < pruned:
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                        f"events after seq {last} up to {pruned} are past retention; "
                                        "re-snapshot with from_seq=0 (or GetVerdict, then watch from its seq)")
            replay = True  # first what the log holds after `last`, then the live events
            while True:
                if replay or sub.lagged:  # lagged: fell behind the live queue; drop it and re-read the log
                    while sub.lagged and not sub.queue.empty():
                        sub.queue.get_nowait()
                    replay = sub.lagged = False
                    async for seq, msg in self._from_log(last, context):
                        yield msg
                        last = seq
                    continue
                if sub.queue.empty():
                    if sub.closed:  # the daemon is stopping: end the stream; the client resumes by seq
                        return
                    sub.wake.clear()
                    await sub.wake.wait()
                    continue
                ev = sub.queue.get_nowait()
                if ev.seq > last:
                    yield convert.event_within(ev, limit)
                    last = ev.seq
        finally:
            view.unsubscribe(sub)
            if slot is not None:
                slot.release()

    async def _from_log(self, after: int, context: grpc.aio.ServicerContext) -> AsyncIterator[tuple[int, pb.Event]]:
        """The log's events after `after` as sent, with their seqs; UNAVAILABLE once the log cannot be read in
        time (the client resumes from the last seq it got)."""
        last = after
        try:
            async for ev in self.view.events_after(after):
                yield ev.seq, convert.event_within(ev, self.limit)
                last = ev.seq
        except Unreadable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _resume_later(e, last))

    async def ListEvents(self, request: pb.ListEventsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListEventsResponse:
        if request.limit < 0 or request.limit > MAX_LIMIT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be between 0 and {MAX_LIMIT}")
        if request.min_severity and request.min_severity not in (s.value for s in Severity):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown min_severity {request.min_severity}")
        try:
            since = requests.timestamp(request.since, "since") if request.HasField("since") else None
            after_seq = requests.seq(request.after_seq, "after_seq")
            if len(request.component) > bounds.MAX_COMPONENT:
                raise requests.Invalid(f"component is {len(request.component)} characters; components have at "
                                       f"most {bounds.MAX_COMPONENT}")
        except requests.Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        view = self.view
        try:
            events, oldest = await view.query(since=since, component=request.component,
                                              min_severity=request.min_severity, limit=request.limit or 100,
                                              after_seq=after_seq)
        except Unreadable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; GetVerdict answers from memory meanwhile")
        resp = pb.ListEventsResponse(oldest_seq=oldest, head_seq=view.head_seq())
        budget = self.limit - resp.ByteSize() - HEADROOM
        out: list[pb.Event] = []
        used = 0
        for e in events:
            msg = convert.event_within(e, budget)
            size = convert.field_size(msg.ByteSize())
            if out and used + size > budget:  # the rest on the next page (one event always goes: paging moves)
                resp.truncated = True
                resp.next_after_seq = out[-1].seq
                break
            out.append(msg)
            used += size
        resp.events.extend(out)
        return resp

    async def ListChecks(self, request: pb.ListChecksRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListChecksResponse:
        return pb.ListChecksResponse(checks=[convert.check_info(st) for st in self.checks()])

    async def Acknowledge(self, request: pb.AcknowledgeRequest,
                          context: grpc.aio.ServicerContext) -> pb.AcknowledgeResponse:
        try:
            requests.ascii_token(request.component, "component", bounds.MAX_COMPONENT)
            requests.ascii_token(request.code, "code", bounds.MAX_CODE)
            requests.text(request.reason, "reason", bounds.MAX_REASON)
        except requests.Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            ev = await self.acknowledge(request.component, request.code, request.reason or "acknowledged")
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no standing condition {bounds.echo(request.code)} "
                                f"on {bounds.echo(request.component)}")
        except NotWritten as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.AcknowledgeResponse(event=convert.event_within(ev, self.limit))


def _resume_later(e: Unreadable, last: int) -> str:
    return (f"{e}; watch again from seq {last} once it answers, or from_seq=0 for a snapshot from memory "
            "(GetVerdict answers meanwhile)")
