"""Which components are the node's own (robustd/owned.py): the GPUs NVML lists and the devices sysfs shows,
looked up under roots.sys only, never by a path a kernel line could steer."""

from __future__ import annotations

from pathlib import Path

from robustd.owned import Owned


def sysfs(root: Path) -> Path:
    """A sysfs tree laid out as the kernel lays it out: devices are directories, class entries are links."""
    pci = root / "bus" / "pci" / "devices"
    (root / "devices" / "pci0000:00" / "0000:3b:00.0").mkdir(parents=True)
    pci.mkdir(parents=True)
    (pci / "0000:3b:00.0").symlink_to("../../../devices/pci0000:00/0000:3b:00.0")
    (pci / "0000:5e:00.0").symlink_to("../../../devices/pci0000:00/0000:5e:00.0")  # dangling: still listed
    for where, name in (("class/net", "ens1f0np0"), ("class/infiniband", "mlx5_0"), ("block", "nvme0n1")):
        (root / where).mkdir(parents=True)
        (root / where / name).symlink_to("../../devices/virtual")
    (root / "secret").mkdir()
    return root


def test_devices_sysfs_shows_and_gpus_nvml_lists_are_the_nodes_own(tmp_path: Path) -> None:
    listed, root = ["0000:1b:00.0"], str(sysfs(tmp_path / "sys"))
    owned = Owned(lambda: root, lambda: listed)
    yes = ["gpu/0000:1b:00.0", "gpu/0000:3b:00.0", "gpu/0000:3B:00.0", "pcie/0000:3b:00.0", "nic/0000:5e:00.0",
           "nvswitch/0000:3b:00.0", "nic/ens1f0np0", "ib/mlx5_0", "ib/mlx5_0/1", "disk/nvme0n1"]
    no = ["gpu/0000:1c:00.0", "gpu/*", "host", "nic/eth9", "ib/mlx5_9/1", "disk/sdz", "pcie/../../secret",
          "nic/..", "nic/.", "disk/../secret", "ib/../secret", "gpu/", "check/kernel", "nic/a b", "x/0000:3b:00.0"]
    assert [c for c in yes if not owned(c)] == []
    assert [c for c in no if owned(c)] == []


def test_a_gpu_nvml_lost_stays_the_nodes_own(tmp_path: Path) -> None:
    listed = ["0000:1b:00.0", "0000:2a:00.0"]
    owned = Owned(lambda: str(tmp_path), lambda: listed)
    assert owned("gpu/0000:2a:00.0")
    listed.clear()  # fell off the bus: NVML no longer lists it, and its Xid 79 still stands on its own
    assert owned("gpu/0000:2a:00.0") and owned("gpu/0000:1b:00.0") and not owned("gpu/0000:3c:00.0")
