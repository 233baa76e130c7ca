"""GPU benchmarks behind ``python benchmarks/run.py --gpu``: one JSON line per measurement.

    python benchmarks/run.py --gpu            # the issue's shapes on one CUDA GPU (under a minute on an H100)
    python benchmarks/run.py --gpu --quick    # tiny shapes through every code path (seconds, plus compile time)
    python benchmarks/run.py --gpu --out benchmarks/results/gpu-h100.jsonl   # also write the records to a file

Sections (every record has ``section``, ``shape``, ``machine``, ``torch`` and ``elapsed_s``):

``proxy``  ``log π(y)`` and ``Σπ²`` from an LM head, T = 8192, d = 3584, V = 152064, bf16, ``mode``
           ``forward`` (no autograd: old log-probs) or ``forward_backward`` (``log_probs.sum().backward()``).
           ``path``: ``matmul`` (the LM-head matmul alone; forward + backward: its three matmuls),
           ``naive`` (full [T, V] logits, log-softmax, gather, Σ softmax²), ``eager`` (chunked, default
           chunk), ``fused`` (chunked with compiled kernels, ``chunk_rows`` 1024 ... 8192). Reported:
           ``median_ms`` / ``min_ms`` of timed calls (CUDA events), ``first_call_ms`` (includes compilation;
           excluded from the median), ``peak_extra_gib`` (max_memory_allocated after a reset, minus what the
           inputs hold), ``peak_beyond_grads_gib`` (the same minus the returned gradients) and, for fused,
           ``over_matmul`` / ``over_naive`` with the issue's targets.
``proxy_memory``  the fused path's peak at T = 16384 (target: <= 2 GiB beyond inputs and gradients).
``proxy_check``   fused (compiled) vs eager on the GPU, both against an fp32 reference: largest errors.
``otb``    OTB advantages at (B, T, N) = (2048, 4096, 8) and (16384, 512, 4), fp32, vs one reverse cumsum
           over the same [B, T] (the floor); ``syncs_per_call`` counts host synchronisations
           (``torch.cuda.set_sync_debug_mode("warn")``) of one call.
Every case is guarded: a failure prints ``{"error": ...}`` for that case and the run goes on. Cases
after ``--time-budget`` seconds are skipped (``"skipped": true``).
"""

from __future__ import annotations

import json
import time
import traceback
import warnings
from typing import Callable

import torch

import otb_ref
from harness import (
    OTB_SHAPES,
    OTB_SHAPES_QUICK,
    naive_logprobs_and_sum_pi_squared,
    otb_inputs,
    peak_extra_bytes,
    time_cuda,
)

PROXY = dict(n=8192, d=3584, vocab=152064)
PROXY_QUICK = dict(n=1000, d=64, vocab=5000)  # rows not a multiple of any chunk
MEMORY_ROWS, MEMORY_ROWS_QUICK = 16384, 2000
FUSED_CHUNKS, FUSED_CHUNKS_QUICK = (1024, 2048, 4096, 8192), (128, 256)
TARGETS = dict(forward_over_matmul=1.3, forward_backward_over_naive=0.9, memory_gib=2.0, otb_over_floor=3.0)
GIB = 2**30


class Recorder:
    """Prints records with the common fields; runs cases guarded and within the time budget."""

    def __init__(self, budget_s: float, out_path: str | None):
        self.start, self.budget_s = time.perf_counter(), budget_s
        self.common = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__}
        self.out = open(out_path, "a") if out_path else None

    def emit(self, record: dict) -> None:
        line = json.dumps({**record, **self.common, "elapsed_s": round(time.perf_counter() - self.start, 1)})
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()

    def case(self, labels: dict, fn: Callable[[], dict]) -> dict | None:
        """``fn()``'s fields printed with ``labels``; an exception or an exhausted budget prints why instead."""
        if time.perf_counter() - self.start > self.budget_s:
            self.emit({**labels, "skipped": True, "reason": f"time budget {self.budget_s:.0f} s spent"})
            return None
        try:
            result = fn()
        except Exception as error:  # noqa: BLE001 - one failing case must not stop the run
            self.emit(
                {
                    **labels,
                    "error": f"{type(error).__name__}: {error}"[:2000],
                    "where": traceback.format_exc(limit=-3)[-1500:],
                }
            )
            result = None
        finally:
            try:  # after a CUDA error these raise too; the error record is already out
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass
        if result is not None:
            self.emit({**labels, **result})
        return result


# ---------------------------------------------------------------------------
# (a) the LM-head proxy
# ---------------------------------------------------------------------------


