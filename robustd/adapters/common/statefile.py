"""An adapter's state file (what it did and why, and its Watch position): locked while used, replaced atomically.

Several processes may use one state file at the same moment (robustd-slurm and the Slurm hooks:
HealthCheckProgram, Prolog, Epilog), so every read-decide-act-write pass holds an flock on
`<state_file>.lock`, and reads the file afresh under it: nobody writes from a stale copy. A write goes
to a temporary file that is fsynced and renamed over the old one (then the directory is fsynced), so a
crash or power loss leaves the old state or the new one, never half of either. A write that would not
change the file (the same bytes, and the file still the one this object last read or wrote) is skipped:
most passes change nothing. A file that cannot be read as a state (corrupt, another version, not UTF-8)
is set aside as `<state_file>.corrupt` and the adapter starts afresh, saying so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from typing import Any, Callable, Generic, Iterator, Protocol, TypeVar

from robustd import atomicfile

log = logging.getLogger("robustd.adapters")

MAX_STATE_BYTES = 16 << 20  # a state file is a few KB; a larger one is not ours to parse whole


class Saved(Protocol):
    def to_json(self) -> dict[str, Any]: ...


S = TypeVar("S", bound=Saved)


class LockTimeout(Exception):
    """Another process of the adapter held the state lock for longer than we could wait."""


class StateFile(Generic[S]):
    """One adapter's state file. `parse` turns the saved JSON into a state (ValueError if it is not one),
    `empty` makes the state of an adapter with none; `owner` names the adapter in messages, and `aside` is what
    the log adds when a corrupt file is set aside (what survives without it)."""

    def __init__(self, path: str, parse: Callable[[Any], S], empty: Callable[[], S], owner: str, aside: str = ""):
        self.path = path
        self.lock_path = path + ".lock"
        self.owner = owner
        self.parse = parse
        self.empty = empty
        self.aside = aside
        self._known: tuple[bytes, tuple[int, int, int, int]] | None = None  # the file's bytes as last read/written

    @staticmethod
    def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
        """Which file this is and whether it changed: another writer's rename brings a new inode."""
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def read(self) -> S:
        """The saved state; an empty one when there is none. A corrupt file is set aside (and said so)."""
        self._known = None
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_STATE_BYTES + 1)
                identity = self._identity(os.fstat(f.fileno()))
        except FileNotFoundError:
            return self.empty()
        try:
            if len(raw) > MAX_STATE_BYTES:
                raise ValueError(f"larger than {MAX_STATE_BYTES >> 20} MiB")
            st = self.parse(json.loads(raw.decode("utf-8")))  # UnicodeDecodeError, JSONDecodeError: ValueErrors
        except ValueError as e:
            aside = f"{self.path}.corrupt"
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error("state file %s is unusable (%s); moved to %s, starting afresh%s", self.path, e, aside,
                      f" ({self.aside})" if self.aside else "")
            return self.empty()
        self._known = (raw, identity)
        return st

    def write(self, st: S) -> None:
        data = json.dumps(st.to_json(), separators=(",", ":")).encode()
        if self._known is not None and self._known[0] == data:
            try:
                if self._identity(os.stat(self.path)) == self._known[1]:
                    return  # the file holds these bytes already
            except FileNotFoundError:
                pass
        self._known = None
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, mode=0o750, exist_ok=True)
        atomicfile.write_bytes(self.path, data, mode=0o640, durable=True)
        with contextlib.suppress(OSError):
            self._known = (data, self._identity(os.stat(self.path)))

    @contextlib.contextmanager
    def locked(self, timeout: float) -> Iterator[None]:
        """Hold the state lock for the block; LockTimeout if it cannot be had within `timeout` seconds."""
        os.makedirs(os.path.dirname(self.lock_path) or ".", mode=0o750, exist_ok=True)
        with exclusive_lock(self.lock_path, timeout, f"{self.lock_path} is held by another {self.owner} process"):
            yield


@contextlib.contextmanager
def exclusive_lock(path: str, timeout: float, held: str, mode: int = 0o640, every: float = 0.01) -> Iterator[None]:
    """An exclusive flock on `path` (created with `mode`) for the block, tried every `every` seconds;
    LockTimeout(`held`) if it cannot be had within `timeout`. Closing the file releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                if time.monotonic() >= deadline:
                    raise LockTimeout(held) from None
                time.sleep(every)
        yield
    finally:
        os.close(fd)
