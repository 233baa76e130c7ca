"""Readings of the committed records that the docs quote beyond each experiment's own report (issue 28).

    python experiments/readings.py          # reads results/{reproduction,stability,stability_long}/ (seconds)

No training: every number comes from the committed per-run records, through the experiments' own helpers
(``reproduction_rule.analyse``, ``common.collapse``, ``stability_long_rule.spikes``), and from the built-in model of
``otb_train`` for the parameter counts. Writes ``results/readings.json`` (every number) and ``results/readings.md``
(the same as tables). The choices made here, stated once:

* **KL ratio.** A run's update KL is the median of its steps' ``approx_kl``; arms are compared by the mean over
  seeds of those run medians (other poolings are given beside it).
* **Spikes.** Per run, the committed rule of ``stability_long.py`` (a step's KL above 10x the run's own median);
  the alternative is one shared absolute threshold, 10x the median of every step KL of all 12 runs.
* **Tests between arms.** An exact two-sided permutation test of the difference of the arm sums (equal group
  sizes: of the means): every split of the pooled runs into two groups of the observed sizes is enumerated
  (924 for 6 vs 6, 20 for 3 vs 3), and p is the fraction whose |difference| is at least the observed one. It
  ignores the pairing by seed; with 3 vs 3 runs its smallest possible p is 0.1.
* **Paired tests (variance_lr).** An exact sign-flip permutation test of the mean paired difference: all 2^n sign
  assignments of the n paired differences; p (two-sided) is the fraction whose |mean| is at least the observed one.
  With n = 5 its smallest possible p is 2/32 = 0.0625, with n = 3 it is 0.25: a count of seeds above δ that this
  test cannot separate from chance is read "inconclusive", whatever the committed rule's word.
* **Reproduction floor.** The saving an N = 4 arm would have if it reached tau - delta only at its last step,
  in every seed: its T is then its whole run's generated tokens (``saving_interval``, the report's bootstrap).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from pathlib import Path

from common import (
    RESULTS,
    collapse,
    command_line,
    compact,
    load_records,
    reproduction_rule,
    stability_long_rule,
    variance_rule,
    variance_runs,
    write_report,
)

# experiments/stability.py's arms in its order (only their names are read here; a test keeps the two equal)
STABILITY_ARMS = ("grpo_n8", "rloo_n8", "otb_n8", "grpo_n32", "otb_n32")
WIDTHS = {64: "snapshots (gradient_variance, proxy_fidelity) and train.py's default", 128: "warm_start.py's default"}


def permutation_p(first: list[float], second: list[float]) -> float:
    """Exact two-sided permutation p of ``sum(second) - sum(first)`` over every split of the pooled values."""
    pooled, total = [*first, *second], sum(first) + sum(second)
    observed = abs(sum(second) - sum(first))
    splits = list(itertools.combinations(range(len(pooled)), len(first)))
    extreme = sum(abs(total - 2 * sum(pooled[i] for i in split)) >= observed - 1e-12 for split in splits)
    return extreme / len(splits)


sign_flip_p = variance_rule.sign_flip_p  # exact two-sided sign-flip permutation p of the mean of paired differences


def variance_lr_readings(records_dir: Path) -> dict:
    """At each N: the test seeds' paired d(M) at the selected rates with its sign-flip p, collapses per arm, and at
    every rate of the grid the selection seeds' paired d(M) (equal rate) with the ratio of median update norms."""
    by_cell = variance_rule.cells(variance_runs.load_runs(records_dir))
    lrs, selection, test = variance_rule.LRS, variance_rule.SELECTION_SEEDS, variance_rule.TEST_SEEDS
    out = {}
    for n in variance_rule.GROUP_SIZES:
        comparison = variance_rule.test_comparison(by_cell, n, lrs, selection, test)
        if "d_metric" not in comparison:
            continue
        chosen, d = comparison["chosen"], comparison["d_metric"]
        collapsed = {
            arm: sum(variance_rule.collapsed(by_cell[(arm, n, lr)][s]) for s in test) for arm, lr in chosen.items()
        }
        equal_rate = {}
        for lr in lrs:
            a, b = by_cell.get(("otb_loo", n, lr), {}), by_cell.get(("rloo", n, lr), {})
            both = [s for s in selection if s in a and s in b]
            diffs = [variance_runs.reward_per_token(a[s]["rows"]) - variance_runs.reward_per_token(b[s]["rows"])
                     for s in both]  # fmt: skip
            ratio = statistics.mean(variance_rule.median_step(a[s]) / variance_rule.median_step(b[s]) for s in both)
            fallen = [sum(variance_rule.collapsed(c[s]) for s in both) for c in (a, b)]
            equal_rate[f"{lr:g}"] = {"d_metric": diffs, "sign_flip_p": sign_flip_p(diffs), "step_ratio": ratio,
                                     "collapsed": fallen}  # fmt: skip
        out[str(n)] = {
            "chosen": chosen,
            "rule": variance_rule.decide(d["diffs"], variance_rule.DELTA),
            "d_metric": d["diffs"],
            "d_metric_interval": [d["mean"], d["low"], d["high"]],
            "sign_flip_p": sign_flip_p(d["diffs"]),
            "collapsed_test_seeds": collapsed,
            "equal_rate_selection_seeds": equal_rate,
        }
    return out


