"""Traffic counters: the NIC check publishes them, the GPU check's stall detection reads them (robustd/traffic.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from checks.gpu import GpuCheck
from checks.gpu.config import GpuConfig
from checks.nic import NicCheck
from robustd import checkset
from robustd.check import CheckConfig, CheckContext, CheckStatus
from robustd.roots import Roots
from robustd.runner import CheckState
from robustd.traffic import TrafficSnapshot, read_traffic


def sysfs(root: Path) -> Path:
    counters = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters"
    counters.mkdir(parents=True)
    (counters / "port_xmit_data").write_text("1000\n")
    (counters / "port_rcv_data").write_text("1000\n")
    for link, rx in (("eth0", 5000), ("lo", 7)):
        stats = root / "class" / "net" / link / "statistics"
        stats.mkdir(parents=True)
        (stats / "rx_bytes").write_text(f"{rx}\n")
        (stats / "tx_bytes").write_text(f"{rx}\n")
    return root


def test_read_traffic_counts_every_link_but_lo_and_every_ib_port_in_bytes(tmp_path: Path) -> None:
    root = sysfs(tmp_path)
    snap = read_traffic(str(root))
    assert snap.links == {"ib/mlx5_0/1": 4 * 2000, "nic/eth0": 10000}
    assert snap.total == 4 * 2000 + 10000  # IB words are 4 bytes; lo is not traffic


def test_a_context_reads_the_nic_snapshot_and_falls_back_to_sysfs_without_one(tmp_path: Path) -> None:
    root = str(sysfs(tmp_path))
    published = TrafficSnapshot(at=5.0, links={"nic/eth0": 1})
    ctx = CheckContext(name="gpu", node_name="n", roots=Roots(sys=root), config=CheckConfig(), state_dir=root)
    assert ctx.traffic().total == 18000  # no NIC check wired: read now
    ctx = replace(ctx, traffic_source=lambda: None)  # the NIC check runs but has not polled yet
    assert ctx.traffic().total == 18000
    assert replace(ctx, traffic_source=lambda: published).traffic() is published


def test_only_a_running_nic_check_publishes() -> None:
    nic = NicCheck()
    nic._snapshot = TrafficSnapshot(at=1.0, links={"nic/eth0": 3})
    assert checkset.traffic([CheckState(check=nic, config=CheckConfig(), status=CheckStatus.OK)]) is nic._snapshot
    for status in (CheckStatus.DISABLED, CheckStatus.UNSUPPORTED, CheckStatus.ERROR, CheckStatus.TIMEOUT):
        assert checkset.traffic([CheckState(check=nic, config=CheckConfig(), status=status)]) is None
    assert checkset.traffic([]) is None


def test_the_stall_is_judged_on_the_nic_checks_snapshots(tmp_path: Path) -> None:
    """Rates between two NIC snapshots; a GPU poll that finds no new snapshot judges nothing new."""
    snaps = iter([TrafficSnapshot(0.0, {"ib/mlx5_0/1": 0}),
                  TrafficSnapshot(1.0, {"ib/mlx5_0/1": 10_000_000}),  # 10 MB/s: collectives running
                  TrafficSnapshot(1.0, {"ib/mlx5_0/1": 10_000_000}),  # the same snapshot again
                  TrafficSnapshot(2.0, {"ib/mlx5_0/1": 10_000_100}),  # quiet from here
                  TrafficSnapshot(3.0, {"ib/mlx5_0/1": 10_000_200}),
                  TrafficSnapshot(4.0, {"ib/mlx5_0/1": 10_000_300})])
    ctx = CheckContext(name="gpu", node_name="n", roots=Roots(sys=str(tmp_path)), config=GpuConfig(),
                       state_dir=str(tmp_path), traffic_source=lambda: next(snaps))
    gpu, cfg = GpuCheck(), GpuConfig(stall_after="2s")
    got = [gpu._stall(ctx, cfg, now, {4242}, [0]) for now in (0.1, 1.1, 1.3, 2.1, 3.1, 4.1)]
    assert [len(f) for f in got] == [0, 0, 0, 0, 1, 1]  # quiet from the snapshot at 1.0 on: stalled 2 s later
    assert got[-1][0].code == "TRAINING_STALLED" and got[-1][0].evidence["traffic_bytes_per_s"] == "100"
