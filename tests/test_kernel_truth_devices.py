"""Verdict truth on real device kernel lines (issue 12): GPUs, NVLink5, PCIe, mlx5 NICs.

Every line here is a real line from a public report, a peer project's fixture or NVIDIA's own tests
(the source is named in checks/kernel/rules.yaml next to the rule), with only its PCI address changed
so that no two tests and no earlier run can be confused. The unit tests go through the shipped rule set
and its code table, as the policy does; the daemon tests write the lines into the real /dev/kmsg and
read what a scheduler reads: GetVerdict's conditions (component, code, severity, action).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import Daemon, inject_kmsg, need_root

from checks.kernel.rules import SHIPPED_RULE_FILES, RuleSet, load_rules
from robustd.api.v1 import robustd_pb2 as pb
from robustd.codes import CodeTable
from robustd.model import Action, FindingKind, Severity

W, C = Severity.WARNING, Severity.CRITICAL


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules(SHIPPED_RULE_FILES)


def verdict_of(rules: RuleSet, line: str) -> tuple[str, str, Severity, Action]:
    """(code, component, severity, action) the policy would give the one finding for `line`."""
    found = rules.match([line])
    assert len(found) == 1, f"expected one finding for {line!r}, got {found}"
    f = found[0]
    assert f.kind is FindingKind.OCCURRENCE, f
    m = CodeTable([rules.codes]).resolve(f.code, hint_severity=f.severity, hint_action=f.action,
                                         default_clear_after=300, default_escalate=2)
    return f.code, f.component, m.severity, m.action


def new_bus() -> str:
    """`dddd:bb:dd` no other test uses (the Xid form; gpu/<it>.0 is the component)."""
    n = uuid.uuid4().int
    return f"{n % 0xffff:04x}:{(n >> 16) % 0xff:02x}:{(n >> 24) % 0x20:02x}"


# --- the Xid table against NVIDIA's Xid catalog (Immediate Action column) ------------------------

# Catalog bucket of every Xid robustd's table names (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html).
CATALOG = {
    "RESTART_APP": [8, 11, 13, 25, 31, 32, 39, 40, 41, 60, 68, 69, 70, 71, 72, 75, 76, 77, 80, 82, 83, 84, 85, 86,
                    88, 89, 94, *range(96, 106), *range(126, 136), 139],
    "IGNORE": [14, 37, 38, 43, 44, 66, 67, 92, 93, 106, 107, 108, 121, 137, 141, 152, 153, 160, 161],
    "RESET_GPU": [46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158],
    "WORKFLOW_XID_48": [48],
    "WORKFLOW_NVLINK_ERR": [74],
    "RESTART_BM": [79],
    "CHECK_MECHANICALS": [54],
    "CONTACT_SUPPORT": [56, 57, 58, 61],  # "Unused" on Ampere and newer
}
BUCKET = {
    "RESTART_APP": (W, Action.RESTART_JOB), "IGNORE": (W, Action.NONE),
    "RESET_GPU": (C, Action.RESET_GPU), "WORKFLOW_XID_48": (C, Action.RESET_GPU),
    "WORKFLOW_NVLINK_ERR": (C, Action.RESET_GPU), "RESTART_BM": (C, Action.REBOOT),
    "CHECK_MECHANICALS": (C, Action.HW_INSPECT), "CONTACT_SUPPORT": (W, Action.HW_INSPECT),
}
# Rows where robustd deliberately names a different action (kernel.yaml says why): severity still follows.
DEVIATIONS = {
    45: (W, Action.RESTART_JOB),   # WORKFLOW_XID_45: the application was torn down
    63: (W, Action.RESET_GPU),     # IGNORE, but the remap is pending until a reset ("reset gpu to activate")
    157: (W, Action.HW_INSPECT),   # IGNORE -> CONTACT_SUPPORT: no spare resources left
    159: (W, Action.RESET_GPU),    # CHECK_UVM: reset if UVM/vGPU is used, else ignore
    171: (C, Action.RESET_GPU), 172: (C, Action.RESET_GPU),  # detail to an Xid 48 (WORKFLOW_XID_48)
    162: (W, Action.NONE), 163: (W, Action.NONE), 164: (W, Action.NONE), 165: (W, Action.HW_INSPECT),
}


def meaning(rules: RuleSet, code: str) -> tuple[Severity, Action]:
    m = CodeTable([rules.codes]).resolve(code, hint_severity=None, hint_action=None, default_clear_after=300,
                                         default_escalate=2)
    return m.severity, m.action


@pytest.mark.parametrize("xid,bucket", [(x, b) for b, xs in CATALOG.items() for x in xs])
def test_xid_table_follows_the_catalog(rules: RuleSet, xid: int, bucket: str) -> None:
    assert f"XID_{xid}" in rules.codes and rules.codes[f"XID_{xid}"].description, xid
    assert meaning(rules, f"XID_{xid}") == BUCKET[bucket], (xid, bucket)


def test_every_xid_in_the_table_is_accounted_for(rules: RuleSet) -> None:
    """No Xid entry escapes the catalog check: it is in CATALOG, a documented deviation, or decoded
    from its line (144-150, 154)."""
    named = {int(k.split("_")[1]) for k in rules.codes if k.startswith("XID_") and k[4:].isdigit()}
    covered = {x for xs in CATALOG.values() for x in xs} | set(DEVIATIONS) | {*range(144, 151), 154}
    assert named == covered, (sorted(named - covered), sorted(covered - named))
    for xid, expect in DEVIATIONS.items():
        assert meaning(rules, f"XID_{xid}") == expect, xid


@pytest.mark.parametrize("xid", [*range(144, 151), 154])
def test_decoded_xids_have_no_fixed_verdict(rules: RuleSet, xid: int) -> None:
    """Their verdict comes from the line; a fixed severity here would override the rule's hints."""
    code = rules.codes[f"XID_{xid}"]
    assert code.severity is None and code.action is None and code.description


