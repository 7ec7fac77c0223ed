"""The host check: configured disks, memory pressure, EDAC memory errors and stuck tasks (`check.py`)."""

from checks.host.check import HostCheck

__all__ = ["HostCheck"]
