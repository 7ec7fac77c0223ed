"""`robustctl sim`: the emulator's state file edited from the command line, as an integrator would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from robustd.nvmlemu import state as emu

REPO = Path(__file__).resolve().parent.parent


def sim(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != emu.ENV_VAR}
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "sim", *args], capture_output=True,
                          text=True, timeout=30, cwd=REPO, env={**full_env, **(env or {})}, stdin=subprocess.DEVNULL)


def test_init_show_set_fault_clear(tmp_path: Path) -> None:
    path = str(tmp_path / "nvml.state")
    r = sim("--state", path, "init", "--gpus", "4")
    assert r.returncode == 0, r.stderr
    st = emu.load(path)
    assert len(st.gpus) == 4 and st.gpus[0].bus_id == "00000000:1B:00.0" and st.gpus[0].name.startswith("NVIDIA H100")

    env = {emu.ENV_VAR: path}  # --state defaults to the emulator's own variable
    assert sim("set", "gpu", "2", "temperature", "91", env=env).returncode == 0
    assert sim("fault", "gpu", "1", "hang", env=env).returncode == 0
    assert sim("fault", "gpu", "3", "nvlink-down", "--link", "5", env=env).returncode == 0
    assert sim("fault", "gpu", "0", "ecc-dbe", env=env).returncode == 0
    st = emu.load(path)
    assert st.gpus[2].temperature == 91
    assert st.gpus[1].fault_list == ["hang"]
    assert st.gpus[3].nvlink_down == "5" and st.gpus[3].fault_list == ["nvlink-down"]
    assert st.gpus[0].ecc_dbe_volatile == 1

    shown = sim("show", env=env)
    assert shown.returncode == 0 and "EMULATED NVML" in shown.stdout
    assert "hang" in shown.stdout and "91C/87C" in shown.stdout
    as_json = json.loads(sim("show", "--json", env=env).stdout)
    assert as_json["gpus"][1]["faults"] == "hang"

    assert sim("clear", "gpu", "0", env=env).returncode == 0
    assert sim("clear", "gpu", "1", env=env).returncode == 0
    st = emu.load(path)
    assert st.gpus[0].ecc_dbe_volatile == 0 and st.gpus[0].ecc_dbe_aggregate == 1  # volatile resets, lifetime stays
    assert st.gpus[1].faults == ""


@pytest.mark.parametrize("args, message", [
    (("show",), "no state file"),
    (("--state", "{state}", "fault", "gpu", "9", "lost"), "no GPU 9"),
    (("--state", "{state}", "set", "gpu", "0", "colour", "red"), "unknown GPU key"),
    (("--state", "{state}", "set", "gpu", "0", "temperature", "hot"), "must be a number"),
    (("--state", "{state}", "fault", "gpu", "0", "melted"), "invalid choice"),
    (("--state", "{state}", "init", "--gpus", "17"), "0 to 16"),
    (("--state", "{state}", "fault", "gpu", "0", "fabric"), "needs a value"),
    (("--state", "{state}", "fault", "gpu", "0", "fabric", "melted"), "unknown fabric fault"),
])
def test_bad_input_is_a_usage_error(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    path = str(tmp_path / "nvml.state")
    emu.save(path, emu.healthy_node(2))
    r = sim(*(a.format(state=path) for a in args))
    assert r.returncode == 64, r
    assert message in r.stderr and "Traceback" not in r.stderr


def test_missing_state_file_is_one_line(tmp_path: Path) -> None:
    r = sim("--state", str(tmp_path / "absent"), "show")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "No such file" in r.stderr


def test_state_text_round_trips_and_rejects_garbage() -> None:
    st = emu.healthy_node(3)
    emu.apply_fault(st, 1, "remap-pending")
    emu.apply_fault(st, 2, "nvlink-errors", link=4)
    assert emu.loads(emu.dumps(st)) == st
    assert emu.loads(emu.dumps(st)).gpus[2].nvlink_errors == "4:2:10"
    with pytest.raises(ValueError, match="line:2"):
        emu.loads("driver_version = 1\nwat = 3\n", "line")
    with pytest.raises(ValueError, match=r"expected \[gpu 0\]"):
        emu.loads("[gpu 3]\n")


def test_fabric_faults_and_a_node_without_a_fabric(tmp_path: Path) -> None:
    path = str(tmp_path / "nvml.state")
    env = {emu.ENV_VAR: path}
    assert sim("init", "--gpus", "2", env=env).returncode == 0
    assert sim("fault", "gpu", "0", "fabric", "not-started", env=env).returncode == 0
    assert sim("fault", "gpu", "1", "fabric", "error", env=env).returncode == 0
    st = emu.load(path)
    assert st.gpus[0].fabric_state == emu.FABRIC_NOT_STARTED and st.gpus[0].fault_list == ["fabric-not-started"]
    assert (st.gpus[1].fabric_state, st.gpus[1].fabric_status) == (emu.FABRIC_COMPLETED, emu.NVML_ERROR_UNKNOWN)
    assert sim("clear", "gpu", "0", env=env).returncode == 0 and sim("clear", "gpu", "1", env=env).returncode == 0
    st = emu.load(path)
    assert [(g.fabric_state, g.fabric_status) for g in st.gpus] == [(emu.FABRIC_COMPLETED, 0)] * 2

    r = sim("init", "--gpus", "2", "--no-fabric", env=env)
    assert r.returncode == 0 and "no NVLink fabric" in r.stdout
    assert [g.fabric_state for g in emu.load(path).gpus] == [emu.FABRIC_NOT_SUPPORTED] * 2
    r = sim("fault", "gpu", "0", "fabric", "error", env=env)
    assert r.returncode == 64 and "has no NVLink fabric" in r.stderr
