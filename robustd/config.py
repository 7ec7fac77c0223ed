"""robustd.yaml: validated with pydantic, errors reported with key path and line number.

The key names here are a public contract (operators and tools write them); extend, never rename.
"""

from __future__ import annotations

import collections.abc
import difflib
import re
import socket
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Iterable, Literal, Mapping

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from robustd import yamlpos
from robustd.adapters.k8s.config import K8sConfig
from robustd.adapters.slurm.config import SlurmConfig, known_levels
from robustd.check import CheckConfig
from robustd.codes import CodeRule
from robustd.diagnostics.table import TESTS as STOP_TIME_TESTS
from robustd.durations import Duration, PositiveDuration
from robustd.paths import AbsPath, NameOrPath
from robustd.roots import (
    DEFAULT_BOOT_ID,
    DEFAULT_DEV,
    DEFAULT_PROC,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    DEFAULT_SYS,
    Roots,
)
from robustd.startup import split_address


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TlsConfig(Strict):
    cert: AbsPath = Field(min_length=1)  # PEM server certificate (chain)
    key: AbsPath = Field(min_length=1)  # PEM private key
    client_ca: AbsPath | None = None  # PEM CA bundle: set = mutual TLS, every client must present a cert it signed

    @model_validator(mode="after")
    def _readable(self) -> TlsConfig:
        for name in ("cert", "key", "client_ca"):
            path = getattr(self, name)
            if path is None:
                continue
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise ValueError(f"listen.tls.{name}: cannot read {path}: {e.strerror}") from e
        return self


class ListenConfig(Strict):
    unix: AbsPath = DEFAULT_SOCKET
    unix_mode: int = Field(default=0o660, ge=0, le=0o777)  # file mode of the Unix socket
    unix_group: str | None = None  # group owning the socket, e.g. the one in authz.disruptive.unix_groups
    tcp: str | None = None  # host:port; needs `tls`, or `insecure: true` for plaintext
    tls: TlsConfig | None = None
    insecure: bool = False  # allow `tcp` without TLS (logged as a warning at every start)
    max_message_bytes: int = Field(default=4 << 20, ge=1024, le=1 << 30)  # per message, received and sent
    max_concurrent_streams: int = Field(default=100, ge=1, le=10_000)  # per connection (HTTP/2 streams)
    # The Unix socket's relay: each connection costs three descriptors; beyond these, new ones are refused.
    max_connections: int = Field(default=256, ge=1, le=100_000)
    max_connections_per_uid: int = Field(default=64, ge=1, le=100_000)
    handshake_timeout: PositiveDuration = 10.0  # a connection that sends no bytes within this is closed

    @field_validator("unix_group")
    @classmethod
    def _group_exists(cls, name: str | None) -> str | None:
        if name is not None:
            import grp

            try:
                grp.getgrnam(name)
            except KeyError:
                raise ValueError(f"no such group {name!r}") from None
        return name

    @model_validator(mode="after")
    def _tcp_needs_tls(self) -> ListenConfig:
        if self.tcp and self.tls is None and not self.insecure:
            raise ValueError("listen.tcp needs listen.tls (cert and key), or listen.insecure: true to serve "
                             "plaintext")
        return self


class DisruptiveAuthz(Strict):
    @staticmethod
    def _identity(entry: str) -> str:
        from robustd.authz import parse_identity  # a late import: robustd.authz imports this module

        parse_identity(entry)
        return entry

    # Client certificate names, TCP: `dns:`, `uri:`, `email:`, `ip:`, or a plain name (robustd.authz.parse_identity).
    identities: list[Annotated[str, AfterValidator(_identity)]] = Field(default_factory=list)
    unix_groups: list[str] = Field(default_factory=list)  # groups whose members may, on the Unix socket


class AuthzConfig(Strict):
    disruptive: DisruptiveAuthz = Field(default_factory=DisruptiveAuthz)


class MetricsConfig(Strict):
    address: str | None = None  # host:port for the Prometheus endpoint; unset = off
    # robustd_condition series per scrape (most severe first); the rest are counted as dropped.
    max_condition_series: int = Field(default=1000, ge=0, le=1_000_000)

    @field_validator("address")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        if address:
            split_address(address)
        return address


class RetentionConfig(Strict):
    max_age: Duration = 30 * 86400.0
    max_events: int = Field(default=100_000, gt=0)


