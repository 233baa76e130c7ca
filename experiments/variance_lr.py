"""Variance, at each estimator's own best learning rate: leave-one-out OTB vs RLOO (issue 28).

    python experiments/variance_lr.py --commit          # every run not yet recorded (selection first), the report
    python experiments/variance_lr.py --report-only     # results/variance_lr.md from the committed records alone
    python experiments/variance_lr.py --quick           # seconds (the test suite)

RLOO and leave-one-out OTB are both unbiased with the same expected gradient (F7): they differ only in variance. One
learning rate for both (the reproduction's 1e-4) can favour either, so each is compared at its own best rate, and
the mechanism is read beside the winner. Design and decision rule, fixed and committed before any run of
``results/variance_lr/`` (docs/EXPERIMENTS.md says the same):

* **Task and warm start** (experiments/variance_lr_pilot.py): ``copy_exact`` with answers of 16-24 digits
  (responses of 17-25 tokens), from the committed warm start ``results/variance_lr_warm_start/`` (width 64,
  125,376 parameters, sampled exact-copy rate 0.414). The pilot measured SNR(otb_loo) / SNR(rloo) there: an N where
  it is below 1.5 is labelled "no variance contrast" and its comparison is reported, not read as a test (measured:
  2.00 at N = 4 and 10.9 at N = 16 over 3 pilot seeds, results/variance_lr_pilot.md: both N are tests).
* **Runs.** :data:`STEPS` = 150 steps each from that warm start, 8 prompts per step, N in {4, 16} responses per
  prompt, on-policy (1 epoch x 1 mini-batch), AdamW, the same 10-step linear warmup then a constant rate for every
  arm, no gradient clipping (``--grad-clip 0``) for every arm, token-mean loss, PPO clip 0.2, temperature 1.
* **Arms.** ``rloo`` and ``otb_loo`` (``--estimator otb --leave-one-out``). The secondary pair ``grpo_nostd`` vs
  ``otb`` (include-self; biased differently) runs only when named with ``--arms`` and is reported apart.
* **Learning-rate grid** :data:`LRS`, the same for every arm, from stable (1e-4, the reproduction's rate; 3e-4
  took the pilot's runs from 0.4 to 0.8) to 1e-2 (meant to collapse; the report says which runs did).
* **Selection.** Seeds 0-2 at every rate of the grid. Each arm x N's best rate is the one with the highest mean
  over seeds 0-2 of the metric; a tie (equal to 4 decimals) goes to the smaller rate.
* **Test.** Seeds 3-7, fresh, at each arm x N's selected rate; otb_loo and rloo are paired by seed (the same
  prompt stream and sampling uniforms), n = 5.
* **Metric.** M = the run's mean reward per generated token (the area under reward vs generated tokens divided by
  the tokens); also the final reward (mean over the last 15 steps). Paired differences d = otb_loo − rloo, their
  mean with a 95% t interval (n − 1 degrees of freedom).
* **Decision rule, at each N.** *Variance reduction matters at N* if d(M) ≥ δ in at least k of the 5 paired test
  seeds; *RLOO better at N* if d(M) ≤ −δ in at least k of them; otherwise *no difference of δ at N*. δ =
  :data:`DELTA` = 0.0104, the pilot's pooled seed-to-seed standard deviation of M (6 runs: rloo and
  otb_loo at N = 4, lr 3e-4, seeds 100-102; 4 degrees of freedom), used at both N; k =
  :data:`K` = 4. With no true difference and d ~ Normal(0, 2σ²), P(d ≥ σ) ≈ 0.24 and P(≥ 4 of 5) ≈ 0.013 for each
  direction; a true difference of 2σ passes with probability ≈ 0.65.
* **Mechanism** (every run): ‖Δθ‖ of every step, and at steps :data:`AIM_STEPS` the cosine between the update Δθ and
  a reference gradient (RLOO, 16 fresh prompts x 32 responses at the current parameters; experiments/aimed_train.py),
  and between the step's own gradient and it. The report says whether otb_loo's selected rate is higher than
  rloo's, and, at each rate of the grid (seeds 0-2, paired), whether otb_loo's updates are better aimed at equal
  step size.

Each finished run leaves a compact record ``results/variance_lr/<arm>_n<N>_lr<rate>_seed<seed>.json``; the report
reads only those, so a later session resumes where one stopped (``--commit`` commits each record as it ends).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import commit, machine_name, write_report
from common.variance_rule import (
    DELTA,
    LRS,
    SELECTION_SEEDS,
    STABLE_LRS,
    TEST_SEEDS,
    WINDOWS,
    K,
    cells,
    collapsed,
    decide,
    dependence,
    interval_text,
    mean_sd,
    median_step,
    paired,
    select,
    sign_flip_p,
    test_comparison,
)
from common.variance_runs import (
    AIM_STEPS,
    ARMS,
    COMMON,
    CONTRAST,
    GROUP_SIZES,
    PRIMARY,
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

SECONDARY = ("grpo_nostd", "otb")
QUICK = {"lrs": (1e-3,), "selection": (0,), "test": (1,), "group_sizes": (2,), "steps": 2, "aim": (1,)}


# ----------------------------------------------------------------------------- reading the records


def contrast_labels(pilot_dir: Path) -> dict[int, float]:
    records = [json.loads(p.read_text()) for p in sorted(pilot_dir.glob("snr_seed*.json"))]
    return contrasts(records) if records else {}


def verdict(comparisons: dict[int, dict], contrast: dict[int, float], delta: float) -> str:
    parts = []
    for n, comparison in comparisons.items():
        if comparison is None or "d_metric" not in comparison:
            parts.append(f"N = {n}: not decided yet (selection incomplete)")
            continue
        d = comparison["d_metric"]
        word = decide(d["diffs"], delta)
        above = sum(x >= delta for x in d["diffs"])
        below = sum(x <= -delta for x in d["diffs"])
        label = "" if contrast.get(n, math.inf) >= CONTRAST else " (no variance contrast: not read as a test)"
        rates = ", ".join(f"{arm} lr {lr:g}" for arm, lr in comparison["chosen"].items())
        parts.append(
            f"N = {n}: **{word}**{label}; {rates}; d(M) = otb_loo − rloo = {interval_text(d)}, ≥ δ in {above}, ≤ −δ "
            f"in {below} of {len(d['diffs'])} seeds; d(final reward) = {interval_text(comparison['d_final'], 3)}"
        )
    return "Verdict: " + "; ".join(parts) + "."


# ----------------------------------------------------------------------------- mechanism


def aim_mean(record: dict, key: str) -> float:
    values = [line[key] for line in record.get("aim", []) if line.get(key) is not None and math.isfinite(line[key])]
    return statistics.mean(values) if values else math.nan


def grid_table(by_cell: dict, arms, group_sizes, lrs, seeds) -> list[str]:
    head = ("| arm | N | lr | seeds | M (mean ± sd) | final reward | collapsed | median ‖Δθ‖ | cos(Δθ, g_ref) "
            "| cos(g, g_ref) | cos of the reference's halves |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in group_sizes:
        for arm in arms:
            for lr in lrs:
                runs = [r for s, r in by_cell.get((arm, n, lr), {}).items() if s in seeds]
                if not runs:
                    continue
                cells_ = [
                    str(len(runs)),
                    mean_sd([reward_per_token(r["rows"]) for r in runs]),
                    mean_sd([final_reward(r["rows"]) for r in runs], 3),
                    f"{sum(map(collapsed, runs))}/{len(runs)}",
                    mean_sd([median_step(r) for r in runs], 3),
                    *(mean_sd([aim_mean(r, key) for r in runs], 3) for key in ("cos_update", "cos_grad", "cos_halves")),
                ]
                lines.append(f"| {arm} | {n} | {lr:g} | " + " | ".join(cells_) + " |")
    return lines


def aim_comparison(by_cell: dict, group_sizes, lrs, seeds, arms=PRIMARY) -> list[str]:
    """At each N and rate, paired over the selection seeds: otb_loo − rloo in cos(Δθ, g_ref), and the ratio of
    their median ‖Δθ‖ (equal step size when near 1)."""
    lines = [
        "| N | lr | seeds | Δ cos(Δθ, g_ref), otb_loo − rloo | Δ cos(g, g_ref) | median ‖Δθ‖ ratio otb_loo / rloo |",
        "|---|---|---|---|---|---|",
    ]
    for n in group_sizes:
        for lr in lrs:
            a, b = by_cell.get((arms[1], n, lr), {}), by_cell.get((arms[0], n, lr), {})
            both = [s for s in seeds if s in a and s in b]
            if not both:
                continue
            cos_u = paired(
                {s: aim_mean(a[s], "cos_update") for s in both}, {s: aim_mean(b[s], "cos_update") for s in both}
            )
            cos_g = paired({s: aim_mean(a[s], "cos_grad") for s in both}, {s: aim_mean(b[s], "cos_grad") for s in both})
            ratio = statistics.mean(median_step(a[s]) / max(median_step(b[s]), 1e-30) for s in both)
            lines.append(
                f"| {n} | {lr:g} | {len(both)} | {interval_text(cos_u, 3)} | {interval_text(cos_g, 3)} | {ratio:.2f} |"
            )
    return lines


# ----------------------------------------------------------------------------- what each output hangs on (issue 38)

ALPHA = 0.05  # the reading's criterion: a paired comparison is read as a difference only at sign-flip p <= ALPHA


def reading(comparisons: dict[int, dict], alpha: float = ALPHA) -> str:
    """The reading beside the rule's output, with its criterion: at each N the paired test d(M) counts as a
    difference only where its exact two-sided sign-flip p is at most ``alpha``."""
    parts, shown = [], []
    for n, comparison in comparisons.items():
        if comparison is None or "d_metric" not in comparison:
            parts.append(f"N = {n}: not decided yet")
            continue
        diffs = comparison["d_metric"]["diffs"]
        p = sign_flip_p(diffs)
        if p <= alpha:
            shown.append(f"{'otb_loo' if sum(diffs) > 0 else 'rloo'} better at N = {n}")
        parts.append(f"N = {n}: sign-flip p = {p:.3f} (n = {len(diffs)}, smallest possible {2 / 2 ** len(diffs):.4f})")
    word = "; ".join(shown) if shown else "inconclusive"
    return (
        f"Reading (criterion: a paired test comparison is read as a difference only at exact two-sided sign-flip "
        f"p ≤ {alpha}): **{word}**; " + "; ".join(parts) + "."
    )


def _count(pairs) -> str:
    return f"{sum(p[3] > 0 for p in pairs)} of {len(pairs)}"


def dependence_lines(dep: dict) -> list[str]:
    """The report's section on what each output hangs on (issue 38)."""
    lines = ["## What each output hangs on (read after the runs, issue 38)", ""]
    for n, v in dep["per_n"].items():
        t, alt = v["test"], v["chosen_without_lone_collapses"]
        at = "; ".join(f"{arm} " + ", ".join(f"{m:.3f}" for m in ms.values())
                       for arm, ms in v["selection_metric_at_1e-3"].items())  # fmt: skip
        dropped = "; ".join(f"{arm} lr {lr:g} seed {s} (M = {m:.3f})" for arm, runs in v["dropped"].items()
                            for lr, s, m in runs) or "none"  # fmt: skip
        lines.append(
            f"- N = {n}: selected rates " + ", ".join(f"{a} {lr:g}" for a, lr in v["chosen"].items())
            + f"; with each lone collapsed selection run dropped ({dropped}): "
            + ", ".join(f"{a} {lr:g}" for a, lr in alt.items()) + f". Selection M at lr 1e-3 (seeds 0-2): {at}. "
            + "Test d(M) per seed: " + ", ".join(f"{s}: {d:+.3f}" for s, d in t["d"].items())
            + "; collapsed: " + "; ".join(f"{a} seeds {seeds or 'none'}" for a, seeds in t["collapsed"].items())
            + f"; the {len(t['calm_seeds'])} pairs without a collapse: {interval_text(t['calm'], 3)}."
        )  # fmt: skip
    c = dep["collapses_at_1e-3"]
    pairs = dep["equal_rate_pairs"]
    selection_pairs = [p for p in pairs if not p[5]]
    lines += [
        f"- Collapses at lr 1e-3 (every seed, both N): otb_loo {c['otb_loo'][0]} of {c['otb_loo'][1]} runs, rloo "
        f"{c['rloo'][0]} of {c['rloo'][1]}; exact two-sided Fisher p = {c['fisher_p']:.2f}.",
        f"- Equal-rate pairs at lr {', '.join(f'{lr:g}' for lr in STABLE_LRS)}: otb_loo's M above rloo's in "
        f"{_count(selection_pairs)} selection pairs, {_count(pairs)} with the test seeds run at one rate by both "
        f"arms; pairs holding a collapsed run: "
        + ("; ".join(f"N = {p[0]}, lr {p[1]:g}, seed {p[2]} (d = {p[3]:+.3f})" for p in pairs if p[4]) or "none")
        + ". Pairs share seeds across N and rates: they are not independent.",
        "",
        "Update-size ratio, median ‖Δθ‖ of otb_loo / rloo (mean over seeds 0-2 of the per-seed ratios of medians "
        "over the steps of each window):",
        "",
        "| N | lr | " + " | ".join(f"steps {a}–{b}" for a, b in WINDOWS) + " |",
        "|---|---|" + "---|" * len(WINDOWS),
        *[
            f"| {n} | {lr:g} | " + " | ".join(f"{r:.2f}" for r in ws.values()) + " |"
            for (n, lr), ws in dep["windows"].items()
        ],  # fmt: skip
        "",
    ]
    return lines


