"""One fast reader for the small sysfs/procfs files every poll reads.

`open()` with a text wrapper costs ~12 µs a file; a raw os.open/os.read ~3 µs. At 1 s
polls over hundreds of attribute files that is most of the checks' CPU.
"""

from __future__ import annotations

import os


def read_text(path: str) -> str:
    """The file's text (at most 64 KiB, plenty for an attribute); raises OSError like open()."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    return data.decode("ascii", "replace")
