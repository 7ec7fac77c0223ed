#!/usr/bin/env python3
"""A small GPT-like model trained with real torch.distributed (gloo on CPU, NCCL on GPU) under a 1F1B
pipeline schedule with data parallelism, recorded by robustd's straggler op recorder.

    python examples/pipeline_train.py --pp 2 --dp 2 --steps 30 --trace-dir DIR \\
        [--slow-worker DP,PP] [--heavy-last-stage] [--long-sequences DP] [--gc-pauses]
    robustctl stragglers analyze --trace-dir DIR

Run as above it starts pp x dp worker processes itself (a rendezvous on 127.0.0.1); under torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) each process is one worker. Rank r is DP rank r // pp, stage
r % pp. Per step each stage runs Megatron-LM's 1F1B schedule: warm-up forwards, steady one-forward-one-
backward with batched send/recv pairs (P2P to the neighbouring stages), cool-down backwards; then ZeRO-1
style data parallelism: gradients reduce-scattered across the stage's DP ranks, a global grad-norm
all-reduce for clipping, the optimizer on the rank's shard, and the parameters all-gathered at the next
step's start. Every one of those is a recorded op, named as the analyser knows them.

Injected causes, each large enough to read through the noise of a shared 2-core machine:
  --slow-worker DP,PP   that worker does extra real compute in every compute op (--slow-factor x its work)
  --heavy-last-stage    the last stage holds 4x the layers
  --long-sequences DP   that DP rank's microbatches are 1.5-4x longer, varying from microbatch to microbatch
  --gc-pauses           every rank holds a large Python heap and runs full collections at random moments,
                        unsynchronised across ranks (recorded by the recorder's gc hook, not by this script)
--fault-after STEP delays the injected cause until that step (for watching a fault start mid-run).
Defaults suit a 2-core machine: one torch thread per rank and small ops.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

try:
    from robustd.stragglers.recorder import Recorder
except ImportError:  # run from a checkout without installing robustd
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from robustd.stragglers.recorder import Recorder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (>= 2)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas (>= 1)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--trace-dir", metavar="DIR", help="record ops here (shards + metadata.yaml); none: no recorder")
    p.add_argument("--slow-worker", metavar="DP,PP", type=_cell, help="slow this worker down")
    p.add_argument("--slow-factor", type=float, default=2.0, help="its extra compute per op, x the op's own")
    p.add_argument("--heavy-last-stage", action="store_true", help="give the last stage 4x the layers")
    p.add_argument("--long-sequences", metavar="DP", type=int, help="give this DP rank longer, varied sequences")
    p.add_argument("--gc-pauses", action="store_true", help="heavy, unsynchronised GC pauses on every rank")
    p.add_argument("--fault-after", type=int, default=0, metavar="STEP", help="inject the cause from this step")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks per stage")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--mb-size", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--record-every", type=int, default=1, help="recorder: a window every N steps")
    p.add_argument("--record-window", type=int, default=1, help="recorder: steps per window")
    p.add_argument("--record-start", type=int, default=2, help="recorder: first recorded step (skip warm-up)")
    p.add_argument("--compute-clock", choices=("thread", "monotonic"), default="thread",
                   help="recorder on CPU: time compute ops by the thread's CPU time (default: ranks share cores, "
                        "like kernels share a GPU's time, and CUDA events time only the kernels) or wall time")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the whole job may take")
    p.add_argument("--stats-dir", metavar="DIR", help="each rank writes its step times here (benchmarks)")
    a = p.parse_args(argv)
    if a.pp < 2 or a.dp < 1 or a.steps < 1 or a.microbatches < 1 or a.layers < 1:
        p.error("need --pp >= 2, --dp >= 1, --steps >= 1, --microbatches >= 1, --layers >= 1")
    if a.slow_worker and not (a.slow_worker[0] < a.dp and a.slow_worker[1] < a.pp):
        p.error(f"--slow-worker {a.slow_worker[0]},{a.slow_worker[1]} is outside DP {a.dp} x PP {a.pp}")
    if a.long_sequences is not None and not 0 <= a.long_sequences < a.dp:
        p.error(f"--long-sequences {a.long_sequences} is not a DP rank (0..{a.dp - 1})")
    return a


def _cell(text: str) -> tuple[int, int]:
    try:
        d, p = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not DP,PP (two whole numbers)") from None
    if d < 0 or p < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: ranks are >= 0")
    return d, p


# ------------------------------------------------------------------ launcher


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start one worker process per rank, wait for all (bounded by --timeout); any failure stops the rest."""
    world = args.pp * args.dp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    deadline = time.monotonic() + args.timeout + 30
    failed: str | None = None
    while any(p.poll() is None for p in procs):
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad:
            failed = f"rank {bad[0][0]} exited with code {bad[0][1]}"
            break
        if time.monotonic() > deadline:
            failed = f"the job ran past --timeout {args.timeout:.0f} s"
            break
        time.sleep(0.1)
    else:
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        failed = f"rank {bad[0][0]} exited with code {bad[0][1]}" if bad else None
    if failed:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        print(f"pipeline_train: {failed}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ the model


def build_stage(args: argparse.Namespace, stage: int, torch: Any) -> Any:
    nn, F = torch.nn, torch.nn.functional
    first, last = stage == 0, stage == args.pp - 1

    class Block(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
            self.heads = max(1, h // 32)

        def forward(self, x: Any) -> Any:
            b, t, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
            return x + self.mlp(self.ln2(x))

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = args.hidden
            layers = args.layers * (4 if last and args.heavy_last_stage else 1)
            self.emb = nn.Embedding(args.vocab, h) if first else None
            self.pos = nn.Embedding(6 * args.seq_len + 1, h) if first else None
            self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
            self.head = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, args.vocab)) if last else None

        def forward(self, x: Any, labels: Any = None) -> Any:
            if self.emb is not None:
                x = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
            for blk in self.blocks:
                x = blk(x)
            if self.head is not None:
                return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
            return x

    return Stage()


def microbatch(args: argparse.Namespace, step: int, dp_rank: int, mb: int, torch: Any) -> tuple[Any, Any]:
    """Tokens and labels of one microbatch, the same on every stage (so a receiver knows the shapes).
    A learnable toy language: arithmetic sequences modulo the vocabulary."""
    rng = random.Random(hash((args.seed, step, dp_rank, mb)))
    length = args.seq_len
    if args.long_sequences == dp_rank and step >= args.fault_after:
        length = int(args.seq_len * rng.uniform(1.5, 6.0))
    start = torch.tensor([rng.randrange(args.vocab) for _ in range(args.mb_size)])
    stride = torch.tensor([rng.randrange(1, 8) for _ in range(args.mb_size)])
    seq = (start[:, None] + stride[:, None] * torch.arange(length + 1)[None, :]) % args.vocab
    return seq[:, :-1], seq[:, 1:]


# ------------------------------------------------------------------ one worker


class _NoRecorder:
    def op(self, optype: str, microbatch: int = -1) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step_end(self) -> None:
        pass

    def close(self) -> None:
        pass


class Worker:
    """One rank: its stage of the model, its ZeRO-1 shard, and the 1F1B schedule of a step."""

    def __init__(self, args: argparse.Namespace, rank: int, torch: Any, cuda: bool) -> None:
        import torch.distributed as dist

        self.args, self.rank, self.torch, self.dist = args, rank, torch, dist
        self.dev = torch.device("cuda" if cuda else "cpu")
        self.dp_rank, self.stage = rank // args.pp, rank % args.pp
        self.first, self.last = self.stage == 0, self.stage == args.pp - 1
        groups = [dist.new_group([d * args.pp + p for d in range(args.dp)]) for p in range(args.pp)]
        self.group = groups[self.stage]  # every rank creates every group, in the same order
        torch.manual_seed(args.seed * 1000 + self.stage)  # DP replicas of a stage start identical
        self.model = build_stage(args, self.stage, torch).to(self.dev)
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.shard = -(-self.numel // args.dp)
        self.flat = torch.zeros(self.shard * args.dp, device=self.dev)
        self.flat[:self.numel].copy_(torch.nn.utils.parameters_to_vector(self.params).detach())
        self.master = self.flat[self.dp_rank * self.shard:(self.dp_rank + 1) * self.shard].clone()
        self.momentum = torch.zeros_like(self.master)
        self.grad_shard = torch.empty(self.shard, device=self.dev)
        self.rec: Any = _NoRecorder()
        if args.trace_dir:
            self.rec = Recorder(args.trace_dir, dp_rank=self.dp_rank, pp_rank=self.stage, dp_size=args.dp,
                                pp_size=args.pp, rank=rank, every=args.record_every, window=args.record_window,
                                start=args.record_start, device="cuda" if cuda else "cpu",
                                name=Path(args.trace_dir).name, cpu_compute_clock=args.compute_clock)
        self.slow = args.slow_worker == (self.dp_rank, self.stage)
        self.rng = random.Random(args.seed * 7919 + rank)
        # A heap a full collection must walk (~50-100 ms per collection on one core); made after gc.freeze().
        self.junk: list[list[int]] | None = None
        self.loss_sum: Any = torch.zeros((), device=self.dev)  # on the device: no sync per microbatch
        self.loss_n = 0
        self.step = 0
        self.faulty = False
        self.gc_at = -1
        self.inputs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.grads: dict[int, Any] = {}

    # --- the ops of a step

    def data(self, mb: int) -> tuple[Any, Any]:
        tokens, labels = microbatch(self.args, self.step, self.dp_rank, mb, self.torch)
        return tokens.to(self.dev), labels.to(self.dev)

    def extra_work(self, x: Any, labels: Any, times: int) -> None:
        """The slowed worker's fixed extra compute: more forward passes of its own stage."""
        with self.torch.no_grad():
            for _ in range(times):
                self.model(x, labels)

    def forward(self, mb: int) -> None:
        tokens, labels = self.data(mb)
        if mb == self.gc_at:
            gc.collect()  # an unsynchronised full collection; the recorder's gc hook records it
        x = tokens if self.first else self.inputs[mb].requires_grad_(True)
        with self.rec.op("forward-compute", mb):
            out = self.model(x, labels if self.last else None)
            if self.slow and self.faulty:
                self.extra_work(x, labels if self.last else None, round(self.args.slow_factor))
        self.outputs[mb] = out
        if self.last:
            self.loss_sum, self.loss_n = self.loss_sum + out.detach(), self.loss_n + 1

    def backward(self, mb: int) -> None:
        with self.rec.op("backward-compute", mb):
            out = self.outputs.pop(mb)
            if self.last:
                out.backward()
            else:
                out.backward(self.grads.pop(mb))
            if self.slow and self.faulty:
                tokens, labels = self.data(mb)
                x = tokens if self.first else self.inputs[mb].detach()
                self.extra_work(x, labels if self.last else None, round(2 * self.args.slow_factor))

    def act_shape(self, mb: int) -> tuple[int, int, int]:
        tokens, _ = microbatch(self.args, self.step, self.dp_rank, mb, self.torch)
        return self.args.mb_size, tokens.shape[1], self.args.hidden

    def recv_forward(self, mb: int) -> list[tuple[str, Any, int]]:
        self.inputs[mb] = self.torch.empty(self.act_shape(mb), device=self.dev)
        return [("forward-recv", self.inputs[mb], self.rank - 1)]

    def send_forward(self, mb: int) -> list[tuple[str, Any, int]]:
        return [("forward-send", self.outputs[mb].detach(), self.rank + 1)]

    def recv_backward(self, mb: int) -> list[tuple[str, Any, int]]:
        self.grads[mb] = self.torch.empty(self.act_shape(mb), device=self.dev)
        return [("backward-recv", self.grads[mb], self.rank + 1)]

    def send_backward(self, mb: int) -> list[tuple[str, Any, int]]:
        return [("backward-send", self.inputs.pop(mb).grad, self.rank - 1)]

    def p2p(self, ops: list[tuple[str, Any, int]]) -> None:
        """One batched P2P call, recorded as one op per transfer (Megatron's send_forward_recv_backward)."""
        dist = self.dist
        with contextlib.ExitStack() as stack:
            for name, _, _ in ops:
                stack.enter_context(self.rec.op(name))
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend if name.endswith("send") else dist.irecv, t, peer)
                                           for name, t, peer in ops])
            for r in reqs:
                r.wait()

    def run_step(self, step: int) -> None:
        args, dist, torch = self.args, self.dist, self.torch
        self.step, self.faulty = step, step >= args.fault_after
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        with self.rec.op("params-all-gather"):
            gather(self.flat, self.master, group=self.group)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(self.flat[:self.numel], self.params)
        for p in self.params:
            p.grad = None
        gc_now = self.junk is not None and self.faulty and self.rng.random() < 0.5
        self.gc_at = self.rng.randrange(args.microbatches) if gc_now else -1
        self.one_f_one_b()

        # ZeRO-1 data parallelism: reduce-scatter the gradients, clip on the global norm, step the shard.
        flat_grad = torch.zeros(self.shard * args.dp, device=self.dev)
        flat_grad[:self.numel] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                            for p in self.params])
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        with self.rec.op("grads-reduce-scatter"):
            scatter(self.grad_shard, flat_grad, group=self.group)
        self.grad_shard /= args.dp * args.microbatches
        with self.rec.op("optimizer-clip-main-grad"):
            norm2 = (self.grad_shard * self.grad_shard).sum().reshape(1)
            dist.all_reduce(norm2)
        with self.rec.op("optimizer"), torch.no_grad():
            scale = min(1.0, 1.0 / (float(norm2.sqrt()) + 1e-6))
            self.momentum.mul_(0.9).add_(self.grad_shard, alpha=scale)
            self.master.add_(self.momentum, alpha=-0.05)
        self.rec.step_end()

    def one_f_one_b(self) -> None:
        """Megatron-LM's non-interleaved schedule: warm-up forwards, steady 1F1B, cool-down backwards."""
        m, first, last = self.args.microbatches, self.first, self.last
        warmup = min(self.args.pp - self.stage - 1, m)
        fwd = bwd = 0
        for _ in range(warmup):
            if not first:
                self.p2p(self.recv_forward(fwd))
            self.forward(fwd)
            if not last:
                self.p2p(self.send_forward(fwd))
            fwd += 1
        remaining = m - warmup
        if remaining and not first:
            self.p2p(self.recv_forward(fwd))
        for i in range(remaining):
            self.forward(fwd)
            if not last:
                self.p2p(self.send_forward(fwd) + self.recv_backward(bwd))
            fwd += 1
            self.backward(bwd)
            if i == remaining - 1:
                if not first:
                    self.p2p(self.send_backward(bwd))
            elif not first:
                self.p2p(self.send_backward(bwd) + self.recv_forward(fwd))
            bwd += 1
        for _ in range(warmup):
            if not last:
                self.p2p(self.recv_backward(bwd))
            self.backward(bwd)
            if not first:
                self.p2p(self.send_backward(bwd))
            bwd += 1
        self.outputs.clear()


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.pp * args.dp:
        raise SystemExit(f"pipeline_train: WORLD_SIZE {world} != --pp {args.pp} x --dp {args.dp}")
    torch.set_num_threads(1)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    w = Worker(args, rank, torch, cuda)
    # As production jobs do: what setup allocated (torch's modules, the model) is never garbage, so full
    # collections should not walk it. Left out, a healthy job pauses for tens of ms at random moments.
    gc.freeze()
    if args.gc_pauses:
        w.junk = [[i] for i in range(2_000_000)]
    step_times: list[float] = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        w.run_step(step)
        step_times.append(time.perf_counter() - t0)
    w.rec.close()
    dist.barrier()
    if args.stats_dir:
        Path(args.stats_dir).mkdir(parents=True, exist_ok=True)
        rec = w.rec
        sampled = [isinstance(rec, Recorder) and rec.enabled and rec.is_sampled(s) for s in range(args.steps)]
        Path(args.stats_dir, f"rank{rank}.json").write_text(json.dumps({"step_times": step_times,
                                                                        "sampled": sampled}))
    if w.last and w.dp_rank == 0:
        print(f"pipeline_train: {args.steps} steps, mean step {1e3 * sum(step_times) / len(step_times):.1f} ms, "
              f"mean loss {float(w.loss_sum) / max(w.loss_n, 1):.3f}"
              + (f", trace {args.trace_dir}" if args.trace_dir else ""), flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
