"""Files replaced whole: a reader sees the old file or the complete new one, never half of one.

One place for the pattern robustd's writers share (evidence bundles, the adapters' state files, saved stacks,
exported archives, the straggler recorder's traces, the NVML emulator's state): write a temporary file beside
the target, optionally fsync it, rename it onto the target, and remove the temporary file when anything fails.
The standard library has the parts (tempfile.mkstemp, os.replace) but not the whole; this module is the whole.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], mode: int = 0o644, durable: bool = False) -> Iterator[str]:
    """A temporary file's name beside `path` (created empty with `mode`): write it in the block; when the
    block ends it is renamed onto `path` (fsynced first, and the directory after, when `durable`). When the
    block raises, the temporary file is removed and `path` is left as it was."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        os.close(fd)
        fd = -1
        yield tmp
        if durable:
            _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        with contextlib.suppress(OSError):  # a file system that cannot sync a directory keeps the rename
            _fsync(directory, os.O_RDONLY | os.O_DIRECTORY)


def write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644, durable: bool = False) -> None:
    """`data` as the whole of `path`, replaced atomically (see replacing)."""
    with replacing(path, mode, durable) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
