"""Exports imported on first use, for the `checks` package and the check folders whose check needs a driver
library (pynvml, pyroute2): importing the package, its config.py or its parse.py must not load that library.

`lazy(package, names)` is the package's module `__getattr__` (PEP 562): `names` maps each exported name to
the module that defines it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
