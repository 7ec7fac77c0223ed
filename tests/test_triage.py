"""The triage judge as a library: root cause over cascade noise, exit status, bounded reading of any input."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from robustd.triage import LogText, read_log, to_json, triage
from robustd.triage.status import signal_name

WATCHDOG = ("[rank{r}]:[E501 12:{m:02d}:01.123456789 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=8, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran "
            "for 600018 milliseconds before timing out.")
ABORT = "[rank{r}]: RuntimeError: NCCL communicator was aborted on rank {r}."
ROOTS = {  # class -> the line rank 3 dies of (real strings: c10 CUDA errors, the caching allocator, a KeyError)
    "gpu_hw": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "cuda": "RuntimeError: CUDA error: an illegal memory access was encountered",
    "oom_gpu": ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 3 has a total capacity "
                "of 79.15 GiB of which 6.75 MiB is free."),
    "user_code": "KeyError: 'input_idss'",
}


def log(name: str, *lines: str) -> LogText:
    return LogText(name=name, data=("\n".join(lines) + "\n").encode())


def cascade(root: str, timestamps: bool, root_last: bool) -> list[LogText]:
    """Rank 3 fails at 12:00; ranks 0-2 and 4-7 time out at 12:10 and abort (all in one merged output)."""
    noise = []
    for r in (0, 1, 2, 4, 5, 6, 7):
        noise += [WATCHDOG.format(r=r, m=10), ABORT.format(r=r)]
    if not timestamps:
        noise = [n.replace("[E501 12:10:01.123456789 ", "[E ") for n in noise]
    head = "[rank3]:[E501 12:00:00.000000000 train.py:88] step 1200 failed" if timestamps else "[rank3]: step 1200"
    failing = [head, "[rank3]: Traceback (most recent call last):",
               '[rank3]:   File "/workspace/train.py", line 88, in <module>', "[rank3]:     loss = step(batch)",
               f"[rank3]: {root}"]
    lines = noise + failing if root_last else failing + noise
    return [log("slurm-42.out", *lines)]


@pytest.mark.parametrize("klass", sorted(ROOTS))
@pytest.mark.parametrize("timestamps", [True, False], ids=["timestamps", "no-timestamps"])
def test_the_root_cause_on_one_rank_decides_over_noise_on_all_others(klass: str, timestamps: bool) -> None:
    for root_last in (False, True):
        if root_last and not timestamps:
            continue  # without timestamps, order and rank structure are all there is
        t = triage(cascade(ROOTS[klass], timestamps, root_last), exit_code=1)
        assert t.klass == klass, (root_last, to_json(t))
        assert t.ranks == (3,)
        assert t.evidence[0].file == "slurm-42.out" and ROOTS[klass][:30] in t.evidence[0].text
        assert "judged consequences" in t.reason


def test_per_rank_files_without_timestamps_name_the_rank_from_the_file() -> None:
    logs = [log(f"rank{r}.log", WATCHDOG.format(r=r, m=10).split(":", 1)[1]) for r in (0, 1, 2)]
    logs.append(log("rank3.log", "Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
                    "    import deepspeedd", "ModuleNotFoundError: No module named 'deepspeedd'"))
    t = triage(logs, exit_code=1)
    assert (t.klass, t.infra, t.next, t.ranks) == ("user_code", "unlikely", "rollback", (3,))
    assert [(e.file, e.line) for e in t.evidence[:2]] == [("rank3.log", 4), ("rank3.log", 2)]


def test_watchdog_timeouts_alone_are_a_hang_on_every_rank() -> None:
    t = triage([log("out", *[WATCHDOG.format(r=r, m=10) for r in range(4)])], exit_code=1)
    j = to_json(t)
    assert (j["class"], j["infra"], j["next"], j["level"]) == ("hang", "likely", "diagnose", "all_to_all,all_gather")
    assert j["ranks"] == [0, 1, 2, 3]


def test_an_earlier_timestamp_beats_a_higher_priority_class() -> None:
    logs = [log("rank0.log", "2024-05-01 12:00:00,000 INFO step", "OSError: [Errno 116] Stale file handle"),
            log("rank1.log", "2024-05-01 12:05:00,000 INFO step", "RuntimeError: CUDA error: unknown error")]
    assert triage(logs, exit_code=1).klass == "storage"
    logs[1] = log("rank1.log", "2024-05-01 12:00:01,000 INFO step", "RuntimeError: CUDA error: unknown error")
    assert triage(logs, exit_code=1).klass == "gpu_hw"  # within 2 s: the GPU fault explains the rest


def test_exit_status_decides_when_the_logs_hold_nothing() -> None:
    empty = [LogText(name="empty.log", data=b"")]
    assert to_json(triage(empty, exit_code=1))["class"] == "unknown"
    assert triage(empty, exit_code=1).next == "diagnose"
    assert (triage(empty, exit_code=0).next, triage(empty, exit_code=0).infra) == ("none", "unlikely")
    assert triage(empty, exit_code=143).next == "none"  # 128 + SIGTERM: scancel or a time limit
    assert triage(empty, signal="TERM").next == "none"
    assert triage([], exit_code=3).klass == "unknown"
    ok = [log("ok.log", "{'train_runtime': 1234.5, 'train_loss': 1.234, 'epoch': 3.0}")]
    assert triage(ok, exit_code=0).next == "none"


def test_sigkill_with_the_shells_killed_line_is_the_host_oom_killer() -> None:
    logs = [log("slurm-7.out", "step 10 loss 2.3", "/var/spool/slurmd/job7/slurm_script: line 14: 98765 Killed"
                "                  python train.py")]
    t = triage(logs, exit_code=137)
    assert (t.klass, t.infra, t.next) == ("oom_host", "unlikely", "rollback")
    assert "SIGKILL" in t.reason


def test_signal_names() -> None:
    assert signal_name("9") == signal_name("kill") == signal_name("SIGKILL") == "SIGKILL"
    assert signal_name(None) is None
    with pytest.raises(ValueError, match="unknown signal"):
        signal_name("SIGNOPE")


def test_a_handled_traceback_does_not_decide() -> None:
    handled = ["Traceback (most recent call last):", '  File "/usr/lib/python3/site-packages/lib.py", line 9, in f',
               "ValueError: retrying"] + [f"step {i} loss 2.{i:03d}" for i in range(300)]
    t = triage([log("train.log", *handled, WATCHDOG.format(r=0, m=10))], exit_code=1)
    assert t.klass == "hang", to_json(t)


def test_a_tail_that_starts_inside_a_traceback_still_finds_the_exception() -> None:
    data = b"x" * 100 + b'\n  File "train.py", line 40, in main\n    x = os.environ["RANK"]\nKeyError: \'RANK\'\n'
    t = triage([LogText(name="t.log", data=data, offset=5000, whole=False)], exit_code=1)
    assert t.klass == "user_code" and t.partial == ("t.log",)
    assert t.evidence[0].line == 3 and t.evidence[0].offset == 5000 + data.index(b"KeyError")


def test_interleaved_ranks_keep_their_own_tracebacks() -> None:
    lines = ["[rank0]: Traceback (most recent call last):", "[rank1]: Traceback (most recent call last):",
             '[rank0]:   File "train.py", line 5, in <module>', '[rank1]:   File "train.py", line 5, in <module>',
             "[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote "
             "process exited or there was a network error, NCCL version 2.19.3",
             "[rank0]: AttributeError: 'NoneType' object has no attribute 'shape'"]
    t = triage([log("out", *lines)], exit_code=1)
    assert (t.klass, t.ranks) == ("user_code", (0,))
    assert "AttributeError" in t.evidence[0].text


def test_garbage_and_invalid_utf8_do_not_crash_and_decide_nothing() -> None:
    junk = os.urandom(1 << 20).replace(b"rror", b"rrxr")
    t = triage([LogText(name="junk", data=junk), LogText(name="bad-utf8", data=b"\xff\xfe\xc3(" * 1000)], exit_code=1)
    assert t.klass == "unknown"
    garbled = b"\xff\xfe RuntimeError: CUDA error: an illegal memory access was encountered \xc3(\x1b[31m\n"
    t = triage([LogText(name="g", data=garbled)], exit_code=1)
    assert t.klass == "cuda" and t.evidence[0].text.isprintable()


def test_a_huge_log_is_read_from_its_tail_in_bounded_time(tmp_path: Path) -> None:
    path = tmp_path / "rank5.log"
    with open(path, "wb") as f:  # 8 GiB, sparse: only the tail is real
        f.truncate(8 << 30)
        f.seek((8 << 30) - 200)
        f.write(b"\n" + b"RuntimeError: CUDA error: uncorrectable ECC error encountered\n".rjust(199, b" "))
    start = time.monotonic()
    text = read_log(str(path))
    t = triage([text], exit_code=1)
    assert time.monotonic() - start < 10
    assert len(text.data) == 1 << 20 and not text.whole and text.offset == (8 << 30) - (1 << 20)
    assert (t.klass, t.ranks, t.partial) == ("gpu_hw", (5,), (str(path),))
    assert t.evidence[0].offset == (8 << 30) - 199


def test_many_matching_lines_are_bounded() -> None:
    spam = (WATCHDOG.format(r=1, m=10) + "\n").encode() * 20000  # ~5 MB of the same failure line
    start = time.monotonic()
    t = triage([LogText(name="spam", data=spam)], exit_code=1)
    assert t.klass == "hang" and len(t.evidence) <= 8
    assert time.monotonic() - start < 10