def pilot_ratios(pilot_dir: Path, snr_gap_file: Path) -> dict:
    """The pilot's SNR ratios at N = 4 per pilot seed (8 prompts each): include-self OTB over RLOO and over GRPO,
    and the contrast otb_loo / rloo as the pilot reports it (ratio of the seed means) beside the same contrast in
    snr_gap's 16-prompt record at 16-24 digits."""
    records = [json.loads(p.read_text()) for p in sorted(pilot_dir.glob("snr_seed*.json"))]
    k = records[0]["group_sizes"].index(4)

    def snr(record: dict, name: str) -> float:
        return record["snr"][record["estimators"].index(name)][k]

    gap = json.loads(snr_gap_file.read_text())
    g = gap["group_sizes"].index(4)
    gap_snr = {name: gap["snr"][gap["estimators"].index(name)][g] for name in ("otb_loo", "rloo")}
    return {
        "otb_over_rloo": [snr(r, "otb") / snr(r, "rloo") for r in records],
        "otb_over_grpo": [snr(r, "otb") / snr(r, "grpo") for r in records],
        "contrast_pilot": variance_runs.contrasts(records)[4],
        "pilot_prompts": records[0]["prompts"], "pilot_seeds": len(records),
        "contrast_snr_gap": gap_snr["otb_loo"] / gap_snr["rloo"], "snr_gap_prompts": gap["prompts"],
    }  # fmt: skip


def variance_lr_dependence(records_dir: Path) -> dict:
    """variance_rule.dependence on the committed records, with JSON keys (issue 38)."""
    dep = variance_rule.dependence(variance_rule.cells(variance_runs.load_runs(records_dir)))
    dep["windows"] = {
        f"{n} {lr:g}": {f"{a}-{b}": r for (a, b), r in ws.items()} for (n, lr), ws in dep["windows"].items()
    }
    return dep


def _kls(rows: list[dict]) -> list[float]:
    return [r["approx_kl"] for r in rows if r["approx_kl"] is not None]


def _by_seed(runs: dict[int, list[dict]]) -> list[list[dict]]:
    return [runs[seed] for seed in sorted(runs)]


