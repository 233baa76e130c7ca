"""train.py on one GPU, measured by running train.py itself. One JSON record per line.

    python benchmarks/gpu_train_step.py --out benchmarks/results/gpu_train_step_h200.jsonl   # one GPU: ~6 minutes
    python benchmarks/gpu_train_step.py --quick      # tiny shapes through every case (CPU or GPU, ~1 minute)

Each case writes a random-init checkpoint (Qwen2 shapes below, the character tokenizer of the synthetic tasks,
``otb_train.tasks.hugging_face_char_tokenizer``) and runs ``train.py --model <it>`` in a subprocess on the copy
task with ``--copy-lengths 255 511`` (every prompt is the 511-character field and "=": 512 tokens),
``--max-new-tokens 512`` and ``--prompts-per-step 64 --group-size 8`` (512 rows; 256 for train_step), two steps,
outputs under /dev/shm. The checkpoint's EOS never wins a draw in practice (its LM-head row is zero and the other
rows are scaled up ``EOS_MARGIN``-fold, logits of std ~25 against the EOS logit 0), so every response runs to the
512-token cap (``truncated_fraction`` 1.0 in the records), as in ``benchmarks/gpu_train_paths.py``; the sampled
distribution is still exactly the model's.

``bench: "generation"`` — the width-1024 × 16-layer model of ``gpu_train_paths.py`` (~250M parameters; vocabulary
64 here, 15 there), train.py's defaults (``static_decode`` left unset: on CUDA the static decoder with CUDA graphs,
float64 sampling, the reference sampler of ``otb_train.rollout``). ``tokens_per_s`` is train.py's own
``throughput/generation_tokens_per_s`` (generated tokens / the rollout phase, graph capture and scoring included)
of each step; ``default_in_train``: config.json records ``static_decode: true`` though the flag was not given.
That case (``case: "built_in_v64"``) is the vocabulary-64 figure with EOS unreachable; ``"qwen05b_eos_reachable"``
is what a user of a 0.5B model sees: Qwen2.5-0.5B's shape (V = 151,936), a channel every position carries and the EOS
head row reading it, so that EOS has probability ~1/200 per token (``reach_eos``; responses end at mixed lengths),
copy-task prompts of 17–512 tokens, 256 rows; ``"qwen05b_eos_reachable_drop"`` the same with ``--static-decode
--drop-finished-rows``. Each record has ``vocab``, ``eos_reachable``, ``drop_finished_rows``, ``copy_lengths``,
``mean_response_tokens`` and ``truncated_fraction``.

``bench: "train_step"`` — Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, intermediate
4864, vocabulary 151936, tied embeddings): seconds of each phase of train.py's step (``rollout``: generation and
scoring; ``logprobs``: old log-probs with Σπ²; ``advantages``; ``update``), end-to-end tokens/s (prompt and
response tokens of the step / its seconds) and ``mfu`` = train.py's ``throughput/update_model_tflops``
(6 × parameters × non-pad tokens / update seconds) / ``--peak-tflops``; per ``variant`` (micro-batch rows,
``--compile-layers``). Step 1 includes compilation and allocator warm-up; read step 2.

``bench: "torchrun"`` — ``torchrun --standalone --nproc_per_node=1 train.py`` (NCCL on CUDA), the built-in model.

Every case is guarded: a failure or a timeout prints ``{"error": ...}`` with the end of train.py's stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import emit, machine, provenance  # beside this file
from otb_train.tasks import hugging_face_char_tokenizer  # installed, or PYTHONPATH=. (gpu_device_checks.sh)
from otb_train.tiny_models import QWEN25_05B, tiny_causal_lm

ROOT = Path(__file__).resolve().parent.parent

EOS_MARGIN = 40.0  # scale of the non-EOS LM-head rows: logits of std ~25 against the EOS logit 0
# Model shapes in Hugging Face's config names (otb_train.tiny_models builds them).
GENERATION = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=64, num_key_value_heads=32,
                  intermediate_size=4096, vocab_size=64, tie_word_embeddings=False)  # fmt: skip
QWEN_05B = QWEN25_05B
QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=64, tie_word_embeddings=False)  # fmt: skip
ROLLOUT = ["--prompts-per-step", "64", "--group-size", "8", "--max-new-tokens", "512", "--copy-lengths", "255", "511"]
ROLLOUT_QUICK = ["--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "16", "--copy-lengths", "4", "8"]
# Mixed prompt lengths (17-512 tokens), 256 rows: the 0.5B generation case whose EOS ends responses (mean ~1/200).
ROLLOUT_MIXED = [
    "--prompts-per-step",
    "32",
    "--group-size",
    "8",
    "--max-new-tokens",
    "512",
    "--copy-lengths",
    "16",
    "511",
]
# Generation cases: (shape, EOS probability per token or None for never, rollout flags, decoder flags).
DROP = ["--static-decode", "--drop-finished-rows"]  # finished rows leave the static decoder's batch at the checks
GENERATION_CASES = {
    "built_in_v64": (GENERATION, None, ROLLOUT, []),
    "qwen05b_eos_reachable": (QWEN_05B, 1 / 200, ROLLOUT_MIXED, []),
    "qwen05b_eos_reachable_drop": (QWEN_05B, 1 / 200, ROLLOUT_MIXED, DROP),
}
STEP_ROWS = ["--prompts-per-step", "32"]  # train_step: 256 rows (32 prompts x 8)
VARIANTS = {  # train_step variants: extra train.py flags
    "micro16": ["--micro-batch-size", "16"],
    "micro16_compiled": ["--micro-batch-size", "16", "--compile-layers"],
    "micro32_compiled": ["--micro-batch-size", "32", "--compile-layers"],
    "micro32": ["--micro-batch-size", "32"],
    "micro64": ["--micro-batch-size", "64"],
    "micro64_compiled": ["--micro-batch-size", "64", "--compile-layers"],
}


def write_checkpoint(
    directory: Path, shape: dict, seed: int = 0, eos_probability: float | None = None
) -> tuple[int, float | None]:
    """A random-init Qwen2 of ``shape`` with the character tokenizer: (its parameters, EOS's mean probability on
    fresh prompts or None). Its EOS never wins a draw (``eos_probability=None``), or has about that probability per
    token (:func:`reach_eos`)."""
    tokenizer = hugging_face_char_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    lm = tiny_causal_lm("qwen2", seed, **shape, max_position_embeddings=2048, **ids)
    measured = None
    with torch.no_grad():
        if eos_probability is None:
            head = lm.get_output_embeddings().weight
            head.mul_(EOS_MARGIN)
            head[tokenizer.eos_token_id] = 0.0
        else:
            measured = reach_eos(lm, tokenizer.eos_token_id, eos_probability)
    lm.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in lm.parameters()), measured


@torch.no_grad()
def reach_eos(lm, eos_id: int, probability: float, positions: int = 256, channel: float = 1.0) -> float:
    """Give EOS about ``probability`` per token at every position; returns the mean EOS probability measured on fresh
    random prompts (not the calibration prompts). Responses then end at mixed lengths, as a real policy's do (the
    EOS-margin checkpoints run every row to the cap).

    A random-init model's final hidden state is mostly its own token's embedding: no direction is shared by positions,
    so an EOS row fitted to some prompts' mean hidden state gives other prompts ~1/V (at V = 151,936 such a fit ended
    no response in 512 tokens). So the model is given a channel every position carries: coordinate 0 of every input
    embedding is ``channel`` and no layer writes to coordinate 0 (its row of each ``o_proj`` and ``down_proj``, and
    of their biases, is zero), so the residual stream holds ``channel`` there at every position. The EOS head row
    reads that coordinate alone, scaled (bisection) so that EOS's mean probability over ``positions`` calibration
    positions is ``probability``. Qwen2/Llama layer names (``self_attn.o_proj``, ``mlp.down_proj``)."""
    vocab, width = lm.config.vocab_size, lm.config.hidden_size
    lm.get_input_embeddings().weight[:, 0] = channel
    for layer in lm.get_decoder().layers:
        for writer in (layer.self_attn.o_proj, layer.mlp.down_proj):
            writer.weight[0] = 0.0
            if writer.bias is not None:  # Llama with attention_bias / mlp_bias
                writer.bias[0] = 0.0
    head = lm.get_output_embeddings().weight  # tied or not: its row eos_id is set below, after the calibration

    def final_channel_and_rest(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (positions // 32, 32), generator=torch.Generator().manual_seed(seed))
        ids[ids == eos_id] = (eos_id + 1) % vocab  # prompts hold no EOS
        hidden = lm.get_decoder()(ids).last_hidden_state.reshape(-1, width).float()  # [positions, d]
        others = hidden @ head.float().T  # [positions, V]
        others[:, eos_id] = -torch.inf
        return hidden[:, 0], others.logsumexp(dim=-1)  # [positions] each

    def mean_p(scale: float, along: torch.Tensor, rest: torch.Tensor) -> float:
        return float(torch.sigmoid(scale * along - rest).mean())

    along, rest = final_channel_and_rest(1)
    low, high = 0.0, 1.0
    while mean_p(high, along, rest) < probability and high < 1e6:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if mean_p(mid, along, rest) > probability else (mid, high)
    head[eos_id] = 0.0
    head[eos_id, 0] = high
    return mean_p(high, *final_channel_and_rest(2))


def run_train(command: list[str], output_dir: Path, timeout_s: float) -> tuple[list[dict], dict]:
    """(metrics records, config.json) of one train.py run; raises with stderr's tail on failure."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise RuntimeError(f"exit status {done.returncode}: {tail}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((output_dir / "config.json").read_text())


