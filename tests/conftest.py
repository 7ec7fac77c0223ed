"""Shared fixtures: a real robustd daemon in a child process, reached over its real Unix socket."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import yaml

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REAL_BOOT_ID = "/proc/sys/kernel/random/boot_id"
KMSG = "/dev/kmsg"


def need_root(what: str) -> None:
    """Tests that need root fail under CI=true (CI runs as root) and skip elsewhere."""
    if os.geteuid() == 0:
        return
    if IN_CI:
        pytest.fail(f"needs root for {what}, and CI=true: CI must run as root")
    pytest.skip(f"needs root for {what}")


def inject_kmsg(*lines: str) -> None:
    """Write lines into the real kernel log, as operators and fault injectors do."""
    need_root("writing /dev/kmsg")
    for line in lines:
        fd = os.open(KMSG, os.O_WRONLY)
        try:
            # A record is read back only once its newline is written (seen on 6.18).
            os.write(fd, (line if line.endswith("\n") else line + "\n").encode())
        finally:
            os.close(fd)


def bdf() -> str:
    """A PCI address no other test uses, so lines from earlier tests can never be confused."""
    n = uuid.uuid4().int
    return f"{n % 0xffff:04x}:{(n >> 16) % 0xff:02x}:00"


def cond(v: pb.Verdict, code: str, component: str | None = None) -> pb.Condition | None:
    """The first condition of `v` with `code` (and `component`, when given), or None."""
    for c in v.conditions:
        if c.code == code and (component is None or c.component == component):
            return c
    return None


def eventually(fn: Callable[[], Any], timeout: float, what: str, every: float = 0.02,
               detail: Callable[[], str] = lambda: "") -> Any:
    """fn()'s first truthy value within `timeout` seconds, else an AssertionError naming `what` and `detail()`."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}\n{detail()}")
        time.sleep(every)


def terminate(proc: subprocess.Popen[Any]) -> int | None:
    """SIGTERM, 15 s to exit, then SIGKILL: a child stopped as systemd stops a service; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def builtin_check_names() -> list[str]:
    from checks import BUILTIN

    return [c.name for c in BUILTIN]


class Daemon:
    """One robustd process with its own config, socket, state dir and (fake) boot id file."""

    def __init__(self, root: Path, config: dict[str, Any], env: dict[str, str] | None = None):
        self.root = root
        self.socket = str(root / "robustd.sock")
        self.state_dir = str(root / "state")
        self.boot_id_file = root / "boot_id"
        self.config_path = root / "robustd.yaml"
        self.log_path = root / "robustd.log"
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        if not self.boot_id_file.exists():
            self.boot_id_file.write_text(Path(REAL_BOOT_ID).read_text())
        base: dict[str, Any] = {
            "node_name": "test-node",
            "state_dir": self.state_dir,
            "boot_id_path": str(self.boot_id_file),
            "listen": {"unix": self.socket},
            # Hardware checks read the real host; a test enables the ones it is about.
            "checks": {"kernel": {"lookback": "0s"},
                       **{name: {"enabled": False} for name in builtin_check_names() if name != "kernel"}},
        }
        self.config = merge(base, config)
        self.write_config()

    def write_config(self, config: dict[str, Any] | None = None) -> None:
        if config is not None:
            self.config = merge(self.config, config)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    wrap: list[str] = []  # e.g. ["ip", "netns", "exec", NAME] to run the daemon in a network namespace
    cwd: Path = REPO  # the daemon's working directory (relative paths in its config resolve against it)

    def command(self, *extra: str) -> list[str]:
        return [*self.wrap, sys.executable, "-m", "robustd.daemon", "--config", str(self.config_path), *extra]

    def start(self, *extra: str, wait: bool = True, timeout: float = 20.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if "NOTIFY_SOCKET" not in self.env:
            env.pop("NOTIFY_SOCKET", None)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - held for the child's lifetime
        self.proc = subprocess.Popen(self.command(*extra), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, cwd=self.cwd, stdin=subprocess.DEVNULL)  # whatever the suite's stdin
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"robustd exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket):
                try:
                    with self.channel() as ch:
                        pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=2)
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"robustd did not answer within {timeout}s:\n{self.log()}")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.socket}")

    def stub(self) -> pb_grpc.NodeHealthStub:
        """A stub on a fresh channel; the channel closes with the test's garbage."""
        return pb_grpc.NodeHealthStub(self.channel())

    def verdict(self) -> pb.Verdict:
        with self.channel() as ch:
            return pb_grpc.NodeHealthStub(ch).GetVerdict(pb.GetVerdictRequest(), timeout=5)

    def wait_for(self, predicate: Any, timeout: float = 5.0) -> pb.Verdict:
        """Poll GetVerdict until predicate(verdict) is true."""
        deadline = time.monotonic() + timeout
        v = self.verdict()
        while not predicate(v):
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout}s; verdict:\n{v}\nlog:\n{self.log()}")
            time.sleep(0.02)
            v = self.verdict()
        return v

    def robustctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "--socket", self.socket, *args],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: no cleanup runs, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        terminate(self.proc)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def restart(self, *extra: str) -> None:
        self.stop()
        self.start(*extra)

    def reboot(self) -> None:
        """Pretend the host rebooted: a new boot id for the next start."""
        import uuid

        self.boot_id_file.write_text(str(uuid.uuid4()) + "\n")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`b` over `a`, nested mappings merged key by key (config overrides in tests)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: Unix socket paths must stay under 108 bytes."""
    d = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` mounted at `path` (made if missing) for the block; lazily unmounted after."""
    need_root("mounting a tmpfs")
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def make_daemon(short_tmp: Path) -> Iterator[Any]:
    """Factory: make_daemon(config_overrides, env=...) -> Daemon (not started). Stops all at teardown."""
    made: list[Daemon] = []

    def factory(config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                name: str = "d") -> Daemon:
        root = short_tmp / f"{name}{len(made)}"
        root.mkdir()
        d = Daemon(root, config or {}, env)
        made.append(d)
        return d

    yield factory
    for d in made:
        d.stop()


