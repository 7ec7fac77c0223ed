"""Triage of log files, read and scanned in parallel when there are many.

A large job leaves one log per rank: 64 logs of 1 MiB tails is 64 MiB to search, about 0.5 ms
per MiB for each of the rule file's gates (bytes.find), over a second on one core. Each worker
process reads and scans its share of the files itself (forked: nothing but the paths goes in,
only the failure lines come back), so the work spreads over the host's cores. The daemon never
forks for this: its RPC gets bytes, not paths, and scans them in a thread (robustd/api/triage.py).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from robustd.triage.judge import judge, succeeded
from robustd.triage.model import MAX_LOG_BYTES, MAX_LOGS, Triage
from robustd.triage.reader import read_log
from robustd.triage.rules import shipped
from robustd.triage.scan import Hit, scan
from robustd.triage.status import exit_signal

PARALLEL_BYTES = 16 << 20  # below this much to read, one process is faster than starting others


class Unreadable(OSError):
    """A log that could not be read; `filename` names it."""


def _scan_share(share: list[tuple[int, str, str]], tail: int) -> tuple[list[Hit], list[str], tuple[str, str] | None]:
    rules = shipped()
    hits: list[Hit] = []
    partial: list[str] = []
    for index, path, name in share:
        try:
            log = read_log(path, tail, name=name)
        except OSError as e:
            return hits, partial, (path, e.strerror or str(e))
        if not log.whole:
            partial.append(log.name)
        hits += scan(log, index, rules)
    return hits, partial, None


def triage_files(paths: Sequence[str], tail: int = MAX_LOG_BYTES, exit_code: int | None = None,
                 signal: str | None = None, workers: int | None = None,
                 names: Sequence[str] | None = None) -> Triage:
    """Triage of the last `tail` bytes of each file; Unreadable for the first file that cannot be read."""
    sig = exit_signal(exit_code, signal)
    rules = shipped()
    items = [(i, p, (names[i] if names else p)) for i, p in enumerate(paths[:MAX_LOGS])]
    if succeeded(exit_code, sig):
        return judge([], (), exit_code, sig, rules, bool(items))
    sizes = 0
    for _, p, _ in items:
        try:
            sizes += min(tail, os.stat(p).st_size)
        except OSError as e:
            raise Unreadable(e.errno, e.strerror, p) from None
    n = workers if workers is not None else (os.cpu_count() or 1)
    n = max(1, min(n, len(items), 8))
    if n == 1 or sizes < PARALLEL_BYTES:
        results = [_scan_share(items, tail)]
    else:
        shares = [items[k::n] for k in range(n)]
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_scan_share, shares, [tail] * n))
    hits: list[Hit] = []
    partial: list[str] = []
    for share_hits, share_partial, error in results:
        if error is not None:
            raise Unreadable(0, error[1], error[0])
        hits += share_hits
        partial += share_partial
    order = {name: i for i, (_, _, name) in enumerate(items)}
    return judge(hits, tuple(sorted(partial, key=order.__getitem__)), exit_code, sig, rules, bool(items))
