"""Config: bad input names the key and the line and exits 1; the shipped configs are valid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_security import pki  # noqa: F401 - real certificates, made once per module

from robustd import __version__
from robustd.durations import format_duration, parse_duration

REPO = Path(__file__).resolve().parent.parent


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustd.daemon", "--check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("text, key, line, words", [
    ("node_name: a\nlisten:\n  unix: /tmp/x.sock\n  bogus: 1\n", "listen.bogus", 4, "unknown key"),
    ("retention:\n  max_age: 1d\n  max_events: many\n", "retention.max_events", 3, "integer"),
    ("checks:\n  kernel:\n    enabled: true\n    interval: -1s\n", "checks.kernel.interval", 4, "negative"),
    ("checks:\n  kernel:\n    interval: 0s\n", "checks.kernel.interval", 3, "greater than zero"),
    ("checks:\n  kernel:\n    lookback: 5\n", "checks.kernel.lookback", 3, "no unit"),
    ("checks:\n  gpu:\n    enabled: true\n    fabric_grace: -1s\n", "checks.gpu.fabric_grace", 4, "negative"),
    ("checks:\n  gpu:\n    fabric_grace: 60\n", "checks.gpu.fabric_grace", 3, "no unit"),
    ("checks:\n  gpu:\n    enabled: true\n    clock_tolerance: 0\n", "checks.gpu.clock_tolerance", 4, "greater than 0"),
    ("checks:\n  gpu:\n    power_tolerance: 150\n", "checks.gpu.power_tolerance", 3, "less than 100"),
    ("checks:\n  gpu:\n    outlier_window: 60\n", "checks.gpu.outlier_window", 3, "no unit"),
    ("checks:\n  gpu:\n    outlier_min_gpus: 1\n", "checks.gpu.outlier_min_gpus", 3, "greater than or equal to 2"),
    ("policy:\n  codes:\n    XID_13: {severity: SEVERE}\n", "policy.codes.XID_13.severity", 3, "must be one of"),
    ("checks:\n  kernl: {}\n", "checks.kernl", 2, "unknown check"),
    ("evidence:\n  keep: 0\n", "evidence.keep", 2, "greater than or equal to 1"),
    ("evidence:\n  keep: 5\n  max_bundle_bytes: 1MiB\n", "evidence.max_bundle_bytes", 3, "integer"),
    ("listen:\n  unix: [unclosed\n", "", 3, "malformed YAML"),
    ("- just\n- a list\n", "", 1, "mapping"),
])
def test_bad_config_names_key_and_line(tmp_path: Path, text: str, key: str, line: int, words: str) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(text)
    r = check_config(cfg)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{cfg}:{line}:" in r.stderr, r.stderr
    assert key in r.stderr and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    r = check_config(tmp_path / "nope.yaml")
    assert r.returncode == 1
    assert "cannot read config" in r.stderr and "No such file" in r.stderr


@pytest.mark.parametrize("name", ["robustd.yaml", "robustd.dev.yaml", "robustd.dev-emulated.yaml"])
def test_shipped_configs_are_valid(name: str) -> None:
    r = check_config(REPO / "etc" / name)
    assert r.returncode == 0, r.stderr
    assert "config OK" in r.stdout


def test_version() -> None:
    r = subprocess.run([sys.executable, "-m", "robustd.daemon", "--version"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == f"robustd {__version__}"


@pytest.mark.parametrize("text, seconds", [("500ms", 0.5), ("1s", 1), ("5m", 300), ("2h", 7200), ("30d", 2592000),
                                           ("1m30s", 90), ("0s", 0)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "5", "5 minutes", "-1s", "1x", "s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_bad_extra_rule_file_is_a_config_error(tmp_path: Path) -> None:
    rules = tmp_path / "site.yaml"
    rules.write_text("rules:\n  - code: SITE_FAN\n    pattern: 'fan (?P<n>\\d+ failed'\n")
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(f"checks:\n  kernel:\n    rules: [{rules}]\n")
    r = check_config(cfg)
    assert r.returncode == 1
    assert f"{cfg}:3: checks.kernel.rules" in r.stderr and "SITE_FAN" in r.stderr, r.stderr


def test_relative_paths_are_resolved_against_the_working_directory_at_load(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`state_dir: ./var` (the dev configs) must mean <cwd>/var everywhere it is used later, e.g. in a
    file:// rendezvous URL, where `./var/...` would parse as /var/...; bare program names stay for $PATH."""
    from robustd.checkset import config_schema, discover_checks
    from robustd.config import parse_config

    monkeypatch.chdir(tmp_path)
    text = ("state_dir: ./var\nboot_id_path: boot_id\nlisten:\n  unix: run/robustd.sock\n"
            "diagnostics:\n  python: python3\ntracer:\n  py_spy: ./bin/py-spy\n"
            "checks:\n  gpu:\n    backend: emulator\n    emulator_state: var/nvml.state\n"
            "  kernel:\n    kmsg_path: ./kmsg\n  nic:\n    netns: blue\n")
    s = parse_config(text, "t.yaml", config_schema(discover_checks()))
    c = s.config
    assert c.state_dir == str(tmp_path / "var")
    assert c.boot_id_path == str(tmp_path / "boot_id")
    assert c.listen.unix == str(tmp_path / "run" / "robustd.sock")
    assert c.diagnostics.python == "python3"  # a name, looked up on $PATH when the child starts
    assert c.tracer.py_spy == str(tmp_path / "bin" / "py-spy")
    assert s.checks["gpu"].emulator_state == str(tmp_path / "var" / "nvml.state")  # type: ignore[attr-defined]
    assert s.checks["kernel"].kmsg_path == str(tmp_path / "kmsg")  # type: ignore[attr-defined]
    assert s.checks["nic"].netns == "blue"  # type: ignore[attr-defined]
    assert s.roots().kmsg == str(tmp_path / "kmsg")