@pytest.fixture
def daemon(make_daemon: Any) -> Daemon:
    """A started daemon with the default checks (the kernel check on the real /dev/kmsg)."""
    need_root("reading /dev/kmsg")
    d = make_daemon()
    d.start()
    return d


def python_with_torch(root: Path, torch_init: str) -> str:
    """An interpreter (a wrapper script under `root`) whose `import torch` runs `torch_init` instead: a stand-in
    torch put first on PYTHONPATH, for the child and every process it starts."""
    (root / "shadow" / "torch").mkdir(parents=True)
    (root / "shadow" / "torch" / "__init__.py").write_text(torch_init)
    wrapper = root / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={root / "shadow"}${{PYTHONPATH:+:$PYTHONPATH}} '
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture(scope="session")
def python_without_torch(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter whose `import torch` fails, as with a torch built for another CUDA."""
    return python_with_torch(tmp_path_factory.mktemp("notorch"),
                             'raise ImportError("torch is not usable here: libcudart.so.12: cannot open shared '
                             'object file")\n')


def stragglers_cli(*argv: str) -> tuple[int, str]:
    """`robustctl stragglers ARGV... [--json]` in process: its exit status and what it printed."""
    import argparse
    import io

    from robustd.cli import stragglers as cli

    p = argparse.ArgumentParser(prog="robustctl stragglers")
    cli.add_parser(p, lambda v, top: v.add_argument("--json", action="store_true"))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.run(p.parse_args(list(argv)))
    return code, buf.getvalue()


def plugin_env(tmp: Path) -> dict[str, str]:
    """Install the test checks as a real distribution with `robustd.checks` entry points."""
    dist = tmp / "plugins" / "robustd_test_plugins-1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: robustd-test-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[robustd.checks]\nhang = robustd_test_plugins:HangCheck\n"
                                           "boom = robustd_test_plugins:BoomCheck\n"
                                           "tick = robustd_test_plugins:TickCheck\n"
                                           "mark = robustd_test_plugins:MarkCheck\n")
    here = Path(__file__).resolve().parent
    return {"PYTHONPATH": os.pathsep.join([str(tmp / "plugins"), str(here / "plugins"), str(here.parent)])}
