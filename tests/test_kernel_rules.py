"""The shipped kernel rules, loaded through the daemon's loader, on real line shapes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from checks.kernel.rules import SHIPPED_RULE_FILES, SHIPPED_RULES, RuleError, RuleSet, load_rules, normalize_bdf
from robustd.codes import CodeTable
from robustd.model import Action, FindingKind, Severity

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules(SHIPPED_RULE_FILES)


def shipped_docs() -> list[dict]:
    import yaml

    return [yaml.safe_load(Path(p).read_text()) for p in SHIPPED_RULE_FILES]


def one(rules: RuleSet, *lines: str):
    found = rules.match(list(lines))
    assert len(found) == 1, f"expected one finding for {lines[-1]!r}, got {found}"
    return found[0]


def test_shipped_rules_compile_and_examples_hold(rules: RuleSet) -> None:
    # load_rules verifies every example and counter-example; check the set is substantial too.
    assert len(rules.rules) >= 20
    for doc in shipped_docs():
        total = sum(len(r.get("examples", [])) for r in doc["rules"])
        assert total >= len(doc["rules"])
        for rule in doc["rules"]:
            assert rule.get("examples"), f"rule {rule.get('name')} has no examples"


def test_no_shipped_rule_claims_another_files_examples(rules: RuleSet) -> None:
    """The loader checks each file's order on its own; the shipped files are loaded together, so each
    example must still be claimed first by its own rule in the whole set."""
    for doc in shipped_docs():
        for raw in doc["rules"]:
            name = raw.get("name") or raw.get("code") or f"resolve {raw['resolves']}"
            for ex in raw.get("examples", []):
                line = ex if isinstance(ex, str) else ex["line"]
                hit = rules.first(line.rstrip("\n").split("\n"))
                assert hit is not None and hit[0].name == name, (name, line, hit and hit[0].name)


def test_xid_table_covers_required_codes(rules: RuleSet) -> None:
    need = [8, 13, 31, 32, 38, 43, 45, 48, 56, 57, 58, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 110,
            119, 120, 121, 136, 137, 140, 143, *range(144, 151), 154, 158, 171, 172]
    for xid in need:
        assert f"XID_{xid}" in rules.codes, xid
        assert rules.codes[f"XID_{xid}"].description
    table = CodeTable([rules.codes])

    def meaning(code: str):
        return table.resolve(code, hint_severity=None, hint_action=None, default_clear_after=300,
                             default_escalate=2)

    for xid in (13, 31, 32, 45, 68, 69, 94):
        m = meaning(f"XID_{xid}")
        assert (m.severity, m.action) == (Severity.WARNING, Action.RESTART_JOB), xid
    assert meaning("XID_79").action == Action.REBOOT and meaning("XID_79").sticky
    for xid in (48, 64, 74, 95):
        assert (meaning(f"XID_{xid}").severity, meaning(f"XID_{xid}").action) == (Severity.CRITICAL, Action.RESET_GPU)
    assert (meaning("XID_63").severity, meaning("XID_63").action) == (Severity.WARNING, Action.RESET_GPU)
    assert meaning("XID_92").action == Action.NONE
    assert (meaning("XID_999").severity, meaning("XID_999").action) == (Severity.WARNING, Action.HW_INSPECT)
    assert rules.codes["XID_154"].severity is None and rules.codes["XID_154"].action is None
    tol = rules.codes["MLX5_LINK_DOWN"].tolerate
    assert tol is not None and tol.count == 3 and tol.window == 300


@pytest.mark.parametrize("line,code,component", [
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1101234, name=nvc:[driver], GPU has fallen off the bus.",
     "XID_79", "gpu/0000:3b:00.0"),
    ("NVRM: Xid (PCI:0000:3B:00): 13, pid=3234, name=python3, Graphics SM Warp Exception on (GPC 2, TPC 2, SM 1)",
     "XID_13", "gpu/0000:3b:00.0"),
    ("NVRM: Xid (PCI:0000:3b:00 GPU-I:02 GPU-CI:01): 31, pid=77, name=python3, Ch 00000008, MMU Fault",
     "XID_31", "gpu/0000:3b:00.0"),
    ("NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link 14"
     "(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", "XID_74", "gpu/0003:00:00.0"),
    ("NVRM: Xid (PCI:0000:2a:00): 999, something new", "XID_999", "gpu/0000:2a:00.0"),
    ("pcieport 0000:00:01.0: AER: Corrected error received: 0000:01:00.0", "PCIE_AER_CORRECTED", "pcie/0000:01:00.0"),
    ("pcieport 0000:00:1c.0: AER: Correctable error message received from 0000:00:1c.0",
     "PCIE_AER_CORRECTED", "pcie/0000:00:1c.0"),
    ("pcieport 0000:00:1c.0: AER: Multiple Uncorrectable (Non-Fatal) error message received from 0000:73:00.1",
     "PCIE_AER_NONFATAL", "pcie/0000:73:00.1"),
    ("pcieport 0000:00:01.0: AER: Uncorrected (Non-Fatal) error received: 0000:01:00.0",
     "PCIE_AER_NONFATAL", "pcie/0000:01:00.0"),
    ("pcieport 0000:00:01.0: AER: Multiple Uncorrected (Fatal) error received: 0000:01:00.0",
     "PCIE_AER_FATAL", "pcie/0000:01:00.0"),
    ("pcieport 0000:00:1c.0: AER: Uncorrectable (Fatal) error message received from 0000:73:00.1",
     "PCIE_AER_FATAL", "pcie/0000:73:00.1"),
    ("INFO: task python:4321 blocked for more than 120 seconds.", "HUNG_TASK", "host"),
    ("Out of memory: Killed process 1234 (python) total-vm:1000kB, anon-rss:500kB, file-rss:0kB, shmem-rss:0kB, "
     "UID:0 pgtables:100kB oom_score_adj:0", "OOM_KILL", "host"),
    ("blk_update_request: I/O error, dev nvme0n1, sector 32776 op 0x1:(WRITE) flags 0x3000 phys_seg 6 prio class 0",
     "DISK_IO_ERROR", "disk/nvme0n1"),
    ("I/O error, dev sda, sector 2048 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 2", "DISK_IO_ERROR", "disk/sda"),
    ("Buffer I/O error on dev nvme0n1p3, logical block 0, async page read", "DISK_IO_ERROR", "disk/nvme0n1p3"),
    ("EXT4-fs (sdb7): Remounting filesystem read-only", "FS_READONLY", "disk/sdb7"),
    ("XFS (dm-0): Filesystem has been shut down due to log error (0x2).", "FS_SHUTDOWN", "disk/dm-0"),
    ("mlx5_core 0000:0c:00.0 ens1f0np0: Link down", "MLX5_LINK_DOWN", "nic/ens1f0np0"),
    ("EDAC MC1: 1 UE memory read error on CPU_SrcID#1_MC#0_Chan#0_DIMM#0 (channel:0 slot:0)", "EDAC_UE", "memory/mc1"),
    ("mce: CPU3: Core temperature above threshold, cpu clock throttled (total events = 9)",
     "CPU_THERMAL_THROTTLE", "host"),
])
def test_line_table(rules: RuleSet, line: str, code: str, component: str) -> None:
    f = one(rules, line)
    assert (f.code, f.component, f.kind) == (code, component, FindingKind.OCCURRENCE)
    assert f.evidence["line"] == line and f.evidence["rule"]


def test_xid_evidence_and_mig(rules: RuleSet) -> None:
    f = one(rules, "NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 13, pid=2211, name=python3, Graphics Exception")
    assert f.evidence["xid"] == "13" and f.evidence["pid"] == "2211" and f.evidence["name"] == "python3"
    assert f.evidence["gpu_instance"] == "01" and f.evidence["compute_instance"] == "00"
    assert f.evidence["bdf"] == "0000:3b:00.0"


FALLEN = "NVRM: Xid (PCI:0000:c6:00): {}, pid=1101234, name=nvc:[driver], GPU has fallen off the bus."


@pytest.mark.parametrize("xid", ["079", "0079", "79"])
def test_a_zero_padded_xid_is_the_same_xid(rules: RuleSet, xid: str) -> None:
    """`079` is Xid 79: XID_79 with its table meaning (CRITICAL, REBOOT, sticky), not a triage code of its own."""
    f = one(rules, FALLEN.format(xid))
    assert (f.code, f.component, f.evidence["xid"]) == ("XID_79", "gpu/0000:c6:00.0", "79")
    assert f.message == "Xid 79 on GPU 0000:c6:00.0: GPU has fallen off the bus."
    assert f.evidence["line"] == FALLEN.format(xid)  # the line as the kernel wrote it
    m = CodeTable([rules.codes]).resolve(f.code, hint_severity=f.severity, hint_action=f.action,
                                         default_clear_after=300, default_escalate=2)
    assert (m.severity, m.action, m.sticky) == (Severity.CRITICAL, Action.REBOOT, True)


def test_zero_padding_keeps_the_xid_bound(rules: RuleSet) -> None:
    """The field stays at most 4 characters, zeros included: a long run of zeros is no Xid and no new code."""
    assert rules.match([FALLEN.format("00079")]) == []
    assert rules.match([FALLEN.format("0" * 28 + "79")]) == []
    assert one(rules, FALLEN.format("0000")).code == "XID_0"


def test_zero_padded_xids_with_a_rule_of_their_own_keep_it(rules: RuleSet) -> None:
    """Xid 154 (the recovery action) and the NVLink5 Xids are read by their own rules, padded or not."""
    f = one(rules, "NVRM: Xid (PCI:0000:2a:00): 0154, GPU recovery action changed from 0x0 (None) to "
                   "0x2 (Node Reboot Required)")
    assert (f.code, f.severity, f.action) == ("XID_154", Severity.CRITICAL, Action.REBOOT)
    f = one(rules, "NVRM: Xid (PCI:0019:01:00): 0149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 "
                   "0x00000000 0x00000000 0x00000000 0x00000000)")
    assert (f.code, f.evidence["rule"], f.severity, f.action) == ("XID_149", "XID_NVLINK5", Severity.CRITICAL,
                                                                   Action.RESET_GPU)


def test_xid_74_is_not_also_nvlink_error(rules: RuleSet) -> None:
    found = rules.match(["NVRM: Xid (PCI:0000:18:00): 74, pid=1, name=x, NVLink: fatal error detected on link 3"])
    assert [f.code for f in found] == ["XID_74"]
    assert one(rules, "NVRM: GPU 0000:3b:00.0: NVLink: link 4 fatal error, link in error state").code == "NVLINK_ERROR"


@pytest.mark.parametrize("line,severity,action", [
    ("NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
     Severity.CRITICAL, Action.RESET_GPU),
    ("NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
     Severity.CRITICAL, Action.REBOOT),
    ("NVRM: Xid (PCI:0000:2a:00 GPU-I:03): 154, pid=5, name=p, GPU recovery action changed from 0x0 (None) "
     "to 0x4 (Drain and Reset)", Severity.CRITICAL, Action.RESET_GPU),
    ("nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error (First)",
     Severity.CRITICAL, Action.RESET_GPU),
    ("nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Link 04 RX Short Error Rate",
     Severity.WARNING, Action.NONE),
])
def test_hints_set_severity_and_action(rules: RuleSet, line: str, severity: Severity, action: Action) -> None:
    f = one(rules, line)
    assert (f.severity, f.action) == (severity, action)


def test_xid_154_back_to_none_resolves(rules: RuleSet) -> None:
    f = one(rules, "NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) "
                   "to 0x0 (None)")
    assert (f.code, f.kind, f.component) == ("XID_154", FindingKind.RESOLVED, "gpu/0000:2a:00.0")


def test_sxid_component_and_followups(rules: RuleSet) -> None:
    f = one(rules, "nvidia-nvswitch0: SXid (PCI:0000:C3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error (First)")
    assert (f.code, f.component) == ("SXID_24007", "nvswitch/0000:c3:00.0")
    assert rules.match(["nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Data {0x0, 0x0}"]) == []


def test_mlx5_up_resolves_down(rules: RuleSet) -> None:
    up = one(rules, "mlx5_core 0000:0c:00.0 ens1f0np0: Link up")
    assert (up.code, up.kind, up.component) == ("MLX5_LINK_DOWN", FindingKind.RESOLVED, "nic/ens1f0np0")


def test_hung_task_and_oom_evidence(rules: RuleSet) -> None:
    f = one(rules, "INFO: task kworker/u8:2:123 blocked for more than 245 seconds. [Warning #2]")
    assert (f.evidence["task"], f.evidence["pid"], f.evidence["warning"]) == ("kworker/u8:2", "123", "2")
    f = one(rules, "Memory cgroup out of memory: Killed process 5678 (pt_main_thread) total-vm:8kB, anon-rss:6kB")
    assert (f.code, f.evidence["pid"], f.evidence["comm"]) == ("OOM_KILL", "5678", "pt_main_thread")


def test_multi_line_fell_off_bus_needs_all_three_lines(rules: RuleSet) -> None:
    lines = (FIXTURES / "GPU_FELL_OFF_BUS.log").read_text().splitlines()
    assert rules.match(lines[:1]) == [] and rules.match(lines[:2]) == []
    f = one(rules, "unrelated", *lines)
    assert (f.code, f.component) == ("GPU_FELL_OFF_BUS", "gpu/0000:3b:00.0")
    assert f.evidence["line"] == "\n".join(lines)


def test_anchored_at_end(rules: RuleSet) -> None:
    assert rules.match(["mlx5_core 0000:0c:00.0 ens1f0np0: Link down (maybe)"]) == []
    assert one(rules, "EXT4-fs (sdb7): Remounting filesystem read-only  ").code == "FS_READONLY"


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.log")), ids=lambda p: p.stem)
def test_fixture_files(rules: RuleSet, path: Path) -> None:
    """Each tests/fixtures/kmsg/<CODE>.log yields findings of that code only."""
    window: list[str] = []
    codes = []
    for line in path.read_text().splitlines():
        window = (window + [line])[-8:]
        codes += [f.code for f in rules.match(window)]
    assert codes and set(codes) == {path.stem}, codes


@pytest.mark.parametrize("text,expect", [
    ("0000:3b:00", "0000:3b:00.0"), ("3B:00.1", "0000:3b:00.1"), ("00000000:3b:00.0", "0000:3b:00.0"),
    ("000d:00:00", "000d:00:00.0"),
])
def test_normalize_bdf(text: str, expect: str) -> None:
    assert normalize_bdf(text) == expect


# --- bad rule files --------------------------------------------------------------------------

def _write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return str(p)


def test_unknown_key_names_file_key_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules:\n  - code: A\n    pattern: 'a'\n    colour: red\n")
    with pytest.raises(RuleError) as e:
        load_rules([path])
    assert f"{path}:4: rules.0.colour: unknown key" in str(e.value)


def test_bad_code_meaning_names_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "codes:\n  FOO: {severity: LOUD}\n")
    with pytest.raises(RuleError) as e:
        load_rules([path])
    assert f"{path}:2: codes.FOO.severity:" in str(e.value)


def test_bad_regex_names_rule_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules:\n  - name: BROKEN\n    code: BROKEN\n    pattern: 'a(b'\n")
    with pytest.raises(RuleError) as e:
        load_rules([path])
    msg = str(e.value)
    assert f"{path}:4: rules.0.pattern" in msg and "BROKEN" in msg


def test_malformed_yaml_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules:\n  - code: A\n    pattern: [unclosed\n")
    with pytest.raises(RuleError) as e:
        load_rules([path])
    assert f"{path}:" in str(e.value) and "malformed YAML" in str(e.value)


def test_a_key_written_twice_names_both_lines(tmp_path: Path) -> None:
    # YAML keeps the last one silently: the rule would match what its author did not read in the file.
    path = _write(tmp_path, "rules:\n  - code: A\n    pattern: 'alpha'\n    severity: WARNING\n"
                            "    pattern: 'beta'\n")
    with pytest.raises(RuleError) as e:
        load_rules([path])
    assert f"{path}:5: rules.0.pattern: duplicate key (also at line 3)" in str(e.value)


def test_template_group_and_failing_example(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules:\n  - code: 'X_{nope}'\n    pattern: 'x'\n")
    with pytest.raises(RuleError, match="nope"):
        load_rules([path])
    path = _write(tmp_path, "rules:\n  - code: A\n    pattern: 'alpha'\n    examples: ['beta']\n")
    with pytest.raises(RuleError, match=r"bad\.yaml:4: rule A: example matches no rule"):
        load_rules([path])


def test_later_file_overrides_codes_and_rules_first(tmp_path: Path) -> None:
    extra = _write(tmp_path, "codes:\n  XID_79: {severity: WARNING}\n"
                             "rules:\n  - code: MY_XID\n    pattern: 'Xid \\(PCI:.*\\): 79, .*'\n")
    rs = load_rules([SHIPPED_RULES, extra])
    assert rs.codes["XID_79"].severity == Severity.WARNING and "XID_13" in rs.codes
    assert rs.codes["XID_79"].action == Action.REBOOT and rs.codes["XID_79"].sticky  # other fields kept
    assert one(rs, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.").code == "MY_XID"


# --- what a rule may put into a code or component ------------------------------------------------

def _group_bodies(pattern: str) -> dict[str, str]:
    """`{name: body}` of every `(?P<name>body)` in `pattern` (escapes and nesting respected)."""
    out = {}
    for m in re.finditer(r"\(\?P<(\w+)>", pattern):
        depth, i = 1, m.end()
        while depth:
            ch = pattern[i]
            if ch == "\\":
                i += 2
                continue
            depth += {"(": 1, ")": -1}.get(ch, 0)
            i += 1
        out[m.group(1)] = pattern[m.end():i - 1]
    return out


def test_shipped_codes_take_only_bounded_ascii_digits_and_components_bounded_fields() -> None:
    """A group in a code is `[0-9]{1,n}` (n <= 5): no Unicode digit, no Xid hundreds of digits
    long. A group in a component has a bounded length (the matcher escapes what it holds)."""
    for rule in [r for doc in shipped_docs() for r in doc["rules"]]:
        bodies = _group_bodies(rule["pattern"])
        for field in re.findall(r"\{(\w+)\}", rule.get("code") or ""):
            assert re.fullmatch(r"\[0-9\]\{1,[1-5]\}\+?", bodies[field]), (rule.get("name"), field, bodies[field])
        for field in re.findall(r"\{(\w+)\}", rule.get("component", "")):
            body = re.sub(r"\{\d+(?:,\d+)?\}\+?", "", bodies[field])  # drop bounded repeats
            assert not re.search(r"(?<!\\)[*+]|\{\d+,\}", body), (rule.get("name"), field, bodies[field])