def proxy_inputs(n: int, d: int, vocab: int, train: bool, seed: int = 0):
    """bf16 hidden [n, d], weight [V, d] (scaled so logits have unit scale), targets [n]; generated on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(train)
    weight = (torch.randn(vocab, d, generator=gen, device="cuda") / d**0.5).to(torch.bfloat16).requires_grad_(train)
    targets = torch.randint(vocab, (n,), generator=gen, device="cuda")
    return hidden, weight, targets


def proxy_step(path: str, train: bool, hidden, weight, targets, chunk_rows: int | None, upstream=None):
    """One call of ``path``; with ``train``, its backward too (gradients are dropped afterwards)."""

    def run():
        if path == "matmul":
            logits = hidden @ weight.T  # [n, V]
            if train:
                logits.backward(upstream)  # the two backward matmuls
            return
        if path == "naive":
            log_probs, _ = naive_logprobs_and_sum_pi_squared(hidden, weight, targets)
        else:
            log_probs, _ = otb_ref.logprobs_and_sum_pi_squared(
                hidden, weight, targets, chunk_size=chunk_rows, implementation=path
            )
        if train:
            log_probs.sum().backward()

    def step():
        with torch.set_grad_enabled(train):
            run()
        hidden.grad = weight.grad = None

    return step


def bench_proxy(rec: Recorder, quick: bool) -> None:
    shape = PROXY_QUICK if quick else PROXY
    chunks = FUSED_CHUNKS_QUICK if quick else FUSED_CHUNKS
    repeats = 3 if quick else 10
    for mode in ("forward", "forward_backward"):
        train = mode == "forward_backward"
        hidden, weight, targets = proxy_inputs(**shape, train=train)
        upstream = torch.randn(shape["n"], shape["vocab"], device="cuda", dtype=torch.bfloat16) if train else None
        grads_bytes = (hidden.numel() + weight.numel()) * hidden.element_size() if train else 0
        baseline: dict[str, float] = {}
        cases = [("matmul", None), ("naive", None), ("eager", None)] + [("fused", c) for c in chunks]
        for path, chunk_rows in cases:
            labels = {
                "section": "proxy",
                "shape": shape,
                "dtype": "bfloat16",
                "mode": mode,
                "path": path,
                "chunk_rows": chunk_rows,
            }

            def measure(path=path, chunk_rows=chunk_rows):
                # runs before the `del hidden, ...` below (hence the F821 waiver)
                step = proxy_step(path, train, hidden, weight, targets, chunk_rows, upstream)  # noqa: F821
                result = time_cuda(step, repeats)
                peak = peak_extra_bytes(step)
                result.update(peak_extra_gib=peak / GIB, peak_beyond_grads_gib=(peak - grads_bytes) / GIB)
                return result

            result = rec.case(labels, lambda: _with_ratios(measure(), path, mode, baseline))
            if result is not None and path in ("matmul", "naive"):
                baseline[path] = result["median_ms"]
        del hidden, weight, targets, upstream


def _with_ratios(result: dict, path: str, mode: str, baseline: dict) -> dict:
    """Ratios to the matmul and naive times of the same mode, with the issue's targets."""
    for name in ("matmul", "naive"):
        if path not in ("matmul", "naive") and name in baseline:
            result[f"over_{name}"] = result["median_ms"] / baseline[name]
    if path == "fused" and mode == "forward" and "over_matmul" in result:
        result.update(
            target_over_matmul=TARGETS["forward_over_matmul"],
            meets_target=result["over_matmul"] <= TARGETS["forward_over_matmul"],
        )
    if path == "fused" and mode == "forward_backward" and "over_naive" in result:
        result.update(
            target_over_naive=TARGETS["forward_backward_over_naive"],
            meets_target=result["over_naive"] <= TARGETS["forward_backward_over_naive"],
        )
    return result


def bench_proxy_memory(rec: Recorder, quick: bool) -> None:
    """Peak memory of the fused path (forward + backward) at T = 16384 rows, every chunk size and the default."""
    shape = dict(PROXY_QUICK if quick else PROXY, n=MEMORY_ROWS_QUICK if quick else MEMORY_ROWS)
    hidden, weight, targets = proxy_inputs(**shape, train=True)
    grads_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    for chunk_rows in (*(FUSED_CHUNKS_QUICK if quick else FUSED_CHUNKS), None):
        chunk_label = chunk_rows if chunk_rows else f"default ({otb_ref.proxy.FUSED_CHUNK_ROWS})"
        labels = {
            "section": "proxy_memory",
            "shape": shape,
            "dtype": "bfloat16",
            "mode": "forward_backward",
            "path": "fused",
            "chunk_rows": chunk_label,
        }

        def measure(chunk_rows=chunk_rows):
            step = proxy_step("fused", True, hidden, weight, targets, chunk_rows)
            step()  # warm-up (compilation)
            peak = peak_extra_bytes(step)
            beyond = (peak - grads_bytes) / GIB
            return {
                "peak_extra_gib": peak / GIB,
                "peak_beyond_grads_gib": beyond,
                "target_gib": TARGETS["memory_gib"],
                "meets_target": beyond <= TARGETS["memory_gib"],
            }

        rec.case(labels, measure)