def test_unknown_xid_and_undecodable_nvlink5_go_to_triage(rules: RuleSet) -> None:
    assert verdict_of(rules, "NVRM: Xid (PCI:0000:2a:00): 166, CC traffic before the link was configured")[2:] \
        == (W, Action.HW_INSPECT)
    # An NVLink5 Xid whose text is not the catalog's layout: never CRITICAL on the number alone.
    assert verdict_of(rules, "NVRM: Xid (PCI:0000:2a:00): 146, pid=1, name=p, TLW error")[2:] == (W, Action.HW_INSPECT)


# --- NVLink5 (Xid 144-150): decoded by the severity word and, for XID_154_EVAL rows, the error status ---

NVL5 = [
    # Real lines (gpud kmsg_extended_test.go "Log1".."Log19", NVSentinel csv_test.go, gpud kmsg_test.go).
    ("NVRM: Xid (PCI:{bus}): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001 0x00000000 "
     "0x00000000 0x00000000 0x00000000)", "XID_149", W, Action.NONE),
    ("NVRM: Xid (PCI:{bus}): 145, pid=876767, name=ray::WorkerDict, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 "
     "0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)", "XID_145", W, Action.NONE),
    ("NVRM: Xid (PCI:{bus}): 145, RLW_SRC_TRACK Nonfatal XC1 i0 Link 12 (0x040988e2 0x00000008 0x00000000 0x00000000 "
     "0x00000000 0x00000000)", "XID_145", W, Action.RESTART_JOB),  # XID_154_EVAL: the app was cross-contained
    ("NVRM: Xid (PCI:{bus}): 145, pid=11436, name=cache_mgr_main, RLW_SRC_TRACK Nonfatal XC1 i0 Link 03 (0x040868e2 "
     "0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)", "XID_145", W, Action.RESTART_JOB),
    ("NVRM: Xid (PCI:{bus}): 144, SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 0x00000000 "
     "0x00000000 0x00000000)", "XID_144", W, Action.NONE),
    ("NVRM: Xid (PCI:{bus}): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 "
     "0x00000000)", "XID_149", C, Action.RESET_GPU),
    ("NVRM: Xid (PCI:{bus}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 0x00000000 0x00000000 "
     "0x00000000 0x00000000)", "XID_149", C, Action.RESET_GPU),
    ("NVRM: Xid (PCI:{bus}): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000 "
     "0x00000000 0x00000000 0x00000000)", "XID_149", C, Action.RESET_GPU),
]


