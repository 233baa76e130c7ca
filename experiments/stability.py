"""Long-horizon stability: does some baseline's gradient norm surge, or training collapse, where OTB stays stable?

    python experiments/stability.py            # 3 estimators x 3 seeds, results/stability.md + PNG
    python experiments/stability.py --quick    # seconds (the test suite)
    python experiments/stability.py --lr 3e-3 --epochs 4 --runs-dir runs/stability_harsh \
        --out-dir results/stability_harsh      # the harsher setting (results/stability_harsh/)

Setting: the reproduction's warm start and ``copy_exact`` task (responses of 65-81 tokens, 0/1 reward), pushed
toward instability by a learning rate 10x the reproduction's (1e-3) and two PPO epochs of two mini-batches per
step (off-policy updates within a step), gradient clipping at 1.0 as usual. Same flags for every arm; only the
estimator differs, at N = 8. Reported per arm (mean ± std over seeds): the pre-clipping gradient-norm maximum
and median, spikes (steps above ``SPIKE_FACTOR`` x the run's median), reward at the start, peak and end, the
final entropy, and whether the run collapsed (final reward below half its starting reward). These are
measurements, not a verdict chosen in advance: the report states what happened.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import reproduction  # noqa: E402
from common import new_figure, write_report  # noqa: E402

ARMS = {name: ["--estimator", name, "--group-size", "8"] for name in ("grpo", "rloo", "otb")}


def common_flags(lr: str, epochs: int) -> list[str]:
    """The flags every arm shares; only the estimator differs between arms."""
    return [
        "--prompts-per-step",
        "8",
        "--lr",
        lr,
        "--epochs",
        str(epochs),
        "--mini-batches",
        "2",
        *reproduction.RUN_FLAGS,
    ]


def _positive_number(text: str) -> str:
    """argparse type: ``text`` unchanged if it reads as a positive finite number (so the report shows it as given)."""
    try:
        ok = 0 < float(text) < float("inf")
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return text


def summarize(records: list[dict]) -> dict:
    base = reproduction.run_summary(records, records[-1]["tokens"])
    start = sum(r["reward_mean"] for r in records[:5]) / len(records[:5])
    return {**base, "start_reward": start, "collapsed": base["final_reward"] < 0.5 * start}


def plot(by_arm: dict[str, list[list[dict]]], out_dir: Path) -> None:
    figure, (norm_axis, reward_axis) = new_figure(2)
    for name, seeds in by_arm.items():
        color = None
        for records in seeds:
            tokens = [r["tokens"] for r in records]
            line = norm_axis.plot(
                tokens, [r["grad_norm"] for r in records], lw=0.7, color=color, label=name if color is None else None
            )[0]
            color = line.get_color()
            points = reproduction.smoothed(records, reproduction.SMOOTH_TOKENS)
            reward_axis.plot([t for t, _ in points], [r for _, r in points], lw=0.8, color=color)
    norm_axis.set(xlabel="generated tokens", ylabel="gradient norm before clipping", yscale="log", title="every seed")
    reward_axis.set(xlabel="generated tokens", ylabel="reward (trailing window)", title="every seed")
    norm_axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / "stability.png", dpi=110)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--token-budget", type=int, default=120_000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--lr", type=_positive_number, default="1e-3", help="learning rate of every arm (passed to train.py as written)"
    )
    parser.add_argument("--epochs", type=int, default=2, help="PPO epochs per step, every arm")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "stability")
    parser.add_argument("--warm", type=Path, default=ROOT / "runs" / "reproduction" / "warm_start")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    started, task = time.perf_counter(), reproduction.QUICK_TASK if args.quick else reproduction.TASK
    if args.quick:
        args.seeds, args.token_budget = args.seeds[:1], 300
        args.warm = reproduction.ensure_warm_start(args.runs_dir / "warm_start", task)
    if not (args.warm / "config.json").exists():
        raise SystemExit(f"stability.py: error: {args.warm}: no warm start; run experiments/reproduction.py first")
    jobs = [(name, seed) for seed in args.seeds for name in ARMS]

    def one(job):
        name, seed = job
        flags = [*task, *common_flags(args.lr, args.epochs), *ARMS[name]]
        return reproduction.run_arm(name, seed, args.token_budget, args.warm, args.runs_dir, flags)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outs = list(pool.map(one, jobs))
    by_arm: dict[str, list[list[dict]]] = {}
    for (name, _), out in zip(jobs, outs):
        by_arm.setdefault(name, []).append([json.loads(line) for line in (out / "metrics.jsonl").open()])
    summaries = {name: [summarize(records) for records in seeds] for name, seeds in by_arm.items()}
    keys = [
        "steps",
        "start_reward",
        "peak_reward",
        "final_reward",
        "grad_norm_median",
        "grad_norm_max",
        "grad_norm_spikes",
        "entropy_final",
    ]
    lines = ["| estimator | seeds | collapsed | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for name, runs in summaries.items():
        cells = [reproduction.mean_spread([r[k] for r in runs]) for k in keys]
        collapsed = sum(r["collapsed"] for r in runs)
        lines.append(f"| {name} | {len(runs)} | {collapsed}/{len(runs)} | " + " | ".join(cells) + " |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(by_arm, args.out_dir)
    (args.out_dir / "stability.json").write_text(json.dumps(summaries, indent=1))
    # A collapsed run (every reward 0: zero advantages) can have a median gradient norm of 0: its max/median is
    # undefined and every nonzero step counts as a spike. Such runs are left out of the ratio and named.
    ratios = {
        name: [r["grad_norm_max"] / r["grad_norm_median"] for r in runs if r["grad_norm_median"] > 0]
        for name, runs in summaries.items()
    }
    zero_median = {name: sum(r["grad_norm_median"] == 0 for r in runs) for name, runs in summaries.items()}
    sections = [
        f"Warm start: `{args.warm}`; task flags `{' '.join(task)}`; common flags "
        f"`{' '.join(common_flags(args.lr, args.epochs))}`; N = 8; "
        f"token budget {args.token_budget}; seeds {args.seeds}.",
        "",
        *lines,
        "",
        "Largest gradient norm over the run's median, mean over seeds: "
        + ", ".join(f"{k} {statistics.mean(v):.1f}x" if v else f"{k} undefined" for k, v in ratios.items())
        + "."
        + "".join(
            f" {k}: {n} of {len(summaries[k])} runs have a median gradient norm of 0 (collapsed: all rewards 0), "
            "left out of the ratio; their spikes count every nonzero step."
            for k, n in zero_median.items()
            if n
        ),
        "",
        "![gradient norm and reward vs generated tokens](stability.png)",
    ]
    return write_report(
        "stability",
        "Stability at a long horizon: gradient-norm surges and collapse",
        sections,
        time.perf_counter() - started,
        args.out_dir,
    )


if __name__ == "__main__":
    print(main())
