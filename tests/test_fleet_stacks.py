"""Stack aggregation on synthetic stacks: one stuck rank, one stuck PP group, no outlier, fail-slow."""

from __future__ import annotations

import random
from typing import Any

import pytest

from robustd.fleet.stacks import Frame, Layout, aggregate, fail_slow, normalize

TP, PP, DP, RPN = 8, 4, 32, 8  # 1,024 ranks on 128 nodes of 8 GPUs
LAYOUT = Layout(tp=TP, pp=PP, dp=DP, ranks_per_node=RPN)


def _frame(fn: str, path: str, rng: random.Random) -> dict[str, Any]:
    return {"function": fn, "file": path, "line": rng.randint(1, 2000)}


def _wait(rng: random.Random, innermost: str = "allreduce") -> list[Any]:
    """A rank's threads: main thread in a collective wait (varying lines/addresses), plus idle helpers."""
    addr = f"0x{rng.getrandbits(48):x}"
    main = [
        {"function": f"ncclKernel_{innermost} (libnccl.so.2 +{addr})", "file": f"/usr/lib/libnccl.so.2+{addr}",
         "line": 0},
        _frame(innermost, f"/opt/venv{rng.randint(0, 1)}/lib/python3.11/site-packages/torch/distributed/c10d.py",
               rng),
        _frame("step", "/opt/venv/lib/python3.11/site-packages/megatron/optimizer.py", rng),
        _frame("train_step", "/job/megatron/training.py", rng),
        _frame("train", "/job/megatron/training.py", rng),
        _frame("<module>", "/job/pretrain_gpt.py", rng),
    ]
    helper = {"name": "Thread-3 (_pin_memory_loop)", "frames": [_frame("_pin_memory_loop", "/x/pin_memory.py", rng)]}
    idle = {"name": "Thread-7", "frames": [_frame("wait", "/usr/lib/python3.11/threading.py", rng),
                                           _frame("run", "/usr/lib/python3.11/threading.py", rng)]}
    threads: list[Any] = [{"name": "MainThread", "frames": main}, helper, idle]
    rng.shuffle(threads)
    return threads


def _healthy(seed: int = 0) -> dict[int, list[Any]]:
    rng = random.Random(seed)
    return {r: _wait(rng) for r in range(LAYOUT.world)}


def test_megatron_default_order() -> None:
    assert LAYOUT.world == 1024
    # rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    assert LAYOUT.coords(3 + 8 * (5 + 32 * 2)) == {"tp": 3, "dp": 5, "pp": 2}
    assert LAYOUT.node(17) == "node2"
    pp_group = [r for r in range(1024) if LAYOUT.group_index("pp", r) == LAYOUT.group_index("pp", 13)]
    assert pp_group == [13, 13 + 256, 13 + 512, 13 + 768]
    assert Layout(tp=2, pp=2, dp=2, ranks_per_node=2, order="tp-pp-dp").coords(2) == {"tp": 0, "pp": 1, "dp": 0}
    with pytest.raises(ValueError):
        Layout(tp=2, pp=2, dp=2)


def test_normalize_drops_varying_parts() -> None:
    rng = random.Random(1)
    a, b = normalize(_wait(rng)), normalize(_wait(rng))
    assert a == b and len(a) == 1  # helper threads dropped, addresses/lines/dirs gone
    assert a[0].startswith("ncclKernel_allreduce@libnccl.so.2;allreduce@c10d.py;") and "0x" not in a[0]
    frames = [Frame("f", "/a/b.py", 3), Frame("g (libx.so +0x1f)", "/lib/libx.so", 9)]
    assert normalize([frames]) == ("f@b.py;g@libx.so",)
    # py-spy --json shape
    assert normalize([{"thread_name": "MainThread", "frames": [{"name": "f", "filename": "/a/b.py", "line": 1}]}]) \
        == ("f@b.py",)


def test_no_outlier_no_suspect() -> None:
    agg = aggregate(_healthy(), LAYOUT)
    assert len(agg.groups) == 1 and agg.groups[0].healthy
    assert agg.outliers == () and agg.suspects == () and agg.suspect_kind is None


def test_one_stuck_rank_names_its_node_only() -> None:
    stacks = _healthy()
    stuck = 8 * 37 + 5  # node37
    stacks[stuck] = _wait(random.Random(9), innermost="cudaStreamSynchronize")
    agg = aggregate(stacks, LAYOUT)
    assert agg.outliers == (stuck,)
    assert agg.suspect_kind == "node"
    assert len(agg.suspects) == 1
    assert agg.suspects[0].index == "node37" and agg.suspect_machines == ("node37",)
    assert agg.suspects[0].outliers == (stuck,)
    # its parallel groups are the evidence
    assert {g.kind for k, gs in agg.evidence.items() for g in gs} == {"node", "tp", "pp", "mp", "dp"}
    assert agg.evidence["pp"][0].ranks == (stuck % 256, stuck % 256 + 256, stuck % 256 + 512, stuck % 256 + 768)


def test_one_stuck_pp_group_names_that_group_only() -> None:
    stacks = _healthy()
    rng = random.Random(5)
    t, d = 6, 11
    pipe = [t + TP * (d + DP * p) for p in range(PP)]
    # Fig. 7: the stages wait in different places
    for p, r in enumerate(pipe):
        stacks[r] = _wait(rng, innermost=["irecv", "irecv", "isend", "all_gather_into_tensor"][p])
    agg = aggregate(stacks, LAYOUT)
    assert agg.outliers == tuple(pipe)
    assert agg.suspect_kind == "pp" and len(agg.suspects) == 1
    g = agg.suspects[0]
    assert g.ranks == tuple(pipe) and g.outliers == tuple(pipe)
    assert g.index == t + TP * d
    assert agg.suspect_machines == tuple(sorted(f"node{r // RPN}" for r in pipe))


def test_whole_replica_stuck_names_model_parallel_group() -> None:
    stacks = _healthy()
    rng = random.Random(6)
    d = 4
    replica = [t + TP * (d + DP * p) for p in range(PP) for t in range(TP)]
    for r in replica:
        stacks[r] = _wait(rng, innermost="irecv")
    agg = aggregate(stacks, LAYOUT)
    assert agg.suspect_kind == "mp" and [g.index for g in agg.suspects] == [d]
    assert len(agg.suspect_machines) == 4


def test_missing_rank_is_an_outlier() -> None:
    stacks = _healthy()
    del stacks[100]
    agg = aggregate(stacks, LAYOUT)
    assert agg.missing == (100,) and agg.outliers == (100,)
    assert agg.suspect_machines == ("node12",)


def test_fail_slow_most_flagged_group() -> None:
    rng = random.Random(2)
    slow = 8 * 90 + 1  # node90, slow in 4 of 5 rounds
    rounds = []
    for i in range(5):
        stacks = _healthy(seed=i)
        if i != 2:
            stacks[slow] = _wait(rng, innermost="cudaMemcpyAsync")
        else:  # noisy round: a different rank happens to be caught elsewhere
            stacks[3] = _wait(rng, innermost="cudaMemcpyAsync")
        rounds.append(aggregate(stacks, LAYOUT))
    res = fail_slow(rounds)
    assert res.suspect is not None and res.suspect.index == "node90"
    assert res.flags == 4 and res.rounds == 5
    assert res.counts[("node", "node0")] == 1
    assert fail_slow([aggregate(_healthy(), LAYOUT)] * 5).suspect is None
