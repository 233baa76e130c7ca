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
from common import write_report  # noqa: E402

TASK = ["--task", "copy_exact", "--copy-lengths", "64", "80", "--max-new-tokens", "96"]
QUICK_TASK = ["--task", "copy_exact", "--copy-lengths", "2", "3", "--max-new-tokens", "6"]  # --quick (tests)
ARMS = {  # name -> train.py flags
    "grpo_n32": ["--estimator", "grpo", "--group-size", "32"],
    "grpo_n4": ["--estimator", "grpo", "--group-size", "4"],
    "otb_n4": ["--estimator", "otb", "--group-size", "4"],
    "otb_n4_std": ["--estimator", "otb", "--group-size", "4", "--std-normalize"],
    "rloo_n4": ["--estimator", "rloo", "--group-size", "4"],
    "otb_n32": ["--estimator", "otb", "--group-size", "32"],
}
# Run bookkeeping shared with experiments/stability.py: no warmup, logging and saving, CPU.
RUN_FLAGS = [
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
COMMON = ["--prompts-per-step", "4", "--lr", "1e-4", *RUN_FLAGS]
TARGET = 0.8
SMOOTH_TOKENS = 20_000
SPIKE_FACTOR = 5.0  # a gradient-norm spike: above this multiple of the run's median


def run_arm(name: str, seed: int, budget: int, warm: Path, runs: Path, flags: list[str]) -> Path:
    """One train.py run from ``warm`` with ``flags``, into ``runs/<name>_seed<seed>``; skipped when finished."""
    out = runs / f"{name}_seed{seed}"
    if (out / "metrics.jsonl").exists() and (out / "checkpoints").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "--model",
        str(warm),
        *flags,
        "--token-budget",
        str(budget),
        "--seed",
        str(seed),
        "--output-dir",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = runs / f"{name}_seed{seed}.log"  # a file, not a pipe: the run survives its driver
    runs.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as stream:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{log.read_text()[-3000:]}")
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


def load_runs(runs: dict[tuple[str, int], Path], budget: int) -> dict[str, list[dict]]:
    """arm -> [per-seed summary with its records]."""
    by_arm: dict[str, list[dict]] = {}
    for (name, seed), out in sorted(runs.items()):
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        by_arm.setdefault(name, []).append({"seed": seed, "records": records, **run_summary(records, budget)})
    return by_arm


def table(by_arm: dict[str, list[dict]]) -> list[str]:
    keys = [
        "steps",
        "start_reward",
        "final_reward",
        "peak_reward",
        "tokens_to_target",
        "grad_norm_max",
        "grad_norm_spikes",
        "entropy_final",
        "zero_variance_final",
    ]
    lines = ["| arm | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, seeds in by_arm.items():
        cells = [mean_spread([s[k] for s in seeds]) for k in keys]
        lines.append(f"| {name} | {len(seeds)} | " + " | ".join(cells) + " |")
    return lines


def verdict(by_arm: dict[str, list[dict]]) -> str:
    """The rule written in the report, applied to OTB N=4 vs GRPO N=32 (and GRPO N=4 as the control)."""
    if not {"otb_n4", "grpo_n32", "grpo_n4"} <= set(by_arm):
        return "Verdict: not computed (the otb_n4, grpo_n32 and grpo_n4 arms are all needed)."
    final = {k: [s["final_reward"] for s in v] for k, v in by_arm.items()}
    mean = {k: statistics.mean(v) for k, v in final.items()}
    spread = {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in final.items()}
    matches = mean["otb_n4"] >= mean["grpo_n32"] - max(spread["otb_n4"], spread["grpo_n32"])
    beats_control = mean["otb_n4"] > mean["grpo_n4"] + max(spread["otb_n4"], spread["grpo_n4"])
    numbers = ", ".join(f"{k} {mean[k]:.3f} ± {spread[k]:.3f}" for k in ("otb_n4", "grpo_n32", "grpo_n4"))
    if matches and beats_control:
        word = "reproduced"
    elif matches:
        word = "partially reproduced (OTB N=4 matches GRPO N=32 at equal tokens, but so does GRPO N=4)"
    else:
        word = "not reproduced"
    return f"Verdict: {word}. Final reward at equal generated tokens (mean ± std over seeds): {numbers}."


def plot(by_arm: dict[str, list[dict]], budget: int, out_dir: Path) -> list[str]:
    from common import new_figure

    figure, (reward_axis, norm_axis, entropy_axis) = new_figure(3, width=5.0)
    grid = [budget * i / 50 for i in range(1, 51)]
    for name, seeds in by_arm.items():
        curves = []
        for s in seeds:
            points = smoothed(s["records"], SMOOTH_TOKENS)
            curves.append([next((r for t, r in reversed(points) if t <= x), math.nan) for x in grid])
        mean = [statistics.mean(c[i] for c in curves) for i in range(len(grid))]
        line = reward_axis.plot(grid, mean, label=name)[0]
        if len(curves) > 1:
            low = [min(c[i] for c in curves) for i in range(len(grid))]
            high = [max(c[i] for c in curves) for i in range(len(grid))]
            reward_axis.fill_between(grid, low, high, color=line.get_color(), alpha=0.15)
        for s in seeds[:1]:
            tokens = [r["tokens"] for r in s["records"]]
            norm_axis.plot(tokens, [r["grad_norm"] for r in s["records"]], color=line.get_color(), lw=0.8, label=name)
            entropy_axis.plot(tokens, [r["entropy"] for r in s["records"]], color=line.get_color(), lw=0.8)
    reward_axis.axhline(TARGET, color="grey", ls=":", lw=0.8)
    reward_axis.set(
        xlabel="generated tokens", ylabel="reward (trailing window)", title="reward: mean, min-max over seeds"
    )
    norm_axis.set(xlabel="generated tokens", ylabel="gradient norm (first seed)", yscale="log", title="gradient norm")
    entropy_axis.set(xlabel="generated tokens", ylabel="nats per token (first seed)", title="entropy")
    reward_axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / "reproduction.png", dpi=110)
    return ["![reward, gradient norm and entropy vs generated tokens](reproduction.png)"]


def ensure_warm_start(warm: Path, task: list[str]) -> Path:
    """The warm start for ``task`` (its --copy-lengths) at ``warm``, trained if missing; a tiny one for QUICK_TASK."""
    if not (warm / "config.json").exists():
        shutil.rmtree(warm, ignore_errors=True)
        lengths = task[task.index("--copy-lengths") + 1 :][:2]
        extra = ["--steps", "10", "--hidden-size", "32"] if task == QUICK_TASK else []
        warm_start.main(["--out", str(warm), "--task", "copy_exact", "--copy-lengths", *lengths, *extra])
    return warm


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny warm start, 2 arms, 1 seed, a few steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--token-budget", type=int, default=200_000)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "reproduction")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    started = time.perf_counter()
    task = QUICK_TASK if args.quick else TASK
    if args.quick:
        args.seeds, args.arms, args.token_budget = args.seeds[:1], ["grpo_n4", "otb_n4"], 400
    warm = ensure_warm_start(args.runs_dir / "warm_start", task)
    jobs = [(name, seed) for seed in args.seeds for name in args.arms]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outs = list(
            pool.map(
                lambda job: run_arm(*job, args.token_budget, warm, args.runs_dir, [*task, *COMMON, *ARMS[job[0]]]), jobs
            )
        )
    by_arm = load_runs(dict(zip(jobs, outs)), args.token_budget)
    warm_record = json.loads((warm / "warm_start.json").read_text())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sections = [
        f"Warm start: `{warm_record['command']}` ({warm_record['steps_run']} supervised steps, sampled reward "
        f"{warm_record['final_sampled_reward']}). Task flags: `{' '.join(task)}`; common flags: `{' '.join(COMMON)}`; "
        f"token budget {args.token_budget} per run; seeds {args.seeds}.",
        "",
        f"Target reward {TARGET}; reward curves are trailing means over the last {SMOOTH_TOKENS} generated tokens; "
        f"a spike is a step whose gradient norm exceeds {SPIKE_FACTOR}x the run's median. Cells: mean ± std over "
        "seeds.",
        "",
        *table(by_arm),
        "",
        verdict(by_arm),
        "",
        "Verdict rule (fixed before the runs): *reproduced* if OTB N=4's final reward is at least GRPO N=32's minus "
        "the larger of their seed spreads, at the same generated tokens, AND exceeds GRPO N=4's by more than the "
        "larger spread (the saving is OTB's, not N=4's); *partially* if only the first holds; *not* otherwise.",
        "",
        *plot(by_arm, args.token_budget, args.out_dir),
    ]
    (args.out_dir / "reproduction.json").write_text(
        json.dumps(
            {k: [{key: v for key, v in s.items() if key != "records"} for s in seeds] for k, seeds in by_arm.items()},
            indent=1,
        )
    )
    return write_report(
        "reproduction",
        "Reproduction: OTB N=4 vs GRPO N=32 at equal generated tokens",
        sections,
        time.perf_counter() - started,
        args.out_dir,
    )


if __name__ == "__main__":
    print(main())
