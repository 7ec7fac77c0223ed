"""MiniGPT bitwise replay: the same tiny GPT trained the same K steps on every GPU must agree bit for bit.

    python -m stoptests.minigpt --spec SPEC.json

The launcher (this module without ``--worker-rank``) never imports torch. It starts one worker
process per GPU (``spec.gpus[i]``, pinned with ``CUDA_VISIBLE_DEVICES``) or per ``spec.cpu_ranks``
on a host without GPUs (each worker pinned to one CPU thread; at most as many workers at once as
CPU cores). Each worker builds the model from a fixed seed on the CPU, moves it to its device,
trains ``spec.steps`` steps of AdamW on a fixed token batch under deterministic settings, and
prints one JSON line: the SHA-256 digest over the exact bytes of the float32 loss trajectory and
of the final parameters (in ``named_parameters`` order, each preceded by its name, dtype and shape).

Verdicts (see PROTOCOL.md): every rank agrees -> PASS for all; a strict majority with odd ones
out -> FAIL for the odd ones out; no strict majority -> FAIL for every rank. A rank whose loss is
NaN/inf, whose worker crashed while others produced a digest, or which ran far longer than the
slowest rank that finished (hung) -> FAIL for that rank. A rank the deadline stopped without such
evidence (never started, or still in its turn) is SKIPPED, and when no rank produced a digest at all
the test could not run (exit 2: the daemon records an ERROR with the reason), never a FAIL.
A ``host`` result carries the node digest (the majority digest); the daemon compares it with the
golden digest recorded for this (device, driver, torch) after the run (robustd/diagnostics/golden.py),
the one place that judges it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any

TEST = "minigpt"
DIGEST_VERSION = b"robustd-minigpt-v1"
DEFAULT_STEPS = 20
DEFAULT_CPU_RANKS = 4
DEFAULT_TIMEOUT = 300.0
MAX_STEPS = 100_000
HUNG_FACTOR = 2.0  # a rank still running after this many times the slowest finished rank's wall time hung

# The model and the data: changing any of these changes every digest (and invalidates goldens).
VOCAB = 256
BLOCK = 64  # sequence length
WIDTH = 96
HEADS = 4
LAYERS = 3
BATCH = 8
LR = 3e-3
WEIGHT_DECAY = 0.01
WEIGHT_SEED = 20240607
DATA_SEED = 1234
MODEL_ID = (f"{DIGEST_VERSION.decode()} layers={LAYERS} width={WIDTH} heads={HEADS} block={BLOCK} "
            f"vocab={VOCAB} batch={BATCH} adamw lr={LR} wd={WEIGHT_DECAY}")


# --------------------------------------------------------------------------------------------------
# pure helpers (no torch)

def rank_components(spec: dict[str, Any]) -> list[str]:
    """The component of every rank: ``gpu/<bus_id>`` of ``spec.gpus[i]``, else ``rank/<i>`` for ``cpu_ranks``."""
    from stoptests.protocol import rank_component

    gpus = spec.get("gpus") or []
    n = len(gpus) if gpus else int(spec.get("cpu_ranks") or DEFAULT_CPU_RANKS)
    return [rank_component(spec, i) for i in range(n)]


def check_spec(spec: dict[str, Any]) -> tuple[int, float]:
    """(steps, timeout) of the spec; raise SpecError for values this launcher would size things by
    (ranks, steps, timeout) and for malformed faults."""
    from stoptests.protocol import MAX_LOCAL_RANKS, bounded_int, spec_faults, spec_gpus, spec_timeout

    spec_gpus(spec)
    bounded_int(spec.get("cpu_ranks") or None, "cpu_ranks", DEFAULT_CPU_RANKS, 1, MAX_LOCAL_RANKS)
    steps = bounded_int(spec.get("steps") or None, "steps", DEFAULT_STEPS, 1, MAX_STEPS)
    timeout = spec_timeout(spec, DEFAULT_TIMEOUT)
    spec_faults(spec)
    return steps, timeout


def majority(digests: list[str]) -> tuple[str | None, int]:
    """The digest held by a strict majority of ``digests`` and how many hold it; (None, top count) if none."""
    if not digests:
        return None, 0
    digest, count = Counter(digests).most_common(1)[0]
    return (digest, count) if 2 * count > len(digests) else (None, count)


@dataclass
class RankOutcome:
    rank: int
    component: str
    digest: str | None = None  # None: the worker produced no digest (crash, hang, not started)
    finite: bool = True
    final_loss: float | None = None
    duration_s: float | None = None
    error: str | None = None  # why there is no usable digest: evidence against this rank (FAIL)
    skipped: str | None = None  # why this rank was not judged (the deadline came first, no evidence)
    extra: dict[str, Any] = field(default_factory=dict)


def judge(outcomes: list[RankOutcome], noun: str, host_details: dict[str, Any],
          duration_s: float) -> list[dict[str, Any]]:
    """Turn per-rank outcomes into protocol results (one per rank, then ``host``)."""
    voters = [o for o in outcomes if o.digest is not None and o.finite and o.error is None]
    node_digest, count = majority([o.digest for o in voters])  # type: ignore[misc]
    results: list[dict[str, Any]] = []
    for o in outcomes:
        figures: dict[str, float] = {}
        if o.duration_s is not None:
            figures["duration_s"] = round(o.duration_s, 3)
        if o.final_loss is not None and math.isfinite(o.final_loss):
            figures["final_loss"] = o.final_loss
        details: dict[str, Any] = {"digest": o.digest, **o.extra}
        if o.skipped is not None:
            status, message = "SKIPPED", o.skipped
        elif o.error is not None:
            status, message = "FAIL", o.error
        elif not o.finite:
            status, message = "FAIL", f"non-finite loss (final loss {o.final_loss})"
        elif node_digest is None:
            status = "FAIL"
            message = (f"no majority digest: {len(set(v.digest for v in voters))} different digests "
                       f"across {len(voters)} {noun}s (largest group {count})")
        elif o.digest == node_digest:
            status = "PASS"
            message = (f"bitwise identical across all {len(voters)} {noun}s" if count == len(voters)
                       else f"matches the majority digest ({count} of {len(voters)} {noun}s)")
        else:
            status = "FAIL"
            message = f"bitwise mismatch against the other {count} {noun}s"
            details["majority_digest"] = node_digest
        results.append({"component": o.component, "status": status, "message": message,
                        "figures": figures, "details": details})

    host_figures: dict[str, float] = {"duration_s": round(duration_s, 3)}
    agreeing = [o for o in voters if o.digest == node_digest]
    if agreeing and agreeing[0].final_loss is not None:
        host_figures["final_loss"] = agreeing[0].final_loss
    details = {"node_digest": node_digest, **host_details,
               "ranks": len(outcomes), "agreeing": len(agreeing)}
    if node_digest is None:
        status, message = "FAIL", (f"no majority digest across {len(outcomes)} {noun}s"
                                   if voters else f"no {noun} produced a usable digest")
    else:
        status, message = "PASS", "node digest computed"
    results.append({"component": "host", "status": status, "message": message,
                    "figures": host_figures, "details": details})
    return results


# --------------------------------------------------------------------------------------------------
# worker (imports torch)

def _tensor_bytes(t: Any) -> bytes:
    import ctypes

    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def build_model(torch: Any) -> Any:
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(WIDTH)
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)
            self.ln2 = nn.LayerNorm(WIDTH)
            self.fc = nn.Linear(WIDTH, 4 * WIDTH)
            self.out = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x: Any, mask: Any) -> Any:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
            q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            # Explicit attention (no fused SDPA kernels, whose backward may be nondeterministic).
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // HEADS))
            att = F.softmax(att.masked_fill(mask[:t, :t], float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class MiniGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.02)
            self.pos = nn.Parameter(torch.randn(BLOCK, WIDTH) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.register_buffer("mask", torch.ones(BLOCK, BLOCK, dtype=torch.bool).triu(1), persistent=False)

        def forward(self, idx: Any, targets: Any) -> Any:
            # One-hot matmuls instead of embedding / nll_loss: their CUDA backward kernels use atomics.
            x = F.one_hot(idx, VOCAB).to(self.tok.dtype) @ self.tok + self.pos[: idx.shape[1]]
            for block in self.blocks:
                x = block(x, self.mask)
            logp = F.log_softmax(self.head(self.ln_f(x)), dim=-1)
            return -(logp * F.one_hot(targets, VOCAB).to(logp.dtype)).sum(-1).mean()

    return MiniGPT()


def replay(steps: int, device: str = "cpu", perturb_ulp: bool = False) -> dict[str, Any]:
    """Train the MiniGPT ``steps`` steps on ``device``; returns the digest and figures."""
    import hashlib
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

    # torch.use_deterministic_algorithms() also imports torch._inductor to set its config (~2 s per
    # worker); this model never compiles, so set only the ATen flag when the private setter exists.
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is not None:
        setter(True, warn_only=False)
    else:
        torch.use_deterministic_algorithms(True)
    if not torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("could not enable deterministic algorithms")
    if device.startswith("cuda"):
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(WEIGHT_SEED)
    model = build_model(torch)  # initialised on the CPU: identical starting weights on every device
    if perturb_ulp:  # test-only fault: move one weight by one ulp
        with torch.no_grad():
            flat = model.tok.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf))
    gen = torch.Generator().manual_seed(DATA_SEED)
    data = torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=gen)
    model = model.to(device)
    idx, targets = data[:, :-1].to(device), data[:, 1:].to(device)
    # AdamW written out: torch.optim's Optimizer imports torch._dynamo (~2 s per worker) and its
    # kernels may change between releases; these few elementwise ops are deterministic everywhere.
    params = list(model.parameters())
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8

    t0 = time.monotonic()
    losses = []
    for step in range(1, steps + 1):
        for p in params:
            p.grad = None
        loss = model(idx, targets)
        loss.backward()
        with torch.no_grad():
            bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
            for p, m, v in zip(params, exp_avg, exp_avg_sq, strict=True):
                p.mul_(1.0 - LR * WEIGHT_DECAY)
                m.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-LR / bc1)
        losses.append(loss.detach())
    trajectory = torch.stack(losses).to(torch.float32).cpu()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    duration = time.monotonic() - t0

    h = hashlib.sha256(DIGEST_VERSION)
    h.update(b"losses" + str(tuple(trajectory.shape)).encode())
    h.update(_tensor_bytes(trajectory))
    for name, p in model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(_tensor_bytes(p))
    final = float(trajectory[-1]) if steps else float("nan")
    return {"digest": h.hexdigest(), "finite": bool(torch.isfinite(trajectory).all()),
            "final_loss": final, "first_loss": float(trajectory[0]) if steps else float("nan"),
            "duration_s": duration, "torch_version": torch.__version__, "device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}


def worker_main(spec: dict[str, Any], rank: int) -> int:
    faults = spec.get("faults") or {}
    perturb = (faults.get("perturb_ulp") or {}).get("rank")
    device = "cuda:0" if spec.get("gpus") else "cpu"  # the launcher pins one GPU per worker
    if device == "cpu":
        import warnings

        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
    out = replay(int(spec.get("steps") or DEFAULT_STEPS), device, perturb_ulp=perturb is not None
                 and int(perturb) == rank)
    print("MINIGPT " + json.dumps({"rank": rank, **out}), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# launcher (no torch)

@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]
    started: float


def _worker_env(spec: dict[str, Any], rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["PYTHONHASHSEED"] = "0"
    gpus = spec.get("gpus") or []
    if gpus:
        gpu = gpus[rank]
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # NVML and CUDA agree on indices in bus order
        uuid = str(gpu.get("uuid") or "")
        env["CUDA_VISIBLE_DEVICES"] = uuid if uuid.startswith(("GPU-", "MIG-")) else str(gpu.get("index", rank))
    else:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _tail(f: IO[bytes], limit: int = 2000) -> str:
    f.seek(0)
    data = f.read().decode(errors="replace").strip()
    return data[-limit:]


def _collect(w: _Worker, out: RankOutcome) -> None:
    w.stdout.seek(0)
    report = None
    for line in w.stdout.read().decode(errors="replace").splitlines():
        if line.startswith("MINIGPT "):
            report = json.loads(line[len("MINIGPT "):])
    if w.proc.returncode != 0 or report is None:
        lines = _tail(w.stderr).splitlines()
        out.error = f"replay worker failed (exit {w.proc.returncode}): {lines[-1][:500] if lines else 'no output'}"
        out.extra["stderr"] = _tail(w.stderr)
        return
    out.digest = report["digest"]
    out.finite = bool(report["finite"])
    out.final_loss = report["final_loss"]
    out.duration_s = report["duration_s"]
    out.extra.update(torch_version=report["torch_version"], device_name=report["device_name"],
                     first_loss=report["first_loss"])


def launch(spec: dict[str, Any], spec_path: str, steps: int, timeout: float) -> list[RankOutcome]:
    """Run one worker per rank (all GPUs at once; at most one CPU rank per core) until done or the deadline.

    `steps` and `timeout` are the spec's, as `check_spec` returns them."""
    from stoptests.protocol import emit_progress

    components = rank_components(spec)
    n = len(components)
    gpus = spec.get("gpus") or []
    parallel = n if gpus else max(1, min(n, os.cpu_count() or 1))
    deadline = time.monotonic() + max(1.0, timeout - min(10.0, 0.1 * timeout))  # leave time to report
    outcomes = [RankOutcome(rank=i, component=c) for i, c in enumerate(components)]
    pending = list(range(n))
    running: dict[int, _Worker] = {}
    finished = 0
    walls: list[float] = []  # wall times (start to exit) of the workers that produced a digest
    emit_progress(0.0, f"replaying {steps} steps on {n} "
                       f"{'GPU' if gpus else 'CPU rank'}s ({parallel} at a time)")
    with contextlib.ExitStack() as files:
        try:
            while pending or running:
                while pending and len(running) < parallel and time.monotonic() < deadline:
                    rank = pending.pop(0)
                    out_f = files.enter_context(tempfile.TemporaryFile())
                    err_f = files.enter_context(tempfile.TemporaryFile())
                    # Run this file as a script: the worker needs only torch, not the `checks` package.
                    cmd = [sys.executable, os.path.abspath(__file__), "--spec", spec_path, "--worker-rank", str(rank)]
                    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                                            env=_worker_env(spec, rank))
                    running[rank] = _Worker(rank, proc, out_f, err_f, time.monotonic())
                for rank, w in list(running.items()):
                    if w.proc.poll() is None:
                        continue
                    del running[rank]
                    _collect(w, outcomes[rank])
                    if outcomes[rank].digest is not None:
                        walls.append(time.monotonic() - w.started)
                    finished += 1
                    emit_progress(95.0 * finished / n, f"{components[rank]} finished ({finished}/{n})")
                if time.monotonic() >= deadline:
                    slowest = max(walls, default=None)
                    for rank, w in running.items():
                        w.proc.kill()
                        w.proc.wait()
                        ran = time.monotonic() - w.started
                        if slowest is not None and ran > HUNG_FACTOR * slowest:
                            # Evidence: the same replay finished elsewhere in a fraction of this time.
                            outcomes[rank].error = (f"replay hung: not finished after {ran:.1f}s while the "
                                                    f"slowest other rank took {slowest:.1f}s")
                        else:
                            outcomes[rank].skipped = (f"replay did not finish within the {timeout:g}s timeout "
                                                      f"(ran {ran:.1f}s" + (f"; the slowest other rank took "
                                                                             f"{slowest:.1f}s)" if slowest else ")"))
                        outcomes[rank].extra["stderr"] = _tail(w.stderr)
                    running.clear()
                    for rank in pending:
                        outcomes[rank].skipped = "replay not started: the test ran out of time"
                    pending.clear()
                    break
                time.sleep(0.02)
        finally:
            for w in running.values():  # only on an exception: never leave workers behind
                w.proc.kill()
                w.proc.wait()
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoptests.minigpt", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the SPEC.json written by the daemon")
    parser.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_rank is not None:  # a worker: run as a plain script, stdlib and torch only
        with open(args.spec, encoding="utf-8") as f:
            return worker_main(json.load(f), args.worker_rank)

    from stoptests.protocol import SpecError, cannot_run, emit_progress, emit_result, load_spec

    try:
        spec = load_spec(["--spec", args.spec])
        steps, timeout = check_spec(spec)
    except SpecError as e:
        return cannot_run(f"bad spec: {e}")

    t0 = time.monotonic()
    outcomes = launch(spec, os.path.abspath(args.spec), steps, timeout)
    if not any(o.digest is not None for o in outcomes):
        # No digest to compare (every worker crashed: no torch, no CUDA...; or none finished in time):
        # the test itself could not run, whatever the reason, and nothing is known about any device.
        return cannot_run("no rank produced a digest: " + "; ".join(
            f"{o.component}: {(o.error or o.skipped or 'no result').splitlines()[0][:300]}" for o in outcomes))
    gpus = spec.get("gpus") or []
    noun = "GPU" if gpus else "rank"
    versions = sorted({o.extra["torch_version"] for o in outcomes if "torch_version" in o.extra})
    host_details = {"torch_version": versions[0] if len(versions) == 1 else ",".join(versions) or None,
                    "device": (gpus[0].get("name") or "unknown GPU") if gpus else "cpu",
                    "steps": steps, "model": MODEL_ID}
    for r in judge(outcomes, noun, host_details, time.monotonic() - t0):
        emit_result(r["component"], r["status"], r["message"], r["figures"], r["details"])
    emit_progress(100.0, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