class PolicyConfig(Strict):
    clear_after: Duration = 300.0  # hold-down: a non-sticky condition clears this long after its last sighting
    update_interval: Duration = 1.0  # at most one UPDATED event per condition per interval for repeats
    escalate_after_reboots: int = Field(default=2, ge=1)
    # Standing conditions are bounded: past these, a code's new components fold into one `<family>/*` condition.
    max_conditions_per_code: int = Field(default=64, ge=1, le=100_000)
    max_conditions: int = Field(default=1000, ge=1, le=1_000_000)
    codes: dict[str, CodeRule] = Field(default_factory=dict)


class EudConfig(Strict):
    command: list[str] = Field(default_factory=lambda: ["dcgmi", "diag", "-r", "eud", "-j"], min_length=1)
    timeout: Duration = 3600.0


class CollectivesConfig(Strict):
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with real GPUs, else gloo
    cpu_ranks: int = Field(default=4, ge=2, le=64)  # ranks on a host without GPUs
    min_busbw_gbps: float = Field(default=0.0, ge=0)  # all_to_all bus bandwidth floor (0 = none)
    timeout: Duration = 300.0


class MinigptConfig(Strict):
    steps: int = Field(default=20, ge=1, le=10_000)
    timeout: Duration = 300.0


def _default_levels() -> dict[str, list[str]]:
    return {"quick": ["all_to_all"], "standard": ["all_to_all", "minigpt"],
            "full": ["eud", "all_to_all", "all_gather", "minigpt"]}


