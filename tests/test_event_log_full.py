"""A full state disk: nothing is lost, the verdict stays current and says the log lags, and the held
events reach the log and Watch once space is back. Real tmpfs, real SQLite, real daemon."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import plugin_env, tmpfs

from robustd.api.v1 import robustd_pb2 as pb


@pytest.fixture
def small_disk(short_tmp: Path) -> Iterator[Path]:
    with tmpfs(short_tmp / "disk", "2m") as mnt:
        yield mnt


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass
    return filler


def test_a_full_state_disk_holds_events_and_loses_none(make_daemon: Any, small_disk: Path, short_tmp: Path) -> None:
    flag = short_tmp / "flag"
    d = make_daemon({"state_dir": str(small_disk / "state"),
                     "checks": {"kernel": {"enabled": False}, "hang": {"enabled": False}, "boom": {"enabled": False},
                                "tick": {"interval": "100ms", "flag_file": str(flag)}},
                     "policy": {"codes": {"TICK_FLAG": {"severity": "CRITICAL", "action": "REBOOT"}}}},
                    env=plugin_env(short_tmp))
    d.start()
    assert d.verdict().event_log_error == ""
    filler = fill(small_disk)

    flag.touch()  # a fault appears while the log cannot be written
    v = d.wait_for(lambda v: any(c.code == "TICK_FLAG" for c in v.conditions))
    assert v.severity == pb.SEVERITY_CRITICAL and v.action == pb.ACTION_REBOOT  # the verdict tells the truth
    assert "disk is full" in v.event_log_error and v.events_held >= 1
    r = d.robustctl("status")
    assert r.returncode == 2 and "EVENT LOG NOT WRITABLE: " in r.stdout and "held in memory" in r.stdout
    assert d.stub().ListEvents(pb.ListEventsRequest(), timeout=5).events == []  # nothing on disk yet
    runs = {c.name: c.runs for c in d.stub().ListChecks(pb.ListChecksRequest(), timeout=5).checks}
    time.sleep(0.5)
    later = {c.name: c.runs for c in d.stub().ListChecks(pb.ListChecksRequest(), timeout=5).checks}
    assert later["tick"] > runs["tick"]  # the check keeps running
    assert "cannot write the event log" in d.log()

    os.unlink(filler)  # space is back: the held event is committed within the next tick
    v = d.wait_for(lambda v: v.event_log_error == "", timeout=5)
    assert v.events_held == 0 and v.seq >= 1
    [c] = [c for c in v.conditions if c.code == "TICK_FLAG"]
    assert c.seq >= 1
    events = d.stub().ListEvents(pb.ListEventsRequest(), timeout=5).events
    assert [(e.kind, e.condition.code) for e in events][:1] == [(pb.EVENT_KIND_RAISED, "TICK_FLAG")]
    stream = d.stub().Watch(pb.WatchRequest(from_seq=0), timeout=5)
    first = next(iter(stream))
    assert first.snapshot and first.condition.code == "TICK_FLAG" and first.seq == c.seq
    stream.cancel()
    assert "event log writable again" in d.log()

    d.restart()  # and it was really written: the condition survives a restart
    v = d.verdict()
    assert [c.code for c in v.conditions] == ["TICK_FLAG"] and v.event_log_error == ""
