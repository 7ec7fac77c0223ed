"""The stop-time tests: one entry each, read by the config, the manager and the child launcher.

Adding a test is one child module under stoptests/ (PROTOCOL.md) and one entry here: the
config accepts its name in `diagnostics.levels`, the manager runs it (with a rendezvous when it needs
one) and applies its judgement after the child, the launcher starts its module, and the policy knows
the codes its FAILs raise (`DIAG_<TEST>_FAILED` on the component the result names).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from robustd.codes import CodeRule
from robustd.diagnostics import golden
from robustd.diagnostics.model import TestResult


@dataclass(frozen=True)
class JudgeContext:
    """What a judgement after the run may know besides the child's results."""

    driver: str  # the GPU driver version, "" without one
    cpu_model: str
    golden: Callable[[str], str | None]  # the recorded golden digest of a key, if any


Judge = Callable[[list[TestResult], JudgeContext], list[TestResult]]


def _hardware(test: str) -> dict[str, CodeRule]:
    """A FAIL names hardware: out of its jobs and inspected. A wildcard key, so a test's own hint
    (DCGM's ISOLATE vs RESET severity of an EUD error) wins."""
    return {f"DIAG_{test.upper()}_*": CodeRule(severity="CRITICAL", action="HW_INSPECT", clear_after="7d",
                                               description=f"the {test} stop-time test named this component")}


@dataclass(frozen=True)
class StopTimeTest:
    name: str
    module: str  # the child: `<diagnostics.python> -m <module> --spec SPEC.json`
    section: str  # its section under `diagnostics:` in robustd.yaml (at least a `timeout`)
    needs_rendezvous: bool = False  # run only with a rendezvous from the scheduler (the nodes of one job)
    judge: Judge | None = None  # the daemon's one judgement after the child, on the child's results
    codes: Mapping[str, CodeRule] = field(default_factory=dict)

    @property
    def failed_code(self) -> str:
        return f"DIAG_{self.name.upper()}_FAILED"


TESTS: Mapping[str, StopTimeTest] = {t.name: t for t in (
    StopTimeTest("eud", "stoptests.eud", "eud", codes=_hardware("eud")),
    StopTimeTest("all_to_all", "stoptests.all_to_all", "collectives", codes=_hardware("all_to_all")),
    # A peer named by this node's all-gather is the peer's fault, not this node's: keep training, look.
    StopTimeTest("all_gather", "stoptests.all_gather", "collectives", needs_rendezvous=True,
                 codes={"DIAG_ALL_GATHER_*": CodeRule(severity="WARNING", action="HW_INSPECT", clear_after="7d",
                                                      description="a peer node's all-gather data was wrong, "
                                                                  "late or missing")}),
    StopTimeTest("minigpt", "stoptests.minigpt", "minigpt",
                 judge=lambda results, ctx: golden.judge(results, ctx.driver, ctx.cpu_model, ctx.golden),
                 codes=_hardware("minigpt")),
)}
NAMES = tuple(TESTS)


def codes() -> dict[str, CodeRule]:
    """Every test's codes, for the policy's code table."""
    return {code: rule for t in TESTS.values() for code, rule in t.codes.items()}
