"""Hostile and malformed kernel lines (issue 11, item 4): ASCII-only numbers, bounded fields,
ASCII components and codes, a bounded line.

A forged or corrupt line must not invent a fault (`XID_٧٩`, an Xid hundreds of digits long),
and a real fault on a device whose name carries control characters must still be reported,
on a component that is safe to print. The last test drives the same lines through a real daemon
on the real /dev/kmsg and reads GetVerdict.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from conftest import bdf, cond, inject_kmsg, need_root

from checks.kernel.rules import (
    MAX_LINE_CHARS,
    SHIPPED_RULE_FILES,
    RuleError,
    RuleSet,
    clip_line,
    load_rules,
)
from robustd.bounds import MAX_CODE, MAX_COMPONENT, is_token

ARABIC_XID = "NVRM: Xid (PCI:0000:7e:00): \u0667\u0669, pid=1, name=python, GPU has fallen off the bus."
LONG_XID = f"NVRM: Xid (PCI:0000:7e:00): {'7' * 300}, pid=1, name=python, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules(SHIPPED_RULE_FILES)


def test_arabic_indic_digits_are_not_an_xid(rules: RuleSet) -> None:
    assert rules.match([ARABIC_XID]) == []
    # The same line with ASCII digits is the real fault, so the rule itself still works.
    ascii_line = ARABIC_XID.replace("\u0667\u0669", "79")
    assert [(f.code, f.component) for f in rules.match([ascii_line])] == [("XID_79", "gpu/0000:7e:00.0")]


def test_an_xid_hundreds_of_digits_long_is_not_a_code(rules: RuleSet) -> None:
    assert rules.match([LONG_XID]) == []
    assert [f.code for f in rules.match([LONG_XID.replace("7" * 300, "7" * 5)])] == []  # over 4 digits
    assert [f.code for f in rules.match([LONG_XID.replace("7" * 300, "1234")])] == ["XID_1234"]


# Arabic-Indic, full-width and Bengali digits: str.isdigit() says yes to all of them.
@pytest.mark.parametrize("digits", ["\u0663\u0661", "\uff13\uff11", "\u09e9\u09e7"])
def test_no_rule_reads_unicode_digits(rules: RuleSet, digits: str) -> None:
    lines = [
        f"NVRM: Xid (PCI:0000:3b:00): {digits}, pid=2, name=p, MMU Fault",
        f"nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): {digits}007, Fatal, Link 28 sourcetrack timeout error",
        f"EDAC MC{digits}: 1 UE memory read error on CPU_SrcID#0_MC#0_Chan#1_DIMM#0",
        f"INFO: task python:{digits} blocked for more than 120 seconds.",
    ]
    for line in lines:
        assert rules.match([line]) == [], line


@pytest.mark.parametrize("line,code,prefix", [
    ("mlx5_core 0000:0c:00.0 ens\x1b[31m0\x07: Link down", "MLX5_LINK_DOWN", "nic/"),
    ("mlx5_core 0000:0c:00.0 ens\x1b[31m0\x07: Link up", "MLX5_LINK_DOWN", "nic/"),
    ("blk_update_request: I/O error, dev nvme\x1b]0;pwned\x070n1, sector 32776 op 0x1:(WRITE) flags 0x3000",
     "DISK_IO_ERROR", "disk/"),
    ("EXT4-fs (sd\x1bb7): Remounting filesystem read-only", "FS_READONLY", "disk/"),
    ("XFS (dm-\x07\u0660): Filesystem has been shut down due to log error (0x2).", "FS_SHUTDOWN", "disk/"),
])
def test_control_characters_in_a_device_name_are_escaped(rules: RuleSet, line: str, code: str,
                                                          prefix: str) -> None:
    """The fault is real, so it is reported; its component is an escaped ASCII token and the raw
    line stays in evidence for whoever needs to see exactly what the kernel said."""
    (f,) = rules.match([line])
    assert f.code == code and is_token(f.code, MAX_CODE)
    assert f.component.startswith(prefix) and is_token(f.component, MAX_COMPONENT), f.component
    assert "\\x1b" in f.component or "\\x07" in f.component
    assert f.evidence["line"] == line


def test_an_operator_rule_cannot_make_a_non_ascii_code(tmp_path: Path) -> None:
    path = tmp_path / "op.yaml"
    path.write_text("rules:\n"
                    "  - code: 'OP_{word}'\n    component: 'dev/{dev}'\n"
                    "    pattern: 'op (?P<dev>\\S+) (?P<word>\\w+) (?P<n>\\d+)'\n"
                    "    examples: [{line: 'op eth0 fault 1', code: OP_FAULT, component: dev/eth0}]\n")
    rs = load_rules([str(path)])
    assert [f.code for f in rs.match(["op eth0 \u0661 1"])] == []  # \w is ASCII: no match at all
    assert [f.code for f in rs.match(["op eth0 fault \u0661"])] == []  # \d is ASCII
    assert [(f.code, f.component) for f in rs.match(["op eth\x1b0 fault 1"])] == [("OP_FAULT", "dev/eth\\x1b0")]
    # `.` captures anything; a code that is not an ASCII UPPER_SNAKE token is no finding.
    path.write_text("rules:\n  - code: 'OP_{word}'\n    pattern: 'op (?P<word>.{1,10})'\n")
    rs = load_rules([str(path)])
    assert [f.code for f in rs.match(["op two words"])] == []  # a space in the code
    assert [f.code for f in rs.match(["op \u0131"])] == []  # dotless i, which .upper() makes ASCII 'I'
    assert [f.code for f in rs.match(["op \x1b"])] == []
    assert [f.code for f in rs.match(["op fault_2"])] == ["OP_FAULT_2"]


@pytest.mark.parametrize("rule,message", [
    ("  - code: 'bad_code'\n    pattern: 'x'\n", "is not UPPER_SNAKE"),
    ("  - code: \"X\\n\"\n    pattern: 'x'\n", "is not UPPER_SNAKE"),
    ("  - code: 'X\u0130'\n    pattern: 'x'\n", "is not UPPER_SNAKE"),
    ("  - code: X\n    component: 'nic/{n} x'\n    pattern: '(?P<n>x)'\n", "printable ASCII"),
    ("  - code: X\n    component: 'nic/\u00e9{n}'\n    pattern: '(?P<n>x)'\n", "printable ASCII"),
    ("  - code: X\n    pattern: '(?u)x'\n", "ASCII only"),
    ("  - code: X\n    pattern: 'a(?u:\\d)'\n", "ASCII only"),
])
def test_loader_rejects_rules_that_could_emit_non_ascii(tmp_path: Path, rule: str, message: str) -> None:
    path = tmp_path / "op.yaml"
    path.write_text("rules:\n" + rule)
    with pytest.raises(RuleError) as e:
        load_rules([str(path)])
    assert re.search(rf"{re.escape(str(path))}:[23]: rules\.0", str(e.value)), str(e.value)  # file:line
    assert message in str(e.value), str(e.value)


# Benign lines no rule may claim: the rule file's counter-examples that no other rule claims
# either, and lines from this VM's own boot log (Linux 6.18, `dmesg` before the ring wrapped).
BENIGN = [
    "Linux version 6.18.44-fc-v669 (builder@sandboxing) (gcc (GCC) 15.3.0, GNU ld (GNU Binutils) 2.46) "
    "#1 SMP PREEMPT_DYNAMIC @0",
    "printk: log buffer data + meta data: 131072 + 458752 = 589824 bytes",
    "nvidia-nvlink: Nvlink Core is being initialized, major device number 234",
    "NVRM: GPU at PCI:0000:3b:00: GPU-7f9c1a4e-1d2b-4c7a-9e0e-2f3a4b5c6d7e",
    "pcieport 0000:00:01.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
    "mce: [Hardware Error]: TSC 0 ADDR fef1c140 MISC 38a0000086",
    "EDAC MC0: Giving out device to module skx_edac controller Skylake Socket#0 IMC#0: DEV 0000:3a:0a.0 (INTERRUPT)",
    '"echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.',
    "python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
    "nvme nvme0: I/O 123 QID 4 timeout, aborting",
    "XFS (sda4): Mounting V5 Filesystem",
    "Aborting journal on device sdb7-8.",
    "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Data {0x00000000, 0x00000000, 0x00000000, 0x00000000}",
]


@pytest.mark.parametrize("line", BENIGN)
def test_benign_lines_raise_nothing(rules: RuleSet, line: str) -> None:
    assert rules.match([line]) == []
    assert rules.match([line + " \u0669\x1b"]) == []


def test_a_long_line_is_matched_on_its_bounded_head(rules: RuleSet) -> None:
    detail = "x" * 5000
    (f,) = rules.match([f"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=p, GPU has fallen off the bus. {detail}"])
    assert f.code == "XID_79" and len(f.evidence["line"]) <= MAX_LINE_CHARS
    assert f.evidence["line"].endswith("more chars]")
    # A rule anchored at the line's end does not match a line merely cut at the limit: the cut
    # is marked, so the head of an over-long line never looks like a whole line.
    tail = "EXT4-fs (sdb7): Remounting filesystem read-only"
    line = "y" * (MAX_LINE_CHARS - len(tail)) + tail + " and then something else"
    assert len(clip_line(line)) <= MAX_LINE_CHARS
    assert rules.match([line]) == []
    assert [f.code for f in rules.match([line[:MAX_LINE_CHARS]])] == ["FS_READONLY"]  # the same head, whole


def test_daemon_verdict_has_no_forged_xid_and_only_ascii_components(make_daemon, tmp_path: Path) -> None:
    """Through the real daemon: the forged Xids raise nothing, the control characters in a device
    name reach GetVerdict escaped. A token rule (not a shipped one) carries the device-name case,
    so other daemons reading the same /dev/kmsg meanwhile see no new fault."""
    need_root("writing /dev/kmsg")
    token = f"rdt{uuid.uuid4().hex[:12]}"
    bus = bdf()  # a bus id no other test uses
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n"
                     f"  - code: RDT_DEVICE_FAULT\n    component: 'nic/{{dev}}'\n"
                     f"    pattern: '{token} fault on (?P<dev>[^\\s:/]{{1,15}}+)'\n"
                     f"  - code: RDT_DONE\n    pattern: '{token} done'\n")
    d = make_daemon({"checks": {"kernel": {"rules": [str(rules)]}}})
    d.start()
    inject_kmsg(ARABIC_XID.replace("0000:7e:00", bus), LONG_XID.replace("0000:7e:00", bus),
                f"{token} fault on eth\x1b[2J\x07", f"{token} done")
    v = d.wait_for(lambda v: cond(v, "RDT_DONE") is not None, timeout=10)
    gpu = f"gpu/{bus}.0"
    assert [c.code for c in v.conditions if c.component == gpu] == []
    fault = cond(v, "RDT_DEVICE_FAULT")
    assert fault is not None and fault.component == "nic/eth\\x1b[2J\\x07"
    for c in v.conditions:
        assert is_token(c.component, MAX_COMPONENT) and is_token(c.code, MAX_CODE), (c.component, c.code)
