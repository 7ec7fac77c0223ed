"""Netlink link state for the NIC check: readings, the (netns-aware) socket, dumps, the tracker.

Kept apart from `checks/nic.py` so the check itself reads as config, scheduling and counters.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from robustd.model import Finding, FindingKind

DOWN_OPERSTATES = {"DOWN", "LOWERLAYERDOWN", "NOTPRESENT"}
IFF_UP = 0x1
CLONE_NEWNET = 0x40000000

# -- netlink ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkObs:
    """One reading of one link, from an event or a dump."""

    ifname: str
    index: int
    admin_up: bool = True
    carrier: bool | None = None
    operstate: str = "UNKNOWN"
    carrier_changes: int | None = None
    stats: Mapping[str, int] = field(default_factory=dict)
    gone: bool = False

    @property
    def down(self) -> bool:
        return self.gone or not self.admin_up or self.carrier is False or self.operstate in DOWN_OPERSTATES

    def evidence(self) -> dict[str, str]:
        if self.gone:
            return {"state": "absent"}
        return {"operstate": self.operstate, "admin": "up" if self.admin_up else "down",
                "carrier": {True: "on", False: "off", None: "unknown"}[self.carrier],
                "carrier_changes": str(self.carrier_changes)}


def link_from_msg(msg: Any) -> LinkObs:
    """An RTM_NEWLINK / RTM_DELLINK message (pyroute2 ifinfmsg) → LinkObs."""
    from pyroute2.netlink.rtnl import RTM_DELLINK

    carrier = msg.get("IFLA_CARRIER")
    return LinkObs(ifname=msg.get("IFLA_IFNAME") or "", index=msg["index"],
                   admin_up=bool(msg["flags"] & IFF_UP), carrier=None if carrier is None else bool(carrier),
                   operstate=msg.get("IFLA_OPERSTATE") or "UNKNOWN", carrier_changes=msg.get("IFLA_CARRIER_CHANGES"),
                   stats=dict(msg.get("IFLA_STATS64") or {}), gone=msg["header"]["type"] == RTM_DELLINK)


def open_netlink(groups: int, netns_path: str | None, self_ns: str) -> socket.socket:
    """A NETLINK_ROUTE socket bound to `groups`, created inside `netns_path` if given.

    A socket keeps the namespace it was created in, so only a short-lived thread enters the
    namespace (setns changes the calling thread only); the daemon's threads never move.
    """
    def make() -> socket.socket:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        s.bind((0, groups))
        return s

    if netns_path is None:
        return make()
    out: list[Any] = []

    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            home = os.open(self_ns, os.O_RDONLY)
            target = os.open(netns_path, os.O_RDONLY)
            try:
                if libc.setns(target, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns_path}: {os.strerror(err)}")
                try:
                    out.append(make())
                finally:
                    libc.setns(home, CLONE_NEWNET)
            finally:
                os.close(target)
                os.close(home)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out.append(e)

    t = threading.Thread(target=enter, name="nic-netns")
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def parse_messages(data: bytes) -> list[Any]:
    from pyroute2.netlink.rtnl.marshal import MarshalRtnl

    return list(MarshalRtnl().parse(data))


def dump_links(sock: socket.socket, seq: int, timeout: float) -> list[LinkObs]:
    """RTM_GETLINK dump on a blocking socket; replies of other (timed-out) dumps are skipped."""
    from pyroute2.netlink import NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR
    from pyroute2.netlink.rtnl import RTM_GETLINK, RTM_NEWLINK
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    req = ifinfmsg()
    req["header"]["type"] = RTM_GETLINK
    req["header"]["flags"] = NLM_F_REQUEST | NLM_F_DUMP
    req["header"]["sequence_number"] = seq
    req["family"] = 0
    req.encode()
    sock.settimeout(timeout)
    sock.send(req.data)
    out: list[LinkObs] = []
    while True:
        for msg in parse_messages(sock.recv(1 << 20)):
            if msg["header"]["sequence_number"] != seq:
                continue
            kind = msg["header"]["type"]
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR and msg["header"].get("error") is not None:
                raise OSError(f"link dump failed: {msg['header']['error']}")
            if kind == RTM_NEWLINK:
                out.append(link_from_msg(msg))


# -- link state ---------------------------------------------------------------------------------
class LinkTracker:
    """Carrier state and carrier changes of the watched links; pure, run on the loop thread."""

    def __init__(self, watched: Callable[[str], bool], expected: Iterable[str], flap_count: int, flap_window: float):
        self.watched = watched
        self.expected = set(expected)  # links reported absent when missing from a dump
        self.flap_count = flap_count
        self.flap_window = flap_window
        self.links: dict[str, LinkObs] = {}
        self.changes: dict[str, deque[float]] = {}
        self._disagree: dict[str, int] = {}

    def event(self, obs: LinkObs, now: float) -> list[Finding]:
        return self._accept(obs, now, from_dump=False) if self.watched(obs.ifname) else []

    def snapshot(self, links: Sequence[LinkObs], now: float) -> list[Finding]:
        """A full dump: reconcile, then re-report every link still down and every flapping one."""
        out: list[Finding] = []
        seen = {o.ifname for o in links}
        for o in links:
            if self.watched(o.ifname):
                out += self._accept(o, now, from_dump=True)
        for name in (self.expected | set(self.links)) - seen:
            out += self._accept(LinkObs(name, -1, gone=True), now, from_dump=True)
        for name, o in sorted(self.links.items()):
            if o.down:
                out.append(self._down(o))
            out += self._flapping(name, now)
        return out

    def _accept(self, obs: LinkObs, now: float, from_dump: bool) -> list[Finding]:
        name = obs.ifname
        prev = self.links.get(name)
        if prev is not None and prev.gone and obs.gone:
            return []
        same = prev is not None and not prev.gone and not obs.gone and prev.index == obs.index
        delta = 0
        if same and prev is not None and prev.carrier_changes is not None and obs.carrier_changes is not None:
            if obs.carrier_changes < prev.carrier_changes:
                return []  # older than a reading already applied (a dump overtaken by an event)
            if from_dump and obs.carrier_changes == prev.carrier_changes and obs.down != prev.down:
                self._disagree[name] = self._disagree.get(name, 0) + 1
                if self._disagree[name] < 2:  # no carrier change in between: believe it on the 2nd dump
                    return []
            delta = obs.carrier_changes - prev.carrier_changes
        elif prev is not None and prev.down != obs.down:
            delta = 1  # a new ifindex (driver reload) or a vanished link: one change, counters restart
        self._disagree.pop(name, None)
        self.links[name] = obs
        if delta:
            q = self.changes.setdefault(name, deque(maxlen=4 * self.flap_count))
            q.extend([now] * min(delta, q.maxlen or delta))
        out: list[Finding] = []
        if obs.down and (prev is None or not prev.down):
            out.append(self._down(obs))
        elif not obs.down and (prev is None or prev.down):
            out.append(Finding(f"nic/{name}", "NIC_DOWN", f"{name} link is up", obs.evidence(), FindingKind.RESOLVED))
        if delta:
            out += self._flapping(name, now)
        return out

    def _down(self, o: LinkObs) -> Finding:
        why = "is gone" if o.gone else f"is down (operstate {o.operstate}, carrier {o.evidence()['carrier']}" + \
            (", admin down)" if not o.admin_up else ")")
        return Finding(f"nic/{o.ifname}", "NIC_DOWN", f"{o.ifname} link {why}", o.evidence(), FindingKind.STATE)

    def _flapping(self, name: str, now: float) -> list[Finding]:
        n = sum(1 for t in self.changes.get(name, ()) if now - t <= self.flap_window)
        if n < self.flap_count:
            return []
        return [Finding(f"nic/{name}", "NIC_FLAPPING", f"{name} changed carrier {n} times in "
                        f"{self.flap_window:g}s", {"carrier_changes_in_window": str(n),
                                                   "window_s": f"{self.flap_window:g}"}, FindingKind.STATE)]
