"""The services check: NVIDIA host services' systemd units, watched through systemd's D-Bus API (`check.py`)."""

from checks.services.check import ServicesCheck

__all__ = ["ServicesCheck"]
