"""The pilot of experiments/variance_lr.py (issue 28): is there a variance contrast to test, and how large is the
seed-to-seed spread of the metric? Its runs and records are common/variance_runs.py, shared with the driver.

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
import statistics
import time
from pathlib import Path

import torch

from common import commit, machine_name, write_report
from common.gradients import sample_batch, snr_statistics
from common.variance_runs import (
    AIM_STEPS,
    CONTRAST,
    GROUP_SIZES,
    PRIMARY,
    PROMPTS_PER_STEP,
    QUICK_TASK,
    STEPS,
    TASK,
    contrasts,
    ensure_warm_start,
    final_reward,
    load_runs,
    reward_per_token,
    run_flags,
    run_name,
    run_one,
    write_run_record,
)

ROOT = Path(__file__).resolve().parents[1]

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


# ----------------------------------------------------------------------------- SNR at the warm start


def batch_gradients(lm, sample, sizes, estimators: dict) -> torch.Tensor:
    """[E, len(sizes), P]: each estimator's gradient of the token-mean surrogate on the first N responses of every
    group of ``sample`` (a common.gradients.Sample), one forward and one backward per (estimator, N)."""
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


def measure_snr(warm: Path, seed: int, replicates: int, prompts: int, task: list[str], reward: str) -> dict:
    """SNR of every pilot estimator at N in GROUP_SIZES at the warm start, for one pilot seed's prompts; ``reward``
    is the task scoring the responses (``copy_exact``; ``copy``, graded, in quick mode, whose tiny warm start never
    copies exactly)."""
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
        sample = sample_batch(lm, problems, max(GROUP_SIZES), replicate + 1, max_new, SNR_PROMPT_SEED + seed, reward)
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
