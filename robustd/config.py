"""robustd.yaml: validated with pydantic, errors reported with key path and line number.

One file serves several processes: the daemon reads the core keys below and `checks:`, robustd-slurm and
the Slurm hooks its `slurm:` section, robustd-k8s its `k8s:`. Each process validates what it reads, and
says so with a `Schema`: the checks' `Config` models (each check registers its own), the sections other
processes own (registered by name: the daemon finds them through the `robustd.sections` entry-point
group, robustd/sections.py), the stop-time test names `diagnostics.levels` may use, and which core keys it
reads. This module knows that registry, never Slurm, Kubernetes or the stop-time tests themselves.

Every outside path is in `roots:`; the older keys that also name one (`boot_id_path`, a check's own key
such as `checks.kernel.kmsg_path`) are still accepted and folded into it at load.

The key names here are a public contract (operators and tools write them); extend, never rename.
"""

from __future__ import annotations

import collections.abc
import difflib
import logging
import os
import re
import socket
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Collection, Iterable, Literal, Mapping

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from robustd import tls, yamlpos
from robustd.check import CheckConfig
from robustd.codes import CodeRule
from robustd.durations import Duration, PositiveDuration
from robustd.flags import Flag
from robustd.identity import parse_identity
from robustd.paths import AbsPath, NameOrPath
from robustd.roots import (
    DEFAULT_BOOT_ID,
    DEFAULT_DCGMI,
    DEFAULT_DEV,
    DEFAULT_KMSG,
    DEFAULT_NVML_LIBRARY,
    DEFAULT_PROC,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    DEFAULT_SYS,
    Roots,
)
from robustd.startup import split_address

# What a section's validators may know of the rest of the file (pydantic's validation context, a dict):
LEVELS = "diagnostics_levels"  # frozenset of the level names diagnostics.levels defines
TESTS = "stop_time_tests"  # frozenset of the stop-time test names a level may use; absent: not checked here


def known(info: ValidationInfo, key: str) -> frozenset[str] | None:
    """A name set the loader put in the validation context (LEVELS, TESTS), or None when it did not."""
    value = (info.context or {}).get(key)
    return value if isinstance(value, frozenset) else None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def host_port(address: str | None) -> str | None:
    """A listening address, `host:port` or `[v6]:port` with a port from 1 to 65535 (split_address); unset or
    empty means off."""
    if address:
        split_address(address)
    return address


class TlsConfig(Strict):
    """The listener's PEM files, each read and parsed at load (robustd/tls.py): a file that is not what its key
    says is a config error at its line, never a listener that fails to start or a reload that waits on a FIFO."""

    cert: AbsPath = Field(min_length=1)  # PEM server certificate (chain)
    key: AbsPath = Field(min_length=1)  # PEM private key
    client_ca: AbsPath | None = None  # PEM CA bundle: set = mutual TLS, every client must present a cert it signed

    @field_validator("cert", "client_ca")
    @classmethod
    def _certificates(cls, path: str | None) -> str | None:
        if path is not None:
            tls.check_certificates(tls.read_pem(path))
        return path

    @field_validator("key")
    @classmethod
    def _private_key(cls, path: str, info: ValidationInfo) -> str:
        key = tls.read_pem(path)
        tls.check_private_key(key)
        if "cert" in info.data:  # the certificate passed its own check
            tls.check_pair(tls.read_pem(info.data["cert"]), key)
        return path


class ListenConfig(Strict):
    unix: AbsPath = DEFAULT_SOCKET
    unix_mode: int = Field(default=0o660, ge=0, le=0o777)  # file mode of the Unix socket
    unix_group: str | None = None  # group owning the socket, e.g. the one in authz.disruptive.unix_groups
    tcp: str | None = None  # host:port; needs `tls`, or `insecure: true` for plaintext
    tls: TlsConfig | None = None
    insecure: Flag = False  # allow `tcp` without TLS (logged as a warning at every start)
    max_message_bytes: int = Field(default=4 << 20, ge=1024, le=1 << 30)  # per message, received and sent
    max_concurrent_streams: int = Field(default=100, ge=1, le=10_000)  # per connection (HTTP/2 streams)
    # The Unix socket's relay: each connection costs three descriptors; beyond these, new ones are refused.
    max_connections: int = Field(default=256, ge=1, le=100_000)
    max_connections_per_uid: int = Field(default=64, ge=1, le=100_000)
    # Open Watch streams (robustd/api/watch_slots.py): per uid (or client certificate) and in total; past
    # them a Watch gets RESOURCE_EXHAUSTED. Root keeps a reserve of the total, as for connections.
    max_watches: int = Field(default=256, ge=1, le=100_000)
    max_watches_per_uid: int = Field(default=32, ge=1, le=100_000)
    handshake_timeout: PositiveDuration = 10.0  # a connection that sends no bytes within this is closed

    _host_port = field_validator("tcp")(host_port)

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
        parse_identity(entry)
        return entry

    # Client certificate names, TCP: `dns:`, `uri:`, `email:`, `ip:`, or a plain name (robustd.identity).
    identities: list[Annotated[str, AfterValidator(_identity)]] = Field(default_factory=list)
    unix_groups: list[str] = Field(default_factory=list)  # groups whose members may, on the Unix socket