class DiagnosticsConfig(Strict):
    # One section per `section` named in robustd/diagnostics/table.py (each with its `timeout`).
    eud: EudConfig = Field(default_factory=EudConfig)
    collectives: CollectivesConfig = Field(default_factory=CollectivesConfig)
    minigpt: MinigptConfig = Field(default_factory=MinigptConfig)
    levels: dict[str, list[str]] = Field(default_factory=_default_levels)
    python: NameOrPath | None = None  # the interpreter for the test children; default: the daemon's own
    timeout: Duration = 7200.0  # a whole Run, unless the request says otherwise
    keep_reports: int = Field(default=500, ge=1)
    test_faults: bool = False  # accept test-only fault injection in specs (tests only; never in production)
    # The largest all_gather rendezvous (nodes) a Run may ask for; larger ones are INVALID_ARGUMENT.
    max_world_size: int = Field(default=4096, ge=1, le=65536)

    @field_validator("levels")
    @classmethod
    def _known_tests(cls, levels: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, tests in levels.items():
            bad = [t for t in tests if t not in STOP_TIME_TESTS]
            if bad or not tests:
                raise ValueError(f"level {name!r}: unknown tests {bad} (known: {', '.join(STOP_TIME_TESTS)})"
                                 if bad else f"level {name!r} is empty")
        return levels


def _regex(pattern: str) -> str:
    if not pattern:
        raise ValueError("an empty pattern would match every process")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{pattern!r} is not a valid regular expression: {e}") from None
    return pattern


Regex = Annotated[str, AfterValidator(_regex)]


class TracerConfig(Strict):
    """`CaptureStacks`: which processes are training processes, and how long one capture may take."""

    gpu_processes: bool = True  # processes holding NVML compute contexts
    process_patterns: list[Regex] = Field(default_factory=list)  # searched in each process's command line
    timeout: PositiveDuration = 10.0  # per process
    concurrency: int = Field(default=8, ge=1, le=256)  # py-spy children at once
    max_processes: int = Field(default=256, ge=1)
    py_spy: NameOrPath | None = None  # the py-spy binary; default: beside the daemon's interpreter, then $PATH


class RootsConfig(Strict):
    proc: AbsPath = DEFAULT_PROC
    sys: AbsPath = DEFAULT_SYS
    dev: AbsPath = DEFAULT_DEV


class Config(Strict):
    node_name: str = Field(default_factory=socket.gethostname, min_length=1)
    state_dir: AbsPath = DEFAULT_STATE_DIR
    boot_id_path: AbsPath = DEFAULT_BOOT_ID
    log_level: str = Field(default="info", pattern=r"^(debug|info|warning|error)$")
    listen: ListenConfig = Field(default_factory=ListenConfig)
    authz: AuthzConfig = Field(default_factory=AuthzConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    roots: RootsConfig = Field(default_factory=RootsConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    tracer: TracerConfig = Field(default_factory=TracerConfig)
    checks: dict[str, Any] = Field(default_factory=dict)  # validated per check, see load_config
    # Read by robustd-slurm and `robustctl slurm` only; the daemon validates it and never acts on it.
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    # Read by robustd-k8s only; validated here like `slurm`, never acted on by the daemon.
    k8s: K8sConfig = Field(default_factory=K8sConfig)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """`metrics:` with only comments under it means the defaults, not an error."""
        if isinstance(data, dict):
            sections = ("listen", "authz", "metrics", "retention", "policy", "roots", "diagnostics", "tracer", "checks",
                        "slurm", "k8s")
            return {k: ({} if v is None and k in sections else v) for k, v in data.items()}
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _slurm_levels(cls, data: Any, handler: Any) -> Any:
        """slurm.resume_check/epilog_diagnostics name a level of this file's diagnostics.levels."""
        with known_levels(data, _default_levels()):
            return handler(data)


@dataclass(frozen=True)
class Settings:
    """The validated config: the top level plus each known check's own section."""

    config: Config
    checks: Mapping[str, CheckConfig]
    source: str

    def roots(self) -> Roots:
        kmsg = getattr(self.checks.get("kernel"), "kmsg_path", None)
        r = self.config.roots
        return Roots(proc=r.proc, sys=r.sys, dev=r.dev, boot_id=self.config.boot_id_path,
                     **({"kmsg": kmsg} if kmsg else {}))


class ConfigError(Exception):
    """A config that cannot be used; `str()` lists every problem as `file:line: key: message`."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def load_config(path: str, check_types: Mapping[str, type[CheckConfig]],
                overrides: Mapping[str, Any] | None = None) -> Settings:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read config: {e.strerror}"]) from e
    return parse_config(text, path, check_types, overrides)


def parse_config(text: str, source: str, check_types: Mapping[str, type[CheckConfig]],
                 overrides: Mapping[str, Any] | None = None) -> Settings:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([yamlpos.malformed(e, source)]) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}:1: the config must be a mapping of keys, got {type(data).__name__}"])
    for key, value in (overrides or {}).items():
        _set_path(data, key.split("."), value)

    problems: list[str] = []
    config = None
    try:
        config = Config.model_validate(data)
    except ValidationError as e:
        problems += _describe(e, (), root, source, Config)

    checks: dict[str, CheckConfig] = {}
    raw_checks = data.get("checks") or {}
    if isinstance(raw_checks, dict):
        for name in raw_checks:
            if name not in check_types:
                known = ", ".join(sorted(check_types)) or "none"
                problems.append(f"{yamlpos.where(root, ('checks', name), source)}: checks.{name}: unknown check"
                                f"{_did_you_mean(str(name), check_types)} (known: {known})")
        for name, model in check_types.items():
            section = raw_checks.get(name)
            try:
                checks[name] = model.model_validate(section if section is not None else {})
            except ValidationError as e:
                problems += _describe(e, ("checks", name), root, source, model)
    if problems or config is None:
        raise ConfigError(problems)
    return Settings(config=config, checks=checks, source=source)


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def _describe(err: ValidationError, prefix: tuple[Any, ...], root: yaml.Node | None, source: str,
              model: type[BaseModel] | None = None) -> list[str]:
    """One line per problem: where (file:line), which key, what is wrong; an unknown key gets the
    nearest valid key at its level (`did you mean `clear_after`?`), as a typo is the usual cause."""
    out = []
    for item in err.errors():
        loc = prefix + tuple(item["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        if item["type"] == "extra_forbidden":
            known = _keys_at(model, tuple(item["loc"])[:-1]) if model is not None else []
            msg = "unknown key" + _did_you_mean(str(item["loc"][-1]), known)
        elif item["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = item["msg"].removeprefix("Value error, ")
            if "input" in item and not isinstance(item["input"], (dict, list)):
                msg += f" (got {item['input']!r})"
        out.append(f"{yamlpos.where(root, loc, source)}: {key}: {msg}")
    return out


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean `x`?)` for the closest of `choices` to a mistyped `word`, or nothing."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _keys_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys the config accepts at `loc` under `model` (following nested models, their optionals and
    the values of dict fields); [] where the schema is not a model there."""
    current: Any = model
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if typing.get_origin(current) in (dict, collections.abc.Mapping):
            current = typing.get_args(current)[-1] if typing.get_args(current) else None  # `part`: a free key
            continue
        target = _model_in(current)
        if target is None or not isinstance(part, str) or part not in target.model_fields:
            return []
        current = target.model_fields[part].annotation
    target = _model_in(current)
    return [f.alias or name for name, f in target.model_fields.items()] if target is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel in an annotation such as `X`, `X | None` or `Annotated[X, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