def stability_long_readings(by_arm: dict[str, dict[int, list[dict]]]) -> dict:
    """Update KL, spikes (committed rule and a shared threshold), their test, and rewards per arm."""
    arms = list(stability_long_rule.ARMS)
    runs = {arm: _by_seed(by_arm[arm]) for arm in arms}
    medians = {arm: [statistics.median(_kls(rows)) for rows in runs[arm]] for arm in arms}
    pooled = {arm: statistics.median(k for rows in runs[arm] for k in _kls(rows)) for arm in arms}
    otb, grpo = medians["otb_n8"], medians["grpo_n8"]
    ratios = [o / g for o, g in zip(otb, grpo)]
    ratio = {
        "mean_of_run_medians": statistics.mean(otb) / statistics.mean(grpo),
        "median_of_run_medians": statistics.median(otb) / statistics.median(grpo),
        "mean_of_seed_ratios": statistics.mean(ratios),
        "geometric_mean_of_seed_ratios": math.exp(statistics.mean(map(math.log, ratios))),
        "median_of_pooled_steps": pooled["otb_n8"] / pooled["grpo_n8"],
    }
    arm_means = lambda group: statistics.mean(m for arm in group for m in medians[arm])  # noqa: E731
    # The committed rule: each run's own median.
    spikes = {arm: [stability_long_rule.spikes(rows) for rows in runs[arm]] for arm in arms}
    spike_steps = {
        arm: [[r["step"] for r in rows if r["approx_kl"] is not None and r["approx_kl"] > stability_long_rule.SPIKE * m]
              for rows, m in zip(runs[arm], medians[arm])]
        for arm in arms
    }  # fmt: skip
    # One shared absolute threshold for every run.
    threshold = stability_long_rule.SPIKE * statistics.median(
        k for arm in arms for rows in runs[arm] for k in _kls(rows)
    )
    shared = {arm: [sum(k > threshold for k in _kls(rows)) for rows in runs[arm]] for arm in arms}
    group = lambda counts, arms_: [c for arm in arms_ for c in counts[arm]]  # noqa: E731
    mean_baseline, otb_arms = stability_long_rule.MEAN_BASELINE, stability_long_rule.OTB
    states = {arm: [collapse(rows) for rows in runs[arm]] for arm in arms}
    largest = sorted(((max(_kls(rows)), arm, seed) for arm in arms for seed, rows in enumerate(runs[arm])),
                     reverse=True)[:2]  # fmt: skip
    ends = {arm: [s["end"] for s in states[arm]] for arm in arms}
    gains = {arm: [s["end"] - s["start"] for s in states[arm]] for arm in arms}
    return {
        "committed_reading": stability_long_rule.reading(by_arm),
        "run_median_kl": medians,
        "run_median_kl_range": [min(min(m) for m in medians.values()), max(max(m) for m in medians.values())],
        "kl_ratio_otb_to_grpo": ratio,
        "kl_ratio_otb_arms_to_mean_baseline_arms": arm_means(otb_arms) / arm_means(mean_baseline),
        "largest_step_kl": [{"kl": kl, "arm": arm, "seed": seed} for kl, arm, seed in largest],
        "spikes_own_median": spikes,
        "spike_steps_own_median": spike_steps,
        "every_run_spikes_at_step_1": all(steps[0] == 1 for per_arm in spike_steps.values() for steps in per_arm),
        "spikes_own_median_totals": {
            "mean_baseline": sum(group(spikes, mean_baseline)),
            "otb": sum(group(spikes, otb_arms)),
        },  # fmt: skip
        "spikes_own_median_p": permutation_p(group(spikes, mean_baseline), group(spikes, otb_arms)),
        "spikes_own_median_without_step_1_p": permutation_p(
            [c - 1 for c in group(spikes, mean_baseline)], [c - 1 for c in group(spikes, otb_arms)]
        ),
        "shared_threshold": threshold,
        "spikes_shared_threshold": shared,
        "spikes_shared_threshold_totals": {
            "mean_baseline": sum(group(shared, mean_baseline)),
            "otb": sum(group(shared, otb_arms)),
        },  # fmt: skip
        "spikes_shared_threshold_p": permutation_p(group(shared, mean_baseline), group(shared, otb_arms)),
        "collapsed_runs": sum(s["collapsed"] for per_arm in states.values() for s in per_arm),
        "step_1_reward": {arm: statistics.mean(rows[0]["reward_mean"] for rows in runs[arm]) for arm in arms},
        "step_1_same_in_every_arm": all(
            len({runs[arm][i][0]["reward_mean"] for arm in arms}) == 1 for i in range(len(runs[arms[0]]))
        ),  # fmt: skip
        "start_reward": {arm: statistics.mean(s["start"] for s in states[arm]) for arm in arms},
        "end_reward": {arm: statistics.mean(ends[arm]) for arm in arms},
        "end_reward_p": permutation_p(group(ends, mean_baseline), group(ends, otb_arms)),
        "gain_p": permutation_p(group(gains, mean_baseline), group(gains, otb_arms)),
    }


