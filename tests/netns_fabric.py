"""Hosts on one switch, for real: each host a network namespace with one veth link to a bridge in the root
namespace, and the faults a real network has, made with the kernel's own tools (`ip`, `tc`).

Used by the netns tests (tests/test_all_gather_netns.py, tests/test_fleet_diagnose_netns.py) and by
bench/fleet_diagnose.py. Everything made here is torn down by `close()` (the devices take their qdiscs
with them), also after a failure half-way through the setup; a `Fabric` is a context manager.

Faults (this kernel has tbf, htb and u32, not netem):
- `slow_host(i)`: a token bucket (tbf) on both ends of host i's link, so every flow to or from it is slow;
- `slow_pair(i, j)`: an htb class with a u32 filter on the destination address on each of the two
  hosts' own veth, so only the traffic between i and j is slow and each keeps full speed to the others;
- `link_down(i)`: host i's veth set down inside its namespace (a daemon there still answers on its
  Unix socket, which is reachable from every namespace: sockets live in the file system);
- `clear(i)`: host i's link back to full speed (both ends' root qdiscs removed).

With `bridge_addr=True` the bridge itself has an address on the subnet (`bridge_ip`, `<subnet>.254`), so
daemons in the root namespace (tests/fixtures/slurm/multi.py: slurmctld and its EpilogSlurmctld) and the
hosts reach each other; its subnet is then one that no route in the root namespace uses yet.
"""

from __future__ import annotations

import ipaddress
import subprocess
import uuid
from dataclasses import dataclass

SLOW_RATE = "8mbit"  # 1 MB/s: three orders of magnitude below a veth pair on this machine
# The --slow-fraction (slurm.ctld.slow_fraction) of the tests that diagnose daemons' CPU collectives on this
# machine. Healthy pairs of gloo ranks sharing two cores are not a fabric: timed by their median iteration
# and judged by the better of their round and a re-test alone, they were still seen 7 times below the
# reference (CI, a healthy 4-host ring: 0.027 against 0.19 GB/s, the same pair in its round and alone) and
# 9 times (0.024 against 0.22 GB/s, while other tests loaded the cores); a lap of a healthy pair took from
# 0.2 ms to 38 ms in one loaded run. A pair behind the SLOW_RATE token bucket sits at 0.003-0.017 of the
# reference. 0.05 keeps more than twice the worst healthy spread seen and three times the slowest
# reference seen on the slow side; the default 0.5 is for a fabric, whose healthy pairs measure within a
# few percent of each other.
TEST_SLOW_FRACTION = 0.05


def ip(*args: str) -> None:
    run("ip", *args)


def tc(*args: str) -> None:
    run("tc", *args)


def run(*argv: str) -> None:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    ns: str  # the network namespace
    addr: str  # its address on the bridge's subnet
    dev: str  # its end of the veth, inside the namespace
    peer: str  # the other end, a port of the bridge in the root namespace