@pytest.mark.parametrize("template,code,severity,action", NVL5, ids=lambda v: v if isinstance(v, str) and
                         v.startswith("XID") else None)
def test_nvlink5_lines_decode_by_their_severity_word(rules: RuleSet, template: str, code: str,
                                                      severity: Severity, action: Action) -> None:
    bus = new_bus()
    assert verdict_of(rules, template.format(bus=bus)) == (code, f"gpu/{bus}.0", severity, action)


def test_nonfatal_nvlink5_never_critical_nor_a_reset(rules: RuleSet) -> None:
    for template, *_ in NVL5:
        line = template.format(bus=new_bus())
        if "Nonfatal" in line:
            _, _, severity, action = verdict_of(rules, line)
            assert severity < C and action not in (Action.RESET_GPU, Action.REBOOT), line


# --- Xid 154: the recovery action the driver printed ---------------------------------------------

XID_154 = [  # open-gpu-kernel-modules gpu.c: "GPU recovery action changed from 0x%x (%s) to 0x%x (%s)"
    ("0x1 (GPU Reset Required)", C, Action.RESET_GPU),
    ("0x2 (Node Reboot Required)", C, Action.REBOOT),
    ("0x3 (Drain P2P)", C, Action.RESTART_JOB),
    ("0x4 (Drain and Reset)", C, Action.RESET_GPU),
    ("0x5 (Recover IMEX Domain)", C, Action.HW_INSPECT),
    ("0x6 (Unknown)", C, Action.RESET_GPU),   # NVML BUS_RESET; the driver has no label for it yet
    ("0x7 (Unknown)", C, Action.REBOOT),      # NVML SYSTEM_REBOOT
    ("0x9 (Unknown)", W, Action.HW_INSPECT),  # not a known action: triage
]


@pytest.mark.parametrize("to,severity,action", XID_154)
def test_xid_154_recovery_action_maps_to_an_action(rules: RuleSet, to: str, severity: Severity,
                                                    action: Action) -> None:
    bus = new_bus()
    line = f"NVRM: Xid (PCI:{bus}): 154, GPU recovery action changed from 0x0 (None) to {to}"
    assert verdict_of(rules, line) == ("XID_154", f"gpu/{bus}.0", severity, action)


def test_xid_154_back_to_none_resolves(rules: RuleSet) -> None:
    (f,) = rules.match(["NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x4 (Drain and Reset) "
                        "to 0x0 (None)"])
    assert (f.code, f.kind, f.component) == ("XID_154", FindingKind.RESOLVED, "gpu/0008:01:00.0")


# --- the classes that had no rule, and the mlx5 / AER lines that never matched -----------------------

@dataclass(frozen=True)
class Case:
    name: str
    line: str  # {bdf} is a fresh dddd:bb:dd.f, {bus} the same address in the Xid form
    code: str
    component: str
    severity: Severity
    action: Action


