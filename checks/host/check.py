"""The host check: the disks from config, memory pressure, and host memory errors (EDAC).

Disks (`checks.host.disks`, each a path): free space through psutil.disk_usage (statvfs on the
configured path), read-only from the mount table, and SCSI I/O errors from the kernel's per-device
`<sys>/block/<disk>/device/ioerr_cnt` (it counts commands that completed with an error). There is
no error counter for NVMe in sysfs (`<sys>/block/<dev>/stat` counts I/Os, not failures): NVMe and
other block errors are left to the kernel-log rule DISK_IO_ERROR ("I/O error, dev nvme0n1, …").

The mount table is `<proc>/1/mounts` when readable: init's mount namespace is the host's, while the
daemon's own may be sandboxed (systemd ProtectSystem= makes / read-only in *our* namespace only).
Then `<proc>/self/mounts`, then `<proc>/mounts`.

Memory: PSI `<proc>/pressure/memory` (`some`/`full` avg10, percent of time stalled) and
MemAvailable from `<proc>/meminfo` → MEMORY_PRESSURE on `host`. EDAC:
`<sys>/devices/system/edac/mc/mc<N>/{ce_count,ue_count}` → EDAC_UE on any rise, EDAC_CE_RISING above
a rate, on `memory/mc<N>`. Counters are baselined at start; a decrease is a reset.

Stuck tasks: threads in uninterruptible sleep (`D`) longer than `dstate_after`, from a rate-limited,
bounded walk of `<proc>/<pid>/task/<tid>/stat` → PROCESS_STUCK on `host` (checks/host/stuck.py).

Components: `disk<path>` (`disk/` for `/`, `disk/data` for `/data`), `host`, `memory/mc<N>`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

import psutil

from checks.common.counters import Counters, rising
from checks.common.sysfs import read_text
from checks.host.config import RULES, DiskConfig, HostConfig, thresholds
from checks.host.parse import Mount, mount_for, parse_count, parse_meminfo, parse_mounts, parse_psi
from checks.host.stuck import StuckTasks
from robustd.check import Check, CheckContext
from robustd.model import Finding, FindingKind

_MC = re.compile(r"^mc(\d+)$")


def _disk_component(path: str) -> str:
    """`disk/<mount>`; the root file system is `disk/rootfs` (a bare `disk/` reads as a prefix in ListEvents)."""
    return "disk/rootfs" if path == "/" else f"disk{path}"


class HostCheck(Check):
    """Disks, memory pressure, EDAC memory errors and tasks stuck in D."""

    name = "host"
    mode = "poll"
    Config = HostConfig
    rule_file = RULES

    def __init__(self) -> None:
        self._ioerr: Counters[str] = Counters()  # by block device
        self._edac: Counters[tuple[str, str]] = Counters()  # by (mcN, "ce" | "ue")
        self._stuck = StuckTasks()

    def poll(self, ctx: CheckContext) -> Sequence[Finding]:
        cfg = ctx.config if isinstance(ctx.config, HostConfig) else HostConfig()
        now = ctx.clock()
        findings: list[Finding] = []
        mounts = self._mounts(ctx)
        for disk in cfg.disks:
            findings += self._disk(ctx, disk, mounts, now)
        findings += self._memory(ctx, cfg)
        findings += self._edac_counts(ctx, cfg, now)
        findings += self._stuck.poll(ctx.roots, cfg, now)
        return findings

    # -- disks ---------------------------------------------------------------------------------
    @staticmethod
    def _mounts(ctx: CheckContext) -> list[Mount]:
        for parts in (("1", "mounts"), ("self", "mounts"), ("mounts",)):
            try:
                return parse_mounts(read_text(ctx.roots.proc_path(*parts)))
            except OSError:
                continue
        raise OSError(f"no readable mount table under {ctx.roots.proc}")

    def _disk(self, ctx: CheckContext, disk: DiskConfig, mounts: list[Mount], now: float) -> list[Finding]:
        component = _disk_component(disk.path)
        out: list[Finding] = []
        mount = mount_for(disk.path, mounts)
        where = {"path": disk.path}
        if mount is not None:
            where.update(mount=mount.point, source=mount.source, fstype=mount.fstype)
        try:
            usage = psutil.disk_usage(disk.path)
        except OSError as e:  # ENOENT: the path is gone; EIO: the file system cannot answer
            out.append(Finding(component=component, code="DISK_UNAVAILABLE", kind=FindingKind.STATE,
                               message=f"cannot stat {disk.path}: {e.strerror or e}",
                               evidence={**where, "errno": str(e.errno)}))
        else:
            free = 100.0 - usage.percent
            levels = thresholds().disk_space  # what each level means (where it starts: the disk's config)
            for level, limit in ((levels.critical, disk.critical_free_percent), (levels.low, disk.min_free_percent)):
                if free < limit:  # the first level that holds
                    out.append(Finding(
                        component=component, code="DISK_SPACE_LOW", kind=FindingKind.STATE, severity=level.severity,
                        action=level.action,
                        message=f"{disk.path}: {free:.1f}% free, below {limit:g}%",
                        evidence={**where, "free_percent": f"{free:.1f}", "free_bytes": str(usage.free),
                                  "total_bytes": str(usage.total), "threshold_percent": f"{limit:g}"}))
                    break
        if mount is not None and mount.readonly and disk.readonly_is_fault:
            out.append(Finding(component=component, code="DISK_READONLY", kind=FindingKind.STATE,
                               message=f"{mount.point} ({mount.source}) is mounted read-only",
                               evidence={**where, "options": ",".join(mount.options)}))
        device = disk.device or (self._block_disk(ctx, os.path.basename(mount.source)) if mount else None)
        if device:
            out += self._ioerrors(ctx, device, component, where, now)
        return out

    @staticmethod
    def _block_disk(ctx: CheckContext, name: str) -> str | None:
        """The whole disk a block device name belongs to (sda1 → sda), or None if it is not one."""
        if not name or name in (".", ".."):
            return None
        if os.path.isdir(ctx.roots.sys_path("block", name)):
            return name
        try:
            disks = os.listdir(ctx.roots.sys_path("block"))
        except OSError:
            return None
        return next((d for d in disks if os.path.isdir(ctx.roots.sys_path("block", d, name))), None)

    def _ioerrors(self, ctx: CheckContext, device: str, component: str, where: Mapping[str, str],
                  now: float) -> list[Finding]:
        try:  # SCSI (sd*) only; NVMe, virtio and dm have no such counter (see the module doc)
            count = parse_count(read_text(ctx.roots.sys_path("block", device, "device", "ioerr_cnt")))
        except (OSError, ValueError):
            return []
        reading = self._ioerr.update(device, count, now)
        if reading is None or not reading.delta:
            return []
        old, delta = reading.old, reading.delta
        return [Finding(component=component, code="DISK_IO_ERRORS_RISING", kind=FindingKind.OCCURRENCE,
                        message=f"{device}: {delta} new I/O error(s) (ioerr_cnt {old} -> {count})",
                        evidence={**where, "device": device, "new": str(delta), "ioerr_cnt": str(count)})]

    # -- memory --------------------------------------------------------------------------------
    @staticmethod
    def _memory(ctx: CheckContext, cfg: HostConfig) -> list[Finding]:
        reasons: list[str] = []
        evidence: dict[str, str] = {}
        try:
            psi = parse_psi(read_text(ctx.roots.proc_path("pressure", "memory")))
        except (OSError, ValueError):
            psi = {}  # no PSI (kernel without CONFIG_PSI, or psi=0): MemAvailable alone decides
        for kind, limit in (("some", cfg.psi_some_avg10), ("full", cfg.psi_full_avg10)):
            if kind in psi:
                evidence[f"psi_{kind}_avg10"] = f"{psi[kind].avg10:g}"
                if psi[kind].avg10 >= limit:
                    reasons.append(f"PSI {kind} avg10 {psi[kind].avg10:g}% >= {limit:g}%")
        try:
            info = parse_meminfo(read_text(ctx.roots.proc_path("meminfo")))
        except OSError:
            info = {}
        total, avail = info.get("MemTotal"), info.get("MemAvailable")
        if total and avail is not None:
            pct = 100.0 * avail / total
            evidence.update(mem_available_kb=str(avail), mem_total_kb=str(total), mem_available_percent=f"{pct:.1f}")
            if pct < cfg.min_available_percent:
                reasons.append(f"MemAvailable {pct:.1f}% < {cfg.min_available_percent:g}%")
        if not reasons:
            return []
        return [Finding(component="host", code="MEMORY_PRESSURE", kind=FindingKind.STATE,
                        message="memory pressure: " + "; ".join(reasons), evidence=evidence)]

    # -- EDAC ----------------------------------------------------------------------------------
    def _edac_counts(self, ctx: CheckContext, cfg: HostConfig, now: float) -> list[Finding]:
        base = ctx.roots.sys_path("devices", "system", "edac", "mc")
        try:
            names = sorted(n for n in os.listdir(base) if _MC.match(n))
        except OSError:
            return []  # no EDAC driver loaded: nothing to count
        out: list[Finding] = []
        for mc in names:
            counts: dict[str, int] = {}
            for kind in ("ce", "ue"):
                try:
                    counts[kind] = parse_count(read_text(os.path.join(base, mc, f"{kind}_count")))
                except (OSError, ValueError):
                    continue
            component = f"memory/{mc}"
            for kind, value in counts.items():
                reading = self._edac.update((mc, kind), value, now)
                if reading is None:
                    continue
                counter, old, delta = reading
                if kind == "ue" and delta:
                    out.append(Finding(component=component, code="EDAC_UE", kind=FindingKind.OCCURRENCE,
                                       message=f"{mc}: {delta} new uncorrected memory error(s) "
                                               f"(ue_count {old} -> {value})",
                                       evidence={"new": str(delta), "ue_count": str(value)}))
                elif kind == "ce":
                    f = rising(counter, cfg.edac_ce_window, cfg.edac_ce_count, now, component, "EDAC_CE_RISING", mc,
                               "corrected memory errors", {"ce_count": str(value)})
                    out += [f] if f is not None else []
        return out
