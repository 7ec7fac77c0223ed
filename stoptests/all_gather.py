"""Stop-time all-gather across nodes: each node names the peers whose data was wrong, late or missing.

    python -m stoptests.all_gather --spec SPEC.json      (spec.rendezvous from the scheduler)

Every node's child joins one process group through ``spec.rendezvous``. The launcher of node rank 0
hosts the TCPStore on ``master_port``; every launcher checks its node in (name and local rank count),
waits for the others, then hands its workers their global ranks (``node_rank * local_ranks +
local_rank``; one rank per node on CPU). Workers publish their phase in the store, so every node can
tell which peer is late. Names are exchanged with an all-gather of JSON (torch's
``all_gather_object`` needs numpy, which is not installed); then every rank all-gathers chunks that
are a function of (sender global rank, iteration) and checks every peer's chunk. ``bytes`` = the
gathered output per iteration, ``busbw = algbw * (n-1)/n``. The launcher is collective_launcher.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from stoptests.collective_launcher import MAX_GLOBAL_RANKS, MAX_NODES, MB, Launcher, Rank, Verdict, child_main
from stoptests.collective_worker import P_READY, describe, p_finished
from stoptests.protocol import (
    ERROR,
    FAIL,
    PASS,
    SKIPPED,
    SpecError,
    bounded_int,
    bounded_str,
    cannot_run,
    emit_progress,
    emit_result,
)

TEST = "all_gather"
CRASH_UNRUNNABLE = 2  # the value of crashed/<g> for a rank that failed in Python before joining (1: crashed)


def node_info(raw: bytes) -> dict[str, Any]:
    """A peer's check-in (its name and local rank count), bounded and checked: it came from another host."""
    try:
        info = json.loads(raw[:4096])
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return {"name": "", "local_ranks": -1}
    name, local = info.get("name"), info.get("local_ranks")
    return {"name": name[:256] if isinstance(name, str) else "",
            "local_ranks": local if isinstance(local, int) and not isinstance(local, bool) else -1}


def harness_failure(r: Rank) -> bool:
    """A Python error of the rank's own before it joined the process group: no torch, a bug, a bad spec."""
    return r.crashed and r.error is not None and r.error[0] == "local" and r.error[1] < P_READY


