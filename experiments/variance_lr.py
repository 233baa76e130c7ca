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
import itertools
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import variance_lr_pilot as pilot

from common import commit, machine_name, write_report

ROOT = Path(__file__).resolve().parents[1]

LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
SELECTION_SEEDS = (0, 1, 2)
TEST_SEEDS = (3, 4, 5, 6, 7)
STEPS = pilot.STEPS
GROUP_SIZES = pilot.GROUP_SIZES
PRIMARY = pilot.PRIMARY
SECONDARY = ("grpo_nostd", "otb")
AIM_STEPS = pilot.AIM_STEPS
DELTA = 0.0104  # the pilot's pooled seed-to-seed standard deviation of M (6 runs, 4 d.o.f.)
K = 4
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
QUICK = {"lrs": (1e-3,), "selection": (0,), "test": (1,), "group_sizes": (2,), "steps": 2, "aim": (1,)}


# ----------------------------------------------------------------------------- reading the records


def cells(runs: list[dict]) -> dict[tuple, dict[int, dict]]:
    """(arm, N, lr) -> seed -> record."""
    out: dict[tuple, dict[int, dict]] = {}
    for record in runs:
        out.setdefault((record["arm"], record["group_size"], record["lr"]), {})[record["seed"]] = record
    return out


def select(by_cell: dict, arm: str, n: int, lrs, seeds) -> float | None:
    """The selection rule: the rate of ``lrs`` with the highest mean metric over ``seeds`` (ties, equal to 4
    decimals, to the smaller rate); None until every rate has every seed."""
    means = {}
    for lr in lrs:
        runs = by_cell.get((arm, n, lr), {})
        if not all(seed in runs for seed in seeds):
            return None
        means[lr] = round(statistics.mean(pilot.reward_per_token(runs[s]["rows"]) for s in seeds), 4)
    best = max(means.values())
    return min(lr for lr, value in means.items() if value == best)


def paired(values_a: dict[int, float], values_b: dict[int, float]) -> dict:
    """Paired differences a − b over the seeds both have: the differences, their mean and 95% t interval."""
    seeds = sorted(set(values_a) & set(values_b))
    diffs = [values_a[s] - values_b[s] for s in seeds]
    if len(diffs) < 2:
        return {
            "seeds": seeds,
            "diffs": diffs,
            "mean": diffs[0] if diffs else math.nan,
            "low": math.nan,
            "high": math.nan,
        }
    mean, half = statistics.mean(diffs), T_975[len(diffs) - 1] * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"seeds": seeds, "diffs": diffs, "mean": mean, "low": mean - half, "high": mean + half}


def decide(diffs: list[float], delta: float, k: int = K, needed: int = len(TEST_SEEDS)) -> str:
    """The decision rule on the paired test differences d = otb_loo − rloo of the metric."""
    if len(diffs) < needed:
        return "not decided yet"
    if sum(d >= delta for d in diffs) >= k:
        return "variance reduction matters"
    if sum(d <= -delta for d in diffs) >= k:
        return "RLOO better"
    return f"no difference of δ = {delta:.4f}"


def test_comparison(by_cell: dict, n: int, lrs, selection, test, arms=PRIMARY) -> dict | None:
    """At N: each arm's selected rate and the paired test comparison of the second arm minus the first."""
    chosen = {arm: select(by_cell, arm, n, lrs, selection) for arm in arms}
    if any(lr is None for lr in chosen.values()):
        return {"chosen": chosen}
    runs = {arm: by_cell.get((arm, n, chosen[arm]), {}) for arm in arms}
    metric = {arm: {s: pilot.reward_per_token(r["rows"]) for s, r in runs[arm].items() if s in test} for arm in arms}
    final = {arm: {s: pilot.final_reward(r["rows"]) for s, r in runs[arm].items() if s in test} for arm in arms}
    return {
        "chosen": chosen,
        "metric": metric,
        "d_metric": paired(metric[arms[1]], metric[arms[0]]),
        "d_final": paired(final[arms[1]], final[arms[0]]),
    }


