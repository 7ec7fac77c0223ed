"""The NIC check's settings (`checks.nic` in robustd.yaml: links, namespace, IB ports, limits) and its rule file
(its codes, and `thresholds.ib_per_hour`: the hourly IB error limits `ib_thresholds` starts from)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from checks.common.thresholds import Strict, load
from checks.nic.parse import parse_rate
from robustd.check import CheckConfig
from robustd.durations import Duration
from robustd.paths import AbsPath, NameOrPath

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table
DEFAULT_NETNS_DIR = "/run/netns"  # where `ip netns add` puts its handles

IbCounter = Literal["symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
                    "local_link_integrity_errors", "excessive_buffer_overrun_errors"]  # checks/nic/ibrates.py HOURLY
PerHour = Annotated[float, Field(ge=0)] | None  # errors an hour above which the code raises; None: not judged


class IbPerHour(Strict):
    """`thresholds.ib_per_hour` of checks/nic/rules.yaml: every counter's default, each cited there."""

    symbol_error: PerHour
    link_error_recovery: PerHour
    link_downed: PerHour
    port_rcv_errors: PerHour
    local_link_integrity_errors: PerHour
    excessive_buffer_overrun_errors: PerHour


class NicThresholds(Strict):
    """`thresholds:` of checks/nic/rules.yaml."""

    ib_per_hour: IbPerHour


def ib_defaults() -> dict[str, float | None]:
    return load(RULES, NicThresholds).ib_per_hour.model_dump()


class NicConfig(CheckConfig):
    """`checks.nic`."""

    interfaces: list[str] = Field(default_factory=list)  # globs; default: physical links up at start
    expected_speed_mbps: int | dict[str, int] | None = None  # one speed, or glob → speed
    sysfs_root: AbsPath | None = None  # default: roots.sys
    netns: NameOrPath | None = None  # a name under netns_dir, or a path to a netns handle
    netns_dir: AbsPath = DEFAULT_NETNS_DIR
    flap_count: int = Field(default=6, ge=2)  # carrier changes (down + up = 2) within flap_window
    flap_window: Duration = 300.0
    error_rate: float = Field(default=1.0, ge=0)  # rx+tx errors per second, averaged over rate_window
    drop_rate: float = Field(default=100.0, ge=0)  # rx+tx drops per second, averaged over rate_window
    rate_window: Duration = 10.0
    ib_root: AbsPath | None = None  # default: <sysfs_root>/class/infiniband
    ib_ports: list[str] = Field(default_factory=list)  # "mlx5_*/1" globs; default: ports ACTIVE at start
    expected_ib_rate: float | None = None  # Gb/s ("400 Gb/sec" accepted); default: the rate seen first
    ib_error_rate: float = Field(default=1.0, ge=0)  # IB error counter increase per second
    # Errors an hour per counter (IB_SYMBOL_ERRORS_HIGH ...), judged over ib_window; what is not given keeps
    # the rule file's default, null turns one off.
    ib_thresholds: dict[IbCounter, PerHour] = Field(default_factory=ib_defaults)
    ib_window: Duration = 3600.0  # the hourly rates' window (shorter only for tests)

    @field_validator("ib_thresholds", mode="after")
    @classmethod
    def _over_defaults(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        return {**ib_defaults(), **v}

    @field_validator("expected_ib_rate", mode="before")
    @classmethod
    def _rate(cls, v: Any) -> Any:
        return parse_rate(v) if isinstance(v, str) else v
