"""NVML field values, many in one call, through a preallocated plain ctypes array.

Why not `pynvml.nvmlDeviceGetFieldValues`: it builds a new array on every call, and its structure
(`_PrintableStructure`) sends every attribute write and read through Python-level `__setattr__` and
`__getattribute__`. For the NVLink state of 18 links on 8 GPUs every second, that wrapper cost as
much as the 144 `nvmlDeviceGetNvLinkState` calls it replaced (yappi: 0.55 ms a GPU a poll, against
0.08 ms with this array). The layout is pynvml's own (`c_nvmlFieldValue_t._fields_`, from nvml.h),
the function comes from pynvml's table and a failed call raises pynvml's NVMLError, so nothing here
departs from how pynvml talks to the driver; only the Python wrapper is lighter.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import pynvml

_MEMBER = {pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
           pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
           pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal", pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
           pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal"}


class _FieldValue(ctypes.Structure):
    _fields_ = pynvml.c_nvmlFieldValue_t._fields_


class FieldBatch:
    """The same fields (id, scope) asked of one GPU every poll."""

    def __init__(self, asked: Sequence[tuple[int, int]]):
        self.asked = tuple(asked)
        self._values = (_FieldValue * len(self.asked))()
        for v, (field_id, scope) in zip(self._values, self.asked, strict=True):
            v.fieldId, v.scopeId = field_id, scope

    def nvmlDeviceGetFieldValues(self, handle: Any) -> list[tuple[int, int]]:  # noqa: N802 - named for NVML_HANG
        """(nvmlReturn, value) per field in the order asked; the value is 0 where nvmlReturn is an error.

        Named after the NVML call it makes: a GPU that hangs in it is reported as stuck there.
        """
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
        pynvml._nvmlCheckReturn(fn(handle, ctypes.c_int(len(self.asked)), self._values))
        return [(v.nvmlReturn, int(getattr(v.value, _MEMBER.get(v.valueType, "uiVal")))
                 if v.nvmlReturn == pynvml.NVML_SUCCESS else 0) for v in self._values]