class Rendezvous:
    """The launcher's own view of the store: node check-in, peers' phases, crash flags."""

    def __init__(self, ln: Launcher, rdv: dict[str, Any]):
        """Raises SpecError for impossible values (a port past 65535, a node rank past the world)."""
        self.ln = ln
        self.addr = bounded_str(rdv.get("master_addr") or None, "rendezvous.master_addr", "127.0.0.1", 255)
        self.port = bounded_int(rdv.get("master_port"), "rendezvous.master_port", 0, 1, 65535)
        self.nodes = bounded_int(rdv.get("world_size") or None, "rendezvous.world_size", 1, 1, MAX_NODES)
        self.node_rank = bounded_int(rdv.get("node_rank"), "rendezvous.node_rank", 0, 0, self.nodes - 1)
        # The same prefix on every node: the daemon's own run id differs from node to node.
        run_id = bounded_str(rdv.get("run_id") or None, "rendezvous.run_id", "", 256)
        self.prefix = f"robustd/all_gather/{run_id or f'{self.addr}:{self.port}/{self.nodes}'}"
        self.store: Any = None
        self.connect_error: str | None = None
        self.joined: dict[int, dict[str, Any]] = {}
        self.local = len(ln.ranks)
        self.world = self.nodes * self.local
        if self.world > MAX_GLOBAL_RANKS:
            raise SpecError(f"{self.nodes} nodes x {self.local} ranks is more than {MAX_GLOBAL_RANKS} ranks")
        self.positions: dict[int, int] = {}
        self.crashed: set[int] = set()
        self.unrunnable: set[int] = set()  # ranks whose own launcher saw them fail before joining, in Python
        self.ended: set[int] = set()  # ranks whose worker process is gone, whatever the reason
        self.store_lost: str | None = None
        self.started = False
        self._thread = threading.Thread(target=self._connect, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _connect(self) -> None:
        try:
            import warnings

            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch.distributed as dist

            remaining = max(1.0, self.ln.deadline - time.monotonic())
            store = dist.TCPStore(self.addr, self.port, is_master=self.node_rank == 0,
                                  timeout=timedelta(seconds=remaining), wait_for_workers=False)
            store.set_timeout(timedelta(seconds=5))
            ps = dist.PrefixStore(self.prefix, store)
            ps.set(f"node/{self.node_rank}", json.dumps({"name": self.ln.node,
                                                          "local_ranks": self.local}))
            ps.add(f"joined/{self.node_rank}", 1)
            self._raw = store
            self.store = ps
        except Exception as e:  # noqa: BLE001
            self.connect_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def poll(self) -> None:
        if self.store is None or self.store_lost:
            return
        try:
            for k in range(self.nodes):
                if k not in self.joined and self.store.add(f"joined/{k}", 0) > 0:
                    self.joined[k] = node_info(self.store.get(f"node/{k}"))
            if self.started:
                for g in range(self.world):
                    self.positions[g] = int(self.store.add(f"pos/{g}", 0))
                    if g not in self.crashed and g not in self.unrunnable:
                        flag = self.store.add(f"crashed/{g}", 0)
                        if flag >= CRASH_UNRUNNABLE:
                            self.unrunnable.add(g)
                        elif flag > 0:
                            self.crashed.add(g)
                    if g not in self.ended and self.store.add(f"ended/{g}", 0) > 0:
                        self.ended.add(g)
        except Exception as e:  # noqa: BLE001
            self.store_lost = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def flag(self, what: str, g: int, value: int = 1) -> None:
        if self.store is not None and not self.store_lost:
            with contextlib.suppress(Exception):
                self.store.add(f"{what}/{g}", value)

    def name(self, k: int) -> str:
        info = self.joined.get(k)
        return info["name"] if info and info.get("name") else f"rank{k}"


def run_all_gather(spec: dict[str, Any], t0: float) -> int:
    rdv_spec = spec.get("rendezvous") or {}
    if not isinstance(rdv_spec, dict) or "master_port" not in rdv_spec:
        return cannot_run("all_gather needs spec.rendezvous with master_addr, master_port, world_size, node_rank")
    ln = Launcher(spec, t0)
    rdv = Rendezvous(ln, rdv_spec)
    me = rdv.node_rank
    words = max(1, int(ln.size_mb * MB) // 8)
    emit_progress(0.0, f"all-gather: node rank {me} of {rdv.nodes}, joining {rdv.addr}:{rdv.port}")
    ln.spawn()
    rdv.start()
    waited_join = False
    how = "done"
    try:
        # 1. every node checks in (or the deadline comes)
        while len(rdv.joined) < rdv.nodes:
            if time.monotonic() >= ln.deadline or rdv.connect_error:
                how = "rendezvous"
                break
            ln.pump(0.2)
            rdv.poll()
            if rdv.store_lost:
                how = "rendezvous"
                break
            if not waited_join and rdv.store is not None:
                waited_join = True
                emit_progress(2.0, f"all-gather: joined the rendezvous, waiting for {rdv.nodes} nodes")
        if how == "done":
            sizes = {k: v["local_ranks"] for k, v in rdv.joined.items()}
            if len(set(sizes.values())) > 1:
                return cannot_run(f"nodes have different local rank counts: {sizes}")
            emit_progress(5.0, "all-gather: every node joined: " + ", ".join(rdv.name(k) for k in range(rdv.nodes)))
            rdv.started = True
            for r in ln.ranks:
                if r.conn is None:
                    continue
                g = me * rdv.local + r.index
                r.conn.send({**ln.base_cfg(r, words), "rank": g, "world": rdv.world, "grank": g,
                             "node_rank": me, "master_addr": rdv.addr, "master_port": rdv.port,
                             "prefix": rdv.prefix})

            flagged: set[int] = set()

            def watch() -> None:
                rdv.poll()
                for r in ln.ranks:
                    if r.crashed and r.index not in flagged:
                        flagged.add(r.index)
                        rdv.flag("crashed", me * rdv.local + r.index, CRASH_UNRUNNABLE if harness_failure(r) else 1)

            how = ln.supervise(5.0, 90.0, "all-gather", watch)
            watch()
            for r in ln.ranks:
                rdv.flag("ended", me * rdv.local + r.index)
            rdv.poll()
            if me == 0:  # keep the store up until every rank is through (or the deadline)
                fin = p_finished(ln.total)
                while time.monotonic() < ln.deadline and not rdv.store_lost and not all(
                        rdv.positions.get(g, 0) >= fin or g in rdv.ended for g in range(rdv.world)):
                    time.sleep(0.1)
                    rdv.poll()
    finally:
        ln.kill_all(at_deadline=how == "deadline")

    for comp, v in judge_all_gather(ln, rdv, how):
        emit_result(comp, v.status, v.message, v.figures, v.details)
    emit_progress(100.0, "all-gather finished")
    sys.stdout.flush()
    return 0


def judge_all_gather(ln: Launcher, rdv: Rendezvous, how: str) -> list[tuple[str, Verdict]]:
    """One verdict per peer node, plus `host` for this node's own problems.

    FAIL needs evidence: a node that joined and then crashed, lagged or sent wrong bytes, a node missing
    from a rendezvous the others reached, a master that went away after everybody joined. A
    rendezvous nobody else reached (or that this node could not reach), ranks that could not form the
    process group anywhere, and this node's own ranks failing in Python before joining are ERRORs:
    they say the harness, the addresses or the network setup are wrong, not which hardware is. Such an
    ERROR's details say which in `cause`: `rendezvous` (the ranks could not meet: addresses, ports, the
    network) or `harness` (the test could not run: torch, the interpreter); a job-level diagnosis tells a
    broken data plane from a broken harness by it (robustd/fleet/diagnosis.py).
    """
    me, L = rdv.node_rank, rdv.local
    peers = [k for k in range(rdv.nodes) if k != me]
    out: list[tuple[str, Verdict]] = []
    base = {"node_ranks": rdv.nodes, "ranks_per_node": L, "backend": ln.backend}
    if not peers:
        return [("host", Verdict(SKIPPED, "no peer nodes (rendezvous world_size is 1)", {}, base))]

    def untested(why: str) -> list[tuple[str, Verdict]]:
        return [(f"node/{rdv.name(k)}", Verdict(SKIPPED, f"not tested: {why}", {}, {**base, "node_rank": k}))
                for k in peers]

    if how == "rendezvous" or len(rdv.joined) < rdv.nodes:
        if rdv.store is None:  # we never got in: nothing is known about any peer
            if me == 0:
                why = f"could not host the rendezvous on {rdv.addr}:{rdv.port}"
            else:
                why = (f"could not reach the rendezvous master {rdv.addr}:{rdv.port} (node rank 0) within the "
                       f"{ln.timeout:g}s timeout")
            why += f": {rdv.connect_error}" if rdv.connect_error else ""
            return untested("this node could not join the rendezvous") + [
                ("host", Verdict(ERROR, f"ranks could not rendezvous: {why}", {},
                                 {**base, "node_rank": me, "cause": "rendezvous"}))]
        missing = [k for k in range(rdv.nodes) if k not in rdv.joined]
        if not any(k in rdv.joined for k in peers):  # nobody else came: a wrong address, port or run id
            why = (f"no other node joined the rendezvous on {rdv.addr}:{rdv.port} within the {ln.timeout:g}s "
                   f"timeout ({rdv.nodes} nodes expected)" + (f"; {rdv.store_lost}" if rdv.store_lost else ""))
            return untested("no other node joined") + [
                ("host", Verdict(ERROR, f"ranks could not rendezvous: {why}", {},
                                 {**base, "node_rank": me, "cause": "rendezvous"}))]
        why = f"never joined the rendezvous within the {ln.timeout:g}s timeout"
        if rdv.store_lost and not missing:  # everybody had joined, then the master went away
            why = f"(the rendezvous master) went away before the exchange: {rdv.store_lost}"
            missing = [0]
        for k in peers:
            comp = f"node/{rdv.name(k)}"
            if k in missing:
                out.append((comp, Verdict(FAIL, f"node rank {k} {why}", {}, {**base, "node_rank": k})))
            else:
                names = ", ".join(f"node rank {m}" for m in missing) or "the rendezvous"
                out.append((comp, Verdict(SKIPPED, f"not tested: the exchange never started ({names} missing)", {},
                                          {**base, "node_rank": k})))
        return out

    def node_of(g: int) -> int:
        return g // L

    # crashes: our own ranks (what we saw) and the peers' (what their launchers flagged)
    suspects: dict[int, str] = {}
    errors: dict[int, str] = {}  # peers that could not run the test at all (no evidence about them)
    own: list[str] = []  # evidence against this node
    own_errors: list[str] = []  # this node could not run the test
    harness = [r for r in ln.ranks if harness_failure(r)]
    for r in ln.ranks:
        if r.crashed and (r not in harness or len(harness) < L):
            own.append(f"{r.component} crashed {describe(r.pos, ln.total)}"
                       + (f": {r.error[2]}" if r.error else f" (exit code {r.exit_code})"))
    if len(harness) == L:  # every rank here failed in Python before joining: the harness, not L devices
        own_errors.append("every rank of this node failed before joining the process group: "
                          + "; ".join(f"{r.component}: {r.error[2] if r.error else r.exit_code}" for r in harness))
    for g in sorted(rdv.crashed):
        if node_of(g) != me:
            suspects.setdefault(node_of(g), f"its rank {g} crashed "
                                            f"{describe(rdv.positions.get(g, 0), ln.total)}")
    for g in sorted(rdv.unrunnable):
        if node_of(g) != me and node_of(g) not in suspects:
            errors.setdefault(node_of(g), f"could not run the test: its rank {g} failed before joining the "
                                          "process group (its own report says why)")
    # wrong data: what our ranks received
    bad = [b for r in ln.ranks if r.result for b in r.result["bad"]]
    for g, why in ln.bad_data_suspects(bad, list(range(rdv.world)), [me * L + r.index for r in ln.ranks]).items():
        k = node_of(g)
        if k == me:
            own.append(f"rank {g} of this node: {why}")
        else:
            suspects.setdefault(k, why.replace("sent wrong bytes", f"sent wrong bytes (global rank {g})"))
    positions = {g: rdv.positions.get(g, 0) for g in range(rdv.world)}
    for r in ln.ranks:  # what our own ranks told us directly is at least as recent
        positions[me * L + r.index] = max(positions[me * L + r.index], r.pos)
    formed = any(p >= P_READY for p in positions.values())
    # lateness: who never reached the phase everybody else waited in
    if how == "deadline" and not suspects and not own and not own_errors and not errors:
        lag, top = ln.laggards(positions)
        starting = ln.still_starting(lag, positions)  # robustd's start-up was late, not a device
        for g in sorted(lag):
            k = node_of(g)
            why = (f"late: its rank {g} was still {describe(positions[g], ln.total)} at the "
                   f"{ln.timeout:g}s timeout while others got to '{describe(top, ln.total)}'")
            if starting:
                why = f"could not start the test in time ({why}): no evidence about its devices"
            if k == me:
                (own_errors if starting else own).append(why.replace("its rank", "this node's rank"))
            elif starting:
                errors.setdefault(k, why)
            else:
                suspects.setdefault(k, why)
        if not lag and not formed:
            own_errors.append(f"ranks could not form the process group: every rank was still "
                              f"{describe(top, ln.total)} at the {ln.timeout:g}s timeout")
        elif not lag:
            own.append(f"every rank hung {describe(top, ln.total)} past the {ln.timeout:g}s timeout")
    if not suspects and not own and not own_errors and not errors and any(r.result is None for r in ln.ranks):
        for r in ln.ranks:
            if r.result is None:
                text = (f"{r.component} failed {describe(r.pos, ln.total)}: "
                        + (r.error[2] if r.error else f"exit code {r.exit_code}"))
                (own if formed else own_errors).append(
                    text if formed else f"ranks could not form the process group: {text}")

    results = [r.result for r in ln.ranks if r.result]
    figs: dict[str, Any] = {}
    if len(results) == L:
        mean = dict(results[0])
        mean["duration_s"] = sum(x["duration_s"] for x in results) / L
        if all("median_iteration_s" in x for x in results):
            mean["median_iteration_s"] = sum(x["median_iteration_s"] for x in results) / L
        figs = ln.figures(mean, rdv.world)
    floor = float(ln.spec.get("min_busbw_gbps") or 0.0)
    if figs and floor > 0 and figs["busbw_gbps"] < floor:
        own.append(f"bus bandwidth {figs['busbw_gbps']:.3g} GB/s below the floor {floor:g} GB/s")
    names_seen: dict[int, str] = {}
    for r in ln.ranks:
        for entry in r.names or []:
            if isinstance(entry, dict) and isinstance(entry.get("node_rank"), int):
                names_seen[entry["node_rank"]] = str(entry.get("node", ""))[:256]
    verified = len(results) == L
    for k in peers:
        comp = f"node/{rdv.name(k)}"
        details = {**base, "node_rank": k, "global_ranks": list(range(k * L, (k + 1) * L)), "completed": verified}
        if k in names_seen and names_seen[k] != rdv.name(k):
            details["name_in_collective"] = names_seen[k]
        if k in suspects:
            out.append((comp, Verdict(FAIL, suspects[k], figs, details)))
        elif k in errors:
            out.append((comp, Verdict(ERROR, f"node {rdv.name(k)} {errors[k]}", figs, {**details, "cause": "harness"})))
        elif verified:
            out.append((comp, Verdict(PASS, f"all-gather data from node {rdv.name(k)} verified over "
                                            f"{ln.iterations} iterations"
                                            + (f", {figs['busbw_gbps']:.3g} GB/s busbw" if figs else ""),
                                      figs, details)))
        elif suspects or own:
            out.append((comp, Verdict(PASS, "no fault attributed to this node; the exchange stopped early "
                                            "because of another node", figs, details)))
        elif own_errors or errors:
            out.append((comp, Verdict(SKIPPED, "not tested: the exchange could not run", figs, details)))
        else:
            out.append((comp, Verdict(ERROR, "the exchange did not complete and no node could be blamed",
                                      figs, details)))
    if own:
        out.append(("host", Verdict(FAIL, "; ".join(own), figs, base)))
    elif own_errors:
        # every rank failed in Python before joining: the harness; otherwise the ranks could not meet
        cause = "harness" if len(harness) == L else "rendezvous"
        out.append(("host", Verdict(ERROR, "; ".join(own_errors), figs, {**base, "cause": cause})))
    return out


if __name__ == "__main__":
    child_main(TEST, run_all_gather)
