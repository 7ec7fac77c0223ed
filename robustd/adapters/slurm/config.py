"""The `slurm:` section of robustd.yaml, read by `robustd-slurm` and `robustctl slurm ...`.

The section is registered under the `robustd.sections` entry-point group, so the daemon validates it
with the rest of the file (`robustd --check-config` names the key and the line of a bad value) but
never acts on it: adapters act, the core never does. The daemon loads this module by that name only,
so it imports nothing heavier than pydantic and robustd's config models.

Two keys name a diagnostics level (`resume_check`, `epilog_diagnostics`); whether that level
exists depends on `diagnostics.levels` in the same file. The loader puts the level names the file
defines into the validation context (robustd.config.LEVELS), so a typo is reported at its own key
and line rather than at the first self-check after a reboot.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from robustd.adapters.common.config import ActionName
from robustd.config import LEVELS, Schema, host_port, known
from robustd.durations import Duration, PositiveDuration
from robustd.flags import Flag
from robustd.model import Action
from robustd.paths import AbsPath, NameOrPath

DEFAULT_PREFIX = "robustd:"
HEALTHCHECK_KILL = 60.0  # Slurm 22.05 kills HealthCheckProgram after 60 s; the hooks must end well before


def plain_char(ch: str) -> bool:
    """Printable ASCII other than quotes and backslashes: what a Slurm reason (and robustd's prefix) may hold."""
    return " " <= ch <= "~" and ch not in "\"'\\"


def _level(name: str | None, info: ValidationInfo) -> str | None:
    if name is None or name == "":
        return None
    levels = known(info, LEVELS)
    if levels is not None and name not in levels:
        names = ", ".join(sorted(levels)) or "none"
        raise ValueError(f"{name!r} is not a level in diagnostics.levels (known: {names})")
    return name


Level = Annotated[str | None, AfterValidator(_level)]

MAX_TRIAGE_PATTERNS = 32
_PATTERN_CODES = {"j": "the job id", "u": "the job's user name", "%": "a %"}


def _log_pattern(value: str) -> str:
    """An absolute glob naming a job's logs, with %j (job id), %u (user) and %% (a %) filled in per job."""
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path (a glob such as /scratch/%u/logs/%j/*.log)")
    if len(value) > 4096 or "\0" in value:
        raise ValueError("must be a path of at most 4096 characters")
    i = 0
    while i < len(value):
        if value[i] == "%":
            code = value[i + 1:i + 2]
            if code not in _PATTERN_CODES:
                raise ValueError(f"{value!r}: unknown {('%' + code) if code else 'trailing %'} (known: "
                                 + ", ".join(f"%{k} {v}" for k, v in _PATTERN_CODES.items()) + ")")
            i += 2
            continue
        i += 1
    return value


LogPattern = Annotated[str, AfterValidator(_log_pattern)]


def _off(value: object) -> object:
    """`off` (YAML reads an unquoted off as false) and null: no preflight."""
    return None if value is False or value is None or value == "off" else value


Preflight = Annotated[str | None, BeforeValidator(_off), AfterValidator(_level)]
CTLD_MAX_TIMEOUT = 3600.0  # the job-level diagnosis after a job; slurmctld holds the job's record meanwhile


class CtldConfig(BaseModel):
    """The controller's hooks (`robustctl slurm epilog-ctld | prolog-ctld`, README "Slurm"): the job-level
    diagnosis over the job's nodes' daemons, dialled over TCP with mutual TLS."""

    model_config = ConfigDict(extra="forbid")

    # On the nodes: EpilogSlurmctld is robustd's, so the node epilog of a multi-node job leaves the diagnosis to
    # it (never two runs racing for one node); a single-node job is diagnosed by the node epilog either way.
    epilog: Flag = False
    port: int = Field(default=7070, ge=1, le=65535)  # the nodes' robustd listen.tcp port
    rendezvous_port: int = Field(default=29500, ge=1, le=65535)  # the collectives' first port (fleet diagnose --port)
    # The controller's client certificate (its identity must be in the nodes' authz.disruptive.identities), its
    # key, and the CA that signed the nodes' certificates. Checked when a hook runs, not at load: one robustd.yaml
    # is often shared by the nodes, which have no such files.
    tls_ca: AbsPath | None = None
    tls_cert: AbsPath | None = None
    tls_key: AbsPath | None = None
    level: Level = "quick"  # the local tests of the diagnosis (all_gather always follows); null: the daemons' default
    timeout: PositiveDuration = 300.0  # the whole diagnosis after a failed job
    preflight: Preflight = None  # off, or the level prolog-ctld runs before a multi-node job starts
    preflight_timeout: PositiveDuration = 60.0
    # A pair below this fraction of the median pair's bus bandwidth is slow (`fleet diagnose --slow-fraction`):
    # 0.5 for a fabric whose healthy pairs measure within a few percent of each other.
    slow_fraction: float = Field(default=0.5, gt=0, lt=1)

    @field_validator("timeout", "preflight_timeout")
    @classmethod
    def _bounded(cls, value: float) -> float:
        if value > CTLD_MAX_TIMEOUT:
            raise ValueError(f"must be at most {CTLD_MAX_TIMEOUT:g}s")
        return value

    @property
    def tls(self) -> tuple[str | None, str | None, str | None]:
        """(CA, client certificate, client key), as robustd.cli.client.Client and fleet diagnose take them."""
        return (self.tls_ca, self.tls_cert, self.tls_key)

    @model_validator(mode="after")
    def _tls_together(self) -> CtldConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self


class SlurmConfig(BaseModel):
    """How robustd-slurm and the robustctl hooks act on this node's verdict (README, "Slurm")."""

    model_config = ConfigDict(extra="forbid")

    # act: drain and resume in Slurm. shadow: decide exactly the same, write nothing to Slurm, log and count each
    # decision as "would drain NODE: REASON" / "would resume NODE" (`robustctl slurm status` shows them).
    mode: Literal["act", "shadow"] = "act"
    # A Watch event older than this when robustd-slurm reads it (replayed after the agent was down) causes no new
    # drain: it is logged as stale and counted. The agent's own view is what it acts on, never old news.
    max_event_age: PositiveDuration = 600.0
    # host:port for robustd-slurm's own Prometheus endpoint (robustd_slurm_mode, robustd_slurm_shadow_decisions_total);
    # unset = off. Plain HTTP without authentication: keep it on loopback or behind a firewall.
    metrics_address: str | None = None
    # The Slurm node name. Default: $SLURMD_NODENAME in the hooks (slurmd sets it), else the short host name.
    node_name: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+$")
    # Every reason robustd writes starts with this; a node whose reason does not is never touched.
    reason_prefix: str = DEFAULT_PREFIX
    # Drain when a CRITICAL condition's action is one of these.
    drain_actions: list[ActionName] = Field(default_factory=lambda: [Action.RESET_GPU, Action.REBOOT,
                                                                     Action.HW_INSPECT])
    on_critical: Literal["drain", "down"] = "drain"  # down kills the running jobs; drain lets them end
    resume_after: Duration = 300.0  # the verdict must stay below the drain threshold this long before a resume
    max_resumes: int = Field(default=3, ge=0, le=1000)  # resumes in 24 h; one more drain holds it as flapping
    # Circuit breaker: drains robustd may hold per partition: max(min_drains, floor(fraction x partition size)).
    min_drains: int = Field(default=1, ge=0, le=1_000_000)
    max_drained_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    # Actions answered with `scontrol reboot ASAP nextstate=DOWN` instead of a drain (default none).
    reboot_on: list[ActionName] = Field(default_factory=list)
    resume_check: Level = "quick"  # the diagnostics level that must PASS before a rebooted node resumes; null: none
    epilog_diagnostics: Level = None  # the level the epilog runs after a failed job; null: none
    epilog_timeout: PositiveDuration = 600.0  # the epilog's diagnostics, all of it
    # The epilog triages a failed job's logs first (README, "Triage") and runs epilog_diagnostics only when the
    # cause may be the machine (infra likely or unknown, next step diagnose); false: diagnose every failed job.
    triage: Flag = True
    # More logs to triage besides the job's StdOut/StdErr: absolute globs, %j job id, %u user, %% a %.
    triage_logs: list[LogPattern] = Field(default_factory=list, max_length=MAX_TRIAGE_PATTERNS)
    reconcile_interval: PositiveDuration = 300.0  # Slurm's state re-read and compared this often (and at start)
    state_file: AbsPath | None = None  # default: <state_dir>/slurm.json
    command_timeout: PositiveDuration = 10.0  # each scontrol/sinfo call
    hook_timeout: PositiveDuration = 30.0  # healthcheck and prolog end within this, whatever hangs
    scontrol: NameOrPath = "scontrol"  # looked up on $PATH, or a path
    sinfo: NameOrPath = "sinfo"
    ctld: CtldConfig = Field(default_factory=CtldConfig)  # the controller's hooks (EpilogSlurmctld, PrologSlurmctld)

    _metrics_address = field_validator("metrics_address")(host_port)

    @field_validator("reason_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value or len(value) > 32:
            raise ValueError("must be 1 to 32 characters")
        if value != value.strip() or not all(plain_char(ch) for ch in value):
            raise ValueError("must be printable ASCII without quotes, backslashes or surrounding spaces")
        return value

    @field_validator("hook_timeout")
    @classmethod
    def _under_slurm_limit(cls, value: float) -> float:
        if value > HEALTHCHECK_KILL - 5:
            raise ValueError(f"must be at most {HEALTHCHECK_KILL - 5:g}s: Slurm kills HealthCheckProgram after "
                             f"{HEALTHCHECK_KILL:g}s")
        return value

    @field_validator("reboot_on")
    @classmethod
    def _reboot_subset(cls, value: list[Action], info: ValidationInfo) -> list[Action]:
        drain = info.data.get("drain_actions")
        missing = [a.name for a in value if drain is not None and a not in drain]
        if missing:
            raise ValueError(f"{', '.join(missing)} not in drain_actions: such a verdict never drains, so it "
                             "would never reboot")
        return value


# The core keys robustd-slurm and the hooks read besides `slurm:` (the socket, the state directory, the log
# level, the roots of /proc and /dev, a diagnostic run's timeout, the tracer's limits for a hung job's
# stacks); the rest, `checks:` among it, is the daemon's.
READS = ("state_dir", "log_level", "listen", "roots", "diagnostics", "tracer")
SCHEMA = Schema(sections={"slurm": SlurmConfig}, reads=READS)
