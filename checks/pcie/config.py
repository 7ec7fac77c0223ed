"""The PCIe check's settings (`checks.pcie` in robustd.yaml: the classes watched, the AER limits) and its rule file."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from checks.pcie.parse import parse_hex
from robustd.check import CheckConfig
from robustd.durations import Duration
from robustd.paths import AbsPath

RULES = str(Path(__file__).with_name("rules.yaml"))  # its codes table


class ClassMatch(BaseModel):
    """`{class: "0x0680", vendor: "0x10de"}`: a class prefix, optionally only from one vendor."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    class_: str = Field(alias="class")
    vendor: str | None = None

    @field_validator("class_", "vendor")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        return None if v is None else parse_hex(v)

    def matches(self, pci_class: str, vendor: str) -> bool:
        return pci_class.startswith(self.class_) and (self.vendor is None or self.vendor == vendor)


def _default_classes() -> list[ClassMatch | str]:
    return ["0x0302", "0x0300", "0x0200", "0x0207", ClassMatch(class_="0x0680", vendor="0x10de")]


class PcieConfig(CheckConfig):
    """`checks.pcie`."""

    sysfs_root: AbsPath | None = None  # default: roots.sys
    # PCI class prefixes watched: 3D controller and VGA (GPUs), Ethernet and InfiniBand (NICs), and
    # NVIDIA's "other bridge" class (NVSwitch). A plain string is a class prefix; a mapping adds a vendor.
    classes: list[ClassMatch | str] = Field(default_factory=_default_classes)
    aer_correctable_count: int = Field(default=100, ge=1)  # corrected errors within the window that
    aer_correctable_window: Duration = 60.0                # make PCIE_AER_CORRECTABLE_RISING

    @field_validator("classes")
    @classmethod
    def _matches(cls, v: list[ClassMatch | str]) -> list[ClassMatch | str]:
        return [ClassMatch(class_=x) if isinstance(x, str) else x for x in v]

    def matchers(self) -> list[ClassMatch]:
        return [x if isinstance(x, ClassMatch) else ClassMatch(class_=x) for x in self.classes]