@pytest.mark.parametrize("text, line, shown", [
    ("policy:\n  clear_afterr: 2m\n", 2, "policy.clear_afterr: unknown key (did you mean `clear_after`?)"),
    ("polcy:\n  clear_after: 2m\n", 1, "polcy: unknown key (did you mean `policy`?)"),
    ("checks:\n  kernel:\n    lookbak: 1m\n", 3, "checks.kernel.lookbak: unknown key (did you mean `lookback`?)"),
    ("policy:\n  codes:\n    XID_13: {severty: WARNING}\n", 3,
     "policy.codes.XID_13.severty: unknown key (did you mean `severity`?)"),
    ("checks:\n  kernl: {}\n", 2, "checks.kernl: unknown check (did you mean `kernel`?)"),
    ("policy:\n  zzzzzz: 1\n", 2, "policy.zzzzzz: unknown key\n"),  # nothing close: no guess
])
def test_unknown_key_suggests_the_nearest_valid_one(tmp_path: Path, text: str, line: int, shown: str) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text(text)
    r = check_config(cfg)
    assert r.returncode == 1 and f"{cfg}:{line}: {shown}" in r.stderr, r.stderr


# Values robustd once took without a word (or with a traceback), each refused now with its key and line: by
# `--check-config`, at start, and by a reload (tests/test_reload.py). (text, key, line, words): `{pki}` in a
# text is the directory of test_security's certificates, `{fifo}` a FIFO beside the config; bytes are written
# as they are.
GAPS: list[tuple[str | bytes, str, int, str]] = [
    ("policy:\n  clear_after: 1m\n  clear_after: 5m\n", "policy.clear_after", 3, "duplicate key (also at line 2)"),
    ("policy: {}\nretention: {}\npolicy:\n  clear_after: 5m\n", "policy", 3, "duplicate key (also at line 1)"),
    ("retention:\n  max_events: 100000000000000000000000\n", "retention.max_events", 2,
     "less than or equal to 1000000000"),
    ("retention:\n  max_events: 1.0e+5\n", "retention.max_events", 2, "valid integer"),
    ("listen:\n  insecure: true\n  tcp: 127.0.0.1:70000\n", "listen.tcp", 3, "a port from 1 to 65535"),
    ("listen:\n  insecure: true\n  tcp: 127.0.0.1\n", "listen.tcp", 3, "a port from 1 to 65535"),
    ("listen:\n  insecure: true\n  tcp: 127.0.0.1:0\n", "listen.tcp", 3, "a port from 1 to 65535"),
    ("listen:\n  tcp: 127.0.0.1:8443\n  tls:\n    cert: {pki}/ca.cnf\n    key: {pki}/server.key\n",
     "listen.tls.cert", 4, "not a PEM certificate"),
    ("listen:\n  tcp: 127.0.0.1:8443\n  tls:\n    cert: {pki}/server.pem\n    key: {pki}/server.pem\n",
     "listen.tls.key", 5, "not a PEM private key"),
    ("listen:\n  tcp: 127.0.0.1:8443\n  tls:\n    cert: {pki}/server.pem\n    key: {pki}/denied.key\n",
     "listen.tls.key", 5, "not the private key of the certificate in listen.tls.cert"),
    ("listen:\n  tcp: 127.0.0.1:8443\n  tls:\n    cert: {pki}/server.pem\n    key: {pki}/server.key\n"
     "    client_ca: {pki}/ca.key\n", "listen.tls.client_ca", 6, "not a PEM certificate"),
    ("listen:\n  tcp: 127.0.0.1:8443\n  tls:\n    cert: {fifo}\n    key: {pki}/server.key\n",
     "listen.tls.cert", 4, "not a regular file (a FIFO)"),
    (b"node_name: n\npolicy:\n  # caf\xe9\n", "", 3, "not UTF-8 text: byte 0xe9 at column 8"),
    ("checks:\n  kernel:\n    kmsg_path: ''\n", "checks.kernel.kmsg_path", 3, "empty path"),
    ("roots:\n  kmsg: ''\n", "roots.kmsg", 2, "empty path"),
    ("listen:\n  tcp: 127.0.0.1:8443\n  insecure: 'yes'\n", "listen.insecure", 3, "expected a boolean"),
    ("checks:\n  kernel:\n    enabled: \"true\"\n", "checks.kernel.enabled", 3, "expected a boolean"),
    ("policy:\n  codes:\n    XID_13: {sticky: 'no'}\n", "policy.codes.XID_13.sticky", 3, "expected a boolean"),
]
GAP_IDS = ["duplicate", "duplicate-section", "max_events-huge", "max_events-float", "port-70000", "no-port",
           "port-0", "cert-not-pem", "key-not-pem", "key-of-another-cert", "client_ca-not-pem", "cert-fifo",
           "not-utf8", "empty-kmsg_path", "empty-roots.kmsg", "insecure-string", "enabled-string", "sticky-string"]


