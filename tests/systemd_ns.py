"""A real systemd as PID 1 of its own PID, mount, UTS, IPC and cgroup namespaces, on a Debian 12 root.

PID 1 of the test machine is not systemd, so the packaged unit would otherwise only ever be checked
by `systemd-analyze`. Here a minimal Debian root made by `debootstrap` (once, cached under
build/systemd-root) is the lower layer of an overlay (each run writes only to its own upper
layer, so the cache stays pristine), bind-mounted onto itself with proc, sys, cgroup2, a small
/dev, run and tmp mounted inside, and `pivot_root`ed into: systemd wants `/` to be a mount point,
and a plain chroot fails on shared mount propagation. Then `/lib/systemd/systemd --system` runs as
PID 1 of the new PID namespace in container mode (`container=`), and `nsenter -t PID -a` runs
systemctl, journalctl and dpkg inside. It is stopped through its own poweroff signal, with a
bounded wait and SIGKILL after it (which ends the whole PID namespace).

What differs from a host: /dev holds only null, zero, full, random, urandom, tty and the host's
kmsg (bind mounts; /dev/kmsg is the host's kernel log, so a line written there is seen by the
nested robustd), and /dev/console is a bind of a log file. No network namespace: units share the
host's network. The cgroup tree is a fresh cgroup under the host's cgroup2 hierarchy, seen as the
root through the cgroup namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

from robustd.adapters.common.statefile import LockTimeout, exclusive_lock

SUITE = "bookworm"
# systemd as init; libcap2-bin for capsh, to name the capabilities a process holds. The caller adds what
# the package under test depends on. util-linux (nsenter, used inside) is Essential, so in minbase.
BASE_PACKAGES = ("systemd", "libcap2-bin")
MIRROR = os.environ.get("ROBUSTD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
STAMP = ".robustd-test-root"
PR_SET_PDEATHSIG = 1
# Units of the Debian root that would only add noise or touch the host: timers that run apt and fstrim,
# gettys (there is no tty to run them on).
MASKED = ("apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer",
          "fstrim.timer", "e2scrub_reap.service", "getty.target", "console-getty.service")
JOURNALD_CONF = ("[Journal]\n# The nested journald would otherwise import the host's whole kernel log.\n"
                 "ReadKMsg=no\nStorage=volatile\nRateLimitBurst=0\n")
INSIDE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
              "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", "DEBIAN_FRONTEND": "noninteractive", "TERM": "dumb"}

# Runs inside the new namespaces (as their PID 1 until the exec): $1 lower, $2 upper, $3 work, $4 merged,
# $5 the console log.
LAUNCH = r"""
set -eu
lower=$1 upper=$2 work=$3 merged=$4 console=$5
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$merged"
cd "$merged"
mount -t proc proc proc
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs sys
mount -t cgroup2 cgroup2 sys/fs/cgroup
mount -t tmpfs -o mode=755,size=16m,nosuid tmpfs dev
for n in null zero full random urandom tty kmsg; do touch "dev/$n"; mount --bind "/dev/$n" "dev/$n"; done
touch dev/console; mount --bind "$console" dev/console
mkdir -p dev/pts dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts dev/pts
ln -s pts/ptmx dev/ptmx
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs dev/shm
ln -s /proc/self/fd dev/fd
ln -s /proc/self/fd/0 dev/stdin; ln -s /proc/self/fd/1 dev/stdout; ln -s /proc/self/fd/2 dev/stderr
mount -t tmpfs -o mode=755,size=256m,nosuid,nodev tmpfs run
mount -t tmpfs -o mode=1777,size=256m,nosuid,nodev tmpfs tmp
mkdir -p .host-root
pivot_root . .host-root
cd /
umount -l /.host-root
rmdir /.host-root
export container=robustd-test
exec /lib/systemd/systemd --system --show-status=0 --log-target=journal
"""


class NestedError(AssertionError):
    """The nested systemd could not be made, started or reached (a fixture failure, with the reason)."""


def ensure_root(path: Path, packages: Sequence[str] = (), timeout: float = 900) -> float:
    """Make the Debian root at `path` with BASE_PACKAGES and `packages` unless a complete one is there;
    seconds spent (0.0 when cached).

    A root is complete when its stamp names this suite and package list (so a new dependency makes a new
    root); a partial one (an interrupted debootstrap) has no stamp and is made again. A lock keeps two
    test runs from making it at once.
    """
    include = sorted({*BASE_PACKAGES, *packages})
    want = f"{SUITE} minbase {' '.join(include)} masked={','.join(MASKED)}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / (path.name + ".lock"), timeout):
        stamp = path / STAMP
        if stamp.exists() and stamp.read_text() == want:
            return 0.0
        t = time.monotonic()
        new = path.parent / (path.name + ".new")
        shutil.rmtree(new, ignore_errors=True)
        p = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(include)}", SUITE, str(new),
                            MIRROR], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise NestedError(f"debootstrap {SUITE} from {MIRROR} exited {p.returncode}:\n"
                              f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        _customize(new)
        (new / STAMP).write_text(want)
        shutil.rmtree(path, ignore_errors=True)
        new.rename(path)
        return time.monotonic() - t


def _customize(root: Path) -> None:
    etc = root / "etc" / "systemd" / "system"
    for unit in MASKED:
        link = etc / unit
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("/dev/null")
    shutil.rmtree(etc / "getty.target.wants", ignore_errors=True)
    default = etc / "default.target"
    if default.is_symlink() or default.exists():
        default.unlink()
    default.symlink_to("/lib/systemd/system/multi-user.target")
    conf = root / "etc" / "systemd" / "journald.conf.d"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "robustd-test.conf").write_text(JOURNALD_CONF)
    (root / "etc" / "machine-id").write_text("")  # empty: each boot gets its own transient id
    (root / "etc" / "hostname").write_text("robustd-nested\n")


@contextlib.contextmanager
def _locked(path: Path, timeout: float):  # type: ignore[no-untyped-def]
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(str(path), timeout, f"{path} stayed locked for {timeout:.0f}s",
                                              mode=0o644, every=0.5))
        except LockTimeout as e:
            raise NestedError(str(e)) from None
        yield


def cgroup2_mount() -> Path:
    """Where the host's cgroup2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return Path(left.split()[4])
    raise NestedError("no cgroup2 hierarchy is mounted on this host; systemd needs one")


