"""Evidence bundles: what robustd knew at the moment an adapter decided to drain, cordon or reboot.

A bundle is one JSON file under `state_dir/evidence/<id>.json` (plain dicts here; protobuf only at the API
edge, robustd/api/evidence.py). Ids are `ev-<UTC time to the millisecond>-<6 hex>`, so names sort by age
and never collide. Every write is a temporary file renamed into place (a reader never sees half of one).

Bounded three ways (`evidence:` in robustd.yaml): a bundle's JSON is cut to `max_bundle_bytes` (oldest events
first, then diagnostic reports, then kernel-log records; the bundle's `trimmed` says what went), the newest
`keep` bundles are kept, and the directory to `max_bytes` (oldest removed first; the new one always stays).
A bundle is also cut to fit one gRPC message (`listen.max_message_bytes` less MESSAGE_OVERHEAD: message_fit,
in the daemon's limits()), so every bundle robustd writes can be read back through `Get`.
`List` reads a bundle's file once: its summary is kept in memory beside the file's size and mtime (a listing of
the newest 1000 would otherwise read up to a gigabyte each call).
The blocking file work runs off the event loop (the servicer calls these in a worker thread).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Callable

from robustd import atomicfile

ID = re.compile(r"ev-\d{8}T\d{6}\.\d{3}Z-[0-9a-f]{6}")
DIR = "evidence"
MAX_READ = 16 << 20  # a bundle file read back is at most this (a larger one was not written by robustd)
MESSAGE_OVERHEAD = 4096  # an EvidenceBundle's bytes besides its JSON (id, tags), with room to spare


def message_fit(max_message_bytes: int) -> int:
    """The largest bundle JSON one gRPC message of `max_message_bytes` returns (a quarter kept for the rest
    when the limit is a few KB)."""
    return max_message_bytes - min(MESSAGE_OVERHEAD, max_message_bytes // 4)


@dataclass(frozen=True)
class Summary:
    """What `List` shows of one bundle."""

    id: str
    created: float
    reason: str
    components: tuple[str, ...]


class EvidenceStore:
    """The bundles of one state dir; `limits()` gives (keep, max_bundle_bytes, max_bytes) at each write."""

    def __init__(self, state_dir: str, limits: Callable[[], tuple[int, int, int]],
                 clock: Callable[[], float] = time.time):
        self.dir = os.path.join(state_dir, DIR)
        self.limits = limits
        self.clock = clock
        # id -> ((size, mtime_ns) of the file read, its Summary): List parses each file once
        self._summaries: dict[str, tuple[tuple[int, int], Summary]] = {}

    def new_id(self, now: float) -> str:
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%S.%f")[:-3]
        return f"ev-{stamp}Z-{secrets.token_hex(3)}"

    def write(self, bundle: dict[str, Any]) -> Summary:
        """Give `bundle` an id and creation time, cut it to size, write it atomically, prune the directory."""
        keep, max_bundle, max_bytes = self.limits()
        os.makedirs(self.dir, mode=0o750, exist_ok=True)
        now = self.clock()
        while True:
            ident = self.new_id(now)
            if not os.path.exists(self.path(ident)):
                break
        bundle = {"id": ident, "created": _iso(now), "created_unix": now, **bundle}
        data = fit(bundle, max_bundle)
        atomicfile.write_bytes(self.path(ident), data, durable=True)
        self.prune(keep, max_bytes, ident)
        summary = Summary(ident, now, str(bundle.get("reason", "")), tuple(bundle.get("components", ())))
        stamp = _stamp(self.path(ident))
        if stamp is not None:
            self._summaries[ident] = (stamp, summary)
        return summary

    def prune(self, keep: int, max_bytes: int, newest: str) -> list[str]:
        """Remove the oldest bundles past `keep`, then past `max_bytes` in all; never `newest`. The removed ids."""
        ids = self.ids()
        removed = ids[:max(0, len(ids) - keep)]
        ids = ids[len(removed):]
        sizes = {i: _size(self.path(i)) for i in ids}
        total = sum(sizes.values())
        for i in list(ids):
            if total <= max_bytes or i == newest:
                break
            removed.append(i)
            total -= sizes[i]
        for i in removed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(i))
        return removed

    def ids(self) -> list[str]:
        """Every bundle's id, oldest first (ids sort by creation time)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(n[:-5] for n in names if n.endswith(".json") and ID.fullmatch(n[:-5]))

    def list(self, limit: int) -> list[Summary]:
        """The newest `limit` bundles, newest first (each file parsed once, then known by its size and mtime)."""
        ids = self.ids()
        known = self._summaries
        fresh: dict[str, tuple[tuple[int, int], Summary]] = {}
        out = []
        for ident in reversed(ids[-limit:] if limit else []):
            stamp = _stamp(self.path(ident))
            if stamp is None:
                continue  # removed since the listing
            cached = known.get(ident)
            if cached is not None and cached[0] == stamp:
                summary = cached[1]
            else:
                text = self.read(ident)
                if text is None:
                    continue
                summary = _summary(ident, text)
            fresh[ident] = (stamp, summary)
            out.append(summary)
        present = set(ids)
        self._summaries = {**{i: v for i, v in known.items() if i in present}, **fresh}  # the removed go
        return out

    def read(self, ident: str) -> str | None:
        """A bundle's JSON, None when there is none. `ident` must be a well-formed id (ValueError otherwise):
        it becomes a file name, so nothing else may reach the path."""
        if not ID.fullmatch(ident):
            raise ValueError(f"not an evidence id (ev-YYYYMMDDTHHMMSS.mmmZ-xxxxxx): {ident[:80]!r}")
        try:
            with open(self.path(ident), "rb") as f:
                return f.read(MAX_READ).decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None

    def path(self, ident: str) -> str:
        """Where bundle `ident` is kept (well-formed ids only reach here)."""
        return os.path.join(self.dir, f"{ident}.json")


