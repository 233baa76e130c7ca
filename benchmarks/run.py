"""Side-by-side benchmarks; prints one JSON line per measurement.

    python benchmarks/run.py              # the issue's shapes (CPU: ~3 minutes on 2 cores)
    python benchmarks/run.py --quick      # tiny shapes, seconds (the test suite runs this)
    python benchmarks/run.py --only otb   # one section: otb | proxy
    python benchmarks/run.py --gpu        # CUDA: the issue's GPU shapes side by side (benchmarks/gpu.py)
    python benchmarks/run.py --gpu --quick   # CUDA, tiny shapes through every GPU code path

(a) ``proxy``: chunked ``logprobs_and_sum_pi_squared`` vs the naive full-logits
    path, forward (old log-probs) and forward + backward (the loss): median
    time and peak extra memory. Each memory case runs in a fresh subprocess
    (CPU: increase of max RSS over the inputs; CUDA: max_memory_allocated).
(b) ``otb``: vectorised OTB advantages vs a per-group Python loop, vs the
    authors' verl function when installed, and vs one reverse cumsum over the
    same [B, T] (the memory-bound floor). Ratios are within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

import otb_ref
from harness import (
    OTB_SHAPES,
    OTB_SHAPES_QUICK,
    emit,
    machine,
    median_seconds,
    naive_logprobs_and_sum_pi_squared,
    otb_inputs,
)

PROXY_SHAPE = dict(n=8192, d=256, vocab=32000)
PROXY_SHAPE_QUICK = dict(n=256, d=32, vocab=1000)


# ---------------------------------------------------------------------------
# (a) chunked proxy vs naive full logits
# ---------------------------------------------------------------------------


def _proxy_inputs(n, d, vocab, dtype, device, requires_grad):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_(requires_grad)
    weight = (torch.randn(vocab, d, generator=g) / d**0.5).to(device, dtype).requires_grad_(requires_grad)
    targets = torch.randint(vocab, (n,), generator=g).to(device)
    return hidden, weight, targets


def _proxy_case(
    path: str, mode: str, n: int, d: int, vocab: int, dtype: torch.dtype, device: torch.device, repeats: int
):
    """Time and peak memory of one path; meant to run in its own process."""
    train = mode == "forward_backward"
    hidden, weight, targets = _proxy_inputs(n, d, vocab, dtype, device, train)
    fn_path = otb_ref.logprobs_and_sum_pi_squared if path == "chunked" else naive_logprobs_and_sum_pi_squared

    def step():
        with torch.set_grad_enabled(train):
            log_probs, _ = fn_path(hidden, weight, targets)
            if train:
                log_probs.sum().backward()
                hidden.grad = weight.grad = None

    if device.type == "cuda":
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    seconds = median_seconds(step, device, repeats)
    return {"seconds": seconds, "peak_extra_bytes": peak}


def _run_proxy_case_in_subprocess(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--proxy-case", *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_proxy(quick: bool, device: torch.device) -> None:
    shape = PROXY_SHAPE_QUICK if quick else PROXY_SHAPE
    dtypes = ["float32"] if device.type == "cpu" else ["bfloat16"]
    repeats = 2 if quick else 3
    for dtype in dtypes:
        for mode in ["forward", "forward_backward"]:
            results = {}
            for path in ["naive", "chunked"]:
                args = [
                    path,
                    mode,
                    str(shape["n"]),
                    str(shape["d"]),
                    str(shape["vocab"]),
                    dtype,
                    device.type,
                    str(repeats),
                ]
                results[path] = _run_proxy_case_in_subprocess(args)
            emit(
                {
                    "bench": "proxy",
                    "mode": mode,
                    "dtype": dtype,
                    **shape,
                    "machine": machine(),
                    "naive_seconds": results["naive"]["seconds"],
                    "chunked_seconds": results["chunked"]["seconds"],
                    "naive_peak_mib": results["naive"]["peak_extra_bytes"] / 2**20,
                    "chunked_peak_mib": results["chunked"]["peak_extra_bytes"] / 2**20,
                    "time_ratio_chunked_over_naive": results["chunked"]["seconds"] / results["naive"]["seconds"],
                    "memory_ratio_chunked_over_naive": results["chunked"]["peak_extra_bytes"]
                    / max(results["naive"]["peak_extra_bytes"], 1),
                }
            )


# ---------------------------------------------------------------------------
# (b) vectorised OTB vs a per-group loop vs the reverse-cumsum floor
# ---------------------------------------------------------------------------


def per_group_loop_otb(rewards, mask, index, old_log_probs, sum_pi_squared, epsilon=1e-8):
    """OTB written the direct way: one Python iteration (and ~8 small ops) per prompt group."""
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    energy = (1 - 2 * old_log_probs.exp() + sum_pi_squared).clamp(0, 2)
    cumulative = (energy * mask).cumsum(-1)
    baselines = torch.zeros_like(returns)
    groups: dict = {}
    for row, key in enumerate(index):
        groups.setdefault(key, []).append(row)
    for rows in groups.values():
        if len(rows) < 2:
            continue
        rows_t = torch.tensor(rows, device=rewards.device)
        w = cumulative[rows_t] * mask[rows_t]
        baselines[rows_t] = ((returns[rows_t] * w).sum(0) / (w.sum(0) + epsilon)).expand(len(rows), -1)
    return (returns - baselines) * mask, returns


def bench_otb(quick: bool, device: torch.device) -> None:
    repeats = 3 if quick else 5
    try:
        from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage as verl_otb
    except Exception:  # verl is optional
        verl_otb = None
    import numpy as np

    for batch, length, group_size in OTB_SHAPES_QUICK if quick else OTB_SHAPES:
        rewards, mask, index, log_probs, sum_pi_squared = otb_inputs(batch, length, group_size, device)
        index_tensor = torch.tensor(index, device=device)
        cases = {
            "floor_reverse_cumsum": lambda: rewards.flip(-1).cumsum(-1).flip(-1),
            "vectorised": lambda: otb_ref.compute_optimal_token_baseline_advantage(
                rewards, mask, index_tensor, log_probs, sum_pi_squared, handle_zero_tail=False
            ),
            "per_group_loop": lambda: per_group_loop_otb(rewards, mask, index, log_probs, sum_pi_squared),
        }
        if verl_otb is not None:
            index_np = np.array(index)
            cases["verl"] = lambda: verl_otb(rewards, mask, index_np, log_probs, sum_pi_squared, handle_zero_tail=False)
        seconds = {name: median_seconds(fn, device, repeats) for name, fn in cases.items()}
        record = {"bench": "otb", "B": batch, "T": length, "N": group_size, "machine": machine()}
        record.update({f"{name}_seconds": value for name, value in seconds.items()})
        record["vectorised_over_floor"] = seconds["vectorised"] / seconds["floor_reverse_cumsum"]
        record["loop_over_vectorised"] = seconds["per_group_loop"] / seconds["vectorised"]
        if "verl" in seconds:
            record["verl_over_vectorised"] = seconds["verl"] / seconds["vectorised"]
        emit(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--only", choices=["otb", "proxy"], help="run one section")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--gpu", action="store_true", help="CUDA benchmarks of benchmarks/gpu.py (JSON lines)")
    parser.add_argument("--out", help="with --gpu: also append the records to this file")
    parser.add_argument(
        "--time-budget", type=float, default=270.0, help="with --gpu: skip the cases left after this many seconds"
    )
    parser.add_argument("--proxy-case", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu: CUDA is not available (torch.cuda.is_available() is False); run without --gpu for CPU")
        import gpu

        gpu.main(args.quick, args.time_budget, args.out)
        return
    if args.proxy_case:
        path, mode, n, d, vocab, dtype, device, repeats = args.proxy_case
        result = _proxy_case(
            path, mode, int(n), int(d), int(vocab), getattr(torch, dtype), torch.device(device), int(repeats)
        )
        print(json.dumps(result))
        return
    device = torch.device(args.device)
    if args.only in (None, "otb"):
        bench_otb(args.quick, device)
    if args.only in (None, "proxy"):
        bench_proxy(args.quick, device)


if __name__ == "__main__":
    main()
