"""Failed jobs the second held-out set found misjudged (issue 28), each from real lines with their public source:
fp16 loss-scale collapse, GPU faults the job echoes, NCCL NVLS failures, rendezvous connect timeouts, hangs
(infra likely unless the job's own code raised), a DataLoader FileNotFoundError before torchrun's SIGTERMs, and
a SIGKILL with nothing in the logs."""

from __future__ import annotations

from robustd.triage import LogText, Triage, to_json, triage


def judge(*lines: str, exit_code: int | None = 1, signal: str | None = None, name: str = "job.out") -> Triage:
    return triage([LogText(name=name, data=("\n".join(lines) + "\n").encode())], exit_code=exit_code, signal=signal)


def test_an_apex_loss_scale_that_collapsed_below_one_is_nan() -> None:
    # https://github.com/NVIDIA/apex/issues/318: the scale halved on every step, down to 1e-202
    scale = 1.0
    lines = []
    for _ in range(12):
        scale /= 2
        lines.append(f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {scale}")
    lines += ["Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 8.165126103939127e-202",
              "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 4.082563051969564e-202"]
    t = judge("Epoch 1/90", *lines)
    assert (t.klass, t.next) == ("nan", "diagnose"), to_json(t)
    assert "loss scale collapsed" in t.reason and "reducing loss scale to 0.5" in t.evidence[0].text
    # https://github.com/kenziyuliu/MS-G3D/issues/9 and LEEYOONHYUNG/BVAE-TTS#3: the scaler finding its level is benign
    t = judge("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 131072.0",
              "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0",
              "[2024-05-01 12:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 "
              "Skipping step. Attempted loss scale: 65536, reducing to 32768")
    assert t.klass == "unknown" and "no failure line" in t.reason


def test_deepspeed_at_its_minimum_loss_scale_is_nan() -> None:
    # DeepSpeed's loss_scaler.py at min_loss_scale 1 (the state before ymcui/Chinese-LLaMA-Alpaca#534's exit), every step  # noqa: E501 - a real log line, kept whole
    t = judge("[2024-05-01 12:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "  # noqa: E501 - a real log line, kept whole
              "step. Attempted loss scale: 1, reducing to 1",
              "[2024-05-01 12:00:01,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "  # noqa: E501 - a real log line, kept whole
              "step. Attempted loss scale: 1, reducing to 1")
    assert t.klass == "nan", to_json(t)


def test_nvlink5_xids_echoed_by_the_job_are_gpu_hw() -> None:
    # https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1150: the Xid 45s that name an earlier NVLink5 Xid
    t = judge("kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",  # noqa: E501 - a real log line, kept whole
              "kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, Ch 0000000c caused by previous Xid 145",  # noqa: E501 - a real log line, kept whole
              "[rank0]: RuntimeError: NCCL communicator was aborted on rank 0.")
    assert (t.klass, t.infra) == ("gpu_hw", "likely"), to_json(t)
    # https://github.com/leptonai/gpud/pull/1160: the Xid as a health agent echoes it into the job's output
    assert judge("XID 149.38 (err status 0x00000000) NVLINK_NETIR_ERROR detected on GPU PCI:0000:00:00").klass == "gpu_hw"  # noqa: E501 - a real log line, kept whole


def test_a_contained_nvlink_hardware_error_is_gpu_hw() -> None:
    # https://github.com/marin-community/marin/issues/8934: CUDA_ERROR_CONTAINED on a GB200 NVL72 domain
    t = judge("2026-09-05 17:34:36.549 E external/xla/xla/stream_executor/gpu/gpu_cudamallocasync_allocator.cc:414] "
              "CUDA_ERROR_CONTAINED: Invalid access of peer GPU memory over nvlink or a hardware error")
    assert (t.klass, t.infra, t.level) == ("gpu_hw", "likely", "eud"), to_json(t)


def test_nvls_invalid_argument_is_nccl_not_a_cuda_fault() -> None:
    # https://github.com/vllm-project/vllm/issues/6732: every rank's NVLS setup fails, then PyTorch's "unhandled cuda error"  # noqa: E501 - a real log line, kept whole
    host = "h100-kickoff-llama-70b-chat-20230328-bcf75c4f6-gn6nd"
    t = judge(f"{host}:843:843 [5] transport/nvls.cc:157 NCCL WARN Cuda failure 1 'invalid argument'",
              f"{host}:774:774 [0] NCCL INFO transport/nvls.cc:328 -> 1",
              f"{host}:842:842 [4] transport/nvls.cc:157 NCCL WARN Cuda failure 1 'invalid argument'",
              "[rank0]: RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)")
    assert (t.klass, t.infra, t.next) == ("nccl", "likely", "diagnose"), to_json(t)
    assert "nvls.cc:157" in t.evidence[0].text


def test_a_rendezvous_connect_timeout_is_the_launcher_with_infra_possible() -> None:
    # https://github.com/intel/torch-xpu-ops/issues/2119 (torch 2.x) and pytorch/pytorch#67547 (torch 1.10)
    new = ["Traceback (most recent call last):",
           '  File "/usr/lib/python3.10/site-packages/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", '  # noqa: E501 - a real log line, kept whole
           "line 156, in _create_tcp_store", "    store = TCPStore(",
           "torch.distributed.DistNetworkError: The client socket has timed out after 10000ms while trying to connect "
           "to (localhost, 44557).", "",
           "The above exception was the direct cause of the following exception:", "",
           "Traceback (most recent call last):", '  File "/usr/bin/torchrun", line 8, in <module>',
           "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has "
           "failed. See inner exception for details."]
    old = ["Traceback (most recent call last):",
           '  File "/root/anaconda3/lib/python3.8/site-packages/torch/distributed/elastic/rendezvous/'
           'c10d_rendezvous_backend.py", line 155, in _create_tcp_store', "    store = TCPStore(",
           "RuntimeError: connect() timed out. Original timeout was 60000 ms."]
    for lines in (new, old, new[3:4]):
        t = judge(*lines)
        assert (t.klass, t.infra, t.next) == ("launcher", "unknown", "restart"), (lines[-1], to_json(t))


WATCHDOG = ("[rank{r}]:[E1015 10:42:25.158963427 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=8, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran "
            "for 600018 milliseconds before timing out.")


def test_a_hang_is_infra_likely_unless_the_jobs_code_raised() -> None:
    t = judge(*[WATCHDOG.format(r=r) for r in range(4)])
    assert (t.klass, t.infra) == ("hang", "likely"), to_json(t)
    # the same timeouts, and a rank's own exception whose traceback is not in the logs: maybe the job's doing
    t = judge(*[WATCHDOG.format(r=r) for r in range(4)], "[rank2]: ValueError: too many values to unpack (expected 2)")
    assert (t.klass, t.infra) == ("hang", "unknown"), to_json(t)
    assert "user-side cause" in t.reason and "ValueError" in t.reason


def test_a_dataloader_file_not_found_before_torchruns_sigterms_is_the_root() -> None:
    # https://github.com/mila-iqia/milabench/pull/367: rank 0's DataLoader worker fails, torchrun SIGTERMs the others,
    # who print far more than the "handled exception" bound before the job ends
    lines = ["Traceback (most recent call last):", '  File "/milabench/benchmarks/torchvision/main.py", line 210, in <module>',  # noqa: E501 - a real log line, kept whole
             "    for inp, target in loader:",
             "FileNotFoundError: Caught FileNotFoundError in DataLoader worker process 2.",
             "Original Traceback (most recent call last):",
             '  File "/milabench/envs/venv/torch/lib/python3.12/site-packages/torch/utils/data/_utils/worker.py", line 349, '  # noqa: E501 - a real log line, kept whole
             "in _worker_loop", "    data = fetcher.fetch(index)  # type: ignore[possibly-undefined]",
             "FileNotFoundError: [Errno 2] No such file or directory: '/data/imagenet/train/n01440764/n01440764_10026.JPEG'"]  # noqa: E501 - a real log line, kept whole
    lines += [f"W0909 21:54:55.983000 41207 torch/distributed/elastic/multiprocessing/api.py:900] Sending process {p} "
              "closing signal SIGTERM" for p in range(41240, 41247)]
    lines += [f"rank {r % 7 + 1}: shutting down, step {r}" for r in range(300)]
    lines += ["E0909 21:54:56.212000 41207 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) "
              "local_rank: 0 (pid: 41239) of binary: /milabench/envs/venv/torch/bin/python"]
    t = judge(*lines)
    assert (t.klass, t.next) == ("user_code", "rollback"), to_json(t)
    assert "Caught FileNotFoundError" in t.evidence[0].text


def test_a_bare_sigkill_is_taken_for_the_oom_killer_and_says_so() -> None:
    for kw in ({"exit_code": 137}, {"exit_code": None, "signal": "SIGKILL"}):
        t = judge("step 1200 loss 2.31", "step 1210 loss 2.30", **kw)
        assert (t.klass, t.infra, t.next) == ("oom_host", "unknown", "rollback"), to_json(t)
        assert "OOM killer" in t.reason and "infra unknown" in t.reason
    assert judge("step 1200 loss 2.31", exit_code=None, signal="SIGTERM").klass == "unknown"  # stopped from outside
