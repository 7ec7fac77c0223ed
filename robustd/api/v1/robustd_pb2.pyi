import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Severity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEVERITY_UNSPECIFIED: _ClassVar[Severity]
    SEVERITY_OK: _ClassVar[Severity]
    SEVERITY_WARNING: _ClassVar[Severity]
    SEVERITY_CRITICAL: _ClassVar[Severity]

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_NONE: _ClassVar[Action]
    ACTION_RESTART_JOB: _ClassVar[Action]
    ACTION_RESET_GPU: _ClassVar[Action]
    ACTION_REBOOT: _ClassVar[Action]
    ACTION_HW_INSPECT: _ClassVar[Action]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_RAISED: _ClassVar[EventKind]
    EVENT_KIND_UPDATED: _ClassVar[EventKind]
    EVENT_KIND_CLEARED: _ClassVar[EventKind]

class CheckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECK_STATUS_UNSPECIFIED: _ClassVar[CheckStatus]
    CHECK_STATUS_NOT_YET_RUN: _ClassVar[CheckStatus]
    CHECK_STATUS_OK: _ClassVar[CheckStatus]
    CHECK_STATUS_ERROR: _ClassVar[CheckStatus]
    CHECK_STATUS_TIMEOUT: _ClassVar[CheckStatus]
    CHECK_STATUS_DISABLED: _ClassVar[CheckStatus]
    CHECK_STATUS_UNSUPPORTED: _ClassVar[CheckStatus]
    CHECK_STATUS_WATCHING: _ClassVar[CheckStatus]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_PASS: _ClassVar[Outcome]
    OUTCOME_FAIL: _ClassVar[Outcome]
    OUTCOME_CANCELLED: _ClassVar[Outcome]
    OUTCOME_ERROR: _ClassVar[Outcome]
    OUTCOME_RUNNING: _ClassVar[Outcome]

class ResultStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_UNSPECIFIED: _ClassVar[ResultStatus]
    RESULT_PASS: _ClassVar[ResultStatus]
    RESULT_FAIL: _ClassVar[ResultStatus]
    RESULT_SKIPPED: _ClassVar[ResultStatus]
    RESULT_ERROR: _ClassVar[ResultStatus]
SEVERITY_UNSPECIFIED: Severity
SEVERITY_OK: Severity
SEVERITY_WARNING: Severity
SEVERITY_CRITICAL: Severity
ACTION_UNSPECIFIED: Action
ACTION_NONE: Action
ACTION_RESTART_JOB: Action
ACTION_RESET_GPU: Action
ACTION_REBOOT: Action
ACTION_HW_INSPECT: Action
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_RAISED: EventKind
EVENT_KIND_UPDATED: EventKind
EVENT_KIND_CLEARED: EventKind
CHECK_STATUS_UNSPECIFIED: CheckStatus
CHECK_STATUS_NOT_YET_RUN: CheckStatus
CHECK_STATUS_OK: CheckStatus
CHECK_STATUS_ERROR: CheckStatus
CHECK_STATUS_TIMEOUT: CheckStatus
CHECK_STATUS_DISABLED: CheckStatus
CHECK_STATUS_UNSUPPORTED: CheckStatus
CHECK_STATUS_WATCHING: CheckStatus
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_PASS: Outcome
OUTCOME_FAIL: Outcome
OUTCOME_CANCELLED: Outcome
OUTCOME_ERROR: Outcome
OUTCOME_RUNNING: Outcome
RESULT_UNSPECIFIED: ResultStatus
RESULT_PASS: ResultStatus
RESULT_FAIL: ResultStatus
RESULT_SKIPPED: ResultStatus
RESULT_ERROR: ResultStatus

