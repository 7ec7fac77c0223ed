"""`robustctl fleet status` against several real daemons on this machine: one critical, one down, one silent."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import REPO, plugin_env


def ctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)


def test_fleet_status_summarises_many_daemons_and_reports_the_unreachable(make_daemon: Any, short_tmp: Path) -> None:
    flag = short_tmp / "flag"
    flag.touch()
    env = plugin_env(short_tmp)
    tick = {"tick": {"interval": "100ms", "flag_file": str(flag)}, "kernel": {"enabled": False},
            "hang": {"enabled": False}, "boom": {"enabled": False}}
    ok = [make_daemon({"node_name": f"ok-{i}", "checks": {"kernel": {"enabled": False}}}) for i in range(2)]
    bad = make_daemon({"node_name": "bad-0", "checks": tick,
                       "policy": {"codes": {"TICK_FLAG": {"severity": "CRITICAL", "action": "REBOOT",
                                                                    "clear_after": "200ms"}}}}, env=env)
    down = make_daemon({"node_name": "down-0", "checks": {"kernel": {"enabled": False}}})
    for d in [*ok, bad, down]:
        d.start()
    bad.wait_for(lambda v: v.severity == 3)
    down.stop()
    hosts_file = short_tmp / "hosts"
    hosts_file.write_text(f"# the rack\nunix:{bad.socket}\n\n{down.socket}   # stopped for the test\n")

    r = ctl("fleet", "status", f"unix:{ok[0].socket}", f"unix://{ok[1].socket}", "--hosts-file", str(hosts_file))
    assert r.returncode == 2, r.stderr  # a CRITICAL host outranks the unreachable one
    lines = r.stdout.splitlines()
    assert lines[0].startswith("4 hosts in ") and lines[0].endswith("s: 2 ok, 1 critical, 1 unreachable")
    assert lines[1].split() == ["HOST", "NODE", "SEVERITY", "ACTION", "CONDITIONS", "WORST"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows[f"unix:{ok[0].socket}"][1:5] == ["ok-0", "OK", "NONE", "0"]
    assert rows[f"unix:{bad.socket}"][1:7] == ["bad-0", "CRITICAL", "REBOOT", "1", "host", "TICK_FLAG"]
    # Why it is down, in the OS's words: a daemon stopped cleanly removes its socket, a crashed one leaves it.
    assert rows[down.socket][1:5] == ["-", "UNREACHABLE", "-", "-"]
    assert " ".join(rows[down.socket][5:]).startswith(("No such file", "Connection refused"))

    r = ctl("fleet", "status", "--json", f"unix:{ok[0].socket}", down.socket)
    assert r.returncode == 3, r.stderr  # nothing worse than OK, but a host did not answer
    doc = json.loads(r.stdout)
    assert doc["summary"] == {"ok": 1, "warning": 0, "critical": 0, "unreachable": 1, "error": 0}
    first, second = doc["hosts"]
    assert first["reachable"] and first["node"] == "ok-0" and first["severity"] == "SEVERITY_OK"
    assert not second["reachable"] and "cannot reach robustd" in second["error"]

    flag.unlink()
    bad.wait_for(lambda v: v.severity == 1, timeout=15)
    r = ctl("fleet", "status", *(f"unix:{d.socket}" for d in [*ok, bad]))
    assert r.returncode == 0 and ": 3 ok" in r.stdout.splitlines()[0]


def test_fleet_status_time_is_bounded_by_the_deadline_not_the_number_of_dead_hosts() -> None:
    # Ten TCP listeners that never speak: each host times out, all at once, within --timeout.
    silent = []
    for _ in range(10):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        silent.append(s)
    try:
        hosts = [f"127.0.0.1:{s.getsockname()[1]}" for s in silent]
        t0 = time.monotonic()
        r = ctl("fleet", "status", "--timeout", "1s", *hosts)
        took = time.monotonic() - t0
        assert r.returncode == 3, r.stderr
        assert r.stdout.splitlines()[0].startswith("10 hosts in ") and "10 unreachable" in r.stdout
        assert took < 6, took  # interpreter start-up + one 1 s deadline, not ten
    finally:
        for s in silent:
            s.close()


def test_fleet_status_usage_errors() -> None:
    r = ctl("fleet", "status")
    assert r.returncode == 64 and "no hosts" in r.stderr
    r = ctl("fleet", "status", "--hosts-file", "/nonexistent/hosts")
    assert r.returncode == 64 and "/nonexistent/hosts" in r.stderr
    r = ctl("fleet", "stacks", "--layout", "tp=2,pp=0,dp=2", "h1")
    assert r.returncode == 64 and "pp must be a whole number of at least 1" in r.stderr
    r = ctl("fleet", "stacks", "--layout", "tp=2,dp=2", "h1")
    assert r.returncode == 64 and "missing pp" in r.stderr


def test_host_syntax() -> None:
    from robustd.cli.remote import client_for

    tls = (None, None, None)
    assert client_for("gpu-17", 5, tls).target == "gpu-17:7070"
    assert client_for("gpu-17:9000", 5, tls).target == "gpu-17:9000"
    assert client_for("[fd00::1]", 5, tls).target == "[fd00::1]:7070"
    assert client_for("[fd00::1]:9000", 5, tls).target == "[fd00::1]:9000"
    assert client_for("unix:/run/r.sock", 5, tls).target == "unix:///run/r.sock"
    assert client_for("unix:///run/r.sock", 5, tls).target == "unix:///run/r.sock"
    assert client_for("/run/r.sock", 5, tls).target == "unix:///run/r.sock"