CASES = [
    Case("fell_off_bus_one_line", "NVRM: GPU {bdf}: GPU has fallen off the bus.",
         "GPU_FELL_OFF_BUS", "gpu/{bdf}", C, Action.REBOOT),
    Case("rm_init_adapter_failed", "NVRM: GPU {bdf}: RmInitAdapter failed! (0x24:0x72:1568)",
         "GPU_INIT_FAILED", "gpu/{bdf}", C, Action.REBOOT),
    Case("rm_init_adapter_minor", "NVRM: GPU {bdf}: rm_init_adapter failed, device minor number 5",
         "GPU_INIT_FAILED", "gpu/{bdf}", C, Action.REBOOT),
    Case("mlx5_insufficient_power",
         "mlx5_core {bdf}: mlx5_pcie_event:299:(pid 268269): Detected insufficient power on the PCIe slot (27W).",
         "MLX5_PCIE_POWER_INSUFFICIENT", "nic/{bdf}", W, Action.HW_INSPECT),
    Case("mlx5_ports_powered_down",
         "mlx5_core {bdf}: port_module:254:(pid 0): Port module event[error]: module 0, Cable error, One or more "
         "network ports have been powered down due to insufficient/unadvertised power on the PCIe slot",
         "MLX5_PORT_POWERED_DOWN", "nic/{bdf}", C, Action.HW_INSPECT),
    Case("mlx5_module_error_with_func_prefix",
         "mlx5_core {bdf}: port_module:247:(pid 0): Port module event[error]: module 1, Cable error, Bus stuck "
         "(I2C or data shorted)", "MLX5_MODULE_ERROR", "nic/{bdf}", W, Action.HW_INSPECT),
    Case("mlx5_cable_unplugged_with_func_prefix",
         "mlx5_core {bdf}: port_module:254:(pid 0): Port module event: module 0, Cable unplugged",
         "MLX5_CABLE_UNPLUGGED", "nic/{bdf}", W, Action.HW_INSPECT),
    # Issue 28: printed after the back-to-back GSP RPC timeouts that mark the GPU for reset
    # (open-gpu-kernel-modules issue #446).
    Case("gsp_rpc_timeouts_gpu_marked_for_reset",
         "NVRM: Rate limiting GSP RPC error prints for GPU at PCI:{bus} (printing 1 of every 30).  The GPU likely "
         "needs to be reset.", "GSP_GPU_RESET_REQUIRED", "gpu/{bdf}", C, Action.RESET_GPU),
    Case("aer_device_recovery_failed", "pcieport {bdf}: AER: device recovery failed",
         "PCIE_AER_RECOVERY_FAILED", "pcie/{bdf}", C, Action.REBOOT),
    Case("gpu_config_space_inaccessible",
         "nvidia {bdf}: Unable to change power state from D3cold to D0, device inaccessible",
         "GPU_INACCESSIBLE", "gpu/{bdf}", C, Action.REBOOT),
    Case("pci_device_inaccessible",
         "vfio-pci {bdf}: Unable to change power state from D3cold to D0, device inaccessible",
         "PCIE_DEVICE_INACCESSIBLE", "pcie/{bdf}", W, Action.HW_INSPECT),
    Case("aer_no_details_found",
         "pci 0000:00:01.0: AER: Correctable error message received from {bdf} (no details found)",
         "PCIE_AER_CORRECTED", "pcie/{bdf}", W, Action.NONE),
    # Issue 28: IOMMU faults name the requester on pcie/<bdf> (ggml-org/llama.cpp#21908: an NVIDIA GPU's
    # I/O page fault, then an Xid 31); one fault is a WARNING, an ATS invalidation timeout asks for a reboot.
    Case("amdvi_io_page_fault",
         "nvidia {bdf}: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x001c address=0xd0826240 flags=0x0020]",
         "IOMMU_DMA_FAULT", "pcie/{bdf}", W, Action.HW_INSPECT),
    Case("amdvi_iotlb_invalidation_timeout",
         "iommu ivhd0: AMD-Vi: Event logged [IOTLB_INV_TIMEOUT device={bdf} address=0x42b5b01a0]",
         "IOMMU_CMD_TIMEOUT", "pcie/{bdf}", W, Action.REBOOT),
    Case("smmuv3_event_names_the_gpu",
         "arm-smmu-v3 arm-smmu-v3.0.auto: event: F_TRANSLATION client: {bdf} sid: 0x90100 ssid: 0x0 iova: "
         "0x7ffff000 ipa: 0x0", "IOMMU_DMA_FAULT", "pcie/{bdf}", W, Action.HW_INSPECT),
    Case("nvlink5_nonfatal", NVL5[0][0], "XID_149", "gpu/{bdf}", W, Action.NONE),
    Case("nvlink5_nonfatal_contained", NVL5[2][0], "XID_145", "gpu/{bdf}", W, Action.RESTART_JOB),
    Case("nvlink5_fatal", NVL5[5][0], "XID_149", "gpu/{bdf}", C, Action.RESET_GPU),
    *[Case(f"xid154_{to.split()[0]}", f"NVRM: Xid (PCI:{{bus}}): 154, GPU recovery action changed from 0x0 (None) "
           f"to {to}", "XID_154", "gpu/{bdf}", sev, act) for to, sev, act in XID_154[:5]],
]


def render(case: Case, bus: str) -> tuple[str, str]:
    """(line, component) for `case` on the address `bus` (dddd:bb:dd)."""
    bdf = f"{bus}.0"
    return case.line.format(bdf=bdf, bus=bus), case.component.format(bdf=bdf)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_class_rules(rules: RuleSet, case: Case) -> None:
    line, component = render(case, new_bus())
    assert verdict_of(rules, line) == (case.code, component, case.severity, case.action)