# ----------------------------------------------------------------------------- figure


def plot(by_cell: dict, comparisons: dict, group_sizes, lrs, selection, test, out_dir: Path) -> list[str]:
    from common import new_figure

    figure, axes = new_figure(len(group_sizes) + 2, width=4.6)
    for axis, n in zip(axes, group_sizes):
        chosen = (comparisons.get(n) or {}).get("chosen", {})
        for arm in PRIMARY:
            lr = chosen.get(arm)
            if lr is None:
                continue
            runs = [r for s, r in by_cell.get((arm, n, lr), {}).items() if s in test] or [
                r for s, r in by_cell.get((arm, n, lr), {}).items() if s in selection
            ]
            if not runs:
                continue
            length = min(len(r["rows"]) for r in runs)
            tokens = [statistics.mean(r["rows"][i]["tokens"] for r in runs) for i in range(length)]
            reward = [statistics.mean((r["rows"][i]["reward_mean"] or 0.0) for r in runs) for i in range(length)]
            smooth = [statistics.mean(reward[max(0, i - 9) : i + 1]) for i in range(length)]
            axis.plot(tokens, smooth, label=f"{arm}, lr {lr:g} ({len(runs)} seeds)")
        axis.set(xlabel="generated tokens", ylabel="reward (10-step trailing mean)", title=f"N = {n}, best rates")
        axis.legend(fontsize="small")
    metric_axis, aim_axis = axes[-2], axes[-1]
    for n in group_sizes:
        for arm in PRIMARY:
            points = [(lr, [r for s, r in by_cell.get((arm, n, lr), {}).items() if s in selection]) for lr in lrs]
            points = [(lr, runs) for lr, runs in points if runs]
            if not points:
                continue
            style = "-" if arm == PRIMARY[1] else "--"
            metric_axis.plot(
                [lr for lr, _ in points],
                [statistics.mean(reward_per_token(r["rows"]) for r in runs) for _, runs in points],
                style, marker="o", label=f"{arm} N={n}",
            )  # fmt: skip
            # a collapsed run's reference gradient is 0 (every reward 0) after the collapse: its aim is step 1's alone
            steady = [(lr, runs) for lr, runs in points if not any(map(collapsed, runs))]
            aim_axis.plot(
                [statistics.mean(median_step(r) for r in runs) for _, runs in steady],
                [statistics.mean(aim_mean(r, "cos_update") for r in runs) for _, runs in steady],
                style, marker="o", label=f"{arm} N={n}",
            )  # fmt: skip
    metric_axis.set(xscale="log", xlabel="learning rate", ylabel="M: reward per generated token", title="selection")
    aim_axis.set(xscale="log", xlabel="median ‖Δθ‖ per step", ylabel="mean cos(Δθ, g_ref)",
                 title="aim vs step size (runs that did not collapse)")  # fmt: skip
    metric_axis.legend(fontsize="small")
    aim_axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / "variance_lr.png", dpi=110)
    return ["![reward vs generated tokens at each arm's best rate; the selection; aim vs step size](variance_lr.png)"]


