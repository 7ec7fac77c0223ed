"""Whom the Unix socket's path may belong to: the rule robustd keeps for its socket's directory, and the check
every client of the socket makes before it trusts an answer.

A local user who can write to the socket's directory can take the socket's name, sticky bit or not: plant a
file there so that robustd cannot start, or bind a listener of their own while robustd is down and answer
"OK, 0 conditions" to root's robustctl, a Slurm hook or an adapter. So the socket's directory must be writable
by its owner only, and owned by a trusted uid; a directory above it may be writable by others only when it is
sticky (as /tmp is: nobody else may rename or remove the trusted directory inside it), and a symlink on the
way must not belong to another user. The daemon refuses to start otherwise (`listen.unix: ...`), and every
client (robustctl, robustd-slurm, robustd-k8s, the Slurm hooks, `robustctl fleet`) refuses such a path, and a
socket that is not owned by a trusted uid, before it connects.

Trusted uids are root and the caller's own effective uid: robustd runs as root (systemd/robustd.service),
and a developer who runs it as themselves (`make run`) talks to it as themselves. No config key names
another uid for robustd.

Checking a path and then connecting to it is a race in general (TOCTOU). Here it is not one another user
can win: the check requires every directory that holds the name, or could be renamed away with it, to be
writable only by trusted uids (or sticky), so between the check and gRPC's connect() (and its reconnects)
only root or the caller could change what the path names. Verifying the peer after connecting
(SO_PEERCRED) would be better still, but grpcio opens its own connections and exposes none of them; a
separate probe connection would be checked and then not used, the same race again.
"""

from __future__ import annotations

import os
import pwd
import stat

SOCKET_DIR_HINT = "/run/robustd"  # where the systemd unit puts it (RuntimeDirectory=robustd, mode 0755)


class UntrustedSocket(Exception):
    """The socket, or a directory on its way, could be another user's: one line that names them."""


def trusted_uids() -> frozenset[int]:
    """Who may own the socket and the directories on its way: root and this process's own uid."""
    return frozenset({0, os.geteuid()})


def describe_uid(uid: int) -> str:
    """`uid 65534 (nobody)`; the number alone for a uid without a name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _trusted_text(trusted: frozenset[int]) -> str:
    others = [describe_uid(u) for u in sorted(trusted - {0})]
    return " or ".join(["root", *others])


def directory_problem(directory: str, trusted: frozenset[int]) -> str | None:
    """Why another user could take the socket's name in `directory`, as a phrase that names what to fix; None
    when nobody but `trusted` can.

    Refused: the socket's own directory when anyone but its owner may write to it (sticky or not: the sticky
    bit stops others removing robustd's socket, not creating one while it is absent); a directory above it
    that others may write to and that is not sticky (they could rename the subtree away and put their own in
    its place); any of them owned by an untrusted uid; a symlink on the way that an untrusted uid owns.
    """
    lexical = os.path.abspath(directory)
    real = os.path.realpath(lexical)
    prefixes = _prefixes(lexical)
    dirs = dict.fromkeys([*_prefixes(real), *(os.path.realpath(os.path.dirname(p)) for p in prefixes)])
    for p in prefixes:
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"socket directory {lexical}: {p}: {e.strerror}"
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            return (f"socket directory {lexical}: {p} is a symlink owned by {describe_uid(st.st_uid)}, who could "
                    "point it elsewhere; use a path without it")
    for d in dirs:
        try:
            st = os.stat(d)  # a real path: no symlinks left to follow
        except OSError as e:
            return f"socket directory {lexical}: {d}: {e.strerror}"
        own = d == real
        label = f"socket directory {lexical}" if own else f"{d}, above the socket directory {lexical},"
        if st.st_uid not in trusted:
            return (f"{label} is owned by {describe_uid(st.st_uid)}, who could put their own socket in robustd's "
                    f"place; use a directory owned by root, such as {SOCKET_DIR_HINT}")
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if own and writable:
            return (f"{label} is writable by group/others (mode {stat.S_IMODE(st.st_mode):04o}): another user "
                    "could take the socket's name, sticky bit or not, and answer in robustd's place; use a "
                    f"directory only root can write, such as {SOCKET_DIR_HINT}")
        if writable and not st.st_mode & stat.S_ISVTX:
            return (f"{label} is writable by group/others and not sticky: another user could rename it away and "
                    f"put their own in its place; use a directory only root can write, such as {SOCKET_DIR_HINT}")
    return None


def check_socket(path: str, trusted: frozenset[int] | None = None) -> None:
    """Before a client connects to `path`: raise UntrustedSocket unless the socket is robustd's to give.

    The socket must be a socket owned by a trusted uid (root, or the caller), reached through no symlink that
    someone else owns, in a directory that passes `directory_problem` (see the module's docstring for why that
    makes the check hold until the connection is made). OSError when the path cannot be read at all.
    """
    trusted = trusted_uids() if trusted is None else trusted
    lexical = os.path.abspath(path)
    st = os.lstat(lexical)
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
        raise UntrustedSocket(f"refusing {lexical}: it is a symlink owned by {describe_uid(st.st_uid)}, not "
                              f"{_trusted_text(trusted)}; another user may be impersonating robustd")
    real = os.path.realpath(lexical)
    problem = directory_problem(os.path.dirname(lexical), trusted)
    if problem is None and os.path.dirname(real) != os.path.realpath(os.path.dirname(lexical)):
        problem = directory_problem(os.path.dirname(real), trusted)  # a symlinked socket: where it really is
    if problem is not None:
        raise UntrustedSocket(f"refusing {lexical}: {problem}")
    st = os.lstat(real)
    what = "it" if real == lexical else real
    if not stat.S_ISSOCK(st.st_mode):
        raise UntrustedSocket(f"refusing {lexical}: {what} is not a socket")
    if st.st_uid not in trusted:
        raise UntrustedSocket(f"refusing {lexical}: {what} is owned by {describe_uid(st.st_uid)}, not "
                              f"{_trusted_text(trusted)}; another user may be impersonating robustd")


def _prefixes(path: str) -> list[str]:
    """`/a/b/c` → [`/a`, `/a/b`, `/a/b/c`]; `/` itself is checked as the directory above `/a`."""
    parts = [p for p in path.split(os.sep) if p]
    return [os.sep + os.sep.join(parts[:i]) for i in range(1, len(parts) + 1)] or [os.sep]
