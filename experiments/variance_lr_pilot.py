"""The pilot of experiments/variance_lr.py (issue 28): is there a variance contrast to test, and how large is the
seed-to-seed spread of the metric? Also the run machinery the driver shares.

    python experiments/variance_lr_pilot.py --commit        # the warm start if missing, the SNR and spread records
    python experiments/variance_lr_pilot.py --report-only   # results/variance_lr_pilot.md from the records alone
    python experiments/variance_lr_pilot.py --quick         # seconds (the test suite)

* **Task and warm start.** ``copy_exact`` with answers of 16-24 digits (responses of 17-25 tokens, reward 1 only for
  the exact answer + EOS), from ``experiments/warm_start.py`` on that task (width 64, 2 layers, 125,376 parameters,
  stopped by its rule at the first evaluation whose sampled exact-copy rate reaches 0.3). The checkpoint itself is
  committed in ``results/variance_lr_warm_start/`` so every run of the grid starts from the same bytes.
* **SNR.** At the warm start, for each pilot seed (its own 8 prompts, the main runs' prompts per step), R = 24
  independent batches of 8 prompts x 16 responses; the N = 4 batch is the first 4 responses of each prompt (paired
  with N = 16). Each estimator's batch gradient is that of the on-policy token-mean surrogate over every parameter;
  ``SNR = ‖E g‖² / tr Cov g`` with ``‖E g‖²`` the U-statistic over pairs of different batches (as in
  experiments/gradient_variance.py). The contrast at N is SNR(otb_loo) / SNR(rloo); below 1.5 at an N, that N is
  labelled "no variance contrast" and the main runs at it are not read as a test of variance.
* **Spread.** The main runs' configuration at the middle learning rate of the grid, rloo and otb_loo at N = 4 and
  16, pilot seeds 100-102 (none of the main runs' seeds): the pooled within-cell standard deviation of the metric
  (the run's mean reward per generated token) over seeds is the δ of the driver's decision rule. A probe of the
  grid's top (lr 1e-2, N = 4, seed 100, both arms) says whether it reaches a collapsing rate. Run order: N = 4 at
  seeds 100-102, the probe, N = 16 at seeds 100-101.
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
from pathlib import Path

import torch

from common import commit, machine_name, write_json_record, write_report
from otb_train.warm_start import main as train_warm_start

ROOT = Path(__file__).resolve().parents[1]

LENGTHS = ("16", "24")
TASK = ["--task", "copy_exact", "--copy-lengths", *LENGTHS, "--max-new-tokens", "32"]
QUICK_TASK = ["--task", "copy_exact", "--copy-lengths", "2", "3", "--max-new-tokens", "6"]
WARM_START = ["--task", "copy_exact", "--copy-lengths", *LENGTHS, "--hidden-size", "64", "--target-reward", "0.3"]
PROMPTS_PER_STEP = 8
STEPS = 150
WARMUP = 10
AIM_STEPS = (1, 50, 100, 150)  # steps whose update's aim is measured (experiments/aimed_train.py)
AIM = ["--aim-prompts", "16", "--aim-group", "32"]
# The runs' flags beside the arm's and the learning rate: on-policy (1 epoch x 1 mini-batch), the same 10-step
# linear warmup then a constant rate (--min-lr-ratio 1), no gradient clipping, token-mean loss, PPO clip 0.2.
COMMON = [
    "--prompts-per-step", str(PROMPTS_PER_STEP), "--epochs", "1", "--mini-batches", "1", "--warmup-steps",
    str(WARMUP), "--min-lr-ratio", "1", "--grad-clip", "0", "--micro-batch-size", "128", "--save-every", "0",
    "--keep-checkpoints", "1", "--sample-every", "0", "--device", "cpu",
]  # fmt: skip
ARMS = {  # name -> train.py flags (N is added per run)
    "rloo": ["--estimator", "rloo"],
    "otb_loo": ["--estimator", "otb", "--leave-one-out"],
    # the secondary pair (biased differently: reported apart, never read as evidence about variance)
    "grpo_nostd": ["--estimator", "grpo", "--no-std-normalize"],
    "otb": ["--estimator", "otb"],
}
PRIMARY = ("rloo", "otb_loo")
GROUP_SIZES = (4, 16)
COLUMNS = ["step", "tokens", "generated_tokens", "reward_mean", "grad_norm", "update_norm", "approx_kl", "entropy",
           "response_length_mean", "lr"]  # fmt: skip
CONTRAST = 1.5

# The pilot itself
SNR_SEEDS = (0, 1, 2)
SNR_REPLICATES = 24
SNR_PROMPT_SEED = 20_000  # the pilot's prompts: a stream no run trains on
SNR_ESTIMATORS = {  # name -> (otb_ref estimator, flags)
    "rloo": ("rloo", {}),
    "otb_loo": ("otb", {"leave_one_out": True}),
    "grpo_nostd": ("grpo", {"std_normalize": False}),
    "otb": ("otb", {}),
    "grpo": ("grpo", {}),
}
SPREAD_SEEDS = (100, 101, 102)
SPREAD_LR = 3e-4  # the middle of the driver's grid
PROBE_LRS = (1e-2,)  # the top of the grid: does it collapse? (one seed, N = 4, both arms)


# ----------------------------------------------------------------------------- one run (shared with the driver)


def run_name(arm: str, n: int, lr: float, seed: int) -> str:
    return f"{arm}_n{n}_lr{lr:g}_seed{seed}"


def run_flags(task: list[str], arm: str, n: int, lr: float) -> list[str]:
    return [*task, *COMMON, *ARMS[arm], "--group-size", str(n), "--lr", f"{lr:g}"]


def run_one(
    name: str, flags: list[str], seed: int, steps: int, warm: Path, runs: Path, aim_steps, in_process: bool = False
) -> Path:
    """One ``experiments/aimed_train.py`` run (train.py + the aim measurement) from ``warm`` into ``runs/<name>``;
    an unfinished one restarts from scratch. Its log is a file, so the run survives its driver; ``in_process``
    (quick mode) runs it in this process instead, with a tiny reference."""
    out = runs / name
    shutil.rmtree(out, ignore_errors=True)
    aim = ["--aim-steps", *map(str, [s for s in aim_steps if s <= steps]), *AIM]
    command = [sys.executable, str(ROOT / "experiments" / "aimed_train.py"), *aim, "--", "--model", str(warm),
               *flags, "--steps", str(steps), "--seed", str(seed), "--output-dir", str(out)]  # fmt: skip
    runs.mkdir(parents=True, exist_ok=True)
    if in_process:
        import aimed_train

        tiny = ["--aim-prompts", "2", "--aim-group", "4"]
        aimed_train.main([*aim[: aim.index("--aim-prompts")], *tiny, *command[command.index("--") :]])
        return out
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = runs / f"{name}.log"
    with open(log, "w") as stream:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{log.read_text()[-3000:]}")
    return out


def write_run_record(meta: dict, run: Path, seconds: float, records_dir: Path) -> Path:
    """The run's compact record ``<records_dir>/<name>.json`` (per-step columns and the aim lines), written whole
    and then renamed, so a record exists only for a finished run."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    aim_file = run / "aim.jsonl"
    aims = [json.loads(line) for line in aim_file.read_text().splitlines()] if aim_file.exists() else []
    record = {
        **meta, "machine": machine_name(), "wall_seconds": round(seconds), "columns": COLUMNS,
        "steps": [[_short(row.get(key)) for key in COLUMNS] for row in rows],
        "aim": [{k: _short(v) for k, v in line.items()} for line in aims],
    }  # fmt: skip
    return write_json_record(records_dir / f"{meta['name']}.json", record)