# ----------------------------------------------------------------------------- running


def plan(args, lrs, selection, test, group_sizes) -> None:
    """Run every missing run: the selection phase (every rate, seeds 0-2, seed-major) first; then, for each
    arm x N whose selection is complete, its test seeds at its selected rate."""
    records_dir, warm = args.out_dir / "variance_lr", args.warm
    task, steps, aim = args.task, args.steps, args.aim_steps

    def missing(items):
        return [i for i in items if not (records_dir / f"{run_name(*i)}.json").exists()]

    def job(item):
        arm, n, lr, seed = item
        name, flags, begun = run_name(*item), run_flags(task, arm, n, lr), time.perf_counter()
        run = run_one(name, flags, seed, steps, warm, args.runs_dir, aim, in_process=args.quick)
        meta = {"name": name, "arm": arm, "group_size": n, "lr": lr, "seed": seed, "flags": flags}
        path = write_run_record(meta, run, time.perf_counter() - begun, records_dir)
        if args.commit:
            commit([path], f"results/variance_lr: {name} ({steps} steps, {machine_name()})")

    def run_all(items):
        if args.jobs == 1 or args.quick:
            for item in items:
                job(item)
        else:
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                list(pool.map(job, items))

    first = missing([(a, n, lr, s) for s in selection for lr in lrs for n in group_sizes for a in args.arms])
    if first:
        ensure_warm_start(warm, args.quick)
        run_all(first)
    by_cell = cells(load_runs(records_dir))
    second = []
    for n in group_sizes:
        for arm in args.arms:
            lr = select(by_cell, arm, n, lrs, selection)
            if lr is not None:
                second += [(arm, n, lr, s) for s in test]
    second = missing(second)
    if second:
        ensure_warm_start(warm, args.quick)
        run_all(second)


