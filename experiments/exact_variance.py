"""Every estimator's exact variance relative to ``B**`` and its exact bias, by enumeration (no sampling), across
horizons, vocabulary sizes, policy kinds, reward kinds and group sizes.

    python experiments/exact_variance.py            # results/exact_variance.md + PNGs, about 5 minutes on 2 cores
    python experiments/exact_variance.py --quick    # seconds: tiny sizes, one seed (the test suite)
    python experiments/exact_variance.py --quick --out-dir /tmp/exact_variance

Only ``otb_ref.exact`` is used: it lists every response of a tiny policy with its probability and per-token
scores, so every number is an exact expectation (float64), not an estimate.

Axes. Policies: ``tree`` (tabular, every prefix owns its logits; the logit-gradient proxy is exact there, F6)
and ``shared`` (``logits_t = U tanh(E[y_{t-1}] + P_t) + b``, width 3), with random parameters of the seed.
Lengths: ``eos`` (token 0 ends a response, so responses have 1..L tokens) or ``fixed`` (no EOS, all L
tokens). Vocabulary ``V`` (EOS included) and horizon ``L``. Rewards: ``outcome`` (R = 1 when the response
holds an odd number of token 1, at its last token) or ``dense`` (r_t = 1 at every token 1).

Population level (THEORY §3): each estimator's baseline is its population constant; reported are
``Var / Var(B**)`` (B** of F4: the variance-optimal vector of per-position constants) and the relative bias
``||E ĝ − ∇J|| / ||∇J||``. Finite groups (F7): ``N`` i.i.d. responses, advantages from
``otb_ref.compute_advantages`` over every multiset of ``N`` responses (``otb_ref.exact.group_moments``),
include-self and leave-one-out; reported are ``N · Var(ĝ) / Var(B**)`` (1 = the average of N independent
``B**`` estimates) and the relative bias.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from common import new_figure, write_records, write_report
from otb_ref import ESTIMATORS
from otb_ref.exact import (
    POPULATION_ESTIMATORS,
    SharedPolicy,
    TreePolicy,
    enumerate_policy,
    estimator_moments,
    group_moments,
    outcome_rewards,
    population_advantages,
    population_granularity,
)

ROOT = Path(__file__).resolve().parents[1]

# Population estimators and group estimators: the library's own tables (otb_ref.exact.POPULATION_ESTIMATORS,
# otb_ref.ESTIMATORS), in their order; two references are computed from the population moments.
POPULATION = list(POPULATION_ESTIMATORS)
SEQUENCE_LEVEL = [n for n in POPULATION if population_granularity(n) == "sequence"]
TOKEN_LEVEL = [n for n in POPULATION if population_granularity(n) == "token" and n != "optimal"]
GROUP = list(ESTIMATORS)
REFERENCES = ["none", "optimal"]
ENERGY_WEIGHTED = ["opo", "sequence_proxy", "eob", "otb", "otb_exact"]
# Group estimators' labels; a population column "grpo" is the cell's baseline E[R] alone (no std scaling).
LABELS = {
    "none": "no baseline",
    "optimal": "B**",
    "grpo": "grpo (std-scaled mean)",
    "rloo": "rloo (plain mean)",
}
POPULATION_LABELS = {**LABELS, "grpo": "grpo/rloo mean"}
COLORS = {
    "none": "0.55",
    "grpo": "C0",
    "rloo": "C1",
    "opo": "C2",
    "sequence_proxy": "C9",
    "eob": "C4",
    "token_mean": "C5",
    "token_length": "C6",
    "otb": "C3",
    "otb_exact": "C8",
    "optimal": "black",
}
POPULATION_COLORS = {**COLORS, "grpo": COLORS["rloo"]}  # the population mean: rloo's colour in group plots
POLICIES = ["tree", "shared"]
REWARDS = ["outcome", "dense"]
PANELS = [(policy, reward) for policy in POLICIES for reward in REWARDS]
ABOVE = 1e-9  # relative margin of "a is above b" in counts (a > b (1 + ABOVE)): equal values count as not above


@dataclass(frozen=True)
class Grid:
    """What to enumerate: population sweeps ``(lengths, V, horizons)``, group cells ``(lengths, V, L)``."""

    population: tuple[tuple[str, int, tuple[int, ...]], ...]
    groups: tuple[tuple[str, int, int], ...]
    seeds: tuple[int, ...]
    sizes: tuple[int, ...] = (2, 4, 8)
    group_seed: int = 0


FULL = Grid(
    population=(
        ("eos", 2, (2, 4, 8, 16, 32)),
        ("eos", 3, (2, 3, 4, 6, 8, 10)),
        ("eos", 4, (2, 3, 4, 5, 6)),
        ("eos", 5, (2, 3, 4, 5)),
        ("fixed", 2, (2, 3, 4, 6, 8, 10)),
        ("fixed", 3, (2, 3, 4, 5, 6)),
    ),
    groups=(("eos", 3, 3), ("eos", 2, 4), ("eos", 3, 2), ("eos", 4, 2), ("fixed", 2, 3)),
    seeds=(0, 1, 2),
)
QUICK = Grid(
    population=(("eos", 3, (2, 3)), ("fixed", 2, (2, 3))),
    groups=(("eos", 2, 3), ("fixed", 2, 2)),
    seeds=(0,),
)


class Outcome(NamedTuple):
    report: Path
    population: list[dict]
    groups: list[dict]


# --------------------------------------------------------------------------- exact moments


def make_policy(kind: str, lengths: str, vocab: int, horizon: int, seed: int) -> TreePolicy | SharedPolicy:
    eos = lengths == "eos"
    if kind == "tree":
        return TreePolicy(vocab, horizon, eos=eos, seed=seed)
    return SharedPolicy(vocab, horizon, eos=eos, width=3, seed=seed)


def make_rewards(enum, kind: str) -> torch.Tensor:
    """``[M, L]`` token rewards: ``outcome`` (parity of the count of token 1, at the last token) or ``dense``."""
    ones = (enum.tokens == 1).double() * enum.mask
    if kind == "outcome":
        return outcome_rewards(enum, ones.sum(-1) % 2)
    return ones


def population_moments(enum, rewards: torch.Tensor, names: list[str]) -> tuple[dict, dict, float, float]:
    """``({name: Var}, {name: ||E ĝ − ∇J||}, Var(B**), ||∇J||)`` of population estimators."""
    moments = {n: estimator_moments(enum, population_advantages(enum, rewards, n), rewards) for n in names}
    best = estimator_moments(enum, population_advantages(enum, rewards, "optimal"), rewards)
    gradient = estimator_moments(enum, population_advantages(enum, rewards, "none"), rewards).mean  # ∇J = E ĝ_0
    variance = {n: m.variance for n, m in moments.items()}
    return variance, {n: m.bias_norm for n, m in moments.items()}, best.variance, float(gradient.norm())


def population_records(lengths: str, vocab: int, horizons: tuple[int, ...], seed: int) -> list[dict]:
    """One record per (L, policy, reward) at this seed: ``var`` (Var/Var(B**)) and ``bias`` (relative)."""
    records = []
    for horizon in horizons:
        for policy in POLICIES:
            enum = enumerate_policy(make_policy(policy, lengths, vocab, horizon, seed), keep_scores=False)
            for reward in REWARDS:
                variance, bias, best, gradient = population_moments(enum, make_rewards(enum, reward), POPULATION)
                cell = {"lengths": lengths, "V": vocab, "L": horizon, "policy": policy, "reward": reward}
                records.append(
                    {
                        **cell,
                        "seed": seed,
                        "responses": enum.tokens.shape[0],
                        "var": {n: v / best for n, v in variance.items()},
                        "bias": {n: b / gradient for n, b in bias.items()},
                    }
                )
    return records


def group_records(lengths: str, vocab: int, horizon: int, seed: int, sizes: tuple[int, ...]) -> list[dict]:
    """One record per (policy, reward, N, estimator): ``var_self``, ``var_loo`` (N·Var/Var(B**)), ``bias_self``,
    ``bias_loo`` (relative). The references (no baseline, B**) are averages of N independent population
    estimates: N·Var is their population variance, whichever way the group is used."""
    records = []
    for policy in POLICIES:
        enum = enumerate_policy(make_policy(policy, lengths, vocab, horizon, seed), keep_scores=True)
        for reward in REWARDS:
            rewards = make_rewards(enum, reward)
            variance, bias, best, gradient = population_moments(enum, rewards, REFERENCES)
            cell = {"lengths": lengths, "V": vocab, "L": horizon, "policy": policy, "reward": reward}
            cell["responses"] = enum.tokens.shape[0]
            for size in sizes:
                for name in REFERENCES:
                    var, rel = variance[name] / best, bias[name] / gradient
                    records.append({**cell, "N": size, "estimator": name, **_pair(var, rel, var, rel)})
                for name in GROUP:
                    own, loo = (group_moments(enum, rewards, name, size, leave_one_out=flag) for flag in (False, True))
                    values = _pair(
                        size * own.variance / best,
                        own.bias_norm / gradient,
                        size * loo.variance / best,
                        loo.bias_norm / gradient,
                    )
                    records.append({**cell, "N": size, "estimator": name, **values})
    return records


def _pair(var_self: float, bias_self: float, var_loo: float, bias_loo: float) -> dict[str, float]:
    return {"var_self": var_self, "bias_self": bias_self, "var_loo": var_loo, "bias_loo": bias_loo}


def measure(grid: Grid) -> tuple[list[dict], list[dict]]:
    """All population records (every seed) and all group records (seed ``grid.group_seed``)."""
    population = [
        record
        for lengths, vocab, horizons in grid.population
        for seed in grid.seeds
        for record in population_records(lengths, vocab, horizons, seed)
    ]
    groups = [
        record
        for lengths, vocab, horizon in grid.groups
        for record in group_records(lengths, vocab, horizon, grid.group_seed, grid.sizes)
    ]
    return population, groups


# --------------------------------------------------------------------------- tables


def label(name: str) -> str:
    """A group estimator's label."""
    return LABELS.get(name, name)


