"""The NIC check: link state pushed by netlink, counters and InfiniBand ports polled (`check.py`).

The class is imported on first use: `checks.nic.config` and `checks.nic.parse` need no pyroute2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checks.common.exports import lazy

if TYPE_CHECKING:  # `X as X`: re-exported, as `__all__` says
    from checks.nic.check import NicCheck as NicCheck

__all__ = ["NicCheck"]
__getattr__ = lazy("checks.nic", {"NicCheck": "checks.nic.check"})
