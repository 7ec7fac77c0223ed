"""Diagnose a job across its machines: one call runs the hierarchy on every node and names the slow or
broken machine, or link.

    from robustd.fleet.diagnose import Target, diagnose
    d = diagnose([Target("gpu-1", "10.0.0.1"), Target("gpu-2", "10.0.0.2")], level="quick")
    d.outcome, [s.host for s in d.suspects], d.to_json()

Three phases, each a bounded set of ordinary `Diagnostics.Run` calls (disruptive calls: the daemons'
authorization applies), every one tagged with the diagnosis's run id (`RunRequest.run_id`, shown by
`robustctl diag list`):
1. local — the level's node-local tests (all but all_gather) on every host at once;
2. inter — one all_gather across every remaining host, on a rendezvous built here (master: the first
   host's address, a free port from `port`, a run id);
3. pairs — all_gather in pairs along a ring, at most three rounds whatever the number of hosts
   (robustd/fleet/rings.py), to tell a slow or broken machine from a bad link; a pair that measured slow
   in its round is re-tested alone before it is judged. Two hosts' one pair is the inter all-gather.
So a diagnosis costs one local round and at most 1 + 3 collectives, plus one per slow pair re-tested (at
most rings.MAX_RETESTS). Each phase has a deadline, a share of `timeout`; a run still going at its
deadline is cancelled (`Diagnostics.Cancel`) and judged by what the others saw. A KeyboardInterrupt (or
`cancel` set) cancels every run this call started.

The daemons are dialled as robustctl dials them (robustd/cli/remote.py), so this module sits with the
clients in tests/test_layout.py; what it decides is in the pure robustd/fleet/diagnosis.py and rings.py.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.cli import remote
from robustd.cli.client import EXIT_UNREACHABLE, Client, CliError
from robustd.fleet import rings
from robustd.fleet.diagnosis import (
    COLLECTIVE,
    PHASES,
    Diagnosis,
    HostRecord,
    PhaseProgress,
    PhaseRecord,
    Result,
    RunOutcome,
    Suspect,
    Target,
    judge_inter,
    judge_local,
    pair_result,
)

__all__ = ["Diagnosis", "PhaseProgress", "Target", "diagnose", "parse_target", "DEFAULT_PORT", "DEFAULT_TIMEOUT"]

DEFAULT_PORT = 29500  # torch's MASTER_PORT; the collectives take DEFAULT_PORT, +1, ... one each
DEFAULT_TIMEOUT = 1800.0  # the whole diagnosis
LOCAL_WEIGHT = 2  # the local phase's share of the time left, against 1 for each collective round
MARGIN = 10.0  # a run's own timeout ends this much (at most a fifth of its phase) before the phase's deadline
# Diagnostics.Cancel returns once the run's children are dead (the daemon kills their process group): it gets
# the unary deadline and this much more, and the run's stream as long again to end with the CANCELLED report.
# So a daemon that is stuck itself adds at most the unary deadline and twice this to a phase.
CANCEL_GRACE = 5.0
TICK = 1.0  # progress callbacks while a phase runs
MIN_BUDGET = 5.0  # a phase (or round) with less time left is not started: runs cut short would blame hosts
MAX_HOSTS = 4096  # the daemons' diagnostics.max_world_size default
STATUS = {pb.RESULT_PASS: "PASS", pb.RESULT_FAIL: "FAIL", pb.RESULT_SKIPPED: "SKIPPED", pb.RESULT_ERROR: "ERROR"}

Tls = tuple[str | None, str | None, str | None]
Progress = Callable[[PhaseProgress], None]


class _Cancelled(Exception):
    """The caller's cancel event was set: every run was cancelled."""


def parse_target(host: str, addr: str | None = None) -> Target:
    """A Target from a HOST as `fleet status` takes it; ADDR defaults to a TCP HOST's host part, and to
    127.0.0.1 for a Unix socket (a daemon on this machine, in this network namespace)."""
    remote.client_for(host, 1.0, (None, None, None))  # ValueError for what is no host
    if addr is None:
        if host.startswith(("unix:", "/")):
            addr = "127.0.0.1"
        elif host.startswith("["):
            addr = host[1:].split("]", 1)[0]
        else:
            addr = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if not addr or any(c.isspace() for c in addr) or len(addr) > 253:
        raise ValueError(f"{addr!r} is not an address the hosts can reach {host} at")
    return Target(host, addr)


