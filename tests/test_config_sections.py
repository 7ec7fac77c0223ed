"""Each process validates what it reads of robustd.yaml: the daemon the whole file (its checks' sections and every
registered section among them), an adapter its own section and the core keys it reads; every outside path is
in `roots:`, with the older keys folded into it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from robustd.checkset import config_schema, discover_checks
from robustd.config import ConfigError, parse_config

REPO = Path(__file__).resolve().parent.parent
MODULES = {"robustd": "robustd.daemon", "robustd-slurm": "robustd.adapters.slurm.agent",
           "robustd-k8s": "robustd.adapters.k8s.agent"}


def check_config(cmd: str, path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", MODULES[cmd], "--check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def write(tmp: Path, text: str) -> Path:
    path = tmp / "robustd.yaml"
    path.write_text(text)
    return path


def test_an_adapter_validates_its_section_and_the_keys_it_reads_not_the_checks(tmp_path: Path) -> None:
    """A mistake in `checks:` or `policy:` is the daemon's to report; it must not stop robustd-slurm or
    robustd-k8s from starting (they read neither), while a mistake in what they read stops them, with key and line."""
    cfg = write(tmp_path, "policy:\n  clear_afterr: 2m\nchecks:\n  kernl: {}\nslurm:\n  resume_after: 1m\n"
                          "k8s:\n  heartbeat: 1m\n")
    daemon = check_config("robustd", cfg)
    assert daemon.returncode == 1
    assert f"{cfg}:2: policy.clear_afterr: unknown key" in daemon.stderr, daemon.stderr
    assert f"{cfg}:4: checks.kernl: unknown check" in daemon.stderr, daemon.stderr
    for cmd in ("robustd-slurm", "robustd-k8s"):
        r = check_config(cmd, cfg)
        assert r.returncode == 0, (cmd, r.stdout + r.stderr)
        assert f"{cfg}: config OK" in r.stdout, r.stdout
    bad = write(tmp_path, "# robustd\nlisten:\n  unix: /run/x.sock\n  bogus: 1\nslurm:\n  resume_after: -1m\n")
    slurm = check_config("robustd-slurm", bad)
    assert slurm.returncode == 78  # EX_CONFIG, as robustd-k8s
    assert f"{bad}:4: listen.bogus: unknown key" in slurm.stderr and f"{bad}:6: slurm.resume_after" in slurm.stderr
    k8s = check_config("robustd-k8s", bad)
    assert k8s.returncode == 78 and f"{bad}:4: listen.bogus: unknown key" in k8s.stderr, k8s.stderr
    assert "slurm.resume_after" not in k8s.stderr  # robustd-slurm's section: not robustd-k8s's to judge


def test_an_adapter_loads_its_config_without_importing_any_check(tmp_path: Path) -> None:
    cfg = write(tmp_path, f"state_dir: {tmp_path}\nslurm:\n  resume_check: quick\nk8s:\n  heartbeat: 1m\n")
    code = ("import sys\nfrom robustd.adapters.common.watch import load_settings\n"
            "from robustd.adapters.slurm.config import SCHEMA as S\n"
            "from robustd.adapters.k8s.config import SCHEMA as K\n"
            f"s = load_settings({str(cfg)!r}, S)\nk = load_settings({str(cfg)!r}, K)\n"
            "print(s.section('slurm').resume_check, k.section('k8s').heartbeat)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('checks', 'pynvml', 'pyroute2', 'kubernetes')"
            " or m in ('robustd.checkset', 'robustd.runner', 'robustd.diagnostics')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["quick 60.0", "[]"], out.stdout


def test_a_level_named_in_the_slurm_section_is_checked_against_this_files_levels(tmp_path: Path) -> None:
    # The file's levels merge over the built-in ones (issue 31): both kinds are known, any other name is not.
    text = "diagnostics:\n  levels:\n    smoke: [all_to_all]\nslurm:\n  resume_check: burnin\n"
    for cmd in ("robustd", "robustd-slurm"):
        r = check_config(cmd, write(tmp_path, text))
        assert r.returncode == {"robustd": 1, "robustd-slurm": 78}[cmd], r.stdout
        assert (":5: slurm.resume_check: 'burnin' is not a level in diagnostics.levels "
                "(known: full, quick, smoke, standard)") in r.stderr
        for level in ("smoke", "quick"):
            ok = check_config(cmd, write(tmp_path, text.replace("burnin", level)))
            assert ok.returncode == 0, ok.stderr


def test_the_daemon_validates_a_section_registered_by_another_package(tmp_path: Path) -> None:
    """A section registers like a check (an entry point): the daemon names the key and line of a bad value in
    it, accepts a good one, and calls the key unknown while no package registers it."""
    dist = tmp_path / "site" / "lab_scheduler-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-scheduler\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[robustd.sections]\nlab = lab_scheduler:LabConfig\n"
                                           "policy = lab_scheduler:LabConfig\n")  # a core key: refused
    (tmp_path / "site" / "lab_scheduler.py").write_text(
        "from pydantic import BaseModel, ConfigDict, Field\n\n\nclass LabConfig(BaseModel):\n"
        "    model_config = ConfigDict(extra='forbid')\n    retries: int = Field(default=1, ge=0)\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    cfg = tmp_path / "lab.yaml"
    cfg.write_text("node_name: a\nlab:\n  retries: -1\n")
    r = check_config("robustd", cfg, env)
    assert r.returncode == 1 and f"{cfg}:3: lab.retries: Input should be greater than or equal to 0" in r.stderr, \
        r.stderr
    assert "config section policy (lab_scheduler:LabConfig) ignored: the key 'policy' is taken" in r.stderr
    cfg.write_text("node_name: a\nlab:\n  retries: 2\n")
    assert check_config("robustd", cfg, env).returncode == 0
    plain = check_config("robustd", cfg)
    assert plain.returncode == 1 and f"{cfg}:2: lab: unknown key" in plain.stderr, plain.stderr


def settings(text: str) -> Any:
    return parse_config(text, "t.yaml", config_schema(discover_checks()))


def test_every_outside_path_comes_from_roots(tmp_path: Path) -> None:
    s = settings(f"roots:\n  proc: {tmp_path}/proc\n  sys: {tmp_path}/sys\n  dev: {tmp_path}/dev\n"
                 f"  kmsg: {tmp_path}/kmsg\n  boot_id: {tmp_path}/boot_id\n  dcgmi: /opt/dcgm/bin/dcgmi\n"
                 f"  nvml_library: {tmp_path}/lib/libnvidia-ml.so.1\n")
    r = s.roots()
    assert (r.proc, r.sys, r.dev, r.kmsg, r.boot_id) == tuple(f"{tmp_path}/{p}" for p in
                                                              ("proc", "sys", "dev", "kmsg", "boot_id"))
    assert (r.dcgmi, r.nvml_library) == ("/opt/dcgm/bin/dcgmi", f"{tmp_path}/lib/libnvidia-ml.so.1")
    # `dcgmi` in the EUD command is roots.dcgmi; a command naming its own program keeps it.
    assert s.config.diagnostics.eud.command == ["/opt/dcgm/bin/dcgmi", "diag", "-r", "eud", "-j"]
    own = settings("roots:\n  dcgmi: /opt/dcgm/bin/dcgmi\ndiagnostics:\n  eud:\n    command: [/srv/fake, diag]\n")
    assert own.config.diagnostics.eud.command == ["/srv/fake", "diag"]
    defaults = settings("").roots()
    assert (defaults.kmsg, defaults.dcgmi, defaults.nvml_library) == ("/dev/kmsg", "dcgmi", "libnvidia-ml.so.1")


def test_the_older_path_keys_fold_into_roots_and_must_agree_with_it(tmp_path: Path) -> None:
    s = settings(f"boot_id_path: {tmp_path}/b\nchecks:\n  kernel:\n    kmsg_path: {tmp_path}/k\n")
    assert (s.roots().boot_id, s.roots().kmsg) == (f"{tmp_path}/b", f"{tmp_path}/k")
    same = settings(f"boot_id_path: {tmp_path}/b\nroots:\n  boot_id: {tmp_path}/b\n")
    assert same.roots().boot_id == f"{tmp_path}/b"
    with pytest.raises(ConfigError) as e:
        settings(f"roots:\n  kmsg: {tmp_path}/a\n  boot_id: {tmp_path}/b\nboot_id_path: {tmp_path}/c\n"
                 f"checks:\n  kernel:\n    kmsg_path: {tmp_path}/d\n")
    assert e.value.problems == [
        f"t.yaml:4: boot_id_path: '{tmp_path}/c' differs from roots.boot_id ('{tmp_path}/b'); write it once, as "
        "roots.boot_id",
        f"t.yaml:7: checks.kernel.kmsg_path: '{tmp_path}/d' differs from roots.kmsg ('{tmp_path}/a'); write it "
        "once, as roots.kmsg"]


def test_the_daemon_reads_its_boot_id_from_roots(make_daemon: Any, tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("0f7c2b1e-6d1a-4c8e-9a53-3b2f8d1c4e77\n")
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    del d.config["boot_id_path"]
    d.config["roots"] = {"boot_id": str(boot)}
    d.write_config()
    d.start()
    assert d.verdict().boot_id == "0f7c2b1e-6d1a-4c8e-9a53-3b2f8d1c4e77"
