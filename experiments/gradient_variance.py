"""The paper's mechanism measured directly: variance and bias of the mini-batch policy gradient in parameter space.

    python experiments/gradient_variance.py            # copy16 snapshots warm/mid/late, ~10 min on one CPU thread
    python experiments/gradient_variance.py --quick    # seconds: the tiny "quick" snapshots, R = 3, N in {2, 4}

No training. At fixed policy snapshots (``experiments/snapshots.py``) a batch is P prompts x N responses; its
gradient is that of the on-policy token-mean surrogate ``Σ_it a_it log π(y_it) / #tokens`` (PPO's loss at ratio 1),
flattened over every parameter. R independent batches are drawn; each batch is reused by every estimator (only
the advantages differ). The N-response batch of a replicate is the first N of its 32 responses per prompt:
batches of one replicate overlap across N (a paired comparison), batches of different replicates are independent.

How: one per-token Jacobian ``J_i = [∇_θ log π(y_it)]_t`` per response (``torch.func``, float32) gives every
estimator's gradient (``Σ_it a_it J_it``, the advantages of ``otb_ref.compute_advantages``) and the exact
energies ``||S_t||² = ||Σ_{j<=t} J_ij||²`` (otb_exact) and ``||S||²`` (eob, the last ``||S_t||²``).

Statistics, from the Gram matrices of the R gradients (all unbiased, none is a ratio of noisy means):
``||E g||²`` by the U-statistic over pairs of different batches (= ``||ḡ||² − tr Ĉov / R``), ``tr Cov g`` =
mean ``||g||²`` − that, SNR = their ratio; cosine, scale and bias against the reference ``E g`` of RLOO at
N = 32 (``REFERENCE``) from cross U-statistics. Intervals: percentiles of a bootstrap over the R batches.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.func import functional_call, jacrev, vmap

from common import RESULTS, new_figure, snapshots, write_records, write_report
from common.gradients import Sample, crossing, gram_matrices, sample_batch, statistics
from otb_ref import compute_advantages
from otb_train.tasks import synthetic_problem

ROOT = Path(__file__).resolve().parents[1]

# name -> (otb_ref estimator, flags); None is REINFORCE without a baseline (advantage = return).
ESTIMATORS = {
    "reinforce": (None, {}),
    "grpo": ("grpo", {}),
    "grpo_nostd": ("grpo", {"std_normalize": False}),
    "rloo": ("rloo", {}),
    "opo": ("opo", {}),
    "otb": ("otb", {}),
    "otb_loo": ("otb", {"leave_one_out": True}),
    "otb_exact": ("otb_exact", {}),
    "eob": ("eob", {}),
}
REFERENCE = ("rloo", 32)  # E g of this estimator at this N is g_ref (unbiased; the largest N)
TARGET = ("grpo", 32)  # the SNR the other estimators have to reach
LEVEL = 0.90  # bootstrap interval


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    setting: str
    snapshots: tuple[str, ...]
    prompts: int
    replicates: int
    group_sizes: tuple[int, ...]
    bootstrap: int = 2000
    task: str = "copy_exact"  # reward; the prompts are the copy prompts either way
    seed: int = 0
    chunk: int = 4  # responses per vmapped Jacobian


FULL = Plan("copy16", ("warm", "mid", "late"), prompts=4, replicates=32, group_sizes=(2, 4, 8, 16, 32))
# The quick snapshots never produce an exact copy (reward 0 everywhere, every gradient 0): quick mode scores the
# same prompts with the copy task's graded reward, so its gradients are not all zero.
QUICK = Plan("quick", ("warm", "late"), prompts=2, replicates=3, group_sizes=(2, 4), bootstrap=200, task="copy")


# ----------------------------------------------------------------------------- sampling and per-batch gradients


def _row_log_probs(lm, num_prompt: int, params: dict, row: torch.Tensor) -> torch.Tensor:
    """log π(y_t) [T] of one row ``[L + T]`` (positions 0..L+T-1, as Policy gives an unpadded row)."""
    logits = functional_call(lm, params, (row[None],), {"use_cache": False}).logits[0, num_prompt - 1 : -1]
    return logits.float().log_softmax(dim=-1).gather(-1, row[num_prompt:, None]).squeeze(-1)


def token_jacobians(lm, sequences: torch.Tensor, mask: torch.Tensor, num_prompt: int, chunk: int) -> list:
    """Per chunk of ``chunk`` consecutive rows, ``J[i, t] = ∇_θ log π(y_it)`` [rows, span, P] (``vmap(jacrev)``),
    θ = every parameter flattened in ``lm.parameters()`` order, span = the chunk's longest response. Columns past a
    row's end hold padding's gradients (a causal model's earlier log-probs never see them): callers mask them."""
    params = {name: p.detach() for name, p in lm.named_parameters()}
    row_jacobian = vmap(jacrev(functools.partial(_row_log_probs, lm, num_prompt)), in_dims=(None, 0))
    lengths, out = mask.sum(dim=1), []
    for start in range(0, len(mask), chunk):
        span = int(lengths[start : start + chunk].max())
        jac = row_jacobian(params, sequences[start : start + chunk, : num_prompt + span])
        out.append(torch.cat([j.flatten(2) for j in jac.values()], dim=-1))
    return out


def prefix_energies(jacobians: list, mask: torch.Tensor) -> torch.Tensor:
    """Exact ``||S_t||² = ||Σ_{j<=t} m_j J_j||²`` [B, T] of the chunks of :func:`token_jacobians` (0 off the mask)."""
    energies, row = torch.zeros(mask.shape), 0
    for jac in jacobians:
        running = torch.zeros(jac.shape[0], jac.shape[2])
        for t in range(jac.shape[1]):
            running += jac[:, t]
            energies[row : row + len(jac), t] = torch.linalg.vector_norm(running, dim=-1).square()
        row += len(jac)
    return energies * mask


def advantages(name: str, rewards, mask, old_log_probs, sum_pi_squared, energies) -> torch.Tensor:
    """[N, T] advantages of estimator ``name`` for one group of N responses (prefix energies for the exact ones)."""
    estimator, flags = ESTIMATORS[name]
    if estimator is None:
        return rewards.sum(dim=1, keepdim=True) * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)[:, None]
    extra = {
        "otb_exact": {"cumulative_energy": energies},
        "eob": {"grad_norms_sq": energies.gather(1, last).squeeze(1)},
    }.get(estimator, {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared})
    index = torch.zeros(len(rewards), dtype=torch.long)
    return compute_advantages(estimator, rewards, mask, index, **extra, **flags)[0]