class NestedSystemd:
    """One booted systemd on an overlay of `root`; its files live under `workdir` until `stop()`."""

    def __init__(self, root: Path, workdir: Path):
        self.root = root
        self.workdir = workdir
        self.console = workdir / "console.log"
        self.cgroup = cgroup2_mount() / f"robustd-test-{uuid.uuid4().hex[:12]}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0  # PID 1 of the namespace, as the host numbers it

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> float:
        """Boot until `systemctl is-system-running` says running (or degraded); seconds it took."""
        for d in ("upper", "work", "merged"):
            (self.workdir / d).mkdir(parents=True)
        self.console.touch()
        try:
            self.cgroup.mkdir()
        except OSError as e:
            raise NestedError(f"cannot make a cgroup for the nested systemd: {e}") from None
        t = time.monotonic()
        log = open(self.workdir / "launch.log", "wb")  # noqa: SIM115 - the launcher's for its life
        cgroup_procs = str(self.cgroup / "cgroup.procs")

        def into_cgroup() -> None:  # before unshare's own exec: the cgroup namespace is rooted here
            with open(cgroup_procs, "w") as f:
                f.write(str(os.getpid()))
            # If the test process dies, unshare dies with it, and its --kill-child takes PID 1 along.
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--cgroup", "--propagation", "private",
             "--kill-child", "--", "/bin/sh", "-c", LAUNCH, "launch", str(self.root), str(self.workdir / "upper"),
             str(self.workdir / "work"), str(self.workdir / "merged"), str(self.console)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=into_cgroup,
            start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        while not self.pid:
            self._alive_or_fail()
            with contextlib.suppress(OSError, ValueError, IndexError):
                self.pid = int(children.read_text().split()[0])
            if time.monotonic() > deadline:
                raise NestedError("unshare started no child")
            time.sleep(0.02)
        state = ""
        while state not in ("running", "degraded"):
            self._alive_or_fail()
            if time.monotonic() > deadline:
                raise NestedError(f"systemd did not finish booting within {timeout:.0f}s (state {state!r}):\n"
                                  + self.run("systemctl", "list-jobs", "--no-legend", check=False).stdout[-2000:])
            state = self.run("systemctl", "is-system-running", check=False, timeout=10).stdout.strip()
            time.sleep(0.1)
        return time.monotonic() - t

    def _alive_or_fail(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise NestedError(f"the nested systemd exited with {self.proc.returncode}:\n{self.launch_log()}")

    def launch_log(self) -> str:
        text = ""
        for name in ("launch.log", "console.log"):
            with contextlib.suppress(OSError):
                text += (self.workdir / name).read_text(errors="replace")[-3000:]
        return text

    def stop(self, timeout: float = 30) -> float:
        """Power off (SIGRTMIN+4 to PID 1), wait at most `timeout`, then SIGKILL; seconds until it was gone."""
        t = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # unshare's --kill-child ends PID 1 when unshare goes
                os.kill(self.pid, signal.SIGRTMIN + 4) if self.pid else self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid or self.proc.pid, signal.SIGKILL)  # ends every process of the namespace
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        took = time.monotonic() - t
        self._remove_cgroup()
        return took

    def _remove_cgroup(self) -> None:
        if not self.cgroup.exists():
            return
        with contextlib.suppress(OSError):
            (self.cgroup / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + 5
        while self.cgroup.exists() and time.monotonic() < deadline:
            dirs = sorted((p for p in self.cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            for d in [*dirs, self.cgroup]:
                with contextlib.suppress(OSError):
                    d.rmdir()
            time.sleep(0.05)

    # -- inside --------------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 60, input: str | None = None
            ) -> subprocess.CompletedProcess[str]:
        """`argv` inside every namespace of PID 1 (its root, its PID numbers), with a plain environment."""
        p = subprocess.run(["nsenter", "-t", str(self.pid), "-a", "--", *argv], capture_output=True, text=True,
                           timeout=timeout, env=INSIDE_ENV, input=input,
                           stdin=None if input is not None else subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} (inside) exited {p.returncode}:\n{p.stdout[-3000:]}\n"
                                 f"{p.stderr[-3000:]}")
        return p

    def path(self, inside: str) -> Path:
        """A path of the nested root as the host reaches it (through PID 1's root)."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 30, every: float = 0.1,
                 detail: Callable[[], str] | None = None) -> None:
        """Poll `predicate` until true; past `timeout`, fail naming `what` (and `detail()`, e.g. a unit's journal)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout:g}s: {what}" + (f"\n{detail()}" if detail else ""))
            time.sleep(every)


def workdir(base: Path) -> Path:
    """A fresh directory for one nested systemd's overlay layers, beside the cached root (same file system)."""
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="systemd-run-", dir=base))
