"""MiniGPT bitwise replay child (stoptests/minigpt.py), run as the daemon runs it: a subprocess with a spec.

Only the CPU path runs here (one worker per `cpu_ranks`); the verdict logic and component naming are pure
functions tested directly. This module never imports torch itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from robustd.diagnostics import golden
from robustd.diagnostics.launcher import parse_result
from robustd.diagnostics.model import Status, TestResult
from stoptests.minigpt import RankOutcome, judge, majority, rank_components

REPO = Path(__file__).resolve().parent.parent
STEPS = 8
DIGEST_A, DIGEST_B, DIGEST_C = "a" * 64, "b" * 64, "c" * 64


def run_raw(tmp_path: Path, name: str, python: str = sys.executable,
            **overrides: Any) -> subprocess.CompletedProcess[str]:
    spec: dict[str, Any] = {"test": "minigpt", "run_id": f"t-{name}", "node": "test-node",
                            "work_dir": str(tmp_path), "timeout": 60.0, "gpus": [], "backend": "gloo",
                            "cpu_ranks": 4, "steps": STEPS, "faults": {}}
    spec.update(overrides)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    return subprocess.run([python, "-m", "stoptests.minigpt", "--spec", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def run_child(tmp_path: Path, name: str, **overrides: Any) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    proc = run_raw(tmp_path, name, **overrides)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = {r["component"]: r for r in lines if r["type"] == "result"}
    progress = [p for p in lines if p["type"] == "progress"]
    return results, progress


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    results, progress = run_child(tmp_path_factory.mktemp("minigpt"), "baseline")
    assert progress and progress[-1]["percent"] == 100.0
    return results


# ---------------------------------------------------------------------------------------------- pure functions

def test_rank_components_gpus_and_cpu() -> None:
    gpus = [{"index": 0, "bus_id": "0000:1b:00.0", "uuid": "GPU-a", "name": "NVIDIA H100"},
            {"index": 1, "bus_id": "0000:1c:00.0", "uuid": "GPU-b", "name": "NVIDIA H100"}]
    assert rank_components({"gpus": gpus, "cpu_ranks": 4}) == ["gpu/0000:1b:00.0", "gpu/0000:1c:00.0"]
    assert rank_components({"gpus": [], "cpu_ranks": 3}) == ["rank/0", "rank/1", "rank/2"]
    assert rank_components({}) == ["rank/0", "rank/1", "rank/2", "rank/3"]


def test_majority() -> None:
    assert majority([DIGEST_A] * 3 + [DIGEST_B]) == (DIGEST_A, 3)
    assert majority([DIGEST_A, DIGEST_A, DIGEST_B, DIGEST_B]) == (None, 2)
    assert majority([DIGEST_A]) == (DIGEST_A, 1)
    assert majority([]) == (None, 0)


def _outcomes(*digests: str | None) -> list[RankOutcome]:
    return [RankOutcome(rank=i, component=f"gpu/0000:{i:02x}:00.0", digest=d, final_loss=1.5, duration_s=1.0)
            for i, d in enumerate(digests)]


def _judge(outcomes: list[RankOutcome]) -> dict[str, dict[str, Any]]:
    results = judge(outcomes, "GPU", {"torch_version": "x", "device": "NVIDIA H100"}, 2.0)
    return {r["component"]: r for r in results}


def _golden(results: dict[str, dict[str, Any]], recorded: str) -> TestResult:
    """The host result after the daemon's one golden judgement (the child only computes the node digest)."""
    parsed = [parse_result("minigpt", r) for r in results.values()]
    judged = golden.judge(parsed, driver="", cpu_model="test CPU", golden=lambda key: recorded)
    return next(x for x in judged if x.component == "host")


def test_judge_minority_is_the_suspect() -> None:
    res = _judge(_outcomes(DIGEST_A, DIGEST_A, DIGEST_B, DIGEST_A))
    odd = res["gpu/0000:02:00.0"]
    assert odd["status"] == "FAIL"
    assert odd["message"] == "bitwise mismatch against the other 3 GPUs"
    assert odd["details"] == {"digest": DIGEST_B, "majority_digest": DIGEST_A}
    assert [res[f"gpu/0000:0{i}:00.0"]["status"] for i in (0, 1, 3)] == ["PASS"] * 3
    assert res["host"]["status"] == "PASS"
    assert res["host"]["details"]["node_digest"] == DIGEST_A


def test_judge_no_majority_fails_everything() -> None:
    res = _judge(_outcomes(DIGEST_A, DIGEST_B, DIGEST_A, DIGEST_B))
    assert {r["status"] for r in res.values()} == {"FAIL"}
    assert "no majority" in res["gpu/0000:00:00.0"]["message"]
    assert "no majority" in res["host"]["message"]
    assert res["host"]["details"]["node_digest"] is None
    res = _judge(_outcomes(DIGEST_A, DIGEST_B, DIGEST_C))
    assert {r["status"] for r in res.values()} == {"FAIL"}


def test_judge_nan_and_crashed_ranks_fail_alone() -> None:
    outcomes = _outcomes(DIGEST_A, DIGEST_C, DIGEST_A, None)
    outcomes[1].finite, outcomes[1].final_loss = False, float("nan")
    outcomes[3].error = "replay worker failed (exit 1): CUDA error"
    res = _judge(outcomes)
    assert res["gpu/0000:01:00.0"]["status"] == "FAIL" and "non-finite" in res["gpu/0000:01:00.0"]["message"]
    assert "final_loss" not in res["gpu/0000:01:00.0"]["figures"]
    assert res["gpu/0000:03:00.0"]["status"] == "FAIL" and "CUDA error" in res["gpu/0000:03:00.0"]["message"]
    assert res["gpu/0000:00:00.0"]["status"] == res["gpu/0000:02:00.0"]["status"] == "PASS"
    assert res["host"]["status"] == "PASS" and res["host"]["details"]["node_digest"] == DIGEST_A


