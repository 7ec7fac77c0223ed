"""The Watch streams' hub: each committed event goes to every live stream's mailbox.

The engine publishes an event only after the event log took it (robustd/journal.py), with its seq,
so a stream that subscribes first and then reads the log misses nothing; it skips a seq it already
sent (robustd/api/servicer.py). A mailbox that overflows is marked `lagged` and its stream re-reads
the log instead, so a slow client costs its own memory, never the daemon's. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from robustd.model import Event

MAILBOX = 1024  # events a stream may fall behind before it re-reads the log


@dataclass(eq=False)
class Subscriber:
    """One Watch stream's mailbox. On overflow it is marked lagged and re-reads the log; `closed` ends the
    stream (the daemon is stopping: clients resume by seq)."""

    queue: asyncio.Queue[Event] = field(default_factory=lambda: asyncio.Queue(maxsize=MAILBOX))
    lagged: bool = False
    closed: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Hub:
    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()
        self.closed = False

    def subscribe(self) -> Subscriber:
        s = Subscriber(closed=self.closed)
        self.subscribers.add(s)
        return s

    def unsubscribe(self, s: Subscriber) -> None:
        self.subscribers.discard(s)

    def publish(self, events: list[Event]) -> None:
        for s in self.subscribers:
            for ev in events:
                if s.lagged:
                    break
                try:
                    s.queue.put_nowait(ev)
                except asyncio.QueueFull:
                    s.lagged = True
            s.wake.set()

    def close(self) -> None:
        """End every stream (and any that starts from now on)."""
        self.closed = True
        for s in self.subscribers:
            s.closed = True
            s.wake.set()
