"""systemd glue: sd_notify (READY, WATCHDOG, STATUS, STOPPING) and journald logging.

Uses libsystemd through systemd-python, so NOTIFY_SOCKET (path or abstract) and the
watchdog variables behave exactly as systemd documents them.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("robustd.systemd")


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self.watchdog_interval = _watchdog_interval()

    def send(self, state: str) -> None:
        if not self.enabled:
            return
        try:
            try:
                from systemd import daemon
            except ImportError:  # e.g. a package whose systemd-python wheel does not load on this distribution
                _notify_datagram(state)
                return
            daemon.notify(state)
        except Exception as e:  # noqa: BLE001 - notification failures must not stop the daemon
            log.warning("sd_notify(%s) failed: %s", state.split("=")[0], e)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self) -> None:
        self.send("STOPPING=1")


def _notify_datagram(state: str) -> None:
    """sd_notify's wire protocol without libsystemd: one datagram to $NOTIFY_SOCKET.

    Without it, Type=notify would time out wherever systemd-python cannot be installed.
    """
    import socket

    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # an abstract socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.sendto(state.encode(), addr)


def _watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC (as sd_watchdog_enabled advises), or None when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


def setup_logging(level: str, identifier: str = "robustd") -> None:
    """journald (with structured fields, SYSLOG_IDENTIFIER `identifier`) under systemd, plain stderr otherwise."""
    root = logging.getLogger()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler | None = None
    if os.environ.get("JOURNAL_STREAM") and os.environ.get("INVOCATION_ID"):
        try:
            from systemd.journal import JournalHandler

            handler = JournalHandler(SYSLOG_IDENTIFIER=identifier)
        except ImportError:
            pass  # stderr below: systemd puts it in the journal too, without the structured fields
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)


def fatal(text: str) -> None:
    """Why the program cannot start, on stderr; at priority err when stderr is the journal.

    Under systemd, stderr lines are stored at priority info, so `journalctl -p err` would show only
    systemd's "Failed to start"; a `<3>` prefix (SyslogLevelPrefix=, on by default) files each line
    at err. JOURNAL_STREAM names the stream systemd connected, so a redirected stderr gets no prefix.
    """
    prefix = "<3>" if _stderr_is_journal() else ""
    sys.stderr.write("".join(f"{prefix}{line}\n" for line in text.splitlines() or [""]))
    sys.stderr.flush()


def _stderr_is_journal() -> bool:
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return bool(ino) and (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        return False
