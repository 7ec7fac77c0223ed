"""The `k8s:` section of robustd.yaml, read by `robustd-k8s`.

The section is registered under the `robustd.sections` entry-point group, so the daemon validates it
with the rest of the file (`robustd --check-config` names the key and the line of a bad value) but never
acts on it: adapters act, the core never does. The daemon loads this module by that name only, so it
imports nothing heavier than pydantic (not the kubernetes client).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from robustd.adapters.common.config import ActionName, Threshold
from robustd.config import Schema, host_port
from robustd.durations import PositiveDuration
from robustd.model import Severity
from robustd.paths import AbsPath

# A DNS-1123 subdomain: what Kubernetes accepts as a node name.
_NODE_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_NAMESPACE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A label selector as the API server takes it: key=value, key!=value, key, !key, key in (a,b), comma-separated.
_SELECTOR_CHARS = re.compile(r"^[A-Za-z0-9._/=!(), -]*$")


class QuarantineConfig(BaseModel):
    """Cordon and taint this node on a CRITICAL verdict whose action is listed (opt-in: empty by default)."""

    model_config = ConfigDict(extra="forbid")

    actions: list[ActionName] = Field(default_factory=list)  # e.g. [RESET_GPU, REBOOT, HW_INSPECT]
    # NoSchedule keeps running pods; NoExecute evicts the pods that do not tolerate the taint.
    taint_effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"
    release_after: PositiveDuration = 300.0  # the verdict must be OK this long before robustd uncordons
    # Circuit breaker: at most max(1, floor(max_fraction x nodes matching node_selector)) nodes carry the taint.
    max_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    node_selector: str = Field(default="", max_length=1024)  # a label selector; "" means every node

    @field_validator("node_selector")
    @classmethod
    def _selector(cls, value: str) -> str:
        if not _SELECTOR_CHARS.match(value):
            raise ValueError(f"{value!r} is not a label selector (e.g. nvidia.com/gpu.present=true)")
        return value


class K8sConfig(BaseModel):
    """How robustd-k8s shows this node's verdict to Kubernetes (README, "Kubernetes")."""

    model_config = ConfigDict(extra="forbid")

    # The Node object. Default: $NODE_NAME (the DaemonSet sets it from the downward API), else the host name.
    node_name: str | None = Field(default=None, min_length=1, max_length=253, pattern=_NODE_NAME)
    # A kubeconfig file; default: the in-cluster service account (`--kubeconfig` overrides both).
    kubeconfig: AbsPath | None = None
    condition_prefix: str = Field(default="Robustd", min_length=1, max_length=32, pattern=r"^[A-Z][A-Za-z0-9]*$")
    condition_severity: Threshold = Severity.WARNING  # a family's condition is True at or above this
    heartbeat: PositiveDuration = 300.0  # lastHeartbeatTime rewritten this often (plus up to 10% jitter)
    events_namespace: str = Field(default="default", min_length=1, max_length=63, pattern=_NAMESPACE)
    state_file: AbsPath | None = None  # default: <state_dir>/k8s.json
    request_timeout: PositiveDuration = 10.0  # each request to the API server
    max_backoff: PositiveDuration = 60.0  # failed writes are retried after 0.5 s, doubling up to this (jittered)
    quarantine: QuarantineConfig = Field(default_factory=QuarantineConfig)
    # act: write conditions, Events and the quarantine; shadow: decide the same, write nothing, log each
    # decision as "would ..." and count it in the state file (`robustd-k8s --status`).
    mode: Literal["act", "shadow"] = "act"
    # News older than this when read (a replayed or long-standing fault) causes no new cordon; it is logged.
    max_event_age: PositiveDuration = 600.0
    # host:port of robustd-k8s's own /metrics (robustd_k8s_decisions_total, robustd_k8s_shadow_mode); unset: off.
    metrics_address: str | None = None

    _host_port = field_validator("metrics_address")(host_port)

    @field_validator("heartbeat")
    @classmethod
    def _heartbeat(cls, value: float) -> float:
        if value < 10:
            raise ValueError("must be at least 10s: every heartbeat is a write to the API server from every node")
        return value


READS = ("state_dir", "log_level", "listen")  # the core keys robustd-k8s reads besides `k8s:`
SCHEMA = Schema(sections={"k8s": K8sConfig}, reads=READS)
