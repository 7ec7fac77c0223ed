"""The kernel check: /dev/kmsg matched against the kernel-log rules as the kernel logs (`check.py`)."""

from checks.kernel.check import KernelCheck

__all__ = ["KernelCheck"]