def population_label(name: str) -> str:
    """A population column's label."""
    return POPULATION_LABELS.get(name, name)


def _cell(value: float) -> str:
    return f"{value:.4f}"


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def _above(a: float, b: float) -> bool:
    return a > b * (1 + ABOVE)


def _panel(records: list[dict], lengths: str, policy: str, reward: str) -> list[dict]:
    return [r for r in records if (r["lengths"], r["policy"], r["reward"]) == (lengths, policy, reward)]


def _case(r: dict) -> str:
    seed = f", seed {r['seed']}" if "seed" in r else ""
    return f"{r['lengths']} lengths, {r['policy']}, {r['reward']}, V={r['V']}, L={r['L']}{seed}"


def medians(chosen: list[dict], vocab: int) -> list[tuple[int, int, dict[str, float]]]:
    """``[(L, responses, {estimator: median over seeds of Var/Var(B**)})]`` of one panel's records at ``V``."""
    at_vocab = [r for r in chosen if r["V"] == vocab]
    out = []
    for horizon in sorted({r["L"] for r in at_vocab}):
        at = [r for r in at_vocab if r["L"] == horizon]
        out.append((horizon, at[0]["responses"], {n: statistics.median(r["var"][n] for r in at) for n in POPULATION}))
    return out


def population_tables(population: list[dict]) -> list[str]:
    """One table per (lengths, policy, reward): rows (V, L), median Var/Var(B**) over seeds."""
    lines = []
    for lengths in dict.fromkeys(r["lengths"] for r in population):
        for policy, reward in PANELS:
            chosen = _panel(population, lengths, policy, reward)
            rows = [
                [str(vocab), str(horizon), str(responses)] + [_cell(var[n]) for n in POPULATION]
                for vocab in dict.fromkeys(r["V"] for r in chosen)
                for horizon, responses, var in medians(chosen, vocab)
            ]
            lines += [f"#### {lengths} lengths, {policy} policy, {reward} reward", ""]
            lines += _markdown(["V", "L", "responses"] + [population_label(n) for n in POPULATION], rows)
    return lines