class Fabric:
    """`n` hosts on one bridge: `hosts[i]` is host i; `netns_exec(i)` the prefix to run a command there."""

    def __init__(self, n: int, prefix: str = "rdfab", bridge_addr: bool = False):
        tag = uuid.uuid4().hex[:5]
        self.bridge = f"rdbr{tag}"
        third = int(tag[:2], 16)
        if bridge_addr:  # a subnet on the root namespace's routes would clash with another bridge's (or the host's)
            free = next((t for t in [third, *range(256)] if not _routed(f"10.77.{t}.0/24")), None)
            if free is None:
                raise RuntimeError("every 10.77.*.0/24 is routed in the root namespace: leftover bridges?")
            third = free
        subnet = f"10.77.{third}"
        self.bridge_ip: str | None = f"{subnet}.254" if bridge_addr else None
        self.hosts = [Host(f"{prefix}-{tag}-{i}", f"{subnet}.{i + 1}", f"rdh{tag}{i}", f"rdv{tag}{i}")
                      for i in range(n)]
        self._made: list[tuple[str, ...]] = []  # undo commands, in the order things were made
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("ip", "link", "del", self.bridge))
            ip("link", "set", self.bridge, "up")
            if self.bridge_ip:
                ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            for h in self.hosts:
                ip("netns", "add", h.ns)
                self._made.append(("ip", "netns", "del", h.ns))
                ip("link", "add", h.peer, "type", "veth", "peer", "name", h.dev)
                self._made.append(("ip", "link", "del", h.peer))
                ip("link", "set", h.dev, "netns", h.ns)
                ip("link", "set", h.peer, "master", self.bridge, "up")
                ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
                ip("-n", h.ns, "link", "set", h.dev, "up")
                ip("-n", h.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def netns_exec(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i].ns]

    def net_enter(self, i: int) -> list[str]:
        """A prefix that joins host i's network namespace only. `ip netns exec` also gives the command a mount
        namespace of its own with a fresh /sys, in which /sys/fs/cgroup is not mounted: slurmd's cgroup plugin
        then fails to start ("No filesystem mounted on /sys/fs/cgroup")."""
        return ["nsenter", f"--net=/run/netns/{self.hosts[i].ns}"]

    def slow_host(self, i: int, rate: str = SLOW_RATE) -> None:
        """Rate-limit host i's link in both directions: its own veth (what it sends) and the bridge's port
        (what it receives)."""
        h = self.hosts[i]
        tbf = ("root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")
        tc("-n", h.ns, "qdisc", "add", "dev", h.dev, *tbf)
        tc("qdisc", "add", "dev", h.peer, *tbf)

    def slow_pair(self, i: int, j: int, rate: str = SLOW_RATE) -> None:
        """Rate-limit only the traffic between hosts i and j (each direction on its sender's veth)."""
        for a, b in ((i, j), (j, i)):
            h, other = self.hosts[a], self.hosts[b]
            n = ("-n", h.ns)
            tc(*n, "qdisc", "add", "dev", h.dev, "root", "handle", "1:", "htb", "default", "10")
            tc(*n, "class", "add", "dev", h.dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
            tc(*n, "class", "add", "dev", h.dev, "parent", "1:", "classid", "1:20", "htb", "rate", rate)
            tc(*n, "filter", "add", "dev", h.dev, "parent", "1:", "protocol", "ip", "u32",
               "match", "ip", "dst", f"{other.addr}/32", "flowid", "1:20")

    def clear(self, i: int) -> None:
        """Host i's link at full speed again: the root qdisc of each end removed (none there: nothing to do)."""
        h = self.hosts[i]
        for argv in (["tc", "-n", h.ns, "qdisc", "del", "dev", h.dev, "root"], ["tc", "qdisc", "del", "dev", h.peer,
                                                                                  "root"]):
            subprocess.run(argv, capture_output=True, timeout=20)

    def link_down(self, i: int) -> None:
        h = self.hosts[i]
        ip("-n", h.ns, "link", "set", h.dev, "down")

    def qdiscs(self, i: int) -> str:
        """`tc qdisc show` of both ends of host i's link (for a failing test's message)."""
        h = self.hosts[i]
        out = []
        for argv in (["tc", "-n", h.ns, "qdisc", "show", "dev", h.dev], ["tc", "qdisc", "show", "dev", h.peer]):
            out.append(subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip())
        return "\n".join(out)

    def close(self) -> None:
        """Undo everything, newest first, whatever fails on the way (a namespace takes its veth end, the
        veth its peer, a device its qdiscs)."""
        for argv in reversed(self._made):
            subprocess.run(list(argv), capture_output=True, timeout=20)
        self._made.clear()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _routed(subnet: str) -> bool:
    """Whether a route of the root namespace's main table overlaps `subnet` (a leftover bridge's, the host's)."""
    p = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, timeout=20)
    net = ipaddress.ip_network(subnet)
    for line in p.stdout.splitlines():
        try:
            if ipaddress.ip_network(line.split()[0], strict=False).overlaps(net):
                return True
        except (IndexError, ValueError):  # `default`, or an empty line
            continue
    return False