def batch_gradients(lm, sample: Sample, group_sizes, chunk: int = 4) -> tuple[torch.Tensor, dict]:
    """Every estimator's batch gradient at every N: ``[E, len(group_sizes), P]``, and per-N batch facts.

    Group by group: the group's Jacobians and exact energies; for each N the advantages of its first N responses;
    then per chunk of rows one product ``coefficients @ J`` adds ``Σ_it a_it J_it`` to every N that uses those rows.
    Finally each N is divided by its batch's token count (the token-mean surrogate)."""
    n_max, names, sizes = sample.group_size, list(ESTIMATORS), list(group_sizes)
    tokens, zero_groups, sums = torch.zeros(len(sizes)), torch.zeros(len(sizes)), None
    for start in range(0, len(sample.mask), n_max):
        rows = slice(start, start + n_max)
        mask = sample.mask[rows].float()
        jacobians = token_jacobians(lm, sample.sequences[rows], mask, sample.num_prompt, chunk)
        group = (sample.rewards[rows], mask, sample.old_log_probs[rows], sample.sum_pi_squared[rows])
        group += (prefix_energies(jacobians, mask),)
        coefficients = torch.zeros(len(sizes), len(names), n_max, mask.shape[1])  # [N, E, rows, T], 0 past row N
        for k, n in enumerate(sizes):
            first = [x[:n] for x in group]
            coefficients[k, :, :n] = torch.stack([advantages(name, *first) * first[1] for name in names])
            tokens[k] += first[1].sum()
            scores = first[0].sum(dim=1)
            zero_groups[k] += float(scores.max() == scores.min())
        sums = sums if sums is not None else torch.zeros(len(sizes), len(names), jacobians[0].shape[-1])
        row = 0
        for jac in jacobians:
            used = [k for k, n in enumerate(sizes) if n > row]  # the N whose batches hold some of these rows
            c = coefficients[used, :, row : row + len(jac), : jac.shape[1]]  # [n_used, E, rows, span]
            sums[used] += (c.flatten(2) @ jac.flatten(0, 1)).view(len(used), len(names), -1)
            row += len(jac)
    facts = {"tokens": tokens, "zero_variance_groups": zero_groups / (len(sample.mask) // n_max)}
    return (sums / tokens[:, None, None]).transpose(0, 1), facts


# ----------------------------------------------------------------------------- statistics from Gram matrices


def summarize(grads: torch.Tensor, plan: Plan) -> dict:
    """Point estimates and bootstrap draws of every statistic, and each estimator's N reaching TARGET's SNR."""
    names, sizes = list(ESTIMATORS), list(plan.group_sizes)
    reference = (names.index(REFERENCE[0]), sizes.index(min(REFERENCE[1], max(sizes))))
    target = (names.index(TARGET[0]), sizes.index(min(TARGET[1], max(sizes))))
    own, cross = gram_matrices(grads, reference)
    r = len(grads)
    generator = torch.Generator().manual_seed(plan.seed)
    draws = torch.randint(r, (plan.bootstrap, r), generator=generator)
    weights = torch.zeros(plan.bootstrap, r, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(plan.bootstrap, r, dtype=torch.float64)
    )
    point = statistics(own, cross, reference, torch.ones(1, r, dtype=torch.float64))
    boot = statistics(own, cross, reference, weights)
    for stats in (point, boot):
        for key, snr in (("n_star", "snr"), ("n_star_par", "snr_par")):
            goal = stats[snr][:, target[0], target[1]]
            stats[key] = torch.stack([crossing(stats[snr][:, e], goal, sizes) for e in range(len(names))], 1)
    return {"point": {k: v[0] for k, v in point.items()}, "boot": boot}


# ----------------------------------------------------------------------------- one snapshot


def measure_snapshot(path: Path, plan: Plan, max_new_tokens: int, copy_lengths) -> dict:
    """R batches at one snapshot: every estimator's gradient at every N, then the statistics."""
    from transformers import AutoModelForCausalLM

    # eager attention: vmap has batching rules for its ops (SDPA's CPU kernel falls back to a loop)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    problems = [synthetic_problem("copy_exact", plan.seed, i, copy_lengths=copy_lengths) for i in range(plan.prompts)]
    n_max = max(plan.group_sizes)
    grads, tokens, zero, rewards, started = [], 0.0, 0.0, [], time.perf_counter()
    for replicate in range(plan.replicates):
        sample = sample_batch(lm, problems, n_max, replicate + 1, max_new_tokens, plan.seed, plan.task)
        g, facts = batch_gradients(lm, sample, plan.group_sizes, plan.chunk)
        grads.append(g)
        tokens, zero = tokens + facts["tokens"], zero + facts["zero_variance_groups"]
        rewards.append(float(sample.rewards.sum() / len(sample.mask)))
        elapsed = time.perf_counter() - started
        print(f"  {path.name}: batch {replicate + 1}/{plan.replicates}, {elapsed:.0f} s", file=sys.stderr, flush=True)
    result = summarize(torch.stack(grads), plan)
    result.update(
        tokens=(tokens / plan.replicates).tolist(),
        zero_variance=(zero / plan.replicates).tolist(),
        reward=sum(rewards) / len(rewards),
        params=grads[0].shape[-1],
    )
    return result


# ----------------------------------------------------------------------------- report


def interval(values: torch.Tensor, digits: int = 3) -> str:
    """``[low, high]`` bootstrap percentiles (``LEVEL``), NaN draws dropped."""
    finite = values[~values.isnan()]
    if len(finite) == 0:
        return "[n/a]"
    levels = torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)
    low, high = torch.quantile(finite.double(), levels, interpolation="nearest")
    return f"[{_number(float(low), digits)}, {_number(float(high), digits)}]"


def _number(value: float, digits: int = 3) -> str:
    if math.isnan(value):
        return "n/a"
    return "inf" if math.isinf(value) else f"{value:.{digits}g}"


def matrix_table(result: dict, key: str, sizes, digits: int = 3) -> list[str]:
    """Estimators x N, each cell the point estimate and its bootstrap interval."""
    lines = ["| estimator | " + " | ".join(f"N={n}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for e, name in enumerate(ESTIMATORS):
        cells = [
            f"{_number(float(result['point'][key][e, k]), digits)} {interval(result['boot'][key][:, e, k], 2)}"
            for k in range(len(sizes))
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def n_star_text(result: dict, e: int, sizes, key: str = "n_star") -> str:
    """The N at which estimator ``e`` reaches TARGET's SNR (``key`` "n_star_par": its SNR∥): point, bootstrap
    interval and median."""
    point = float(result["point"][key][e])
    draws = result["boot"][key][:, e]
    levels = torch.tensor([(1 - LEVEL) / 2, 0.5, (1 + LEVEL) / 2], dtype=draws.dtype)
    low, median, high = torch.nanquantile(draws, levels, interpolation="nearest")
    below = "<=" if point <= sizes[0] else ""
    never = f"> {sizes[-1]}" if math.isinf(point) else f"{below}{point:.3g}"
    return f"{never} [{_number(float(low))}, {_number(float(high))}], median {_number(float(median))}"


def headline(results: dict, plan: Plan, key: str = "n_star") -> list[str]:
    """Per snapshot and estimator: the N reaching GRPO's SNR (``key`` "n_star_par": SNR∥) at N=32, and the
    generated tokens that saves."""
    sizes, names = list(plan.group_sizes), list(ESTIMATORS)
    target_n = min(TARGET[1], max(sizes))
    measure = "SNR∥" if key == "n_star_par" else "SNR"
    lines = [
        f"N at which each estimator's {measure} reaches {TARGET[0]}'s {measure} at N = {target_n} (interpolated "
        "linearly in "
        f"log2 N; `<={sizes[0]}`: already at N = {sizes[0]}; `> {sizes[-1]}`: never on the grid); point estimate, "
        f"{LEVEL:.0%} bootstrap interval over the R batches and bootstrap median. Tokens saved = 1 − N*/{target_n} "
        "(every estimator uses the same samples, so tokens per batch are proportional to N).",
        "",
        "| estimator | " + " | ".join(results) + " |",
        "|---" * (len(results) + 1) + "|",
    ]
    for e, name in enumerate(names):
        cells = []
        for result in results.values():
            point = float(result["point"][key][e])
            saving = f"; saves {1 - point / target_n:.0%}" if math.isfinite(point) else ""
            cells.append(n_star_text(result, e, sizes, key) + saving)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def ratio_table(results: dict, plan: Plan) -> list[str]:
    """SNR / GRPO's SNR at the same N (same batches: a paired ratio), per snapshot."""
    sizes, target = list(plan.group_sizes), list(ESTIMATORS).index(TARGET[0])
    lines = [
        "| snapshot | estimator | " + " | ".join(f"N={n}" for n in sizes) + " |",
        "|---" * (len(sizes) + 2) + "|",
    ]
    for snapshot, result in results.items():
        point, boot = result["point"]["snr"], result["boot"]["snr"]
        for e, name in enumerate(ESTIMATORS):
            if e == target:
                continue
            cells = [
                f"{_number(float(point[e, k] / point[target, k]), 2)} {interval(boot[:, e, k] / boot[:, target, k], 2)}"
                for k in range(len(sizes))
            ]
            lines.append(f"| {snapshot} | {name} | " + " | ".join(cells) + " |")
    return lines


def verdict(results: dict, plan: Plan) -> list[str]:
    """The answer to the question, in numbers, for OTB (proxy, include-self: the paper's estimator)."""
    sizes, names = list(plan.group_sizes), list(ESTIMATORS)
    target_n = min(TARGET[1], max(sizes))
    lines = []
    for snapshot, result in results.items():
        t = result["point"]["snr"][names.index(TARGET[0]), sizes.index(target_n)]
        otb = names.index("otb")
        curve = ", ".join(f"N={n}: {float(result['point']['snr'][otb, k]):.3g}" for k, n in enumerate(sizes))
        lines.append(
            f"* **{snapshot}**: GRPO SNR at N={target_n} = {float(t):.3g} "
            f"{interval(result['boot']['snr'][:, names.index(TARGET[0]), sizes.index(target_n)])}; "
            f"OTB reaches it at N = {n_star_text(result, otb, sizes)}. OTB SNR by N: {curve}."
        )
    return lines


def _snr_panel(axis, result: dict, x: list) -> None:
    """One snapshot: every estimator's SNR curve with its bootstrap interval (log axes; an estimate or interval
    end at or below 0 is drawn at the panel's floor, a tenth of its smallest positive estimate)."""
    from matplotlib.ticker import NullFormatter

    point = result["point"]["snr"]
    floor = float(point[point > 0].min()) / 10 if (point > 0).any() else 1e-4
    levels = torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)
    for e, name in enumerate(ESTIMATORS):
        low, high = torch.quantile(result["boot"]["snr"][:, e].nan_to_num(), levels, dim=0).clamp(min=floor).tolist()
        shown = point[e].clamp(min=floor).tolist()
        errors = [[max(s - lo, 0) for s, lo in zip(shown, low)], [max(h - s, 0) for s, h in zip(shown, high)]]
        style = "-" if name in ("otb", "grpo") else "--"
        axis.errorbar(x, shown, yerr=errors, fmt="o" + style, ms=3, lw=1.2, capsize=2, label=name)
    axis.axhline(float(point[list(ESTIMATORS).index(TARGET[0]), -1]), color="grey", ls=":", lw=0.8)
    axis.set(xscale="log", yscale="log", ylim=(floor / 1.5, None), ylabel="SNR = ||E g||² / tr Cov g")
    axis.xaxis.set_minor_formatter(NullFormatter())


def record(result: dict) -> dict:
    """One snapshot's compact record: every statistic's point estimate and bootstrap interval, [estimator, N] (the
    nearest draw, as the report's intervals: an inf draw of SNR∥ stays inf, not NaN)."""
    levels = torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)
    stats = {}
    for key, point in result["point"].items():
        low, high = torch.nanquantile(result["boot"][key].double(), levels, dim=0, interpolation="nearest")
        stats[key] = {"point": point, f"low_{LEVEL:.0%}": low, f"high_{LEVEL:.0%}": high}
    extra = {k: result[k] for k in ("tokens", "zero_variance", "reward", "params")}
    return {"statistics": stats, **extra}


def plot(results: dict, plan: Plan, out_dir: Path) -> list[str]:
    """SNR vs N and SNR vs generated tokens per batch, one panel per snapshot, bootstrap intervals as bars."""
    sizes, links = list(plan.group_sizes), []
    for kind, label in (("n", "group size N"), ("tokens", "generated tokens per batch (P x N x mean length)")):
        figure, axes = new_figure(len(results), width=5.0, height=4.2)
        for axis, (snapshot, result) in zip(axes, results.items()):
            _snr_panel(axis, result, sizes if kind == "n" else result["tokens"])
            axis.set(xlabel=label, title=f"{snapshot} (dotted: {TARGET[0]} at N={sizes[-1]})")
            if kind == "n":
                axis.set_xticks(sizes, [str(n) for n in sizes])
        axes[0].legend(fontsize="x-small", ncol=2)
        figure.tight_layout()
        name = f"gradient_variance_snr_{kind}.png"
        figure.savefig(out_dir / name, dpi=110)
        links.append(f"![SNR vs {label}]({name})")
    return links


def setup_text(results: dict, plan: Plan, setting) -> list[str]:
    """What was measured, on what, how many times."""
    first = next(iter(results.values()))
    rewards = ", ".join(f"{k} {v['reward']:.2f}" for k, v in results.items())
    return [
        f"Setting `{setting.name}`: task {plan.task}, answers of {setting.copy_lengths[0]}-{setting.copy_lengths[1]} "
        f"digits, max new tokens {setting.copy_lengths[1] + 8}, temperature 1; snapshots from "
        f"`experiments/snapshots.py` ({', '.join(plan.snapshots)}; mean sampled reward {rewards}). The init "
        "snapshot is left out: its reward is 0 on every response, so every estimator's gradient is 0.",
        "",
        f"Batches: P = {plan.prompts} fixed prompts x N responses, N in {list(plan.group_sizes)}; **R = "
        f"{plan.replicates}** independent batches per snapshot (sampled with {max(plan.group_sizes)} responses per "
        "prompt; the N-batch is the first N of them). Every batch is reused by every estimator. Gradient: of the "
        "on-policy token-mean surrogate `Σ a_t log π(y_t) / #tokens in the batch`, flattened over all "
        f"{first['params']} parameters (float32, per-token Jacobians). Estimators: "
        + ", ".join(f"`{k}` ({v[0] or 'no baseline'}{', ' + str(v[1]) if v[1] else ''})" for k, v in ESTIMATORS.items())
        + ". All include the response itself in its baseline except rloo and otb_loo; grpo divides by the group's "
        "reward std.",
        "",
        "Statistics (per estimator and N, from the R gradients): `||E g||²` by the U-statistic over pairs of "
        "different batches (equal to `||ḡ||² − tr Ĉov/R`), `tr Cov g` = mean `||g||²` minus it, **SNR** = "
        f"their ratio. Reference `g_ref` = E g of **{REFERENCE[0]} at N = {REFERENCE[1]}** (leave-one-out: unbiased "
        "for the REINFORCE gradient up to the random token-count denominator; the largest N), estimated by the "
        "same pair statistics, so `<E g, g_ref>` and `||E g − g_ref||²` are unbiased too. **cos** = "
        "`<E g, g_ref> / (||E g|| ||g_ref||)`, **scale** = `<E g, g_ref> / ||g_ref||²` (the step size relative "
        "to the reference along it), **rel. bias** = `||E g − g_ref|| / ||g_ref||` (meaningful when scale is "
        "about 1: std scaling and include-self baselines change the scale, and a scale change alone is a bias). "
        f"Intervals: {LEVEL:.0%} percentile bootstrap over the R batches ({plan.bootstrap} resamples, pairs of a "
        "batch with its own copy excluded). Tokens per batch: "
        + "; ".join(
            f"{k}: " + ", ".join(f"N={n}: {t:.0f}" for n, t in zip(plan.group_sizes, v["tokens"]))
            for k, v in results.items()
        )
        + ". Groups with all-equal rewards (no signal for group-mean baselines): "
        + "; ".join(
            f"{k}: " + ", ".join(f"N={n}: {z:.0%}" for n, z in zip(plan.group_sizes, v["zero_variance"]))
            for k, v in results.items()
        )
        + ".",
    ]


def reading_notes() -> list[str]:
    """Facts about the task and the estimators that the numbers above rest on (true whatever the numbers are)."""
    return [
        "## How to read these numbers",
        "",
        "* copy_exact rewards a response only if it is exactly the answer followed by EOS, so every reward-1 "
        "response to a prompt is one and the same sequence with one and the same score `S`. REINFORCE's batch "
        "gradient is `Σ_prompts (number of successes) × S_success / #tokens`: its only noise is the success count, "
        "and failures (reward 0) contribute nothing to it. A task whose correct responses differ (math) does not "
        "have this property.",
        "* A baseline `b` adds `−b S_i` for every response, failures included. When the policy copies well, a "
        "success is made of confident tokens whose logit gradients are small (F6: `||e_y − π||² = 1 − 2π_y + "
        "Σπ²`, near 0 for a confident token, near 2 for an unlikely one), and a failure contains a token other "
        "than the answer's, usually an unlikely one. Group-mean baselines (grpo, rloo, opo) weight every response "
        "alike and so add the failures' score noise; the variance-optimal constant baseline of F3, "
        "`b* = E[||S||² R] / E[||S||²]`, weights each response by its energy, and is close to 0 when the "
        "high-energy responses are the failures.",
        "* Energy-weighted include-self baselines (otb, otb_exact, eob) contain the response's own term: "
        "`B_t = (W_t^i R_i + Σ_j≠i W_t^j R_j) / Σ_j W_t^j` tends to the response's own reward as its energy "
        "dominates the group's, so a high-energy response gets an advantage near 0. This is a bias as well as a "
        "variance reduction (F7), which the cos, scale and bias tables measure. otb_loo has no self term.",
        "* SNR is scale-free: an estimator that shrinks the gradient (include-self, small N) or inflates it (std "
        "scaling) keeps its SNR; cos and scale say how its mean differs from the reference.",
        "",
    ]


def snapshot_sections(results: dict, plan: Plan) -> list[str]:
    sections = []
    for snapshot, result in results.items():
        sections += [f"## Snapshot {snapshot} (mean reward {result['reward']:.2f})", "", "SNR:", ""]
        sections += matrix_table(result, "snr", plan.group_sizes) + ["", "cos(E g, g_ref):", ""]
        sections += matrix_table(result, "cosine", plan.group_sizes) + ["", "scale <E g, g_ref>/||g_ref||²:", ""]
        sections += matrix_table(result, "scale", plan.group_sizes) + ["", "rel. bias ||E g − g_ref||/||g_ref||:", ""]
        sections += matrix_table(result, "bias", plan.group_sizes) + ["", "directional SNR∥ = ρ²/(1 − ρ²):", ""]
        sections += matrix_table(result, "snr_par", plan.group_sizes) + ["", "MSE E‖g − g_ref‖² / ‖g_ref‖²:", ""]
        sections += matrix_table(result, "mse_rel", plan.group_sizes)
        ref_noise = float(result["point"]["ref_noise"])
        sections += ["", f"Noise of g_ref's estimate: tr Cov(g_ref) / R / ‖g_ref‖² = {_number(ref_noise)}.", ""]
    return sections


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny snapshots, R = 3, N in {2, 4} (seconds)")
    parser.add_argument("--replicates", type=int, default=None, help="R, independent batches per snapshot")
    parser.add_argument("--prompts", type=int, default=None, help="P, prompts per batch")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    snapshots.add_snapshots_dir(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Measure every snapshot, write ``<out-dir>/gradient_variance.md`` and its figures; returns the results."""
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    plan = Plan(
        **{**plan.__dict__, "replicates": args.replicates or plan.replicates, "prompts": args.prompts or plan.prompts}
    )
    threads, started = torch.get_num_threads(), time.perf_counter()
    torch.set_num_threads(1)
    try:
        paths = snapshots.snapshots(plan.setting, args.snapshots_dir)
        setting = snapshots.SETTINGS[plan.setting]
        max_new_tokens = setting.copy_lengths[1] + 8  # snapshots.Setting.task_flags
        results = {}
        for name in plan.snapshots:
            results[name] = measure_snapshot(paths[name], plan, max_new_tokens, setting.copy_lengths)
    finally:
        torch.set_num_threads(threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sections = [
        *setup_text(results, plan, setting),
        "",
        "## Answer: where does OTB reach GRPO's SNR at N = 32?",
        "",
        *verdict(results, plan),
        "",
        *headline(results, plan),
        "",
        "The same on the directional SNR∥ = ρ²/(1 − ρ²), ρ² = ⟨E g, ∇J⟩² / (‖∇J‖² E‖g‖²) with ∇J = g_ref: equal to "
        "SNR when E g is a positive multiple of ∇J, lower by the direction error (issue 38):",
        "",
        *headline(results, plan, "n_star_par"),
        "",
        f"SNR relative to {TARGET[0]}'s at the same N (the same batches), point [{LEVEL:.0%} bootstrap interval]:",
        "",
        *ratio_table(results, plan),
        "",
        *plot(results, plan, args.out_dir),
        "",
        *reading_notes(),
        *snapshot_sections(results, plan),
    ]
    write_records("gradient_variance", {"estimators": list(ESTIMATORS), "group_sizes": list(plan.group_sizes),
                                        "snapshots": {name: record(result) for name, result in results.items()}},
                  args.out_dir)  # fmt: skip
    write_report(
        "gradient_variance",
        "Gradient variance: SNR and bias of the mini-batch policy gradient in parameter space",
        sections,
        time.perf_counter() - started,
        args.out_dir,
    )
    return results


if __name__ == "__main__":
    main()
