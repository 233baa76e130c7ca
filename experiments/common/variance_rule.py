"""variance_lr's committed design and decision rule, and what its outputs hang on (issue 38): read by variance_lr's
report, by equal_rate (issue 28's cells and its paired statistics) and by readings.

* Design: :data:`LRS`, :data:`SELECTION_SEEDS`, :data:`TEST_SEEDS`, :data:`GROUP_SIZES`, :data:`DELTA`, :data:`K`.
* Reading the records: :func:`cells`, :func:`select` (the selection rule), :func:`paired` (paired differences and
  their t interval), :func:`decide` (the decision rule), :func:`test_comparison`, :func:`interval_text`,
  :func:`mean_sd`, :func:`median_step`, :func:`collapsed`.
* What each output hangs on: :func:`sign_flip_p`, :func:`fisher_p`, :func:`window_ratio`,
  :func:`selection_without_lone_collapses`, :func:`dependence` (:data:`STABLE_LRS`, :data:`WINDOWS`).

The design in words: the docstring of ``experiments/variance_lr.py``.
"""

from __future__ import annotations

import itertools
import math
import statistics

from common.variance_runs import GROUP_SIZES, PRIMARY, final_reward, reward_per_token

LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
SELECTION_SEEDS = (0, 1, 2)
TEST_SEEDS = (3, 4, 5, 6, 7)
DELTA = 0.0104  # the pilot's pooled seed-to-seed standard deviation of M (6 runs, 4 d.o.f.)
K = 4
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


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
        means[lr] = round(statistics.mean(reward_per_token(runs[s]["rows"]) for s in seeds), 4)
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
    metric = {arm: {s: reward_per_token(r["rows"]) for s, r in runs[arm].items() if s in test} for arm in arms}
    final = {arm: {s: final_reward(r["rows"]) for s, r in runs[arm].items() if s in test} for arm in arms}
    return {
        "chosen": chosen,
        "metric": metric,
        "d_metric": paired(metric[arms[1]], metric[arms[0]]),
        "d_final": paired(final[arms[1]], final[arms[0]]),
    }


def interval_text(p: dict, digits: int = 4) -> str:
    if math.isnan(p["low"]):
        return f"{p['mean']:+.{digits}f} (n = {len(p['diffs'])})"
    return f"{p['mean']:+.{digits}f} [{p['low']:+.{digits}f}, {p['high']:+.{digits}f}] (n = {len(p['diffs'])})"


def median_step(record: dict) -> float:
    return statistics.median(r["update_norm"] for r in record["rows"] if r["update_norm"] is not None)


def collapsed(record: dict) -> bool:
    """The run ended below half its starting reward (first and last 10% of the steps), as in experiments/stability."""
    rows = record["rows"]
    head = statistics.mean((r["reward_mean"] or 0.0) for r in rows[: max(1, len(rows) // 10)])
    return final_reward(rows) < 0.5 * head


def mean_sd(values: list[float], digits: int = 4) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "—"
    text = f"{statistics.mean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


# ----------------------------------------------------------------------------- what each output hangs on (issue 38)

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
        dropped += [(lr, s, reward_per_token(runs[s]["rows"])) for s in seeds if s not in kept]
        means[lr] = round(statistics.mean(reward_per_token(runs[s]["rows"]) for s in kept), 4)
    best = max(means.values())
    return min(lr for lr, value in means.items() if value == best), dropped


def _metric(record: dict) -> float:
    return reward_per_token(record["rows"])


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