class AuthzConfig(Strict):
    disruptive: DisruptiveAuthz = Field(default_factory=DisruptiveAuthz)


class MetricsConfig(Strict):
    address: str | None = None  # host:port for the Prometheus endpoint; unset = off
    # robustd_condition series per scrape (most severe first); the rest are counted as dropped.
    max_condition_series: int = Field(default=1000, ge=0, le=1_000_000)

    _host_port = field_validator("address")(host_port)


# The most events retention may keep: prune computes `head - max_events` in SQLite's 64-bit integers, and a
# log of a billion events is far beyond any disk the event log is meant for.
MAX_EVENTS = 10**9


class RetentionConfig(Strict):
    max_age: Duration = 30 * 86400.0
    # strict: a YAML integer, not 1.0e+5 nor "100000" (a float or a string here is a mistake, not a count)
    max_events: int = Field(default=100_000, gt=0, le=MAX_EVENTS, strict=True)


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
    # Payload per rank and iteration (MiB) and timed iterations; 0: the test's own default for its backend
    # (stoptests/collective_launcher.py DEFAULTS). Smaller for a slow fabric or a test bench.
    size_mb: float = Field(default=0.0, ge=0, le=65536)
    iterations: int = Field(default=0, ge=0, le=100_000)
    # fork: the ranks are forked from the launcher once it has loaded torch (one load per node); exec: each
    # rank is its own interpreter (an escape hatch for a torch build that does not survive a fork).
    worker_start: Literal["fork", "exec"] = "fork"
    timeout: Duration = 300.0


class MinigptConfig(Strict):
    steps: int = Field(default=20, ge=1, le=10_000)
    timeout: Duration = 300.0


def _default_levels() -> dict[str, list[str]]:
    return {"quick": ["all_to_all"], "standard": ["all_to_all", "minigpt"],
            "full": ["eud", "all_to_all", "all_gather", "minigpt"]}


class DiagnosticsConfig(Strict):
    # One section per `section` named in robustd/diagnostics/table.py (each with its `timeout`). The test
    # names a level may use come from that table too, through the loader (Schema.stop_time_tests).
    eud: EudConfig = Field(default_factory=EudConfig)
    collectives: CollectivesConfig = Field(default_factory=CollectivesConfig)
    minigpt: MinigptConfig = Field(default_factory=MinigptConfig)
    levels: dict[str, list[str]] = Field(default_factory=_default_levels)
    python: NameOrPath | None = None  # the interpreter for the test children; default: the daemon's own
    timeout: Duration = 7200.0  # a whole Run, unless the request says otherwise
    keep_reports: int = Field(default=500, ge=1)
    # Each read (and restore) of the GPUs' settings before and after a run (robustd/diagnostics/gpustate.py):
    # its NVML child is killed past this, and the report says so (ERROR), as for a hung driver call.
    gpu_state_timeout: Duration = Field(default=20.0, gt=0)
    test_faults: Flag = False  # accept test-only fault injection in specs (tests only; never in production)
    # The largest all_gather rendezvous (nodes) a Run may ask for; larger ones are INVALID_ARGUMENT.
    max_world_size: int = Field(default=4096, ge=1, le=65536)

    @field_validator("levels")
    @classmethod
    def _known_tests(cls, levels: dict[str, list[str]], info: ValidationInfo) -> dict[str, list[str]]:
        tests = known(info, TESTS)
        for name, names in levels.items():
            if not names:
                raise ValueError(f"level {name!r} is empty")
            bad = [t for t in names if tests is not None and t not in tests]
            if bad:
                raise ValueError(f"level {name!r}: unknown tests {bad} (known: {', '.join(sorted(tests or ()))})")
        return {**_default_levels(), **levels}  # the file's levels over the built-in ones, which it need not repeat


