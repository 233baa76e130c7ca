"""What every benchmark shares: the machine's name, timing, peak memory, JSON-line records and the inputs of the
shapes that several benchmarks time. Speed targets and their ratios live in the benchmarks; this file only
measures."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

# OTB advantage shapes (B rows, T positions, N per group), shared by the CPU (run.py) and CUDA (gpu.py) benchmarks.
OTB_SHAPES = [(2048, 4096, 8), (16384, 512, 4)]
OTB_SHAPES_QUICK = [(64, 128, 8), (256, 32, 4)]


def machine(device: torch.device | None = None) -> str:
    """The GPU's name, or ``"cpu x<threads> threads (<cores> cores visible)"``: every record names its machine."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu x{torch.get_num_threads()} threads ({os.cpu_count()} cores visible)"


def provenance() -> dict:
    """``{"date", "commit", "clean", "command"}`` of this run: the UTC date, the code's commit (``OTB_REF_COMMIT`` where
    the tree travelled without its ``.git``, as on a lent GPU machine; else ``git rev-parse HEAD``), whether ``git
    status --porcelain`` was empty (None when unknown), and the command line."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = os.environ.get("OTB_REF_COMMIT") or git("rev-parse", "HEAD")
    status = None if os.environ.get("OTB_REF_COMMIT") else git("status", "--porcelain")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit,
        "clean": None if status is None else status == "",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def emit(record: dict, out=None) -> None:
    """One JSON line on stdout (flushed), and into the open file ``out`` when given."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def sync(device: torch.device) -> float:
    """Wait for the device; return the wall clock."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls after one warm-up, the device synchronised around each."""
    return timed(fn, device, repeats)[0]


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, int | None, object]:
    """``(median seconds, peak CUDA bytes beyond what was allocated before or None on CPU, last result)`` of
    ``repeats`` calls after one warm-up."""
    result = fn()  # warm-up
    sync(device)
    reset_peak(device)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(sync(device) - start)
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    return statistics.median(times), peak, result


def paired_ratios(
    fn_a: Callable[[], object], fn_b: Callable[[], object], device: torch.device, pairs: int
) -> list[float]:
    """``b / a`` wall-clock ratios of ``pairs`` back-to-back calls (a then b, the device synchronised around each),
    after one warm-up of each: a drift of the machine over the run moves both calls of a pair alike."""
    fn_a(), fn_b()
    ratios = []
    for _ in range(pairs):
        start = sync(device)
        fn_a()
        middle = sync(device)
        fn_b()
        ratios.append((sync(device) - middle) / (middle - start))
    return ratios


def device_busy_seconds(fn: Callable[[], object], device: torch.device) -> float | None:
    """Seconds the GPU spent running kernels during one call of ``fn`` (after a warm-up): the profiler's device
    time summed over every kernel. Beside the wall clock it shows a host-bound pass (wall much larger than busy).
    None on CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA; nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    """Peak device memory since the last :func:`reset_peak`, GiB (None on CPU)."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def time_cuda(fn: Callable[[], object], repeats: int) -> dict:
    """First call (wall clock, compilation included), then the median of ``repeats`` calls timed with CUDA events."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    fn()  # a second warm-up: allocator and autotuning caches settled
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "first_call_ms": first_ms, "repeats": repeats}


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak allocated CUDA memory during ``fn()`` beyond what was allocated before it (the inputs)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def naive_logprobs_and_sum_pi_squared(hidden, weight, targets):
    """The usual path the chunked proxy is timed against: the whole [N, V] logits, log-softmax and softmax²."""
    logits = (hidden @ weight.T).float()  # [N, V]
    log_softmax = logits.log_softmax(-1)  # [N, V]
    log_probs = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    sum_pi_squared = log_softmax.detach().exp().square().sum(-1)
    return log_probs, sum_pi_squared


def otb_inputs(batch: int, length: int, group_size: int, device):
    """Outcome rewards on the last token, random lengths, and log π / Σπ² consistent with each other:
    ``(rewards, mask, index, log_probs, sum_pi_squared)`` for ``compute_advantages``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = torch.randint(0, 2, (batch,), generator=g).float()
    probs = torch.rand(batch, length, generator=g).clamp(min=1e-3)
    sum_pi_squared = (probs.square() + (1 - probs).square() / 4).clamp(max=1.0)  # consistent with π_y = probs
    index = [row // group_size for row in range(batch)]
    to = lambda x: x.to(device)  # noqa: E731
    return to(rewards), to(mask), index, to(probs.log()), to(sum_pi_squared)