def population_summary(population: list[dict]) -> list[str]:
    """Per (lengths, policy, reward), over every case (seeds × (V, L)): OTB against B**, EOB and no baseline."""
    header = ["lengths", "policy", "reward", "cases", "otb median", "otb max", "otb ≤ 1.05", "otb > eob"]
    header += ["otb_exact > eob", "otb > no baseline", "otb_exact > no baseline", "max abs(otb − otb_exact)"]
    header += [f"{population_label(n)} median" for n in ("eob", "token_mean", "grpo", "none")]
    rows = []
    for lengths in dict.fromkeys(r["lengths"] for r in population):
        for policy, reward in PANELS:
            at = _panel(population, lengths, policy, reward)
            otb = [r["var"]["otb"] for r in at]
            gap = max(abs(r["var"]["otb"] - r["var"]["otb_exact"]) for r in at)
            rows.append(
                [lengths, policy, reward, str(len(at)), _cell(statistics.median(otb)), _cell(max(otb))]
                + [f"{sum(v <= 1.05 for v in otb)}/{len(at)}", _count(at, "otb", "eob"), _count(at, "otb_exact", "eob")]
                + [_count(at, "otb", "none"), _count(at, "otb_exact", "none"), f"{gap:.1e}"]
                + [_cell(statistics.median(r["var"][n] for r in at)) for n in ("eob", "token_mean", "grpo", "none")]
            )
    return _markdown(header, rows)


