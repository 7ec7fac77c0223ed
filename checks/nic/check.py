"""The NIC check: link state pushed by netlink, counters and InfiniBand ports polled.

Push: a netlink socket subscribed to RTNLGRP_LINK, read non-blocking on the daemon's loop,
so a carrier or operstate change becomes NIC_DOWN (or its RESOLVED) within milliseconds.
Poll (each interval, in the runner's worker thread): an RTM_GETLINK dump gives carrier,
`carrier_changes` and the 64-bit rx/tx error and drop counters of every link (in the watched
network namespace too, whose sysfs this process cannot see); sysfs gives link speed and the
InfiniBand ports (`checks/nic/ib.py`). Each poll also publishes the raw byte counters of every link and
IB port as a `TrafficSnapshot` (robustd/traffic.py), which the GPU check's stall detection reads.

Both paths feed one `LinkTracker` on the loop thread. Each reading carries the link's
`carrier_changes`, so a dump taken just before an event can never undo what the event said,
and every carrier change is counted once for NIC_FLAPPING, even if events were dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from checks.common.counters import RateWindow
from checks.nic.config import RULES, NicConfig
from checks.nic.ib import IbPorts
from checks.nic.netlink import LinkObs, LinkTracker, dump_links, link_events, open_netlink
from robustd.check import Check, CheckContext, stop_reading
from robustd.model import Finding, FindingBatch, FindingKind
from robustd.traffic import TrafficSnapshot, ib_bytes

_CLOSED = object()


class NicCheck(Check):
    """Ethernet/RoCE links (netlink, pushed and polled) and InfiniBand ports (sysfs, polled)."""

    name = "nic"
    mode = "both"
    Config = NicConfig
    rule_file = RULES

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: socket.socket | None = None
        self._marshal = MarshalRtnl()  # pyroute2's decoder for the subscription's events
        self._dump: socket.socket | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._tracker: LinkTracker | None = None
        self._first: list[Finding] = []
        self._seq = 0
        self._counters: dict[str, tuple[int, dict[str, RateWindow]]] = {}
        self._snapshot: TrafficSnapshot | None = None
        self._ib: IbPorts | None = None
        self._note = ""
        self._lock = threading.Lock()
        # The tracker is fed from the loop (subscription events) and from the poll thread (each dump). Its
        # findings go into the queue in the order it made them: both sides append to the loop's ready list
        # while holding this lock, and a dump that changes nothing wakes nobody.
        self._track_lock = threading.Lock()

    @staticmethod
    def _config(ctx: CheckContext) -> NicConfig:
        return ctx.config if isinstance(ctx.config, NicConfig) else NicConfig()

    @staticmethod
    def _netns_path(cfg: NicConfig) -> str | None:
        if not cfg.netns:
            return None
        return cfg.netns if os.sep in cfg.netns else os.path.join(cfg.netns_dir, cfg.netns)

    def _open(self, ctx: CheckContext, groups: int) -> socket.socket:
        self_ns = ctx.roots.proc_path("thread-self", "ns", "net")
        return open_netlink(groups, self._netns_path(self._config(ctx)), self_ns)

    def note(self) -> str:
        """While the hourly IB rates lack a full window, how much history they have (and saturated counters)."""
        return self._note  # made by the last poll: the loop must not walk the ports while a poll changes them

    def traffic_snapshot(self) -> TrafficSnapshot | None:
        """Byte counters of every link but lo and every IB port at the last poll, watched or not (None before it)."""
        return self._snapshot

    async def start(self, ctx: CheckContext) -> None:
        from pyroute2.netlink.rtnl import RTMGRP_LINK

        cfg = self._config(ctx)
        sysfs = cfg.sysfs_root or ctx.roots.sys
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._events = await asyncio.to_thread(self._open, ctx, RTMGRP_LINK)  # subscribe, then dump: nothing missed
        try:
            self._events.setblocking(False)
            self._events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            links = await asyncio.to_thread(self._dump_now, ctx)
            if cfg.interfaces:
                expected = [p for p in cfg.interfaces if not any(c in p for c in "*?[")]

                def watched(name: str) -> bool:
                    return any(fnmatch.fnmatchcase(name, p) for p in cfg.interfaces)
            else:
                def physical(o: LinkObs) -> bool:
                    if cfg.netns:  # the namespace's sysfs is not ours to read
                        return o.ifname != "lo"
                    return os.path.exists(os.path.join(sysfs, "class", "net", o.ifname, "device"))
                expected = [o.ifname for o in links if not o.down and physical(o)]
                names = set(expected)

                def watched(name: str) -> bool:
                    return name in names
            self._tracker = LinkTracker(watched, expected, cfg.flap_count, cfg.flap_window)
            self._first = self._tracker.snapshot(links, time.monotonic())
            ib = IbPorts(cfg.ib_root or os.path.join(sysfs, "class", "infiniband"), cfg.ib_ports,
                         cfg.expected_ib_rate, cfg.ib_error_rate, cfg.rate_window, dict(cfg.ib_thresholds),
                         cfg.ib_window)
            await asyncio.to_thread(ib.discover)
            self._ib = ib
            self._loop.add_reader(self._events.fileno(), self._on_readable)
        except BaseException:
            await self.close()
            raise
        ctx.log.info("nic: watching %s; IB ports %s", sorted(self._tracker.links) or "no links",
                     sorted(ib.ports) or "none")

    async def close(self) -> None:
        if self._events is not None:
            stop_reading(self._loop, self._events)
            self._events = None
        with self._lock:
            if self._dump is not None:
                self._dump.close()
                self._dump = None
        self._queue.put_nowait(_CLOSED)

    def _dump_now(self, ctx: CheckContext) -> list[LinkObs]:
        with self._lock:
            if self._dump is None:
                self._dump = self._open(ctx, 0)
            self._seq += 1
            try:
                return dump_links(self._dump, self._seq, self._config(ctx).deadline)
            except BaseException:
                self._dump.close()  # a half-read dump must not confuse the next one
                self._dump = None
                raise

    def _on_readable(self) -> None:
        """Loop callback: drain the subscription; hand findings to `reports`."""
        events, tracker, loop = self._events, self._tracker, self._loop
        if events is None or tracker is None or loop is None:
            return
        chunks: list[bytes] = []
        while True:
            try:
                chunks.append(events.recv(1 << 20))
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # ENOBUFS: events were dropped; the next dump reconciles
                    continue
                self._queue.put_nowait(e)
                loop.remove_reader(events.fileno())
                break
        now = time.monotonic()
        with self._track_lock:
            out = [f for data in chunks for link in link_events(data, self._marshal) for f in tracker.event(link, now)]
            if out:
                loop.call_soon(self._queue.put_nowait, out)

    def _reconcile(self, links: list[LinkObs], now: float) -> None:
        """On the poll thread: a dump reconciles the tracker; only what it finds wakes the loop."""
        loop, tracker = self._loop, self._tracker
        if loop is None or tracker is None:
            return
        with self._track_lock:
            found = tracker.snapshot(links, now)
            if found:
                with contextlib.suppress(RuntimeError):  # the loop is closed: robustd is exiting
                    loop.call_soon_threadsafe(self._queue.put_nowait, found)

    def watch(self) -> AsyncIterator[FindingBatch]:
        return self._iterate(self._first)

    async def _iterate(self, first: list[Finding]) -> AsyncIterator[FindingBatch]:
        yield FindingBatch(self.name, tuple(first))
        while True:
            item = await self._queue.get()
            if item is _CLOSED:
                return
            if isinstance(item, BaseException):
                raise item
            if item:
                yield FindingBatch(self.name, tuple(item))

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        cfg = self._config(ctx)
        links = self._dump_now(ctx)
        now = time.monotonic()
        self._reconcile(links, now)
        watched = self._tracker.watched if self._tracker else (lambda _: False)
        out: list[Finding] = []
        for o in links:
            if watched(o.ifname):
                out += self._counters_of(cfg, o, now)
                out += self._speed_of(cfg, ctx, o)
        traffic = {f"nic/{o.ifname}": o.stats.get("rx_bytes", 0) + o.stats.get("tx_bytes", 0)
                   for o in links if o.ifname != "lo"}
        if self._ib is not None:
            with self._lock:
                out += self._ib.poll(now)
                self._note = self._ib.note(now)
                traffic.update(self._ib.data_totals())  # the counters that poll read, not a second read
        else:
            sysfs = cfg.sysfs_root or ctx.roots.sys
            traffic.update(ib_bytes(cfg.ib_root or os.path.join(sysfs, "class", "infiniband")))
        self._snapshot = TrafficSnapshot(at=now, links=traffic)  # replaced whole: readers never see half of one
        return out

    def _counters_of(self, cfg: NicConfig, o: LinkObs, now: float) -> list[Finding]:
        index, windows = self._counters.get(o.ifname, (o.index, {}))
        if index != o.index:  # a new ifindex: the driver was reloaded and its counters restarted
            windows = {}
        self._counters[o.ifname] = (o.index, windows)
        s = o.stats
        sums = {"errors": s.get("rx_errors", 0) + s.get("tx_errors", 0),
                "drops": s.get("rx_dropped", 0) + s.get("tx_dropped", 0)}
        rates = {}
        for k, v in sums.items():
            w = windows.setdefault(k, RateWindow(cfg.rate_window))
            w.add(now, v)
            rates[k] = w.rate()
        bad = {k: f"{rates[k]:.3g}/s (total {sums[k]})" for k, limit in (("errors", cfg.error_rate),
                                                                         ("drops", cfg.drop_rate))
               if (rates[k] or 0.0) > limit}
        if not bad:
            return []
        detail = {k: str(s.get(k, 0)) for k in ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped")}
        return [Finding(f"nic/{o.ifname}", "NIC_ERRORS_RISING", f"{o.ifname} " + ", ".join(
            f"{k} rising {v}" for k, v in bad.items()), {**bad, **detail}, FindingKind.STATE)]

    def _speed_of(self, cfg: NicConfig, ctx: CheckContext, o: LinkObs) -> list[Finding]:
        want = cfg.expected_speed_mbps
        if isinstance(want, dict):
            want = next((v for p, v in want.items() if fnmatch.fnmatchcase(o.ifname, p)), None)
        if want is None or cfg.netns or o.down:  # speed is only meaningful with a link
            return []
        try:
            with open(os.path.join(cfg.sysfs_root or ctx.roots.sys, "class", "net", o.ifname, "speed")) as f:
                speed = int(f.read().strip())
        except (OSError, ValueError):
            return []  # no speed reported (virtual links, EINVAL while the link trains)
        comp = f"nic/{o.ifname}"
        if 0 < speed < want:
            return [Finding(comp, "NIC_SPEED_DEGRADED", f"{o.ifname} runs at {speed} Mb/s, expected {want}",
                            {"speed_mbps": str(speed), "expected_mbps": str(want)}, FindingKind.STATE)]
        return [Finding(comp, "NIC_SPEED_DEGRADED", kind=FindingKind.RESOLVED)] if speed > 0 else []
