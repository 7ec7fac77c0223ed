"""robustd.atomicfile: a reader sees the old file or the whole new one; a failed write leaves the old one and
no temporary file behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from robustd import atomicfile


def test_write_bytes_replaces_the_whole_file_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    atomicfile.write_bytes(target, b"new" * 1000, mode=0o600, durable=True)
    assert target.read_bytes() == b"new" * 1000
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["state.json"]  # no temporary file left


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "bundle.json"
    target.write_text("old")
    seen: list[str] = []
    with pytest.raises(RuntimeError), atomicfile.replacing(target) as tmp:
        seen.append(tmp)
        Path(tmp).write_text("half of the ne")
        assert target.read_text() == "old"  # a reader meanwhile sees the old file
        raise RuntimeError("disk full")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["bundle.json"]
    assert os.path.dirname(seen[0]) == str(tmp_path) and os.path.basename(seen[0]).startswith(".bundle.json.")


def test_a_missing_directory_is_an_oserror_naming_nothing_written(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomicfile.write_bytes(tmp_path / "no" / "such" / "file", b"x")
    assert os.listdir(tmp_path) == []
