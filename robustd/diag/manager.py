"""Stop-time diagnostics: one run at a time, tests in order, a report that survives restarts.

A run executes its tests as child processes (robustd/diag/child.py), streams progress to
whoever asked, keeps the report in the event log's database, and turns failures into
conditions (DIAG_<TEST>_FAILED) so Watch clients see them like any other fault.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from robustd.api import convert
from robustd.api.requests import Invalid, duration
from robustd.api.v1 import robustd_pb2 as pb
from robustd.codes import CodeRule
from robustd.config import DIAG_TESTS, DiagnosticsConfig
from robustd.diag.child import Child, run_child
from robustd.engine import Engine
from robustd.model import Action, Finding, FindingKind, Report, Severity

log = logging.getLogger("robustd.diag")
SOURCE = "diagnostics"
# Wildcard keys, so a test's own hint (DCGM's ISOLATE vs RESET severity of an EUD error) wins.
CODES: dict[str, CodeRule] = {
    f"DIAG_{t.upper()}_*": CodeRule(severity="CRITICAL", action="HW_INSPECT", clear_after="7d",
                                    description=f"the {t} stop-time test named this component")
    for t in DIAG_TESTS
}
# A peer named by this node's all-gather is the peer's fault, not this node's: keep training, look.
CODES["DIAG_ALL_GATHER_*"] = CodeRule(severity="WARNING", action="HW_INSPECT", clear_after="7d",
                                           description="a peer node's all-gather data was wrong, late or missing")


# Bounds on a RunRequest (design rule 7): every field from outside has a size or a range.
MAX_RUN_TIMEOUT = 7 * 86400.0
MAX_NAME = 64  # a level or test name
MAX_TESTS = 16
MAX_GPUS = 1024
MAX_BUS_ID = 64
MAX_FAULTS_JSON = 64 << 10
MAX_ADDR = 253  # the longest DNS name
ADDR = re.compile(r"[A-Za-z0-9._:%-]+")  # a host name, an IPv4 or an IPv6 address (with a %zone)
RUN_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{0,128}")  # the scheduler's job or step id


class Busy(Exception):
    """Another diagnostic is running (→ ABORTED)."""


class Refused(Exception):
    """GPU compute processes are alive and the request did not force (→ FAILED_PRECONDITION)."""


class BadRequest(Exception):
    """An invalid RunRequest (→ INVALID_ARGUMENT)."""


@dataclass
class GpuView:
    """What the diagnostics need from the GPU check: the GPUs, the driver, who is using them."""

    gpus: list[dict[str, Any]] = field(default_factory=list)  # index, bus_id, uuid, name
    driver: str = ""
    busy_pids: frozenset[int] = frozenset()
    emulated: bool = False


@dataclass
class Run:
    id: str
    tests: list[str]
    request: pb.RunRequest
    report: pb.DiagnosticReport
    stop_on_failure: bool
    deadline: float
    subscribers: list[asyncio.Queue[pb.DiagnosticProgress | None]] = field(default_factory=list)
    child: Child | None = None
    cancelled: bool = False
    task: asyncio.Task[None] | None = None


class DiagManager:
    def __init__(self, engine: Engine, config: Callable[[], DiagnosticsConfig], node: str, state_dir: str,
                 gpu_view: Callable[[], GpuView], cpu_model: str = ""):
        self.engine = engine
        self.store = engine.store
        self.config = config
        self.node = node
        # state_dir is absolute (config AbsPath): children get file paths (FileStore) from it.
        self.work_root = os.path.join(state_dir, "diag")
        self.gpu_view = gpu_view
        self.cpu_model = cpu_model or "unknown CPU"
        self.running: Run | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def recover(self) -> None:
        """Reports left RUNNING by a daemon that died mid-run are closed as errors."""
        for blob in self.store.reports(1000, outcome=pb.OUTCOME_RUNNING):
            r = pb.DiagnosticReport.FromString(blob)
            r.outcome, r.message = pb.OUTCOME_ERROR, "the daemon stopped during this run"
            self._save(r)

    # -- requests ------------------------------------------------------------------------------
    def start(self, req: pb.RunRequest) -> Run:
        cfg = self.config()
        asked = validate(req, cfg)
        if self.running is not None:
            raise Busy(f"diagnostic {self.running.id} is running; one at a time per node")
        if req.tests and req.level:
            raise BadRequest("give tests or level, not both")
        if req.level:
            if req.level not in cfg.levels:
                raise BadRequest(f"unknown level {req.level!r} (known: {', '.join(sorted(cfg.levels))})")
            tests = list(cfg.levels[req.level])
        else:
            tests = list(req.tests) or list(cfg.levels.get("standard", ["all_to_all", "minigpt"]))
        bad = [t for t in tests if t not in DIAG_TESTS]
        if bad:
            raise BadRequest(f"unknown tests {bad} (known: {', '.join(DIAG_TESTS)})")
        view = self.gpu_view()
        known = {g["bus_id"] for g in view.gpus}
        if unknown := [b for b in req.gpus if b not in known]:
            more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
            raise BadRequest(f"unknown GPUs {unknown[:4]}{more} (this node has: {', '.join(sorted(known)) or 'none'})")
        if view.busy_pids and not req.force:
            pids = ", ".join(str(p) for p in sorted(view.busy_pids))
            raise Refused(f"GPU compute processes are alive (pids {pids}); stop the job or set force")
        if req.test_faults_json:
            if not cfg.test_faults:
                raise BadRequest("test_faults_json is for tests: this daemon does not accept fault injection "
                                 "(diagnostics.test_faults is false)")
            try:
                if not isinstance(json.loads(req.test_faults_json), dict):
                    raise ValueError("not an object")
            except ValueError as e:
                raise BadRequest(f"test_faults_json: {e}") from e
        timeout = cfg.timeout if asked is None else asked
        now = time.time()
        run_id = f"diag-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{uuid.uuid4().hex[:6]}"
        report = pb.DiagnosticReport(id=run_id, outcome=pb.OUTCOME_RUNNING, node=self.node, tests=tests,
                                     started=convert.ts(now))
        run = Run(id=run_id, tests=tests, request=req, report=report,
                  stop_on_failure=req.stop_on_failure if req.HasField("stop_on_failure") else True,
                  deadline=time.monotonic() + timeout)
        self._save(report)
        self.running = run
        run.task = asyncio.get_running_loop().create_task(self._execute(run, view), name=f"diag-{run_id}")
        log.info("diagnostic %s started: %s", run_id, ", ".join(tests))
        return run

    def subscribe(self, run: Run) -> asyncio.Queue[pb.DiagnosticProgress | None]:
        q: asyncio.Queue[pb.DiagnosticProgress | None] = asyncio.Queue()
        run.subscribers.append(q)
        return q

    async def cancel(self, run_id: str) -> pb.DiagnosticReport | None:
        run = self.running
        if run is None or run.id != run_id:
            return self.get(run_id)
        run.cancelled = True
        if run.child is not None:
            run.child.kill("cancelled")
        if run.task is not None:
            await asyncio.shield(run.task)
        return self.get(run_id)

    def get(self, run_id: str) -> pb.DiagnosticReport | None:
        if self.running is not None and self.running.id == run_id:
            return self.running.report
        blob = self.store.report(run_id)
        return None if blob is None else pb.DiagnosticReport.FromString(blob)

    def list(self, limit: int) -> list[pb.DiagnosticReport]:
        return [pb.DiagnosticReport.FromString(b) for b in self.store.reports(limit)]

    def record_golden(self, report_id: str) -> pb.Golden:
        if report_id:
            report = self.get(report_id)
        else:
            report = next((r for r in self.list(200) if self._minigpt_host(r) and r.outcome == pb.OUTCOME_PASS), None)
        host = self._minigpt_host(report) if report is not None else None
        if report is None or host is None or report.outcome != pb.OUTCOME_PASS:
            raise BadRequest("no passing MiniGPT report" + (f" with id {report_id}" if report_id else ""))
        key, digest = host.details["golden_key"], host.details["node_digest"]
        now = time.time()
        self.store.set_golden(key, digest, report.id, now)
        return pb.Golden(key=key, digest=digest, report_id=report.id, recorded_at=convert.ts(now))

    def goldens(self) -> list[pb.Golden]:
        return [pb.Golden(key=k, digest=d, report_id=r, recorded_at=convert.ts(at)) for k, d, r, at in
                self.store.goldens()]

    # -- the run -------------------------------------------------------------------------------
    async def _execute(self, run: Run, view: GpuView) -> None:
        cfg = self.config()
        failed = False
        try:
            for i, test in enumerate(run.tests):
                if run.cancelled or time.monotonic() >= run.deadline or (failed and run.stop_on_failure):
                    why = ("cancelled" if run.cancelled else "the run's timeout passed" if
                           time.monotonic() >= run.deadline else "an earlier test failed (stop_on_failure)")
                    results = [pb.TestResult(test=test, component="host", status=pb.RESULT_SKIPPED, message=why)]
                else:
                    self._publish(run, pb.DiagnosticProgress(id=run.id, test=test, percent=100.0 * i / len(run.tests),
                                                             phase=pb.DiagnosticProgress.PHASE_STARTED,
                                                             message=f"{test} started"))
                    results = await self._run_test(run, test, i, view, cfg)
                run.report.results.extend(results)
                # Only hardware evidence stops the run: a test that could not run (ERROR) says nothing about
                # the node, and the next one may (no dcgmi on this host: all_to_all still runs).
                failed = failed or any(r.status == pb.RESULT_FAIL for r in results)
                self._publish(run, pb.DiagnosticProgress(id=run.id, test=test, percent=100.0 * (i + 1) / len(run.tests),
                                                         phase=pb.DiagnosticProgress.PHASE_FINISHED, results=results))
        except Exception as e:  # noqa: BLE001 - a broken run is an ERROR report, never a dead daemon
            log.exception("diagnostic %s failed", run.id)
            run.report.results.append(pb.TestResult(test="", component="host", status=pb.RESULT_ERROR,
                                                    message=f"internal error: {e}"))
        finally:
            self._finish(run)
            shutil.rmtree(os.path.join(self.work_root, run.id), ignore_errors=True)
            self.running = None

    async def _run_test(self, run: Run, test: str, i: int, view: GpuView, cfg: DiagnosticsConfig
                        ) -> list[pb.TestResult]:
        if test == "all_gather" and not run.request.HasField("rendezvous"):
            return [pb.TestResult(test=test, component="host", status=pb.RESULT_SKIPPED,
                                  message="all_gather needs a rendezvous (master_addr, master_port, world_size, "
                                          "node_rank) from the scheduler")]
        work = os.path.join(self.work_root, run.id, test)
        os.makedirs(work, exist_ok=True)
        spec = self._spec(run, test, work, view, cfg)
        run.child = Child(test=test)

        def progress(percent: float, message: str) -> None:
            overall = 100.0 * (i + max(0.0, min(percent, 100.0)) / 100.0) / len(run.tests)
            self._publish(run, pb.DiagnosticProgress(id=run.id, test=test, percent=overall, message=message,
                                                     phase=pb.DiagnosticProgress.PHASE_PROGRESS))

        try:
            results = await run_child(run.child, cfg.python or sys.executable, spec,
                                      os.path.join(work, "spec.json"), progress)
        finally:
            run.child = None
        if test == "minigpt":
            results = self._check_golden(results, view)
        return results

    def _spec(self, run: Run, test: str, work: str, view: GpuView, cfg: DiagnosticsConfig) -> dict[str, Any]:
        gpus = [g for g in view.gpus if not run.request.gpus or g["bus_id"] in run.request.gpus]
        if view.emulated:
            gpus = []  # emulated GPUs are no CUDA devices: run CPU ranks
        backend = cfg.collectives.backend
        if backend == "auto":
            backend = "nccl" if gpus else "gloo"
        timeouts = {"eud": cfg.eud.timeout, "minigpt": cfg.minigpt.timeout}
        timeout = min(timeouts.get(test, cfg.collectives.timeout), max(1.0, run.deadline - time.monotonic()))
        spec: dict[str, Any] = {
            "test": test, "run_id": run.id, "node": self.node, "work_dir": work, "timeout": timeout,
            "gpus": gpus, "backend": backend, "cpu_ranks": cfg.collectives.cpu_ranks,
            "min_busbw_gbps": cfg.collectives.min_busbw_gbps, "steps": cfg.minigpt.steps, "golden": None,
            "eud": {"command": list(cfg.eud.command)}, "faults": {},
        }
        if run.request.HasField("rendezvous"):
            rv = run.request.rendezvous
            spec["rendezvous"] = {"master_addr": rv.master_addr, "master_port": rv.master_port,
                                  "world_size": rv.world_size, "node_rank": rv.node_rank, "run_id": rv.run_id}
        if run.request.test_faults_json:  # start() refused it unless diagnostics.test_faults is set
            spec["faults"] = json.loads(run.request.test_faults_json).get(test, {})
        return spec

    def _check_golden(self, results: list[pb.TestResult], view: GpuView) -> list[pb.TestResult]:
        host = next((r for r in results if r.component == "host" and "node_digest" in r.details), None)
        if host is None:
            return results
        d = host.details
        device = d.get("device", "cpu")
        if device == "cpu":  # CPU kernels differ by instruction set: a CPU digest holds for one CPU model
            device = f"cpu {self.cpu_model}"
        key = (f"{device}|{view.driver or 'no driver'}|torch {d.get('torch_version', '?')}"
               f"|{d.get('model', '?')}|{d.get('steps', '?')} steps")
        host.details["golden_key"] = key
        golden = dict((k, d) for k, d, _r, _at in self.store.goldens()).get(key)
        if golden is not None:
            host.details["golden"] = golden
            if golden != host.details["node_digest"]:
                host.status = pb.RESULT_FAIL
                host.message = f"node digest differs from the golden digest recorded for {key}"
        return results

    def _finish(self, run: Run) -> None:
        r = run.report
        r.finished.CopyFrom(convert.ts(time.time()))
        fails = [x for x in r.results if x.status == pb.RESULT_FAIL]
        if run.cancelled:
            r.outcome, r.message = pb.OUTCOME_CANCELLED, "cancelled; its child processes were killed"
        elif fails:
            r.outcome = pb.OUTCOME_FAIL
        elif any(x.status == pb.RESULT_ERROR for x in r.results):
            r.outcome = pb.OUTCOME_ERROR
        elif not any(x.status == pb.RESULT_PASS for x in r.results):
            r.outcome, r.message = pb.OUTCOME_ERROR, "nothing was tested: " + "; ".join(
                f"{x.test}: {x.message}" for x in r.results)  # all skipped is no evidence of health
        else:
            r.outcome = pb.OUTCOME_PASS
        findings, worst = self._conditions(run, fails)
        if r.outcome == pb.OUTCOME_FAIL:
            r.severity, r.action = int(worst[0]), int(worst[1])
            r.suspects.extend(sorted({x.component for x in fails}))
        else:
            r.severity, r.action = int(Severity.OK), int(Action.NONE)
            if r.outcome == pb.OUTCOME_PASS:
                r.message = "no fault found: restart the job"
        self._save(r)
        if findings:
            self.engine.submit(Report(SOURCE, tuple(findings)))
        self._publish(run, pb.DiagnosticProgress(id=run.id, phase=pb.DiagnosticProgress.PHASE_DONE, percent=100.0,
                                                 report=r, message=pb.Outcome.Name(r.outcome)))
        for q in run.subscribers:
            q.put_nowait(None)
        log.info("diagnostic %s: %s %s", run.id, pb.Outcome.Name(r.outcome), r.message)

    def _conditions(self, run: Run, fails: list[pb.TestResult]) -> tuple[list[Finding], tuple[Severity, Action]]:
        """FAILs raise DIAG_<TEST>_FAILED; a test that passed clears its earlier ones."""
        findings: list[Finding] = []
        worst = (Severity.OK, Action.NONE)
        for x in fails:
            code = f"DIAG_{x.test.upper()}_FAILED"
            sev = Severity[x.details["severity"]] if x.details.get("severity") in Severity.__members__ else None
            act = Action[x.details["action"]] if x.details.get("action") in Action.__members__ else None
            meaning = self.engine.policy.meaning(code, sev, act)
            worst = max(worst, (meaning.severity, meaning.action))
            findings.append(Finding(component=x.component, code=code, message=x.message, severity=sev, action=act,
                                    evidence={"report": run.id, "test": x.test, **dict(x.details)}))
        passed = {x.test for x in run.report.results if x.status == pb.RESULT_PASS} - {x.test for x in fails}
        for c in list(self.engine.policy.conditions.values()):
            if c.source == SOURCE and c.code in {f"DIAG_{t.upper()}_FAILED" for t in passed}:
                findings.append(Finding(component=c.component, code=c.code, kind=FindingKind.RESOLVED,
                                        message=f"passed in {run.id}"))
        return findings, worst

    def _publish(self, run: Run, msg: pb.DiagnosticProgress) -> None:
        if msg.phase == pb.DiagnosticProgress.PHASE_FINISHED:
            self._save(run.report)  # the report so far, in case the daemon dies now
        for q in run.subscribers:
            q.put_nowait(msg)

    def _save(self, r: pb.DiagnosticReport) -> None:
        self.store.save_report(r.id, r.started.ToNanoseconds() / 1e9, r.outcome, r.SerializeToString(),
                               self.config().keep_reports)

    @staticmethod
    def _minigpt_host(r: pb.DiagnosticReport | None) -> pb.TestResult | None:
        if r is None:
            return None
        return next((x for x in r.results if x.test == "minigpt" and x.component == "host"
                     and "node_digest" in x.details), None)


def validate(req: pb.RunRequest, cfg: DiagnosticsConfig) -> float | None:
    """Refuse (BadRequest → INVALID_ARGUMENT) what no test could use, before anything starts; return
    the request's timeout in seconds (None when it sets none).

    An impossible rendezvous must not reach a child: a world_size of 2**32-1 grew one until the OOM
    killer came, and a port past 65535 made all_gather blame node rank 0 for the request's mistake.
    """
    if len(req.level) > MAX_NAME:
        raise BadRequest(f"level is longer than {MAX_NAME} characters")
    if len(req.tests) > MAX_TESTS or any(len(t) > MAX_NAME for t in req.tests):
        raise BadRequest(f"tests: at most {MAX_TESTS} names of at most {MAX_NAME} characters")
    if len(req.gpus) > MAX_GPUS or any(not g or len(g) > MAX_BUS_ID for g in req.gpus):
        raise BadRequest(f"gpus: at most {MAX_GPUS} bus ids of 1 to {MAX_BUS_ID} characters")
    if len(req.test_faults_json) > MAX_FAULTS_JSON:
        raise BadRequest(f"test_faults_json is longer than {MAX_FAULTS_JSON} bytes")
    timeout = None
    if req.HasField("timeout"):
        try:
            timeout = duration(req.timeout, "timeout")
        except Invalid as e:
            raise BadRequest(str(e)) from e
        if not 0 < timeout <= MAX_RUN_TIMEOUT:
            raise BadRequest(f"timeout must be positive and at most {MAX_RUN_TIMEOUT / 86400:g} days")
    if req.HasField("rendezvous"):
        rv = req.rendezvous
        if not rv.master_addr or len(rv.master_addr) > MAX_ADDR or not ADDR.fullmatch(rv.master_addr):
            raise BadRequest(f"rendezvous.master_addr must be a host name or an IP address of 1 to {MAX_ADDR} "
                             "characters")
        if not 1 <= rv.master_port <= 65535:
            raise BadRequest(f"rendezvous.master_port must be between 1 and 65535, not {rv.master_port}")
        if not 1 <= rv.world_size <= cfg.max_world_size:
            raise BadRequest(f"rendezvous.world_size must be between 1 and {cfg.max_world_size} nodes "
                             f"(diagnostics.max_world_size), not {rv.world_size}")
        if rv.node_rank >= rv.world_size:
            raise BadRequest(f"rendezvous.node_rank must be below world_size {rv.world_size}, not {rv.node_rank}")
        if not RUN_ID.fullmatch(rv.run_id):
            raise BadRequest("rendezvous.run_id must be at most 128 characters of A-Z a-z 0-9 . _ : / @ + = -")
    return timeout


def codes() -> Mapping[str, CodeRule]:
    return CODES
