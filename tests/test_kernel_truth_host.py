"""Verdict truth on real kernel logs, host side (issue 12): lockups, oopses and BUGs, ext4/XFS/btrfs
errors, NVMe controllers and md RAID arrays.

The lines are the kernel's own, from public reports and mailing-list posts (their sources are in
checks/kernel/rules-host.yaml). First through the rule set, the way the kernel check feeds it (one
line after another into a window), for what each class yields and how often; then through the real
daemon on the real /dev/kmsg, for the condition a scheduler sees: component, code, severity, action.
Device names in the daemon tests are unique per run, so lines from other tests never collide.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, inject_kmsg, need_root
from test_kernel_benign import corpus

from checks.kernel.rules import SHIPPED_RULE_FILES, RuleSet, load_rules
from robustd.api.v1 import robustd_pb2 as pb
from robustd.codes import CodeTable
from robustd.model import Action, Finding, Severity

W, C = Severity.WARNING, Severity.CRITICAL


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules(SHIPPED_RULE_FILES)


def feed(rules: RuleSet, *records: str) -> list[Finding]:
    """Findings for `records` fed as the kernel check feeds them: each record split into lines, each
    line appended to a ring of recent lines and matched with the ring as its window."""
    window: list[str] = []
    out: list[Finding] = []
    for record in records:
        for line in record.split("\n"):
            window = (window + [line])[-max(8, rules.max_lines):]
            out += rules.match(window)
    return out


def meaning(rules: RuleSet, f: Finding) -> tuple[Severity, Action]:
    m = CodeTable([rules.codes]).resolve(f.code, hint_severity=f.severity, hint_action=f.action,
                                         default_clear_after=300, default_escalate=2)
    return m.severity, m.action


# --- each class, through the rule set ---------------------------------------------------------

@pytest.mark.parametrize("records,code,component,severity,action", [
    # Lockups (deepspeedai/DeepSpeed#925, openzfs/zfs#4536, iron-fish/ironfish#701).
    (["watchdog: BUG: soft lockup - CPU#7 stuck for 23s! [pytest:25222]"], "SOFT_LOCKUP", "host", C, Action.REBOOT),
    (["NMI watchdog: BUG: soft lockup - CPU#2 stuck for 22s! [SimpleCacheWork:8140]"], "SOFT_LOCKUP", "host", C,
     Action.REBOOT),
    (["NMI watchdog: Watchdog detected hard LOCKUP on cpu 3"], "HARD_LOCKUP", "host", C, Action.REBOOT),
    (["watchdog: CPU19: Watchdog detected hard LOCKUP on cpu 19"], "HARD_LOCKUP", "host", C, Action.REBOOT),
    # Oopses: x86 and arm64 page faults, BUG(), general protection fault, divide error.
    (["BUG: kernel NULL pointer dereference, address: 0000000000000040"], "KERNEL_OOPS", "host", C, Action.REBOOT),
    (["BUG: unable to handle kernel NULL pointer dereference at 0000000000000010"], "KERNEL_OOPS", "host", C,
     Action.REBOOT),
    (["BUG: unable to handle page fault for address: ffffffffffffffb8"], "KERNEL_OOPS", "host", C, Action.REBOOT),
    (["Unable to handle kernel NULL pointer dereference at virtual address 00000000"], "KERNEL_OOPS", "host", C,
     Action.REBOOT),
    (["kernel BUG at mm/userfaultfd.c:2067!"], "KERNEL_OOPS", "host", C, Action.REBOOT),
    (["general protection fault, probably for non-canonical address 0x25b5f6bb1a24827e: 0000 [#1] SMP NOPTI"],
     "KERNEL_OOPS", "host", C, Action.REBOOT),
    (["divide error: 0000 [#1] SMP"], "KERNEL_OOPS", "host", C, Action.REBOOT),
    (["BUG: workqueue lockup - pool cpus=0 node=0 flags=0x0 nice=0 stuck for 101s!"], "KERNEL_BUG", "host", W,
     Action.REBOOT),
    # ext4 without a read-only remount; superblock I/O errors; the daily count of unrepaired errors.
    (["EXT4-fs error (device nvme19n1): ext4_wait_block_bitmap:517: comm etcd: Cannot read block bitmap - "
      "block_group = 34, block_bitmap = 1048578"], "FS_ERROR", "disk/nvme19n1", W, Action.HW_INSPECT),
    (["EXT4-fs error (device dm-1) in ext4_writepages:2795: IO failure"], "FS_ERROR", "disk/dm-1", W,
     Action.HW_INSPECT),
    (["EXT4-fs (nvme0n1p1): I/O error while writing superblock"], "FS_ERROR", "disk/nvme0n1p1", W, Action.HW_INSPECT),
    (["EXT4-fs (rbd0): error count since last fsck: 38"], "FS_ERROR", "disk/rbd0", W, Action.HW_INSPECT),
    # XFS before any shutdown.
    (["XFS (vda4): Metadata corruption detected at xfs_buf_ioend+0x162/0x570 [xfs], xfs_inode block 0x2fc4e0 "
      "xfs_inode_buf_verify"], "FS_CORRUPTION", "disk/vda4", C, Action.HW_INSPECT),
    (["XFS (sda4): Corruption detected. Unmount and run xfs_repair"], "FS_CORRUPTION", "disk/sda4", C,
     Action.HW_INSPECT),
    (['XFS (dm-7): metadata I/O error: block 0x280000010 ("xlog_bread_noalign") error 5 numblks 8'], "FS_ERROR",
     "disk/dm-7", W, Action.HW_INSPECT),
    # NVMe: reset, lost, unreachable on PCI, no path.
    (["nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS read failed (134)"],
     "NVME_CTRL_RESET", "disk/nvme0", W, Action.HW_INSPECT),
    (["nvme nvme0: I/O tag 12 (400c) opcode 0x9 (Admin Cmd) QID 0 timeout, reset controller"], "NVME_CTRL_RESET",
     "disk/nvme0", W, Action.HW_INSPECT),
    (["nvme nvme1: Disabling device after reset failure: -19"], "NVME_CTRL_LOST", "disk/nvme1", C, Action.REBOOT),
    (["nvme 0002:01:00.0: Unable to change power state from D3cold to D0, device inaccessible"], "NVME_CTRL_LOST",
     "pcie/0002:01:00.0", C, Action.REBOOT),
    (["block nvme0n1: no available path - failing I/O"], "NVME_NO_PATH", "disk/nvme0n1", C, Action.HW_INSPECT),
    # md RAID: raid1 prints both lines in one record.
    (["md/raid1:md0: Disk failure on sdc1, disabling device.\nmd/raid1:md0: Operation continuing on 1 devices."],
     "MD_DEGRADED", "disk/md0", W, Action.HW_INSPECT),
    (["md/raid:md0: raid level 5 active with 3 out of 4 devices, algorithm 2"], "MD_DEGRADED", "disk/md0", W,
     Action.HW_INSPECT),
    (["md/raid:md0: failed to run raid set."], "MD_FAILED", "disk/md0", C, Action.HW_INSPECT),
    # btrfs device errors (the member device), I/O abort, forced read-only, tree-checker corruption.
    (["BTRFS error (device dm-15): bdev /dev/dm-10 errs: wr 0, rd 0, flush 0, corrupt 1, gen 0"], "FS_ERROR",
     "disk/dm-10", W, Action.HW_INSPECT),
    (["BTRFS: error (device sda1) in btrfs_run_delayed_refs:2188: errno=-5 IO failure"], "FS_ERROR", "disk/sda1", W,
     Action.HW_INSPECT),
    (["BTRFS info (device sda1): forced readonly"], "FS_READONLY", "disk/sda1", C, Action.REBOOT),
    (["BTRFS critical (device nvme0n1p2): corrupt leaf: root=7 block=313769984 slot=16, csum end range "
      "(396081434624) goes beyond the start range (396080394240) of the next csum item"], "FS_CORRUPTION",
     "disk/nvme0n1p2", C, Action.HW_INSPECT),
    # Issue 28: panics, RCU stalls, WARN() splats (raspberrypi/linux#2538, Evlers/linux_kernel_t113#2,
    # skiffos/SkiffOS#147, NixOS/nixpkgs#160398).
    (["Kernel panic - not syncing: Fatal exception in interrupt"], "KERNEL_PANIC", "host", C, Action.REBOOT),
    # A soft lockup's panic (sonic-net/sonic-buildimage#17358), read after the reboot: it names the cause.
    (["Kernel panic - not syncing: softlockup: hung tasks"], "KERNEL_PANIC", "host", C, Action.REBOOT),
    (["rcu: INFO: rcu_sched self-detected stall on CPU"], "RCU_STALL", "host", C, Action.REBOOT),
    (["rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:"], "RCU_STALL", "host", C, Action.REBOOT),
    (["WARNING: CPU: 4 PID: 3540247 at fs/btrfs/inode.c:2736 btrfs_finish_ordered_io.isra.0+0x4d1/0x8b0 [btrfs]"],
     "KERNEL_WARNING", "host", W, Action.NONE),
    # Machine checks the kernel recovered from, CMCI storms, GHES recoverable (linux-mm, enarx/enarx#2263,
    # SUSE KB 000021436, matrixorigin/matrixone#20374).
    (["mce: Uncorrected hardware memory error in user-access at af34214200"], "MEMORY_FAILURE", "host", W,
     Action.HW_INSPECT),
    (["Memory failure: 0x8a398a: recovery action for dirty LRU page: Recovered"], "MEMORY_FAILURE", "host", W,
     Action.HW_INSPECT),
    (["CMCI storm detected: switching to poll mode"], "CMCI_STORM", "host", W, Action.HW_INSPECT),
    # The severity line alone (its header interleaved or lost), rule GHES_SEVERITY: with the header before
    # it the older two-line GHES rule claims the pair, so that form did not test this rule.
    (["{7}[Hardware Error]: event severity: recoverable"], "MCE_HARDWARE_ERROR", "host", W, Action.HW_INSPECT),
    (["{7}[Hardware Error]: event severity: fatal"], "MCE_HARDWARE_ERROR", "host", C, Action.HW_INSPECT),
    # Storage: ext4 mounted with errors, btrfs aborted transactions and checksum errors, SCSI offline,
    # block-layer timeouts (motioneye-project/motioneyeos#1006, linux-btrfs, maharmstone/btrfs#88,
    # longhorn/longhorn#12470, dCache/dcache#1708, linux-block).
    (["EXT4-fs (mmcblk0p3): warning: mounting fs with errors, running e2fsck is recommended"], "FS_ERROR",
     "disk/mmcblk0p3", W, Action.HW_INSPECT),
    (["BTRFS error (device loop0 state A): Transaction aborted (error -5)"], "FS_ERROR", "disk/loop0", W,
     Action.HW_INSPECT),
    (["BTRFS warning (device sda2): csum failed root 258 ino 9276991 off 8192 csum 0xf70240b1 expected csum "
      "0x0c62ca5b mirror 1"], "FS_ERROR", "disk/sda2", W, Action.HW_INSPECT),
    # btrfs metadata that is not what its parent points at, and scrub errors no copy repairs (linux-btrfs
    # posts; a scrub fixture): the file system carries on, so FS_ERROR, as csum failures are.
    (["BTRFS error (device bcache1): parent transid verify failed on 2529691090944 wanted 319147 found 310171"],
     "FS_ERROR", "disk/bcache1", W, Action.HW_INSPECT),
    (["BTRFS error (device loop0): bad tree block start, want 5292032 have 0"], "FS_ERROR", "disk/loop0", W,
     Action.HW_INSPECT),
    (["BTRFS error (device dm-0): unable to fixup (regular) error at logical 953118621696 on dev /dev/dm-0 "
      "physical 16106127360"], "FS_ERROR", "disk/dm-0", W, Action.HW_INSPECT),
    (["sd 2:0:0:1: Device offlined - not ready after error recovery"], "SCSI_DEVICE_OFFLINE", "disk/2:0:0:1", C,
     Action.REBOOT),
    (["sd 1:0:0:0: [sdb] Medium access timeout failure. Offlining disk!"], "SCSI_DEVICE_OFFLINE", "disk/sdb", C,
     Action.REBOOT),
    (["timeout error, dev nullb0, sector 8 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 2"], "DISK_IO_ERROR",
     "disk/nullb0", W, Action.HW_INSPECT),
    # Issue 28: the kernel powered the node off at a critical temperature (a public StarPro64 bring-up log).
    (["thermal thermal_zone0: thermal0: critical temperature reached, shutting down"], "HW_PROTECTION_SHUTDOWN",
     "host", C, Action.HW_INSPECT),
])
def test_each_class_yields_its_condition(rules: RuleSet, records: list[str], code: str, component: str,
                                         severity: Severity, action: Action) -> None:
    found = feed(rules, *records)
    assert [(f.code, f.component) for f in found] == [(code, component)], found
    assert meaning(rules, found[0]) == (severity, action)


def test_an_rcu_stall_is_judged_as_a_soft_lockup(rules: RuleSet) -> None:
    """One RCU stall is tolerated within an hour, like a soft lockup; a whole stall report (Evlers/
    linux_kernel_t113#2, its follow-up lines as printed) is one occurrence, on its headline."""
    assert rules.codes["RCU_STALL"].tolerate == rules.codes["SOFT_LOCKUP"].tolerate
    assert rules.codes["RCU_STALL"].sticky and rules.codes["KERNEL_PANIC"].sticky
    found = feed(rules, "rcu: INFO: rcu_sched self-detected stall on CPU",
                 "rcu:     1-....: (8382 ticks this GP) idle=3a04/1/0x40000002 softirq=118/122 fqs=1344",
                 "rcu:     (t=8403 jiffies g=-1055 q=60 ncpus=2)",
                 "rcu: rcu_sched kthread starved for 1519 jiffies! g-1055 f0x0 RCU_GP_WAIT_FQS(5) "
                 "->state=0x402 ->cpu=0",
                 "rcu:     Unless rcu_sched kthread gets sufficient CPU time, OOM is now expected behavior.",
                 "rcu: RCU grace-period kthread stack dump:")
    assert [f.code for f in found] == ["RCU_STALL"]


def test_a_cmci_storm_subsiding_resolves_it(rules: RuleSet) -> None:
    """SUSE KB 000021436: storms come and go; each 'subsided' clears the storm on `host`."""
    found = feed(rules, "CMCI storm detected: switching to poll mode",
                 "CMCI storm subsided: switching to interrupt mode")
    assert [(f.code, f.kind.value, f.component) for f in found] == [
        ("CMCI_STORM", "occurrence", "host"), ("CMCI_STORM", "resolved", "host")]


@pytest.mark.parametrize("hot,normal", [
    ("CPU7: Core temperature is above threshold, cpu clock is throttled (total events = 219)",
     "CPU7: Core temperature/speed normal (total events = 219)"),
    ("CPU1: Core temperature above threshold, cpu clock throttled (total events = 1)",
     "CPU1: Core temperature/speed normal"),
], ids=["5.6+", "before-5.6"])
def test_cpu_thermal_throttling_is_a_warning_that_the_all_clear_resolves(rules: RuleSet, hot: str,
                                                                          normal: str) -> None:
    """Issue 28: therm_throt.c's two wordings (LKML reports, a public blog post): the throttle is WARNING with
    no action (slower, not broken), and "temperature/speed normal", with or without the count, clears it."""
    found = feed(rules, hot, normal)
    assert [(f.code, f.kind.value, f.component) for f in found] == [
        ("CPU_THERMAL_THROTTLE", "occurrence", "host"), ("CPU_THERMAL_THROTTLE", "resolved", "host")]
    assert meaning(rules, found[0]) == (W, Action.NONE)


def test_a_soft_lockup_is_tolerated_once_per_hour(rules: RuleSet) -> None:
    """The code's meaning: WARNING at the first lockup, CRITICAL from the second within an hour."""
    tol = rules.codes["SOFT_LOCKUP"].tolerate
    assert tol is not None and (tol.count, tol.window) == (2, 3600)
    assert rules.codes["SOFT_LOCKUP"].sticky and rules.codes["KERNEL_OOPS"].sticky


# --- one fault, one occurrence: headlines, not register dumps -----------------------------------

X86_OOPS = [  # NVIDIA/open-gpu-kernel-modules#1141 (an fbcon line interleaved, as it was)
    "BUG: kernel NULL pointer dereference, address: 000000000000041c",
    "fbcon: Taking over console",
    "#PF: supervisor read access in kernel mode",
    "#PF: error_code(0x0000) - not-present page",
    "PGD 0 P4D 0 ",
    "Oops: Oops: 0000 [#1] SMP NOPTI",
    "Tainted: [W]=WARN, [O]=OOT_MODULE, [E]=UNSIGNED_MODULE",
    "RIP: 0010:nv_audio_dynamic_power+0xcd/0x140 [nvidia]",
    "RSP: 0018:ffffd2151992e9a8 EFLAGS: 00010207",
    "RAX: 0000000000000400 RBX: ffff8cea7da4c020 RCX: 0000000000000009",
    "CR2: 000000000000041c CR3: 00000002c98b5000 CR4: 0000000000350ef0",
    "Call Trace:",
    " <TASK>",
]
OLD_X86_OOPS = [  # ROCm/hip#15
    "BUG: unable to handle kernel NULL pointer dereference at 0000000000000010",
    "IP: [<ffffffffc01cc246>] amdgpu_bo_list_set+0x196/0x3d0 [amdgpu]",
    "PGD 0 ",
    "Oops: 0000 [#1] SMP ",
]
ARM64_OOPS = [  # hardkernel/linux#346
    "Unable to handle kernel NULL pointer dereference at virtual address 00000000",
    "pgd = ffffffc0edcf1000",
    "[00000000] *pgd=0000000000000000, *pud=0000000000000000",
    "Internal error: Oops: 96000005 [#1] SMP",
    "Modules linked in: af_packet nls_cp936 vfat fat rock_gpiomem autofs4",
    "CPU: 1 PID: 1834 Comm: Xorg Not tainted 4.4.112 #2",
    "Hardware name: Hardkernel ODROID-N1 (DT)",
    "PC is at vop_crtc_bandwidth+0x1f8/0x2dc",
    "LR is at vop_crtc_bandwidth+0xe4/0x2dc",
]
KERNEL_BUG_OOPS = [  # stable patch quoting a syzkaller crash (LKML)
    "------------[ cut here ]------------",
    "kernel BUG at mm/userfaultfd.c:2067!",
    "Oops: invalid opcode: 0000 [#1] SMP DEBUG_PAGEALLOC KASAN NOPTI",
    "CPU: 1 UID: 0 PID: 2475 Comm: reproducer Not tainted 6.16.0-rc6 #1 PREEMPT(none)",
]
GPF_OOPS = [  # netdev patch quoting syzbot (LKML)
    "Oops: general protection fault, probably for non-canonical address 0xdffffc0000000006: 0000 [#1] PREEMPT SMP "
    "KASAN PTI",
    "KASAN: null-ptr-deref in range [0x0000000000000030-0x0000000000000037]",
]
DIVIDE_OOPS = [  # coreos/bugs#1240
    "divide error: 0000 [#1] SMP",
    "CPU: 11 PID: 1914 Comm: cadvisor Not tainted 4.3.6-coreos #2",
    "Hardware name: Dell Inc. PowerEdge R630/0CNCJW, BIOS 1.2.10 03/09/2015",
    "RIP: 0010:[<ffffffff8e0a3d34>]  [<ffffffff8e0a3d34>] task_numa_find_cpu+0x234/0x700",
]
SOFT_LOCKUP_DUMP = [  # deepspeedai/DeepSpeed#925
    "watchdog: BUG: soft lockup - CPU#7 stuck for 23s! [pytest:25222]",
    "Modules linked in: xt_recent bluetooth ecdh_generic ecc xt_nat veth xt_MASQUERADE nf_conntrack_netlink",
]
WORKQUEUE_LOCKUP = [  # openbmc/openbmc#3440
    "BUG: workqueue lockup - pool cpus=0 node=0 flags=0x0 nice=0 stuck for 101s!",
    "Showing busy workqueues and worker pools:",
    "workqueue events: flags=0x0",
    "  pwq 0: cpus=0 node=0 flags=0x0 nice=0 active=1/256",
    "    pending: cache_reap",
]


@pytest.mark.parametrize("lines,code", [
    (X86_OOPS, "KERNEL_OOPS"), (OLD_X86_OOPS, "KERNEL_OOPS"), (ARM64_OOPS, "KERNEL_OOPS"),
    (KERNEL_BUG_OOPS, "KERNEL_OOPS"), (GPF_OOPS, "KERNEL_OOPS"), (DIVIDE_OOPS, "KERNEL_OOPS"),
    (SOFT_LOCKUP_DUMP, "SOFT_LOCKUP"), (WORKQUEUE_LOCKUP, "KERNEL_BUG"),
], ids=["x86", "x86-4.x", "arm64", "BUG()", "gpf", "divide", "soft-lockup", "workqueue"])
def test_one_fault_is_one_occurrence(rules: RuleSet, lines: list[str], code: str) -> None:
    """The headline is matched once; the die header after a reason line and the dump are not."""
    found = feed(rules, *lines)
    assert [(f.code, f.component) for f in found] == [(code, "host")], [f.evidence["line"] for f in found]
    assert found[0].evidence["line"] == lines[1 if lines[0].startswith("-----") else 0]


@pytest.mark.parametrize("records,expect", [
    # Joshua-Riek/ubuntu-rockchip#970: ext4 error, superblock I/O error, then the read-only remount.
    (["Aborting journal on device nvme0n1p1-8.",
      "Buffer I/O error on dev nvme0n1p1, logical block 121667584, lost sync page write",
      "EXT4-fs error (device nvme0n1p1): ext4_journal_check_start:83: comm kworker/u16:3: Detected aborted journal",
      "JBD2: I/O error when updating journal superblock for nvme0n1p1-8.",
      "EXT4-fs (nvme0n1p1): I/O error while writing superblock",
      "EXT4-fs (nvme0n1p1): Remounting filesystem read-only"],
     [("DISK_IO_ERROR", "disk/nvme0n1p1"), ("FS_ERROR", "disk/nvme0n1p1"), ("FS_ERROR", "disk/nvme0n1p1"),
      ("FS_READONLY", "disk/nvme0n1p1")]),
    # Joshua-Riek/ubuntu-rockchip#155: the controller goes down, is unreachable, and is removed.
    (["nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS read failed (134)",
      "nvme 0004:41:00.0: can't change power state from D3cold to D0 (config space inaccessible)",
      "nvme nvme0: Removing after probe failure status: -19",
      "Buffer I/O error on dev nvme0n1, logical block 62514752, async page read"],
     [("NVME_CTRL_RESET", "disk/nvme0"), ("NVME_CTRL_LOST", "pcie/0004:41:00.0"), ("NVME_CTRL_LOST", "disk/nvme0"),
      ("DISK_IO_ERROR", "disk/nvme0n1")]),
    # 1000001101000/Debian_on_Buffalo#161: raid5 loses a second member: failed, not merely degraded.
    (["md: super_written gets error=-5",
      "md/raid:md2: Disk failure on sdb6, disabling device.",
      "md/raid:md2: Cannot continue operation (2/4 failed)."],
     [("MD_FAILED", "disk/md2")]),
    # siderolabs/talos#8733: an XFS log I/O error, then the shutdown.
    (["XFS (sdb6): log I/O error -5",
      "XFS (sdb6): Filesystem has been shut down due to log error (0x2).",
      "XFS (sdb6): Please unmount the filesystem and rectify the problem(s)."],
     [("FS_ERROR", "disk/sdb6"), ("FS_SHUTDOWN", "disk/sdb6")]),
    # coreos/fedora-coreos-tracker#784: one corruption report with its hex dump.
    (["XFS (vda4): Metadata corruption detected at xfs_buf_ioend+0x162/0x570 [xfs], xfs_inode block 0x2fc4e0 "
      "xfs_inode_buf_verify",
      "XFS (vda4): Unmount and run xfs_repair",
      "XFS (vda4): First 128 bytes of corrupted metadata buffer:",
      "00000000: 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00  ................"],
     [("FS_CORRUPTION", "disk/vda4")]),
    # maharmstone/btrfs#215: a bad tree block (FS_ERROR since issue 28), the aborted transaction (the same
    # condition again), read-only.
    (["BTRFS error (device sda1): bad tree block start, want 5914624 have 0",
      "BTRFS: error (device sda1) in btrfs_run_delayed_refs:2188: errno=-5 IO failure",
      "BTRFS info (device sda1): forced readonly"],
     [("FS_ERROR", "disk/sda1"), ("FS_ERROR", "disk/sda1"), ("FS_READONLY", "disk/sda1")]),
    # Issue 28: a thermal zone at its critical trip point, then the shutdown (linux-pm regression report,
    # Niklas Soderlund 2022); the power-off after it raises nothing.
    (["thermal thermal_zone0: cpu-thermal: critical temperature reached, shutting down",
      "reboot: HARDWARE PROTECTION shutdown (Temperature too high)",
      "reboot: Power down"],
     [("HW_PROTECTION_SHUTDOWN", "host"), ("HW_PROTECTION_SHUTDOWN", "host")]),
], ids=["ext4-readonly", "nvme-removed", "raid5-failed", "xfs-shutdown", "xfs-corruption", "btrfs-readonly",
        "thermal-shutdown"])
def test_real_sequences(rules: RuleSet, records: list[str], expect: list[tuple[str, str]]) -> None:
    assert [(f.code, f.component) for f in feed(rules, *records)] == expect


def test_raid1_degraded_names_the_failed_member(rules: RuleSet) -> None:
    (f,) = feed(rules, "md/raid1:md0: Disk failure on sdc1, disabling device.\n"
                       "md/raid1:md0: Operation continuing on 1 devices.")
    assert (f.code, f.component, f.evidence["member"], f.evidence["left"]) == ("MD_DEGRADED", "disk/md0", "sdc1", "1")
    # The same line after another array's failure: degraded, but the member is not claimed.
    (g,) = feed(rules, "md/raid1:md1: Disk failure on sdc1, disabling device.",
                "md/raid1:md0: Operation continuing on 1 devices.")
    assert (g.code, g.component) == ("MD_DEGRADED", "disk/md0") and "member" not in g.evidence


@pytest.mark.parametrize("line", [
    # A fault in a user process is the application's (arch/x86/kernel/traps.c, arch/x86/mm/fault.c).
    "traps: python3.12[3686883] general protection fault ip:750e1fb51587 sp:750e0d3673f0 error:0 in "
    "libpython3.12.so.1.0[750e1dc00000+2bcd000]",
    "traps: div[2500] trap divide error ip:400524 sp:7ffcd27fd630 error:0 in div[400000+1000]",
    "gdb[1191782]: segfault at 0 ip 00005619fd8c0161 sp 00007ffceec2d140 error 6 in gdb[5619fd8c0000+1000]",
    # Healthy arrays, history and hand-offs.
    "md/raid1:md127: active with 2 out of 2 mirrors",
    "md/raid1:md12: active with 12 out of 12 mirrors",
    "BTRFS info (device dm-4): bdev /dev/mapper/crypt-sdb errs: wr 0, rd 1, flush 0, corrupt 0, gen 0",
    "BTRFS: error (device dm-4) in __btrfs_free_extent:3070: errno=-28 No space left",
    "block nvme0n1: no usable path - requeuing I/O",
    "nvme nvme0: I/O 123 QID 4 timeout, aborting",
    "nvme nvme0: Removing ctrl: NQN \"blktests-subsystem-1\"",
    "XFS (dm-0): xfs_log_force: error -5 returned.",
    "EXT4-fs (rbd0): initial error at time 1542617684: ext4_mb_generate_buddy:757",
    # The panic's closing line (linux-speakup/speakup#1): the panic itself is KERNEL_PANIC, once.
    "---[ end Kernel panic - not syncing: Fatal exception in interrupt ]---",
])
def test_lines_that_share_words_raise_nothing(rules: RuleSet, line: str) -> None:
    assert rules.match([line]) == []


def test_benign_host_corpus_raises_nothing(rules: RuleSet) -> None:
    """tests/fixtures/kmsg-benign/host.txt line by line and as one stream (tests/test_kernel_benign.py runs
    every corpus file through the daemon as well)."""
    lines = [line for name, line in corpus() if name == "host.txt"]
    assert len(lines) >= 60
    assert [(line, codes) for line in lines if (codes := [f.code for f in rules.match([line])])] == []
    assert [(f.code, f.evidence["line"]) for f in feed(rules, *lines)] == []


# --- through the real daemon -----------------------------------------------------------------

def _tok() -> str:
    return uuid.uuid4().hex[:8]


def _cond(v: pb.Verdict, component: str, code: str, token: str) -> pb.Condition | None:
    """The condition on (component, code) whose last line carries `token` (our injection, not another's)."""
    return next((c for c in v.conditions if (c.component, c.code) == (component, code)
                 and token in c.evidence.get("line", "")), None)


@pytest.fixture(scope="module")
def host_daemon() -> Iterator[Daemon]:
    """One daemon for the per-class injections (each class has its own code or its own device)."""
    need_root("reading and writing /dev/kmsg")
    root = Path(tempfile.mkdtemp(prefix="rdh-", dir="/tmp"))  # short: a Unix socket path stays under 108 bytes
    (root / "d").mkdir()
    d = Daemon(root / "d", {})
    d.start()
    yield d
    d.stop()
    shutil.rmtree(root, ignore_errors=True)


def _cases(t: str) -> dict[str, tuple[list[str], str, str, str, int, int]]:
    """(records, component, code, token, severity, action) for each class, with device names made from
    `t` (eight hex digits, `_tok()`)."""
    n = int(t[:4], 16) % 90000 + 10000  # an NVMe controller number no other test uses
    dev, md = f"sdt{t}", f"mdt{t}"
    return {
        "soft-lockup": ([f"watchdog: BUG: soft lockup - CPU#7 stuck for 23s! [rdt{t}:25222]"],
                        "host", "SOFT_LOCKUP", f"rdt{t}", pb.SEVERITY_WARNING, pb.ACTION_REBOOT),
        "hard-lockup": ([f"NMI watchdog: Watchdog detected hard LOCKUP on cpu {n}"],
                        "host", "HARD_LOCKUP", f"cpu {n}", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
        "oops": ([f"BUG: kernel NULL pointer dereference, address: 00000000{t}",
                  "#PF: supervisor read access in kernel mode", "#PF: error_code(0x0000) - not-present page",
                  "PGD 0 P4D 0 ", "Oops: 0000 [#1] PREEMPT SMP NOPTI"],
                 "host", "KERNEL_OOPS", f"00000000{t}", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
        "gpf": ([f"general protection fault, probably for non-canonical address 0x25b5f6bb{t}: 0000 [#1] SMP NOPTI"],
                "host", "KERNEL_OOPS", f"0x25b5f6bb{t}", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
        "kernel-bug": ([f"BUG: workqueue lockup - pool cpus=0 node=0 flags=0x0 nice=0 stuck for {n}s!"],
                       "host", "KERNEL_BUG", f"stuck for {n}s", pb.SEVERITY_WARNING, pb.ACTION_REBOOT),
        "ext4-error": ([f"EXT4-fs error (device {dev}): ext4_find_entry:1494: inode #38535169: comm systemd-journal: "
                        "reading directory lblock 0"],
                       f"disk/{dev}", "FS_ERROR", dev, pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        "ext4-superblock": ([f"EXT4-fs ({dev}): I/O error while writing superblock"],
                            f"disk/{dev}", "FS_ERROR", dev, pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        "xfs-corruption": ([f"XFS ({dev}): Metadata corruption detected at xfs_buf_ioend+0x162/0x570 [xfs], "
                            "xfs_inode block 0x2fc4e0 xfs_inode_buf_verify"],
                           f"disk/{dev}", "FS_CORRUPTION", dev, pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT),
        "xfs-io": ([f"XFS ({dev}): log I/O error -5"],
                   f"disk/{dev}", "FS_ERROR", dev, pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        "nvme-reset": ([f"nvme nvme{n}: I/O 0 QID 0 timeout, disable controller"],
                       f"disk/nvme{n}", "NVME_CTRL_RESET", f"nvme{n}", pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        "nvme-lost": ([f"nvme nvme{n}: Removing after probe failure status: -19"],
                      f"disk/nvme{n}", "NVME_CTRL_LOST", f"nvme{n}", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
        "nvme-inaccessible": ([f"nvme 00{t[:2]}:{t[2:4]}:00.0: Unable to change power state from D3cold to D0, "
                               "device inaccessible"],
                              f"pcie/00{t[:2]}:{t[2:4]}:00.0", "NVME_CTRL_LOST", f"00{t[:2]}:{t[2:4]}:00.0",
                              pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
        "nvme-no-path": ([f"block nvme{n}n1: no available path - failing I/O"],
                         f"disk/nvme{n}n1", "NVME_NO_PATH", f"nvme{n}n1", pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT),
        "md-degraded": ([f"md/raid1:{md}: Disk failure on sdc1, disabling device.\n"
                         f"md/raid1:{md}: Operation continuing on 1 devices."],
                        f"disk/{md}", "MD_DEGRADED", md, pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        "md-degraded-at-start": ([f"md/raid1:{md}: active with 1 out of 2 mirrors"],
                                 f"disk/{md}", "MD_DEGRADED", md, pb.SEVERITY_WARNING, pb.ACTION_HW_INSPECT),
        "md-failed": ([f"md/raid:{md}: Disk failure on sdb6, disabling device.",
                       f"md/raid:{md}: Cannot continue operation (2/4 failed)."],
                      f"disk/{md}", "MD_FAILED", md, pb.SEVERITY_CRITICAL, pb.ACTION_HW_INSPECT),
        "btrfs-dev-errors": ([f"BTRFS error (device {dev}): bdev /dev/mapper/rdt-{t} errs: wr 0, rd 3535, flush 0, "
                              "corrupt 0, gen 0"],
                             f"disk/mapper/rdt-{t}", "FS_ERROR", f"rdt-{t}", pb.SEVERITY_WARNING,
                             pb.ACTION_HW_INSPECT),
        "btrfs-readonly": ([f"BTRFS: error (device {dev}) in btrfs_run_delayed_refs:2188: errno=-5 IO failure",
                            f"BTRFS info (device {dev}): forced readonly"],
                           f"disk/{dev}", "FS_READONLY", dev, pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT),
    }


CLASSES = list(_cases("0" * 8))


@pytest.mark.parametrize("name", CLASSES)
def test_each_class_through_the_daemon(host_daemon: Daemon, name: str) -> None:
    """Written to the real /dev/kmsg (one open per line: this host rate-limits writers per open),
    read by the daemon's kernel check, judged by the policy, read back with GetVerdict."""
    records, component, code, token, severity, action = _cases(_tok())[name]
    inject_kmsg(*records)
    v = host_daemon.wait_for(lambda v: _cond(v, component, code, token) is not None, timeout=15)
    c = _cond(v, component, code, token)
    assert c is not None
    assert (c.severity, c.action) == (severity, action), c


def test_a_second_soft_lockup_within_the_hour_is_critical(make_daemon) -> None:
    need_root("reading and writing /dev/kmsg")
    d = make_daemon()
    d.start()
    t = _tok()
    inject_kmsg(f"watchdog: BUG: soft lockup - CPU#3 stuck for 22s! [rdt{t}:4202]")
    v = d.wait_for(lambda v: _cond(v, "host", "SOFT_LOCKUP", f"rdt{t}") is not None, timeout=15)
    first = _cond(v, "host", "SOFT_LOCKUP", f"rdt{t}")
    assert first is not None and (first.severity, first.action) == (pb.SEVERITY_WARNING, pb.ACTION_REBOOT)
    inject_kmsg(f"watchdog: BUG: soft lockup - CPU#3 stuck for 48s! [rdt{t}:4202]")  # the same CPU, still stuck
    again = f"48s! [rdt{t}"
    v = d.wait_for(lambda v: (c := _cond(v, "host", "SOFT_LOCKUP", again)) is not None
                   and c.severity == pb.SEVERITY_CRITICAL, timeout=15)
    c = _cond(v, "host", "SOFT_LOCKUP", again)
    assert c is not None and c.count == 2 and c.sticky and c.action == pb.ACTION_REBOOT


def _sentinel() -> tuple[str, str]:
    """(line, device): a line the daemon turns into a condition on its own device; once that condition
    stands, every line written before it was read."""
    dev = f"sdt{_tok()}"
    return f"EXT4-fs ({dev}): I/O error while writing superblock", dev


def test_one_oops_is_one_occurrence_through_the_daemon(make_daemon) -> None:
    """A whole x86 oops (headline, page-fault detail, die header, registers, stack) is one occurrence."""
    need_root("reading and writing /dev/kmsg")
    d = make_daemon()
    d.start()
    t = _tok()
    oops = [X86_OOPS[0].replace("000000000000041c", f"00000000{t}"), *X86_OOPS[1:]]
    line, dev = _sentinel()
    inject_kmsg(*oops, line)
    v = d.wait_for(lambda v: _cond(v, f"disk/{dev}", "FS_ERROR", dev) is not None, timeout=20)
    c = _cond(v, "host", "KERNEL_OOPS", f"00000000{t}")
    assert c is not None and c.count == 1, [(x.code, x.count, x.evidence.get("line")) for x in v.conditions]
    assert (c.severity, c.action, c.sticky) == (pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT, True)
    assert v.severity == pb.SEVERITY_CRITICAL


def test_user_space_faults_raise_nothing_through_the_daemon(make_daemon) -> None:
    """A general protection fault or divide error in a user process is its application's bug."""
    need_root("reading and writing /dev/kmsg")
    d = make_daemon()
    d.start()
    t = _tok()
    faults = [f"traps: rdt{t}[3615] general protection fault ip:7feb96eb56a1 sp:20000fd0 error:0 in "
              f"libfoo.so[7feb96e75000+84000]",
              f"traps: rdt{t}[2500] trap divide error ip:400524 sp:7ffcd27fd630 error:0 in div[400000+1000]",
              f"rdt{t}[1191782]: segfault at 0 ip 00005619fd8c0161 sp 00007ffceec2d140 error 6 in "
              f"gdb[5619fd8c0000+1000]"]
    line, dev = _sentinel()
    inject_kmsg(*faults, line)
    v = d.wait_for(lambda v: _cond(v, f"disk/{dev}", "FS_ERROR", dev) is not None, timeout=20)
    assert [(c.component, c.code) for c in v.conditions if f"rdt{t}" in c.evidence.get("line", "")] == []
