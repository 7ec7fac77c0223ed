"""A finished Slurm job as its hooks see it: its exit status (the epilog environment's words) and its logs,
read from their ends as root on paths the job's user chose. Shared by the node epilog (hooks.py) and the
controller's hook (ctld.py, ctld_triage.py), which read them alike.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import re
import stat
from typing import TYPE_CHECKING, Any, Mapping

from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.hung_job import JOB_ID
from robustd.adapters.slurm.slurmcli import Slurm, SlurmError
from robustd.roots import DEFAULT_PROC

if TYPE_CHECKING:
    from robustd.triage import LogText, Triage

log = logging.getLogger("robustd.slurm")


def job_failed(env: Mapping[str, str]) -> bool | None:
    """Slurm's epilog environment: SLURM_JOB_EXIT_CODE (a wait status), else SLURM_JOB_EXIT_CODE2 (`code:signal`)."""
    raw = env.get("SLURM_JOB_EXIT_CODE", "").strip()
    if raw.lstrip("-").isdigit():
        return int(raw) != 0
    two = env.get("SLURM_JOB_EXIT_CODE2", "").strip()
    if two:
        try:
            return any(int(p) != 0 for p in two.split(":"))
        except ValueError:
            return None
    return None


def job_status(env: Mapping[str, str]) -> tuple[int | None, str | None] | None:
    """(exit code, signal name) of the job: SLURM_JOB_EXIT_CODE is a wait status, SLURM_JOB_EXIT_CODE2
    `code:signal`. A job killed by a signal has no exit code (None); None when neither can be read."""
    from robustd.triage.status import signal_name

    def sig(n: int) -> str | None:
        try:
            return signal_name(str(n)) if n else None
        except ValueError:
            return None

    raw = env.get("SLURM_JOB_EXIT_CODE", "").strip()
    if raw.isascii() and raw.isdigit():
        status = int(raw)
        if status & 0x7F and status & 0x7F != 0x7F:  # WIFSIGNALED
            return None, sig(status & 0x7F)
        return (status >> 8) & 0xFF, None
    code, _, number = env.get("SLURM_JOB_EXIT_CODE2", "").strip().partition(":")
    try:
        c, n = int(code), int(number or 0)
    except ValueError:
        return None
    if not 0 <= c <= 255 or n < 0:
        return None
    return (c if c or not n else None), sig(n)


NO_DIAGNOSIS = frozenset({"user_code", "oom_gpu", "oom_host"})  # never a reason to test, let alone drain, a node
EPILOG_MAX_LOGS = 256  # logs one epilog reads (StdOut, StdErr and slurm.triage_logs matches together)
EPILOG_READ_BYTES = 64 << 20  # all of them together: each log's tail shrinks when there are many
EPILOG_MIN_TAIL = 64 << 10


def worth_diagnosing(t: Triage) -> bool:
    """Whether the stop-time tests may find what failed the job: the machine may be to blame and the judge
    says diagnose. A user's bug or an out-of-memory never costs the node a test or a drain."""
    return t.klass not in NO_DIAGNOSIS and t.infra in ("likely", "unknown") and t.next == "diagnose"


def _job_user(env: Mapping[str, str], info: Mapping[str, str]) -> tuple[int | None, str | None]:
    """The job's uid and user name: slurmd's environment, else scontrol's UserId=name(uid)."""
    uid_text = env.get("SLURM_JOB_UID", "").strip()
    name = env.get("SLURM_JOB_USER", "").strip() or None
    m = re.fullmatch(r"([^()\s]*)\((\d+)\)", info.get("UserId", ""))
    uid = int(uid_text) if uid_text.isascii() and uid_text.isdigit() else (int(m.group(2)) if m else None)
    if name is None and m and m.group(1):
        name = m.group(1)
    return uid, name


def _expand(text: str, job: str, user: str | None, quote: Any) -> str | None:
    """%j, %u and %% of `text` filled in; None for another %-code (%x, %N, ...) or %u without a user."""
    out = []
    parts = iter(re.split(r"(%.?)", text))
    for part in parts:
        if not part.startswith("%"):
            out.append(part)
        elif part == "%%":
            out.append("%")
        elif part == "%j":
            out.append(quote(job))
        elif part == "%u" and user:
            out.append(quote(user))
        else:
            return None
    return "".join(out)