def _short(value):
    return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def load_runs(records_dir: Path) -> list[dict]:
    """Every run record of ``records_dir``, its per-step rows as dicts under ``rows``."""
    out = []
    for path in sorted(records_dir.glob("*.json")):
        record = json.loads(path.read_text())
        if "columns" not in record:
            continue
        record["rows"] = [dict(zip(record["columns"], values)) for values in record["steps"]]
        out.append(record)
    return out


def reward_per_token(rows: list[dict]) -> float:
    """The metric: mean reward per generated token over the run, Σ reward_mean·tokens / Σ tokens (the area under
    reward vs generated tokens, divided by the tokens). A diverged step (reward None) counts as 0."""
    total = sum(r["generated_tokens"] for r in rows)
    return sum((r["reward_mean"] or 0.0) * r["generated_tokens"] for r in rows) / total


def final_reward(rows: list[dict]) -> float:
    """Mean reward over the last 10% of the steps (at least one)."""
    tail = rows[-max(1, len(rows) // 10) :]
    return statistics.mean((r["reward_mean"] or 0.0) for r in tail)


def ensure_warm_start(warm: Path, quick: bool) -> Path:
    """The warm start at ``warm``: trained by its stopping rule if missing (a tiny one with ``quick``)."""
    if not (warm / "config.json").exists():
        shutil.rmtree(warm, ignore_errors=True)
        flags = [*WARM_START]
        if quick:
            flags = ["--task", "copy_exact", "--copy-lengths", "2", "3", "--hidden-size", "32", "--steps", "10",
                     "--eval-prompts", "16"]  # fmt: skip
        train_warm_start(["--out", str(warm), *flags])
    return warm


# ----------------------------------------------------------------------------- SNR at the warm start


def batch_gradients(lm, sample, sizes, estimators: dict) -> torch.Tensor:
    """[E, len(sizes), P]: each estimator's gradient of the token-mean surrogate on the first N responses of every
    group of ``sample`` (a gradient_variance.Sample), one forward and one backward per (estimator, N)."""
    from otb_ref import compute_advantages
    from otb_train.model import Policy
    from otb_train.rollout import position_ids_from_mask

    n_max, mask = sample.group_size, sample.mask.float()
    groups = len(mask) // n_max
    params = [p for p in lm.parameters()]
    attention = torch.cat([torch.ones(len(mask), sample.num_prompt, dtype=torch.bool), sample.mask], dim=1)
    log_probs, _ = Policy(lm, 1.0, None)(
        sample.sequences, attention, position_ids_from_mask(attention), targets=sample.sequences[:, sample.num_prompt :]
    )
    out = torch.zeros(len(estimators), len(sizes), sum(p.numel() for p in params))
    for k, n in enumerate(sizes):
        rows = torch.tensor([g * n_max + i for g in range(groups) for i in range(n)])
        index = torch.arange(groups).repeat_interleave(n)
        tokens = float(mask[rows].sum())
        for e, (estimator, flags) in enumerate(estimators.values()):
            advantages, _ = compute_advantages(
                estimator, sample.rewards[rows], mask[rows], index, old_log_probs=sample.old_log_probs[rows],
                sum_pi_squared=sample.sum_pi_squared[rows], **flags,
            )  # fmt: skip
            objective = (advantages * mask[rows] * log_probs[rows]).sum() / tokens
            grads = torch.autograd.grad(objective, params, retain_graph=True, allow_unused=True)
            out[e, k] = torch.cat(
                [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
            )
    return out


def snr_statistics(grads: torch.Tensor, bootstrap: int = 2000, seed: int = 0) -> dict:
    """From grads [R, E, N, P]: SNR, ‖E g‖² and tr Cov g per (estimator, N), and bootstrap draws of the SNR."""
    import gradient_variance

    r = len(grads)
    own = torch.zeros(*grads.shape[1:3], r, r, dtype=torch.float64)
    for e in range(grads.shape[1]):
        for n in range(grads.shape[2]):
            g = grads[:, e, n].double()
            own[e, n] = g @ g.T
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(r, (bootstrap, r), generator=generator)
    weights = torch.zeros(bootstrap, r, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(bootstrap, r, dtype=torch.float64)
    )
    signal, power = gradient_variance.pair_means(own, torch.ones(1, r, dtype=torch.float64))
    boot_signal, boot_power = gradient_variance.pair_means(own, weights)
    return {
        "snr": (signal / (power - signal))[0],
        "signal": signal[0],
        "noise": (power - signal)[0],
        "boot_snr": boot_signal / (boot_power - boot_signal),
    }


def measure_snr(warm: Path, seed: int, replicates: int, prompts: int, task: list[str], reward: str) -> dict:
    """SNR of every pilot estimator at N in GROUP_SIZES at the warm start, for one pilot seed's prompts; ``reward``
    is the task scoring the responses (``copy_exact``; ``copy``, graded, in quick mode, whose tiny warm start never
    copies exactly)."""
    import gradient_variance
    from transformers import AutoModelForCausalLM

    from otb_train.tasks import synthetic_problem

    lengths = (int(task[task.index("--copy-lengths") + 1]), int(task[task.index("--copy-lengths") + 2]))
    max_new = int(task[task.index("--max-new-tokens") + 1])
    lm = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval()
    problems = [
        synthetic_problem("copy_exact", SNR_PROMPT_SEED + seed, i, copy_lengths=lengths) for i in range(prompts)
    ]
    grads, rewards, tokens, started = [], [], torch.zeros(len(GROUP_SIZES)), time.perf_counter()
    for replicate in range(replicates):
        sample = gradient_variance.sample_batch(
            lm, problems, max(GROUP_SIZES), replicate + 1, max_new, SNR_PROMPT_SEED + seed, reward
        )
        grads.append(batch_gradients(lm, sample, GROUP_SIZES, SNR_ESTIMATORS))
        rewards.append(float(sample.rewards.sum() / len(sample.mask)))
        for k, n in enumerate(GROUP_SIZES):
            tokens[k] += float(sample.mask.view(prompts, -1, sample.mask.shape[1])[:, :n].sum())
    stats = snr_statistics(torch.stack(grads), seed=seed)
    names, rloo, loo = list(SNR_ESTIMATORS), list(SNR_ESTIMATORS).index("rloo"), list(SNR_ESTIMATORS).index("otb_loo")
    ratio_draws = stats["boot_snr"][:, loo] / stats["boot_snr"][:, rloo]  # [S, N]
    ratio_interval = [
        [
            float(x)
            for x in torch.quantile(
                ratio_draws[:, k].nan_to_num(nan=0.0), torch.tensor([0.05, 0.95], dtype=torch.float64)
            )
        ]
        for k in range(len(GROUP_SIZES))
    ]
    return {
        "kind": "snr", "seed": seed, "replicates": replicates, "prompts": prompts, "group_sizes": list(GROUP_SIZES),
        "estimators": names, "snr": stats["snr"].tolist(), "signal": stats["signal"].tolist(),
        "noise": stats["noise"].tolist(), "contrast": (stats["snr"][loo] / stats["snr"][rloo]).tolist(),
        "contrast_90": ratio_interval, "mean_reward": statistics.mean(rewards),
        "tokens_per_batch": (tokens / replicates).tolist(), "seconds": round(time.perf_counter() - started),
        "machine": machine_name(),
    }  # fmt: skip


# ----------------------------------------------------------------------------- the pilot's report


def contrasts(snr_records: list[dict]) -> dict[int, float]:
    """N -> the contrast SNR(otb_loo) / SNR(rloo), as the ratio of the seeds' mean SNRs."""
    out = {}
    for k, n in enumerate(GROUP_SIZES):
        loo = statistics.mean(r["snr"][r["estimators"].index("otb_loo")][k] for r in snr_records)
        rloo = statistics.mean(r["snr"][r["estimators"].index("rloo")][k] for r in snr_records)
        out[n] = loo / rloo if rloo > 0 else math.inf
    return out


def pooled_spread(runs: list[dict]) -> tuple[float, int]:
    """(pooled within-cell standard deviation of :func:`reward_per_token` over seeds, its degrees of freedom); a cell
    is an arm x N x learning rate."""
    cells: dict[tuple, list[float]] = {}
    for record in runs:
        cells.setdefault((record["arm"], record["group_size"], record["lr"]), []).append(
            reward_per_token(record["rows"])
        )
    squares, df = 0.0, 0
    for values in cells.values():
        if len(values) > 1:
            squares += statistics.variance(values) * (len(values) - 1)
            df += len(values) - 1
    return (math.sqrt(squares / df) if df else math.nan), df


def report(records_dir: Path, out_dir: Path, seconds: float) -> Path:
    snr_records = [json.loads(p.read_text()) for p in sorted(records_dir.glob("snr_seed*.json"))]
    runs = load_runs(records_dir)
    sections = []
    if snr_records:
        names = snr_records[0]["estimators"]
        sections += [
            f"## SNR at the warm start ({len(snr_records)} pilot seeds, R = {snr_records[0]['replicates']} batches "
            f"of {snr_records[0]['prompts']} prompts each)",
            "",
            "| seed | mean reward | N | " + " | ".join(f"SNR {n}" for n in names) + " | otb_loo / rloo [90%] |",
            "|---|---|---|" + "---|" * len(names) + "---|",
        ]
        for r in snr_records:
            for k, n in enumerate(r["group_sizes"]):
                cells = " | ".join(f"{r['snr'][e][k]:.3g}" for e in range(len(names)))
                low, high = r["contrast_90"][k]
                sections.append(
                    f"| {r['seed']} | {r['mean_reward']:.3f} | {n} | {cells} | {r['contrast'][k]:.2f} "
                    f"[{low:.2f}, {high:.2f}] |"
                )
        sections.append("")
        for n, ratio in contrasts(snr_records).items():
            label = "variance contrast" if ratio >= CONTRAST else "**no variance contrast** (not read as a test)"
            sections.append(f"- N = {n}: SNR(otb_loo) / SNR(rloo) = {ratio:.2f} (ratio of seed means): {label}.")
        sections.append("")
    if runs:
        spread, df = pooled_spread(runs)
        sections += [
            f"## Seed-to-seed spread ({len(runs)} runs recorded of the planned: lr {SPREAD_LR:g} at N = 4 on seeds "
            f"{list(SPREAD_SEEDS)} and at N = 16 on seeds {list(SPREAD_SEEDS[:2])}; the top of the grid, lr "
            f"{', '.join(f'{lr:g}' for lr in PROBE_LRS)}, at N = {GROUP_SIZES[0]}, seed {SPREAD_SEEDS[0]})",
            "",
            "| arm | N | lr | mean reward per generated token, per seed | final reward (last 10% of steps) "
            "| median ‖Δθ‖ | seconds |",
            "|---|---|---|---|---|---|---|",
        ]
        for key in sorted({(r["arm"], r["group_size"], r["lr"]) for r in runs}):
            cell = [r for r in runs if (r["arm"], r["group_size"], r["lr"]) == key]
            values = ", ".join(f"{reward_per_token(r['rows']):.4f}" for r in cell)
            finals = ", ".join(f"{final_reward(r['rows']):.3f}" for r in cell)
            steps = ", ".join(f"{statistics.median(x['update_norm'] for x in r['rows']):.3g}" for r in cell)
            secs = ", ".join(str(r["wall_seconds"]) for r in cell)
            sections.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {values} | {finals} | {steps} | {secs} |")
        sections += [
            "",
            f"Pooled within-cell standard deviation: **{spread:.4f}** ({df} degrees of freedom). "
            "experiments/variance_lr.py takes its δ from the N = 4 cells at lr 3e-4 (seeds 100-102), the runs "
            "complete when it was committed; the probe and the N = 16 spread runs were stopped then, to leave the "
            "two cores to the grid (the grid's seed-0 runs at 1e-2 answer the probe's question).",
            "",
        ]
    sections.append("Design: the docstring of `experiments/variance_lr_pilot.py`.")
    return write_report(
        "variance_lr_pilot", "Pilot of the variance / learning-rate experiment", sections, seconds, out_dir
    )


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--commit", action="store_true", help="git commit each record when it is written")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--skip-spread", action="store_true", help="only the SNR part")
    parser.add_argument("--skip-snr", action="store_true", help="only the runs")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "variance_lr")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    records_dir = args.out_dir / "variance_lr_pilot"
    warm = args.out_dir / "variance_lr_warm_start" if not args.quick else args.runs_dir / "warm_start"
    task, steps = (QUICK_TASK, 2) if args.quick else (TASK, STEPS)
    snr_seeds, replicates, spread_seeds = (
        (SNR_SEEDS[:1], 3, SPREAD_SEEDS[:1]) if args.quick else (SNR_SEEDS, SNR_REPLICATES, SPREAD_SEEDS)
    )
    if not args.report_only:
        ensure_warm_start(warm, args.quick)
        for seed in [] if args.skip_snr else snr_seeds:
            path = records_dir / f"snr_seed{seed}.json"
            if path.exists():
                continue
            record = measure_snr(
                warm,
                seed,
                replicates,
                2 if args.quick else PROMPTS_PER_STEP,
                task,
                "copy" if args.quick else "copy_exact",
            )
            records_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record) + "\n")
            if args.commit:
                commit([path], f"results/variance_lr_pilot: SNR at the warm start, pilot seed {seed}")
        # N = 4 at every pilot seed, then the probe of the grid's top, then N = 16 at two seeds (the order in which
        # they are run: on a shared 2-core machine the driver's δ uses the cells complete by its commit).
        todo = [(arm, GROUP_SIZES[0], SPREAD_LR, seed) for seed in spread_seeds for arm in PRIMARY]
        todo += [(arm, GROUP_SIZES[0], lr, spread_seeds[0]) for lr in PROBE_LRS for arm in PRIMARY if not args.quick]
        todo += [(arm, n, SPREAD_LR, seed) for seed in spread_seeds[:2] for n in GROUP_SIZES[1:] for arm in PRIMARY]
        todo = [item for item in todo if not (records_dir / f"{run_name(*item)}.json").exists()]
        if not args.skip_spread and todo:
            from concurrent.futures import ThreadPoolExecutor

            def job(item):
                arm, n, lr, seed = item
                name, flags, begun = run_name(arm, n, lr, seed), run_flags(task, arm, n, lr), time.perf_counter()
                run = run_one(name, flags, seed, steps, warm, args.runs_dir / "pilot", AIM_STEPS)
                meta = {"name": name, "arm": arm, "group_size": n, "lr": lr, "seed": seed, "flags": flags}
                path = write_run_record(meta, run, time.perf_counter() - begun, records_dir)
                if args.commit:
                    commit([path], f"results/variance_lr_pilot: {name} ({steps} steps, {machine_name()})")

            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                list(pool.map(job, todo))
    return report(records_dir, args.out_dir, time.perf_counter() - started)


if __name__ == "__main__":
    print(main())