@pytest.mark.parametrize("records,expect", [
    # thesofproject/sof-test#744 (5.14): the VT-d record prints bus:dev.fn with 0x and no segment.
    (["DMAR: DRHD: handling fault status reg 2",
      "DMAR: [DMA Read NO_PASID] Request device [0x00:0x02.0] fault addr 0x7c346000 [fault reason 0x06] PTE Read "
      "access is not set"],
     [("IOMMU_DMA_FAULT", "pcie/0000:00:02.0", W, Action.HW_INSPECT)]),
    # The linux-pci vmd report: queue, time-out and completion errors, the descriptor dump, the recovery note.
    (["DMAR: VT-d detected Invalidation Queue Error: Reason f",
      "DMAR: VT-d detected Invalidation Time-out Error: SID ffff",
      "DMAR: VT-d detected Invalidation Completion Error: SID ffff",
      "DMAR: QI HEAD: UNKNOWN qw0 = 0x0, qw1 = 0x0",
      "DMAR: QI PRIOR: UNKNOWN qw0 = 0x0, qw1 = 0x0",
      "DMAR: Invalidation Time-out Error (ITE) cleared"],
     [("IOMMU_ERROR", "host", W, Action.HW_INSPECT), ("IOMMU_CMD_TIMEOUT", "host", W, Action.REBOOT),
      ("IOMMU_ERROR", "host", W, Action.HW_INSPECT)]),
    # pcengines/apu2-documentation#240 (4.x): the event split over two lines; the second names the device.
    (["AMD-Vi: Event logged [",
      "IO_PAGE_FAULT device=05:00.0 domain=0x0012 address=0x00000000ff6101b0 flags=0x0070]"],
     [("IOMMU_DMA_FAULT", "pcie/0000:05:00.0", W, Action.HW_INSPECT)]),
    # An IPoIB stall: the watchdog line and ipoib_timeout's, one condition on nic/ib0 (rendered from
    # sch_generic.c dev_watchdog 6.8+ and ipoib_main.c ipoib_timeout).
    (["ib0: NETDEV WATCHDOG: CPU: 3: transmit queue 0 timed out 9560 ms",
      "ib0: transmit timeout: latency 9560 msecs",
      "ib0: queue stopped 1, tx_head 1234, tx_tail 1100, global_tx_head 1234, global_tx_tail 1100"],
     [("NETDEV_TX_TIMEOUT", "nic/ib0", W, Action.HW_INSPECT), ("NETDEV_TX_TIMEOUT", "nic/ib0", W, Action.HW_INSPECT)]),
    # The arm SMMU losing service: CRITICAL, every device behind it is cut off.
    (["arm-smmu-v3 arm-smmu-v3.0.auto: unexpected global error reported (0x00000001), this could be serious",
      "arm-smmu-v3 arm-smmu-v3.0.auto: device has entered Service Failure Mode!"],
     [("IOMMU_ERROR", "host", W, Action.HW_INSPECT), ("IOMMU_FAILED", "host", C, Action.REBOOT)]),
], ids=["vtd-5.14", "vtd-invalidation-queue", "amdvi-4.x-split", "ipoib-stall", "smmu-service-failure"])
def test_iommu_and_transmit_watchdog_sequences(rules: RuleSet, records: list[str],
                                               expect: list[tuple[str, str, Severity, Action]]) -> None:
    """Issue 28: each line of a real (or rendered) sequence alone, as the kernel check reads them: the
    findings and what the code table makes of them; the header and dump lines raise nothing."""
    got = []
    for line in records:
        for f in rules.match([line]):
            got.append((f.code, f.component, *meaning(rules, f.code)))
    assert got == expect


def test_probe_failed_and_legacy_init_failure_are_host_faults(rules: RuleSet) -> None:
    """The driver names no GPU in these (NVSentinel #155; drivers before 515); unit-tested only, because a
    host condition would show in every other daemon reading this machine's kernel log meanwhile."""
    assert verdict_of(rules, "NVRM: The NVIDIA probe routine failed for 1 device(s).") == \
        ("GPU_PROBE_FAILED", "host", C, Action.REBOOT)
    assert verdict_of(rules, "NVRM: RmInitAdapter failed! (0x26:0xffff:1123)") == \
        ("GPU_INIT_FAILED", "host", C, Action.REBOOT)
    assert rules.codes["GPU_INIT_FAILED"].sticky and rules.codes["GPU_PROBE_FAILED"].sticky