def merge_section(out_dir: Path) -> list[str]:
    """Issue 38: merge ed1b10c landed between the 22nd and 23rd record; one pre-merge record rerun at both commits
    (experiments/merge_rerun.py), when its records are there."""
    from common.variance_runs import RECORD, load, summary_lines

    loaded = load(out_dir) if (out_dir / "variance_lr_merge").exists() else None
    if loaded is None:
        return []
    return [
        "## A code change mid-experiment: merge ed1b10c (issue 38)",
        "",
        "Merge ed1b10c (OTB's G_t and W_t formed in fp64 instead of the compute dtype, among other changes) landed "
        "between the 22nd and 23rd record. Record "
        f"`{RECORD}` (pre-merge) rerun at ed1b10c^2 and at ed1b10c, each in a temporary worktree "
        "(`python experiments/merge_rerun.py --commit`; results/variance_lr_merge.md):",
        "",
        *summary_lines(*loaded),
        "",
    ]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny warm start, one rate, 2 steps, in process")
    parser.add_argument("--arms", nargs="+", default=list(PRIMARY), choices=list(ARMS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--commit", action="store_true", help="git commit each run's record when it finishes")
    parser.add_argument("--report-only", action="store_true", help="no runs: the report from the records")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "variance_lr")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.quick:
        lrs, selection, test, group_sizes = QUICK["lrs"], QUICK["selection"], QUICK["test"], QUICK["group_sizes"]
        # the graded copy reward: the tiny warm start never copies exactly, and all-zero rewards move nothing
        args.task, args.steps, args.aim_steps = ["--task", "copy", *QUICK_TASK[2:]], QUICK["steps"], QUICK["aim"]
        args.warm, delta = args.runs_dir / "warm_start", 0.01
    else:
        lrs, selection, test, group_sizes = LRS, SELECTION_SEEDS, TEST_SEEDS, GROUP_SIZES
        args.task, args.steps, args.aim_steps = TASK, STEPS, AIM_STEPS
        args.warm, delta = ROOT / "results" / "variance_lr_warm_start", DELTA
    records_dir = args.out_dir / "variance_lr"
    if not args.report_only:
        plan(args, lrs, selection, test, group_sizes)
    by_cell = cells(load_runs(records_dir))
    contrast = contrast_labels(args.out_dir / "variance_lr_pilot")
    comparisons = {n: test_comparison(by_cell, n, lrs, selection, test) for n in group_sizes}
    total = len(PRIMARY) * len(group_sizes) * (len(lrs) * len(selection) + len(test))
    done = sum(len(v) for (arm, _, _), v in by_cell.items() if arm in PRIMARY)
    sections = [
        f"Runs recorded (primary arms): {done} of {total} (one compact record per run in `{records_dir.name}/`). "
        f"Task flags: `{' '.join(args.task)}`; common flags: `{' '.join(COMMON)}`; {args.steps} steps per run; "
        f"rates {', '.join(f'{lr:g}' for lr in lrs)}; selection seeds {list(selection)}, test seeds {list(test)}; "
        f"δ = {delta}, k = {K}.",
        "",
        "Pilot contrast SNR(otb_loo) / SNR(rloo) at the warm start: "
        + (", ".join(f"N = {n}: {c:.2f}" for n, c in contrast.items()) or "not recorded")
        + " (results/variance_lr_pilot.md).",
        "",
        verdict(comparisons, contrast, delta),
        "",
        reading(comparisons),
        "",
        "## Selected rates",
        "",
    ]
    for n, comparison in comparisons.items():
        rates = ", ".join(f"{arm}: {'—' if lr is None else f'{lr:g}'}" for arm, lr in comparison["chosen"].items())
        chosen = comparison["chosen"]
        higher = ""
        if all(v is not None for v in chosen.values()):
            relation = "higher than" if chosen["otb_loo"] > chosen["rloo"] else (
                "equal to" if chosen["otb_loo"] == chosen["rloo"] else "lower than")  # fmt: skip
            higher = f": otb_loo's best rate is {relation} rloo's"
        sections.append(f"- N = {n}: {rates}{higher}.")
    sections += [
        "",
        "## Every run, by cell (selection seeds)",
        "",
        *grid_table(by_cell, PRIMARY, group_sizes, lrs, selection),
    ]
    sections += ["", "## Test seeds at the selected rates", "", *grid_table(by_cell, PRIMARY, group_sizes, lrs, test)]
    sections += [
        "",
        "## Aim at equal rate (selection seeds, paired)",
        "",
        "After a collapse every reward is 0 and so is the reference gradient: a collapsed run's cosines are those of "
        "the steps before it (step 1 alone when it collapsed early), and step 1's is the same at every rate (AdamW's "
        "first step does not depend on the rate's size).",
        "",
        *aim_comparison(by_cell, group_sizes, lrs, selection),
        "",
    ]
    if not args.quick and all("d_metric" in c for c in comparisons.values()):
        sections += dependence_lines(dependence(by_cell))
    secondary = [k for k in by_cell if k[0] in SECONDARY]
    if secondary:
        sections += [
            "## Secondary pair (include-self OTB vs GRPO without std; biased differently, not evidence about variance)",
            "",
            *grid_table(by_cell, SECONDARY, group_sizes, lrs, (*selection, *test)),
            "",
        ]
    sections += ["Design and decision rule (fixed before the runs): the docstring of `experiments/variance_lr.py`.", ""]
    sections += merge_section(args.out_dir)
    if by_cell:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        sections += plot(by_cell, comparisons, group_sizes, lrs, selection, test, args.out_dir)
    title = "Variance at each estimator's best learning rate: leave-one-out OTB vs RLOO"
    return write_report("variance_lr", title, sections, time.perf_counter() - started, args.out_dir)


if __name__ == "__main__":
    print(main())
