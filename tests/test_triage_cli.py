"""`robustctl triage`: a pure local call on log files (no daemon, no root), bounded whatever the files hold.

What is asserted is what an operator or a script sees: the exit status, the text, the --json keys. A
few assertions name a class (an empty log is `unknown`, a KeyError traceback is `user_code`); they hold
once the judge (robustd/triage/judge.py) does what issue 14 asks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from robustd.cli.triage import parse_size, paths, read
from robustd.triage import CLASSES, INFRA, NEXT

REPO = Path(__file__).resolve().parent.parent
KEYS = {"class", "infra", "next", "level", "evidence", "ranks", "reason", "partial"}

KEYERROR = textwrap.dedent("""\
    step 1200 | loss 2.3141 | lr 3.0e-04
    Traceback (most recent call last):
      File "/home/alice/proj/train.py", line 211, in <module>
        main()
      File "/home/alice/proj/train.py", line 187, in main
        labels = collate(batch, "labels")
      File "/home/alice/proj/train.py", line 42, in collate
        return [sample[key] for sample in batch]
      File "/home/alice/proj/train.py", line 42, in <listcomp>
        return [sample[key] for sample in batch]
    KeyError: 'labels'
    """)

CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
            "79.15 GiB of which 3.44 GiB is free. Including non-PyTorch memory, this process has 75.70 GiB memory in "
            "use. Of the allocated memory 71.38 GiB is allocated by PyTorch, and 3.81 GiB is reserved by PyTorch but "
            "unallocated.\n")


def ctl(*args: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "triage", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL, **kw)  # type: ignore


def answer(*args: str) -> dict[str, object]:
    r = ctl("--json", *args)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    doc = json.loads(r.stdout)
    assert set(doc) <= KEYS and {"class", "infra", "next", "evidence", "reason"} <= set(doc), doc
    assert doc["class"] in CLASSES and doc["infra"] in INFRA and doc["next"] in NEXT, doc
    assert ("level" in doc) <= (doc["next"] == "diagnose"), doc  # level only with diagnose
    for e in doc["evidence"]:  # type: ignore[attr-defined]
        assert {"file", "line", "text", "offset"} <= set(e) <= {"file", "line", "text", "offset", "rank"}, e
    return dict(doc)


def test_text_and_json(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_text(KEYERROR)
    r = ctl(str(log), "--exit-code", "1")
    assert r.returncode == 0, r.stderr
    for label in ("class:", "infra:", "next:"):
        assert label in r.stdout, r.stdout
    doc = answer(str(log), "--exit-code", "1")
    assert doc["class"] == "user_code" and doc["infra"] == "unlikely" and doc["next"] == "rollback", doc
    assert any(e["file"] == str(log) and "KeyError: 'labels'" in e["text"] for e in doc["evidence"]), doc  # type: ignore


def test_exit_code_and_signal_are_checked_and_normalised(tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.write_text("Killed\n")
    for good in (["--signal", "KILL"], ["--signal", "sigkill"], ["--signal", "9"], ["--exit-code", "137"],
                 ["--exit-code", "0"], ["--exit-code", "255", "--signal", "SIGSEGV"],
                 ["--signal", "SIGRTMIN+3"], ["--signal", "35"]):  # real-time signals: judged, not refused
        r = ctl(str(log), *good)
        assert r.returncode == 0, (good, r.stderr)
    for bad, words in ((["--signal", "SIGFOO"], "unknown signal 'SIGFOO'"), (["--signal", "99"], "unknown signal"),
                       (["--exit-code", "256"], "out of range"), (["--exit-code", "-9"], "give the signal instead"),
                       (["--exit-code", "x"], "not a whole number"), (["--tail", "0"], "at least one byte"),
                       (["--tail", "1T"], "not a size"), (["--tail", "2G"], "at most 1GiB")):
        r = ctl(str(log), *bad)
        assert r.returncode == 64 and words in r.stderr, (bad, r.stderr)
        assert "Traceback" not in r.stderr


def test_signal_names() -> None:
    from robustd.triage.status import exit_code, signal_name

    assert [signal_name(s) for s in ("SIGKILL", "KILL", "kill", " 9 ", "sigabrt", "SIGIOT", "6", "SIGCLD")] == \
        ["SIGKILL"] * 4 + ["SIGABRT"] * 3 + ["SIGCHLD"]
    assert signal_name("") is None and signal_name("  ") is None
    assert signal_name("35") == "SIGRTMIN+1" and signal_name("SIGRTMIN+1") == "SIGRTMIN+1"
    assert signal_name("64") == "SIGRTMAX" and signal_name("RTMAX-1") == "SIGRTMAX-1"
    for bad in ("0", "65", "32", "SIGFOO", "-9", "SIGRTMIN+99", "x" * 1000, "9x"):
        with pytest.raises(ValueError):
            signal_name(bad)
    assert exit_code(None) is None and exit_code(0) == 0 and exit_code(255) == 255
    for bad_code in (-1, 256, 1 << 40):
        with pytest.raises(ValueError):
            exit_code(bad_code)


def test_tail_sizes() -> None:
    assert [parse_size(t) for t in ("512", "64K", "64KiB", "1M", "1mib", "1G", "1GiB", " 2 M ")] == \
        [512, 64 << 10, 64 << 10, 1 << 20, 1 << 20, 1 << 30, 1 << 30, 2 << 20]
    for bad in ("", "0", "-1", "1.5M", "1KB", "1T", "2G", "M"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_only_the_tail_is_read(tmp_path: Path) -> None:
    log = tmp_path / "long.log"
    head = "".join(f"step {i} | loss 2.{i:04d}\n" for i in range(2000))
    log.write_text(head + KEYERROR)
    size = log.stat().st_size
    t = read(str(log), 1024)
    assert t.data == log.read_bytes()[-1024:] and t.offset == size - 1024 and not t.whole
    assert read(str(log), size).whole
    doc = answer("--tail", "1K", str(log))
    assert all(int(e["offset"]) >= size - 1024 for e in doc["evidence"]), doc  # type: ignore
    assert doc.get("partial") == [str(log)], doc
    assert doc["class"] == "user_code", doc
    assert "partial" not in answer(str(log))  # 1 MiB by default: the whole file


def test_a_pipe_is_read_to_its_end_keeping_the_tail(tmp_path: Path) -> None:
    r, w = os.pipe()
    data = os.urandom(300_000) + KEYERROR.encode()
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(r)
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    try:
        t = read(f"/dev/fd/{r}", 4096)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert t.data == data[-4096:] and t.offset == len(data) - 4096 and not t.whole
    p = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "triage", "--json", "/dev/stdin"],
                       input=KEYERROR, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["class"] == "user_code"


def test_a_directory_means_its_regular_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    (logs / "nested").mkdir(parents=True)
    (logs / "nested" / "rank9.log").write_text(KEYERROR)  # not recursive
    (logs / "rank1.log").write_text("step 1200 | loss 2.3141\n")
    (logs / "rank0.log").write_text(KEYERROR)
    (logs / "link.log").symlink_to(logs / "rank1.log")  # a link to a regular file is one
    (logs / "dangling.log").symlink_to(tmp_path / "nowhere")
    os.mkfifo(logs / "fifo")  # never opened: it would block
    got = paths([str(logs)])
    assert got == [str(logs / n) for n in ("link.log", "rank0.log", "rank1.log")], got
    assert paths([str(logs / "rank0.log"), str(logs), str(logs / "rank0.log")]) == \
        [str(logs / "rank0.log"), str(logs / "link.log"), str(logs / "rank1.log")]  # each once
    doc = answer(str(logs))
    assert doc["class"] == "user_code", doc
    assert {e["file"] for e in doc["evidence"]} == {str(logs / "rank0.log")}, doc  # type: ignore


def test_an_unreadable_log_is_one_line_naming_it_exit_2(tmp_path: Path) -> None:
    good = tmp_path / "good.log"
    good.write_text(KEYERROR)
    missing = tmp_path / "missing.log"
    r = ctl(str(good), str(missing))
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip() == f"robustctl: triage: {missing}: No such file or directory", r.stderr
    r = ctl("/proc/self/mem")  # stat says a regular file; reading it fails (EIO)
    assert r.returncode == 2 and "/proc/self/mem" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    secret = tmp_path / "secret.log"
    secret.write_text(KEYERROR)
    secret.chmod(0o000)
    if os.geteuid() == 0:  # root reads anything: ask as nobody
        os.chmod(tmp_path, 0o755)
        r = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", sys.executable,
                            "-m", "robustd.cli.robustctl", "triage", str(secret)], capture_output=True, text=True,
                           timeout=60, cwd=REPO, stdin=subprocess.DEVNULL)
    else:
        r = ctl(str(secret))
    assert r.returncode == 2 and r.stderr.strip() == f"robustctl: triage: {secret}: Permission denied", r.stderr
    assert "Traceback" not in r.stderr


def test_too_many_logs_is_a_usage_error(tmp_path: Path) -> None:
    logs = tmp_path / "many"
    logs.mkdir()
    for i in range(1025):
        (logs / f"rank{i}.log").write_bytes(b"")
    r = ctl(str(logs))
    assert r.returncode == 64 and "more than 1024 logs" in r.stderr, r.stderr


def test_binary_garbage_and_non_utf8_do_not_crash(tmp_path: Path) -> None:
    rng = __import__("random").Random(14)
    garbage = tmp_path / "core.bin"
    garbage.write_bytes(bytes(rng.getrandbits(8) for _ in range(1 << 20)))
    latin = tmp_path / "latin1.log"
    latin.write_bytes(b"\xe9tape 3: perte=2.1\n\xff\xfe\x00K\x00e\x00y\nKeyError: 'caf\xe9'\n\x1b[31mred\x1b[0m\r\n")
    nul = tmp_path / "nul.log"
    nul.write_bytes(b"\x00" * 100_000 + b"RuntimeError: CUDA error: an illegal memory access was encountered\x00\n")
    one_line = tmp_path / "one-line.log"
    one_line.write_bytes(b"x" * (3 << 20))  # no newline at all, longer than the tail
    weird = tmp_path / "na\xefve-\u202e.log"
    weird.write_text(KEYERROR)
    not_utf8 = tmp_path / os.fsdecode(b"rank\xff\x1b.log")  # a file name that is not UTF-8
    not_utf8.write_text(KEYERROR)
    for path in (garbage, latin, nul, one_line, weird, not_utf8):
        answer(str(path), "--exit-code", "1")
        r = ctl(str(path))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert "\x1b" not in r.stdout and "\u202e" not in r.stdout, r.stdout  # escaped for the terminal
    answer(str(garbage), str(latin), str(nul), str(one_line), str(weird), str(not_utf8))


def test_an_empty_log_is_unknown(tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    doc = answer(str(empty))
    assert doc["class"] == "unknown" and doc["evidence"] == [], doc


def test_a_sparse_multi_gib_log_is_read_from_its_tail_in_bounded_memory(tmp_path: Path) -> None:
    huge = tmp_path / "rank5.log"
    size = 6 << 30
    tail = ("step 90210 | loss 1.8123 | lr 1.2e-04\n" + CUDA_OOM).encode()
    with open(huge, "wb") as f:
        f.truncate(size - len(tail) - 1)  # sparse: 6 GiB that cost no disk
        f.seek(size - len(tail) - 1)
        f.write(b"\n" + tail)
    assert huge.stat().st_size == size
    # robustctl as a grandchild, so RUSAGE_CHILDREN of its parent is robustctl's own peak RSS
    wrapper = ("import resource, subprocess, sys, time\n"
               "t = time.monotonic()\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.monotonic() - t)\n"
               "print(p.stdout, p.stderr, end='')\n")
    r = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "robustd.cli.robustctl", "triage",
                        "--json", str(huge)], capture_output=True, text=True, timeout=120, cwd=REPO)
    head, _, rest = r.stdout.partition("\n")
    rc, rss_kib, seconds = head.split()
    assert int(rc) == 0, rest
    assert int(rss_kib) < 150 * 1024, f"peak RSS {int(rss_kib) // 1024} MiB"
    assert float(seconds) < 60  # a scan of 6 GiB of zeros would take far longer; the tail takes well under 1 s
    doc = json.loads(rest)
    assert doc.get("partial") == [str(huge)], doc
    assert doc["class"] == "oom_gpu", doc
    assert any(e["offset"] == size - len(CUDA_OOM) for e in doc["evidence"]), doc


def test_the_verb_is_listed_and_needs_no_daemon(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "robustd.cli.robustctl", "--help"], capture_output=True, text=True,
                       timeout=30, cwd=REPO)
    assert "triage" in r.stdout
    log = tmp_path / "x.log"
    log.write_text(KEYERROR)
    t = time.monotonic()
    r = ctl("--socket", str(tmp_path / "no-daemon.sock"), str(log))
    assert r.returncode == 0 and time.monotonic() - t < 30, r.stderr