def test_gsp_and_uvm_faults_without_a_gpu_address_are_host_faults(rules: RuleSet) -> None:
    """Issue 28: GSP RPC / heartbeat timeouts and UVM global fatal errors printed without an Xid (real lines:
    open-gpu-kernel-modules #446/#942, bazzite #4449, public UVM write-ups). One timeout stays WARNING (the
    driver marks the GPU only after back-to-back timeouts); the back-to-back mark is CRITICAL; a UVM global
    fatal error needs an OS reboot. Unit-tested only: the lines name no PCI address, so the component is host,
    and no action aims a GPU reset at host: a WARNING has none (the Xid 119 beside it carries RESET_GPU on the
    GPU's bus id), a CRITICAL is REBOOT (it resets the GPU nobody named), sticky until that reboot."""
    assert verdict_of(rules, "NVRM: nvAssertFailedNoLog: Assertion failed: Back to back GSP RPC timeout detected! "
                             "GPU marked for reset @ kernel_gsp.c:2387") == \
        ("GSP_BACK_TO_BACK_TIMEOUT", "host", C, Action.REBOOT)
    assert verdict_of(rules, "NVRM: _issueRpcAndWait: rpcRecvPoll timedout for fn 76 sequence 4129!") == \
        ("GSP_RPC_TIMEOUT", "host", W, Action.NONE)
    assert verdict_of(rules, "NVRM: GPU0 _kgspRpcRecvPoll: GSP RM heartbeat timed out") == \
        ("GSP_HEARTBEAT_TIMEOUT", "host", W, Action.NONE)
    assert verdict_of(rules, "NVRM: nvGpuOpsReportFatalError: uvm encountered global fatal error 0x60, requiring "
                             "os reboot to recover.") == ("UVM_GLOBAL_FATAL", "host", C, Action.REBOOT)
    assert rules.codes["UVM_GLOBAL_FATAL"].sticky
    # The rate-limit line names the GPU: there the reset is aimed at it.
    assert verdict_of(rules, "NVRM: Rate limiting GSP RPC error prints for GPU at PCI:0000:07:00 (printing 1 of "
                             "every 30).  The GPU likely needs to be reset.") == \
        ("GSP_GPU_RESET_REQUIRED", "gpu/0000:07:00.0", C, Action.RESET_GPU)


@pytest.mark.parametrize("line,code,severity,action", [
    # A failed RPC: the status decides (forum thread 379959; public eGPU write-ups, after Xid 79).
    ("NVRM: _issueRpcAndWait: rpcRecvPoll failed with status 0x00000062 for fn 76 sequence 5742!", "GSP_RPC_FAILED",
     C, Action.REBOOT),
    ("NVRM: GPU1 _issueRpcAndWait: rpcRecvPoll failed with status 0x00000064 for fn 76 sequence 12!", "GSP_RPC_FAILED",
     W, Action.NONE),
    ("NVRM: _kgspLogRpcSanityCheckFailure: GPU0 sanity check failed 0xf waiting for RPC response from GSP. Expected "
     "function 4097 (GSP_INIT_DONE) sequence 0 (0x0 0x0).", "GSP_RPC_FAILED", C, Action.REBOOT),
    # The PMU halted (a public suspend/resume write-up, before Xid 62), the GSP-FMC fatal error (a public H100 note).
    ("NVRM: GPU0 _kgspRpcGspEventPmuHalted: Received signal from GSP that PMU has halted.", "GSP_PMU_HALTED", C,
     Action.REBOOT),
    ("NVRM: GPU6 kgspFmcReportErrorCode_GH100: Fatal GSP-FMC Error: version=0x1, partition=0x1, error code=0xaff, "
     "additional info=0xb", "GSP_FMC_FATAL", C, Action.REBOOT),
], ids=["recv-reset-required", "recv-other", "sanity-gpu-lost", "pmu-halted", "fmc-fatal"])
def test_dead_gsp_lines_without_an_address_reboot_the_host(rules: RuleSet, line: str, code: str,
                                                           severity: Severity, action: Action) -> None:
    """Issue 28: the GSP lines that say a GPU is unusable but name it only as GPU<n> (the driver's numbering):
    CRITICAL/REBOOT on host, sticky; a failed RPC whose status says nothing of the sort stays WARNING."""
    assert verdict_of(rules, line) == (code, "host", severity, action)
    if severity is C and code != "GSP_RPC_FAILED":
        assert rules.codes[code].sticky