def expand_pattern(pattern: str, job: str, user: str | None) -> str | None:
    """A `slurm.triage_logs` glob for this job: %j, %u and %% filled in (the values glob-escaped)."""
    return _expand(pattern, job, user, glob.escape)


def expand_path(path: str, job: str, user: str | None) -> str | None:
    """An output file name as submitted (`out-%j.txt`) for this job; None when it has codes only Slurm knows."""
    return _expand(path, job, user, lambda v: v)


def job_logs(cfg: SlurmConfig, slurm: Slurm, env: Mapping[str, str], job: str, max_logs: int = EPILOG_MAX_LOGS,
             read_bytes: int = EPILOG_READ_BYTES) -> list[LogText]:
    """The failed job's logs, each read from its end: StdOut and StdErr ($SLURM_JOB_STDOUT/STDERR, else
    `scontrol show job`), then every `slurm.triage_logs` match; at most `max_logs`, `read_bytes` in all.
    The node epilog and the controller's hook (robustd/adapters/slurm/ctld_triage.py) read them alike.

    The epilog runs as root on paths the job's user chose: a log is read only when it is a regular file
    owned by that user (a link to /etc/shadow, a FIFO or a device is skipped, never opened for reading).
    """
    from robustd.triage import MAX_LOG_BYTES

    info: dict[str, str] = {}
    uid, user = _job_user(env, info)
    given = [p for p in (env.get("SLURM_JOB_STDOUT", ""), env.get("SLURM_JOB_STDERR", "")) if p]
    # slurmd 22.05 hands the Epilog SLURM_JOB_STDOUT as submitted (`out-%j.txt`): %j, %u and %% are filled in
    # here; a name with other codes (%x, %N, %A, ...), or none at all, is asked of scontrol, which expands them.
    named = [expand_path(p, job, user) for p in given]
    if (not named or None in named) and JOB_ID.fullmatch(job):
        try:
            info = slurm.job(job)
            named = [info.get("StdOut", ""), info.get("StdErr", "")]
        except SlurmError as e:
            log.warning("job %s: cannot ask Slurm for its output files: %s", job, e)
        if uid is None or user is None:
            uid, user = _job_user(env, info)
    if uid is None:
        log.warning("job %s: the job's user is unknown (no SLURM_JOB_UID); its logs are not read", job)
        return []
    paths: dict[str, None] = {p: None for p in named if p and p.startswith("/")}
    for pattern in cfg.triage_logs:
        expanded = expand_pattern(pattern, job, user) if JOB_ID.fullmatch(job) else None
        if expanded is None:
            log.warning("job %s: slurm.triage_logs %r: no job id or user to fill in; skipped", job, pattern)
            continue
        for path in sorted(itertools.islice(glob.iglob(expanded), 4 * max_logs)):
            paths.setdefault(path, None)
    if len(paths) > max_logs:
        log.warning("job %s: %d logs found; the first %d are read", job, len(paths), max_logs)
    chosen = list(paths)[:max_logs]
    tail = max(min(EPILOG_MIN_TAIL, read_bytes), min(MAX_LOG_BYTES, read_bytes // max(1, len(chosen))))
    logs, seen = [], set()
    for path in chosen:
        got = read_owned(path, tail, uid)
        if isinstance(got, str):
            log.info("job %s: %s not read: %s", job, path, got)
            continue
        text, ident = got
        if ident not in seen:  # StdOut and StdErr are often one file
            seen.add(ident)
            logs.append(text)
    return logs


def read_owned(path: str, tail: int, uid: int) -> tuple[LogText, tuple[int, int]] | str:
    """The last `tail` bytes of `path` if it is a regular file owned by `uid`; else why not (a short text).

    Opened with O_PATH|O_NOFOLLOW first (no device is ever opened, no final symlink followed), checked on
    that descriptor, then reopened for reading through it, so a name swapped meanwhile cannot redirect the read.
    """
    from robustd.triage.reader import read_tail

    try:
        pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return e.strerror or str(e)
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_uid != uid:
            return f"owned by uid {st.st_uid}, not the job's user (uid {uid})"
        try:
            fd = os.open(os.path.join(DEFAULT_PROC, "self", "fd", str(pfd)), os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as e:
            return e.strerror or str(e)
    finally:
        os.close(pfd)
    try:
        return read_tail(fd, tail, path), (st.st_dev, st.st_ino)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        os.close(fd)