class Condition(_message.Message):
    __slots__ = ("component", "code", "severity", "action", "message", "evidence", "first_seen", "last_seen", "count", "sticky", "seq", "source", "boot_id")
    class EvidenceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STICKY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    component: str
    code: str
    severity: Severity
    action: Action
    message: str
    evidence: _containers.ScalarMap[str, str]
    first_seen: _timestamp_pb2.Timestamp
    last_seen: _timestamp_pb2.Timestamp
    count: int
    sticky: bool
    seq: int
    source: str
    boot_id: str
    def __init__(self, component: _Optional[str] = ..., code: _Optional[str] = ..., severity: _Optional[_Union[Severity, str]] = ..., action: _Optional[_Union[Action, str]] = ..., message: _Optional[str] = ..., evidence: _Optional[_Mapping[str, str]] = ..., first_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., count: _Optional[int] = ..., sticky: _Optional[bool] = ..., seq: _Optional[int] = ..., source: _Optional[str] = ..., boot_id: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "at", "kind", "condition", "snapshot")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: _timestamp_pb2.Timestamp
    kind: EventKind
    condition: Condition
    snapshot: bool
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kind: _Optional[_Union[EventKind, str]] = ..., condition: _Optional[_Union[Condition, _Mapping]] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class GetVerdictRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("node", "severity", "action", "conditions", "seq", "at", "boot_id", "emulated", "event_log_error", "events_held", "conditions_trimmed", "conditions_omitted")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    EMULATED_FIELD_NUMBER: _ClassVar[int]
    EVENT_LOG_ERROR_FIELD_NUMBER: _ClassVar[int]
    EVENTS_HELD_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_TRIMMED_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    node: str
    severity: Severity
    action: Action
    conditions: _containers.RepeatedCompositeFieldContainer[Condition]
    seq: int
    at: _timestamp_pb2.Timestamp
    boot_id: str
    emulated: _containers.RepeatedScalarFieldContainer[str]
    event_log_error: str
    events_held: int
    conditions_trimmed: int
    conditions_omitted: int
    def __init__(self, node: _Optional[str] = ..., severity: _Optional[_Union[Severity, str]] = ..., action: _Optional[_Union[Action, str]] = ..., conditions: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ..., seq: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., boot_id: _Optional[str] = ..., emulated: _Optional[_Iterable[str]] = ..., event_log_error: _Optional[str] = ..., events_held: _Optional[int] = ..., conditions_trimmed: _Optional[int] = ..., conditions_omitted: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("from_seq",)
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    def __init__(self, from_seq: _Optional[int] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("since", "component", "min_severity", "limit", "after_seq")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    MIN_SEVERITY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    since: _timestamp_pb2.Timestamp
    component: str
    min_severity: Severity
    limit: int
    after_seq: int
    def __init__(self, since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., component: _Optional[str] = ..., min_severity: _Optional[_Union[Severity, str]] = ..., limit: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events", "oldest_seq", "head_seq", "truncated", "next_after_seq")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    oldest_seq: int
    head_seq: int
    truncated: bool
    next_after_seq: int
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., oldest_seq: _Optional[int] = ..., head_seq: _Optional[int] = ..., truncated: _Optional[bool] = ..., next_after_seq: _Optional[int] = ...) -> None: ...

class ListChecksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckInfo(_message.Message):
    __slots__ = ("name", "enabled", "mode", "interval", "timeout", "last_run", "last_duration", "status", "last_error", "runs", "failures", "note")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LAST_RUN_FIELD_NUMBER: _ClassVar[int]
    LAST_DURATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    enabled: bool
    mode: str
    interval: _duration_pb2.Duration
    timeout: _duration_pb2.Duration
    last_run: _timestamp_pb2.Timestamp
    last_duration: _duration_pb2.Duration
    status: CheckStatus
    last_error: str
    runs: int
    failures: int
    note: str
    def __init__(self, name: _Optional[str] = ..., enabled: _Optional[bool] = ..., mode: _Optional[str] = ..., interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., last_run: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., status: _Optional[_Union[CheckStatus, str]] = ..., last_error: _Optional[str] = ..., runs: _Optional[int] = ..., failures: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class ListChecksResponse(_message.Message):
    __slots__ = ("checks",)
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    checks: _containers.RepeatedCompositeFieldContainer[CheckInfo]
    def __init__(self, checks: _Optional[_Iterable[_Union[CheckInfo, _Mapping]]] = ...) -> None: ...

class AcknowledgeRequest(_message.Message):
    __slots__ = ("component", "code", "reason")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    component: str
    code: str
    reason: str
    def __init__(self, component: _Optional[str] = ..., code: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AcknowledgeResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: Event
    def __init__(self, event: _Optional[_Union[Event, _Mapping]] = ...) -> None: ...

class Rendezvous(_message.Message):
    __slots__ = ("master_addr", "master_port", "world_size", "node_rank", "run_id")
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    master_addr: str
    master_port: int
    world_size: int
    node_rank: int
    run_id: str
    def __init__(self, master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., node_rank: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("tests", "level", "gpus", "stop_on_failure", "timeout", "force", "rendezvous", "run_id", "test_faults_json")
    TESTS_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    STOP_ON_FAILURE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TEST_FAULTS_JSON_FIELD_NUMBER: _ClassVar[int]
    tests: _containers.RepeatedScalarFieldContainer[str]
    level: str
    gpus: _containers.RepeatedScalarFieldContainer[str]
    stop_on_failure: bool
    timeout: _duration_pb2.Duration
    force: bool
    rendezvous: Rendezvous
    run_id: str
    test_faults_json: str
    def __init__(self, tests: _Optional[_Iterable[str]] = ..., level: _Optional[str] = ..., gpus: _Optional[_Iterable[str]] = ..., stop_on_failure: _Optional[bool] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., force: _Optional[bool] = ..., rendezvous: _Optional[_Union[Rendezvous, _Mapping]] = ..., run_id: _Optional[str] = ..., test_faults_json: _Optional[str] = ...) -> None: ...

class TestResult(_message.Message):
    __slots__ = ("test", "component", "status", "message", "figures", "details")
    class FiguresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEST_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    test: str
    component: str
    status: ResultStatus
    message: str
    figures: _containers.ScalarMap[str, float]
    details: _containers.ScalarMap[str, str]
    def __init__(self, test: _Optional[str] = ..., component: _Optional[str] = ..., status: _Optional[_Union[ResultStatus, str]] = ..., message: _Optional[str] = ..., figures: _Optional[_Mapping[str, float]] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DiagnosticReport(_message.Message):
    __slots__ = ("id", "outcome", "severity", "action", "suspects", "results", "node", "tests", "started", "finished", "message", "run_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    outcome: Outcome
    severity: Severity
    action: Action
    suspects: _containers.RepeatedScalarFieldContainer[str]
    results: _containers.RepeatedCompositeFieldContainer[TestResult]
    node: str
    tests: _containers.RepeatedScalarFieldContainer[str]
    started: _timestamp_pb2.Timestamp
    finished: _timestamp_pb2.Timestamp
    message: str
    run_id: str
    def __init__(self, id: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., severity: _Optional[_Union[Severity, str]] = ..., action: _Optional[_Union[Action, str]] = ..., suspects: _Optional[_Iterable[str]] = ..., results: _Optional[_Iterable[_Union[TestResult, _Mapping]]] = ..., node: _Optional[str] = ..., tests: _Optional[_Iterable[str]] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class DiagnosticProgress(_message.Message):
    __slots__ = ("id", "test", "phase", "percent", "message", "results", "report")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[DiagnosticProgress.Phase]
        PHASE_STARTED: _ClassVar[DiagnosticProgress.Phase]
        PHASE_PROGRESS: _ClassVar[DiagnosticProgress.Phase]
        PHASE_FINISHED: _ClassVar[DiagnosticProgress.Phase]
        PHASE_DONE: _ClassVar[DiagnosticProgress.Phase]
    PHASE_UNSPECIFIED: DiagnosticProgress.Phase
    PHASE_STARTED: DiagnosticProgress.Phase
    PHASE_PROGRESS: DiagnosticProgress.Phase
    PHASE_FINISHED: DiagnosticProgress.Phase
    PHASE_DONE: DiagnosticProgress.Phase
    ID_FIELD_NUMBER: _ClassVar[int]
    TEST_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    id: str
    test: str
    phase: DiagnosticProgress.Phase
    percent: float
    message: str
    results: _containers.RepeatedCompositeFieldContainer[TestResult]
    report: DiagnosticReport
    def __init__(self, id: _Optional[str] = ..., test: _Optional[str] = ..., phase: _Optional[_Union[DiagnosticProgress.Phase, str]] = ..., percent: _Optional[float] = ..., message: _Optional[str] = ..., results: _Optional[_Iterable[_Union[TestResult, _Mapping]]] = ..., report: _Optional[_Union[DiagnosticReport, _Mapping]] = ...) -> None: ...

class GetDiagnosticRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListDiagnosticsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListDiagnosticsResponse(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[DiagnosticReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[DiagnosticReport, _Mapping]]] = ...) -> None: ...

class CancelDiagnosticRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Golden(_message.Message):
    __slots__ = ("key", "digest", "report_id", "recorded_at")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    key: str
    digest: str
    report_id: str
    recorded_at: _timestamp_pb2.Timestamp
    def __init__(self, key: _Optional[str] = ..., digest: _Optional[str] = ..., report_id: _Optional[str] = ..., recorded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RecordGoldenRequest(_message.Message):
    __slots__ = ("report_id",)
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    report_id: str
    def __init__(self, report_id: _Optional[str] = ...) -> None: ...

class ListGoldensRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGoldensResponse(_message.Message):
    __slots__ = ("goldens",)
    GOLDENS_FIELD_NUMBER: _ClassVar[int]
    goldens: _containers.RepeatedCompositeFieldContainer[Golden]
    def __init__(self, goldens: _Optional[_Iterable[_Union[Golden, _Mapping]]] = ...) -> None: ...

class TriageLog(_message.Message):
    __slots__ = ("name", "data", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    offset: int
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class TriageRequest(_message.Message):
    __slots__ = ("exit_code", "signal", "logs")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    LOGS_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: str
    logs: _containers.RepeatedCompositeFieldContainer[TriageLog]
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[str] = ..., logs: _Optional[_Iterable[_Union[TriageLog, _Mapping]]] = ...) -> None: ...

class TriageEvidence(_message.Message):
    __slots__ = ("file", "line", "text", "offset", "rank")
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    file: str
    line: int
    text: str
    offset: int
    rank: int
    def __init__(self, file: _Optional[str] = ..., line: _Optional[int] = ..., text: _Optional[str] = ..., offset: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class TriageResponse(_message.Message):
    __slots__ = ("infra", "next", "level", "evidence", "ranks", "reason", "partial")
    CLASS_FIELD_NUMBER: _ClassVar[int]
    INFRA_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    infra: str
    next: str
    level: str
    evidence: _containers.RepeatedCompositeFieldContainer[TriageEvidence]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    partial: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, infra: _Optional[str] = ..., next: _Optional[str] = ..., level: _Optional[str] = ..., evidence: _Optional[_Iterable[_Union[TriageEvidence, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., partial: _Optional[_Iterable[str]] = ..., **kwargs) -> None: ...

class RecordTriageRequest(_message.Message):
    __slots__ = ("job_id", "verdict")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    verdict: TriageResponse
    def __init__(self, job_id: _Optional[str] = ..., verdict: _Optional[_Union[TriageResponse, _Mapping]] = ...) -> None: ...

class RecordTriageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTriageRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobTriage(_message.Message):
    __slots__ = ("job_id", "verdict", "recorded_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    verdict: TriageResponse
    recorded_at: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., verdict: _Optional[_Union[TriageResponse, _Mapping]] = ..., recorded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ProcessSelector(_message.Message):
    __slots__ = ("pids", "ranks")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pids: _Optional[_Iterable[int]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class NotTraceable(_message.Message):
    __slots__ = ("pids", "ranks")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pids: _Optional[_Iterable[int]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class CaptureRequest(_message.Message):
    __slots__ = ("selector", "native", "timeout")
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    selector: ProcessSelector
    native: bool
    timeout: _duration_pb2.Duration
    def __init__(self, selector: _Optional[_Union[ProcessSelector, _Mapping]] = ..., native: _Optional[bool] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class StackFrame(_message.Message):
    __slots__ = ("function", "file", "line", "native")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    function: str
    file: str
    line: int
    native: bool
    def __init__(self, function: _Optional[str] = ..., file: _Optional[str] = ..., line: _Optional[int] = ..., native: _Optional[bool] = ...) -> None: ...

class ThreadStack(_message.Message):
    __slots__ = ("thread_id", "os_thread_id", "name", "active", "owns_gil", "frames")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    OS_THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    OWNS_GIL_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    thread_id: int
    os_thread_id: int
    name: str
    active: bool
    owns_gil: bool
    frames: _containers.RepeatedCompositeFieldContainer[StackFrame]
    def __init__(self, thread_id: _Optional[int] = ..., os_thread_id: _Optional[int] = ..., name: _Optional[str] = ..., active: _Optional[bool] = ..., owns_gil: _Optional[bool] = ..., frames: _Optional[_Iterable[_Union[StackFrame, _Mapping]]] = ...) -> None: ...

class ProcessStacks(_message.Message):
    __slots__ = ("pid", "command", "selected_by", "rank", "local_rank", "world_size", "threads", "error", "timed_out", "duration")
    PID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    SELECTED_BY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    pid: int
    command: str
    selected_by: str
    rank: int
    local_rank: int
    world_size: int
    threads: _containers.RepeatedCompositeFieldContainer[ThreadStack]
    error: str
    timed_out: bool
    duration: _duration_pb2.Duration
    def __init__(self, pid: _Optional[int] = ..., command: _Optional[str] = ..., selected_by: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., threads: _Optional[_Iterable[_Union[ThreadStack, _Mapping]]] = ..., error: _Optional[str] = ..., timed_out: _Optional[bool] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CaptureResponse(_message.Message):
    __slots__ = ("node", "captured_at", "processes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_AT_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    node: str
    captured_at: _timestamp_pb2.Timestamp
    processes: _containers.RepeatedCompositeFieldContainer[ProcessStacks]
    def __init__(self, node: _Optional[str] = ..., captured_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., processes: _Optional[_Iterable[_Union[ProcessStacks, _Mapping]]] = ...) -> None: ...

class CreateEvidenceRequest(_message.Message):
    __slots__ = ("components", "codes", "reason")
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    components: _containers.RepeatedScalarFieldContainer[str]
    codes: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, components: _Optional[_Iterable[str]] = ..., codes: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class EvidenceSummary(_message.Message):
    __slots__ = ("id", "created", "reason", "components")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: _timestamp_pb2.Timestamp
    reason: str
    components: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ..., components: _Optional[_Iterable[str]] = ...) -> None: ...

class ListEvidenceRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListEvidenceResponse(_message.Message):
    __slots__ = ("bundles",)
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    bundles: _containers.RepeatedCompositeFieldContainer[EvidenceSummary]
    def __init__(self, bundles: _Optional[_Iterable[_Union[EvidenceSummary, _Mapping]]] = ...) -> None: ...

class GetEvidenceRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class EvidenceBundle(_message.Message):
    __slots__ = ("id", "json")
    ID_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    json: str
    def __init__(self, id: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...
