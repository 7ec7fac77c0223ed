"""The PCIe check: link width and AER counters of GPUs, NICs and NVSwitches, from sysfs.

Each poll reads `<sysfs_root>/bus/pci/devices/<bdf>/` for the devices whose PCI class is watched:
`current_link_width` vs `max_link_width`, and the kernel's AER counters `aer_dev_correctable`,
`aer_dev_nonfatal`, `aer_dev_fatal`. Counters are compared with the previous poll (baselines are
taken at start, so errors from before the daemon started are not reported again); a decrease is a
reset (driver reload, device removed and re-added) and counts from zero. A watched device present
at start whose directory disappears (surprise removal, a GPU fallen off the bus and removed by the
driver) is reported as missing.

Link *speed* below its maximum is not a fault by itself: GPUs and NICs drop to 2.5 GT/s when idle
(ASPM / power management), so speed is only evidence on a width finding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from checks.common.counters import Counters, rising
from checks.common.sysfs import read_text
from checks.pcie.config import RULES, ClassMatch, PcieConfig
from checks.pcie.parse import AerCounters, parse_aer, parse_hex
from robustd.check import Check, CheckContext
from robustd.model import Finding, FindingKind

AER_FILES = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal", "fatal": "aer_dev_fatal"}
# What a class prefix is called in messages; the longest matching prefix wins.
CLASS_NAMES = {"0300": "GPU (VGA)", "0302": "GPU", "0200": "Ethernet NIC", "0207": "InfiniBand NIC",
               "0680": "bridge/NVSwitch", "0604": "PCI bridge"}


@dataclass
class _Device:
    bdf: str
    pci_class: str
    vendor: str
    device: str
    aer: Counters[str] = field(default_factory=Counters)  # by AER kind

    @property
    def what(self) -> str:
        name = next((CLASS_NAMES[p] for p in sorted(CLASS_NAMES, key=len, reverse=True)
                     if self.pci_class.startswith(p)), "device")
        return f"{name} {self.vendor}:{self.device}"

    def evidence(self) -> dict[str, str]:
        return {"class": f"0x{self.pci_class}", "vendor": f"0x{self.vendor}", "device": f"0x{self.device}"}


NOT_WATCHED = object()


class _Gone(Exception):
    """The device's directory vanished while it was read."""