def diagnose(targets: Sequence[Target], *, level: str | None = None, tests: Sequence[str] | None = None,
             port: int = DEFAULT_PORT, timeout: float = DEFAULT_TIMEOUT, slow_fraction: float = 0.5,
             pairs: bool = True, request_timeout: float = 5.0, tls: Tls = (None, None, None),
             progress: Progress | None = None, cancel: threading.Event | None = None,
             test_faults: Mapping[str, str] | None = None, run_id: str | None = None) -> Diagnosis:
    """Diagnose `targets` (at least one; each host once) and return the Diagnosis.

    `level` or `tests` choose the local phase's tests as `robustctl diag run` does (neither: the daemons'
    default); all_gather is never run locally. `timeout` bounds the whole call; `request_timeout` each
    unary request (GetVerdict, Cancel, List). `test_faults`: host → RunRequest.test_faults_json (tests
    only; a daemon refuses it unless diagnostics.test_faults is set). ValueError for arguments no
    diagnosis could use; KeyboardInterrupt cancels every run started, then propagates.
    """
    _check_arguments(targets, level, tests, port, timeout, slow_fraction)
    return _Diagnoser(targets, level=level, tests=tests, port=port, timeout=timeout, slow_fraction=slow_fraction,
                      pairs=pairs, request_timeout=request_timeout, tls=tls, progress=progress, cancel=cancel,
                      test_faults=dict(test_faults or {}), run_id=run_id or new_run_id()).run()


def new_run_id() -> str:
    return f"fleet-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def _check_arguments(targets: Sequence[Target], level: str | None, tests: Sequence[str] | None, port: int,
                     timeout: float, slow_fraction: float) -> None:
    if not targets:
        raise ValueError("no hosts: give HOST arguments or --hosts-file FILE")
    if len(targets) > MAX_HOSTS:
        raise ValueError(f"at most {MAX_HOSTS} hosts, not {len(targets)}")
    hosts = [t.host for t in targets]
    if dup := sorted({h for h in hosts if hosts.count(h) > 1}):
        raise ValueError(f"host {dup[0]} is given twice")
    if level and tests:
        raise ValueError("give a level or tests, not both")
    if port < 1 or port + len(targets) > 65535:
        raise ValueError(f"--port {port}: the collectives need ports {port} to {port + len(targets)}, "
                         "within 1-65535")
    if not timeout > 0:
        raise ValueError("--timeout must be more than zero")
    if not 0 < slow_fraction <= 1:
        raise ValueError(f"--slow-fraction {slow_fraction:g} must be more than 0 and at most 1")


