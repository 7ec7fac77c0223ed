"""Many daemons at once: host lists, one Client per host, calls fanned out under one bounded wall time.

A host is `HOST`, `HOST:PORT` or `[V6]:PORT` (TCP, port 7070 by default; TLS with robustctl's --tls-*
options), or a Unix socket as `unix:PATH` or an absolute path. Every host's answer or failure comes
back; one dead host never holds the others up longer than the per-request deadline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from robustd.cli.client import Client, CliError

DEFAULT_PORT = 7070
MAX_PARALLEL = 64

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    host: str
    value: T | None
    error: str = ""  # one line: why no value
    unreachable: bool = False
    seconds: float = 0.0


MAX_HOSTS_FILE = 4 << 20  # bytes of a hosts file read


def read_entries(path: str) -> list[tuple[str, str | None]]:
    """A hosts file: `HOST [ADDR]` a line (ADDR: where the other hosts reach this one, for `fleet diagnose`);
    blank lines and `#` comments ignored; ValueError naming the line for one with more fields."""
    with open(path, encoding="utf-8") as f:
        text = f.read(MAX_HOSTS_FILE + 1)
    if len(text) > MAX_HOSTS_FILE:
        raise ValueError(f"{path}: longer than {MAX_HOSTS_FILE >> 20} MiB")
    out: list[tuple[str, str | None]] = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if len(fields) > 2:
            raise ValueError(f"{path}:{n}: expected HOST [ADDR], got {len(fields)} fields")
        if fields:
            out.append((fields[0], fields[1] if len(fields) == 2 else None))
    return out


def read_hosts(path: str) -> list[str]:
    """The hosts of a hosts file (an ADDR after a host is for `fleet diagnose`, and ignored here)."""
    return [host for host, _addr in read_entries(path)]


def hosts_from(args_hosts: Sequence[str], hosts_file: str | None) -> list[str]:
    """Hosts from the command line and the file, in order, each once; ValueError when there are none."""
    hosts = list(dict.fromkeys([*args_hosts, *(read_hosts(hosts_file) if hosts_file else [])]))
    if not hosts:
        raise ValueError("no hosts: give HOST arguments or --hosts-file FILE")
    return hosts


def client_for(host: str, timeout: float, tls: tuple[str | None, str | None, str | None]) -> Client:
    if host.startswith("unix:"):
        path = host.removeprefix("unix:")
        path = path[2:] if path.startswith("///") else path
        return Client(path, None, timeout, tls, socket_hint=False)
    if "/" in host or os.path.exists(host):
        # A path, relative or not (`run/robustd.sock`): no host name holds a slash, and an existing file
        # is a socket even without one (`robustd.sock` in the current directory).
        return Client(host, None, timeout, tls, socket_hint=False)
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{host!r} is not a host")
    if host.startswith("["):
        address = host if "]:" in host else f"{host}:{DEFAULT_PORT}"
    else:
        address = host if host.count(":") == 1 else f"{host}:{DEFAULT_PORT}"
    return Client(None, address, timeout, tls)


def fan_out(hosts: Sequence[str], call: Callable[[Client], T], timeout: float,
            tls: tuple[str | None, str | None, str | None] = (None, None, None)) -> list[Outcome[T]]:
    """`call(client)` for every host in parallel threads; outcomes in the hosts' order."""
    clients = [client_for(h, timeout, tls) for h in hosts]  # bad host syntax fails before any call

    def one(i: int) -> Outcome[T]:
        start = time.monotonic()
        try:
            value = call(clients[i])
        except CliError as e:
            return Outcome(hosts[i], None, str(e), e.code == 3, time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - one host's odd failure must not lose the others' answers
            return Outcome(hosts[i], None, f"{type(e).__name__}: {e}", False, time.monotonic() - start)
        return Outcome(hosts[i], value, "", False, time.monotonic() - start)

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(hosts))) as pool:
        return list(pool.map(one, range(len(hosts))))


def tls_of(args: Any) -> tuple[str | None, str | None, str | None]:
    return (getattr(args, "tls_ca", None), getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
