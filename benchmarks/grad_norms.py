"""Per-response exact ||S||² in one pass vs an ordinary forward + backward vs a loop over rows; JSON lines.

    python benchmarks/grad_norms.py             # CPU: the built-in tiny model and a wider one (~1 min on 2 cores)
    python benchmarks/grad_norms.py --quick     # seconds (the test suite runs this)
    python benchmarks/grad_norms.py --gpu       # one GPU: a Qwen2.5-0.5B-shaped config in bf16 (random init)
    python benchmarks/grad_norms.py --gpu --only chunked   # one GPU: the chunked-head cases alone
    python benchmarks/grad_norms.py --rss       # CPU: peak resident memory of each pass, with and without checkpointing

Each case runs, on the same model and batch [B, T] (prompt T/4, response 3T/4), with the LM head either the model's
own (``head: "full"``, [B, T, V] logits) or ``otb_ref.grad_norms.lm_head_log_probs`` on the decoder's hidden states
(``head: "chunked"``, chunked over the vocabulary, no [B, T, V] tensor; the only way past ~16k tokens at V = 152k):
  ordinary   ``Σ_i Σ_t m_it log π(y_it)`` forward + ``.backward()`` into the parameters' ``.grad``;
  one_pass   ``otb_ref.row_grad_norms_sq`` of the same objective (every row's ||S_i||², no ``.grad``);
  loop       one forward + backward per row, ||grad||² summed over parameters (the naive EOB). When B is
             larger than --loop-rows, the first --loop-rows rows are timed and the total is scaled by
             B / rows: the record says ``loop_rows_timed``.
Reported: median seconds over --repeats (after one warm-up), on CUDA also the GPU-busy seconds of one call of each
pass (kernel time from the profiler, ``*_busy_s``; busy / wall far below 1 means the pass waits on the host), the
ratios one_pass / ordinary and loop / one_pass, the paired ratio (``one_pass_over_ordinary_paired``: the median of
--pairs back-to-back ordinary / one-pass pairs, robust to the machine drifting between the two medians; each pair
in ``paired_ratios``), peak memory beyond the model (CUDA only: ``max_memory_allocated`` after a reset, minus what
was allocated before), and the largest relative difference between one_pass and loop norms.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from harness import device_busy_seconds, machine, paired_ratios, provenance, sync, timed
from otb_ref import row_grad_norms_sq
from otb_train.model import enable_hf_activation_checkpointing
from otb_train.tiny_models import QWEN25_05B, tiny_causal_lm

CPU_CASES = [
    dict(width=64, layers=2, heads=4, kv=2, ffn=256, vocab=64, tied=False, shape=(16, 64)),
    dict(width=256, layers=4, heads=4, kv=2, ffn=1024, vocab=4096, tied=True, shape=(16, 256)),
    dict(width=256, layers=4, heads=4, kv=2, ffn=1024, vocab=4096, tied=True, shape=(16, 256), head="chunked"),
]
QUICK_CASES = [
    dict(width=32, layers=1, heads=2, kv=1, ffn=64, vocab=50, tied=True, shape=(4, 16)),
    dict(width=32, layers=1, heads=2, kv=1, ffn=64, vocab=50, tied=True, shape=(4, 16), head="chunked"),
]
# Qwen2.5-0.5B's shape (otb_train.tiny_models.QWEN25_05B) in this file's names: 24 layers, width 896, 14 heads of 64,
# 2 KV heads, MLP 4864, vocabulary 151936, tied.
SIZE_NAMES = dict(
    width="hidden_size",
    layers="num_hidden_layers",
    heads="num_attention_heads",
    kv="num_key_value_heads",
    ffn="intermediate_size",
    vocab="vocab_size",
    tied="tie_word_embeddings",
)
GPU_MODEL = {name: QWEN25_05B[hf] for name, hf in SIZE_NAMES.items()}
# The model's own head ([B, T, V] logits): (shape, activation checkpointing).
GPU_FULL_CASES = [((16, 512), False), ((16, 512), True), ((32, 512), True)]
# Past 16k tokens (full [B, T, V] logits no longer fit): the chunked head, with and without activation checkpointing.
GPU_CHUNKED_SHAPES = [(8, 4096), (16, 2048)]


def build(case: dict, device: torch.device, dtype: torch.dtype, checkpointing: bool = False):
    sizes = {hf: case[name] for name, hf in SIZE_NAMES.items()}
    with torch.device(device):  # initialise on the device: seconds saved per 0.5B model
        model = tiny_causal_lm("qwen2", 0, dtype, **sizes, max_position_embeddings=4096).eval()
    if checkpointing:
        enable_hf_activation_checkpointing(model)
        model.train()  # transformers checkpoints only in training mode (no dropout in this config)
    return model


def batch(rows: int, length: int, vocab: int, device: torch.device):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    mask = torch.zeros(rows, length)
    mask[:, length // 4 :] = 1
    return ids.to(device), mask.to(device)


def log_likelihood(model, ids, mask, head: str = "full") -> torch.Tensor:
    if head == "chunked":  # the decoder's hidden states through the LM head chunked over the vocabulary
        from otb_ref.grad_norms import lm_head_log_probs

        hidden = model.get_decoder()(ids, use_cache=False).last_hidden_state  # [B, T, d]
        log_probs = lm_head_log_probs(hidden[:, :-1], model.get_output_embeddings(), ids[:, 1:])
    else:
        z = model(ids, use_cache=False).logits[:, :-1].float()  # [B, T-1, V]
        log_probs = z.gather(-1, ids[:, 1:, None]).squeeze(-1) - z.logsumexp(dim=-1)
    return (log_probs * mask[:, 1:]).sum(dim=1)  # [B]


def ordinary(model, ids, mask, head: str = "full"):
    log_likelihood(model, ids, mask, head).sum().backward()
    model.zero_grad(set_to_none=True)


def one_pass(model, ids, mask, head: str = "full") -> torch.Tensor:
    return row_grad_norms_sq(model, lambda: log_likelihood(model, ids, mask, head))


def loop(model, ids, mask, rows: int, head: str = "full") -> torch.Tensor:
    out = []
    for i in range(rows):
        log_likelihood(model, ids[i : i + 1], mask[i : i + 1], head).sum().backward()
        out.append(sum(p.grad.float().square().sum() for p in model.parameters() if p.grad is not None))
        model.zero_grad(set_to_none=True)
    return torch.stack(out)


def run_case(case: dict, shape, device, dtype, args, checkpointing: bool = False) -> dict:
    model = build(case, device, dtype, checkpointing)
    rows, length = shape
    ids, mask = batch(rows, length, case["vocab"], device)
    record = dict(
        section="grad_norms",
        machine=machine(device),
        torch=torch.__version__,
        dtype=str(dtype)[6:],
        params=sum(p.numel() for p in model.parameters()),
        B=rows,
        T=length,
        activation_checkpointing=checkpointing,
        **{"head": "full", **{k: v for k, v in case.items() if k not in ("shape", "dtype")}},
    )
    head = record["head"]
    # The lambdas run here, before the `del model` below frees the model (hence the F821 waivers).
    t_ord, m_ord, _ = timed(lambda: ordinary(model, ids, mask, head), device, args.repeats)  # noqa: F821
    t_one, m_one, norms = timed(lambda: one_pass(model, ids, mask, head), device, args.repeats)  # noqa: F821
    pairs = paired_ratios(
        lambda: ordinary(model, ids, mask, head),  # noqa: F821
        lambda: one_pass(model, ids, mask, head),  # noqa: F821
        device,
        args.pairs,
    )
    busy_ord = device_busy_seconds(lambda: ordinary(model, ids, mask, head), device)  # noqa: F821
    busy_one = device_busy_seconds(lambda: one_pass(model, ids, mask, head), device)  # noqa: F821
    loop_rows = min(rows, args.loop_rows)
    t_loop, m_loop, loop_norms = timed(lambda: loop(model, ids, mask, loop_rows, head), device, 1)  # noqa: F821
    rel = ((norms[:loop_rows].double() - loop_norms.double()).abs() / loop_norms.double().clamp_min(1e-30)).max()
    record.update(
        ordinary_s=t_ord,
        one_pass_s=t_one,
        loop_s=t_loop * rows / loop_rows,
        loop_rows_timed=loop_rows,
        one_pass_over_ordinary=t_one / t_ord,
        one_pass_over_ordinary_paired=statistics.median(pairs),
        paired_ratios=[round(r, 4) for r in pairs],
        loop_over_one_pass=t_loop * rows / loop_rows / t_one,
        max_rel_diff_one_pass_vs_loop=float(rel),
    )
    if busy_ord is not None:  # GPU-busy seconds (kernels) beside the wall clock: a host-bound pass shows here
        record.update(
            ordinary_busy_s=busy_ord,
            one_pass_busy_s=busy_one,
            one_pass_over_ordinary_busy=busy_one / busy_ord,
            ordinary_busy_over_wall=busy_ord / t_ord,
            one_pass_busy_over_wall=busy_one / t_one,
        )
    record.update(provenance())
    if m_ord is not None:
        record.update(ordinary_peak_gib=m_ord / 2**30, one_pass_peak_gib=m_one / 2**30, loop_peak_gib=m_loop / 2**30)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def profile_case(case: dict, device: torch.device, dtype: torch.dtype, checkpointing: bool, rows: int = 20) -> dict:
    """Top operators by device time for one ordinary pass and one one_pass (after a warm-up each)."""
    from torch.profiler import ProfilerActivity, profile

    model = build(case, device, dtype, checkpointing)
    ids, mask = batch(*case["shape"], case["vocab"], device)
    x = torch.randn(2, 8, 8, device=device, dtype=dtype)
    try:
        torch.bmm(x, x, out_dtype=torch.float32)
        bmm_out_dtype = "ok"
    except Exception as error:  # noqa: BLE001
        bmm_out_dtype = f"{type(error).__name__}: {str(error)[:200]}"
    record = dict(
        section="grad_norms_profile",
        machine=machine(device),
        B=case["shape"][0],
        T=case["shape"][1],
        bmm_out_dtype=bmm_out_dtype,
        activation_checkpointing=checkpointing,
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    passes = (("ordinary", lambda: ordinary(model, ids, mask)), ("one_pass", lambda: one_pass(model, ids, mask)))
    for name, fn in passes:
        fn()
        sync(device)
        with profile(activities=activities) as prof:
            fn()
            sync(device)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:rows]
        record[name] = [
            dict(op=e.key[:80], calls=e.count, device_ms=getattr(e, key) / 1e3, cpu_ms=e.self_cpu_time_total / 1e3)
            for e in events
        ]
        record[name + "_total_device_ms"] = sum(getattr(e, key) for e in prof.key_averages()) / 1e3
        # Host side: where the CPU's time goes, kernel launches, and host syncs (a pass waiting on the host shows here)
        by_cpu = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
        record[name + "_top_cpu"] = [
            dict(op=e.key[:80], calls=e.count, cpu_ms=e.self_cpu_time_total / 1e3) for e in by_cpu
        ]
        record[name + "_host_calls"] = {
            e.key: e.count
            for e in prof.key_averages()
            if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                         "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
                         "aten::item", "aten::_local_scalar_dense")
        }  # fmt: skip
        record[name + "_total_cpu_ms"] = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
    record.update(provenance())
    return record


RSS_CASE = dict(CPU_CASES[1], shape=(16, 1024))


def rss_case(mode: str, checkpointing: bool) -> dict:
    """Peak resident memory that one ordinary pass or one one-pass adds, in this (fresh) process. CPU has no
    allocator statistics: the increase of ``ru_maxrss`` over the model, batch and a warm-up forward is what the
    pass's tensors needed at their peak, to the page."""
    import resource

    device = torch.device("cpu")
    model = build(RSS_CASE, device, torch.float32, checkpointing)
    ids, mask = batch(*RSS_CASE["shape"], RSS_CASE["vocab"], device)
    with torch.no_grad():
        model(ids[:1, :8])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (ordinary if mode == "ordinary" else one_pass)(model, ids, mask)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(
        section="grad_norms_rss",
        machine=machine(device),
        torch=torch.__version__,
        B=RSS_CASE["shape"][0],
        T=RSS_CASE["shape"][1],
        **{k: v for k, v in RSS_CASE.items() if k != "shape"},
        mode=mode,
        activation_checkpointing=checkpointing,
        peak_rss_increase_mib=(after - before) / 1024,  # ru_maxrss is in KiB on Linux
    )