def _count(records: list[dict], a: str, b: str) -> str:
    """``"k/n"``: the cases where estimator ``a``'s variance is above ``b``'s."""
    return f"{sum(_above(r['var'][a], r['var'][b]) for r in records)}/{len(records)}"


def population_bias_table(population: list[dict]) -> list[str]:
    """One row: each estimator's largest relative bias over every population case."""
    row = ["max over all cases"] + [f"{max(r['bias'][n] for r in population):.1e}" for n in POPULATION]
    return _markdown(["relative bias"] + [population_label(n) for n in POPULATION], [row])


def per_seed_table(population: list[dict]) -> list[str]:
    header = ["lengths", "V", "L", "policy", "reward", "seed"] + [population_label(n) for n in POPULATION]
    rows = [
        [r["lengths"], str(r["V"]), str(r["L"]), r["policy"], r["reward"], str(r["seed"])]
        + [_cell(r["var"][n]) for n in POPULATION]
        for r in population
    ]
    return (
        ["<details><summary>Every population case (each seed): Var / Var(B**)</summary>", ""]
        + _markdown(header, rows)
        + ["</details>", ""]
    )


def group_table(groups: list[dict], cell: tuple[str, int, int], policy: str, reward: str) -> list[str]:
    """Rows: estimators; columns: N·Var/Var(B**) and relative bias, include-self and leave-one-out, per N."""
    chosen = [r for r in groups if (r["lengths"], r["V"], r["L"], r["policy"], r["reward"]) == (*cell, policy, reward)]
    sizes = sorted({r["N"] for r in chosen})
    keys = [("var_self", "N·Var self"), ("var_loo", "N·Var LOO"), ("bias_self", "bias self"), ("bias_loo", "bias LOO")]
    header = ["estimator"] + [f"{text} N={n}" for _, text in keys for n in sizes]
    rows = []
    for name in GROUP + REFERENCES:
        by_size = {r["N"]: r for r in chosen if r["estimator"] == name}
        rows.append([label(name)] + [_cell(by_size[n][key]) for key, _ in keys for n in sizes])
    lengths, vocab, horizon = cell
    title = f"#### {lengths} lengths, V={vocab}, L={horizon} ({chosen[0]['responses']} responses), {policy}, {reward}"
    return [title, ""] + _markdown(header, rows)


def group_summary(groups: list[dict]) -> list[str]:
    """Per estimator and N, over every group cell: median N·Var (both modes) and the include-self bias range."""
    sizes = sorted({r["N"] for r in groups})
    header = ["estimator"] + [f"N·Var LOO median N={n}" for n in sizes] + [f"N·Var self median N={n}" for n in sizes]
    header += [f"bias self N={n}" for n in sizes] + ["bias LOO max"]
    rows = []
    for name in GROUP + REFERENCES:
        at = {n: [r for r in groups if r["estimator"] == name and r["N"] == n] for n in sizes}
        row = [label(name)] + [_cell(statistics.median(r["var_loo"] for r in at[n])) for n in sizes]
        row += [_cell(statistics.median(r["var_self"] for r in at[n])) for n in sizes]
        row += [_span([r["bias_self"] for r in at[n]]) for n in sizes]
        rows.append(row + [_cell(max(r["bias_loo"] for n in sizes for r in at[n]))])
    return _markdown(header, rows)


def _span(values: list[float]) -> str:
    low, high = _cell(min(values)), _cell(max(values))
    return low if low == high else f"{low} to {high}"


# --------------------------------------------------------------------------- findings (read off the records)


