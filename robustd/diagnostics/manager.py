"""Stop-time diagnostics: one run at a time, tests in order, a report that survives restarts.

A run executes its tests (table.py) as child processes (launcher.py), streams progress to whoever
asked, keeps the report on its shelf (shelf.py: the event log's database, as JSON, model.py), and turns
failures into conditions (DIAG_<TEST>_FAILED) by submitting findings like any check, so Watch clients see
them like any other fault; it reads the engine only through its view. Plain types only: robustd/api/
converts them to and from the wire.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import psutil

from robustd.codes import CodeRule
from robustd.config import DiagnosticsConfig
from robustd.diagnostics import golden, gpustate, table
from robustd.diagnostics.launcher import Child, run_child
from robustd.diagnostics.model import (
    Golden,
    Outcome,
    Phase,
    Progress,
    Report,
    RunRequest,
    Status,
    TestResult,
    report_from_json,
    report_to_json,
)
from robustd.diagnostics.shelf import Shelf
from robustd.diagnostics.validate import BadRequest, validate
from robustd.engine import EngineView
from robustd.inventory import GpuInventory
from robustd.model import Action, Finding, FindingBatch, FindingKind, Severity

log = logging.getLogger("robustd.diag")  # the name operators filter the journal by
SOURCE = "diagnostics"

__all__ = ["BadRequest", "Busy", "DiagnosticsManager", "Refused", "Run", "codes"]


class Busy(Exception):
    """Another diagnostic is running (→ ABORTED)."""


class Refused(Exception):
    """The node cannot run it now (→ FAILED_PRECONDITION): GPU compute processes are alive and the request
    did not force, or the state disk does not answer."""


@dataclass
class Run:
    id: str
    tests: list[str]
    request: RunRequest
    report: Report
    deadline: float
    subscribers: list[asyncio.Queue[Progress | None]] = field(default_factory=list)
    child: Child | None = None
    cancelled: bool = False
    task: asyncio.Task[None] | None = None


class DiagnosticsManager:
    def __init__(self, shelf: Shelf, view: EngineView, submit: Callable[[FindingBatch], object],
                 config: Callable[[], DiagnosticsConfig], node: str, state_dir: str,
                 gpu_inventory: Callable[[], GpuInventory], cpu_model: str = ""):
        self.shelf = shelf  # the reports and golden digests (robustd/diagnostics/shelf.py)
        self.view = view  # the conditions and what a code means, read only
        self.submit = submit  # Engine.submit: a run's findings go to the policy like any check's
        self.config = config
        self.node = node
        # state_dir is absolute (config AbsPath): children get file paths (FileStore) from it.
        self.work_root = os.path.join(state_dir, "diag")
        self.gpu_inventory = gpu_inventory  # what the GPU check last published (robustd/inventory.py)
        self.cpu_model = cpu_model or "unknown CPU"
        self.running: Run | None = None
        self.last_end = 0.0  # time.time() when the last run ended (its children gone)
        self.outcomes: dict[str, int] = {}  # finished runs since start, by outcome name (robustd/metrics.py)

    # -- lifecycle -----------------------------------------------------------------------------
    async def recover(self) -> None:
        """Reports left RUNNING by a daemon that died mid-run are closed as errors."""
        for text in await self.shelf.reports(1000, outcome=Outcome.RUNNING.name):
            r = report_from_json(text)
            r.outcome, r.message = Outcome.ERROR, "the daemon stopped during this run"
            self._save(r)

    # -- requests ------------------------------------------------------------------------------
    def start(self, req: RunRequest) -> Run:
        cfg = self.config()
        validate(req, cfg)
        if self.running is not None:
            raise Busy(f"diagnostic {self.running.id} is running; one at a time per node")
        if self.view.disk_stuck:  # the children's files live in state_dir: a run would hang the loop on them
            raise Refused(f"the state disk is not responding ({self.view.store_error}); a diagnostic needs it for "
                          "its children's files, so none starts until it answers (GetVerdict answers meanwhile)")
        tests = self._tests(req, cfg)
        view = self.gpu_inventory()
        known = {g.bus_id for g in view.devices}
        if unknown := [b for b in req.gpus if b not in known]:
            more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
            raise BadRequest(f"unknown GPUs {unknown[:4]}{more} (this node has: {', '.join(sorted(known)) or 'none'})")
        busy = self._busy_pids(view)
        if busy and not req.force:
            pids = ", ".join(str(p) for p in sorted(busy))
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
        timeout = cfg.timeout if req.timeout is None else req.timeout
        now = time.time()
        run_id = f"diag-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{uuid.uuid4().hex[:6]}"
        report = Report(id=run_id, outcome=Outcome.RUNNING, node=self.node, tests=list(tests), started=now,
                        run_id=req.tag)
        run = Run(id=run_id, tests=tests, request=req, report=report, deadline=time.monotonic() + timeout)
        self._save(report)
        self.running = run
        run.task = asyncio.get_running_loop().create_task(self._execute(run, view), name=f"diag-{run_id}")
        log.info("diagnostic %s started: %s%s", run_id, ", ".join(tests), f" (run id {req.tag})" if req.tag else "")
        return run

    def _busy_pids(self, view: GpuInventory) -> frozenset[int]:
        """The compute processes that make this node busy.

        The snapshot is up to one GPU poll old. When it was read before our own last run ended, the
        processes it lists may be that run's children, exited since (seen on an H200: a second Run
        right after the first was refused naming the first run's rank): those no longer alive are
        left out. A snapshot read after the run ended is taken as NVML gave it, so a job whose pids
        live in another PID namespace still makes the node busy.
        """
        if view.polled_at > self.last_end:
            return view.compute_pids
        return frozenset(p for p in view.compute_pids if _alive(p))

    @staticmethod
    def _tests(req: RunRequest, cfg: DiagnosticsConfig) -> list[str]:
        if req.tests and req.level:
            raise BadRequest("give tests or level, not both")
        if req.level:
            if req.level not in cfg.levels:
                raise BadRequest(f"unknown level {req.level!r} (known: {', '.join(sorted(cfg.levels))})")
            tests = list(cfg.levels[req.level])
        else:
            tests = list(req.tests) or list(cfg.levels.get("standard", ["all_to_all", "minigpt"]))
        if bad := [t for t in tests if t not in table.TESTS]:
            raise BadRequest(f"unknown tests {bad} (known: {', '.join(table.NAMES)})")
        return tests

    def subscribe(self, run: Run) -> asyncio.Queue[Progress | None]:
        q: asyncio.Queue[Progress | None] = asyncio.Queue()
        run.subscribers.append(q)
        return q

    async def cancel(self, run_id: str) -> Report | None:
        run = self.running
        if run is None or run.id != run_id:
            return await self.get(run_id)
        run.cancelled = True
        if run.child is not None:
            run.child.kill("cancelled")
        if run.task is not None:
            await asyncio.shield(run.task)
        return await self.get(run_id)

    async def get(self, run_id: str) -> Report | None:
        """A report (the running one from memory); reads.Unreadable if the log does not answer in time."""
        if self.running is not None and self.running.id == run_id:
            return self.running.report
        text = await self.shelf.report(run_id)
        return None if text is None else report_from_json(text)

    async def list(self, limit: int) -> list[Report]:
        return [report_from_json(t) for t in await self.shelf.reports(limit)]

    async def record_golden(self, report_id: str) -> Golden:
        if report_id:
            report = await self.get(report_id)
        else:
            report = next((r for r in await self.list(200)
                           if r.outcome == Outcome.PASS and golden.node_result(r.results)), None)
        host = golden.node_result(report.results) if report is not None else None
        if report is None or host is None or report.outcome != Outcome.PASS:
            raise BadRequest("no passing MiniGPT report" + (f" with id {report_id}" if report_id else ""))
        key, digest = host.details["golden_key"], host.details["node_digest"]
        now = time.time()
        self.shelf.set_golden(key, digest, report.id, now)
        return Golden(key=key, digest=digest, report_id=report.id, recorded_at=now)

    def goldens(self) -> list[Golden]:
        return [Golden(key=k, digest=d, report_id=r, recorded_at=at) for k, d, r, at in self.shelf.goldens()]

    # -- the run -------------------------------------------------------------------------------
    async def _execute(self, run: Run, view: GpuInventory) -> None:
        cfg = self.config()
        failed = False
        n = len(run.tests)
        try:
            before = await self._record_gpu_state(run, view)
            for i, test in enumerate(run.tests):
                if run.cancelled or time.monotonic() >= run.deadline or (failed and run.request.stop_on_failure):
                    why = ("cancelled" if run.cancelled else "the run's timeout passed" if
                           time.monotonic() >= run.deadline else "an earlier test failed (stop_on_failure)")
                    results = [TestResult(test=test, component="host", status=Status.SKIPPED, message=why)]
                else:
                    self._publish(run, Progress(id=run.id, test=test, percent=100.0 * i / n, phase=Phase.STARTED,
                                                message=f"{test} started"))
                    results = await self._run_test(run, table.TESTS[test], i, view, cfg)
                run.report.results.extend(results)
                # Only hardware evidence stops the run: a test that could not run (ERROR) says nothing about
                # the node, and the next one may (no dcgmi on this host: all_to_all still runs).
                failed = failed or any(r.status == Status.FAIL for r in results)
                self._publish(run, Progress(id=run.id, test=test, percent=100.0 * (i + 1) / n, phase=Phase.FINISHED,
                                            results=tuple(results)))
            if before is not None:  # also after a cancel: its children are gone, whatever they changed stays
                run.report.results.extend(await gpustate.restore(view.nvml_library, before, cfg.gpu_state_timeout))
        except Exception as e:  # noqa: BLE001 - a broken run is an ERROR report, never a dead daemon
            log.exception("diagnostic %s failed", run.id)
            run.report.results.append(TestResult(test="", component="host", status=Status.ERROR,
                                                 message=f"internal error: {e}"))
        finally:
            self._finish(run)
            shutil.rmtree(os.path.join(self.work_root, run.id), ignore_errors=True)
            self.running = None
            self.last_end = time.time()

    async def _record_gpu_state(self, run: Run, view: GpuInventory) -> gpustate.Snapshot | None:
        """Each GPU's settings before the first test (robustd/diagnostics/gpustate.py), to set back after the
        last; None (and nothing restored) without GPUs the GPU check has named, or when NVML could not say."""
        buses = [g.bus_id for g in view.devices if not g.bus_id.startswith("index")]
        if not buses:
            return None
        before, errors = await gpustate.record(view.nvml_library, buses, self.config().gpu_state_timeout)
        run.report.results.extend(errors)
        return before

    async def _run_test(self, run: Run, test: table.StopTimeTest, i: int, view: GpuInventory, cfg: DiagnosticsConfig
                        ) -> list[TestResult]:
        if test.needs_rendezvous and run.request.rendezvous is None:
            return [TestResult(test=test.name, component="host", status=Status.SKIPPED,
                               message=f"{test.name} needs a rendezvous (master_addr, master_port, world_size, "
                                       "node_rank) from the scheduler")]
        work = os.path.join(self.work_root, run.id, test.name)
        os.makedirs(work, exist_ok=True)
        spec = self._spec(run, test, work, view, cfg)
        run.child = Child(test=test.name)

        def progress(percent: float, message: str) -> None:
            overall = 100.0 * (i + max(0.0, min(percent, 100.0)) / 100.0) / len(run.tests)
            self._publish(run, Progress(id=run.id, test=test.name, percent=overall, message=message,
                                        phase=Phase.PROGRESS))

        try:
            results = await run_child(run.child, cfg.python or sys.executable, spec,
                                      os.path.join(work, "spec.json"), progress)
        finally:
            run.child = None
        if test.judge is not None:
            results = test.judge(results, table.JudgeContext(driver=view.driver, cpu_model=self.cpu_model,
                                                             golden=self._golden))
        return results

    def _golden(self, key: str) -> str | None:
        return next((d for k, d, _r, _at in self.shelf.goldens() if k == key), None)

    def _spec(self, run: Run, test: table.StopTimeTest, work: str, view: GpuInventory, cfg: DiagnosticsConfig
              ) -> dict[str, Any]:
        """The child's SPEC.json (stoptests/PROTOCOL.md)."""
        req = run.request
        gpus = [asdict(g) for g in view.devices if not req.gpus or g.bus_id in req.gpus]  # index, bus_id, uuid, name
        if view.emulated:
            gpus = []  # emulated GPUs are no CUDA devices: run CPU ranks
        backend = cfg.collectives.backend
        if backend == "auto":
            backend = "nccl" if gpus else "gloo"
        section: Any = getattr(cfg, test.section)
        timeout = min(section.timeout, max(1.0, run.deadline - time.monotonic()))
        spec: dict[str, Any] = {
            "test": test.name, "run_id": run.id, "node": self.node, "work_dir": work, "timeout": timeout,
            "gpus": gpus, "backend": backend, "cpu_ranks": cfg.collectives.cpu_ranks,
            "min_busbw_gbps": cfg.collectives.min_busbw_gbps, "steps": cfg.minigpt.steps,
            "size_mb": cfg.collectives.size_mb, "iterations": cfg.collectives.iterations,  # 0: the test's default
            "worker_start": cfg.collectives.worker_start,
            "eud": {"command": list(cfg.eud.command)}, "faults": {},
        }
        if (rv := req.rendezvous) is not None:
            spec["rendezvous"] = {"master_addr": rv.master_addr, "master_port": rv.master_port,
                                  "world_size": rv.world_size, "node_rank": rv.node_rank, "run_id": rv.run_id}
        if req.test_faults_json:  # start() refused it unless diagnostics.test_faults is set
            spec["faults"] = json.loads(req.test_faults_json).get(test.name, {})
        return spec

    def _finish(self, run: Run) -> None:
        r = run.report
        r.finished = time.time()
        fails = [x for x in r.results if x.status == Status.FAIL]
        # A GPU the run left changed is GPU_STATE_CHANGED (a WARNING: reset it before the next job), not a
        # failed test: the report's outcome, severity and suspects are the tests' alone.
        failed_tests = [x for x in fails if x.test != gpustate.TEST]
        if run.cancelled:
            r.outcome, r.message = Outcome.CANCELLED, "cancelled; its child processes were killed"
        elif failed_tests:
            r.outcome = Outcome.FAIL
        elif any(x.status == Status.ERROR for x in r.results):
            r.outcome = Outcome.ERROR
        elif not any(x.status == Status.PASS and x.test != gpustate.TEST for x in r.results):
            r.outcome, r.message = Outcome.ERROR, "nothing was tested: " + "; ".join(
                f"{x.test}: {x.message}" for x in r.results
                if x.test != gpustate.TEST)  # all skipped is no evidence of health (settings restored are none)
        else:
            r.outcome = Outcome.PASS
        findings, worst = self._conditions(run, fails)
        if r.outcome == Outcome.FAIL:
            r.severity, r.action = self._conditions(run, failed_tests)[1]
            r.suspects.extend(sorted({x.component for x in failed_tests}))
        else:
            r.severity, r.action = Severity.OK, Action.NONE
            if r.outcome == Outcome.PASS:
                r.message = "no fault found: restart the job"
        if restored := [x for x in r.results if x.test == gpustate.TEST and x.status == Status.PASS]:
            r.message += ("; " if r.message else "") + "GPU settings the run changed were restored on " + ", ".join(
                x.component for x in restored)
        if changed := [x for x in fails if x.test == gpustate.TEST]:
            r.message += ("; " if r.message else "") + ("GPU settings left changed (GPU_STATE_CHANGED, reset the GPU) "
                                                         "on " + ", ".join(x.component for x in changed))
        self._save(r)
        self.outcomes[r.outcome.name] = self.outcomes.get(r.outcome.name, 0) + 1
        if findings:
            self.submit(FindingBatch(SOURCE, tuple(findings)))
        outcome = f"OUTCOME_{r.outcome.name}"
        self._publish(run, Progress(id=run.id, phase=Phase.DONE, percent=100.0, report=r, message=outcome))
        for q in run.subscribers:
            q.put_nowait(None)
        log.info("diagnostic %s: %s %s", run.id, outcome, r.message)

    def _conditions(self, run: Run, fails: list[TestResult]) -> tuple[list[Finding], tuple[Severity, Action]]:
        """FAILs raise DIAG_<TEST>_FAILED; a test that passed clears its earlier ones."""
        findings: list[Finding] = []
        worst = (Severity.OK, Action.NONE)
        for x in fails:
            code = (gpustate.CODE if x.test == gpustate.TEST else table.TESTS[x.test].failed_code
                    if x.test in table.TESTS else f"DIAG_{x.test.upper()}_FAILED")
            sev = Severity[x.details["severity"]] if x.details.get("severity") in Severity.__members__ else None
            act = Action[x.details["action"]] if x.details.get("action") in Action.__members__ else None
            meaning = self.view.meaning(code, sev, act)
            worst = max(worst, (meaning.severity, meaning.action))
            findings.append(Finding(component=x.component, code=code, message=x.message, severity=sev, action=act,
                                    evidence={"report": run.id, "test": x.test, **x.details}))
        passed = {x.test for x in run.report.results if x.status == Status.PASS} - {x.test for x in fails}
        cleared = {table.TESTS[t].failed_code for t in passed if t in table.TESTS}
        for c in self.view.conditions():
            if c.source == SOURCE and c.code in cleared:
                findings.append(Finding(component=c.component, code=c.code, kind=FindingKind.RESOLVED,
                                        message=f"passed in {run.id}"))
        return findings, worst

    def _publish(self, run: Run, msg: Progress) -> None:
        if msg.phase == Phase.FINISHED:
            self._save(run.report)  # the report so far, in case the daemon dies now
        for q in run.subscribers:
            q.put_nowait(msg)

    def _save(self, r: Report) -> None:
        self.shelf.save_report(r.id, r.started or 0.0, r.outcome.name, report_to_json(r), self.config().keep_reports)


def codes() -> Mapping[str, CodeRule]:
    """What the diagnostics raise: each test's DIAG_<TEST>_* and GPU_STATE_CHANGED (gpustate.py)."""
    return {**table.codes(), **gpustate.codes()}


def _alive(pid: int) -> bool:
    """A process that still exists and is not a zombie (a zombie holds no GPU context)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
