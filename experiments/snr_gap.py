"""Why do two measurements of OTB's SNR advantage over GRPO differ? (issue 28, "Gradient SNR across N")

    python experiments/snr_gap.py --commit      # each setting's warm start if missing (results/snr_gap_warm_start/,
                                                # committed), its SNR record (committed), the report
    python experiments/snr_gap.py --commit --factors all   # and issue 38's factor runs (results/snr_gap_factors/)
    python experiments/snr_gap.py --quick       # seconds (the test suite)

results/gradient_variance.md (copy_exact with 16-24-digit answers, width 64, warm start at a sampled exact-copy
rate of 0.38) has include-self OTB 31-51x GRPO's SNR at equal N and OTB at N = 2.16 matching GRPO at N = 32. An
independent study (answers of 1-4 and 7-15 digits, warm starts at exact-copy rates 0.49 and 0.57, 16 prompts x 48
repetitions) found OTB 1.7-7x GRPO and the match at N = 6-13. Candidate causes: the task's length, the warm start's
level, the include-self bias, the proxy vs exact energy. This measures the first two directly, with one code path:

* **Settings.** ``copy_exact`` with answers of 1-4, 7-15 and 16-24 digits, each from a width-64 warm start of
  ``experiments/warm_start.py`` (for 1-4 and 7-15: stopped at the first evaluation, every 2 steps, whose sampled
  exact-copy rate reaches 0.5; for 16-24: the committed ``results/variance_lr_warm_start/``, 0.414).
* **SNR.** At each warm start, R = 24 batches of 16 prompts x N responses, N in {2, 4, 8, 16, 32} (the N-batch is
  the first N of 32 responses per prompt); ``SNR = ‖E g‖² / tr Cov g`` of the token-mean surrogate's gradient, by
  the pair U-statistic (as in experiments/gradient_variance.py); estimators grpo (std-scaled), otb (include-self,
  proxy), otb_loo, rloo. Reported: each SNR, otb / grpo at equal N, and N* = the N at which otb's SNR
  reaches grpo's at N = 32 (linear in log2 N), with 90% bootstrap intervals over the batches.
* **Against ∇J** (issue 38): SNR∥ = ρ²/(1 − ρ²), the MSE against ∇J and the cosine, ∇J = RLOO's mean at N = 32
  on the same batches (experiments/gradient_variance.py's statistics), with N*∥ on SNR∥.
* **Factor by factor** (issue 38, ``FACTORS``): one setting with one thing changed (fixed vs resampled prompts, the
  gradient's normalisation, the reward, the warm start's recipe), to see what moves N* toward the independent's.
* **Not measured here**: the exact energy (experiments/gradient_variance.py has otb_exact equal to otb within its
  intervals at 16-24 digits) and the independent study's own code.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from common import commit, gradients, machine_name, read_code_state, write_report
from otb_train.warm_start import main as train_warm_start

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {  # name -> (copy lengths, max new tokens, warm-start target or None for the committed warm start)
    "copy1_4": ((1, 4), 8, 0.5),
    "copy7_15": ((7, 15), 20, 0.5),
    "copy16_24": ((16, 24), 32, None),
}
QUICK_SETTINGS = {"quick": ((2, 3), 6, 0.05)}
ESTIMATORS = {
    "grpo": ("grpo", {}),
    "otb": ("otb", {}),
    "otb_loo": ("otb", {"leave_one_out": True}),
    "rloo": ("rloo", {}),  # GRPO without std has exactly RLOO's SNR (advantages (N-1)/N of RLOO's): not repeated
}
GROUP_SIZES = (2, 4, 8, 16, 32)
PROMPTS, REPLICATES, PROMPT_SEED = 16, 24, 30_000
# Issue 38's factor-by-factor trace: one setting with exactly one thing changed toward what the independent study
# describes (or may have done differently), its record in results/snr_gap_factors/. Options: "prompts" ("fixed":
# the same 16 prompts in every batch, as the settings; "resampled": 16 fresh prompts per batch), "normalisation"
# ("token_mean": Σ_it A_it log π / #tokens, as the settings; "per_response": Σ_it A_it log π / (P·N), the study's),
# "reward" ("copy_exact": 1 exactly when the response is the answer then EOS; "prefix": 1 when the response begins
# with the answer, EOS not required), "warm" (extra warm_start.py flags: another recipe to the same target).
FACTORS = {
    "copy7_15_resampled": ("copy7_15", {"prompts": "resampled"}),
    "copy7_15_per_response": ("copy7_15", {"normalisation": "per_response"}),
    "copy7_15_prefix_reward": ("copy7_15", {"reward": "prefix"}),
    "copy7_15_warm_lr1e-3": ("copy7_15", {"warm": ["--lr", "1e-3"]}),
    "copy7_15_warm_seed1": ("copy7_15", {"warm": ["--seed", "1"]}),
    "copy1_4_resampled": ("copy1_4", {"prompts": "resampled"}),
    "copy1_4_per_response": ("copy1_4", {"normalisation": "per_response"}),
    "copy1_4_prefix_reward": ("copy1_4", {"reward": "prefix"}),
    "copy1_4_warm_lr1e-3": ("copy1_4", {"warm": ["--lr", "1e-3"]}),
}
QUICK_FACTORS = {
    "quick_resampled": ("quick", {"prompts": "resampled"}),
    "quick_per_response": ("quick", {"normalisation": "per_response"}),
    "quick_prefix_reward": ("quick", {"reward": "prefix"}),
    "quick_warm_seed1": ("quick", {"warm": ["--seed", "1"]}),
}


def ensure_warm(name: str, setting, warm_dir: Path, quick: bool, commit_it: bool = False, flags=()) -> Path:
    """The setting's warm start: the committed one of variance_lr, or ``warm_dir/name``, trained if missing (and
    committed with ``commit_it``: a width-64 checkpoint is about 0.5 MB); ``flags``: extra warm_start.py flags."""
    (low, high), _, target = setting
    if target is None:
        return ROOT / "results" / "variance_lr_warm_start"
    warm = warm_dir / name
    if not (warm / "config.json").exists():
        extra = ["--steps", "10", "--hidden-size", "32", "--eval-prompts", "16"] if quick else ["--hidden-size", "64"]
        train_warm_start(["--out", str(warm), "--task", "copy_exact", "--copy-lengths", str(low), str(high),
                         "--target-reward", str(target), "--eval-every", "2", *extra, *flags])  # fmt: skip
        if commit_it:
            commit([warm], f"{warm.relative_to(ROOT)}: the warm start of snr_gap's {name}")
    return warm


def batch_gradients(lm, sample, sizes, per_response: bool = False) -> torch.Tensor:
    """[E, len(sizes), P]: as ``variance_lr_pilot.batch_gradients``, but one forward per N over only the rows it
    uses (the first N responses of each group), which is cheaper when N ranges over 2..32. ``per_response``: the
    surrogate is divided by the number of responses P·N instead of the batch's token count."""
    from otb_ref import compute_advantages
    from otb_train.model import Policy
    from otb_train.rollout import position_ids_from_mask

    n_max, mask = sample.group_size, sample.mask.float()
    groups, params = len(mask) // n_max, list(lm.parameters())
    out = torch.zeros(len(ESTIMATORS), len(sizes), sum(p.numel() for p in params))
    for k, n in enumerate(sizes):
        rows = torch.tensor([g * n_max + i for g in range(groups) for i in range(n)])
        sequences, sub_mask = sample.sequences[rows], sample.mask[rows]
        attention = torch.cat([torch.ones(len(rows), sample.num_prompt, dtype=torch.bool), sub_mask], dim=1)
        log_probs, _ = Policy(lm, 1.0, None)(
            sequences, attention, position_ids_from_mask(attention), targets=sequences[:, sample.num_prompt :]
        )
        index, tokens = (
            torch.arange(groups).repeat_interleave(n),
            float(len(rows) if per_response else mask[rows].sum()),
        )
        for e, (estimator, flags) in enumerate(ESTIMATORS.values()):
            advantages, _ = compute_advantages(
                estimator, sample.rewards[rows], mask[rows], index, old_log_probs=sample.old_log_probs[rows],
                sum_pi_squared=sample.sum_pi_squared[rows], **flags,
            )  # fmt: skip
            objective = (advantages * mask[rows] * log_probs).sum() / tokens
            grads = torch.autograd.grad(objective, params, retain_graph=e + 1 < len(ESTIMATORS), allow_unused=True)
            out[e, k] = torch.cat(
                [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
            )
    return out


def _quantiles(draws: torch.Tensor, levels: torch.Tensor) -> list:
    """[low, high] of each column of draws [S, ...] (NaN draws dropped; inf kept: the nearest draw, so an interval
    whose end is an inf draw (SNR∥ where ρ² reaches 1) reads inf, not NaN), as nested lists."""
    return torch.nanquantile(draws.double(), levels, dim=0, interpolation="nearest").movedim(0, -1).tolist()


def directional_statistics(grads: torch.Tensor, sizes, bootstrap: int = 2000, seed: int = 0) -> dict:
    """Issue 38: against ∇J = RLOO's E g at the largest N (unbiased pair statistics on the same batches, as in
    experiments/gradient_variance.py): the directional SNR∥ = ρ²/(1 − ρ²), the MSE E‖g − ∇J‖² / ‖∇J‖², the cosine,
    each [E, N] with a 90% bootstrap interval over the batches; N*∥, the N at which otb's SNR∥ reaches grpo's at
    the largest N; and the noise of ∇J's estimate (tr Cov / R / ‖∇J‖²)."""
    names, r = list(ESTIMATORS), len(grads)
    reference = (names.index("rloo"), len(sizes) - 1)
    own, cross = gradients.gram_matrices(grads, reference)
    draws = torch.randint(r, (bootstrap, r), generator=torch.Generator().manual_seed(seed))
    weights = torch.zeros(bootstrap, r, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(bootstrap, r, dtype=torch.float64)
    )
    point = gradients.statistics(own, cross, reference, torch.ones(1, r, dtype=torch.float64))
    boot = gradients.statistics(own, cross, reference, weights)
    levels = torch.tensor([0.05, 0.95], dtype=torch.float64)
    out = {}
    for key in ("snr_par", "mse_rel", "cosine"):
        out[key], out[f"{key}_90"] = point[key][0].tolist(), _quantiles(boot[key], levels)
    grpo, otb = names.index("grpo"), names.index("otb")

    def n_star(snr):  # [S, E, N] -> [S]
        return gradients.crossing(snr[:, otb], snr[:, grpo, -1], list(sizes))

    boot_star = n_star(boot["snr_par"])
    finite = boot_star[boot_star.isfinite()]
    out["n_star_par"] = float(n_star(point["snr_par"])[0])
    out["n_star_par_90"] = torch.quantile(finite, levels).tolist() if len(finite) else [math.nan, math.nan]
    out["n_star_par_never"] = float((~boot_star.isfinite()).double().mean())
    out["reference_noise"] = float(point["ref_noise"][0])
    return out


def rescore_prefix(sample, problems) -> None:
    """The "prefix" reward in place: 1 on a response's last token when the response begins with its prompt's
    answer, EOS not required."""
    from otb_train.tasks import CharTokenizer

    tokenizer, lengths = CharTokenizer(), sample.mask.sum(dim=1)
    responses = sample.sequences[:, sample.num_prompt :]
    answers = [problem.answer for problem in problems for _ in range(sample.group_size)]
    texts = [tokenizer.decode(row[: int(n)].tolist()) for row, n in zip(responses, lengths)]
    scores = torch.tensor([float(text.startswith(answer)) for text, answer in zip(texts, answers)])
    sample.rewards = torch.zeros(sample.mask.shape).scatter_(1, (lengths - 1)[:, None], scores[:, None])


def measure(name: str, setting, warm: Path, prompts: int, replicates: int, sizes, reward: str, options=None) -> dict:
    """One record: every estimator's gradient on ``replicates`` batches, SNR, N*, and the statistics against ∇J;
    ``options``: a factor of :data:`FACTORS` (prompts, normalisation, reward), none for the settings."""
    from transformers import AutoModelForCausalLM

    from otb_train.tasks import synthetic_problem

    lengths, max_new, _ = setting
    options = options or {}
    code = read_code_state()  # the code this process started with (issue 38)
    lm = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval()
    grads, rewards, started = [], [], time.perf_counter()
    for replicate in range(replicates):
        first = replicate * prompts if options.get("prompts") == "resampled" else 0
        problems = [
            synthetic_problem("copy_exact", PROMPT_SEED, first + i, copy_lengths=lengths) for i in range(prompts)
        ]
        sample = gradients.sample_batch(lm, problems, max(sizes), replicate + 1, max_new, PROMPT_SEED, reward)
        if options.get("reward") == "prefix":
            rescore_prefix(sample, problems)
        grads.append(batch_gradients(lm, sample, sizes, options.get("normalisation") == "per_response"))
        rewards.append(float(sample.rewards.sum() / len(sample.mask)))
    stats = gradients.snr_statistics(torch.stack(grads))
    names = list(ESTIMATORS)
    grpo, otb = names.index("grpo"), names.index("otb")

    def n_star(snr):  # [S, E, N] -> [S]: N at which otb reaches grpo's SNR at the largest N
        return gradients.crossing(snr[:, otb], snr[:, grpo, -1], list(sizes))

    point = n_star(stats["snr"][None])[0]
    boot = n_star(stats["boot_snr"])
    finite = boot[boot.isfinite()]
    levels = torch.tensor([0.05, 0.95], dtype=boot.dtype)
    interval = torch.quantile(finite, levels).tolist() if len(finite) else [math.nan, math.nan]
    ratio = stats["boot_snr"][:, otb] / stats["boot_snr"][:, grpo]  # [S, N]
    ratio_interval = [torch.quantile(ratio[:, k].nan_to_num(nan=0.0), levels).tolist() for k in range(len(sizes))]
    record = {
        "setting": name, "copy_lengths": list(lengths),
        "warm": str(warm.relative_to(ROOT) if warm.is_relative_to(ROOT) else warm.name),
        "prompts": prompts, "replicates": replicates, "group_sizes": list(sizes), "estimators": names,
        "snr": stats["snr"].tolist(), "otb_over_grpo": (stats["snr"][otb] / stats["snr"][grpo]).tolist(),
        "otb_over_grpo_90": ratio_interval, "n_star": float(point), "n_star_90": interval,
        "n_star_never": float((~boot.isfinite()).double().mean()), "mean_reward": sum(rewards) / len(rewards),
        "seconds": round(time.perf_counter() - started), "machine": machine_name(), "code": code, "factor": options,
        **directional_statistics(torch.stack(grads), sizes),
    }  # fmt: skip
    if warm.name != "variance_lr_warm_start" and (warm / "warm_start.json").exists():
        record["warm_start"] = {
            k: json.loads((warm / "warm_start.json").read_text())[k] for k in ("steps_run", "final_sampled_reward")
        }
    return record


def _interval(value: float, bounds) -> str:
    return f"{value:.3g} [{bounds[0]:.3g}, {bounds[1]:.3g}]"


def _n_star(r: dict, key: str = "n_star") -> str:
    """N* (or N*∥) with its interval over the bootstrap draws that reach the target, and the share that never do."""
    never = r.get(f"{key}_never", 0.0)
    return _interval(r[key], r[f"{key}_90"]) + (f"; never in {never:.0%} of draws" if never else "")


def _warm_text(r: dict) -> str:
    warm = r.get("warm_start")
    return f"{warm['steps_run']}, {warm['final_sampled_reward']:.3f}" if warm else "committed, 0.414"


def report(records: list[dict], out_dir: Path, seconds: float, factor_records: list[dict] = ()) -> Path:
    sizes = records[0]["group_sizes"] if records else list(GROUP_SIZES)
    sections = [
        "SNR = ‖E g‖² / tr Cov g of the batch gradient (16 prompts x N, 24 batches) at each setting's warm start; "
        "include-self OTB (proxy energy) vs std-scaled GRPO. Design: the docstring of `experiments/snr_gap.py`. "
        "N* is where otb's SNR reaches grpo's SNR at the largest N; N*∥ the same on the directional SNR∥ "
        "(below).",
        "",
        "| setting | warm start: steps, sampled exact-copy rate | mean reward of the batches "
        f"| grpo SNR at N = {sizes[0]}, {sizes[-1]} | N* on SNR [90%] | N*∥ on SNR∥ [90%] | "
        + " | ".join(f"otb / grpo at N = {n} [90%]" for n in sizes) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(sizes),
    ]  # fmt: skip
    for r in records:
        ratios = " | ".join(_interval(v, b) for v, b in zip(r["otb_over_grpo"], r["otb_over_grpo_90"]))
        grpo = r["snr"][r["estimators"].index("grpo")]
        par = _n_star(r, "n_star_par") if "n_star_par" in r else "not measured"
        sections.append(
            f"| {r['setting']} | {_warm_text(r)} | {r['mean_reward']:.3f} | {grpo[0]:.3g}, {grpo[-1]:.3g} "
            f"| {_n_star(r)} | {par} | {ratios} |"
        )
    sections += ["", "SNR by estimator and N:", ""]
    for r in records:
        head = "| estimator | " + " | ".join(f"N={n}" for n in r["group_sizes"]) + " |"
        sections += [f"**{r['setting']}**", "", head, "|---|" + "---|" * len(r["group_sizes"])]
        for e, name in enumerate(r["estimators"]):
            sections.append(f"| {name} | " + " | ".join(f"{v:.3g}" for v in r["snr"][e]) + " |")
        sections.append("")
    sections += directional_sections(records)
    sections += factor_sections(records, list(factor_records))
    timed = [*records, *factor_records]
    sections += ["Seconds per record (the measurement, warm start excluded; each record's machine and code commit are "
                 "in it): " + ", ".join(f"{r['setting']} {r['seconds']}" for r in timed) + "."]  # fmt: skip
    return write_report("snr_gap", "OTB vs GRPO gradient SNR: task length and warm start", sections, seconds, out_dir)


def factor_sections(records: list[dict], factor_records: list[dict]) -> list[str]:
    """Issue 38's trace: each factor run beside the setting it changes one thing of (records in snr_gap_factors/)."""
    by_name = {r["setting"]: r for r in records}
    lines = [
        "## Factor by factor (issue 38): what moves N* toward the independent study's",
        "",
        "Each row changes one thing of a setting (`FACTORS` in `experiments/snr_gap.py`; same prompts' seed, "
        "batches and estimators otherwise). The independent study's numbers, as issue 38 quotes them: N* ≈ 5.6 "
        "at 1-4 digits and 12.8 at 7-15; GRPO's SNR 0.80 at N = 2 and 35 at N = 32 at 7-15 digits.",
        "",
        "| run | setting | changed | warm start: steps, rate | mean reward | grpo SNR at N = 2, 32 "
        "| otb / grpo over N | N* on SNR [90%] | N*∥ on SNR∥ [90%] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    bases = sorted({FACTORS.get(f["setting"], QUICK_FACTORS.get(f["setting"], (None,)))[0] for f in factor_records})
    rows = [(by_name[b], "nothing (the setting)") for b in bases if b in by_name]
    rows += [(f, json.dumps(f.get("factor", {}))) for f in factor_records]
    for r, changed in rows:
        base = FACTORS.get(r["setting"], QUICK_FACTORS.get(r["setting"], (r["setting"],)))[0]
        grpo, ratios = r["snr"][r["estimators"].index("grpo")], r["otb_over_grpo"]
        lines.append(
            f"| {r['setting']} | {base} | {changed} | {_warm_text(r)} | {r['mean_reward']:.3f} "
            f"| {grpo[0]:.3g}, {grpo[-1]:.3g} | {min(ratios):.3g}-{max(ratios):.3g} "
            f"| {_n_star(r)} | {_n_star(r, 'n_star_par')} |"
        )
    not_run = [k for k in FACTORS if k not in {f["setting"] for f in factor_records}]
    if not_run and not any(f["setting"] in QUICK_FACTORS for f in factor_records):
        lines += ["", f"Not run: {', '.join(not_run)}."]
    return lines + [""]


def directional_sections(records: list[dict]) -> list[str]:
    """SNR∥, MSE and cosine against ∇J per setting (records made before issue 38 have none: said so)."""
    old = [r["setting"] for r in records if "snr_par" not in r]
    lines = ["## Against ∇J (issue 38): directional SNR∥, MSE, cosine", ""]
    if old:
        lines += [f"Records without these statistics (made before issue 38; rerun to add them): {', '.join(old)}.", ""]
    for r in (r for r in records if "snr_par" in r):
        lo, hi = r["n_star_par_90"]
        lines += [
            f"**{r['setting']}**: N*∥ (otb's SNR∥ reaches grpo's at N = {r['group_sizes'][-1]}) = "
            f"{r['n_star_par']:.3g} [{lo:.3g}, {hi:.3g}]; noise of ∇J's estimate (RLOO, N = {r['group_sizes'][-1]}, "
            f"{r['replicates']} batches): tr Cov / R / ‖∇J‖² = {r['reference_noise']:.3g}.",
            "",
            "| estimator | measure | " + " | ".join(f"N={n}" for n in r["group_sizes"]) + " |",
            "|---|---|" + "---|" * len(r["group_sizes"]),
        ]
        for e, name in enumerate(r["estimators"]):
            for key, label in (("snr_par", "SNR∥"), ("mse_rel", "MSE / ‖∇J‖²"), ("cosine", "cos")):
                cells = [f"{v:.3g} [{a:.3g}, {b:.3g}]" for v, (a, b) in zip(r[key][e], r[f"{key}_90"][e])]
                lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def run_missing(jobs: dict, records_dir: Path, args, quick: bool) -> None:
    """Each job ``name -> (setting name, options)`` whose record is missing: its warm start, its record (committed
    with ``--commit``)."""
    settings = QUICK_SETTINGS if quick else SETTINGS
    prompts, replicates, sizes = (2, 3, (2, 4)) if quick else (PROMPTS, REPLICATES, GROUP_SIZES)
    for name, (base, options) in jobs.items():
        path = records_dir / f"{name}.json"
        if path.exists():
            continue
        setting, flags = settings[base], options.get("warm", [])
        warm = ensure_warm(name if flags else base, setting, args.warm_dir, quick, args.commit, flags)
        reward = "copy" if quick else "copy_exact"
        record = measure(name, setting, warm, prompts, replicates, sizes, reward, options)
        records_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record) + "\n")
        if args.commit:
            commit([path], f"{path.relative_to(ROOT)}: {name} ({machine_name()})")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--commit", action="store_true")
    parser.add_argument("--settings", nargs="*", default=None, help="the settings to run (default: all)")
    parser.add_argument("--factors", nargs="*", default=[], help="issue 38's factor runs (FACTORS) to run, or all")
    parser.add_argument(
        "--warm-dir", type=Path, default=ROOT / "results" / "snr_gap_warm_start", help="the trained warm starts"
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a shared 2-core box: one thread per heavy process
    started, records_dir = time.perf_counter(), args.out_dir / "snr_gap"
    settings, factors = (QUICK_SETTINGS, QUICK_FACTORS) if args.quick else (SETTINGS, FACTORS)
    chosen = list(settings) if args.settings is None else args.settings
    run_missing({k: (k, {}) for k in chosen}, records_dir, args, args.quick)
    wanted = list(factors) if args.factors == ["all"] else args.factors
    unknown = [k for k in wanted if k not in factors]
    if unknown:
        parser.error(f"--factors: unknown {unknown}; choose from {list(factors)} or all")
    run_missing({k: factors[k] for k in wanted}, args.out_dir / "snr_gap_factors", args, args.quick)
    records = [json.loads(p.read_text()) for p in sorted(records_dir.glob("*.json"))]
    factor_records = [json.loads(p.read_text()) for p in sorted((args.out_dir / "snr_gap_factors").glob("*.json"))]
    return report(records, args.out_dir, time.perf_counter() - started, factor_records)


if __name__ == "__main__":
    print(main())