def test_the_rc_watchdog_headline_is_left_to_its_xid(rules: RuleSet) -> None:
    """llama.cpp #27102: "GPU is probably locked!" comes before the driver's channel recovery and its Xid 8
    (RESTART_APP), which names the GPU; the headline alone claims nothing (one finding, not two), and the
    Xid 8 line after it is the finding."""
    line = "NVRM: krcWatchdog_IMPL: RC watchdog: GPU is probably locked!  Notify Timeout Seconds: 7"
    assert rules.match([line]) == []
    assert verdict_of(rules, "NVRM: Xid (PCI:0000:01:00): 8, pid=709378, name=llama-server, channel 0x00000027") == \
        ("XID_8", "gpu/0000:01:00.0", W, Action.RESTART_JOB)


def test_init_and_recovery_failures_outlive_a_resolve(rules: RuleSet) -> None:
    """A GPU the driver could not bring up, and devices AER left disconnected, stay until a reboot."""
    for code in ("GPU_INIT_FAILED", "PCIE_AER_RECOVERY_FAILED", "GPU_FELL_OFF_BUS"):
        assert rules.codes[code].sticky, code


# --- through the real daemon ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kmsg_verdict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[pb.Verdict, dict[str, tuple[str, str]]]]:
    """One daemon on the real /dev/kmsg; every case's line written once, on its own address; the verdict
    once all of them are standing. Yields (verdict, {case name: (line, component)})."""
    need_root("writing /dev/kmsg")
    root = tmp_path_factory.mktemp("truth", numbered=True)
    d = Daemon(root, {})
    try:
        d.start()
        sent = {c.name: render(c, new_bus()) for c in CASES}
        inject_kmsg(*(line for line, _ in sent.values()))

        def all_in(v: pb.Verdict) -> bool:
            have = {(c.component, c.code) for c in v.conditions}
            return all((sent[c.name][1], c.code) in have for c in CASES)

        try:
            v = d.wait_for(all_in, timeout=15)
        except AssertionError:
            v = d.verdict()  # some case never came: each test below says which
        yield v, sent
    finally:
        d.stop()


SEV = {W: pb.SEVERITY_WARNING, C: pb.SEVERITY_CRITICAL}
ACT = {a: getattr(pb, f"ACTION_{a.name}") for a in Action}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_daemon_raises_each_class(kmsg_verdict: tuple[pb.Verdict, dict[str, tuple[str, str]]],
                                  case: Case) -> None:
    v, sent = kmsg_verdict
    line, component = sent[case.name]
    got = [c for c in v.conditions if c.component == component]
    assert [(c.code, c.severity, c.action) for c in got] == [(case.code, SEV[case.severity], ACT[case.action])], got
    assert got[0].evidence["line"] == line and got[0].source == "kernel"


def test_daemon_nonfatal_nvlink5_stays_below_critical(
        kmsg_verdict: tuple[pb.Verdict, dict[str, tuple[str, str]]]) -> None:
    v, sent = kmsg_verdict
    for name in ("nvlink5_nonfatal", "nvlink5_nonfatal_contained"):
        (c,) = [c for c in v.conditions if c.component == sent[name][1]]
        assert c.severity == pb.SEVERITY_WARNING and c.action not in (pb.ACTION_RESET_GPU, pb.ACTION_REBOOT), c