def rss_all() -> None:
    """Each (pass, checkpointing) in its own process: a process's peak resident memory never goes down."""
    import subprocess
    import sys

    for mode in ("ordinary", "one_pass"):
        for checkpointing in (False, True):
            command = [sys.executable, __file__, "--rss-child", mode, str(int(checkpointing))]
            print(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip(), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, seconds")
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, a 0.5B Qwen2-shaped model in bf16")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per measurement (default: 3)")
    parser.add_argument(
        "--pairs", type=int, default=5, help="back-to-back ordinary/one-pass pairs for the paired ratio (default: 5)"
    )
    parser.add_argument("--profile", action="store_true", help="only: top operators of the first case's two passes")
    parser.add_argument("--loop-rows", type=int, default=16, help="rows the loop times at most (default: 16)")
    parser.add_argument("--rss", action="store_true", help="only: CPU peak resident memory of each pass")
    parser.add_argument("--only", choices=("full", "chunked"), help="only the cases of this head")
    parser.add_argument("--rss-child", nargs=2, metavar=("MODE", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_case(args.rss_child[0], args.rss_child[1] == "1")), flush=True)
        return
    if args.rss:
        rss_all()
        return
    if args.pairs < 1:
        parser.error(f"--pairs: expected >= 1, got {args.pairs}")
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu: no CUDA device is available")
    if args.gpu:
        device = torch.device("cuda")
        cases = [(dict(GPU_MODEL, shape=s), c) for s, c in (GPU_FULL_CASES[:1] if args.quick else GPU_FULL_CASES)]
        cases.append((dict(GPU_MODEL, shape=(4, 256), dtype=torch.float32), False))  # exactness vs the loop in fp32
        for shape in GPU_CHUNKED_SHAPES[:1] if args.quick else GPU_CHUNKED_SHAPES:
            cases += [(dict(GPU_MODEL, shape=shape, head="chunked"), checkpointing) for checkpointing in (False, True)]
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        cases = [(c, False) for c in (QUICK_CASES if args.quick else CPU_CASES)]
    if args.only:
        cases = [(case, c) for case, c in cases if case.get("head", "full") == args.only]
    if args.profile:
        for checkpointing in (False, True):
            print(json.dumps(profile_case(cases[0][0], device, dtype, checkpointing)), flush=True)
        return
    for case, checkpointing in cases:
        try:
            record = run_case(case, case["shape"], device, case.get("dtype", dtype), args, checkpointing)
            print(json.dumps(record), flush=True)
        except Exception as error:  # noqa: BLE001 - one failed case must not hide the others
            print(
                json.dumps(
                    dict(
                        section="grad_norms",
                        shape=case["shape"],
                        head=case.get("head", "full"),
                        activation_checkpointing=checkpointing,
                        error=f"{type(error).__name__}: {error}",
                    )
                ),
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
