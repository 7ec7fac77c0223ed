"""Stop-time test 1 (EUD): the dcgmi diag JSON parser on literal 3.x/4.x documents, and the child end to end
against tests/fakes/dcgmi (pass, per-GPU fail, runtime error, non-zero exit with and without JSON, hang)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stoptests.dcgmi import DcgmiOutputError, canonical_test, parse_dcgmi_json
from stoptests.eud import requests_eud
from stoptests.protocol import Result, emit_progress, emit_result, load_spec, rank_component

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "tests" / "fakes" / "dcgmi"
GPUS = [{"index": i, "bus_id": f"0000:{0x18 + i:02x}:00.0", "uuid": f"GPU-{i}", "name": "NVIDIA H100"}
        for i in range(8)]


def bus(i: int) -> str:
    return f"gpu/0000:{0x18 + i:02x}:00.0"


def by_component(results: list[Result] | list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        key = r["component"] if isinstance(r, dict) else r.component
        assert key not in out, f"two results for {key}"
        out[key] = r
    return out


# ---------------------------------------------------------------- literal documents

DOC4_PASS = """
{
    "DCGM Diagnostic": {
        "test_categories": [
            {"category": "Deployment", "tests": [{"name": "software",
                "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
                            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Pass"}],
                "test_summary": {"status": "Pass"}}]},
            {"category": "Stress", "tests": [{"name": "eud",
                "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass",
                             "info": ["GPU 0: suites done"]},
                            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Pass"}],
                "test_summary": {"status": "Pass"}}]}
        ]
    },
    "entity_groups": [{"entity_group": "GPU", "entity_group_id": 1, "entities": [
        {"entity_id": 0, "serial_num": "SN-A0", "device_id": "2330"},
        {"entity_id": 1, "serial_num": "SN-A1", "device_id": "2330"}]}],
    "metadata": {"version": "4.4.1", "Driver Version Detected": "570.86.15", "EUD Test Version": "eud.570.1"}
}
"""

DOC4_FAIL = """
{
    "DCGM Diagnostic": {
        "test_categories": [
            {"category": "Hardware", "tests": [{"name": "memory",
                "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
                            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Fail",
                             "warnings": [{"warning": "row remap pending on GPU 1", "error_id": 85,
                                           "error_category": 10, "error_severity": 6}]},
                            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 2, "status": "Pass"}],
                "test_summary": {"status": "Fail", "warnings": [
                    {"warning": "row remap pending on GPU 1", "error_id": 85, "error_category": 10,
                     "error_severity": 6}]}}]},
            {"category": "Stress", "tests": [{"name": "eud",
                "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
                            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Pass"},
                            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 2, "status": "Fail",
                             "warnings": [{"warning": "EUD reported a miscompare", "error_id": 95,
                                           "error_category": 7, "error_severity": 2}]}],
                "test_summary": {"status": "Fail", "warnings": [
                    {"warning": "EUD reported a miscompare", "error_id": 95, "error_category": 7,
                     "error_severity": 2},
                    {"warning": "EUD spawn hit a timeout on the host", "error_id": 92, "error_category": 7,
                     "error_severity": 4}]}}]}
        ]
    },
    "metadata": {"version": "4.6.0"}
}
"""

# 3.x: gpu_id strings, display names, metadata as top-level siblings, and the 3.3.9 bug ("warnings" as the
# message key of an error object).
DOC3_FAIL = """
{
    "DCGM GPU Diagnostic": {
        "test_categories": [
            {"category": "Deployment", "tests": [
                {"name": "Denylist", "results": [{"gpu_id": "0", "status": "Pass"}, {"gpu_id": "1", "status": "Pass"}]},
                {"name": "Persistence Mode",
                 "results": [{"gpu_id": "0", "status": "Pass"}, {"gpu_id": "1", "status": "Pass"}]}]},
            {"category": "Hardware", "tests": [
                {"name": "GPU Memory",
                 "results": [{"gpu_id": "0", "status": "Pass"}, {"gpu_id": "1", "status": "Pass"}]}]},
            {"category": "Stress", "tests": [
                {"name": "EUD Test", "results": [
                    {"gpu_id": "0", "status": "Pass"},
                    {"gpu_id": "1", "status": "Fail",
                     "warnings": [{"warnings": "EUD exited non-zero on GPU 1", "error_id": 94,
                                   "error_category": 7, "error_severity": 4}]}]}]}
        ]
    },
    "version": "3.3.9",
    "Driver Version Detected": "550.54.15",
    "GPU Device IDs": ["2330", "2330"],
    "GPU Device Serials": {"0": "SN-30", "1": "SN-31"}
}
"""


def test_parse_4x_pass_maps_gpus_to_bus_ids_with_serials() -> None:
    results = by_component(parse_dcgmi_json(DOC4_PASS, GPUS[:2], require_eud=True))
    assert set(results) == {bus(0), bus(1)}
    r0 = results[bus(0)]
    assert r0.status == "PASS"
    assert r0.details["serial"] == "SN-A0"
    assert r0.details["eud"] == "pass"
    assert r0.details["tests_passed"] == ["software", "eud"]
    assert r0.details["dcgm_version"] == "4.4.1"
    assert "error_ids" not in r0.details


def test_parse_4x_fail_errors_severity_action_and_global_errors() -> None:
    results = by_component(parse_dcgmi_json(DOC4_FAIL, GPUS[:3]))
    assert results[bus(0)].status == "PASS"
    reset = results[bus(1)]
    assert reset.status == "FAIL"
    assert reset.details["tests_failed"] == ["memory"]
    assert reset.details["error_ids"] == [85]
    assert reset.details["error_categories"] == [10]
    assert reset.details["error_severities"] == [6]
    assert reset.details["severity"] == "CRITICAL"
    assert reset.details["action"] == "RESET_GPU"
    assert "PENDING_ROW_REMAP" in reset.message and "RESET" in reset.message
    isolate = results[bus(2)]
    assert isolate.status == "FAIL"
    assert isolate.details["tests_failed"] == ["eud"]
    assert isolate.details["error_ids"] == [95]
    assert isolate.details["error_severities"] == [2]
    assert isolate.details["severity"] == "CRITICAL"
    assert "action" not in isolate.details
    assert isolate.details["errors"][0]["name"] == "EUD_TEST_FAILED"
    assert "EUD reported a miscompare" in isolate.message
    # The summary error tied to no GPU is a host failure; TRIAGE severity only → WARNING.
    host = results["host"]
    assert host.status == "FAIL"
    assert host.details["error_ids"] == [92]
    assert host.details["severity"] == "WARNING"
    assert "action" not in host.details


def test_parse_3x_display_names_gpu_id_strings_and_3_3_9_warnings_key() -> None:
    results = by_component(parse_dcgmi_json(DOC3_FAIL, GPUS[:2], require_eud=True))
    assert results[bus(0)].status == "PASS"
    assert results[bus(0)].details["serial"] == "SN-30"
    assert results[bus(0)].details["dcgm_version"] == "3.3.9"
    bad = results[bus(1)]
    assert bad.status == "FAIL"
    assert bad.details["tests_failed"] == ["eud"]
    assert bad.details["error_ids"] == [94]
    assert bad.details["error_severities"] == [4]
    assert bad.details["severity"] == "WARNING"
    assert "EUD exited non-zero on GPU 1" in bad.message
    assert "memory" in bad.details["tests_passed"]
    assert "host" not in results


def test_parse_3x_metadata_inside_the_root_and_a_warning_string() -> None:
    doc = {"DCGM GPU Diagnostic": {"version": "3.1.7", "test_categories": [{"category": "Stress", "tests": [
        {"name": "EUD Test", "results": [{"gpu_id": "0", "status": "Fail", "warnings": ["plain text warning"]}]}]}]}}
    (r,) = parse_dcgmi_json(json.dumps(doc), GPUS[:1])
    assert (r.component, r.status) == (bus(0), "FAIL")
    assert r.details["dcgm_version"] == "3.1.7"
    assert r.details["error_ids"] == []
    assert r.details["severity"] == "WARNING"
    assert "plain text warning" in r.message


def test_unknown_gpu_index_is_named_by_index() -> None:
    results = by_component(parse_dcgmi_json(DOC4_PASS, []))
    assert set(results) == {"gpu/index0", "gpu/index1"}


def test_spec_gpu_missing_from_the_output_is_skipped() -> None:
    results = by_component(parse_dcgmi_json(DOC4_PASS, GPUS[:3], require_eud=True))
    assert results[bus(2)].status == "SKIPPED"
    assert "not in the dcgmi diag output" in results[bus(2)].message


def test_runtime_error_is_an_error_on_host() -> None:
    doc = '{"DCGM Diagnostic": {"version": "4.2.3", "runtime_error": "the host engine went away"}}'
    (r,) = parse_dcgmi_json(doc, GPUS)
    assert (r.component, r.status) == ("host", "ERROR")
    assert "the host engine went away" in r.message
    assert r.details["runtime_error"] == "the host engine went away"


def test_runtime_error_saying_eud_is_missing_is_skipped() -> None:
    doc = '{"DCGM Diagnostic": {"version": "4.4.2", "runtime_error": "test eud not found"}}'
    (r,) = parse_dcgmi_json(doc, GPUS, require_eud=True)
    assert (r.component, r.status) == ("host", "SKIPPED")
    assert "EUD not available" in r.message


def test_iterations_fail_when_one_iteration_fails() -> None:
    doc = '{"iterations": [' + DOC4_PASS + ", " + DOC4_FAIL + '], "Overall Result": "Fail"}'
    results = by_component(parse_dcgmi_json(doc, GPUS[:3]))
    assert results[bus(0)].status == "PASS"
    assert results[bus(0)].details["iterations"] == 2
    assert results[bus(2)].status == "FAIL"
    assert results[bus(2)].details["iterations_failed"] == [2]
    assert "iteration 2" in results[bus(2)].message


def test_eud_absent_is_skipped_on_host_never_pass() -> None:
    doc = json.loads(DOC4_PASS)
    doc["DCGM Diagnostic"]["test_categories"].pop()  # no eud test: not installed, or nvvs not root
    results = parse_dcgmi_json(json.dumps(doc), GPUS[:2], require_eud=True)
    assert [(r.component, r.status) for r in results] == [("host", "SKIPPED")]
    assert "EUD did not run" in results[0].message
    # A run level (-r 3) that does not name eud judges the GPUs on the tests that ran.
    results = by_component(parse_dcgmi_json(json.dumps(doc), GPUS[:2], require_eud=False))
    assert results[bus(0)].status == "PASS"
    assert results[bus(0)].details["eud"] == "not run"


def test_eud_skipped_on_a_gpu_is_skipped_with_its_reason() -> None:
    doc = json.loads(DOC4_PASS)
    eud = doc["DCGM Diagnostic"]["test_categories"][1]["tests"][0]
    eud["results"][1] = {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Skip",
                         "info": ["EUD package not installed"]}
    results = by_component(parse_dcgmi_json(json.dumps(doc), GPUS[:2], require_eud=True))
    assert results[bus(0)].status == "PASS"
    assert results[bus(1)].status == "SKIPPED"
    assert "EUD package not installed" in results[bus(1)].message


def test_banner_before_the_json_and_garbage() -> None:
    (r, _) = parse_dcgmi_json("Successfully ran diagnostic for group.\n" + DOC4_PASS, GPUS[:2])
    assert r.status == "PASS"
    with pytest.raises(DcgmiOutputError):
        parse_dcgmi_json("Error: unable to connect to host engine", GPUS)
    with pytest.raises(DcgmiOutputError):
        parse_dcgmi_json('{"something": "else"}', GPUS)


def test_names_and_command() -> None:
    assert canonical_test("EUD Test") == "eud"
    assert canonical_test("GPU Memory") == "memory"
    assert canonical_test("Targeted Stress") == "targeted_stress"
    assert requests_eud(["dcgmi", "diag", "-r", "eud", "-j"])
    assert requests_eud(["dcgmi", "diag", "--run=pcie,EUD", "-j"])
    assert not requests_eud(["dcgmi", "diag", "-r", "3", "-j"])


# ---------------------------------------------------------------- the shared child helpers


def test_child_helpers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({"test": "eud", "gpus": GPUS[:2]}))
    spec = load_spec(["--spec", str(spec_path)])
    assert rank_component(spec, 1) == bus(1)
    assert rank_component({"gpus": []}, 3) == "rank/3"
    emit_progress(50, "half")
    emit_result("host", "SKIPPED", "dcgmi not found", details={"reason": "x"})
    emit_result(Result("gpu/x", "PASS", "ok", {"busbw_gbps": 1.5}))
    with pytest.raises(ValueError):
        emit_result("host", "MAYBE", "?")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        {"type": "progress", "percent": 50.0, "message": "half"},
        {"type": "result", "component": "host", "status": "SKIPPED", "message": "dcgmi not found",
         "figures": {}, "details": {"reason": "x"}},
        {"type": "result", "component": "gpu/x", "status": "PASS", "message": "ok",
         "figures": {"busbw_gbps": 1.5}, "details": {}},
    ]


# ---------------------------------------------------------------- the child, end to end


def run_child(tmp_path: Path, mode: str, command: list[str] | None = None,
              timeout: float = 30.0) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    spec = {"test": "eud", "run_id": "d-test", "node": "node-a", "work_dir": str(tmp_path), "timeout": timeout,
            "gpus": GPUS, "eud": {"command": command or [str(FAKE), "diag", "-r", "eud", "-j"]}, "faults": {}}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "FAKE_DCGMI_MODE": mode}
    proc = subprocess.run([sys.executable, "-m", "stoptests.eud", "--spec", str(spec_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout + 30)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert all(line["type"] in ("progress", "result") for line in lines)
    assert proc.returncode == 0, proc.stderr
    return proc, [line for line in lines if line["type"] == "result"]


@pytest.mark.parametrize("mode", ["pass4", "pass3"])
def test_child_pass(tmp_path: Path, mode: str) -> None:
    _, results = run_child(tmp_path, mode)
    assert [r["component"] for r in results] == [bus(i) for i in range(8)]
    assert {r["status"] for r in results} == {"PASS"}
    assert all(r["details"]["eud"] == "pass" and r["details"]["exit_code"] == 0 for r in results)
    assert all(r["details"]["serial"] == f"165482300{i:04d}" for i, r in enumerate(results))
    assert all(r["figures"]["duration_s"] >= 0 for r in results)


def test_child_fail4_exit_205_still_parsed(tmp_path: Path) -> None:
    _, results = run_child(tmp_path, "fail4")
    got = by_component(results)
    assert set(got) == {bus(i) for i in range(8)}
    assert [c for c, r in got.items() if r["status"] != "PASS"] == [bus(2), bus(5)]
    eud = got[bus(2)]
    assert eud["status"] == "FAIL"
    assert eud["details"]["tests_failed"] == ["eud"]
    assert eud["details"]["error_ids"] == [95]
    assert eud["details"]["error_categories"] == [7]
    assert eud["details"]["error_severities"] == [2]
    assert eud["details"]["severity"] == "CRITICAL"
    assert "action" not in eud["details"]
    assert eud["details"]["exit_code"] == 205
    mem = got[bus(5)]
    assert mem["status"] == "FAIL"
    assert mem["details"]["tests_failed"] == ["memory"]
    assert mem["details"]["error_ids"] == [85]
    assert mem["details"]["error_severities"] == [6]
    assert mem["details"]["action"] == "RESET_GPU"
    assert mem["details"]["eud"] == "pass"


def test_child_fail3_exit_226_still_parsed(tmp_path: Path) -> None:
    _, results = run_child(tmp_path, "fail3")
    got = by_component(results)
    assert [c for c, r in got.items() if r["status"] != "PASS"] == [bus(3), bus(6)]
    assert got[bus(3)]["details"]["error_ids"] == [94]
    assert got[bus(3)]["details"]["severity"] == "WARNING"
    assert "EUD exited with status 3" in got[bus(3)]["message"]
    assert got[bus(6)]["details"]["error_ids"] == [85]
    assert got[bus(6)]["details"]["action"] == "RESET_GPU"
    assert got[bus(6)]["details"]["exit_code"] == 226


def test_child_iterations(tmp_path: Path) -> None:
    _, results = run_child(tmp_path, "iter4")
    got = by_component(results)
    assert got[bus(2)]["status"] == "FAIL"
    assert got[bus(2)]["details"]["iterations_failed"] == [2]
    assert got[bus(0)]["status"] == "PASS"


def test_child_eud_not_installed(tmp_path: Path) -> None:
    _, results = run_child(tmp_path, "noeud4")
    assert [(r["component"], r["status"]) for r in results] == [("host", "SKIPPED")]
    assert "EUD did not run" in results[0]["message"]
    # The same output from a run level that does not ask for eud judges the GPUs on what ran.
    _, results = run_child(tmp_path, "noeud4", [str(FAKE), "diag", "-r", "3", "-j"])
    assert {r["status"] for r in results} == {"PASS"} and len(results) == 8


def test_child_runtime_error(tmp_path: Path) -> None:
    _, results = run_child(tmp_path, "runtime_error")
    assert [(r["component"], r["status"]) for r in results] == [("host", "ERROR")]
    assert "nvvs stopped before it reported any result" in results[0]["message"]
    assert results[0]["details"]["exit_code"] == 226


def test_child_nonzero_exit_without_json(tmp_path: Path) -> None:
    _, results = run_child(tmp_path, "nojson")
    assert [(r["component"], r["status"]) for r in results] == [("host", "ERROR")]
    assert results[0]["details"]["exit_code"] == 204
    assert "nvvs binary not found" in results[0]["details"]["stderr_tail"]
    assert "204" in results[0]["message"]


def test_child_hang_is_killed_at_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    proc, results = run_child(tmp_path, "hang", timeout=2.0)
    assert time.monotonic() - start < 10
    assert [(r["component"], r["status"]) for r in results] == [("host", "ERROR")]
    assert "hung" in results[0]["message"]
    assert results[0]["details"]["hung"] is True
    assert results[0]["figures"]["duration_s"] >= 2.0


def test_child_dcgmi_missing_is_an_error_never_pass_nor_fail(tmp_path: Path) -> None:
    # The harness cannot run the test: an ERROR that says what to fix, not a SKIP a full run passes with.
    _, results = run_child(tmp_path, "pass4", ["dcgmi-not-installed-here", "diag", "-r", "eud", "-j"])
    assert [(r["component"], r["status"]) for r in results] == [("host", "ERROR")]
    assert results[0]["message"].startswith("dcgmi not found: dcgmi-not-installed-here")
    assert "install DCGM" in results[0]["message"]


@pytest.mark.parametrize("eud, words", [
    ({"command": ["x"] * 1000}, "eud.command has 1000 items"),
    ({"command": ["dcgmi"], "timeout": 1e12}, "eud.timeout must be between"),
    ({"command": "dcgmi", "timeout": "soon"}, "eud.timeout must be a number"),
])
def test_child_bad_spec_cannot_run(tmp_path: Path, eud: dict[str, Any], words: str) -> None:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({"test": "eud", "timeout": 30, "gpus": GPUS, "eud": eud, "faults": {}}))
    proc = subprocess.run([sys.executable, "-m", "stoptests.eud", "--spec", str(spec_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and not proc.stdout  # PROTOCOL.md: could not run; the daemon records an ERROR
    assert proc.stderr.strip().splitlines()[-1].startswith("bad spec: ") and words in proc.stderr


def test_child_oversized_spec_cannot_run(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({"test": "eud", "pad": "x" * (2 << 20)}))
    proc = subprocess.run([sys.executable, "-m", "stoptests.eud", "--spec", str(spec_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "larger than" in proc.stderr.splitlines()[-1]