def test_judge_ranks_without_evidence_are_skipped_a_hung_one_fails() -> None:
    outcomes = _outcomes(DIGEST_A, DIGEST_A, None, None)
    outcomes[2].skipped = "replay not started: the test ran out of time"
    outcomes[3].error = "replay hung: not finished after 30.0s while the slowest other rank took 2.0s"
    res = _judge(outcomes)
    assert res["gpu/0000:02:00.0"]["status"] == "SKIPPED" and "not started" in res["gpu/0000:02:00.0"]["message"]
    assert res["gpu/0000:03:00.0"]["status"] == "FAIL" and "hung" in res["gpu/0000:03:00.0"]["message"]
    assert res["host"]["status"] == "PASS" and res["host"]["details"]["node_digest"] == DIGEST_A


def test_judge_golden() -> None:
    assert _golden(_judge(_outcomes(DIGEST_A, DIGEST_A)), DIGEST_A).status == Status.PASS
    host = _golden(_judge(_outcomes(DIGEST_A, DIGEST_A)), DIGEST_B)
    assert host.status == Status.FAIL
    assert host.details["node_digest"] == DIGEST_A and host.details["golden"] == DIGEST_B


# ---------------------------------------------------------------------------------------------- the child

def test_cpu_ranks_agree_bitwise(baseline: dict[str, dict[str, Any]]) -> None:
    ranks = [f"rank/{i}" for i in range(4)]
    assert sorted(baseline) == sorted([*ranks, "host"])
    digests = {baseline[c]["details"]["digest"] for c in ranks}
    assert len(digests) == 1
    (digest,) = digests
    assert len(digest) == 64 and int(digest, 16) >= 0
    for c in ranks:
        r = baseline[c]
        assert r["status"] == "PASS", r
        assert r["figures"]["duration_s"] > 0
        assert 0 < r["figures"]["final_loss"] < r["details"]["first_loss"]  # it trained
    host = baseline["host"]
    assert host["status"] == "PASS"
    assert host["details"]["node_digest"] == digest
    assert host["details"]["device"] == "cpu"
    assert host["details"]["torch_version"].startswith("2.13.0")
    assert "golden" not in host["details"]  # compared by the daemon after the run (robustd/diagnostics/golden.py)
    assert host["details"]["steps"] == STEPS and host["details"]["model"].startswith("robustd-minigpt-v1")
    assert host["figures"]["final_loss"] == baseline["rank/0"]["figures"]["final_loss"]


def test_reproducible_across_runs_and_golden_match(baseline: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    node_digest = baseline["host"]["details"]["node_digest"]
    results, _ = run_child(tmp_path, "again", cpu_ranks=2)
    assert results["host"]["details"]["node_digest"] == node_digest  # bitwise identical in a fresh run
    host = _golden(results, node_digest)
    assert host.status == Status.PASS
    assert "golden" in host.message
    assert [results[f"rank/{i}"]["status"] for i in range(2)] == ["PASS", "PASS"]


def test_golden_mismatch_fails_host(baseline: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    results, _ = run_child(tmp_path, "golden", cpu_ranks=2)
    host = _golden(results, "0" * 64)
    assert host.status == Status.FAIL
    assert host.details["golden"] == "0" * 64
    assert host.details["node_digest"] == baseline["host"]["details"]["node_digest"]
    assert [results[f"rank/{i}"]["status"] for i in range(2)] == ["PASS", "PASS"]  # the ranks agree


def test_one_ulp_perturbation_is_attributed(baseline: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    results, _ = run_child(tmp_path, "ulp", faults={"perturb_ulp": {"rank": 1}})
    good = baseline["host"]["details"]["node_digest"]
    assert results["rank/1"]["status"] == "FAIL"
    assert results["rank/1"]["message"] == "bitwise mismatch against the other 3 ranks"
    assert results["rank/1"]["details"]["majority_digest"] == good
    assert results["rank/1"]["details"]["digest"] != good
    assert [results[f"rank/{i}"]["status"] for i in (0, 2, 3)] == ["PASS"] * 3
    assert results["host"]["status"] == "PASS" and results["host"]["details"]["node_digest"] == good


def test_timeout_before_any_digest_cannot_run_never_fails(tmp_path: Path) -> None:
    # No rank finished (the workers cannot even import torch in 0.5 s): no digest to compare, no
    # evidence about any device. The test could not run (exit 2: the daemon's ERROR), never a FAIL.
    proc = run_raw(tmp_path, "timeout", cpu_ranks=2, timeout=0.5)
    assert proc.returncode == 2 and '"status": "FAIL"' not in proc.stdout
    reason = proc.stderr.strip().splitlines()[-1]
    assert reason.startswith("no rank produced a digest: rank/0: ") and "did not finish" in reason


def test_without_torch_the_test_cannot_run(tmp_path: Path, python_without_torch: str) -> None:
    proc = run_raw(tmp_path, "notorch", python=python_without_torch, cpu_ranks=2)
    assert proc.returncode == 2 and '"type": "result"' not in proc.stdout
    assert "torch is not usable here" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("overrides, words", [
    ({"steps": 10**9}, "steps must be between"),
    ({"cpu_ranks": 5000}, "cpu_ranks must be between"),
    ({"gpus": "all"}, "gpus must be a list"),
])
def test_bad_spec_cannot_run(tmp_path: Path, overrides: dict[str, Any], words: str) -> None:
    proc = run_raw(tmp_path, "bad", **overrides)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("bad spec: ")
    assert words in proc.stderr