def contrast_labels(pilot_dir: Path) -> dict[int, float]:
    records = [json.loads(p.read_text()) for p in sorted(pilot_dir.glob("snr_seed*.json"))]
    return pilot.contrasts(records) if records else {}


def interval_text(p: dict, digits: int = 4) -> str:
    if math.isnan(p["low"]):
        return f"{p['mean']:+.{digits}f} (n = {len(p['diffs'])})"
    return f"{p['mean']:+.{digits}f} [{p['low']:+.{digits}f}, {p['high']:+.{digits}f}] (n = {len(p['diffs'])})"


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
        label = "" if contrast.get(n, math.inf) >= pilot.CONTRAST else " (no variance contrast: not read as a test)"
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


def median_step(record: dict) -> float:
    return statistics.median(r["update_norm"] for r in record["rows"] if r["update_norm"] is not None)


def collapsed(record: dict) -> bool:
    """The run ended below half its starting reward (first and last 10% of the steps), as in experiments/stability."""
    rows = record["rows"]
    head = statistics.mean((r["reward_mean"] or 0.0) for r in rows[: max(1, len(rows) // 10)])
    return pilot.final_reward(rows) < 0.5 * head


def _mean_sd(values: list[float], digits: int = 4) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "—"
    text = f"{statistics.mean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


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
                    _mean_sd([pilot.reward_per_token(r["rows"]) for r in runs]),
                    _mean_sd([pilot.final_reward(r["rows"]) for r in runs], 3),
                    f"{sum(map(collapsed, runs))}/{len(runs)}",
                    _mean_sd([median_step(r) for r in runs], 3),
                    *(
                        _mean_sd([aim_mean(r, key) for r in runs], 3)
                        for key in ("cos_update", "cos_grad", "cos_halves")
                    ),
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
STABLE_LRS = (1e-4, 3e-4, 1e-3)  # the rates at which most selection runs did not collapse
WINDOWS = ((1, 150), (11, 150), (11, 50), (51, 150))  # steps (inclusive) over which update sizes are compared


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided sign-flip p of the mean of paired differences: the share of the 2^n sign vectors whose
    |sum| is at least the observed one."""
    observed = abs(sum(diffs))
    flips = list(itertools.product((1, -1), repeat=len(diffs)))
    return sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= observed - 1e-12 for signs in flips) / len(flips)


def fisher_p(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """Exact two-sided Fisher p of a 2 x 2 table (hits of n in each group): the total probability, with the
    margins fixed, of the tables no more probable than the observed one."""
    hits, total = hits_a + hits_b, n_a + n_b

    def prob(k: int) -> float:
        return math.comb(n_a, k) * math.comb(n_b, hits - k) / math.comb(total, hits)

    observed = prob(hits_a)
    ks = range(max(0, hits - n_b), min(hits, n_a) + 1)
    return min(1.0, sum(prob(k) for k in ks if prob(k) <= observed * (1 + 1e-9)))


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


def window_ratio(by_cell: dict, n: int, lr: float, window: tuple[int, int], seeds, arms=PRIMARY) -> float:
    """Mean over ``seeds`` of median ‖Δθ‖ over the steps of ``window`` of otb_loo over that of rloo, paired."""

    def median(record: dict) -> float:
        return statistics.median(
            r["update_norm"] for r in record["rows"] if window[0] <= r["step"] <= window[1] and r["update_norm"]
        )

    a, b = by_cell[(arms[1], n, lr)], by_cell[(arms[0], n, lr)]
    return statistics.mean(median(a[s]) / median(b[s]) for s in seeds)


def selection_without_lone_collapses(by_cell: dict, arm: str, n: int, lrs, seeds) -> tuple[float, list]:
    """The selection rule with each collapsed run dropped from a cell where most of the arm's seeds did not
    collapse (a lone collapse); (the rate it picks, the dropped runs as (rate, seed, M))."""
    means, dropped = {}, []
    for lr in lrs:
        runs = {s: by_cell[(arm, n, lr)][s] for s in seeds}
        fallen = [s for s, r in runs.items() if collapsed(r)]
        kept = [s for s in seeds if s not in fallen] if 2 * len(fallen) < len(seeds) else list(seeds)
        dropped += [(lr, s, pilot.reward_per_token(runs[s]["rows"])) for s in seeds if s not in kept]
        means[lr] = round(statistics.mean(pilot.reward_per_token(runs[s]["rows"]) for s in kept), 4)
    best = max(means.values())
    return min(lr for lr, value in means.items() if value == best), dropped


def _metric(record: dict) -> float:
    return pilot.reward_per_token(record["rows"])


def _test_dependence(by_cell: dict, n: int, chosen: dict, test) -> dict:
    """The test seeds at the selected rates: d(M) per seed, who collapsed, and the pairs without a collapse."""
    runs = {arm: by_cell[(arm, n, lr)] for arm, lr in chosen.items()}
    d = {s: _metric(runs["otb_loo"][s]) - _metric(runs["rloo"][s]) for s in test}
    fallen = {arm: [s for s in test if collapsed(runs[arm][s])] for arm in PRIMARY}
    calm = [s for s in test if not any(s in seeds for seeds in fallen.values())]
    interval = paired({s: _metric(runs["otb_loo"][s]) for s in calm}, {s: _metric(runs["rloo"][s]) for s in calm})
    return {"d": d, "collapsed": fallen, "calm_seeds": calm, "calm": interval}


def dependence(by_cell: dict, lrs=LRS, selection=SELECTION_SEEDS, test=TEST_SEEDS, group_sizes=GROUP_SIZES) -> dict:
    """What the rule's outputs hang on, recomputed from the records: per N the selection with lone collapses
    dropped and the test pairs with and without a collapse; collapses at 1e-3 per arm (Fisher); the equal-rate pairs
    at the stable rates; the update-size ratio otb_loo / rloo per window of steps."""
    out: dict = {"per_n": {}, "windows": {}}
    for n in group_sizes:
        chosen = test_comparison(by_cell, n, lrs, selection, test)["chosen"]
        alternative = {arm: selection_without_lone_collapses(by_cell, arm, n, lrs, selection) for arm in PRIMARY}
        out["per_n"][n] = {
            "chosen": chosen,
            "chosen_without_lone_collapses": {arm: v[0] for arm, v in alternative.items()},
            "dropped": {arm: v[1] for arm, v in alternative.items()},
            "selection_metric_at_1e-3": {
                arm: {s: _metric(by_cell[(arm, n, 1e-3)][s]) for s in selection} for arm in PRIMARY
            },  # fmt: skip
            "test": _test_dependence(by_cell, n, chosen, test),
        }
        for lr in STABLE_LRS:
            out["windows"][(n, lr)] = {w: window_ratio(by_cell, n, lr, w, selection) for w in WINDOWS}
    at = {arm: [r for n in group_sizes for r in by_cell.get((arm, n, 1e-3), {}).values()] for arm in PRIMARY}
    hits = {arm: (sum(map(collapsed, runs)), len(runs)) for arm, runs in at.items()}
    out["collapses_at_1e-3"] = {**hits, "fisher_p": fisher_p(*hits["otb_loo"], *hits["rloo"])}
    pairs = []  # (N, lr, seed, d, a run of the pair collapsed, test seed)
    for n in group_sizes:
        chosen = out["per_n"][n]["chosen"]
        for lr in STABLE_LRS:
            seeds = [*selection, *(test if chosen["otb_loo"] == chosen["rloo"] == lr else ())]
            for s in seeds:
                a, b = by_cell[("otb_loo", n, lr)][s], by_cell[("rloo", n, lr)][s]
                pairs.append((n, lr, s, _metric(a) - _metric(b), collapsed(a) or collapsed(b), s in test))
    out["equal_rate_pairs"] = pairs
    return out


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
                [statistics.mean(pilot.reward_per_token(r["rows"]) for r in runs) for _, runs in points],
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
        return [i for i in items if not (records_dir / f"{pilot.run_name(*i)}.json").exists()]

    def job(item):
        arm, n, lr, seed = item
        name, flags, begun = pilot.run_name(*item), pilot.run_flags(task, arm, n, lr), time.perf_counter()
        run = pilot.run_one(name, flags, seed, steps, warm, args.runs_dir, aim, in_process=args.quick)
        meta = {"name": name, "arm": arm, "group_size": n, "lr": lr, "seed": seed, "flags": flags}
        path = pilot.write_run_record(meta, run, time.perf_counter() - begun, records_dir)
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
        pilot.ensure_warm_start(warm, args.quick)
        run_all(first)
    by_cell = cells(pilot.load_runs(records_dir))
    second = []
    for n in group_sizes:
        for arm in args.arms:
            lr = select(by_cell, arm, n, lrs, selection)
            if lr is not None:
                second += [(arm, n, lr, s) for s in test]
    second = missing(second)
    if second:
        pilot.ensure_warm_start(warm, args.quick)
        run_all(second)


def merge_section(out_dir: Path) -> list[str]:
    """Issue 38: merge ed1b10c landed between the 22nd and 23rd record; one pre-merge record rerun at both commits
    (experiments/merge_rerun.py), when its records are there."""
    import merge_rerun

    loaded = merge_rerun.load(out_dir) if (out_dir / "variance_lr_merge").exists() else None
    if loaded is None:
        return []
    return [
        "## A code change mid-experiment: merge ed1b10c (issue 38)",
        "",
        "Merge ed1b10c (OTB's G_t and W_t formed in fp64 instead of the compute dtype, among other changes) landed "
        "between the 22nd and 23rd record. Record "
        f"`{merge_rerun.RECORD}` (pre-merge) rerun at ed1b10c^2 and at ed1b10c, each in a temporary worktree "
        "(`python experiments/merge_rerun.py --commit`; results/variance_lr_merge.md):",
        "",
        *merge_rerun.summary_lines(*loaded),
        "",
    ]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny warm start, one rate, 2 steps, in process")
    parser.add_argument("--arms", nargs="+", default=list(PRIMARY), choices=list(pilot.ARMS))
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
        args.task, args.steps, args.aim_steps = ["--task", "copy", *pilot.QUICK_TASK[2:]], QUICK["steps"], QUICK["aim"]
        args.warm, delta = args.runs_dir / "warm_start", 0.01
    else:
        lrs, selection, test, group_sizes = LRS, SELECTION_SEEDS, TEST_SEEDS, GROUP_SIZES
        args.task, args.steps, args.aim_steps = pilot.TASK, STEPS, AIM_STEPS
        args.warm, delta = ROOT / "results" / "variance_lr_warm_start", DELTA
    records_dir = args.out_dir / "variance_lr"
    if not args.report_only:
        plan(args, lrs, selection, test, group_sizes)
    by_cell = cells(pilot.load_runs(records_dir))
    contrast = contrast_labels(args.out_dir / "variance_lr_pilot")
    comparisons = {n: test_comparison(by_cell, n, lrs, selection, test) for n in group_sizes}
    total = len(PRIMARY) * len(group_sizes) * (len(lrs) * len(selection) + len(test))
    done = sum(len(v) for (arm, _, _), v in by_cell.items() if arm in PRIMARY)
    sections = [
        f"Runs recorded (primary arms): {done} of {total} (one compact record per run in `{records_dir.name}/`). "
        f"Task flags: `{' '.join(args.task)}`; common flags: `{' '.join(pilot.COMMON)}`; {args.steps} steps per run; "
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