class PcieCheck(Check):
    """PCIe link width, AER counters and presence of the watched devices."""

    name = "pcie"
    mode = "poll"
    Config = PcieConfig
    rule_file = RULES

    def __init__(self) -> None:
        self._devices: dict[str, _Device] | None = None  # None until the first poll took baselines
        self._missing: dict[str, _Device] = {}
        self._ignored: set[str] = set()  # bdfs of classes we do not watch

    @staticmethod
    def _config(ctx: CheckContext) -> PcieConfig:
        return ctx.config if isinstance(ctx.config, PcieConfig) else PcieConfig()

    @classmethod
    def devices_dir(cls, ctx: CheckContext) -> str:
        return os.path.join(cls._config(ctx).sysfs_root or ctx.roots.sys, "bus", "pci", "devices")

    def supported(self, ctx: CheckContext) -> str | None:
        path = self.devices_dir(ctx)
        return None if os.path.isdir(path) else f"{path} does not exist (no PCI bus in sysfs)"

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        cfg = self._config(ctx)
        base = self.devices_dir(ctx)
        now = ctx.clock()
        present = set(os.listdir(base))
        first = self._devices is None
        devices = self._devices if self._devices is not None else {}
        findings: list[Finding] = []

        self._ignored &= present  # a bdf that goes and comes back is looked at afresh
        for bdf in sorted(present - devices.keys() - self._ignored):  # at start, and devices that (re)appear
            dev = self._discover(base, bdf, cfg.matchers())
            if dev is NOT_WATCHED:
                self._ignored.add(bdf)  # not a watched class: do not read it again every second
            elif dev is not None:
                devices[bdf] = dev
                self._missing.pop(bdf, None)
        for bdf, dev in sorted(devices.items()):
            try:
                if bdf not in present:
                    raise _Gone
                findings += self._read_device(os.path.join(base, bdf), dev, cfg, now, baseline=first)
            except _Gone:
                self._missing[bdf] = dev
        for bdf in self._missing:
            devices.pop(bdf, None)
        self._devices = devices
        for bdf, dev in sorted(self._missing.items()):
            findings.append(Finding(
                component=f"pcie/{bdf}", code="PCIE_DEVICE_MISSING", kind=FindingKind.STATE,
                message=f"{dev.what} at {bdf}, present at start, is gone from the PCI bus",
                evidence=dev.evidence()))
        return findings

    @staticmethod
    def _discover(base: str, bdf: str, matchers: list[ClassMatch]) -> _Device | object | None:
        """The device if watched, NOT_WATCHED for another class, None if unreadable (retried)."""
        path = os.path.join(base, bdf)
        try:
            pci_class = parse_hex(read_text(os.path.join(path, "class")))
            vendor = parse_hex(read_text(os.path.join(path, "vendor")))
            device = parse_hex(read_text(os.path.join(path, "device")))
        except (OSError, ValueError):
            return None  # not a device directory we understand (or gone already)
        if not any(m.matches(pci_class, vendor) for m in matchers):
            return NOT_WATCHED
        return _Device(bdf=bdf.lower(), pci_class=pci_class, vendor=vendor, device=device)

    def _read_device(self, path: str, dev: _Device, cfg: PcieConfig, now: float,
                     baseline: bool) -> list[Finding]:
        out: list[Finding] = []
        component = f"pcie/{dev.bdf}"
        link = {k: _attr(path, k) for k in ("current_link_width", "max_link_width",
                                             "current_link_speed", "max_link_speed")}
        cur, top = _int(link["current_link_width"]), _int(link["max_link_width"])
        if cur is not None and top is not None and cur < top:
            speed = {k: v.strip() for k, v in link.items() if k.endswith("speed") and v is not None}
            out.append(Finding(
                component=component, code="PCIE_WIDTH_DEGRADED", kind=FindingKind.STATE,
                message=f"{dev.what} at {dev.bdf}: PCIe link at x{cur}, capable of x{top}",
                evidence={**dev.evidence(), "current_link_width": str(cur), "max_link_width": str(top), **speed}))

        for kind, filename in AER_FILES.items():
            text = _attr(path, filename)
            if text is None:
                continue  # no AER capability (or AER disabled): nothing to count
            try:
                aer = parse_aer(text)
            except ValueError:
                continue
            reading = dev.aer.update(kind, aer.total, now, baseline=baseline)
            if reading is None:
                continue
            counter, old, delta = reading
            if kind == "correctable":
                f = rising(counter, cfg.aer_correctable_window, cfg.aer_correctable_count, now, component,
                           "PCIE_AER_CORRECTABLE_RISING", f"{dev.what} at {dev.bdf}", "corrected PCIe errors",
                           {**dev.evidence(), "total": str(aer.total), **_named(aer)})
                out += [f] if f is not None else []
            elif delta:
                code = "PCIE_AER_FATAL" if kind == "fatal" else "PCIE_AER_NONFATAL"
                out.append(Finding(
                    component=component, code=code, kind=FindingKind.OCCURRENCE,
                    message=f"{dev.what} at {dev.bdf}: {delta} new {kind} uncorrectable PCIe error(s) "
                            f"(AER total {old} -> {aer.total})",
                    evidence={**dev.evidence(), "new": str(delta), "total": str(aer.total), **_named(aer)}))
        return out


def _named(aer: AerCounters) -> dict[str, str]:
    """The non-zero named counters, as evidence (which error types they were)."""
    return {f"aer_{k}": str(v) for k, v in aer.counters.items() if v}


def _attr(path: str, name: str) -> str | None:
    """One sysfs attribute; None if this device has no such file. A vanished device raises _Gone."""
    try:
        return read_text(os.path.join(path, name))
    except FileNotFoundError:
        if not os.path.isdir(path):
            raise _Gone from None
        return None
    except OSError:  # EIO/EINVAL: the device does not answer config reads right now
        if not os.path.isdir(path):
            raise _Gone from None
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None
