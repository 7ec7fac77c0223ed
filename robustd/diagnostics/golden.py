"""The golden MiniGPT digest: the node digest known to be right for one device, driver and torch.

The child computes the node digest (stoptests/minigpt.py); this is the one place that
compares it with the recorded golden, after the run, because the key needs what only the daemon
knows (the driver, the CPU model) and what only the child knows (torch's version).
"""

from __future__ import annotations

from collections.abc import Callable

from robustd.diagnostics.model import Status, TestResult

TEST = "minigpt"


def node_result(results: list[TestResult]) -> TestResult | None:
    """The `host` result that carries a node digest, if the run produced one."""
    return next((x for x in results if x.test == TEST and x.component == "host" and "node_digest" in x.details),
                None)


def key(host: TestResult, driver: str, cpu_model: str) -> str:
    d = host.details
    device = d.get("device", "cpu")
    if device == "cpu":  # CPU kernels differ by instruction set: a CPU digest holds for one CPU model
        device = f"cpu {cpu_model}"
    return (f"{device}|{driver or 'no driver'}|torch {d.get('torch_version', '?')}"
            f"|{d.get('model', '?')}|{d.get('steps', '?')} steps")


def judge(results: list[TestResult], driver: str, cpu_model: str,
          golden: Callable[[str], str | None]) -> list[TestResult]:
    """Compare the node digest with the golden one of its key; a difference FAILs the `host` result."""
    host = node_result(results)
    if host is None:
        return results
    k = key(host, driver, cpu_model)
    host.details["golden_key"] = k
    recorded = golden(k)
    if recorded is not None:
        host.details["golden"] = recorded
    if host.status != Status.PASS:  # no node digest to compare (the ranks disagreed): the child said why
        return results
    if recorded is None:
        host.message = "node digest computed (no golden digest recorded)"
    elif recorded != host.details["node_digest"]:
        host.status = Status.FAIL
        host.message = f"node digest differs from the golden digest recorded for {k}"
    else:
        host.message = "node digest matches the golden digest"
    return results