def stability_readings(by_arm: dict[str, dict[int, list[dict]]]) -> dict:
    """Where each run's largest update is, how large step 1 was against its gradient norm, and collapse steps."""
    runs = {arm: _by_seed(by_arm[arm]) for arm in STABILITY_ARMS}
    largest_step = {
        arm: [max(rows, key=lambda r: r["update_norm"])["step"] for rows in per] for arm, per in runs.items()
    }
    largest_grad = {arm: [max(rows, key=lambda r: r["grad_norm"])["step"] for rows in per] for arm, per in runs.items()}
    first = [rows[0] for per in runs.values() for rows in per]
    zero_from = {arm: [collapse(rows)["zero_from"] for rows in per] for arm, per in runs.items()}
    pairs = (("grpo_n8", "grpo_n32"), ("otb_n8", "otb_n32"), ("grpo_n8", "otb_n8"), ("rloo_n8", "otb_n8"))
    return {
        "runs": len(first),
        "largest_update_step": largest_step,
        "runs_largest_update_at_step_1": sum(s == 1 for per in largest_step.values() for s in per),
        "largest_grad_norm_step": largest_grad,
        "runs_largest_grad_norm_at_step_1": sum(s == 1 for per in largest_grad.values() for s in per),
        "step_1_update_norm_range": [min(r["update_norm"] for r in first), max(r["update_norm"] for r in first)],
        "step_1_grad_norm_range": [min(r["grad_norm"] for r in first), max(r["grad_norm"] for r in first)],
        "collapsed_runs": sum(collapse(rows)["collapsed"] for per in runs.values() for rows in per),
        "zero_reward_from_step": zero_from,
        "zero_reward_from_step_p": {f"{a} vs {b}": permutation_p(zero_from[a], zero_from[b]) for a, b in pairs},
    }


def reproduction_readings(by_arm: dict[str, dict[int, list[dict]]]) -> dict:
    """The verdict's savings, and the saving of an N = 4 arm that reaches tau - delta only at its last step."""
    analysis = reproduction_rule.analyse(by_arm)
    reference = [tokens for tokens, _ in analysis["hits"]["grpo_n32"].values()]
    n4 = [arm for arm in by_arm if arm != "grpo_n32"]
    most = max(rows[-1]["tokens"] for arm in n4 for rows in by_arm[arm].values())
    cap = (
        reproduction_rule.STEPS
        * 4
        * 4
        * int(reproduction_rule.TASK[reproduction_rule.TASK.index("--max-new-tokens") + 1])
    )
    seeds = len(reference)
    return {
        "tau": analysis["tau"],
        "target": analysis["target"],
        "reached": {arm: sum(r for _, r in hits.values()) for arm, hits in analysis["hits"].items()},
        "savings": analysis["savings"],
        "most_tokens_of_an_n4_run": most,
        "saving_if_reached_at_last_step": reproduction_rule.saving_interval([most] * seeds, reference),
        "n4_token_cap": cap,
        "saving_at_token_cap": reproduction_rule.saving_interval([cap] * seeds, reference),
    }


def parameter_counts() -> dict[int, int]:
    """Parameters of the built-in Qwen2 (2 layers) at each width of :data:`WIDTHS`, built by otb_train's own code."""
    from otb_train.config import parse_config
    from otb_train.model import build_model_and_tokenizer

    counts = {}
    for width in WIDTHS:
        lm = build_model_and_tokenizer(parse_config(["--hidden-size", str(width), "--num-layers", "2"]))[0]
        counts[width] = sum(p.numel() for p in lm.parameters())
    return counts


def run_seconds(records_dir: Path) -> dict:
    """Runs, their summed wall seconds and the machines their records name (timings: the machine matters)."""
    records = [json.loads(path.read_text()) for path in sorted(records_dir.glob("*.json"))]
    return {"runs": len(records), "seconds": sum(r["wall_seconds"] for r in records),
            "machines": sorted({r["machine"] for r in records})}  # fmt: skip


def readings(results: Path = RESULTS) -> dict:
    return {
        "run_seconds": {
            name: run_seconds(results / name) for name in ("reproduction", "stability", "stability_long", "variance_lr")
        },
        "stability_long": stability_long_readings(load_records(results / "stability_long")),
        "stability": stability_readings(load_records(results / "stability")),
        "reproduction": reproduction_readings(load_records(results / "reproduction")),
        "parameters": parameter_counts(),
        "variance_lr": variance_lr_readings(results / "variance_lr"),
        "variance_lr_dependence": variance_lr_dependence(results / "variance_lr"),
        "variance_lr_pilot": pilot_ratios(results / "variance_lr_pilot", results / "snr_gap" / "copy16_24.json"),
    }


def _list(values, digits: str = ".3g") -> str:
    return ", ".join(format(v, digits) for v in values)


def _span(values: list[float]) -> str:
    return "–".join(format(v, ".2f") for v in values)