def bench_proxy_check(rec: Recorder, quick: bool) -> None:
    """Fused (compiled) and eager on the GPU against an fp32 full-logits reference: values and both gradients.

    Shape: rows not a multiple of the chunk, temperature 0.7. Errors are relative to each reference's largest entry.
    """
    n, d, vocab, chunk = (300, 32, 1000, 64) if quick else (2048 + 77, 256, 32000, 512)
    hidden, weight, targets = proxy_inputs(n, d, vocab, train=False, seed=1)
    upstream = torch.randn(n, device="cuda")

    def run(implementation: str | None, dtype: torch.dtype):
        h, w = (t.detach().to(dtype, copy=True).requires_grad_(True) for t in (hidden, weight))  # fresh leaves
        if implementation is None:  # fp32 reference with full logits
            logits = (h @ w.T).float() / 0.7
            log_probs = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
            sum_pi_squared = logits.softmax(-1).square().sum(-1)
        else:
            log_probs, sum_pi_squared = otb_ref.logprobs_and_sum_pi_squared(
                h, w, targets, temperature=0.7, chunk_size=chunk, implementation=implementation
            )
        (log_probs * upstream).sum().backward()
        return [t.detach().float() for t in (log_probs, sum_pi_squared, h.grad, w.grad)]

    def measure():
        reference = run(None, torch.float32)
        record = {}
        for implementation in ("eager", "fused"):
            got = run(implementation, torch.bfloat16)
            for name, a, b in zip(("log_probs", "sum_pi_squared", "grad_hidden", "grad_weight"), got, reference):
                record[f"{implementation}_{name}_rel_err"] = float((a - b).abs().max() / b.abs().max())
        worst = {
            name: max(record[f"eager_{name}_rel_err"], 1e-3)
            for name in ("log_probs", "sum_pi_squared", "grad_hidden", "grad_weight")
        }
        record["fused_within_2x_eager"] = all(record[f"fused_{k}_rel_err"] <= 2 * v for k, v in worst.items())
        return record

    rec.case(
        {
            "section": "proxy_check",
            "shape": dict(n=n, d=d, vocab=vocab),
            "chunk_rows": chunk,
            "temperature": 0.7,
            "dtype": "bfloat16",
        },
        measure,
    )


# ---------------------------------------------------------------------------
# (b) OTB advantages
# ---------------------------------------------------------------------------


def count_syncs(fn: Callable[[], object]) -> int:
    """Host synchronisations of one call, as reported by ``torch.cuda.set_sync_debug_mode("warn")``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def bench_otb(rec: Recorder, quick: bool) -> None:
    repeats = 5 if quick else 50
    device = torch.device("cuda")
    for batch, length, group_size in OTB_SHAPES_QUICK if quick else OTB_SHAPES:
        rewards, mask, index, log_probs, sum_pi_squared = otb_inputs(batch, length, group_size, device)
        index_tensor = torch.tensor(index, device=device)

        def floor():
            return rewards.flip(-1).cumsum(-1).flip(-1)

        def otb(handle_zero_tail: bool = False, ids=index_tensor):
            return otb_ref.compute_optimal_token_baseline_advantage(
                rewards, mask, ids, log_probs, sum_pi_squared, handle_zero_tail=handle_zero_tail
            )

        def measure():
            floor_ms = time_cuda(floor, repeats)["median_ms"]
            timed = time_cuda(otb, repeats)
            tail_ms = time_cuda(lambda: otb(True), repeats)["median_ms"]
            ratio = timed["median_ms"] / floor_ms
            return {
                "floor_reverse_cumsum_ms": floor_ms,
                "otb_ms": timed["median_ms"],
                "otb_first_call_ms": timed["first_call_ms"],
                "otb_over_floor": ratio,
                "otb_handle_zero_tail_ms": tail_ms,
                "target_over_floor": TARGETS["otb_over_floor"],
                "meets_target": ratio <= TARGETS["otb_over_floor"],
                "syncs_per_call": count_syncs(otb),
                "syncs_per_call_list_index": count_syncs(lambda: otb(ids=index)),
            }

        rec.case({"section": "otb", "shape": dict(B=batch, T=length, N=group_size), "dtype": "float32"}, measure)


def main(quick: bool, budget_s: float, out_path: str | None) -> None:
    rec = Recorder(budget_s, out_path)
    rec.emit(
        {
            "section": "start",
            "shape": None,
            "quick": quick,
            "fused_chunk_rows_default": otb_ref.proxy.FUSED_CHUNK_ROWS,
            "cuda": torch.version.cuda,
        }
    )
    bench_otb(rec, quick)
    bench_proxy_check(rec, quick)
    bench_proxy(rec, quick)
    bench_proxy_memory(rec, quick)
    rec.emit({"section": "end", "shape": None})
