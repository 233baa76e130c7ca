"""What makes training collapse here: the step size, or the gradient's variance? (issue 22, part 3 (a))

    python experiments/stability.py --commit          # every arm x seed not yet recorded, then the report
    python experiments/stability.py --report-only     # the report from the committed records alone
    python experiments/stability.py --quick           # seconds (the test suite)

The earlier harsh setting (lr 3e-3, 4 PPO epochs x 2 mini-batches per step, N = 8) collapsed GRPO, RLOO and OTB
alike, 9k-55k tokens in, with no gradient-norm surge before. To separate the two causes, the step size is held
fixed and the variance is varied: the same learning rate, epochs and mini-batches for every arm, with N = 8 and
N = 32 responses per prompt (N = 32 has about 4x less gradient variance per step). Design and reading, fixed
before the runs:

* **Setting.** The reproduction's warm start and ``copy_exact`` task (responses of 65-81 tokens), 8 prompts per
  step, lr 3e-3 constant (no warmup), 4 epochs x 2 mini-batches, gradient clip 1.0, :data:`STEPS` steps for every
  arm (equal steps: the step count, not a token budget, is what the step-size hypothesis is about).
* **Arms.** grpo, rloo, otb at N = 8; grpo, otb at N = 32. Seeds 0-2.
* **Collapse.** The mean reward of the last 5 steps is below half that of the first 5.
* **Reading.** If the N = 32 arms collapse in as many seeds as their N = 8 twins, the numbers point to the step
  size; if N = 32 does not collapse where N = 8 does, they point to variance. The report also gives, per run, the
  largest update size ‖Δθ‖ and KL of a step before the reward became all zero (raw gradient norms are not
  comparable across estimators: OTB's is 27-120x smaller than GRPO's) and the step of collapse.
* Part (b) of the issue (responses of ≥ 256 tokens, sparse 5-20% reward, small updates) is not run here: its warm
  start alone is beyond this machine's sessions so far.

Each finished run leaves a compact record in ``results/stability/``; the report reads only those.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import (
    QUICK_TASK,
    RUN_FLAGS,
    collapse,
    driver_parser,
    load_records,
    plot_per_step,
    run_missing,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]

ARMS = {
    "grpo_n8": ["--estimator", "grpo", "--group-size", "8"],
    "rloo_n8": ["--estimator", "rloo", "--group-size", "8"],
    "otb_n8": ["--estimator", "otb", "--group-size", "8"],
    "grpo_n32": ["--estimator", "grpo", "--group-size", "32"],
    "otb_n32": ["--estimator", "otb", "--group-size", "32"],
}
SEEDS = [0, 1, 2]
STEPS = 30
TASK = ["--task", "copy_exact", "--copy-lengths", "64", "80", "--max-new-tokens", "96"]  # the reproduction's task
COMMON = ["--prompts-per-step", "8", "--lr", "3e-3", "--min-lr-ratio", "1", "--epochs", "4", "--mini-batches", "2",
          *RUN_FLAGS]  # fmt: skip


def _before_collapse(rows: list[dict]) -> list[dict]:
    """The steps before the reward became all zero for good (all steps if it never did): after it, advantages are
    0 and the updates only Adam's momentum, so statistics over the whole run would describe the collapsed state."""
    zero_from = collapse(rows)["zero_from"]
    return [r for r in rows if zero_from is None or r["step"] < zero_from] or rows[:1]


def _largest(rows: list[dict], key: str) -> float:
    values = [r[key] for r in _before_collapse(rows) if r[key] is not None]
    return max(values) if values else float("nan")


def table(by_arm: dict[str, dict[int, list[dict]]]) -> list[str]:
    head = "| arm | seeds | collapsed | all-zero reward from step | start → end reward | max grad norm | max ‖Δθ‖ of a step | max KL of a step |"  # noqa: E501
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for arm in [a for a in ARMS if a in by_arm]:
        runs = list(by_arm[arm].values())
        states = [collapse(rows) for rows in runs]
        zero = [str(s["zero_from"]) for s in states if s["zero_from"] is not None]
        cells = [
            str(len(runs)), f"{sum(s['collapsed'] for s in states)}/{len(runs)}", ", ".join(zero) or "—",
            f"{statistics.mean(s['start'] for s in states):.3f} → {statistics.mean(s['end'] for s in states):.3f}",
            ", ".join(f"{max(r['grad_norm'] for r in rows):.3g}" for rows in runs),
            ", ".join(f"{_largest(rows, 'update_norm'):.3g}" for rows in runs),
            ", ".join(f"{_largest(rows, 'approx_kl'):.2g}" for rows in runs),
        ]  # fmt: skip
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def reading(by_arm: dict[str, dict[int, list[dict]]]) -> str:
    """The reading fixed before the runs, applied to each estimator that has both group sizes."""
    parts = []
    for estimator in ("grpo", "otb"):
        small, large = by_arm.get(f"{estimator}_n8"), by_arm.get(f"{estimator}_n32")
        if not small or not large:
            continue
        n8 = sum(collapse(rows)["collapsed"] for rows in small.values())
        n32 = sum(collapse(rows)["collapsed"] for rows in large.values())
        if n8 == 0:
            word = "no N = 8 run collapsed: nothing to explain"
        elif n32 >= n8 * len(large) / len(small):
            word = "N = 32 collapses as often: the step size"
        elif n32 == 0:
            word = "N = 32 never collapses: the variance"
        else:
            word = "N = 32 collapses less often: mixed"
        parts.append(f"{estimator}: {n8}/{len(small)} at N = 8, {n32}/{len(large)} at N = 32 ({word})")
    return "Reading: " + ("; ".join(parts) if parts else "not computed yet (both group sizes needed)") + "."


def plot(by_arm: dict[str, dict[int, list[dict]]], out_dir: Path) -> list[str]:
    plot_per_step(by_arm, list(ARMS), "update_norm", "‖Δθ‖ of the step", out_dir / "stability.png")
    return ["![reward and update size per step](stability.png)"]


def main(argv: list[str] | None = None) -> Path:
    parser = driver_parser(__doc__, ARMS, SEEDS, ROOT / "runs" / "stability")
    parser.add_argument("--warm", type=Path, default=ROOT / "runs" / "reproduction" / "warm_start")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    task, steps = (QUICK_TASK, 2) if args.quick else (TASK, STEPS)
    if args.quick:
        args.seeds = args.seeds[:1]
    records_dir = args.out_dir / "stability"
    if not args.report_only:
        warm = args.runs_dir / "warm_start" if args.quick else args.warm
        run_missing(args, ARMS, COMMON, task, steps, warm, records_dir)
    by_arm = load_records(records_dir)
    sections = [
        f"Arms x seeds recorded: {sum(len(v) for v in by_arm.values())} of {len(ARMS) * len(SEEDS)} (one compact "
        f"record per run in `{records_dir.name}/` beside this report). Task flags: `{' '.join(task)}`; common flags: "
        f"`{' '.join(COMMON)}`; {steps} steps per run.",
        "",
        *table(by_arm),
        "",
        reading(by_arm),
        "",
        "Design and reading (fixed before the runs): the docstring of `experiments/stability.py`.",
        "",
    ]
    if by_arm:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        sections += plot(by_arm, args.out_dir)
    title = "Stability: step size or variance? N = 8 and N = 32 at one step size"
    return write_report("stability", title, sections, time.perf_counter() - started, args.out_dir)


if __name__ == "__main__":
    print(main())
