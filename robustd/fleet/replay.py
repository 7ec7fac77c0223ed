"""Dual-phase replay planner (ByteRobust §4.2, Algorithm 1) for silent data corruption.

TP and PP stay as in the job; only DP shrinks. With m = k·PP machines per group and n = machines / m
groups (n = DP/k when each machine holds one pipeline stage's TP group), phase 1 replays the n
horizontal groups H_i = {x : ⌊x/m⌋ = i} and phase 2 the n vertical groups V_j = {x : x mod n = j}.
When m ≤ n any m consecutive machines have distinct residues mod n, so H_i and V_j share at most one
machine: the failing horizontal group intersected with the failing vertical group names the faulty one.
Machines and groups are numbered from 0.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout or group index the planner refuses; the message says why, in one line."""


@dataclass(frozen=True)
class ReplayPlan:
    machines: int
    pp: int
    k: int
    m: int  # machines per group (k·PP)
    n: int  # groups per phase (machines / m)
    horizontal: tuple[tuple[int, ...], ...]
    vertical: tuple[tuple[int, ...], ...]


def _whole(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a whole number of at least 1, not {value!r}")
    return value


def _layout(machines: int, pp: int, k: int) -> tuple[int, int]:
    machines, pp, k = _whole("machines", machines), _whole("pp", pp), _whole("k", k)
    m = k * pp
    if machines % m:
        raise LayoutError(f"{machines} machines do not split into groups of m = k*PP = {k}*{pp} = {m}: "
                          f"m*n must equal the machine count")
    n = machines // m
    if m > n:
        hint = " (use a smaller k)" if k > 1 else ""
        raise LayoutError(f"m = k*PP = {k}*{pp} = {m} is more than n = machines/m = {machines}/{m} = {n}: "
                          f"the two phases need m <= n to isolate one machine{hint}")
    return m, n


def plan(machines: int, pp: int, k: int) -> ReplayPlan:
    """Both phases' groups; refuses (LayoutError) layouts with m > n or m·n ≠ machines."""
    m, n = _layout(machines, pp, k)
    horizontal = tuple(tuple(range(i * m, (i + 1) * m)) for i in range(n))
    vertical = tuple(tuple(range(j, machines, n)) for j in range(n))
    return ReplayPlan(machines, pp, k, m, n, horizontal, vertical)


def horizontal_group(x: int, m: int) -> int:
    return x // m


def vertical_group(x: int, n: int) -> int:
    return x % n


def locate(machines: int, pp: int, k: int, failed_horizontal: int, failed_vertical: int) -> int:
    """The machine in both failing groups; LayoutError for a bad index or groups that do not meet."""
    m, n = _layout(machines, pp, k)
    for name, value in (("horizontal", failed_horizontal), ("vertical", failed_vertical)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            raise LayoutError(f"failed {name} group {value!r} is out of range: groups are 0..{n - 1}")
    start = failed_horizontal * m
    # The one x in [start, start + m) with x ≡ failed_vertical (mod n), if any.
    x = start + (failed_vertical - start) % n
    if x >= start + m:
        raise LayoutError(f"horizontal group {failed_horizontal} (machines {start}..{start + m - 1}) and "
                          f"vertical group {failed_vertical} share no machine: the replay results are "
                          f"inconsistent (more than one faulty machine, or a flaky replay)")
    return x
