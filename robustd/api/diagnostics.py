"""Diagnostics service: start a stop-time run and stream its progress; get, list, cancel reports."""

from __future__ import annotations

from typing import AsyncIterator

import grpc

from robustd.api import diagnostics_convert as convert
from robustd.api import triage
from robustd.api.requests import Invalid
from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc
from robustd.bounds import echo
from robustd.diagnostics.manager import BadRequest, Busy, DiagnosticsManager, Refused
from robustd.reads import Unreadable


class DiagnosticsServicer(pb_grpc.DiagnosticsServicer):
    def __init__(self, manager: DiagnosticsManager):
        self.manager = manager
        self.job_triages = triage.JobTriages()

    async def Run(self, request: pb.RunRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DiagnosticProgress]:
        try:
            run = self.manager.start(convert.run_request(request))
        except Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Busy as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        except Refused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        queue = self.manager.subscribe(run)
        # A client that goes away does not stop the run: its report stays available through Get.
        while (msg := await queue.get()) is not None:
            yield convert.progress(msg)

    async def Get(self, request: pb.GetDiagnosticRequest, context: grpc.aio.ServicerContext) -> pb.DiagnosticReport:
        try:
            report = await self.manager.get(request.id)
        except Unreadable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if report is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no diagnostic {echo(request.id)}")
        return convert.report(report)

    async def List(self, request: pb.ListDiagnosticsRequest,
                   context: grpc.aio.ServicerContext) -> pb.ListDiagnosticsResponse:
        if request.limit < 0 or request.limit > 1000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit must be between 0 and 1000")
        try:
            reports = await self.manager.list(request.limit or 20)
        except Unreadable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.ListDiagnosticsResponse(reports=[convert.report(r) for r in reports])

    async def Cancel(self, request: pb.CancelDiagnosticRequest,
                     context: grpc.aio.ServicerContext) -> pb.DiagnosticReport:
        try:
            report = await self.manager.cancel(request.id)
        except Unreadable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if report is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no diagnostic {echo(request.id)}")
        return convert.report(report)

    async def RecordGolden(self, request: pb.RecordGoldenRequest, context: grpc.aio.ServicerContext) -> pb.Golden:
        try:
            return convert.golden(await self.manager.record_golden(request.report_id))
        except BadRequest as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Unreadable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def ListGoldens(self, request: pb.ListGoldensRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListGoldensResponse:
        return pb.ListGoldensResponse(goldens=[convert.golden(g) for g in self.manager.goldens()])

    async def Triage(self, request: pb.TriageRequest, context: grpc.aio.ServicerContext) -> pb.TriageResponse:
        """Failure triage of a job's logs (read-only; robustd/api/triage.py has the bounds and the worker thread)."""
        return await triage.handle(request, context)

    async def RecordTriage(self, request: pb.RecordTriageRequest,
                           context: grpc.aio.ServicerContext) -> pb.RecordTriageResponse:
        """A node epilog's verdict on a multi-node job, for the controller's hook (robustd/api/triage.py)."""
        try:
            self.job_triages.record(request)
        except Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RecordTriageResponse()

    async def GetTriage(self, request: pb.GetTriageRequest, context: grpc.aio.ServicerContext) -> pb.JobTriage:
        try:
            got = self.job_triages.get(request.job_id)
        except Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if got is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no triage recorded for job {echo(request.job_id)}")
        return got