def fit(bundle: dict[str, Any], limit: int) -> bytes:
    """The bundle's JSON within `limit` bytes: the oldest events go first, then the oldest diagnostic reports,
    then kernel-log records, then the conditions' evidence maps, then (a limit of a few KB) the node's other
    conditions, the notes, the GPU readings and the involved conditions; `trimmed` says how many of each went
    (1 for a whole section). The result fits any limit of 128 bytes or more: at worst the id and time."""
    trimmed: dict[str, int] = {}
    bundle["trimmed"] = trimmed
    data = _encode(bundle)
    for key in ("events", "diagnostics", "kernel_log"):
        items = bundle.get(key)
        while len(data) > limit and items:
            cut = max(1, len(items) // 4)
            if key == "diagnostics":
                del items[-cut:]  # reports are newest first
            else:
                del items[:cut]  # events and records oldest first
            trimmed[key] = trimmed.get(key, 0) + cut
            data = _encode(bundle)
    if len(data) > limit:
        for c in bundle.get("verdict", {}).get("conditions", ()):
            c["evidence"] = {}
        trimmed["condition_evidence"] = len(bundle.get("verdict", {}).get("conditions", ()))
        data = _encode(bundle)
    verdict = bundle.get("verdict")
    if len(data) > limit and isinstance(verdict, dict) and verdict.get("conditions"):
        trimmed["verdict_conditions"] = len(verdict["conditions"])  # the node's others; involved_conditions stay
        verdict["conditions"] = []
        data = _encode(bundle)
    for key in ("notes", "gpus", "involved_conditions"):  # still too large (a small message limit): whole ones go
        if len(data) > limit and key in bundle:
            del bundle[key]
            trimmed[key] = 1
            data = _encode(bundle)
    if len(data) > limit:  # what is left is the id, times, reason and components: keep what fits of them
        head = {k: bundle[k] for k in ("id", "created", "created_unix", "node", "boot_id", "versions", "verdict")
                if k in bundle}
        head["reason"] = str(bundle.get("reason", ""))[:100]
        head["components"] = list(bundle.get("components", ()))[:4]
        head["trimmed"] = {"all": 1}
        data = _encode(head)
    if len(data) > limit:  # below a few hundred bytes (message_fit is 768 at least): the id alone
        data = _encode({k: bundle[k] for k in ("id", "created") if k in bundle} | {"trimmed": {"all": 1}})
    return data


def _encode(bundle: dict[str, Any]) -> bytes:
    return json.dumps(bundle, indent=1, default=str).encode()


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _summary(ident: str, text: str) -> Summary:
    try:
        d = json.loads(text)
    except ValueError:
        d = {}
    if not isinstance(d, dict):
        d = {}
    try:
        created = float(d.get("created_unix", 0.0))
    except (TypeError, ValueError):
        created = 0.0
    components = d.get("components", ())
    return Summary(ident, created, str(d.get("reason", "")),
                   tuple(str(c) for c in components) if isinstance(components, list) else ())


def _stamp(path: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of a file, None when it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
