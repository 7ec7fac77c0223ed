"""The Evidence service: Create a bundle for the moment of a decision, List them, Get one (robustd/evidence.py
keeps them). Read-only in robustd/authz.py: a bundle holds only what GetVerdict, ListEvents, ListChecks and
Diagnostics.List already show any admitted caller, and the adapters (root) ask for one before they act.
Creates by a caller not allowed disruptive RPCs are limited per caller (`evidence.max_creates_per_minute`),
so such a caller cannot churn the kept bundles (the directory is bounded whatever happens).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any, Callable

import grpc

from robustd import __version__, bounds
from robustd.api import requests
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.authz import Authorizer
from robustd.config import EvidenceConfig
from robustd.diagnostics.manager import DiagnosticsManager
from robustd.engine import EngineView
from robustd.evidence import EvidenceStore, Summary, message_fit
from robustd.inventory import GpuInventory
from robustd.model import Condition, Event, worst
from robustd.reads import Unreadable
from robustd.store import condition_to_json

log = logging.getLogger("robustd.api.evidence")
MAX_COMPONENTS = 16  # components (and codes) one request may name
EVENTS_PER_COMPONENT = 20  # the newest events of each component involved
MAX_EVENTS = 200
MAX_REPORTS = 5  # the newest diagnostic reports
MAX_LIST = 1000


def _condition(c: Condition) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(condition_to_json(c))
    return d


def _event(e: Event) -> dict[str, Any]:
    return {"seq": e.seq, "at": e.at, "kind": e.kind.name, "condition": _condition(e.condition)}


def kernel_records(events: list[dict[str, Any]], conditions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernel-log lines behind those events and conditions (the kernel check keeps each raw, clipped line in
    the condition's evidence as `line`, with its rule), oldest first, each once."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for e in [{"seq": c["seq"], "at": c["last_seen"], "condition": c} for c in conditions] + events:
        c = e["condition"]
        line = c.get("evidence", {}).get("line")
        if line:
            key = (c["component"], c["code"], line)
            if key not in out or e["seq"] > out[key]["seq"]:
                out[key] = {"seq": e["seq"], "at": e["at"], "component": c["component"], "code": c["code"],
                            "rule": c["evidence"].get("rule", ""), "source": c.get("source", ""), "line": line}
    return sorted(out.values(), key=lambda r: r["seq"])


def gpus(view: GpuInventory, components: list[str]) -> dict[str, Any]:
    """The inventory, with NVML's last readings for the GPUs among `components`."""
    involved = {c.removeprefix("gpu/") for c in components if c.startswith("gpu/")}
    devices = []
    for d in view.devices:
        entry: dict[str, Any] = {"index": d.index, "bus_id": d.bus_id, "uuid": d.uuid, "name": d.name,
                                 "involved": d.bus_id in involved}
        if entry["involved"]:
            entry["readings"] = dict(d.readings)
        devices.append(entry)
    return {"driver": view.driver, "emulated": view.emulated, "polled_at": view.polled_at, "devices": devices}