def otb_findings(population: list[dict]) -> list[str]:
    """OTB against B**, its exact-energy version, EOB and no baseline, over every population case."""
    n = len(population)
    worst = max(population, key=lambda r: r["var"]["otb"])
    by_policy = {p: statistics.median(r["var"]["otb"] for r in population if r["policy"] == p) for p in POLICIES}
    items = [
        f"`otb` within 5% of B** (Var/Var(B**) ≤ 1.05) in {sum(r['var']['otb'] <= 1.05 for r in population)}/{n} "
        f"population cases; median {_cell(by_policy['tree'])} on tree policies, {_cell(by_policy['shared'])} on "
        f"shared ones; largest {_cell(worst['var']['otb'])} ({_case(worst)})."
    ]
    tree = [abs(r["var"]["otb"] - r["var"]["otb_exact"]) for r in population if r["policy"] == "tree"]
    shift = [r["var"]["otb"] - r["var"]["otb_exact"] for r in population if r["policy"] == "shared"]
    items.append(
        f"`otb` − `otb_exact` (proxy instead of exact energies, in units of Var(B**)): at most {max(tree):.1e} in "
        f"absolute value on tree policies; from {min(shift):+.4f} to {max(shift):+.4f} on shared ones."
    )
    for name in ("otb", "otb_exact"):
        parts = []
        for lengths in dict.fromkeys(r["lengths"] for r in population):
            for policy, reward in PANELS:
                at = _panel(population, lengths, policy, reward)
                above = sum(_above(r["var"][name], r["var"]["eob"]) for r in at)
                parts.append(f"{lengths}/{policy}/{reward} {above}/{len(at)}")
        total = sum(_above(r["var"][name], r["var"]["eob"]) for r in population)
        items.append(f"`{name}` above `eob` in {total}/{n} cases: " + ", ".join(parts) + ".")
        worse = [r for r in population if _above(r["var"][name], r["var"]["none"])]
        cases = "; ".join(f"{_case(r)}: {_cell(r['var'][name])} vs {_cell(r['var']['none'])}" for r in worse)
        items.append(f"`{name}` above no baseline in {len(worse)}/{n} cases" + (f" ({cases})." if worse else "."))
    return items


def reward_findings(population: list[dict]) -> list[str]:
    """Outcome vs dense rewards: medians of each granularity, estimators above no baseline, the minima."""
    items = []
    for reward in REWARDS:
        at = [r for r in population if r["reward"] == reward]
        cells = ", ".join(
            f"`{population_label(n)}` {_cell(statistics.median(r['var'][n] for r in at))}" for n in POPULATION[:-1]
        )
        items.append(f"{reward} reward, median Var/Var(B**) over {len(at)} cases: {cells}.")
        worse = {n: sum(_above(r["var"][n], r["var"]["none"]) for r in at) for n in POPULATION[1:-1]}
        listed = ", ".join(f"`{population_label(n)}` {k}" for n, k in worse.items() if k)
        items.append(f"{reward} reward, cases above no baseline (of {len(at)}): {listed or 'none'}.")
    dense = [r for r in population if r["reward"] == "dense"]
    lowest = min(r["var"][n] for r in dense for n in SEQUENCE_LEVEL)
    items.append(
        f"smallest sequence-level Var/Var(B**) under dense rewards (their effective baseline b − Σ_(k<t) r_k reads "
        f"the prefix, outside the class B** is optimal over): {_cell(lowest)}."
    )
    gap = max(abs(r["var"]["token_length"] - r["var"]["token_mean"]) for r in population)
    items.append(f"`token_length` − `token_mean` at population level: at most {gap:.1e} in absolute value.")
    return items


