"""Built-in checks, in the order the runner starts them. Nothing registers itself at import."""

from __future__ import annotations

from checks.kernel import KernelCheck
from robustd.check import Check

BUILTIN: list[type[Check]] = [KernelCheck]

__all__ = ["BUILTIN", "KernelCheck"]
