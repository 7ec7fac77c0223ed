"""The `slurm:` section (validated by robustd and robustd-slurm alike, key and line in every error), and the
robustctl Slurm hooks failing open: an unreachable robustd, a bad config or a hung scontrol never drains a node
nor fails a job, and the hooks end within their budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def check(cmd: str, path: Path) -> subprocess.CompletedProcess[str]:
    module = {"robustd": "robustd.daemon", "robustd-slurm": "robustd.adapters.slurm.agent"}[cmd]
    return subprocess.run([sys.executable, "-m", module, "--check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL)


EXIT = {"robustd": 1, "robustd-slurm": 78}  # robustd-slurm: EX_CONFIG, named by its unit's RestartPreventExitStatus=

BAD = [
    ("slurm:\n  resume_after: -5m\n", "slurm.resume_after", 2, "negative"),
    ("slurm:\n  reconcile_interval: 0s\n", "slurm.reconcile_interval", 2, "greater than zero"),
    ("slurm:\n  epilog_timeout: 10\n", "slurm.epilog_timeout", 2, "no unit"),
    ("slurm:\n  drain_actions: [REBOOT, REBOT]\n", "slurm.drain_actions.1", 2, "unknown action 'REBOT'"),
    ("slurm:\n  drain_actions:\n    - REBOOT\n    - FIX_IT\n", "slurm.drain_actions.1", 4, "unknown action"),
    ("slurm:\n  reboot_on: [SHUTDOWN]\n", "slurm.reboot_on.0", 2, "unknown action"),
    ("slurm:\n  drain_actions: [HW_INSPECT]\n  reboot_on: [REBOOT]\n", "slurm.reboot_on", 3, "not in drain_actions"),
    ("slurm:\n  max_drained_fraction: 1.5\n", "slurm.max_drained_fraction", 2, "less than or equal to 1"),
    ("slurm:\n  max_drained_fraction: -0.1\n", "slurm.max_drained_fraction", 2, "greater than or equal to 0"),
    ("slurm:\n  min_drains: -1\n", "slurm.min_drains", 2, "greater than or equal to 0"),
    ("slurm:\n  max_resumes: -2\n", "slurm.max_resumes", 2, "greater than or equal to 0"),
    ("slurm:\n  on_critical: reboot\n", "slurm.on_critical", 2, "'drain' or 'down'"),
    ("slurm:\n  reason_prefix: ''\n", "slurm.reason_prefix", 2, "1 to 32 characters"),
    ("slurm:\n  reason_prefix: 'a\"b'\n", "slurm.reason_prefix", 2, "without quotes"),
    ("slurm:\n  hook_timeout: 2m\n", "slurm.hook_timeout", 2, "at most 55s"),
    ("slurm:\n  node_name: 'two words'\n", "slurm.node_name", 2, "pattern"),
    ("diagnostics:\n  levels:\n    fast: [eud]\nslurm:\n  resume_check: burnin\n", "slurm.resume_check", 5,
     "'burnin' is not a level in diagnostics.levels (known: fast, full, quick, standard)"),
    ("slurm:\n  epilog_diagnostics: thorough\n", "slurm.epilog_diagnostics", 2, "not a level"),
    ("slurm:\n  bogus: 1\n", "slurm.bogus", 2, "unknown key"),
    ("slurm:\n  triage: sometimes\n", "slurm.triage", 2, "boolean"),
    ("slurm:\n  triage: 'false'\n", "slurm.triage", 2, "boolean"),  # a string, however it reads
    ("slurm:\n  min_drains: 1\n  min_drains: 3\n", "slurm.min_drains", 3, "duplicate key (also at line 3)"),
    ("slurm:\n  triage_logs: [logs/%j.out]\n", "slurm.triage_logs.0", 2, "not an absolute path"),
    ("slurm:\n  triage_logs:\n    - /scratch/%u/%j/*.log\n    - /scratch/%x.out\n", "slurm.triage_logs.1", 4,
     "unknown %x (known: %j the job id, %u the job's user name, %% a %)"),
    ("slurm:\n  triage_logs: ['/logs/100%']\n", "slurm.triage_logs.0", 2, "trailing %"),
    ("slurm:\n  triage_logs: /logs/%j.out\n", "slurm.triage_logs", 2, "valid list"),
    ("slurm:\n  triage_logs: [" + ", ".join(f"/l/{i}" for i in range(33)) + "]\n", "slurm.triage_logs", 2,
     "at most 32"),
    ("slurm:\n  ctld:\n    port: 0\n", "slurm.ctld.port", 3, "greater than or equal to 1"),
    ("slurm:\n  ctld:\n    rendezvous_port: 70000\n", "slurm.ctld.rendezvous_port", 3, "less than or equal to 65535"),
    ("slurm:\n  ctld:\n    tls_cert: ''\n    tls_key: /k.pem\n", "slurm.ctld.tls_cert", 3, "empty path names no file"),
    ("slurm:\n  ctld:\n    tls_cert: /etc/robustd/ctld.pem\n", "slurm.ctld", 2, "tls_cert and tls_key go together"),
    ("slurm:\n  ctld:\n    level: thorough\n", "slurm.ctld.level", 3, "not a level"),
    ("slurm:\n  ctld:\n    slow_fraction: 1\n", "slurm.ctld.slow_fraction", 3, "less than 1"),
    ("slurm:\n  ctld:\n    preflight: on\n", "slurm.ctld.preflight", 3, "valid string"),
    ("slurm:\n  ctld:\n    preflight: deep\n", "slurm.ctld.preflight", 3, "'deep' is not a level"),
    ("slurm:\n  ctld:\n    timeout: 0s\n", "slurm.ctld.timeout", 3, "greater than zero"),
    ("slurm:\n  ctld:\n    timeout: 2h\n", "slurm.ctld.timeout", 3, "at most 3600s"),
    ("slurm:\n  ctld:\n    preflight_timeout: 60\n", "slurm.ctld.preflight_timeout", 3, "no unit"),
    ("slurm:\n  ctld:\n    epilog: 'yes'\n", "slurm.ctld.epilog", 3, "boolean"),
    ("slurm:\n  ctld:\n    tls: {}\n", "slurm.ctld.tls", 3, "unknown key"),
    ("slurm: [1, 2]\n", "slurm", 1, "valid dictionary"),
    ("slurm:\n  resume_after: 1m\n  mode: dry-run\n", "slurm.mode", 3, "'act' or 'shadow'"),
    ("slurm:\n  max_event_age: 10\n", "slurm.max_event_age", 2, "no unit"),
    ("slurm:\n  metrics_address: localhost\n", "slurm.metrics_address", 2, "expected host:port"),
]


@pytest.mark.parametrize("cmd", ["robustd", "robustd-slurm"])
@pytest.mark.parametrize("text, key, line, words", BAD)
def test_bad_slurm_values_are_rejected_with_key_and_line(tmp_path: Path, cmd: str, text: str, key: str, line: int,
                                                          words: str) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text("# robustd\n" + text)
    r = check(cmd, cfg)
    assert r.returncode == EXIT[cmd], r.stdout + r.stderr
    assert f"{cfg}:{line + 1}: {key}: " in r.stderr and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", ["robustd", "robustd-slurm"])
def test_a_config_that_is_not_utf8_is_a_config_error_for_the_adapter_too(tmp_path: Path, cmd: str) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_bytes(b"slurm:\n  reason_prefix: r\xf6bustd\n")
    r = check(cmd, cfg)
    assert r.returncode == EXIT[cmd] and f"{cfg}:2: the config is not UTF-8 text: byte 0xf6" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_an_empty_slurm_section_means_the_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nslurm:\n  # nothing yet\n")
    r = check("robustd-slurm", cfg)
    assert r.returncode == 0, r.stderr
    assert f"config OK (Slurm node {os.uname().nodename.split('.')[0]}, state {tmp_path}/state/slurm.json)" in r.stdout


def test_the_ctld_section_takes_off_or_a_level_for_preflight() -> None:
    from robustd.adapters.slurm.config import SlurmConfig

    assert SlurmConfig().ctld.preflight is None and SlurmConfig().ctld.level == "quick"
    assert SlurmConfig.model_validate(yaml.safe_load("ctld:\n  preflight: off\n")).ctld.preflight is None
    assert SlurmConfig.model_validate(yaml.safe_load("ctld:\n  preflight: 'off'\n")).ctld.preflight is None
    got = SlurmConfig.model_validate(yaml.safe_load("ctld:\n  preflight: quick\n  tls_cert: /c.pem\n"
                                                    "  tls_key: /k.pem\n  tls_ca: /ca.pem\n  timeout: 90s\n"))
    assert (got.ctld.preflight, got.ctld.tls_cert, got.ctld.timeout) == ("quick", "/c.pem", 90.0)


def test_the_shipped_config_documents_every_slurm_key_with_its_default() -> None:
    from robustd.adapters.slurm.config import SlurmConfig

    shipped = yaml.safe_load((REPO / "etc" / "robustd.yaml").read_text())["slurm"]
    assert SlurmConfig.model_validate(shipped) == SlurmConfig()
    text = (REPO / "etc" / "robustd.yaml").read_text().split("\nslurm:", 1)[1]
    for key in SlurmConfig.model_fields:
        assert f"  {key}:" in text or f"  # {key}:" in text, f"slurm.{key} is not documented in etc/robustd.yaml"
    assert check("robustd-slurm", REPO / "etc" / "robustd.yaml").returncode == 0


# --- the hooks fail open ----------------------------------------------------------------------------


def hook_config(tmp_path: Path, socket: str, **slurm: Any) -> tuple[Path, Path]:
    """A config whose scontrol/sinfo record every call in calls.log (and then do what `behaviour` says)."""
    calls = tmp_path / "calls.log"
    for tool in ("scontrol", "sinfo"):
        script = tmp_path / tool
        script.write_text(f"#!/bin/sh\necho {tool} \"$@\" >>{calls}\n" + slurm.pop(f"{tool}_body", "exit 0\n"))
        script.chmod(0o755)
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "listen": {"unix": socket},
                                   "slurm": {"scontrol": str(tmp_path / "scontrol"), "sinfo": str(tmp_path / "sinfo"),
                                             "node_name": "n1", **slurm}}))
    return cfg, calls


def robustctl_slurm(verb: str, cfg: Path, env: dict[str, str] | None = None,
                    timeout: float = 70) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "slurm", verb, "--config", str(cfg)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("verb", ["healthcheck", "prolog"])
def test_with_robustd_unreachable_the_hooks_change_nothing_and_exit_0(tmp_path: Path, verb: str) -> None:
    cfg, calls = hook_config(tmp_path, str(tmp_path / "nobody.sock"))
    r = robustctl_slurm(verb, cfg)
    assert r.returncode == 0, r.stderr
    assert "no robustd socket at" in r.stderr and ("changing nothing" in r.stderr or "letting the job" in r.stderr)
    assert not calls.exists()  # Slurm was not even asked


# status: 78 (EX_CONFIG, issue 32), not 1, which is its "a warning stands"
@pytest.mark.parametrize("verb, code", [("healthcheck", 0), ("prolog", 0), ("epilog", 0), ("status", 78)])
def test_a_bad_config_fails_open_in_the_hooks(tmp_path: Path, verb: str, code: int) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text("slurm:\n  max_drained_fraction: 2\n")
    r = robustctl_slurm(verb, cfg)
    assert r.returncode == code, r.stderr
    assert f"{cfg}:2: slurm.max_drained_fraction" in r.stderr


def test_the_epilog_of_a_job_that_succeeded_or_without_diagnostics_does_nothing(tmp_path: Path) -> None:
    cfg, calls = hook_config(tmp_path, str(tmp_path / "nobody.sock"))
    assert robustctl_slurm("epilog", cfg, {"SLURM_JOB_EXIT_CODE": "256"}).returncode == 0  # no epilog_diagnostics
    cfg, calls = hook_config(tmp_path, str(tmp_path / "nobody.sock"), epilog_diagnostics="quick")
    r = robustctl_slurm("epilog", cfg, {"SLURM_JOB_ID": "7", "SLURM_JOB_EXIT_CODE": "0"})
    assert r.returncode == 0 and r.stderr == "" and not calls.exists()
    r = robustctl_slurm("epilog", cfg, {"SLURM_JOB_ID": "8", "SLURM_JOB_EXIT_CODE": "256"})  # failed; robustd down
    assert r.returncode == 0 and "job 8 failed" in r.stderr and "not diagnosing" in r.stderr
    assert "job 8 triage" in r.stderr  # triage needs no daemon
    assert calls.read_text().splitlines() == ["scontrol show job --oneliner 8"]  # where its output went; no update


def test_a_hung_scontrol_cannot_hold_the_healthcheck_past_its_budget(make_daemon: Any, tmp_path: Path) -> None:
    d = make_daemon({"checks": {"kernel": {"enabled": False}}})
    d.start()
    cfg, calls = hook_config(tmp_path, d.socket, hook_timeout="2s", command_timeout="20s",
                             scontrol_body="sleep 50\n")
    t = time.monotonic()
    r = robustctl_slurm("healthcheck", cfg)
    took = time.monotonic() - t
    assert r.returncode == 0 and took < 8, (took, r.stderr)
    assert "scontrol show node n1" in calls.read_text() and "changing nothing" in r.stderr


def test_robustctl_lists_the_slurm_verbs() -> None:
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "slurm", "--help"], capture_output=True,
                       text=True, timeout=30, cwd=REPO)
    assert r.returncode == 0
    for verb in ("healthcheck", "prolog", "epilog", "status"):
        assert verb in r.stdout
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "slurm", "drain"], capture_output=True,
                       text=True, timeout=30, cwd=REPO)
    assert r.returncode == 64


def test_a_bad_config_stops_robustd_slurm_with_78_and_its_unit_does_not_restart_on_it(tmp_path: Path) -> None:
    """Without --check-config too (the unit's ExecStart=): exit 78, key and line told. The unit has no failing
    ExecStartPre= check: systemd applies RestartPreventExitStatus= to the main process only, so a failing
    ExecStartPre= would be restarted every 5 s all the same."""
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text("slurm:\n  min_drains: -1\n")
    r = subprocess.run([str(REPO / ".venv" / "bin" / "robustd-slurm"), "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 78 and f"{cfg}:2: slurm.min_drains: " in r.stderr, (r.returncode, r.stderr)
    unit = (REPO / "systemd" / "robustd-slurm.service").read_text().splitlines()
    assert "RestartPreventExitStatus=78" in unit and "Restart=on-failure" in unit
    assert not [line for line in unit if line.startswith("ExecStartPre=") and not line.startswith("ExecStartPre=-")]