def group_findings(groups: list[dict]) -> list[str]:
    """Biases (F7) and leave-one-out variances of the group estimators."""
    loo = [r for r in groups if r["estimator"] in GROUP]
    unbiased = max(r["bias_loo"] for r in loo if r["estimator"] != "grpo")
    grpo = [r["bias_loo"] for r in loo if r["estimator"] == "grpo"]
    mean = [r for r in loo if r["estimator"] == "rloo"]
    items = [
        f"leave-one-out relative bias: at most {unbiased:.1e} for every estimator but `grpo (std-scaled mean)`, "
        f"whose leave-one-out bias is {_span(grpo)}.",
        f"include-self plain mean (`rloo`): bias − 1/N at most "
        f"{max(abs(r['bias_self'] - 1 / r['N']) for r in mean):.1e}; N·Var self / N·Var LOO − ((N−1)/N)² at most "
        f"{max(abs(r['var_self'] / r['var_loo'] - (1 - 1 / r['N']) ** 2) for r in mean):.1e} in absolute value.",
    ]
    lowest = min((r for r in loo if r["estimator"] != "grpo"), key=lambda r: r["var_self"])
    items.append(
        f"smallest include-self N·Var/Var(B**): {_cell(lowest['var_self'])} (`{lowest['estimator']}`, N={lowest['N']}"
        f", {_case(lowest)}), with relative bias {_cell(lowest['bias_self'])}."
    )
    floor = min((r for r in loo if r["estimator"] != "grpo"), key=lambda r: r["var_loo"])
    items.append(
        f"smallest leave-one-out N·Var/Var(B**): {_cell(floor['var_loo'])} (`{floor['estimator']}`, N={floor['N']}, "
        f"{_case(floor)})."
    )
    for size in sorted({r["N"] for r in groups}):
        at = {
            (r["lengths"], r["V"], r["L"], r["policy"], r["reward"], r["estimator"]): r
            for r in groups
            if r["N"] == size
        }
        cells = sorted({key[:5] for key in at})
        beats = {
            n: sum(at[(*c, "otb")]["var_loo"] < at[(*c, n)]["var_loo"] for c in cells) for n in ("rloo", "eob", "none")
        }
        listed = ", ".join(f"`{label(n)}` in {k}/{len(cells)}" for n, k in beats.items())
        items.append(f"N = {size}, leave-one-out: `otb`'s N·Var below that of {listed} cells.")
    return items


def headline(population: list[dict], groups: list[dict]) -> str:
    """The 'what this shows' paragraph: a few of the findings' numbers, in prose, population then groups."""
    n = len(population)
    worst = max(population, key=lambda r: r["var"]["otb"])
    above = {p: [_above(r["var"]["otb"], r["var"]["eob"]) for r in population if r["policy"] == p] for p in POLICIES}
    e2 = _panel(population, "fixed", "tree", "outcome")
    dense = {k: statistics.median(r["var"][k] for r in population if r["reward"] == "dense") for k in POPULATION}
    text = (
        f"With population baselines, OTB's variance is within 5% of the optimum B** in "
        f"{sum(r['var']['otb'] <= 1.05 for r in population)} of {n} cases, but reaches "
        f"{_cell(worst['var']['otb'])}× B** ({_case(worst)}). It is above EOB's in {sum(above['tree'])}/"
        f"{len(above['tree'])} tree-policy cases and {sum(above['shared'])}/{len(above['shared'])} shared-parameter "
        f"cases ({sum(_above(r['var']['otb'], r['var']['eob']) for r in e2)}/{len(e2)} with a tree policy, fixed "
        f"lengths and outcome reward, the setting of E2), and above no baseline in "
        f"{sum(_above(r['var']['otb'], r['var']['none']) for r in population)}/{n} cases. Under dense rewards the "
        f"median ratios are {_cell(dense['otb'])} (otb), {_cell(dense['otb_exact'])} (otb_exact), "
        f"{_cell(dense['token_mean'])} (token_mean), {_cell(dense['eob'])} (eob), {_cell(dense['grpo'])} (grpo/rloo "
        f"mean) and {_cell(dense['none'])} (no baseline). "
    )
    return text + group_headline(groups)


def group_headline(groups: list[dict]) -> str:
    estimators = [r for r in groups if r["estimator"] in GROUP]
    unbiased = [r for r in estimators if r["estimator"] != "grpo"]
    largest = max(r["N"] for r in groups)

    def median_loo(name: str) -> str:
        return _cell(statistics.median(r["var_loo"] for r in groups if r["estimator"] == name and r["N"] == largest))

    lower = sum(r["var_self"] < r["var_loo"] for r in estimators)
    biggest = max(unbiased, key=lambda r: r["bias_self"])
    return (
        f"In groups, the leave-one-out relative bias is at most {max(r['bias_loo'] for r in unbiased):.1e} for every "
        f"estimator but std-scaled GRPO (whose leave-one-out bias reaches "
        f"{_cell(max(r['bias_loo'] for r in estimators if r['estimator'] == 'grpo'))}); at N = {largest} the median "
        f"leave-one-out N·Var/Var(B**) is {median_loo('otb')} for otb, {median_loo('rloo')} for the plain mean "
        f"(rloo) and {median_loo('eob')} for eob. Include-self N·Var is below leave-one-out's in {lower}/"
        f"{len(estimators)} (estimator, cell, N) cases, and its relative bias reaches {_cell(biggest['bias_self'])} "
        f"(`{biggest['estimator']}`, N={biggest['N']}, {_case(biggest)})."
    )


