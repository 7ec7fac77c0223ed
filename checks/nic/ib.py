"""InfiniBand / RoCE ports read from sysfs (`<ib root>/<dev>/ports/<n>/`), and counter rates.

The NIC check polls these once per interval. The parsers of each file's text are in
`checks/nic/parse.py`; `IbPorts` turns readings into findings on `ib/<dev>/<port>`.
`RateWindow` (checks/common/counters.py, shared with the NIC counters) turns a monotonic counter into
a rate over a window, and treats a counter that went backwards (driver reload, reset) as a new
baseline, never as a huge or negative rate. The same error counters are also judged per hour against
`checks.nic.ib_thresholds` (checks/nic/ibrates.py): the grey link that has not dropped yet.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from dataclasses import dataclass, field

from checks.common.counters import RateWindow
from checks.common.sysfs import read_text
from checks.nic.ibrates import HourlyRates, span_text
from checks.nic.parse import PortState, parse_counter, parse_ib_state, parse_rate
from robustd.model import Finding, FindingKind
from robustd.traffic import IB_WORD

IB_ACTIVE = 4  # `state`: "4: ACTIVE"
PHYS_LINKUP = 5  # `phys_state`: "5: LinkUp"
ERROR_COUNTERS = ("symbol_error", "port_rcv_errors", "local_link_integrity_errors",
                  "excessive_buffer_overrun_errors")
DATA_COUNTERS = ("port_xmit_data", "port_rcv_data")  # in 4-byte words (IBA PortCounters)


@dataclass(frozen=True)
class PortReading:
    state: PortState
    phys_state: PortState
    rate: float | None
    counters: dict[str, int]

    @property
    def active(self) -> bool:
        return self.state.code == IB_ACTIVE and self.phys_state.code == PHYS_LINKUP


@functools.lru_cache(maxsize=1024)
def _port_files(path: str) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
    """The files of one port, joined once (path joins were a third of a poll's cost)."""
    counters = tuple((name, os.path.join(path, "counters", name))
                     for name in ("link_downed", "link_error_recovery", *ERROR_COUNTERS, *DATA_COUNTERS))
    return (os.path.join(path, "state"), os.path.join(path, "phys_state"), os.path.join(path, "rate"), counters)


def read_port(path: str) -> PortReading:
    """One port directory; raises FileNotFoundError when the port (or its device) is gone."""
    state_file, phys_file, rate_file, counter_files = _port_files(path)
    state = parse_ib_state(read_text(state_file))
    phys = parse_ib_state(read_text(phys_file))
    try:
        rate: float | None = parse_rate(read_text(rate_file))
    except (OSError, ValueError):  # some drivers fail the read while the link trains
        rate = None
    counters: dict[str, int] = {}
    for name, file in counter_files:
        try:
            counters[name] = parse_counter(read_text(file))
        except (OSError, ValueError):
            continue
    return PortReading(state, phys, rate, counters)


@dataclass
class _Port:
    hourly: HourlyRates
    baseline_rate: float | None = None
    windows: dict[str, RateWindow] = field(default_factory=dict)


class IbPorts:
    """The watched ports of one IB root and what was last read from them."""

    def __init__(self, root: str, patterns: list[str], expected_rate: float | None, error_rate: float,
                 rate_window: float, thresholds: dict[str, float | None] | None = None, hour_window: float = 3600.0):
        self.root = root
        self.thresholds = thresholds or {}  # counter → errors per hour (None: not judged); checks/nic/ibrates.py
        self.hour_window = hour_window
        self.patterns = patterns
        self.expected_rate = expected_rate
        self.error_rate = error_rate
        self.rate_window = rate_window
        self.ports: dict[str, _Port] = {}  # "dev/port" → state
        self.data_bytes: dict[str, int] = {}  # "dev/port" → bytes both ways at the last poll (watched ports)
        self.traffic: dict[str, tuple[float, float]] = {}  # component → (tx, rx) bytes/s

    def _present(self) -> list[str]:
        out = []
        try:
            devs = sorted(os.listdir(self.root))
        except OSError:
            return []
        for dev in devs:
            try:
                out += [f"{dev}/{p}" for p in sorted(os.listdir(os.path.join(self.root, dev, "ports")))]
            except OSError:
                continue
        return out

    def discover(self) -> None:
        """Ports matching `ib_ports`; by default every port that is ACTIVE now."""
        for key in self._present():
            if self.patterns:
                if any(fnmatch.fnmatchcase(key, p) for p in self.patterns):
                    self.ports.setdefault(key, self._new(key))
                continue
            try:
                if read_port(self._path(key)).active:
                    self.ports.setdefault(key, self._new(key))
            except (OSError, ValueError):
                continue

    def _new(self, key: str) -> _Port:
        return _Port(HourlyRates(key, self.thresholds, self.hour_window))

    def note(self, now: float) -> str:
        """For ListChecks while it matters: how much history the hourly rates have, and saturated counters."""
        shortest: float | None = None
        stuck: list[str] = []
        for st in self.ports.values():
            short, sat = st.hourly.status(now)
            stuck += sat
            if short is not None:
                shortest = short if shortest is None else min(shortest, short)
        parts = []
        window = span_text(self.hour_window)
        if shortest is not None:
            parts.append(f"IB error rates per {window}: {span_text(shortest)} of history so far; only a count "
                         f"already over its hourly threshold raises until {window} is seen")
        if stuck:
            parts.append("IB counters saturated, rate unknown: " + ", ".join(sorted(stuck)[:8])
                         + (f" (+{len(stuck) - 8})" if len(stuck) > 8 else ""))
        return "; ".join(parts)

    def data_totals(self) -> dict[str, int]:
        """ib/<dev>/<port> → bytes both ways, every port present: the watched ones as this poll read them,
        the others read now (two files each), so a snapshot never reads a watched port twice."""
        out: dict[str, int] = {}
        for key in self._present():
            if key in self.ports and key in self.data_bytes:
                out[f"ib/{key}"] = self.data_bytes[key]
                continue
            counters = os.path.join(self._path(key), "counters")
            total = 0
            for name in DATA_COUNTERS:
                try:
                    total += parse_counter(read_text(os.path.join(counters, name)))
                except (OSError, ValueError):
                    continue
            out[f"ib/{key}"] = IB_WORD * total
        return out

    def _path(self, key: str) -> str:
        dev, port = key.split("/", 1)
        return os.path.join(self.root, dev, "ports", port)

    def poll(self, now: float) -> list[Finding]:
        if self.patterns:  # globs also pick up ports that appear later
            for key in self._present():
                if key not in self.ports and any(fnmatch.fnmatchcase(key, p) for p in self.patterns):
                    self.ports[key] = self._new(key)
        out: list[Finding] = []
        for key, st in self.ports.items():
            comp = f"ib/{key}"
            try:
                r = read_port(self._path(key))
                self.data_bytes[key] = IB_WORD * sum(r.counters.get(c, 0) for c in DATA_COUNTERS)
            except FileNotFoundError:
                self.data_bytes.pop(key, None)
                out.append(Finding(comp, "IB_PORT_DOWN", f"IB port {key} is gone from sysfs",
                                   {"state": "absent"}, FindingKind.STATE))
                st.windows.clear()
                st.hourly.clear()  # a port that comes back starts its counters (and its hour) again
                continue
            except (OSError, ValueError) as e:
                out.append(Finding(comp, "IB_READ_ERROR", f"cannot read IB port {key}: {e}", {"error": str(e)},
                                   FindingKind.STATE))
                continue
            out += self._judge(key, comp, st, r, now)
        return out

    def _judge(self, key: str, comp: str, st: _Port, r: PortReading, now: float) -> list[Finding]:
        out: list[Finding] = []
        ev = {"state": r.state.name, "phys_state": r.phys_state.name}
        if r.active:
            out.append(Finding(comp, "IB_PORT_DOWN", kind=FindingKind.RESOLVED, message=f"{key} is ACTIVE"))
        else:
            out.append(Finding(comp, "IB_PORT_DOWN", f"IB port {key} is {r.state.name}/{r.phys_state.name}",
                               ev, FindingKind.STATE))
        if r.active and r.rate is not None:
            if st.baseline_rate is None:
                st.baseline_rate = r.rate
            want = self.expected_rate if self.expected_rate is not None else st.baseline_rate
            if r.rate < want:
                out.append(Finding(comp, "IB_RATE_DEGRADED", f"IB port {key} runs at {r.rate:g} Gb/s, "
                                   f"expected {want:g}", {"rate_gbps": f"{r.rate:g}", "expected_gbps": f"{want:g}"},
                                   FindingKind.STATE))
            else:
                out.append(Finding(comp, "IB_RATE_DEGRADED", kind=FindingKind.RESOLVED))
        rising: dict[str, str] = {}
        for name, value in r.counters.items():
            w = st.windows.setdefault(name, RateWindow(self.rate_window))
            inc = w.add(now, value)
            if name == "link_downed" and inc:
                out.append(Finding(comp, "IB_LINK_DOWNED", f"IB port {key} lost its link {inc} time(s) "
                                   f"(link_downed {value})", {"link_downed": str(value), "increase": str(inc)}))
            rate = w.rate()
            if name in ERROR_COUNTERS and rate is not None and rate > self.error_rate:
                rising[name] = f"{rate:.3g}/s (total {value})"
        if rising:
            out.append(Finding(comp, "IB_ERRORS_RISING", f"IB port {key} error counters rising: "
                               + ", ".join(f"{k} {v}" for k, v in rising.items()), rising, FindingKind.STATE))
        out += st.hourly.poll(r.counters, now)
        tx, rx = (st.windows.get(n) for n in DATA_COUNTERS)
        self.traffic[comp] = ((tx.rate() or 0.0) * IB_WORD if tx else 0.0, (rx.rate() or 0.0) * IB_WORD if rx else 0.0)
        return out