def write_gap(path: Path, text: str | bytes, certs: Path) -> None:
    """The config file of one GAPS entry at `path` (the FIFO it may name made beside it)."""
    if isinstance(text, bytes):
        path.write_bytes(text)
        return
    fifo = path.parent / "cert.fifo"
    if "{fifo}" in text and not fifo.exists():
        os.mkfifo(fifo)
    path.write_text(text.replace("{pki}", str(certs)).replace("{fifo}", str(fifo)))


def problem_line(path: Path, key: str, line: int) -> str:
    return f"{path}:{line}: {key}: " if key else f"{path}:{line}: "


@pytest.mark.parametrize("text, key, line, words", GAPS, ids=GAP_IDS)
def test_values_once_taken_are_refused_by_check_config(tmp_path: Path, pki: Path,  # noqa: F811
                                                       text: str | bytes, key: str, line: int, words: str) -> None:
    cfg = tmp_path / "robustd.yaml"
    write_gap(cfg, text, pki)
    r = subprocess.run([sys.executable, "-m", "robustd.daemon", "--check-config", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=20, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stdout + r.stderr
    [shown] = [x for x in r.stderr.splitlines() if x.startswith(problem_line(cfg, key, line))]
    assert words in shown, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("text, key, line, words", GAPS, ids=GAP_IDS)
def test_values_once_taken_stop_the_daemon_at_start(short_tmp: Path, pki: Path,  # noqa: F811
                                                    text: str | bytes, key: str, line: int, words: str) -> None:
    """The start says what `--check-config` says, and exits 1 before it serves anything."""
    cfg = short_tmp / "robustd.yaml"
    write_gap(cfg, text, pki)
    r = subprocess.run([sys.executable, "-m", "robustd.daemon", "--config", str(cfg), "--socket",
                        str(short_tmp / "s.sock"), "--state-dir", str(short_tmp / "state")],
                       capture_output=True, text=True, timeout=20, cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "invalid config" in r.stderr, r.stderr
    [shown] = [x for x in r.stderr.splitlines() if x.startswith(problem_line(cfg, key, line))]
    assert words in shown, r.stderr
    assert "Traceback" not in r.stderr and not (short_tmp / "s.sock").exists()


def test_a_key_merged_in_from_an_anchor_may_be_overridden_but_not_written_twice(tmp_path: Path) -> None:
    """`<<: *defaults` then a key of its own is an override, the reason merges exist: not a duplicate. The
    same key written twice beside it is one."""
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text("diagnostics:\n  collectives: &c {timeout: 1m}\n  minigpt:\n    <<: *c\n    timeout: 2m\n"
                   "  eud:\n    <<: *c\n    timeout: 2h\n    timeout: 3h\n")
    r = check_config(cfg)
    assert r.returncode == 1, r.stderr
    problems = r.stderr.splitlines()[1:]
    assert problems == [f"{cfg}:9: diagnostics.eud.timeout: duplicate key (also at line 8); write it once"], r.stderr


def test_a_config_larger_than_the_bound_is_refused_unread(tmp_path: Path) -> None:
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text("node_name: n\n" + "#" * (2 << 20) + "\n")
    r = check_config(cfg)
    assert r.returncode == 1 and f"{cfg}: the config is larger than 1 MiB" in r.stderr, r.stderr


def test_services_keys_are_validated_with_their_line(tmp_path: Path) -> None:
    """checks.services: a detection mode outside auto/always/never and an unknown key are each named with file and
    line (checks/services/config.py)."""
    cfg = tmp_path / "robustd.yaml"
    cfg.write_text("checks:\n  services:\n    fabricmanager: sometimes\n    imex_nodes_config: nodes.cfg\n"
                   "    persistenced: auto\n    buss: SYSTEM\n    bus: tcp:host=node1,port=5\n")
    r = check_config(cfg)
    assert r.returncode == 1
    assert f"{cfg}:3: checks.services.fabricmanager: Input should be 'auto', 'always' or 'never'" in r.stderr, r.stderr
    assert f"{cfg}:6: checks.services.buss: unknown key" in r.stderr, r.stderr
    assert f"{cfg}:7: checks.services.bus: " in r.stderr and "unix D-Bus address" in r.stderr, r.stderr
