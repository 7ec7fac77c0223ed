"""Built-in checks, in the order the runner starts them. Nothing registers itself at import.

One folder per check (`kernel/`, `nic/`, `gpu/`, `pcie/`, `thermal/`, `host/`, `services/`), each of the same shape:
`__init__.py` exports the check class from `check.py`, `config.py` holds its `checks.<name>` settings,
`parse.py` its pure parsers (where it has any), `rules.yaml` its codes table and thresholds; what the
checks share is in `common/`. The contract they implement is robustd/check.py.

The checks are imported on first use (`BUILTIN`, or one of the class names below), not with the
package: importing one check, or a helper of `checks.common`, must not need the others' driver
libraries (pynvml for gpu, pyroute2 for nic). The stop-time tests are not checks: `stoptests/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checks.common.exports import lazy

if TYPE_CHECKING:  # `X as X`: re-exported, as `__all__` says
    from checks.gpu import GpuCheck as GpuCheck
    from checks.host import HostCheck as HostCheck
    from checks.kernel import KernelCheck as KernelCheck
    from checks.nic import NicCheck as NicCheck
    from checks.pcie import PcieCheck as PcieCheck
    from checks.services import ServicesCheck as ServicesCheck
    from checks.thermal import ThermalCheck as ThermalCheck
    from robustd.check import Check

    BUILTIN: list[type[Check]]

_MODULES = {"KernelCheck": "checks.kernel", "NicCheck": "checks.nic", "GpuCheck": "checks.gpu",
            "PcieCheck": "checks.pcie", "ThermalCheck": "checks.thermal", "HostCheck": "checks.host",
            "ServicesCheck": "checks.services"}

__all__ = ["BUILTIN", *_MODULES]
_export = lazy("checks", _MODULES)


def __getattr__(name: str) -> Any:
    return [_export(n) for n in _MODULES] if name == "BUILTIN" else _export(name)
