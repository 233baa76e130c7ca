"""Does OTB with N = 4 match GRPO with N = 32 at fewer generated tokens? Equal-budget runs from a warm start.

    python experiments/reproduction.py            # warm start, 6 arms x 3 seeds, results/reproduction.md + PNGs
    python experiments/reproduction.py --quick    # seconds: tiny warm start, 2 arms, 1 seed (the test suite)

Setting (docs/EXPERIMENTS.md): the ``copy_exact`` task with answers of 64-80 digits (responses 65-81 tokens,
0/1 reward: one wrong digit scores 0), from the supervised warm start of ``experiments/warm_start.py`` (sampled
reward about 0.5: competent, imperfect). Every arm runs ``train.py`` on-policy with the same prompts per step,
loss aggregation, clipping, learning rate and schedule; only the estimator, N and std scaling differ.

Fairness rules, fixed before any run: one learning rate for every arm (1e-4, the warm start's 3e-3 / 30,
not tuned on any arm); no warmup; the cosine runs on generated tokens to the same ``--token-budget`` for every
arm, so an arm with N = 32 takes 8x fewer steps than one with N = 4; std scaling is ablated (OTB N = 4 with and
without it), because GRPO's division by the group std changes the gradient's scale.

Reported per arm (mean and spread over seeds): reward vs generated tokens (a trailing window of
``SMOOTH_TOKENS`` tokens, the same for every arm), tokens to reach ``TARGET`` reward, final reward (last 10% of
the budget), peak reward, gradient-norm maximum and spikes, entropy. The verdict rule is stated in the report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import warm_start  # noqa: E402
from common import machine_name, write_report  # noqa: E402

TASK = ["--task", "copy_exact", "--copy-lengths", "64", "80", "--max-new-tokens", "96"]
ARMS = {  # name -> train.py flags
    "grpo_n32": ["--estimator", "grpo", "--group-size", "32"],
    "grpo_n4": ["--estimator", "grpo", "--group-size", "4"],
    "otb_n4": ["--estimator", "otb", "--group-size", "4"],
    "otb_n4_std": ["--estimator", "otb", "--group-size", "4", "--std-normalize"],
    "rloo_n4": ["--estimator", "rloo", "--group-size", "4"],
    "otb_n32": ["--estimator", "otb", "--group-size", "32"],
}
COMMON = [
    "--prompts-per-step",
    "8",
    "--lr",
    "1e-4",
    "--warmup-steps",
    "0",
    "--micro-batch-size",
    "64",
    "--save-every",
    "0",
    "--keep-checkpoints",
    "1",
    "--sample-every",
    "50",
    "--device",
    "cpu",
]
TARGET = 0.8
SMOOTH_TOKENS = 20_000
SPIKE_FACTOR = 5.0  # a gradient-norm spike: above this multiple of the run's median


def run_arm(name: str, seed: int, budget: int, warm: Path, runs: Path) -> Path:
    """One train.py run (skipped when a finished run is already there)."""
    out = runs / f"{name}_seed{seed}"
    if (out / "metrics.jsonl").exists() and (out / "checkpoints").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "--model",
        str(warm),
        *TASK,
        *COMMON,
        *ARMS[name],
        "--token-budget",
        str(budget),
        "--seed",
        str(seed),
        "--output-dir",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-3000:]}")
    return out


def smoothed(records: list[dict], window: int) -> list[tuple[int, float]]:
    """(tokens, mean reward of the responses generated in the last ``window`` tokens) after every step."""
    points = []
    for i, record in enumerate(records):
        total, weight = 0.0, 0
        for earlier in reversed(records[: i + 1]):
            if weight and record["tokens"] - earlier["tokens"] >= window:
                break
            total += earlier["reward_mean"] * earlier["generated_tokens"]
            weight += earlier["generated_tokens"]
        points.append((record["tokens"], total / weight))
    return points


def run_summary(records: list[dict], budget: int) -> dict:
    curve = smoothed(records, SMOOTH_TOKENS)
    reached = [tokens for tokens, reward in curve if reward >= TARGET]
    tail = [r for r in records if r["tokens"] >= 0.9 * budget] or records[-1:]
    norms = [r["grad_norm"] for r in records if r["grad_norm"] is not None]
    median = statistics.median(norms)
    return {
        "steps": records[-1]["step"],
        "tokens": records[-1]["tokens"],
        "start_reward": records[0]["reward_mean"],
        "final_reward": sum(r["reward_mean"] * r["generated_tokens"] for r in tail)
        / sum(r["generated_tokens"] for r in tail),
        "peak_reward": max(reward for _, reward in curve),
        "tokens_to_target": reached[0] if reached else None,
        "grad_norm_max": max(norms),
        "grad_norm_median": median,
        "grad_norm_spikes": sum(n > SPIKE_FACTOR * median for n in norms),
        "entropy_final": tail[-1]["entropy"],
        "zero_variance_final": tail[-1]["zero_variance_group_fraction"],
    }


def mean_spread(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "never"
    text = f"{statistics.mean(known):.3g}"
    text += f" ± {statistics.stdev(known):.2g}" if len(known) > 1 else ""
    return text + (f" ({len(known)}/{len(values)} reached)" if len(known) < len(values) else "")