def report(data: dict) -> list[str]:
    """The readings as short tables (every number also in readings.json)."""
    long, short, repro = data["stability_long"], data["stability"], data["reproduction"]
    pilot = data["variance_lr_pilot"]
    ratio = long["kl_ratio_otb_to_grpo"]
    own, shared = long["spikes_own_median_totals"], long["spikes_shared_threshold_totals"]
    lines = [
        "## stability_long (records in `stability_long/`)",
        "",
        f"Committed rule's output: {long['committed_reading']}",
        "",
        "| arm | step 1, first 5 → last 5 steps' reward | run median KL | spikes, own median (10×) | spike steps | "
        f"spikes, shared threshold {long['shared_threshold']:.2g} |",
        "|---|---|---|---|---|---|",
    ]
    for arm in stability_long_rule.ARMS:
        lines.append(
            f"| {arm} | {long['step_1_reward'][arm]:.3f}, {long['start_reward'][arm]:.3f} → "
            f"{long['end_reward'][arm]:.3f} | "
            f"{_list(long['run_median_kl'][arm], '.2g')} | {_list(long['spikes_own_median'][arm], 'd')} | "
            f"{'; '.join(map(str, long['spike_steps_own_median'][arm]))} | "
            f"{_list(long['spikes_shared_threshold'][arm], 'd')} |"
        )
    lines += [
        "",
        f"- OTB / GRPO median update KL: {ratio['mean_of_run_medians']:.2f}× (mean over seeds of run medians); "
        f"median of run medians {ratio['median_of_run_medians']:.2f}×, mean of per-seed ratios "
        f"{ratio['mean_of_seed_ratios']:.2f}×, geometric mean {ratio['geometric_mean_of_seed_ratios']:.2f}×, "
        f"median of all steps {ratio['median_of_pooled_steps']:.2f}×. OTB arms / mean-baseline arms (mean of run "
        f"medians): {long['kl_ratio_otb_arms_to_mean_baseline_arms']:.2f}×.",
        f"- Spikes, mean-baseline arms vs OTB arms: own median {own['mean_baseline']} vs {own['otb']} (exact "
        f"permutation p = {long['spikes_own_median_p']:.2f}; without step 1, which spikes in every run: "
        f"p = {long['spikes_own_median_without_step_1_p']:.2f}); shared threshold {shared['mean_baseline']} vs "
        f"{shared['otb']} (p = {long['spikes_shared_threshold_p']:.2f}).",
        f"- Step 1's reward is the same in every arm of a seed: {long['step_1_same_in_every_arm']} (one warm start, "
        "the same prompts and sampling uniforms); the first 5 steps already hold 4 updates.",
        f"- End reward, mean-baseline vs OTB arms: p = {long['end_reward_p']:.3f}; gain (end − start): "
        f"p = {long['gain_p']:.3f} (exact permutation, 6 vs 6 runs; read after the runs, not a committed rule).",
        "",
        "## stability (a) (records in `stability/`)",
        "",
        f"- Largest ‖Δθ‖ of a run at step 1: {short['runs_largest_update_at_step_1']} of {short['runs']} runs; "
        f"step 1's ‖Δθ‖ {_span(short['step_1_update_norm_range'])} while its gradient norm spans "
        f"{_span(short['step_1_grad_norm_range'])}.",
        f"- Collapsed: {short['collapsed_runs']} of {short['runs']}. All-zero reward from step: "
        + "; ".join(f"{arm} {_list(steps, 'd')}" for arm, steps in short["zero_reward_from_step"].items())
        + ". Exact permutation p: "
        + "; ".join(f"{pair} {p:.2f}" for pair, p in short["zero_reward_from_step_p"].items())
        + ".",
        f"- Largest gradient norm of a run at step 1: {short['runs_largest_grad_norm_at_step_1']} of {short['runs']} "
        "runs (steps: "
        + "; ".join(f"{arm} {_list(steps, 'd')}" for arm, steps in short["largest_grad_norm_step"].items())
        + ").",
        "",
        "## reproduction (records in `reproduction/`)",
        "",
        f"- τ = {repro['tau']:.3f}, τ − δ = {repro['target']:.3f}; savings: "
        + "; ".join(f"{arm} {reproduction_rule.saving_text(*s)}" for arm, s in repro["savings"].items())
        + ".",
        f"- An N = 4 run generated at most {repro['most_tokens_of_an_n4_run']} tokens in "
        f"{reproduction_rule.STEPS} steps; "
        f"reaching τ − δ only then, in every seed, would save "
        f"{reproduction_rule.saving_text(*repro['saving_if_reached_at_last_step'])} (3 decimals: "
        f"{_list(repro['saving_if_reached_at_last_step'], '.3f')}). At the cap of {repro['n4_token_cap']} tokens "
        f"({reproduction_rule.STEPS} steps × 16 responses × 96 new tokens): "
        f"{reproduction_rule.saving_text(*repro['saving_at_token_cap'])}.",
        "",
        "## variance_lr (records in `variance_lr/`): otb_loo − rloo, M = reward per generated token",
        "",
        "| N | selected rates (rloo, otb_loo) | committed rule | test seeds' d(M), mean [95% t] | sign-flip p | "
        "collapsed (rloo, otb_loo) |",
        "|---|---|---|---|---|---|",
        *[
            f"| {n} | {v['chosen']['rloo']:g}, {v['chosen']['otb_loo']:g} | {v['rule']} | "
            f"{_list(v['d_metric'], '+.3f')}; {v['d_metric_interval'][0]:+.3f} [{v['d_metric_interval'][1]:+.3f}, "
            f"{v['d_metric_interval'][2]:+.3f}] | {v['sign_flip_p']:.3f} | "
            f"{v['collapsed_test_seeds']['rloo']}/5, {v['collapsed_test_seeds']['otb_loo']}/5 |"
            for n, v in data["variance_lr"].items()
        ],
        "",
        "At equal rate (selection seeds 0–2, paired; sign-flip p ≥ 0.25 at n = 3, so no single rate can separate):",
        "",
        "| N | lr | d(M) per seed | sign-flip p | median ‖Δθ‖ ratio otb_loo / rloo | collapsed (otb_loo, rloo) |",
        "|---|---|---|---|---|---|",
        *[
            f"| {n} | {lr} | {_list(e['d_metric'], '+.3f')} | {e['sign_flip_p']:.2f} | {e['step_ratio']:.2f} | "
            f"{e['collapsed'][0]}/3, {e['collapsed'][1]}/3 |"
            for n, v in data["variance_lr"].items()
            for lr, e in v["equal_rate_selection_seeds"].items()
        ],
        "",
        "What each output hangs on (collapses, the selection without a lone collapse, equal-rate pairs, update-size "
        "ratios per window): the section of [variance_lr.md](variance_lr.md) of that name, numbers also under "
        "`variance_lr_dependence` in readings.json.",
        "",
        f"Pilot (records in `variance_lr_pilot/`, {pilot['pilot_seeds']} seeds x {pilot['pilot_prompts']} prompts), "
        f"SNR ratios at N = 4 per seed: include-self OTB / RLOO {_list(pilot['otb_over_rloo'], '.1f')}; include-self "
        f"OTB / GRPO {_list(pilot['otb_over_grpo'], '.1f')}. Contrast otb_loo / rloo at N = 4: "
        f"{pilot['contrast_pilot']:.2f} (ratio of the seed means) in the pilot, {pilot['contrast_snr_gap']:.2f} in "
        f"`snr_gap/copy16_24.json` ({pilot['snr_gap_prompts']} prompts; the pilot's label threshold is "
        f"{variance_runs.CONTRAST}).",
        "",
        "## run time (summed over each experiment's per-run records)",
        "",
        *[
            f"- {name}: {t['runs']} runs, {t['seconds']} s of runs on {', '.join(t['machines'])}"
            for name, t in data["run_seconds"].items()
        ],  # fmt: skip
        "",
        "## parameters (built-in Qwen2, 2 layers, `otb_train.model.build_model_and_tokenizer`)",
        "",
        *[f"- width {w}: {n:,} parameters ({WIDTHS[int(w)]})" for w, n in data["parameters"].items()],
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the committed records are")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    data = readings(args.results)
    title = "Readings of the committed records (issue 28)"
    write_report("readings", title, report(data), time.perf_counter() - started, args.out_dir)
    written = {"command": command_line(), **compact(data)}  # no machine: nothing here is a timing
    (args.out_dir / "readings.json").write_text(json.dumps(written, indent=1, ensure_ascii=False) + "\n")
    return written


if __name__ == "__main__":
    main()
    print((RESULTS / "readings.md").read_text())