class CreateLimit:
    """Creates per caller in the last minute, for callers not allowed disruptive RPCs (bounded in callers)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_callers: int = 1024):
        self.clock = clock
        self.max_callers = max_callers
        self._seen: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def admit(self, caller: str, per_minute: int) -> bool:
        now = self.clock()
        times = self._seen.pop(caller, None) or collections.deque()
        while times and times[0] <= now - 60.0:
            times.popleft()
        ok = len(times) < per_minute
        if ok:
            times.append(now)
        self._seen[caller] = times
        while len(self._seen) > self.max_callers:
            self._seen.popitem(last=False)
        return ok


class EvidenceServicer(pb_grpc.EvidenceServicer):
    def __init__(self, view: EngineView, store: EvidenceStore, diagnostics: DiagnosticsManager,
                 inventory: Callable[[], GpuInventory], node: str, boot_id: str,
                 config: Callable[[], EvidenceConfig], authz: Authorizer | None, max_message_bytes: int = 4 << 20):
        self.view = view
        self.max_message_bytes = max_message_bytes  # the listener's (listen.max_message_bytes, fixed at start)
        self.store = store
        self.diagnostics = diagnostics
        self.inventory = inventory
        self.node = node
        self.boot_id = boot_id
        self.config = config
        self.authz = authz
        self.limit = CreateLimit()
        self._writing = asyncio.Lock()  # one bundle built and written at a time

    def _limited(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's name when its Create is past its per-minute share, else None."""
        if self.authz is None:
            return None
        ident = self.authz.identify(context)
        if ident is not None and self.authz.allowed(ident):
            return None
        caller = ident.caller if ident is not None else "callers without an identity"
        return None if self.limit.admit(caller, self.config().max_creates_per_minute) else caller

    async def Create(self, request: pb.CreateEvidenceRequest, context: grpc.aio.ServicerContext) -> pb.EvidenceSummary:
        try:
            for name, values, most in (("components", request.components, bounds.MAX_COMPONENT),
                                       ("codes", request.codes, bounds.MAX_CODE)):
                if len(values) > MAX_COMPONENTS:
                    raise requests.Invalid(f"{len(values)} {name}; at most {MAX_COMPONENTS}")
                for v in values:
                    requests.ascii_token(v, name, most)
            requests.text(request.reason, "reason", bounds.MAX_REASON)
        except requests.Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        caller = self._limited(context)
        if caller is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{caller} created {self.config().max_creates_per_minute} evidence bundles in the "
                                "last minute (evidence.max_creates_per_minute; privileged callers are not limited)")
        async with self._writing:
            try:
                bundle = await self._bundle(list(request.components), list(request.codes), request.reason)
                cfg = self.config()
                summary = await asyncio.to_thread(self.store.write, bundle)
            except OSError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"cannot write {self.store.dir}: {e.strerror or e}")
        log.info("evidence %s created (%s; keep %d)", summary.id, bounds.echo(request.reason) or "no reason",
                 cfg.keep)
        return _summary(summary)

    async def _bundle(self, components: list[str], codes: list[str], reason: str) -> dict[str, Any]:
        await self.view.settled()
        conds, head = self.view.snapshot()
        if not components:
            chosen = [c for c in conds if not codes or c.code in codes]
            components = list(dict.fromkeys(c.component for c in chosen))[:MAX_COMPONENTS]
        severity, action = worst(conds)
        notes: list[str] = []
        events: dict[int, dict[str, Any]] = {}
        for comp in components:
            try:
                got, _ = await self.view.query(since=None, component=comp, min_severity=0,
                                               limit=EVENTS_PER_COMPONENT, after_seq=0)
            except Unreadable as e:
                notes.append(f"events of {comp}: {e}")
                continue
            events.update((e.seq, _event(e)) for e in got)
        recent = [events[s] for s in sorted(events)][-MAX_EVENTS:]
        involved = [_condition(c) for c in conds if c.component in components]
        try:
            reports = [json.loads(_report_json(r)) for r in await self.diagnostics.list(MAX_REPORTS)]
        except Unreadable as e:
            reports = []
            notes.append(f"diagnostic reports: {e}")
        inv = self.inventory()
        return {
            "reason": reason, "components": components, "codes": codes, "node": self.node, "boot_id": self.boot_id,
            "versions": {"robustd": __version__, "driver": inv.driver},
            "verdict": {"severity": severity.name, "action": action.name, "seq": head,
                        "conditions": [_condition(c) for c in conds]},
            "involved_conditions": involved,
            "events": recent,
            "kernel_log": kernel_records(recent, involved),
            "gpus": gpus(inv, components),
            "diagnostics": reports,
            "notes": notes,
        }

    async def List(self, request: pb.ListEvidenceRequest, context: grpc.aio.ServicerContext) -> pb.ListEvidenceResponse:
        if request.limit < 0 or request.limit > MAX_LIST:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be between 0 and {MAX_LIST}")
        found = await asyncio.to_thread(self.store.list, request.limit or 20)
        return pb.ListEvidenceResponse(bundles=[_summary(s) for s in found])

    async def Get(self, request: pb.GetEvidenceRequest, context: grpc.aio.ServicerContext) -> pb.EvidenceBundle:
        try:
            text = await asyncio.to_thread(self.store.read, request.id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if text is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no evidence bundle {bounds.echo(request.id)}")
        size = len(text.encode())
        if size > message_fit(self.max_message_bytes):
            # Written under a larger listen.max_message_bytes (robustd cuts new ones to fit): say where it is.
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"evidence bundle {request.id} is {size} bytes, more than one message carries "
                                f"(listen.max_message_bytes {self.max_message_bytes}): read "
                                f"{self.store.path(request.id)} on the node")
        return pb.EvidenceBundle(id=request.id, json=text)


def _report_json(report: Any) -> str:
    from robustd.diagnostics.model import report_to_json

    return report_to_json(report)


def _summary(s: Summary) -> pb.EvidenceSummary:
    out = pb.EvidenceSummary(id=s.id, reason=s.reason, components=s.components)
    out.created.FromNanoseconds(int(s.created * 1e9))
    return out
