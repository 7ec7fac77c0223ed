"""Stop-time all-to-all: one rank per GPU, every received byte verified, bus bandwidth against a floor.

    python -m stoptests.all_to_all --spec SPEC.json

One rank per GPU (``backend`` nccl) or ``cpu_ranks`` ranks (gloo on CPU), a FileStore rendezvous in
``work_dir``. Rank s sends rank r, in iteration k, a chunk whose every byte is a function of (s, r, k);
every receiver checks every byte it got. ``bytes`` = one rank's send buffer. The launcher and the
attribution rules are in collective_launcher.py; the spec and the stdout protocol in PROTOCOL.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from stoptests.collective_launcher import MB, Launcher, Verdict, child_main
from stoptests.collective_worker import P_READY, P_SPAWNED, describe
from stoptests.protocol import ERROR, FAIL, PASS, bounded_str, cannot_run, emit_progress, emit_result

TEST = "all_to_all"


def run_all_to_all(spec: dict[str, Any], t0: float) -> int:
    ln = Launcher(spec, t0)
    n = len(ln.ranks)
    words = max(1, int(ln.size_mb * MB) // n // 8)
    noun = "GPU" if ln.gpus else "CPU rank"
    emit_progress(0.0, f"all-to-all: starting {n} {noun}s ({ln.backend}, {words * 8 * n / MB:.1f} MiB per rank, "
                       f"{ln.iterations} iterations)")
    work_dir = bounded_str(spec.get("work_dir"), "work_dir", "", 4096)
    # Absolute, whatever the daemon wrote: the ranks run in another working directory (REPO).
    work = Path(os.path.abspath(work_dir or tempfile.mkdtemp(prefix="robustd-a2a-")))
    work.mkdir(parents=True, exist_ok=True)
    store_file = work / f"a2a-store-{os.getpid()}-{time.time_ns()}"
    # Test-only fault: a FileStore in a directory that does not exist, where every rank waits in vain.
    rank_store = work / "missing-dir" / store_file.name if ln.faults.get("unusable_store") else store_file
    try:
        ln.spawn()
        for r in ln.ranks:
            assert r.conn is not None
            r.conn.send({**ln.base_cfg(r, words), "rank": r.index, "world": n, "file_store": str(rank_store)})
        how = ln.supervise(5.0, 90.0, "all-to-all")
    finally:
        ln.kill_all(at_deadline=False)
        store_file.unlink(missing_ok=True)
        if not work_dir:
            import shutil

            shutil.rmtree(work, ignore_errors=True)

    if all(r.error and r.error[0] == "local" for r in ln.ranks):
        # The same code failed the same way on every rank: the harness (no torch, a bug), not n devices.
        return cannot_run("every rank failed with an error of its own: " +
                          "; ".join(f"rank {r.index} ({describe(r.error[1], ln.total)}): {r.error[2]}"
                                    for r in ln.ranks if r.error))
    if all(r.exit_code not in (0, None) and r.pos == P_SPAWNED and not r.killed_at_deadline for r in ln.ranks):
        return cannot_run("every worker died before starting: exit codes "
                          + ", ".join(str(r.exit_code) for r in ln.ranks) + " (their stderr is above)")
    if (why := rendezvous_failure(ln)) is not None:
        details = {"backend": ln.backend, "ranks": n, "file_store": str(rank_store),
                   **{f"rank{r.index}": describe(r.pos, ln.total) + (f": {r.error[2]}" if r.error else "")
                      for r in ln.ranks}}
        emit_result("host", ERROR, f"ranks could not rendezvous: {why}", {}, details)
        emit_progress(100.0, "all-to-all could not start")
        return 0

    stuck = {r.index: r.pos for r in ln.ranks}
    if how == "deadline" and not any(r.crashed for r in ln.ranks) and ln.still_starting(ln.laggards(stuck)[0], stuck):
        late = sorted(ln.laggards(stuck)[0])
        emit_result("host", ERROR, f"the test could not start in time: rank(s) {', '.join(map(str, late))} were "
                                   f"still {describe(P_SPAWNED, ln.total)} at the {ln.timeout:g}s timeout (a loaded "
                                   f"host or a slow start-up: no evidence about the devices)", {},
                    {"backend": ln.backend, "ranks": n, "cause": "start-up",
                     **{f"rank{r.index}": describe(r.pos, ln.total) for r in ln.ranks}})
        emit_progress(100.0, "all-to-all could not start in time")
        return 0

    verdicts = judge_all_to_all(ln, how)
    for r, v in zip(ln.ranks, verdicts[:n], strict=True):
        emit_result(r.component, v.status, v.message, v.figures, v.details)
    for comp, v in verdicts[n:]:
        emit_result(comp, v.status, v.message, v.figures, v.details)
    emit_progress(100.0, "all-to-all finished")
    return 0


def rendezvous_failure(ln: Launcher) -> str | None:
    """Why no rank got into the process group, when that says nothing about any one device; else None.

    Only when no rank joined, none crashed and none lagged behind the others: every rank then waited
    at the same rendezvous (or failed in it) — a store path or address that does not work, a harness
    problem. A rank that joined, or one that stayed behind while the others waited, is evidence and is
    judged by `judge_all_to_all`.
    """
    if any(r.pos >= P_READY or r.result is not None or r.crashed for r in ln.ranks):
        return None
    positions = {r.pos for r in ln.ranks}
    if len(positions) != 1:
        return None
    pos = positions.pop()
    errors = [r.error[2] for r in ln.ranks if r.error]
    if errors:
        return (f"{len(errors)} of {len(ln.ranks)} ranks failed while {describe(pos, ln.total)}: "
                f"{errors[0].splitlines()[0] if errors[0] else ''}")
    return (f"none of the {len(ln.ranks)} ranks got past '{describe(pos, ln.total)}' within the "
            f"{ln.timeout:g}s timeout")


def judge_all_to_all(ln: Launcher, how: str) -> list[Any]:
    n = len(ln.ranks)
    suspects: dict[int, str] = {}
    for r in ln.ranks:
        if r.crashed:
            code = r.exit_code or 0
            what = (f"error: {r.error[2]}" if r.error else
                    f"exited with code {code}" if code > 0 else f"killed by signal {-code}")
            suspects[r.index] = f"crashed ({what}); its last phase: {describe(r.pos, ln.total)}"
    bad = [b for r in ln.ranks if r.result for b in r.result["bad"]]
    for g, why in ln.bad_data_suspects(bad, list(range(n)), [r.index for r in ln.ranks if r.result]).items():
        suspects.setdefault(g, why)
    host: list[tuple[str, Verdict]] = []
    stop_reason = ""
    if how == "deadline" and not any(r.crashed for r in ln.ranks):
        stuck = {r.index: r.pos for r in ln.ranks}
        lag, top = ln.laggards(stuck)
        for g in lag:
            suspects.setdefault(g, f"hung: its last phase was '{describe(stuck[g], ln.total)}' at the "
                                   f"{ln.timeout:g}s timeout while other ranks got to '{describe(top, ln.total)}'")
        if not lag and not suspects:
            host.append(("host", Verdict(FAIL, f"every rank hung {describe(top, ln.total)} past the "
                                               f"{ln.timeout:g}s timeout: no single rank to blame")))
        stop_reason = "the test hit its timeout"
    elif how == "crash":
        stop_reason = "a rank crashed"
    if suspects and not stop_reason and any(r.result is None for r in ln.ranks):
        stop_reason = "another rank failed"
    if not suspects and not host and any(r.result is None for r in ln.ranks):
        # Nothing explains why some rank has no result: name the ones that failed in a collective.
        for r in ln.ranks:
            if r.result is None:
                text = r.error[2] if r.error else f"exit code {r.exit_code}"
                suspects[r.index] = f"failed {describe(r.pos, ln.total)}: {text}"

    results = [r.result for r in ln.ranks if r.result]
    floor = float(ln.spec.get("min_busbw_gbps") or 0.0)
    figs = {r.index: ln.figures(r.result, n) for r in ln.ranks if r.result}
    agg: dict[str, Any] = {}
    if len(results) == n:
        mean = dict(results[0])
        mean["duration_s"] = sum(x["duration_s"] for x in results) / n
        if all("median_iteration_s" in x for x in results):
            mean["median_iteration_s"] = sum(x["median_iteration_s"] for x in results) / n
        agg = ln.figures(mean, n)
        if floor > 0 and agg["busbw_gbps"] < floor and not suspects:
            # Ranks below the floor while others are above it are the slow ones; every rank below it
            # is the machine's problem. (Comparing ranks with each other when all are below is noise:
            # a collective runs at its slowest link on every rank, and per-rank timings differ only by
            # scheduling — a 2-core CI machine blamed random ranks that way.)
            slow = [i for i, f in figs.items() if f["busbw_gbps"] < floor]
            if 0 < len(slow) < n:
                for i in slow:
                    suspects[i] = f"bus bandwidth {figs[i]['busbw_gbps']:.3g} GB/s below the floor {floor:g} GB/s"
            else:
                host.append(("host", Verdict(FAIL, f"bus bandwidth {agg['busbw_gbps']:.3g} GB/s below the floor "
                                                   f"{floor:g} GB/s on every rank alike", agg)))
    out: list[Any] = []
    for r in ln.ranks:
        details: dict[str, Any] = {"completed": r.result is not None, "last_phase": describe(r.pos, ln.total),
                                   "exit_code": r.exit_code, "backend": ln.backend, "ranks": n,
                                   "iterations": ln.iterations}
        if agg:
            details["aggregate_busbw_gbps"] = agg["busbw_gbps"]
        if r.error:
            details["error"] = r.error[2]
        fig = figs.get(r.index, {})
        if r.index in suspects:
            out.append(Verdict(FAIL, suspects[r.index], fig, details))
        elif r.result is not None:
            out.append(Verdict(PASS, f"all-to-all verified from {n} ranks over {r.result['iterations']} iterations, "
                                     f"{fig['busbw_gbps']:.3g} GB/s busbw", fig, details))
        else:
            out.append(Verdict(PASS, f"no fault attributed to this rank; the test stopped early ({stop_reason}) "
                                     f"while it was {describe(r.pos, ln.total)}", fig, details))
    return out + host


if __name__ == "__main__":
    child_main(TEST, run_all_to_all)