def levels_note(diagnostics: DiagnosticsConfig) -> str:
    """One line naming the diagnostic levels in force and where each comes from, for the start and reload logs:
    a file that sets `diagnostics.levels` adds to the built-in levels (a level of the same name replaces one)."""
    builtin = _default_levels()
    own = [n for n, tests in diagnostics.levels.items() if builtin.get(n) != tests]
    kept = [n for n in diagnostics.levels if n not in own]
    return (f"diagnostics levels {', '.join(sorted(diagnostics.levels))} (built in: {', '.join(kept) or 'none'}; "
            f"from the config: {', '.join(own) or 'none'})")


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

    gpu_processes: Flag = True  # processes holding NVML compute contexts
    process_patterns: list[Regex] = Field(default_factory=list)  # searched in each process's command line
    timeout: PositiveDuration = 10.0  # per process
    concurrency: int = Field(default=8, ge=1, le=256)  # py-spy children at once
    max_processes: int = Field(default=256, ge=1)
    py_spy: NameOrPath | None = None  # the py-spy binary; default: beside the daemon's interpreter, then $PATH


class EvidenceConfig(Strict):
    """Evidence bundles under state_dir/evidence/ (robustd/evidence.py), bounded in count and bytes."""

    keep: int = Field(default=50, ge=1, le=100_000, strict=True)  # the newest kept
    max_bundle_bytes: int = Field(default=1 << 20, ge=4096, le=1 << 30, strict=True)  # each; trimmed to fit
    max_bytes: int = Field(default=64 << 20, ge=4096, le=1 << 40, strict=True)  # the directory; oldest go first
    # Creates per minute by each caller not allowed disruptive RPCs (the adapters run as root: not counted).
    max_creates_per_minute: int = Field(default=6, ge=0, le=10_000, strict=True)


class RootsConfig(Strict):
    """Every outside path robustd reads, in one section (robustd.roots.Roots is built from it alone)."""

    proc: AbsPath = DEFAULT_PROC
    sys: AbsPath = DEFAULT_SYS
    dev: AbsPath = DEFAULT_DEV
    kmsg: AbsPath = DEFAULT_KMSG  # the kernel log, streamed (also accepted as checks.kernel.kmsg_path)
    boot_id: AbsPath = DEFAULT_BOOT_ID  # the kernel's boot id (also accepted as the top-level boot_id_path)
    dcgmi: NameOrPath = DEFAULT_DCGMI  # DCGM's CLI: the word `dcgmi` in diagnostics.eud.command stands for it
    nvml_library: NameOrPath = DEFAULT_NVML_LIBRARY  # libnvidia-ml for checks.gpu.backend: nvml