# --------------------------------------------------------------------------- plots


def _log_axes(axis, xs: list[int], ylabel: str, xlabel: str, title: str, log_y: bool = True) -> None:
    """Log2 x axis ticked at ``xs``; log y axis with plain-number ticks."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter, NullLocator

    axis.set_xscale("log", base=2)
    axis.set_xticks(xs, [str(x) for x in xs])
    axis.xaxis.set_minor_locator(NullLocator())
    if log_y:
        axis.set_yscale("log")
        low, high = axis.get_ylim()
        subs = (1.0, 2.0, 5.0) if high / low > 20 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if high / low > 3 else None
        axis.yaxis.set_major_locator(LogLocator(subs=subs or (1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 7.0)))
        axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axis.yaxis.set_minor_formatter(NullFormatter())
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)


def plot_horizons(population: list[dict], out_dir: Path) -> list[str]:
    """One PNG per (lengths, V): median Var/Var(B**) vs L per estimator, a panel per (policy, reward)."""
    links = []
    for lengths, vocab in dict.fromkeys((r["lengths"], r["V"]) for r in population):
        figure, axes = new_figure(4, width=4.4, height=3.8)
        for axis, (policy, reward) in zip(axes, PANELS):
            rows = medians(_panel(population, lengths, policy, reward), vocab)
            horizons = [row[0] for row in rows]
            for name in POPULATION:
                style = {"ls": "--"} if name == "optimal" else {"marker": "o", "ms": 3}
                width = 2.0 if name == "otb" else 1.0
                values = [row[2][name] for row in rows]
                color = POPULATION_COLORS[name]
                axis.plot(horizons, values, color=color, lw=width, label=population_label(name), **style)
            _log_axes(axis, horizons, "Var / Var(B**)", "horizon L", f"{policy} policy, {reward} reward")
        axes[-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
        figure.suptitle(f"{lengths} lengths, V = {vocab}: median over seeds (token_length lies under token_mean)")
        figure.tight_layout()
        name = f"exact_variance_horizon_{lengths}_v{vocab}.png"
        figure.savefig(out_dir / name, dpi=100)
        links.append(f"![Var/Var(B**) vs horizon, {lengths} lengths, V={vocab}]({name})")
    return links


def plot_groups(groups: list[dict], cell: tuple[str, int, int], out_dir: Path) -> list[str]:
    """N·Var/Var(B**) and relative bias vs N for one group cell: solid leave-one-out, dashed include-self."""
    links = []
    for key, ylabel in (("var", "N·Var / Var(B**)"), ("bias", "relative bias ||E ĝ − ∇J|| / ||∇J||")):
        figure, axes = new_figure(4, width=4.4, height=3.8)
        for axis, (policy, reward) in zip(axes, PANELS):
            chosen = [
                r for r in groups if (r["lengths"], r["V"], r["L"], r["policy"], r["reward"]) == (*cell, policy, reward)
            ]
            for name in GROUP + REFERENCES:
                at = sorted((r for r in chosen if r["estimator"] == name), key=lambda r: r["N"])
                sizes = [r["N"] for r in at]
                width = 2.0 if name == "otb" else 1.0
                axis.plot(
                    sizes,
                    [r[f"{key}_loo"] for r in at],
                    color=COLORS[name],
                    marker="o",
                    ms=3,
                    lw=width,
                    label=label(name),
                )
                if name not in REFERENCES:
                    axis.plot(
                        sizes, [r[f"{key}_self"] for r in at], color=COLORS[name], marker="x", ms=3, lw=width, ls="--"
                    )
            _log_axes(axis, sizes, ylabel, "group size N", f"{policy} policy, {reward} reward", log_y=key == "var")
        axes[-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
        lengths, vocab, horizon = cell
        note = " (leave-one-out: 0 for all but grpo)" if key == "bias" else ""
        figure.suptitle(
            f"{lengths} lengths, V = {vocab}, L = {horizon}: solid leave-one-out, dashed include-self{note}"
        )
        figure.tight_layout()
        name = f"exact_variance_groups_{key}.png"
        figure.savefig(out_dir / name, dpi=100)
        links.append(
            f"![{key} vs N, include-self and leave-one-out, {lengths} lengths, V={vocab}, L={horizon}]({name})"
        )
    return links


# --------------------------------------------------------------------------- report


def _bullets(items: list[str]) -> list[str]:
    return [f"- {item}" for item in items] + [""]


def setting_text(grid: Grid) -> list[str]:
    population = "; ".join(
        f"{lengths} lengths, V={v}: L ∈ {{{', '.join(map(str, hs))}}}" for lengths, v, hs in grid.population
    )
    cells = "; ".join(f"{lengths} lengths, V={v}, L={h}" for lengths, v, h in grid.groups)
    return [
        "Exact enumeration with `otb_ref.exact` (float64, no sampling). Policies: `tree` (tabular: every prefix "
        "owns its logits) and `shared` (`logits_t = U tanh(E[y_(t−1)] + P_t) + b`, width 3), random parameters. "
        "Lengths: `eos` (token 0 ends a response: 1..L tokens) or `fixed` (no EOS: L tokens). V counts EOS. "
        "Rewards: `outcome` (R = 1 when the response holds an odd number of token 1) or `dense` (r_t = 1 at every "
        "token 1).",
        "",
        f"Population cases: {population}; seeds {', '.join(map(str, grid.seeds))} (tables: median over seeds; "
        f"counts: every seed). Group cells (seed {grid.group_seed}, N ∈ {{{', '.join(map(str, grid.sizes))}}}): "
        f"{cells}.",
        "",
        "Var / Var(B**): B** is the variance-optimal vector of per-position constants (F4), so every population "
        "baseline that is such a vector (no baseline, the token-level ones, and the sequence-level ones under "
        "outcome reward) has a ratio ≥ 1. In groups, N·Var(ĝ)/Var(B**) compares the group estimate to the average "
        "of N independent B** estimates; `no baseline` and `B**` rows there are those i.i.d. averages. Relative "
        'bias: ||E ĝ − ∇J|| / ||∇J||. "Above" in counts means larger by more than a relative 1e-9.',
        "",
    ]


def report_sections(grid: Grid, population: list[dict], groups: list[dict], out_dir: Path) -> list[str]:
    main_cell, other_cells = grid.groups[0], grid.groups[1:]
    return [
        "## Setting",
        "",
        *setting_text(grid),
        "## What this shows",
        "",
        headline(population, groups),
        "",
        "Numbers behind it (every one read off the records of this run):",
        "",
        *_bullets(otb_findings(population) + reward_findings(population) + group_findings(groups)),
        "## Population baselines: Var / Var(B**)",
        "",
        "Summary over every case of each panel (seeds × (V, L)):",
        "",
        *population_summary(population),
        *plot_horizons(population, out_dir),
        "",
        "Relative bias of every population estimator (constants, prefix functions: unbiased by F1):",
        "",
        *population_bias_table(population),
        "### Median over seeds, by panel",
        "",
        *population_tables(population),
        *per_seed_table(population),
        "## Finite groups (compute_advantages): N·Var / Var(B**) and relative bias",
        "",
        "Summary over every group cell (median N·Var; include-self bias range; largest leave-one-out bias):",
        "",
        *group_summary(groups),
        *plot_groups(groups, main_cell, out_dir),
        "",
        *[line for policy, reward in PANELS for line in group_table(groups, main_cell, policy, reward)],
        "<details><summary>The other group cells</summary>",
        "",
        *[
            line
            for cell in other_cells
            for policy, reward in PANELS
            for line in group_table(groups, cell, policy, reward)
        ],
        "</details>",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one seed: seconds")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Outcome:
    torch.set_num_threads(1)
    args = parse_args(argv)
    grid = QUICK if args.quick else FULL
    started = time.perf_counter()
    population, groups = measure(grid)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sections = report_sections(grid, population, groups, args.out_dir)
    write_records("exact_variance", {"population": population, "groups": groups}, args.out_dir)
    title = "Exact variance and bias of every estimator, by enumeration"
    report = write_report("exact_variance", title, sections, time.perf_counter() - started, args.out_dir)
    return Outcome(report, population, groups)


if __name__ == "__main__":
    print(main().report)