def test_daemon_clears_on_the_drivers_all_clear(make_daemon) -> None:
    """Xid 154 back to None and the slot's power back to sufficient clear what they raised; a recovery
    action that changes from Drain P2P to a reset takes the reset."""
    need_root("writing /dev/kmsg")
    d = make_daemon()
    d.start()
    gpu, nic, drain = new_bus(), new_bus(), new_bus()
    g, n, dr = f"gpu/{gpu}.0", f"nic/{nic}.0", f"gpu/{drain}.0"
    inject_kmsg(f"NVRM: Xid (PCI:{gpu}): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
                f"mlx5_core {nic}.0: mlx5_pcie_event:299:(pid 268269): Detected insufficient power on the PCIe slot "
                "(27W).",
                f"NVRM: Xid (PCI:{drain}): 154, GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)")

    def has(v: pb.Verdict, component: str, code: str) -> pb.Condition | None:
        return next((c for c in v.conditions if (c.component, c.code) == (component, code)), None)

    v = d.wait_for(lambda v: has(v, g, "XID_154") and has(v, n, "MLX5_PCIE_POWER_INSUFFICIENT")
                   and has(v, dr, "XID_154"), timeout=20)
    assert has(v, dr, "XID_154").action == pb.ACTION_RESTART_JOB
    inject_kmsg(f"NVRM: Xid (PCI:{gpu}): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
                f"mlx5_core {nic}.0: mlx5_pcie_event:299:(pid 268269): PCIe slot advertised sufficient power (75W).",
                f"NVRM: Xid (PCI:{drain}): 154, GPU recovery action changed from 0x3 (Drain P2P) to 0x4 (Drain and "
                "Reset)")
    v = d.wait_for(lambda v: not has(v, g, "XID_154") and not has(v, n, "MLX5_PCIE_POWER_INSUFFICIENT")
                   and has(v, dr, "XID_154").action == pb.ACTION_RESET_GPU, timeout=20)
    assert has(v, dr, "XID_154").severity == pb.SEVERITY_CRITICAL


def test_daemon_reads_a_zero_padded_xid_as_that_xid(make_daemon) -> None:
    """`Xid ...: 079` is Xid 79 (issue 26): CRITICAL, REBOOT and sticky on the GPU, not a WARNING triage code."""
    need_root("writing /dev/kmsg")
    d = make_daemon()
    d.start()
    bus = new_bus()
    gpu = f"gpu/{bus}.0"
    inject_kmsg(f"NVRM: Xid (PCI:{bus}): 079, pid=1101234, name=nvc:[driver], GPU has fallen off the bus.")
    v = d.wait_for(lambda v: any(c.component == gpu for c in v.conditions), timeout=10)
    got = [(c.code, c.severity, c.action, c.sticky) for c in v.conditions if c.component == gpu]
    assert got == [("XID_79", pb.SEVERITY_CRITICAL, pb.ACTION_REBOOT, True)], got


# --- the matcher's prefilter never changes a verdict -------------------------------------------------

def test_required_literal_is_in_every_match(rules: RuleSet) -> None:
    """RuleSet skips a rule's regex when the line lacks the rule's required literal; that must never
    hide a match. Checked on every example and counter-example and on hostile lines built from them."""
    from test_rule_timing import example_texts, hostile_lines, shipped_raw

    from checks.kernel.rules import required_literal

    raw = shipped_raw()
    examples = [text for r in raw.values() for text in example_texts(r)]
    assert sum(bool(r.literal) for r in rules.rules) >= len(rules.rules) - 2  # nearly every rule has one
    for rule in rules.rules:
        assert rule.literal == required_literal(rule.regex)
        for text in examples + list(hostile_lines(raw[rule.name]))[::7]:
            if rule.regex.search(text):
                assert rule.literal in text, (rule.name, rule.literal, text[:120])


def test_required_literal_reads_only_what_is_certain() -> None:
    import re

    from checks.kernel.rules import required_literal

    def lit(p: str) -> str:
        return required_literal(re.compile(p, re.ASCII))

    assert lit(r"Xid \(PCI:(?P<b>[0-9]{4})\): 79") == "Xid (PCI:"
    assert lit(r"(?:optional long literal)?ab") == "ab"        # an optional part is not required
    assert lit(r"(?:alpha|beta) gamma") == " gamma"             # nor is either side of a branch
    assert lit(r"(?i)Link down") == ""                          # case-insensitive: no prefilter
    assert lit(r"x(?i:Link down)y") in ("x", "y")
    assert lit(r"(?=lookahead)z") == "z"
    assert lit(r"(?:repeated ){1,3}+end") == "repeated "