class Config(Strict):
    node_name: str = Field(default_factory=socket.gethostname, min_length=1)
    state_dir: AbsPath = DEFAULT_STATE_DIR
    boot_id_path: AbsPath = DEFAULT_BOOT_ID  # an older name for roots.boot_id, folded into it at load
    log_level: str = Field(default="info", pattern=r"^(debug|info|warning|error)$")
    listen: ListenConfig = Field(default_factory=ListenConfig)
    authz: AuthzConfig = Field(default_factory=AuthzConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    roots: RootsConfig = Field(default_factory=RootsConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    tracer: TracerConfig = Field(default_factory=TracerConfig)
    evidence: EvidenceConfig = Field(default_factory=EvidenceConfig)
    checks: dict[str, Any] = Field(default_factory=dict)  # validated per check, see load_config

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """`metrics:` with only comments under it means the defaults, not an error."""
        if isinstance(data, dict):
            return {k: ({} if v is None and k in _MAPPINGS else v) for k, v in data.items()}
        return data


_MAPPINGS = ("listen", "authz", "metrics", "retention", "policy", "roots", "diagnostics", "tracer", "evidence",
             "checks")


@dataclass(frozen=True)
class Schema:
    """What one process reads of robustd.yaml, so it validates that and only that.

    The daemon's: every check's Config, every registered section, the stop-time tests' names, all core keys
    (robustd.checkset.config_schema). An adapter's: its own section and the core keys it reads; the rest of
    the file is the daemon's to validate.
    """

    checks: Mapping[str, type[CheckConfig]] | None = None  # None: `checks:` is not read here (nor validated)
    sections: Mapping[str, type[BaseModel]] = field(default_factory=dict)  # top-level sections other processes own
    stop_time_tests: Collection[str] | None = None  # names diagnostics.levels may use; None: not checked here
    reads: Collection[str] | None = None  # the core keys read (and validated) here; None: every one


@dataclass(frozen=True)
class Settings:
    """The validated config: the core keys, each known check's own section, and each registered section."""

    config: Config
    checks: Mapping[str, CheckConfig]
    source: str
    sections: Mapping[str, BaseModel] = field(default_factory=dict)

    def roots(self) -> Roots:
        r = self.config.roots
        return Roots(proc=r.proc, sys=r.sys, dev=r.dev, kmsg=r.kmsg, boot_id=r.boot_id, dcgmi=r.dcgmi,
                     nvml_library=r.nvml_library)

    def section(self, name: str) -> Any:
        """A registered section's validated model; KeyError when this process's schema does not have it."""
        return self.sections[name]


class ConfigError(Exception):
    """A config that cannot be used; `str()` lists every problem as `file:line: key: message`."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


MAX_CONFIG_BYTES = 1 << 20  # robustd.yaml, read whole: a site's is a few KB


def load_config_or_defaults(path: str | None, schema: Schema,
                            overrides: Mapping[str, Any] | None = None) -> Settings:
    """The settings of `path`; None means DEFAULT_CONFIG, and built-in defaults when that file does not exist.

    One rule for every program that reads robustd.yaml (robustd, robustd-slurm, robustd-k8s, robustctl
    slurm): a node installed without /etc/robustd/robustd.yaml runs on the defaults, said once on stderr
    (the caller's logging), while a --config FILE that names a missing file is a ConfigError naming it.
    """
    if path is None:
        from robustd import roots  # read now, not at import: tests point it at a path that does not exist

        path = roots.DEFAULT_CONFIG
        if not os.path.exists(path):
            logging.getLogger("robustd.config").warning("%s not found: using the built-in defaults", path)
            return parse_config("", "(defaults)", schema, overrides)
    return load_config(path, schema, overrides)


def load_config(path: str, schema: Schema, overrides: Mapping[str, Any] | None = None) -> Settings:
    """The settings in the file at `path`, or a ConfigError listing every problem.

    Blocking (it reads the file and the files it names, such as listen.tls's): the daemon's reload runs it
    off the event loop, under a time limit."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError([f"{path}: cannot read config: {e.strerror}"]) from e
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{path}: the config is larger than {MAX_CONFIG_BYTES >> 20} MiB"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError([f"{path}:{line}: the config is not UTF-8 text: byte 0x{raw[e.start]:02x} at column "
                           f"{column}"]) from None
    return parse_config(text, path, schema, overrides)


def parse_config(text: str, source: str, schema: Schema, overrides: Mapping[str, Any] | None = None) -> Settings:
    try:
        root, data, duplicates = yamlpos.load(text, source)
    except yaml.YAMLError as e:
        raise ConfigError([yamlpos.malformed(e, source)]) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}:1: the config must be a mapping of keys, got {type(data).__name__}"])
    for key, value in (overrides or {}).items():
        _set_path(data, key.split("."), value)

    context = {LEVELS: _level_names(data)}
    if schema.stop_time_tests is not None:
        context[TESTS] = frozenset(schema.stop_time_tests)
    problems = duplicates  # the loader kept the last of each: report them, never guess
    core = {k: v for k, v in data.items() if k not in schema.sections}
    if schema.reads is not None:  # the rest of the file is another process's to validate
        core = {k: v for k, v in core.items() if k in schema.reads}
    elif "checks" in core and schema.checks is None:
        core.pop("checks")
    config = None
    try:
        config = Config.model_validate(core, context=context)
    except ValidationError as e:
        problems += describe(e, (), root, source, Config, extra_keys=schema.sections)

    sections: dict[str, BaseModel] = {}
    for name, model in schema.sections.items():
        raw = data.get(name)
        try:
            sections[name] = model.model_validate(raw if raw is not None else {}, context=context)
        except ValidationError as e:
            problems += describe(e, (name,), root, source, model)

    checks: dict[str, CheckConfig] = {}
    raw_checks = data.get("checks") or {}
    check_types = schema.checks if schema.reads is None or "checks" in schema.reads else None
    if check_types is not None and isinstance(raw_checks, dict):
        for name in raw_checks:
            if name not in check_types:
                known_names = ", ".join(sorted(check_types)) or "none"
                problems.append(f"{yamlpos.where(root, ('checks', name), source)}: checks.{name}: unknown check"
                                f"{_did_you_mean(str(name), check_types)} (known: {known_names})")
        for name, model in check_types.items():
            section = raw_checks.get(name)
            try:
                checks[name] = model.model_validate(section if section is not None else {})
            except ValidationError as e:
                problems += describe(e, ("checks", name), root, source, model)
    if config is not None:
        config, folding = _fold_roots(config, checks, root, source)
        problems += folding
    if problems or config is None:
        raise ConfigError(problems)
    return Settings(config=config, checks=checks, source=source, sections=sections)


def _level_names(data: Mapping[str, Any]) -> frozenset[str]:
    """The diagnostics level names the file defines (read raw: a section naming a level is checked against
    them even while diagnostics itself has a problem, which is then reported at its own key)."""
    levels: Any = _default_levels()
    diagnostics = data.get("diagnostics")
    if isinstance(diagnostics, dict) and isinstance(diagnostics.get("levels"), dict):
        levels = {**levels, **diagnostics["levels"]}  # merged over the built-in ones, as DiagnosticsConfig does
    return frozenset(str(k) for k in levels) if isinstance(levels, dict) else frozenset()


def _fold_roots(config: Config, checks: Mapping[str, CheckConfig], root: yaml.Node | None,
                source: str) -> tuple[Config, list[str]]:
    """`roots` with the older keys that name an outside path folded in, and the EUD command's `dcgmi` word
    resolved against it. An older key and its roots key that are both written must agree."""
    aliases: list[tuple[tuple[str, ...], str, str]] = []  # (where, its roots key, value)
    if "boot_id_path" in config.model_fields_set:
        aliases.append((("boot_id_path",), "boot_id", config.boot_id_path))
    for name, cfg in checks.items():
        for key, target in type(cfg).root_aliases.items():
            if key in cfg.model_fields_set:
                aliases.append((("checks", name, key), target, getattr(cfg, key)))
    problems: list[str] = []
    written = config.roots.model_fields_set
    update: dict[str, str] = {}
    for loc, target, value in aliases:
        ours = update.get(target, getattr(config.roots, target) if target in written else None)
        if ours is not None and ours != value:
            problems.append(f"{yamlpos.where(root, loc, source)}: {'.'.join(loc)}: {value!r} differs from "
                            f"roots.{target} ({ours!r}); write it once, as roots.{target}")
            continue
        update[target] = value
    roots = config.roots.model_copy(update=update)
    changes: dict[str, Any] = {"roots": roots, "boot_id_path": roots.boot_id}
    command = config.diagnostics.eud.command
    if command[0] == DEFAULT_DCGMI and roots.dcgmi != DEFAULT_DCGMI:
        eud = config.diagnostics.eud.model_copy(update={"command": [roots.dcgmi, *command[1:]]})
        changes["diagnostics"] = config.diagnostics.model_copy(update={"eud": eud})
    return config.model_copy(update=changes), problems


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def describe(err: ValidationError, prefix: tuple[Any, ...], root: yaml.Node | None, source: str,
              model: type[BaseModel] | None = None, extra_keys: Iterable[str] = ()) -> list[str]:
    """One line per problem: where (file:line), which key, what is wrong, for any YAML file a pydantic model
    validates (robustd.yaml, a check's `thresholds:`). An unknown key gets the nearest valid key at its level
    (`did you mean `clear_after`?`), as a typo is the usual cause (`extra_keys`: more valid keys at the top
    level, the registered sections)."""
    out = []
    for item in err.errors():
        loc = prefix + tuple(item["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        if item["type"] == "extra_forbidden":
            at = tuple(item["loc"])[:-1]
            valid = _keys_at(model, at) if model is not None else []
            valid += list(extra_keys) if not at else []
            msg = "unknown key" + _did_you_mean(str(item["loc"][-1]), valid)
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
