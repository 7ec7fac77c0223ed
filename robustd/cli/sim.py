"""`robustctl sim`: edit the NVML emulator's state file while a daemon runs on it.

    robustctl sim --state FILE init --gpus 8          a healthy 8-GPU H100-like node (NVSwitch fabric registered)
    robustctl sim init --gpus 8 --no-fabric           PCIe cards: no NVLink fabric (fabric state NOT_SUPPORTED)
    robustctl sim show                                the GPUs, their key metrics and faults
    robustctl sim set gpu 3 temperature 90            any GPU key (see `show --json`)
    robustctl sim set gpu 3 sm_clock_mhz 1400         load, clocks, power: utilization_gpu, sm_clock_mhz, power_mw,
                                                      clocks_event_reasons (the GPU check's relative checks)
    robustctl sim fault gpu 3 lost|hang|vanish|ecc-dbe|remap-pending|remap-failure|hw-slowdown|
                              nvlink-down|nvlink-errors|pcie-width|pcie-replay|power-unreadable [--link L]
    robustctl sim fault gpu 3 xid 79                  an NVML event (Xid critical error), as the driver sends it
    robustctl sim fault gpu 3 retirement-failure|unavailable|poison    their NVML events (ecc-dbe sends one too)
    robustctl sim fault gpu 3 recovery-action drain-and-reset          the recovery action field and its event
    robustctl sim fault gpu 3 fabric not-started|in-progress|error|degraded   its NVLink fabric registration
    robustctl sim clear gpu 3                         undo GPU 3's faults, as a GPU reset would (and its
                                                      undelivered events)

`--state` defaults to $ROBUSTD_NVML_EMULATOR_STATE. Each edit is a locked read-modify-write and an
atomic replace, so the emulator (which re-reads the file when it changes) never sees half a file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Iterator

from robustd.cli import output, render
from robustd.nvmlemu import state as emu


def add_parser(p: argparse.ArgumentParser) -> None:
    """Fill in the `sim` verb's parser (robustctl adds the verb and its global options)."""
    p.add_argument("--state", default=None, metavar="FILE",
                   help=f"the emulator's state file (default: ${emu.ENV_VAR})")
    sub = p.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)
    init = sub.add_parser("init", help="write a healthy H100-like node")
    init.add_argument("--gpus", type=int, default=8, metavar="N", help=f"how many GPUs (0-{emu.MAX_GPUS}, default 8)")
    init.add_argument("--no-fabric", action="store_true",
                      help="PCIe cards without an NVLink fabric (default: an NVSwitch board, fabric registered)")
    show = sub.add_parser("show", help="print the emulated GPUs")
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="the whole state as JSON")
    s = sub.add_parser("set", help="set one GPU value, e.g. `set gpu 0 temperature 90`")
    s.add_argument("what", choices=["gpu"])
    s.add_argument("index", type=int)
    s.add_argument("key")
    s.add_argument("value")
    f = sub.add_parser("fault", help="inject a fault into one GPU")
    f.add_argument("what", choices=["gpu"])
    f.add_argument("index", type=int)
    f.add_argument("fault", choices=emu.FAULTS)
    f.add_argument("value", nargs="?", default=None,
                   help=f"xid: the Xid number; recovery-action: {'|'.join(emu.RECOVERY_ACTIONS)} (or 0-7); "
                        f"fabric: {'|'.join(emu.FABRIC_FAULTS)}")
    f.add_argument("--link", type=int, default=0, help="NVLink for nvlink-down / nvlink-errors (default 0)")
    c = sub.add_parser("clear", help="undo one GPU's faults")
    c.add_argument("what", choices=["gpu"])
    c.add_argument("index", type=int)


def state_path(args: argparse.Namespace) -> str:
    path = args.state or os.environ.get(emu.ENV_VAR)
    if not path:
        raise ValueError(f"no state file: give --state FILE or set {emu.ENV_VAR}")
    return path


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Serialise editors of one state file (the emulator only reads, and needs no lock)."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(args: argparse.Namespace) -> int:
    """Carry out one sim command; raises ValueError (bad input) or OSError (file trouble)."""
    path = state_path(args)
    if args.sim_command == "init":
        with _locked(path):
            emu.save(path, emu.healthy_node(args.gpus, fabric=not args.no_fabric))
        output.out(f"{path}: healthy emulated node with {args.gpus} GPUs"
                   + (", no NVLink fabric" if args.no_fabric else ""))
        return 0
    if args.sim_command == "show":
        st = emu.load(path)
        as_json = getattr(args, "json", False)
        output.out(json.dumps(dataclasses.asdict(st), indent=2) if as_json else show_text(st), exact=as_json)
        return 0
    with _locked(path):
        st = emu.load(path)
        if args.sim_command == "set":
            emu.set_value(st, args.index, args.key, args.value)
            done = f"GPU {args.index} {args.key} = {args.value}"
        elif args.sim_command == "fault":
            emu.apply_fault(st, args.index, args.fault, link=args.link, value=args.value)
            done = f"GPU {args.index}: fault {args.fault}{'' if args.value is None else ' ' + args.value} injected"
        else:
            emu.clear(st, args.index)
            done = f"GPU {args.index}: faults cleared"
        emu.save(path, st)
    output.out(done)
    return 0


def _bus_id(raw: str) -> str:
    """NVML's `00000000:1B:00.0` as every component names it (`gpu/0000:1b:00.0`); a malformed one as written."""
    from checks.gpu.parse import normalize_bus_id

    try:
        return normalize_bus_id(raw)
    except ValueError:
        return raw


def show_text(st: emu.EmulatorState) -> str:
    """The state file's GPUs as a table; its text values are any file's contents, so each is `printable`."""
    rows = [("GPU", "BUS ID", "NAME", "TEMP", "UTIL", "PCIE", "NVLINK DOWN", "PROCESSES", "FAULTS")]
    for i, g in enumerate(st.gpus):
        cells = (str(i), _bus_id(g.bus_id), g.name, f"{g.temperature}C/{g.temp_slowdown}C", f"{g.utilization_gpu}%",
                 f"Gen{g.pcie_gen}x{g.pcie_width}", g.nvlink_down or "-", g.processes or "-", g.faults or "-")
        rows.append(tuple(render.printable(c) for c in cells))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [render.printable(f"EMULATED NVML: driver {st.driver_version}, {len(st.gpus)} GPUs"
                              + (f", nvmlInit fails with {st.init_error}" if st.init_error else ""))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
