"""Netlink link state for the NIC check: readings, the (netns-aware) socket, dumps, the tracker.

Kept apart from the check (`checks/nic/check.py`) so the check itself reads as config, scheduling and counters.

pyroute2 decodes the subscription's events (`link_events`) and enters the watched namespace
(`open_netlink`). The once-a-second RTM_GETLINK dump (`dump_links`) is still decoded by hand
(`decode`): measured on this build host (4 links, 200 dumps), pyroute2's generic decoder takes
0.78 ms a dump (194 us a link) against 0.075 ms (19 us a link) by hand, and a training node with
20-odd links would spend ~0.4 % of a core on decoding alone, against a budget of 1 % for the whole
daemon (issue 15: 0.92x node_exporter before). Events are rare (a carrier change), so their cost
does not matter and they take the library's decoder.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyroute2 import netns
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from robustd.model import Finding, FindingKind

DOWN_OPERSTATES = {"DOWN", "LOWERLAYERDOWN", "NOTPRESENT"}
IFF_UP = 0x1

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


# The few rtnetlink attributes the check reads (linux/if_link.h), decoded by hand: pyroute2's
# generic decoder costs ~0.8 ms a link, most of the NIC check's CPU at one dump a second.
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_RTA = struct.Struct("=HH")  # rtattr: len, type
IFLA_IFNAME, IFLA_STATS64, IFLA_OPERSTATE, IFLA_CARRIER, IFLA_CARRIER_CHANGES = 3, 23, 16, 33, 35
OPERSTATES = ("UNKNOWN", "NOTPRESENT", "DOWN", "LOWERLAYERDOWN", "TESTING", "DORMANT", "UP")
STATS64 = ("rx_packets", "tx_packets", "rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped",
           "tx_dropped", "multicast", "collisions")  # the first fields of rtnl_link_stats64
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK, NLMSG_ERROR, NLMSG_DONE = 16, 17, 18, 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300


@dataclass(frozen=True)
class NlMessage:
    type: int
    seq: int
    link: LinkObs | None = None  # for RTM_NEWLINK / RTM_DELLINK
    error: int = 0  # for NLMSG_ERROR (negative errno; 0 is an ack)


def decode(data: bytes) -> list[NlMessage]:
    """Every netlink message in one recv buffer; links decoded, the rest by type only."""
    out: list[NlMessage] = []
    pos = 0
    while pos + _NLMSG.size <= len(data):
        length, kind, _flags, seq, _pid = _NLMSG.unpack_from(data, pos)
        if length < _NLMSG.size:
            break
        body = pos + _NLMSG.size
        if kind in (RTM_NEWLINK, RTM_DELLINK) and length >= _NLMSG.size + _IFINFO.size:
            out.append(NlMessage(kind, seq, _link(data, body, pos + length, kind == RTM_DELLINK)))
        elif kind == NLMSG_ERROR:
            out.append(NlMessage(kind, seq, error=struct.unpack_from("=i", data, body)[0]))
        else:
            out.append(NlMessage(kind, seq))
        pos += (length + 3) & ~3
    return out


def _link(data: bytes, pos: int, end: int, gone: bool) -> LinkObs:
    _family, _type, index, flags, _change = _IFINFO.unpack_from(data, pos)
    pos += _IFINFO.size
    name, oper, carrier, changes, stats = "", "UNKNOWN", None, None, {}
    while pos + _RTA.size <= end:
        alen, atype = _RTA.unpack_from(data, pos)
        if alen < _RTA.size:
            break
        value = data[pos + _RTA.size:pos + alen]
        atype &= 0x3FFF  # drop NLA_F_NESTED / NLA_F_NET_BYTEORDER
        if atype == IFLA_IFNAME:
            name = value.split(b"\0", 1)[0].decode("utf-8", "replace")
        elif atype == IFLA_OPERSTATE and value:
            oper = OPERSTATES[value[0]] if value[0] < len(OPERSTATES) else "UNKNOWN"
        elif atype == IFLA_CARRIER and value:
            carrier = bool(value[0])
        elif atype == IFLA_CARRIER_CHANGES and len(value) >= 4:
            changes = struct.unpack_from("=I", value)[0]
        elif atype == IFLA_STATS64 and len(value) >= 8 * len(STATS64):
            stats = dict(zip(STATS64, struct.unpack_from(f"={len(STATS64)}Q", value), strict=True))
        pos += (alen + 3) & ~3
    return LinkObs(ifname=name, index=index, admin_up=bool(flags & IFF_UP), carrier=carrier, operstate=oper,
                   carrier_changes=changes, stats=stats, gone=gone)


def link_events(data: bytes, marshal: MarshalRtnl | None = None) -> list[LinkObs]:
    """The links of the RTM_NEWLINK / RTM_DELLINK messages in one recv buffer of the subscription (pyroute2)."""
    out: list[LinkObs] = []
    for msg in (marshal or MarshalRtnl()).parse(data):
        kind = msg["header"]["type"]
        if kind not in (RTM_NEWLINK, RTM_DELLINK):
            continue
        carrier, stats = msg.get_attr("IFLA_CARRIER"), msg.get_attr("IFLA_STATS64")
        out.append(LinkObs(ifname=msg.get_attr("IFLA_IFNAME") or "", index=msg["index"],
                           admin_up=bool(msg["flags"] & IFF_UP), carrier=None if carrier is None else bool(carrier),
                           operstate=msg.get_attr("IFLA_OPERSTATE") or "UNKNOWN",
                           carrier_changes=msg.get_attr("IFLA_CARRIER_CHANGES"),
                           stats={k: int(stats[k]) for k in STATS64} if stats else {}, gone=kind == RTM_DELLINK))
    return out


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
        try:
            home = os.open(self_ns, os.O_RDONLY)
            try:
                try:  # flags=0: never create the namespace (pyroute2's default, O_CREAT, would)
                    netns.setns(netns_path, flags=0)
                except OSError as e:
                    raise OSError(e.errno, f"setns into {netns_path}: {os.strerror(e.errno or 0)}") from None
                try:
                    out.append(make())
                finally:
                    netns.setns(home, flags=0)
            finally:
                os.close(home)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out.append(e)

    t = threading.Thread(target=enter, name="nic-netns")
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def dump_links(sock: socket.socket, seq: int, timeout: float) -> list[LinkObs]:
    """RTM_GETLINK dump on a blocking socket; replies of other (timed-out) dumps are skipped."""
    # nlmsghdr (32 bytes in all) + ifinfomsg, all zero but the family: every link, AF_UNSPEC.
    req = _NLMSG.pack(_NLMSG.size + _IFINFO.size, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + bytes(_IFINFO.size)
    sock.settimeout(timeout)
    sock.send(req)
    out: list[LinkObs] = []
    while True:
        for msg in decode(sock.recv(1 << 20)):
            if msg.seq != seq:
                continue
            if msg.type == NLMSG_DONE:
                return out
            if msg.type == NLMSG_ERROR and msg.error:
                raise OSError(-msg.error, f"link dump failed: {os.strerror(-msg.error)}")
            if msg.link is not None and msg.type == RTM_NEWLINK:
                out.append(msg.link)


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
