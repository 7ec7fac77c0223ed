"""The hand-written rtnetlink decoder against the kernel's own view of the same links (sysfs)."""

from __future__ import annotations

import os
import struct

from checks.nic.netlink import (
    IFLA_CARRIER,
    IFLA_IFNAME,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    RTM_DELLINK,
    RTM_GETLINK,
    decode,
    dump_links,
    link_events,
    open_netlink,
)


def _sysfs(ifname: str, name: str) -> str:
    with open(f"/sys/class/net/{ifname}/{name}") as f:
        return f.read().strip()


def test_dump_matches_sysfs_for_every_link_of_this_host() -> None:
    sock = open_netlink(0, None, "")
    try:
        links = dump_links(sock, 7, 2.0)
    finally:
        sock.close()
    assert {link.ifname for link in links} == set(os.listdir("/sys/class/net"))
    for link in links:
        assert link.index == int(_sysfs(link.ifname, "ifindex"))
        assert link.operstate == _sysfs(link.ifname, "operstate").upper()
        assert link.carrier_changes == int(_sysfs(link.ifname, "carrier_changes"))
        assert link.stats["rx_errors"] == int(_sysfs(link.ifname, "statistics/rx_errors"))
        assert link.stats["tx_dropped"] == int(_sysfs(link.ifname, "statistics/tx_dropped"))
        assert 0 <= int(_sysfs(link.ifname, "statistics/rx_bytes")) - link.stats["rx_bytes"] < 1 << 20


def test_decode_handles_dellink_and_nested_flags_and_truncation() -> None:
    def rta(kind: int, payload: bytes) -> bytes:
        raw = struct.pack("=HH", 4 + len(payload), kind) + payload
        return raw + b"\0" * (-len(raw) % 4)

    body = struct.pack("=BxHiII", 0, 1, 9, 0x1, 0) + rta(IFLA_IFNAME, b"ib0\0") + rta(IFLA_CARRIER | 0x8000, b"\0")
    msg = struct.pack("=IHHII", 16 + len(body), RTM_DELLINK, 0, 5, 0) + body
    [m] = decode(msg + b"\x01\x02")  # trailing garbage shorter than a header is ignored
    assert m.seq == 5 and m.link is not None
    assert (m.link.ifname, m.link.index, m.link.carrier, m.link.gone, m.link.admin_up) == ("ib0", 9, False, True, True)


def test_subscription_decoder_reads_what_the_dump_decoder_reads() -> None:
    """Events go through pyroute2 (link_events), dumps through the hand decoder: same links either way."""
    sock = open_netlink(0, None, "")
    try:
        sock.settimeout(2.0)
        sock.send(struct.pack("=IHHII", 32, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 11, 0) + bytes(16))
        data = sock.recv(1 << 20)
    finally:
        sock.close()
    by_hand = [m.link for m in decode(data) if m.link is not None]
    assert by_hand and link_events(data) == by_hand