class _Run:
    """One Diagnostics.Run stream on one host, read on its own thread until its report or an error."""

    def __init__(self, client: Client, request: pb.RunRequest, backstop: float, on_id: Callable[[str], None]):
        self.client = client
        self.request = request
        self.backstop = backstop  # the stream's gRPC deadline, should every other bound fail
        self.on_id = on_id
        self.id = ""
        self.report: pb.DiagnosticReport | None = None
        self.error: CliError | None = None
        self.hung = False  # cancelled at the phase's deadline
        self.stopped = False  # cancelled by the caller
        self.done = threading.Event()
        self._call: Any = None
        self._ended = False  # end_stream was asked before the call existed
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="fleet-diagnose-run", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _read(self) -> None:
        channel: grpc.Channel | None = None
        try:
            channel = self.client.open()
            with self._lock:
                self._call = pb_grpc.DiagnosticsStub(channel).Run(self.request, timeout=self.backstop)
                if self._ended:
                    self._call.cancel()
            for msg in self._call:
                if msg.id and not self.id:
                    self.id = msg.id
                    self.on_id(msg.id)
                if msg.phase == pb.DiagnosticProgress.PHASE_DONE and msg.HasField("report"):
                    self.report = msg.report
        except grpc.RpcError as err:
            if not (err.code() == grpc.StatusCode.CANCELLED and (self.hung or self.stopped)):
                self.error = self.client.error(err, channel)
        except CliError as err:
            self.error = err
        except Exception as err:  # noqa: BLE001 - one host's odd failure is its outcome, not the diagnosis's
            self.error = CliError(4, f"{type(err).__name__}: {err}")
        finally:
            if channel is not None:
                channel.close()
            self.done.set()

    def cancel(self, request_timeout: float, tag: str) -> None:
        """Diagnostics.Cancel on the daemon (the run's children are killed); its stream then ends with the
        CANCELLED report. Before the first message the id is not known yet: the tag finds it."""
        ids = [self.id] if self.id else []
        if not ids:
            try:
                listed = self.client.call("List", pb.ListDiagnosticsRequest(limit=20), "Diagnostics",
                                          timeout=request_timeout)
                ids = [r.id for r in listed.reports if r.run_id == tag and r.outcome == pb.OUTCOME_RUNNING]
            except CliError:
                pass
        for run_id in ids:
            with contextlib.suppress(CliError):
                self.client.call("Cancel", pb.CancelDiagnosticRequest(id=run_id), "Diagnostics",
                                 timeout=request_timeout + CANCEL_GRACE)
        if not self.done.wait(CANCEL_GRACE if ids else 1.0):
            self.end_stream()

    def end_stream(self) -> None:
        with self._lock:
            self._ended = True
            if self._call is not None:
                self._call.cancel()

    def outcome(self) -> RunOutcome:
        if self.stopped and self.report is None:
            return RunOutcome("cancelled", self.id, message="cancelled")
        if self.hung:
            return RunOutcome("hung", self.id, "CANCELLED", "did not finish by the phase's deadline (cancelled)",
                              _results(self.report) if self.report is not None else ())
        if self.report is not None:
            r = self.report
            return RunOutcome("done", r.id or self.id, pb.Outcome.Name(r.outcome).removeprefix("OUTCOME_"),
                              r.message, _results(r))
        err = self.error
        if err is None:
            return RunOutcome("unreachable", self.id, message="the run's stream ended without a report")
        return RunOutcome("unreachable" if err.code == EXIT_UNREACHABLE else "refused", self.id, message=str(err))


def _results(r: pb.DiagnosticReport) -> tuple[Result, ...]:
    out = []
    for x in r.results:
        rank = x.details.get("node_rank", "")
        out.append(Result(test=x.test, component=x.component, status=STATUS.get(x.status, "ERROR"),
                          message=x.message, busbw_gbps=x.figures.get("busbw_gbps"),
                          peer_rank=int(rank) if x.component.startswith("node/") and rank.isdigit() else None,
                          cause=x.details.get("cause", "")))
    return tuple(out)


