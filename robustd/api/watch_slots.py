"""How many Watch streams each caller holds: a cap per caller and in total, with a reserve for root.

Every open Watch costs the daemon on each event (one message made and sent per stream) and memory for its
queue, so one caller holding thousands of them (64 connections × 100 streams) slows everybody's events and
the daemon's memory grows (design rule 7: counts from outside are bounded). A scheduler's adapter opens one
or two; `listen.max_watches_per_uid` (32) is far above that and far below a flood.

The caller is the one robustd/authz.py identifies: a uid on the Unix socket, the names of a verified client
certificate over TLS (counted against the same per-uid cap), else the peer's address. As for connections
(robustd/relay.py), the per-caller cap applies to root too, and all other callers together may hold at
most `listen.max_watches` minus root's reserve (`min(max_watches_per_uid, max_watches // 2)`), so a flood of
streams never keeps an operator's or a root scheduler's Watch out. A stream past the caps is answered
RESOURCE_EXHAUSTED before it sends anything; a slot is released when its stream ends for any reason (the
client cancels, an error, the daemon stops).
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

import grpc

from robustd import bounds
from robustd.authz import Identity
from robustd.ratelog import RateLimitedLogs

log = logging.getLogger("robustd.api")


class WatchSlot:
    """One admitted stream's place; `release()` (idempotent) gives it back when the stream ends."""

    def __init__(self, slots: WatchSlots, caller: str, root: bool):
        self._slots: WatchSlots | None = slots
        self.caller = caller
        self.root = root

    def release(self) -> None:
        if self._slots is not None:
            self._slots._release(self.caller, self.root)
            self._slots = None


class WatchSlots:
    def __init__(self, identify: Callable[[grpc.aio.ServicerContext], Identity | None], max_per_uid: int,
                 max_total: int):
        self.identify = identify  # robustd.authz.Authorizer.identify
        self.max_per_uid = max_per_uid
        self.max_total = max_total
        self.root_reserve = min(max_per_uid, max_total // 2)
        self.open_by_caller: collections.Counter[str] = collections.Counter()  # no zero counts: bounded by the caps
        self.root_streams = 0
        self._refusals = RateLimitedLogs(log, "refused Watch streams of further callers")

    @property
    def open_streams(self) -> int:
        return sum(self.open_by_caller.values())

    async def admit(self, context: grpc.aio.ServicerContext) -> WatchSlot:
        """A slot for this call's stream, or the call aborted with RESOURCE_EXHAUSTED past the caps."""
        caller, root = self._caller(context)
        refusal = self._refusal(caller, root)
        if refusal is not None:
            self._refusals(caller, f"refused Watch streams of {caller}", "Watch refused for %s: %s", caller, refusal)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        self.open_by_caller[caller] += 1
        self.root_streams += root
        return WatchSlot(self, caller, root)

    def close(self) -> None:
        """At shutdown: log the refusals still counted, and stop their timers."""
        self._refusals.flush()

    def _caller(self, context: grpc.aio.ServicerContext) -> tuple[str, bool]:
        """Whom the stream counts against, and whether that is root (uid 0 on the Unix socket)."""
        ident = self.identify(context)
        if ident is not None:
            return ident.caller, ident.unix is not None and ident.unix.uid == 0
        host = (context.peer() or "").rpartition(":")[0]  # `ipv4:10.0.0.5:41234` without its port
        return f"address {host or 'unknown'}", False

    def _refusal(self, caller: str, root: bool) -> str | None:
        """Why one more stream of `caller` is over the caps (the message the client gets), or None."""
        mine = self.open_by_caller[caller]
        total = self.open_streams
        if mine >= self.max_per_uid:
            who = caller if len(caller) <= bounds.MAX_ECHO else f"{caller[:bounds.MAX_ECHO]}…"
            return (f"{who} already holds {mine} Watch streams (listen.max_watches_per_uid {self.max_per_uid}); "
                    "end one first")
        if total >= self.max_total:
            return f"{total} Watch streams are open (listen.max_watches {self.max_total})"
        if not root and total - self.root_streams >= self.max_total - self.root_reserve:
            return (f"{total} Watch streams are open; the last {self.root_reserve} of listen.max_watches "
                    f"{self.max_total} are kept for root")
        return None

    def _release(self, caller: str, root: bool) -> None:
        self.root_streams -= root
        self.open_by_caller[caller] -= 1
        if self.open_by_caller[caller] <= 0:
            del self.open_by_caller[caller]
