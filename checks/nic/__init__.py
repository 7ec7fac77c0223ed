"""The NIC check: link state pushed by netlink, counters and InfiniBand ports polled (`check.py`).

The class is imported on first use: `checks.nic.config` and `checks.nic.parse` need no pyroute2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `X as X`: re-exported, as `__all__` says
    from checks.nic.check import NicCheck as NicCheck

__all__ = ["NicCheck"]


def __getattr__(name: str) -> Any:
    if name == "NicCheck":
        from checks.nic.check import NicCheck

        return NicCheck
    raise AttributeError(f"module 'checks.nic' has no attribute {name!r}")
