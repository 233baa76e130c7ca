"""The whole TRL training step with otb_ref's OTB against TRL's own GRPO step, side by side; JSON lines.

    python benchmarks/trl_step.py            # width 256, 4 layers, 8 completions of 48 tokens a step, 10 rounds
    python benchmarks/trl_step.py --quick    # seconds

Each round trains, interleaved, TRL's ``GRPOTrainer`` and ``OTBGRPOTrainer`` with ``estimator="otb"`` (and with
``"grpo"``) for a few steps from the same initial model, and records the mean step time (TRL's ``step_time``,
the first step left out; the median over rounds) and, for OTB, the added no-grad pass's seconds
(``otb/extra_pass_seconds``) and its share of the step. A ``num_iterations=2`` row shows the set-up where TRL
runs its own old-log-prob pass and OTB adds none.
Needs ``pip install -e ".[trl]"``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from harness import machine

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trl_otb", ROOT / "examples" / "trl_otb.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def train_once(kind: str, hidden: int, layers: int, length: int, steps: int, num_iterations: int) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from otb_ref.integrations.trl import OTBGRPOTrainer

    model, tokenizer = example.tiny_model_and_tokenizer(seed=0, hidden=hidden, layers=layers)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=length,
            max_steps=steps, learning_rate=1e-4, logging_steps=1, report_to="none",
            use_cpu=not torch.cuda.is_available(), seed=0, save_strategy="no", disable_tqdm=True, bf16=False,
            num_iterations=num_iterations,
        )  # fmt: skip
        common = dict(model=model, reward_funcs=example.contains_answer, args=config,
                      train_dataset=example.synthetic_dataset(rows=256), processing_class=tokenizer)  # fmt: skip
        trainer = (
            GRPOTrainer(**common) if kind == "trl_grpo" else OTBGRPOTrainer(**common, estimator=kind.split("_")[1])
        )
        trainer.train()
    history = [r for r in trainer.state.log_history if "step_time" in r]
    # TRL's step_time covers a whole optimizer step, generation included when the step generates; the mean over
    # steps (the first, a warm-up, left out) averages generating and reusing steps alike with num_iterations=2.
    step = statistics.mean(r["step_time"] for r in history[1:] or history)
    extra = [r.get("otb/extra_pass_seconds", 0.0) for r in history[1:] or history]
    return {"step_s": step, "extra_pass_s": statistics.mean(extra)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    hidden, layers, length, steps = (32, 2, 8, 3) if args.quick else (256, 4, 48, 12)
    rounds = 1 if args.quick else args.rounds
    for num_iterations in (1, 2):
        times: dict[str, list[dict]] = {"trl_grpo": [], "ours_grpo": [], "ours_otb": []}
        for _ in range(rounds):
            for kind in times:
                times[kind].append(train_once(kind, hidden, layers, length, steps, num_iterations))
        base = statistics.median(t["step_s"] for t in times["trl_grpo"])
        for kind, runs in times.items():
            step = statistics.median(t["step_s"] for t in runs)
            extra = statistics.median(t["extra_pass_s"] for t in runs)
            record = {
                "bench": "trl_step", "kind": kind, "num_iterations": num_iterations, "hidden": hidden, "layers": layers,
                "completion_tokens": length, "completions_per_step": 8, "steps": steps, "rounds": rounds,
                "step_s": round(step, 4), "ratio_to_trl_grpo": round(step / base, 3), "extra_pass_s": round(extra, 4),
                "extra_pass_share": round(extra / step, 3), "machine": machine(),
            }  # fmt: skip
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())
