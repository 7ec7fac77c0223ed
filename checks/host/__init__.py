"""The host check: configured disks, memory pressure and EDAC memory errors (`check.py`)."""

from checks.host.check import HostCheck

__all__ = ["HostCheck"]
