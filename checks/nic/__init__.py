"""The NIC check: link state pushed by netlink, counters and InfiniBand ports polled (`check.py`)."""

from checks.nic.check import NicCheck

__all__ = ["NicCheck"]