class Bench:
    """Prints (and appends to ``--out``) one record per case, with the machine and the command."""

    def __init__(self, out: str | None):
        self.common = {
            "machine": machine(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "date": time.strftime("%Y-%m-%d"),
            "commit": provenance()["commit"],
            "bench_command": "python " + " ".join(["benchmarks/gpu_train_step.py", *sys.argv[1:]]),
        }
        self.out = open(out, "a") if out else None

    def emit(self, record: dict) -> None:
        emit({**record, **self.common}, self.out)


def train_command(args, checkpoint: Path | None, output_dir: Path, extra: list[str], rollout=None) -> list[str]:
    common = ["--steps", str(args.steps), "--output-dir", str(output_dir), "--sample-every", "0", "--save-every", "0"]
    model = ["--model", str(checkpoint), "--lr", "1e-6"] if checkpoint else []
    rollout = ROLLOUT_QUICK if args.quick else (rollout or ROLLOUT)
    return [sys.executable, "train.py", *model, *rollout, *common, *extra]


def case_generation(bench: Bench, args, scratch: Path, name: str) -> None:
    """``name`` of :data:`GENERATION_CASES`: train.py's rollout phase on that checkpoint (two steps)."""
    shape, eos_probability, rollout, decoder_flags = GENERATION_CASES[name]
    shape = QUICK if args.quick else shape
    checkpoint, output_dir = scratch / f"{name}_model", scratch / f"{name}_run"
    parameters, eos_measured = write_checkpoint(checkpoint, shape, eos_probability=eos_probability)
    rollout = ROLLOUT_QUICK if args.quick else rollout
    command = train_command(args, checkpoint, output_dir, ["--micro-batch-size", "32", *decoder_flags], rollout)
    records, config = run_train(command, output_dir, args.case_timeout)
    rows = config["prompts_per_step"] * config["group_size"]
    for record in records:
        bench.emit(
            {
                "bench": "generation",
                "case": name,
                "step": record["step"],
                "default_in_train": config["static_decode"] is True and not decoder_flags,
                "static_decode": config["static_decode"],
                "drop_finished_rows": config["drop_finished_rows"],
                "rows": rows,
                "max_new_tokens": config["max_new_tokens"],
                "copy_lengths": config["copy_lengths"],
                "generated_tokens": record["generated_tokens"],
                "mean_response_tokens": round(record["generated_tokens"] / rows, 1),
                "truncated_fraction": record["truncated_fraction"],
                "rollout_s": round(record["time/rollout"], 3),
                "tokens_per_s": round(record["throughput/generation_tokens_per_s"], 1),
                "parameters": parameters,
                "vocab": shape["vocab_size"],
                "eos_reachable": eos_probability is not None,
                "eos_probability_fresh_prompts": eos_measured,  # reach_eos's check on prompts it was not fitted to
                "command": " ".join(["python", *command[1:]]),
            }
        )


def update_flops(shape: dict, rows: int, prompt: float, response: float, epochs: int) -> dict[str, float]:
    """The update's model FLOPs under two conventions, for ``rows`` rows of ``prompt + response`` tokens each, ×
    ``epochs``: ``palm``, ``gpu_train_paths.update_model_flops`` (PaLM's: matmul body, attention, the LM head on the
    response tokens only); ``torchtitan``, ``(6·(N − embedding) + 12·L·d·S)`` per token over all ``S`` tokens.
    (The third, ``6·N·tokens``, is train.py's own ``update_model_tflops``.)"""
    from types import SimpleNamespace

    from gpu_train_paths import update_model_flops

    d, layers, f = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    vocab, heads, kv_heads = shape["vocab_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    config = SimpleNamespace(
        hidden_size=d,
        num_hidden_layers=layers,
        intermediate_size=f,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    q, k = d, kv_heads * (d // heads)
    body = layers * (2 * d * q + 2 * d * k + 3 * d * f + 2 * d + q + 2 * k) + d  # matmuls, norms, q/k/v biases
    non_embedding = body + (0 if shape["tie_word_embeddings"] else vocab * d)  # an untied head is not an embedding
    seq = prompt + response
    titan = (6 * non_embedding + 12 * layers * d * seq) * seq * rows
    return {"palm": update_model_flops(config, rows, prompt, response) * epochs, "torchtitan": titan * epochs}


def case_train_step(bench: Bench, args, scratch: Path, checkpoint: Path, variant: str) -> None:
    output_dir = scratch / f"step_{variant}"
    command = train_command(args, checkpoint, output_dir, [*([] if args.quick else STEP_ROWS), *VARIANTS[variant]])
    records, config = run_train(command, output_dir, args.case_timeout)
    for record in records:
        phases = {name: round(record[f"time/{name}"], 3) for name in ("rollout", "logprobs", "advantages", "update")}
        tflops, cuda_run = record["throughput/update_model_tflops"], "memory/peak_allocated_gib" in record
        rows = config["prompts_per_step"] * config["group_size"]
        prompt = (record["sequence_tokens"] - record["generated_tokens"]) / rows  # uniform here: 512
        flops = update_flops(
            QUICK if args.quick else QWEN_05B, rows, prompt, record["generated_tokens"] / rows, config["epochs"]
        )
        peak = args.peak_tflops * 1e12 * record["time/update"]
        bench.emit(
            {
                "bench": "train_step",
                "variant": variant,
                "step": record["step"],
                "seconds": phases,
                "step_s": round(record["time/step"], 3),
                "sequence_tokens": record["sequence_tokens"],
                "generated_tokens": record["generated_tokens"],
                "tokens_per_s": round(record["sequence_tokens"] / record["time/step"], 1),
                "generation_tokens_per_s": round(record["throughput/generation_tokens_per_s"], 1),
                "update_model_tflops": round(tflops, 1),
                "peak_allocated_gib": round(record["memory/peak_allocated_gib"], 2) if cuda_run else None,
                "mfu": round(tflops / args.peak_tflops, 4),  # 6 × all parameters × non-pad tokens
                "mfu_palm": round(flops["palm"] / peak, 4),
                "mfu_torchtitan": round(flops["torchtitan"] / peak, 4),
                "peak_tflops": args.peak_tflops,
                "static_decode": config["static_decode"],
                "micro_batch_size": config["micro_batch_size"],
                "compile_layers": config["compile_layers"],
                "command": " ".join(["python", *command[1:]]),
            }
        )


def case_torchrun(bench: Bench, args, scratch: Path) -> None:
    output_dir = scratch / "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    command += ["--steps", "3", "--output-dir", str(output_dir), "--sample-every", "0"]
    started = time.perf_counter()
    records, config = run_train(command, output_dir, args.case_timeout)
    checkpoints = sorted(p.name for p in (output_dir / "checkpoints").iterdir())
    bench.emit(
        {
            "bench": "torchrun",
            "backend": "nccl" if torch.cuda.is_available() else "gloo",
            "steps": len(records),
            "checkpoints": checkpoints,
            "reward_mean_last": records[-1]["reward_mean"],
            "wall_s": round(time.perf_counter() - started, 1),
            "command": "torchrun --standalone --nproc_per_node=1 train.py " + " ".join(command[6:]),
        }
    )


def guarded(bench: Bench, labels: dict, fn) -> None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - one failing case must not stop the others
        bench.emit({**labels, "error": f"{type(error).__name__}: {error}"[-3000:]})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU or GPU)")
    parser.add_argument("--out", help="also append the records to this JSONL file")
    parser.add_argument("--only", nargs="+", choices=("torchrun", "generation", "train_step"))
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--generation", nargs="+", choices=tuple(GENERATION_CASES), default=list(GENERATION_CASES))
    parser.add_argument("--steps", type=int, default=2, help="train.py steps per run (the first compiles)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--case-timeout", type=float, default=170.0, help="seconds per train.py run")
    args = parser.parse_args(argv)
    bench = Bench(args.out)
    only = set(args.only or ("torchrun", "generation", "train_step"))
    scratch = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None, prefix="otb_bench_"))
    try:
        if "torchrun" in only:
            guarded(bench, {"bench": "torchrun"}, lambda: case_torchrun(bench, args, scratch))
        if "generation" in only:
            for name in args.generation:
                labels = {"bench": "generation", "case": name}
                guarded(bench, labels, lambda n=name: case_generation(bench, args, scratch, n))
        if "train_step" in only:
            checkpoint = scratch / "qwen05b_shape"
            write_checkpoint(checkpoint, QUICK if args.quick else QWEN_05B)
            for variant in args.variants:
                labels = {"bench": "train_step", "variant": variant}
                guarded(bench, labels, lambda v=variant: case_train_step(bench, args, scratch, checkpoint, v))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
