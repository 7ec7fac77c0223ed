"""Stack aggregation (ByteRobust §5): find the parallel group that a hang's outlier ranks share.

Input format
------------
``stacks: Mapping[int, Sequence[Thread]]`` — global rank → the threads of that rank's training process.
A thread is either a sequence of frames, or a mapping ``{"name"/"thread_name": str, "frames": [...]}``
(the shape of ``py-spy dump --json``). Frames are listed **innermost first** (as py-spy prints them).
A frame is a :class:`Frame` or a mapping with ``function`` (or py-spy's ``name``) and ``file`` (or
``filename``); ``line`` and any other key are ignored by normalisation. A rank of the layout that is
absent from ``stacks`` (its capture failed or timed out) counts as an outlier.

Rank order
----------
Megatron-LM's default order ``"tp-cp-ep-dp-pp"`` with CP = EP = 1, i.e. ``"tp-dp-pp"``: TP varies
fastest, then DP, then PP::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Another order can be given as ``Layout(order="tp-pp-dp")`` (fastest first). Group indices:
a TP group is numbered by ``(dp_rank, pp_rank)``, a PP group by ``(tp_rank, dp_rank)``, a DP group by
``(tp_rank, pp_rank)`` and a model-parallel group ("mp", one whole model replica, TP×PP ranks) by
``dp_rank`` — each as a mixed-radix number over the remaining coordinates in the layout's order
(default order: TP group = rank // tp, PP group = tp_rank + tp·dp_rank, DP group = tp_rank + tp·pp_rank).

Method
------
Stacks are normalised (addresses, line numbers, directories dropped; idle helper threads filtered),
grouped by identical normalised stack, and the largest group is healthy (as is any group at least
``healthy_ratio`` times its size, for jobs whose pipeline stages legitimately wait in different places).
The remaining ranks are outliers. For each group kind (node, tp, pp, mp, dp) the groups that contain
outliers cover them; the suspects are the cover evicting the fewest machines, then the fewest ranks,
then the fewest groups, then the kind order above. So one stuck rank gives its node; a stuck PP group
gives that PP group; no outlier gives no suspect.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS = ("node", "tp", "pp", "mp", "dp")


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int | None = None


@dataclass(frozen=True)
class IdleFilter:
    """Threads to ignore: helper threads by name, or threads parked in an idle function (innermost frame).

    The main thread is never ignored.
    """

    thread_names: tuple[str, ...] = (r"^pt_autograd", r"^QueueFeederThread", r"^pin_memory", r"^Thread-\d+ \(_",
                                     r"^wandb", r"^tqdm_monitor", r"^ThreadPoolExecutor")
    idle_functions: frozenset[tuple[str, str]] = frozenset({
        ("wait", "threading.py"), ("_wait_for_tstate_lock", "threading.py"), ("select", "selectors.py"),
        ("poll", "selectors.py"), ("get", "queue.py"), ("_worker", "thread.py"), ("accept", "socket.py"),
        ("recv_into", "socket.py"), ("sleep", "time"), ("_recv", "connection.py"), ("poll", "connection.py"),
    })

    def _name_re(self) -> re.Pattern[str]:
        return re.compile("|".join(self.thread_names)) if self.thread_names else re.compile(r"(?!x)x")


DEFAULT_FILTER = IdleFilter()

_ADDR = re.compile(r"\s*\([^()]*0x[0-9a-fA-F]+[^()]*\)|\s*\+?0x[0-9a-fA-F]+|\s+at\s+0x[0-9a-fA-F]+|:\d+$")


def _frame_key(frame: Any) -> tuple[str, str]:
    if type(frame) is dict and "function" in frame and "file" in frame:  # fast path for the common shape
        return frame["function"], frame["file"]
    if isinstance(frame, Frame):
        return frame.function, frame.file
    if isinstance(frame, Mapping):
        return (str(frame.get("function", frame.get("name", "?"))),
                str(frame.get("file", frame.get("filename", "?"))))
    return str(getattr(frame, "function", "?")), str(getattr(frame, "file", "?"))


_norm_cache: dict[tuple[str, str], tuple[str, str]] = {}


def _norm_frame(key: tuple[str, str]) -> tuple[str, str]:
    hit = _norm_cache.get(key)
    if hit is None:
        function, file = key
        function = _ADDR.sub("", function).strip() or "?"
        base = _ADDR.sub("", file.replace("\\", "/").rsplit("/", 1)[-1]).strip() or "?"
        hit = (function, base)
        if len(_norm_cache) < 1_000_000:
            _norm_cache[key] = hit
    return hit


def _thread_parts(thread: Any) -> tuple[str, Sequence[Any]]:
    if isinstance(thread, Mapping):
        return str(thread.get("name", thread.get("thread_name", ""))), thread.get("frames", ())
    return "", thread


def normalize(stack: Sequence[Any], idle: IdleFilter = DEFAULT_FILTER) -> tuple[str, ...]:
    """One rank's threads → a comparable signature: one string per kept thread, sorted.

    Each thread becomes ``"function@file.py;function@file.py;..."`` (innermost first) with addresses,
    line numbers and directories removed. Idle helper threads (``idle``) are dropped, except the main
    thread (named ``MainThread`` or the first thread when threads are unnamed).
    """
    name_re = idle._name_re()
    out = []
    for i, thread in enumerate(stack):
        name, frames = _thread_parts(thread)
        main = name == "MainThread" or (not name and i == 0)
        normed = [_norm_frame(_frame_key(f)) for f in frames]
        if not main:
            if name and name_re.search(name):
                continue
            if not normed or normed[0] in idle.idle_functions:
                continue
        out.append(";".join(f"{fn}@{fl}" for fn, fl in normed))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Layout:
    """The job's parallel layout: TP, PP, DP sizes, rank order (fastest first) and rank → node.

    Give either ``ranks_per_node`` (node name ``node<rank // ranks_per_node>``) or ``node_of``
    (a mapping or callable rank → node name).
    """

    tp: int
    pp: int
    dp: int
    ranks_per_node: int | None = None
    node_of: Mapping[int, str] | Callable[[int], str] | None = None
    order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, not {v!r}")
        if sorted(self.order.split("-")) != ["dp", "pp", "tp"]:
            raise ValueError(f"order must be a permutation of tp, dp, pp like 'tp-dp-pp', not {self.order!r}")
        if self.node_of is None and (self.ranks_per_node is None or self.ranks_per_node < 1):
            raise ValueError("give ranks_per_node (≥ 1) or node_of")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the layout's world of {self.world}")
        c = {}
        for dim in self.order.split("-"):
            size = getattr(self, dim)
            c[dim] = rank % size
            rank //= size
        return c

    def node(self, rank: int) -> str:
        if self.node_of is None:
            assert self.ranks_per_node is not None
            return f"node{rank // self.ranks_per_node}"
        if callable(self.node_of):
            return str(self.node_of(rank))
        return str(self.node_of[rank])

    def group_index(self, kind: str, rank: int) -> int | str:
        """The index of ``rank``'s group of ``kind`` (a node's index is its name)."""
        if kind == "node":
            return self.node(rank)
        c = self.coords(rank)
        vary = {"tp": {"tp"}, "pp": {"pp"}, "dp": {"dp"}, "mp": {"tp", "pp"}}[kind]
        index, radix = 0, 1
        for dim in self.order.split("-"):
            if dim not in vary:
                index += c[dim] * radix
                radix *= getattr(self, dim)
        return index


@dataclass(frozen=True)
class ParallelGroup:
    kind: str  # node | tp | pp | mp | dp
    index: int | str
    ranks: tuple[int, ...]
    machines: tuple[str, ...]
    outliers: tuple[int, ...]  # the outlier ranks in this group


@dataclass(frozen=True)
class StackGroup:
    signature: tuple[str, ...]
    ranks: tuple[int, ...]
    healthy: bool


@dataclass(frozen=True)
class Aggregation:
    groups: tuple[StackGroup, ...]  # largest first
    outliers: tuple[int, ...]
    missing: tuple[int, ...]  # ranks of the layout without a stack (also outliers)
    suspects: tuple[ParallelGroup, ...]  # the groups to evict; empty when no outlier
    suspect_kind: str | None
    evidence: dict[str, tuple[ParallelGroup, ...]] = field(default_factory=dict)  # the cover of every kind

    @property
    def suspect_machines(self) -> tuple[str, ...]:
        return tuple(sorted({m for g in self.suspects for m in g.machines}))


def _members(layout: Layout) -> dict[str, dict[int | str, list[int]]]:
    members: dict[str, dict[int | str, list[int]]] = {k: {} for k in KINDS}
    for r in range(layout.world):
        for k in KINDS:
            members[k].setdefault(layout.group_index(k, r), []).append(r)
    return members


def aggregate(stacks: Mapping[int, Sequence[Any]], layout: Layout, *, idle: IdleFilter = DEFAULT_FILTER,
              healthy_ratio: float = 0.5) -> Aggregation:
    """Group the ranks' normalised stacks, find the outliers and the parallel group(s) they share."""
    by_sig: dict[tuple[str, ...], list[int]] = {}
    for rank, stack in stacks.items():
        if not 0 <= rank < layout.world:
            raise ValueError(f"rank {rank} outside the layout's world of {layout.world}")
        by_sig.setdefault(normalize(stack, idle), []).append(rank)
    ordered = sorted(by_sig.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    top = len(ordered[0][1]) if ordered else 0
    groups = tuple(StackGroup(sig, tuple(sorted(rs)), len(rs) >= max(1, top * healthy_ratio) and top > 0)
                   for sig, rs in ordered)
    # A lone rank is never "healthy" by ratio unless it is the whole job.
    if len(stacks) > 1 and top == 1:
        groups = tuple(StackGroup(g.signature, g.ranks, False) for g in groups)
    missing = tuple(r for r in range(layout.world) if r not in stacks)
    outliers = tuple(sorted({r for g in groups if not g.healthy for r in g.ranks} | set(missing)))
    if not outliers:
        return Aggregation(groups, (), missing, (), None, {})

    members = _members(layout)
    out_set = set(outliers)
    evidence: dict[str, tuple[ParallelGroup, ...]] = {}
    best: tuple[tuple[int, int, int, int], str] | None = None
    for order_i, kind in enumerate(KINDS):
        idxs = sorted({layout.group_index(kind, r) for r in outliers}, key=str)
        cover = []
        for idx in idxs:
            ranks = tuple(members[kind][idx])
            cover.append(ParallelGroup(kind, idx, ranks, tuple(sorted({layout.node(r) for r in ranks})),
                                       tuple(r for r in ranks if r in out_set)))
        evidence[kind] = tuple(cover)
        machines = len({m for g in cover for m in g.machines})
        cost = (machines, sum(len(g.ranks) for g in cover), len(cover), order_i)
        if best is None or cost < best[0]:
            best = (cost, kind)
    assert best is not None
    kind = best[1]
    return Aggregation(groups, outliers, missing, evidence[kind], kind, evidence)


@dataclass(frozen=True)
class FailSlow:
    suspect: ParallelGroup | None  # the group flagged most often; None when no round flagged any
    flags: int
    rounds: int
    counts: dict[tuple[str, int | str], int]


def fail_slow(rounds: Sequence[Aggregation]) -> FailSlow:
    """Fail-slow mode (ByteRobust: aggregate every 10 s for 5 rounds): the group flagged most often.

    Each round flags its suspect group(s) holding the most outliers. Ties in flag count go to the group
    with more outliers over all rounds, then to the one flagged first.
    """
    counts: Counter[tuple[str, int | str]] = Counter()
    outl: Counter[tuple[str, int | str]] = Counter()
    first: dict[tuple[str, int | str], int] = {}
    latest: dict[tuple[str, int | str], ParallelGroup] = {}
    for i, agg in enumerate(rounds):
        if not agg.suspects:
            continue
        most = max(len(g.outliers) for g in agg.suspects)
        for g in agg.suspects:
            if len(g.outliers) == most:
                key = (g.kind, g.index)
                counts[key] += 1
                outl[key] += len(g.outliers)
                first.setdefault(key, i)
                latest[key] = g
    if not counts:
        return FailSlow(None, 0, len(rounds), {})
    key = min(counts, key=lambda k: (-counts[k], -outl[k], first[k]))
    return FailSlow(latest[key], counts[key], len(rounds), dict(counts))