class _Diagnoser:
    def __init__(self, targets: Sequence[Target], *, level: str | None, tests: Sequence[str] | None, port: int,
                 timeout: float, slow_fraction: float, pairs: bool, request_timeout: float, tls: Tls,
                 progress: Progress | None, cancel: threading.Event | None, test_faults: dict[str, str],
                 run_id: str):
        self.targets = list(targets)
        self.level = level or ""
        self.tests = list(tests or [])
        self.port = port
        self.slow_fraction = slow_fraction
        self.with_pairs = pairs
        self.request_timeout = request_timeout
        self.tls = tls
        self.progress = progress
        self.cancel_event = cancel
        self.test_faults = test_faults
        self.run_id = run_id
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.clients = [remote.client_for(t.host, request_timeout, tls) for t in self.targets]
        self.rows = [HostRecord(t.host, t.addr) for t in self.targets]
        self.phases = {name: PhaseRecord(name) for name in PHASES}
        self.d = Diagnosis(run_id, self.rows, list(self.phases.values()))
        self.suspects: dict[int, Suspect] = {}  # host index → why (host or unreachable)
        self.links: list[Suspect] = []
        self.cancelling: list[threading.Thread] = []  # Diagnostics.Cancel of runs past their deadline, in flight
        self.next_port = port
        self._port = port  # the current collective's
        self.inter_errors: list[str] = []  # why the all-gather across every host told nothing, host by host
        self.inter_runs: dict[int, RunOutcome] | None = None  # host index → its run in it, in rank order

    # -- the whole diagnosis ---------------------------------------------------------------------
    def run(self) -> Diagnosis:
        try:
            remaining = self._probe()
            remaining = self._local(remaining)
            inter_blamed, remaining = self._inter(remaining)
            pair_named = self._pairs(remaining) if self.with_pairs else set()
            for i, why in inter_blamed.items():  # what pairs did not explain (or no pairs ran)
                if i not in pair_named and i not in self.suspects:
                    self.suspects[i] = why
            named = any(s.kind == "host" for s in self.suspects.values()) or self.links
            if self.phases["inter"].outcome not in ("PASS", "SKIPPED") and not named:
                self._gap(None, "the all-gather across every host did not pass, and no host or link could be "
                                "named" + (": " + "; ".join(self.inter_errors) if self.inter_errors else ""))
        except _Cancelled:
            self.d.cancelled = True
            self.d.notes.append("cancelled: every run this diagnosis started was cancelled")
        finally:
            self._join_cancels()
        self.d.suspects = self._ordered_suspects()
        self.d.seconds = time.monotonic() - self.started
        return self.d

    def _join_cancels(self) -> None:
        """Every run this call started is cancelled or over before it returns: wait for the Cancels in flight
        (each bounded by its own deadlines; they run at once)."""
        until = time.monotonic() + 2 * self.request_timeout + 3 * CANCEL_GRACE
        for t in self.cancelling:
            t.join(max(0.0, until - time.monotonic()))

    def _ordered_suspects(self) -> list[Suspect]:
        kinds = {"host": 0, "link": 1, "unreachable": 2}
        named = [s for _i, s in sorted(self.suspects.items())] + self.links
        return sorted(named, key=lambda s: kinds[s.kind])  # stable: hosts in their order within a kind

    def _gap(self, i: int | None, note: str) -> None:
        """Something that could not be diagnosed (not an unreachable host): the outcome cannot be PASS."""
        self.d.gaps = True
        if i is None:
            self.d.notes.append(note)
        elif note not in self.rows[i].notes:
            self.rows[i].notes.append(note)

    def _probe(self) -> list[int]:
        """Who answers (GetVerdict, under request_timeout); the unreachable are listed and left out."""
        outcomes = remote.fan_out([t.host for t in self.targets], _verdict,
                                  self.request_timeout, self.tls)
        alive = []
        for i, o in enumerate(outcomes):
            if o.value is not None:
                self.rows[i].node = o.value.node
                alive.append(i)
            elif o.unreachable:
                self._unreachable(i, o.error)
            else:
                self.rows[i].local = "ERROR"
                self._gap(i, f"the daemon answered GetVerdict with an error: {o.error}")
        return alive

    def _unreachable(self, i: int, why: str) -> None:
        self.suspects[i] = Suspect(self.targets[i].host, "unreachable", why)
        for col in ("local", "inter", "pairs"):
            if getattr(self.rows[i], col) == "SKIPPED":
                setattr(self.rows[i], col, "UNREACHABLE")

    def _weights_left(self, hosts: int, local: bool) -> int:
        # the inter all-gather, each round of pairs, and one share for the re-tests of slow pairs
        pairs = len(rings.ring_rounds(hosts)) + 1 if self.with_pairs and hosts >= 3 else 0  # two: inter is the pair
        collectives = 1 + pairs if hosts >= 2 else 0
        return (LOCAL_WEIGHT if local else 0) + collectives

    def _budget(self, weight: int, weights_left: int) -> float:
        return max(0.0, self.deadline - time.monotonic()) * weight / max(1, weights_left)

    # -- phase 1 ---------------------------------------------------------------------------------
    def _local(self, hosts: list[int]) -> list[int]:
        tests = [t for t in self.tests if t != COLLECTIVE]
        if not hosts or (self.tests and not tests):
            return hosts  # nothing to run locally (only all_gather was asked for)
        budget = self._budget(LOCAL_WEIGHT, self._weights_left(len(hosts), True))
        reqs = {i: pb.RunRequest(tests=tests, level=self.level) for i in hosts}
        outcomes = self._phase("local", reqs, budget)
        remaining = []
        for i in hosts:
            v = judge_local(outcomes[i])
            self.rows[i].local = v.column
            if v.column == "UNREACHABLE":
                self._unreachable(i, v.reason)
            elif v.suspect:
                self.suspects[i] = Suspect(self.targets[i].host, "host", v.reason)
            elif v.reason:
                self._gap(i, v.reason)
            if not v.excluded:
                remaining.append(i)
        self._finish_phase("local", [self.rows[i].local for i in hosts])
        return remaining

    # -- phase 2 ---------------------------------------------------------------------------------
    def _inter(self, hosts: list[int]) -> tuple[dict[int, Suspect], list[int]]:
        """The all-gather across `hosts`: whom it blames, and the hosts left for the pairs (not those whose
        daemon refused the run or went away)."""
        if len(hosts) < 2:
            if hosts and len(self.targets) > 1:
                self._gap(None, "fewer than two hosts remained for the collectives")
            return {}, hosts
        budget = self._budget(1, self._weights_left(len(hosts), False))
        reqs = {i: self._collective(hosts, rank, "inter") for rank, i in enumerate(hosts)}
        outcomes = self._phase("inter", reqs, budget)
        self.inter_runs = {i: outcomes[i] for i in hosts}
        runs = [outcomes[i] for i in hosts]
        j = judge_inter(runs)
        blamed = {}
        for rank, i in enumerate(hosts):
            self.rows[i].inter = j.columns[rank]
            if rank in j.busbw_gbps:
                self.rows[i].busbw_gbps = j.busbw_gbps[rank]
            if rank in j.blamed:
                blamed[i] = Suspect(self.targets[i].host, "host", j.blamed[rank],
                                    tuple(self.targets[hosts[w]].host for w in j.witnesses[rank]))
            if runs[rank].state == "unreachable":
                self._unreachable(i, runs[rank].message)
        self._finish_phase("inter", [j.outcome])
        self.inter_errors = [f"{self.targets[hosts[r]].host}: {why}" for r, why in sorted(j.errors.items())]
        for rank, i in enumerate(hosts):
            if runs[rank].state == "refused":
                self._gap(i, f"the daemon refused the all-gather: {runs[rank].message}")
        return blamed, [i for rank, i in enumerate(hosts) if runs[rank].state not in ("refused", "unreachable")]

    def _collective(self, hosts: list[int], rank: int, what: str) -> pb.RunRequest:
        """An all_gather request for host `hosts[rank]`; the port is taken once per collective (rank 0)."""
        if rank == 0:
            self._port = self._free_port(self.targets[hosts[0]].addr)
        rv = pb.Rendezvous(master_addr=self.targets[hosts[0]].addr, master_port=self._port, world_size=len(hosts),
                           node_rank=rank, run_id=f"{self.run_id}/{what}")
        return pb.RunRequest(tests=[COLLECTIVE], rendezvous=rv)

    def _free_port(self, addr: str) -> int:
        """The next port from --port; on this machine's loopback, one nothing listens on (tests, a laptop)."""
        port = self.next_port
        if _loopback(addr):
            for _ in range(100):
                if port >= 65535 or _bindable(addr, port):
                    break
                port += 1
        self.next_port = port + 1
        return port

    # -- phase 3 ---------------------------------------------------------------------------------
    def _pairs(self, hosts: list[int]) -> set[int]:
        """The ring's pairs; returns the hosts the pairs named (as a host or an end of a link)."""
        if len(hosts) < 2:
            return set()
        rounds = rings.ring_rounds(len(hosts))
        results: list[rings.PairResult] = []
        start = time.monotonic()
        if self.inter_runs is not None and list(self.inter_runs) == hosts and len(hosts) == 2:
            # Two hosts: the all-gather across both was their one pair; running it again would tell nothing new.
            rounds = []
            a, b = hosts
            results.append(pair_result((0, 1), (self.inter_runs[a], self.inter_runs[b]),
                                       {0: self.targets[a].host, 1: self.targets[b].host}))
        self._tell(PhaseProgress("pairs", "started", 0.0, rounds=len(rounds)))
        reserve = 1 if len(hosts) >= 3 else 0  # a share of the phase stays for re-testing slow pairs
        for n, round_pairs in enumerate(rounds, 1):
            results += self._pair_round(hosts, round_pairs, self._budget(1, len(rounds) - n + 1 + reserve),
                                        (n, len(rounds)), start, f"pairs-{n}")
        # A pair slow in its round is re-tested alone, one at a time: the pairs of a round share the switch
        # (and here the CPUs); a slow machine or link stays slow alone (rings.py).
        retest = rings.slow_pairs(len(hosts), results, self.slow_fraction)
        total = len(rounds) + len(retest)
        alone: dict[rings.Pair, rings.PairResult] = {}
        for k, pair in enumerate(retest):
            again = self._pair_round(hosts, [pair], self._budget(1, len(retest) - k),
                                     (len(rounds) + k + 1, total), start, f"alone-{k}")
            alone[pair] = again[0]
        names = {p: self.targets[i].host for p, i in enumerate(hosts)}
        j = rings.judge_pairs(len(hosts), results, self.slow_fraction, names, alone)
        by_pos: dict[int, list[rings.Pair]] = {}
        for r in results:
            for p in r.pair:
                by_pos.setdefault(p, []).append(r.pair)
        measured = j.busbw_gbps
        for p, mine in by_pos.items():
            verdicts = {j.verdicts[q] for q in mine}
            row = self.rows[hosts[p]]
            figures = [measured[q] for q in mine if q in measured]
            row.busbw_gbps = min(figures) if figures else None  # its lowest pair: a slow one stands out
            row.pairs = "FAIL" if "FAIL" in verdicts else "PASS" if verdicts == {"PASS"} else "ERROR"
            for q in mine:
                if j.verdicts[q] == "ERROR":
                    self._gap(hosts[p], f"pair with {names[q[1] if q[0] == p else q[0]]} not tested: {j.reasons[q]}")
        named: set[int] = set()
        for s in j.suspects:
            named.update(hosts[p] for p in s.hosts)
            if s.kind == "host":
                i = hosts[s.hosts[0]]
                if i not in self.suspects:
                    self.suspects[i] = Suspect(self.targets[i].host, "host", s.reason,
                                               tuple(names[p] for p in s.peers))
            else:
                a, b = (hosts[p] for p in s.hosts)
                if a not in self.suspects and b not in self.suspects:
                    self.links.append(Suspect(self.targets[a].host, "link", s.reason, (self.targets[b].host,)))
        if j.inconclusive:
            self._gap(None, j.inconclusive)
        outcome = "PASS" if set(j.verdicts.values()) == {"PASS"} else "FAIL" if "FAIL" in j.verdicts.values() \
            else "ERROR"
        self.phases["pairs"].seconds = time.monotonic() - start
        self.phases["pairs"].outcome = outcome
        self._tell(PhaseProgress("pairs", "finished", self.phases["pairs"].seconds, rounds=len(rounds),
                                 round=len(rounds), outcome=outcome))
        return named

    def _pair_round(self, hosts: list[int], pairs: Sequence[rings.Pair], budget: float, rnd: tuple[int, int],
                    since: float, tag: str) -> list[rings.PairResult]:
        """The all-gathers of `pairs` (positions in `hosts`) at once, under one deadline; what each showed."""
        reqs: dict[int, pb.RunRequest] = {}
        for k, (a, b) in enumerate(pairs):
            for rank, pos in enumerate((a, b)):
                reqs[hosts[pos]] = self._collective([hosts[a], hosts[b]], rank, f"{tag}-{k}")
        outcomes = self._phase("pairs", reqs, budget, rnd, since)
        out = []
        for a, b in pairs:
            out.append(pair_result((a, b), (outcomes[hosts[a]], outcomes[hosts[b]]),
                                   {p: self.targets[hosts[p]].host for p in (a, b)}))
            for pos in (a, b):
                if outcomes[hosts[pos]].state == "unreachable":
                    self._unreachable(hosts[pos], outcomes[hosts[pos]].message)
        return out

    # -- running a set of runs under one deadline ------------------------------------------------
    def _phase(self, name: str, reqs: dict[int, pb.RunRequest], budget: float,
               rnd: tuple[int, int] | None = None, since: float | None = None) -> dict[int, RunOutcome]:
        """Start `reqs` (host index → request) at once; wait until all end or the deadline passes, then cancel
        what is left and wait for its CANCELLED report (bounded). Every report id goes into its host's row."""
        start = time.monotonic()
        since = start if since is None else since
        if budget < MIN_BUDGET:
            self._gap(None, f"{name}: not run, {budget:.1f} s of --timeout left")
            return {i: RunOutcome("refused", message="not run: --timeout spent") for i in reqs}
        # Within the phase's share: the wait for the runs, then (for a run still going) CANCEL_GRACE for its
        # CANCELLED report; each run's own timeout ends a margin before the wait, so that its report comes first.
        grace = min(CANCEL_GRACE, budget / 4)
        deadline = start + budget - grace
        own = max(1.0, deadline - start - min(MARGIN, budget / 5))
        runs: dict[int, _Run] = {}
        for i, req in reqs.items():
            req.run_id = self.run_id
            req.timeout.FromNanoseconds(int(own * 1e9))
            if self.targets[i].host in self.test_faults:
                req.test_faults_json = self.test_faults[self.targets[i].host]
            runs[i] = _Run(self.clients[i], req, budget + 2 * CANCEL_GRACE + self.request_timeout,
                           lambda rid, row=self.rows[i]: row.reports.append(rid))
        rnd_no, rounds = rnd or (0, 0)
        if rnd is None:
            self._tell(PhaseProgress(name, "started", 0.0, total=len(runs)))
        try:
            for r in runs.values():
                r.start()
            next_tick = time.monotonic() + TICK
            while not all(r.done.is_set() for r in runs.values()):
                now = time.monotonic()
                if now >= deadline:
                    self._cancel_late([r for r in runs.values() if not r.done.is_set()], grace)
                    break
                if self.cancel_event is not None and self.cancel_event.is_set():
                    raise _Cancelled
                next(iter(r for r in runs.values() if not r.done.is_set())).done.wait(
                    min(0.2, max(0.0, deadline - now)))
                if time.monotonic() >= next_tick:
                    next_tick += TICK
                    self._tell(PhaseProgress(name, "running", time.monotonic() - since,
                                             sum(r.done.is_set() for r in runs.values()), len(runs), rnd_no, rounds))
        except BaseException:  # Ctrl-C, the caller's cancel: nothing this call started keeps running
            for r in runs.values():
                r.stopped = True
            self._cancel_all([r for r in runs.values() if not r.done.is_set()])
            self.phases[name].outcome = "CANCELLED"
            self.phases[name].seconds = time.monotonic() - since
            raise
        for i, r in runs.items():
            if r.report is not None and r.report.id and r.report.id not in self.rows[i].reports:
                self.rows[i].reports.append(r.report.id)
        if rnd is None:
            self.phases[name].seconds = time.monotonic() - start
        return {i: r.outcome() for i, r in runs.items()}

    def _cancel_late(self, late: list[_Run], grace: float) -> None:
        """Runs past the phase's deadline: Diagnostics.Cancel each (on threads: a stuck daemon must not eat the
        next phase's time), wait `grace` for their CANCELLED reports, then stop reading the rest."""
        for r in late:
            r.hung = True
            t = threading.Thread(target=r.cancel, args=(self.request_timeout, self.run_id), daemon=True,
                                 name="fleet-diagnose-cancel")
            t.start()
            self.cancelling.append(t)
        until = time.monotonic() + grace
        for r in late:
            if not r.done.wait(max(0.0, until - time.monotonic())):
                r.end_stream()

    def _cancel_all(self, runs: list[_Run]) -> None:
        if not runs:
            return
        with ThreadPoolExecutor(max_workers=min(remote.MAX_PARALLEL, len(runs))) as pool:
            list(pool.map(lambda r: r.cancel(self.request_timeout, self.run_id), runs))

    def _finish_phase(self, name: str, columns: list[str]) -> None:
        cols = set(columns)
        outcome = ("PASS" if cols <= {"PASS", "SKIPPED"} and "PASS" in cols else
                   "FAIL" if cols & {"FAIL", "HUNG"} else "SKIPPED" if cols <= {"SKIPPED"} else "ERROR")
        self.phases[name].outcome = outcome
        self._tell(PhaseProgress(name, "finished", self.phases[name].seconds, outcome=outcome))

    def _tell(self, p: PhaseProgress) -> None:
        if self.progress is not None:
            self.progress(p)


def _verdict(client: Client) -> pb.Verdict:
    return client.call("GetVerdict", pb.GetVerdictRequest())


def _loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _bindable(addr: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for TCPStore too
        try:
            s.bind(("127.0.0.1" if addr == "localhost" else addr, port))
            return True
        except OSError:
            return False

