"""verl's old-log-prob pass at a long shape: fused kernels alone, fused + Σπ² (otb_ref's route), non-fused + Σπ².

    python benchmarks/verl_fused.py                      # T = 4096 tokens, d = 896, V = 151,936, 2 layers
    python benchmarks/verl_fused.py --quick              # seconds
    python benchmarks/verl_fused.py --out benchmarks/results/verl_fused_cpu_2core.jsonl

The pass is verl 0.9.1's FSDP engine's ``prepare_model_inputs`` → model → ``prepare_model_outputs`` on one
micro-batch of ``--sequences`` sequences (``--tokens`` in all, remove-padding on, temperature 0.7, fp32, no
gradient), the model a random-init Qwen2 of Qwen2-0.5B's width and vocabulary patched by verl's own
``apply_monkey_patch`` (the non-fused variant switches the class forward back to Hugging Face's). After one
warm-up pass each, ``--repeats`` rounds run every variant once, interleaved, so that the load of a shared machine
falls on all alike. Before each pass the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``); the record
keeps each pass's peak resident set above its start (``peak_rss_above_start_gib``: the largest over the rounds)
and the median seconds. Ratios are against fused alone. Needs ``pip install -e ".[verl]"`` and Linux.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from harness import emit, machine
from otb_train.tiny_models import QWEN25_05B, tiny_causal_lm

VARIANTS = {  # name: (use_fused_kernels, calculate_sum_pi_squared)
    "fused": (True, False),
    "fused_sum_pi_squared": (True, True),
    "non_fused_sum_pi_squared": (False, True),
}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model(args, fused: bool):
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    heads = {k: QWEN25_05B[k] for k in ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")}
    model = tiny_causal_lm(
        "qwen2", 0, torch.float32, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, max_position_embeddings=max(4096, args.tokens), attn_implementation="sdpa",
        **heads,
    ).eval()  # fmt: skip
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=fused, fused_kernels_backend="torch")
    return model


def _micro_batch(args, fused: bool, sum_pi_squared: bool):
    """One micro-batch as verl's trainer sends it to the engine: no-padding (jagged) input ids and positions."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B, L = args.sequences, args.tokens // args.sequences
    prompt = L // 4
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (B, L), generator=generator)
    attention_mask = torch.ones(B, L, dtype=torch.int64)
    data = TensorDict(
        dict(prompts=input_ids[:, :prompt], responses=input_ids[:, prompt:], input_ids=input_ids,
             attention_mask=attention_mask, position_ids=torch.arange(L).expand(B, L).clone(),
             response_mask=attention_mask[:, prompt:]),
        batch_size=[B],
    )  # fmt: skip
    micro_batch = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        micro_batch, use_remove_padding=True, use_fused_kernels=fused, calculate_entropy=True,
        calculate_sum_pi_squared=sum_pi_squared, temperature=0.7,
    )  # fmt: skip
    return micro_batch


def _engine(model):
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = object.__new__(FSDPEngineWithLMHead)  # the methods of verl's engine; no process group on CPU
    engine.module, engine.pad_to_length, engine.use_ulysses_sp = model, False, False
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def run(args) -> dict[str, dict]:
    """One record per variant: one model, the variants' passes interleaved round by round (so that the load of a
    shared machine falls on all alike), the peak resident set of each pass above its start."""
    import transformers
    import verl  # noqa: F401  (loads the otb_ref plugin: the fused route)

    model_class = transformers.Qwen2ForCausalLM
    plain_forward = model_class.forward
    engine = _engine(_model(args, fused=True))
    forwards = {True: model_class.forward, False: plain_forward}  # verl's patch is per class: switch it per pass
    batches = {variant: _micro_batch(args, *flags) for variant, flags in VARIANTS.items()}

    def one_pass(variant: str) -> tuple[float, float]:
        model_class.forward = forwards[VARIANTS[variant][0]]
        micro_batch = batches[variant]
        start_rss = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark (VmHWM) restarts here
        begin = time.perf_counter()
        with torch.no_grad():
            inputs, output_args = engine.prepare_model_inputs(micro_batch=micro_batch)
            raw = engine.module(**inputs, use_cache=False)
            output = engine.prepare_model_outputs(raw, output_args, micro_batch, logits_processor_func=None)
        seconds = time.perf_counter() - begin
        del raw, output
        return seconds, (_status_kib("VmHWM") - start_rss) / 2**20

    try:
        for variant in VARIANTS:
            one_pass(variant)  # warm-up
        samples = {variant: [] for variant in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                samples[variant].append(one_pass(variant))
    finally:
        model_class.forward = plain_forward
    return {variant: _record(args, variant, passes) for variant, passes in samples.items()}


def _record(args, variant: str, passes: list[tuple[float, float]]) -> dict:
    seconds, peaks = [p[0] for p in passes], [p[1] for p in passes]
    return dict(
        bench="verl_old_log_prob_pass", variant=variant, tokens=args.tokens, hidden=args.hidden, vocab=args.vocab,
        layers=args.layers, sequences=args.sequences, repeats=args.repeats, seconds=statistics.median(seconds),
        all_seconds=seconds, peak_rss_above_start_gib=max(peaks), all_peak_rss_above_start_gib=peaks,
        machine=machine(torch.device("cpu")), torch=torch.__version__,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=QWEN25_05B["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=QWEN25_05B["intermediate_size"])
    parser.add_argument("--vocab", type=int, default=QWEN25_05B["vocab_size"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.intermediate, args.vocab, args.layers, args.repeats = 64, 56, 64, 1000, 1, 1
    records = run(args)
    base = records["fused"]
    out_file = args.out.open("a") if args.out else None
    for record in records.values():
        record["seconds_over_fused"] = record["seconds"] / base["seconds"]
        record["peak_rss_over_fused"] = record["peak_rss_above_start_gib"] / base["peak_rss_above_start_gib"]
        emit(record, out_file)


if __name__ == "__main__":
    main()
