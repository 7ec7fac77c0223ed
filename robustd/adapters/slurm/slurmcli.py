"""Slurm through its own command-line tools, each call bounded by a timeout.

Slurm 22.05's REST API cannot update nodes and pyslurm must match Slurm's major version, so
robustd-slurm does what NHC and the other tools do: it runs `scontrol` and `sinfo` (from $PATH or
`slurm.scontrol`/`slurm.sinfo`) with Slurm's own environment (`SLURM_CONF`). The process runner is
injectable, so the parsing and the exact command lines are unit-tested without a cluster; the
integration tests run the real tools against a real slurmctld.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from robustd.adapters.slurm.model import NodeView

# slurmd runs HealthCheckProgram with only SLURMD_NODENAME in its environment: no PATH at all.
FALLBACK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SET_BY = re.compile(r"\s*\[[^\[\]]*@[^\[\]]*\]\s*$")  # scontrol's " [root@2026-11-30T11:35:49]"


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], float], Completed]


class SlurmError(Exception):
    """A Slurm command failed, timed out or could not be started; the message is one line."""


class NodeNotFound(SlurmError):
    """Slurm does not know this node name."""


def run_process(argv: Sequence[str], timeout: float) -> Completed:
    """The real runner: no shell, no stdin, killed at `timeout`."""
    env = dict(os.environ)
    env.setdefault("PATH", FALLBACK_PATH)
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, errors="replace", timeout=timeout,
                           stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]} did not finish within {timeout:g}s") from None
    except OSError as e:
        raise SlurmError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    return Completed(p.returncode, p.stdout, p.stderr)


def _resolve(program: str) -> str:
    if "/" in program:
        return program
    import shutil

    return shutil.which(program, path=os.environ.get("PATH") or FALLBACK_PATH) or program


class Slurm:
    """The few Slurm operations robustd-slurm needs, for one node."""

    def __init__(self, scontrol: str = "scontrol", sinfo: str = "sinfo", timeout: float = 10.0,
                 run: Runner = run_process):
        self.scontrol = _resolve(scontrol)
        self.sinfo = _resolve(sinfo)
        self.timeout = timeout
        self._run = run
        self.deadline: float | None = None  # time.monotonic() by which every call must be done (the hooks' budget)

    def _call(self, argv: list[str]) -> str:
        timeout = self.timeout
        if self.deadline is not None:
            import time

            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise SlurmError(f"no time left for {os.path.basename(argv[0])}")
        p = self._run(argv, timeout)
        if p.returncode != 0:
            text = " ".join((p.stderr or p.stdout).split())[:300] or f"exit status {p.returncode}"
            raise SlurmError(f"{os.path.basename(argv[0])} {argv[1] if len(argv) > 1 else ''}: {text}")
        return p.stdout

    def node(self, name: str) -> NodeView:
        try:
            text = self._call([self.scontrol, "show", "node", name])
        except SlurmError as e:
            if "not found" in str(e).lower() or "invalid node name" in str(e).lower():
                raise NodeNotFound(f"Slurm has no node {name!r} (set slurm.node_name): {e}") from None
            raise
        return parse_node(text, name)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job --oneliner JOB`: its fields (StdOut, StdErr, UserId, ...) by name."""
        return parse_job(self._call([self.scontrol, "show", "job", "--oneliner", job_id]))

    def partition_rows(self, partitions: Sequence[str]) -> list[tuple[str, str, str]]:
        """(node, partition, reason) for every node of these partitions: one sinfo call."""
        if not partitions:
            return []
        text = self._call([self.sinfo, "--noheader", "--Node", "--partition", ",".join(partitions),
                           "--format", "%N|%P|%E"])
        return parse_rows(text)

    def hostnames(self, nodelist: str) -> list[str]:
        """`scontrol show hostnames LIST`: a job's node list (`gpu[1-3,7]`) expanded, in Slurm's order."""
        return parse_hostnames(self._call([self.scontrol, "show", "hostnames", nodelist]))

    def drain(self, name: str, reason: str) -> None:
        self._call([self.scontrol, "update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}"])

    def down(self, name: str, reason: str) -> None:
        self._call([self.scontrol, "update", f"NodeName={name}", "State=DOWN", f"Reason={reason}"])

    def reboot(self, name: str, reason: str) -> None:
        self._call([self.scontrol, "reboot", "ASAP", "nextstate=DOWN", f"reason={reason}", name])

    def cancel_reboot(self, name: str) -> None:
        self._call([self.scontrol, "cancel_reboot", name])

    def resume(self, name: str) -> None:
        self._call([self.scontrol, "update", f"NodeName={name}", "State=RESUME"])


def parse_node(text: str, name: str) -> NodeView:
    """`scontrol show node NAME` (the multi-line form: the reason, which may hold anything, has its own line)."""
    state, partitions, reason, addr = "", (), "", ""
    found = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("NodeName="):
            found = stripped.split()[0].removeprefix("NodeName=") == name
            continue
        if not found:
            continue
        if stripped.startswith("Reason="):
            reason = _SET_BY.sub("", stripped.removeprefix("Reason="))
            continue
        for token in stripped.split():
            key, _, value = token.partition("=")
            if key == "State":
                state = value
            elif key == "Partitions":
                partitions = tuple(p for p in value.split(",") if p)
            elif key == "NodeAddr":
                addr = value
    if not state:
        raise SlurmError(f"scontrol show node {name}: no State in its answer")
    base, flags = parse_state(state)
    return NodeView(name=name, state=base, flags=flags, reason=reason, partitions=partitions, addr=addr)


_JOB_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:]*)=")


def parse_job(text: str) -> dict[str, str]:
    """The fields of one `scontrol show job --oneliner` line. A value runs to the next ` Key=`, so a path
    with spaces (StdOut=/data/my logs/out.txt) stays whole; the first job's line only."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    keys = list(_JOB_KEY.finditer(line))
    fields: dict[str, str] = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        fields.setdefault(m.group(1), line[m.end():end].strip())
    return fields


def parse_state(text: str) -> tuple[str, frozenset[str]]:
    """`IDLE+DRAIN`, `DOWN*+DRAIN+REBOOT_ISSUED`, `MIXED~`: the base state and its flags."""
    parts = [p for p in text.strip().upper().split("+") if p]
    if not parts:
        return "UNKNOWN", frozenset()
    flags: set[str] = set()
    base = parts[0]
    if "*" in base:
        flags.add("NOT_RESPONDING")
    base = re.sub(r"[^A-Z_]", "", base) or "UNKNOWN"
    for p in parts[1:]:
        p = re.sub(r"[^A-Z_]", "", p)
        if p:
            flags.add(p)
    return base, frozenset(flags)


def parse_rows(text: str) -> list[tuple[str, str, str]]:
    """sinfo `%N|%P|%E`: node, partition (default's `*` dropped), reason ("none" means none)."""
    rows = []
    for line in text.splitlines():
        node, sep1, rest = line.partition("|")
        part, sep2, reason = rest.partition("|")
        if not (sep1 and sep2 and node.strip()):
            continue
        reason = reason.strip()
        rows.append((node.strip(), part.strip().rstrip("*"), "" if reason == "none" else reason))
    return rows


def parse_hostnames(text: str) -> list[str]:
    """One node name a line; blank lines skipped, each name once."""
    return list(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))
