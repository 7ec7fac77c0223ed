"""Issue 32: one rule for a missing robustd.yaml in every program that reads it. The default path missing
means built-in defaults, said once on stderr; a --config that names a missing file is an error naming it.

The default path is pointed at a file that does not exist (robustd.roots.DEFAULT_CONFIG, read when the
config is loaded), so the test does not depend on what this machine has in /etc/robustd.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

# (program's main, its argv): robustd, robustd-slurm, robustd-k8s --check-config, robustctl slurm status
PROGRAMS = {
    "robustd": ("robustd.daemon", ["--check-config"]),
    "robustd-slurm": ("robustd.adapters.slurm.agent", ["--check-config"]),
    "robustd-k8s": ("robustd.adapters.k8s.agent", ["--check-config"]),
    "robustctl slurm status": ("robustd.cli.robustctl", ["slurm", "status", "--timeout", "1s"]),
}


def run(program: str, default: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    module, argv = PROGRAMS[program]
    code = ("import sys, runpy; import robustd.roots as r; r.DEFAULT_CONFIG = sys.argv.pop(1); "
            f"sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, str(default), *argv, *extra], capture_output=True,
                          text=True, cwd=REPO, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_a_missing_default_config_means_built_in_defaults(tmp_path: Path, program: str) -> None:
    default = tmp_path / "etc" / "robustd.yaml"
    r = run(program, default)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.count(f"{default} not found: using the built-in defaults") == 1, r.stderr
    if program != "robustctl slurm status":
        assert r.stdout.startswith("(defaults): config OK"), r.stdout
    named = run(program, default, "--config", str(tmp_path / "missing.yaml"))
    # EX_CONFIG (78) for the adapters and robustctl slurm; robustd's own config errors stay 1
    assert named.returncode == (1 if program == "robustd" else 78), named.stdout + named.stderr
    assert f"{tmp_path / 'missing.yaml'}: cannot read config: No such file or directory" in named.stderr
    assert "built-in defaults" not in named.stderr
