"""Does OTB with N = 4 reach what GRPO with N = 32 reaches with ≥ 65% fewer generated tokens? (issue 22, part 2)

    python experiments/reproduction.py                    # every arm x seed not yet recorded, then the report
    python experiments/reproduction.py --commit           # ... and `git commit` each run's record as it finishes
    python experiments/reproduction.py --report-only      # the report from the committed records alone
    python experiments/reproduction.py --quick            # seconds: tiny warm start, 2 steps (the test suite)

Design and verdict rule, fixed before any run (docs/EXPERIMENTS.md says the same):

* **Task and start.** ``copy_exact`` with answers of 64-80 digits (responses 65-81 tokens; reward 1 only for the
  exact answer + EOS), from the supervised warm start of ``experiments/warm_start.py`` (width 128, stopped at the
  first evaluation with sampled reward ≥ 0.3).
* **Equal steps, no budget-dependent schedule.** Every arm runs :data:`STEPS` optimizer steps (≥ the 173 the N = 4
  arms took before), on-policy, 4 prompts per step, one constant learning rate 1e-4 (the warm start's 3e-3 / 30,
  not tuned on any arm; no warmup, ``--min-lr-ratio 1``), token-mean loss, clip 0.2, gradient clip 1.0.
* **Arms.** ``grpo_n32`` (the reference), ``otb_n4``, ``grpo_n4``, and two controls: ``reinforce_n4`` (no baseline,
  4 responses per prompt: ``--no-baseline``) and ``otb_loo_n4`` (leave-one-out OTB: include-self OTB is biased at
  small N, F7). Seeds 0-4.
* **Curves.** Reward against generated tokens is a trailing mean over the last :data:`WINDOW_TOKENS` generated
  tokens (about 256 responses for every arm, so N = 4 and N = 32 are smoothed alike).
* **Reference level.** τ = the mean over seeds of GRPO N = 32's reward over its last :data:`PLATEAU_STEPS` steps.
  It is at its plateau if that mean exceeds the mean of the :data:`PLATEAU_STEPS` steps before by less than δ; the
  report says which.
* **Metric.** T = generated tokens when the trailing curve first reaches τ − δ, δ = :data:`DELTA`. A run that never
  does is censored (reported as such): a censored GRPO N = 32 run counts its last token count (understating the
  saving), a censored run of another arm counts as never reaching it (T = ∞). Saving = 1 − mean T(otb_n4) /
  mean T(grpo_n32), with a 95% bootstrap interval over seeds (each arm resampled, 10,000 draws, seed 0).
* **Verdict.** An arm *meets the claim* when the lower end of its saving's interval is ≥ 0.65.
  *Reproduced*: otb_n4 meets it, otb_n4 reaches τ − δ in fewer tokens than grpo_n4 in most paired seeds
  (> half), and reinforce_n4 does not meet it. *Not attributable to OTB*: otb_n4 meets it and so does
  reinforce_n4 (the task, not the baseline, made the saving). *Partially*: the saving's point estimate is ≥ 0.65
  but its interval reaches below, the other two conditions holding. *Not reproduced*: otherwise. The leave-one-out
  control's saving and its paired comparison with otb_n4 are reported beside it.

Each finished run leaves a compact record (per step: tokens, reward, gradient norm, update size, KL, entropy) in
``results/reproduction/``; the report reads only those records, so a later session resumes where one stopped.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import QUICK_TASK, RUN_FLAGS, driver_parser, load_records, new_figure, run_missing, write_report
from common.reproduction_rule import (
    DELTA,
    PLATEAU_STEPS,
    STEPS,
    TASK,
    WINDOW_TOKENS,
    analyse,
    saving_text,
    smoothed,
    step_mean,
    window,
)

ROOT = Path(__file__).resolve().parents[1]

ARMS = {  # name -> train.py flags
    "grpo_n32": ["--estimator", "grpo", "--group-size", "32"],
    "otb_n4": ["--estimator", "otb", "--group-size", "4"],
    "grpo_n4": ["--estimator", "grpo", "--group-size", "4"],
    "reinforce_n4": ["--estimator", "rloo", "--group-size", "4", "--no-baseline"],
    "otb_loo_n4": ["--estimator", "otb", "--group-size", "4", "--leave-one-out"],
}
SEEDS = [0, 1, 2, 3, 4]
COMMON = ["--prompts-per-step", "4", "--lr", "1e-4", "--min-lr-ratio", "1", *RUN_FLAGS]
CLAIM = 0.65


def ahead(hits: dict, arm: str, other: str) -> tuple[int, int]:
    """(seeds where ``arm`` reached the target in fewer tokens than ``other``, paired seeds)."""
    seeds = sorted(set(hits.get(arm, {})) & set(hits.get(other, {})))
    wins = 0
    for seed in seeds:
        (t_arm, reached_arm), (t_other, reached_other) = hits[arm][seed], hits[other][seed]
        wins += reached_arm and (not reached_other or t_arm < t_other)
    return wins, len(seeds)


def verdict(analysis: dict) -> str:
    savings, hits = analysis["savings"], analysis["hits"]
    needed = {"otb_n4", "grpo_n4", "reinforce_n4"}
    if not needed <= set(savings):
        return f"Verdict: not computed yet (records missing for {sorted(needed - set(savings))})."
    meets = {arm: low >= CLAIM for arm, (_, low, _) in savings.items()}
    wins, paired = ahead(hits, "otb_n4", "grpo_n4")
    majority = wins > paired / 2
    if meets["otb_n4"] and meets["reinforce_n4"]:
        word = "not attributable to OTB (the no-baseline control meets the claim too)"
    elif meets["otb_n4"] and majority:
        word = "reproduced"
    elif savings["otb_n4"][0] >= CLAIM and majority and not meets["reinforce_n4"]:
        word = "partially reproduced (the saving's point estimate meets the claim, its interval does not)"
    else:
        word = "not reproduced"
    return (
        f"Verdict: **{word}**. OTB N=4 saving vs GRPO N=32 [95% interval]: {saving_text(*savings['otb_n4'])}; "
        f"OTB N=4 ahead of GRPO N=4 in {wins} of {paired} paired seeds."
    )


def _cell(values: list[float], digits: str = ".3g") -> str:
    if not values:
        return "—"
    text = format(statistics.mean(values), digits)
    return text + (f" ± {format(statistics.stdev(values), '.2g')}" if len(values) > 1 else "")


def table(by_arm: dict[str, dict[int, list[dict]]], analysis: dict | None) -> list[str]:
    head = "| arm | seeds | steps | start reward | final reward (last 40 steps) | tokens to τ − δ (reached) | saving vs grpo_n32 [95%] | median grad norm | median update norm | median KL |"  # noqa: E501
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in [a for a in ARMS if a in by_arm]:
        runs = list(by_arm[arm].values())
        median = lambda key: [statistics.median(r[key] for r in rows if r[key] is not None) for rows in runs]  # noqa: E731
        to_target, saving = "—", "—"
        if analysis is not None:
            hits = list(analysis["hits"][arm].values())
            to_target = f"{_cell([t for t, _ in hits], '.0f')} ({sum(r for _, r in hits)}/{len(hits)})"
            if arm in analysis["savings"]:
                saving = saving_text(*analysis["savings"][arm])
        cells = [
            str(len(runs)), _cell([rows[-1]["step"] for rows in runs], ".0f"),
            _cell([rows[0]["reward_mean"] for rows in runs]),
            _cell([step_mean(rows[-window(rows) :]) for rows in runs]),
            to_target, saving, _cell(median("grad_norm")), _cell(median("update_norm")), _cell(median("approx_kl")),
        ]  # fmt: skip
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def plot(by_arm: dict[str, dict[int, list[dict]]], analysis: dict | None, out_dir: Path) -> list[str]:
    figure, (reward_axis, update_axis) = new_figure(2, width=5.5)
    for arm in [a for a in ARMS if a in by_arm]:
        runs = list(by_arm[arm].values())
        end = min(rows[-1]["tokens"] for rows in runs)
        grid = [end * i / 60 for i in range(1, 61)]
        curves = [[next((r for t, r in reversed(smoothed(rows, WINDOW_TOKENS)) if t <= x), float("nan")) for x in grid]
                  for rows in runs]  # fmt: skip
        line = reward_axis.plot(grid, [statistics.mean(c[i] for c in curves) for i in range(len(grid))], label=arm)[0]
        for rows in runs[:1]:
            update_axis.plot(
                [r["step"] for r in rows], [r["update_norm"] for r in rows], lw=0.8, color=line.get_color()
            )
    if analysis is not None:
        reward_axis.axhline(analysis["target"], color="grey", ls=":", lw=0.8, label="τ − δ")
    reward_axis.set(xscale="log", xlabel="generated tokens", ylabel="reward (trailing window)", title="mean over seeds")
    update_axis.set(xlabel="optimizer step", ylabel="‖Δθ‖ per step (first seed)", title="update size")
    reward_axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / "reproduction.png", dpi=110)
    return ["![reward vs generated tokens, update size per step](reproduction.png)"]


def main(argv: list[str] | None = None) -> Path:
    args = driver_parser(__doc__, ARMS, SEEDS, ROOT / "runs" / "reproduction").parse_args(argv)
    started = time.perf_counter()
    task, steps = (QUICK_TASK, 2) if args.quick else (TASK, STEPS)
    if args.quick:
        args.seeds = args.seeds[:1]
    records_dir = args.out_dir / "reproduction"
    if not args.report_only:
        run_missing(args, ARMS, COMMON, task, steps, args.runs_dir / "warm_start", records_dir)
    by_arm = load_records(records_dir)
    analysis = analyse(by_arm) if "grpo_n32" in by_arm else None
    sections = [
        f"Arms x seeds recorded: {sum(len(v) for v in by_arm.values())} of {len(ARMS) * len(SEEDS)} "
        f"(one compact record per run in `{records_dir.name}/` beside this report). "
        f"Task flags: `{' '.join(task)}`; common flags: `{' '.join(COMMON)}`; {steps} steps per run.",
        "",
    ]
    if analysis is not None:
        sections += [
            f"Reference level τ = {analysis['tau']:.3f} (GRPO N=32, mean over seeds of its last {PLATEAU_STEPS} "
            f"steps); its gain over the {PLATEAU_STEPS} steps before: {analysis['gain_last_window']:+.3f} "
            f"({'plateau' if analysis['plateau'] else 'NOT at plateau: τ is a lower bound'}). Target τ − δ = "
            f"{analysis['target']:.3f} (δ = {DELTA}).",
            "",
        ]
    sections += [*table(by_arm, analysis), ""]
    if analysis is not None:
        for arm, other in (("otb_n4", "grpo_n4"), ("otb_n4", "otb_loo_n4"), ("otb_n4", "reinforce_n4")):
            wins, paired = ahead(analysis["hits"], arm, other)
            sections.append(f"- {arm} reached τ − δ in fewer tokens than {other} in {wins} of {paired} paired seeds.")
        sections += ["", verdict(analysis), ""]
    sections += ["Design and verdict rule (fixed before the runs): see the docstring of `experiments/reproduction.py`"
                 " and docs/EXPERIMENTS.md.", ""]  # fmt: skip
    if by_arm:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        sections += plot(by_arm, analysis, args.out_dir)
    title = "Reproduction: generated tokens for OTB N=4 to reach GRPO N=32's level (equal steps)"
    return write_report("reproduction", title, sections, time.perf_counter() - started, args.out_dir)


if __name__ == "__main__":
    print(main())
