"""A GPU's NVLink fabric registration (NVML's GPU fabric info) and what in it is a fault.

On NVSwitch systems (HGX H100/H200/B200, GB200/GB300 NVL72) each GPU registers with the NVLink fabric
(the fabric manager, or the NVL72 rack's NVLink domain) after the driver loads: state NOT_STARTED, then
IN_PROGRESS, then COMPLETED with a status. Until it has completed with NVML_SUCCESS, CUDA cannot use
the GPU's NVLinks (peer access and NCCL over NVLink fail or fall back); a completed GPU also carries the
cluster uuid and clique id of the NVLink partition it joined, and, on newer drivers, a health mask.
GPUs that have no fabric (PCIe cards, pre-Hopper) answer NOT_SUPPORTED: the call or the state.

Read through the pinned pynvml's binding and struct (`c_nvmlGpuFabricInfoV_t`, version 2, which has the
health mask); a driver that does not know that version gets the unversioned call, without the mask.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

STATE_NAMES = {pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "NOT_SUPPORTED",
               pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "NOT_STARTED",
               pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "IN_PROGRESS",
               pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "COMPLETED"}
# nvmlReturn_t names, for a completed registration's status
RETURN_NAMES = {v: k for k, v in vars(pynvml).items()
                if (k.startswith("NVML_ERROR_") or k == "NVML_SUCCESS") and isinstance(v, int)}


def _field(name: str, field: str, bad: frozenset[int]) -> tuple[str, int, int, frozenset[int]]:
    return (name, getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{field}"),
            getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{field}"), bad)


# healthMask fields that say the GPU's fabric is degraded or unusable: (name, shift, width, values that do).
# Recovery in progress (route / access-timeout recovery) is transient and not judged; the global fabric
# manager being disconnected does not by itself stop traffic on a fabric already set up.
HEALTH_FAULTS = (
    _field("degraded_bandwidth", "DEGRADED_BW", frozenset({pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE})),
    _field("route_unhealthy", "ROUTE_UNHEALTHY", frozenset({pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE})),
    _field("incorrect_configuration", "INCORRECT_CONFIGURATION", frozenset(range(2, 9))),  # SYSGUID .. GPU_STATE
)


@dataclass(frozen=True)
class FabricInfo:
    """One answer of nvmlDeviceGetGpuFabricInfoV; `health_mask` is None where the driver gave none."""

    state: int
    status: int
    clique: int
    cluster: str  # the cluster uuid as 8-4-4-4-12 hex
    health_mask: int | None

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, f"state {self.state}")

    @property
    def status_name(self) -> str:
        return RETURN_NAMES.get(self.status, f"nvmlReturn {self.status}")

    def problems(self) -> list[str]:
        """Why a completed registration is not usable: its status, and each health field that says so."""
        out = [] if self.status == pynvml.NVML_SUCCESS else [f"status {self.status_name}"]
        return out + health_faults(self.health_mask or 0)


def health_faults(mask: int) -> list[str]:
    return [f"{name}={(mask >> shift) & width}" for name, shift, width, bad in HEALTH_FAULTS
            if (mask >> shift) & width in bad]


def _uuid(raw: Sequence[int]) -> str:
    h = bytes(raw).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def nvmlDeviceGetGpuFabricInfoV(handle: Any) -> FabricInfo:  # noqa: N802 - named for NVML_HANG
    """The GPU's fabric info (pynvml's binding and struct); raises pynvml.NVMLError as the call does.

    Named after the NVML call it makes: a GPU that hangs in it is reported as stuck there.
    """
    try:
        info: Any = pynvml.c_nvmlGpuFabricInfoV_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        mask: int | None = int(info.healthMask)
    except pynvml.NVMLError as e:
        if e.value not in (pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            raise
        info = pynvml.c_nvmlGpuFabricInfo_t()  # an older driver: the unversioned call, no health mask
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        mask = None
    return FabricInfo(state=int(info.state), status=int(info.status), clique=int(info.cliqueId),
                      cluster=_uuid(info.clusterUuid), health_mask=mask)


def cliques(infos: dict[str, FabricInfo]) -> dict[tuple[str, int], list[str]]:
    """The registered GPUs (bus ids) by (cluster uuid, clique id); one key on a healthy node."""
    out: dict[tuple[str, int], list[str]] = {}
    for bus, info in sorted(infos.items()):
        out.setdefault((info.cluster, info.clique), []).append(bus)
    return out
