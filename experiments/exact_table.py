"""Exact variance table:
``python -m experiments.exact_table [--vocab 3] [--horizons 2 3 4 5 6] [--seed 0] [--out FILE]``.

For a tabular tree policy and a parameter-shared policy (vocabulary with EOS,
outcome reward ``R = 1`` when the response holds an odd number of token 1),
prints, computed exactly by enumeration:

1. Population baselines (constants): each estimator's variance relative to
   the variance-optimal per-position baseline ``B**`` (F4), per horizon.
2. Finite groups of ``N = 2, 4`` responses with the sample estimators of
   ``compute_advantages``, include-self and leave-one-out: relative bias
   ``||E ĝ − ∇J|| / ||∇J||`` and ``N · Var(ĝ) / Var(B**)`` (per-response
   variance against the population optimum).
3. The Logit-Gradient Proxy against exact energies on a tiny transformer:
   Spearman rank correlation of the realized energy ``W_t`` with ``||S_t||²``
   (all parameters, and the LM head alone).
4. A summary derived from 1 and 2 (ranges and orderings), so that prose which
   quotes the table can quote these lines instead of recomputing them by hand.

``--out FILE`` also writes the same text, without the timing line, to ``FILE``
(the committed copy is ``docs/exact_table.md``, written with the default
settings; ``tests/test_otb_ref/exact/test_table.py`` checks that it is up to date). It is a measurement, not
part of the library: it lives with the experiments and imports :mod:`otb_ref` and, for its tiny Qwen2,
:mod:`otb_train.tiny_models` (run it from the repository root; ``python experiments/exact_table.py`` runs the
same).

Nothing here is asserted: it is measured. The theorems are in ``proofs/``.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import time
from pathlib import Path

import torch

from otb_ref import ESTIMATORS
from otb_ref.exact.groups import MAX_TUPLES, group_moments
from otb_ref.exact.moments import POPULATION_ESTIMATORS, estimator_moments, outcome_rewards, population_advantages
from otb_ref.exact.policies import SharedPolicy, TreePolicy, enumerate_policy

POPULATION_ROWS = list(POPULATION_ESTIMATORS)  # the table's columns, in the estimator table's order
GROUP_ROWS = ["grpo", "rloo", "opo", "sequence_proxy", "eob", "token_mean", "otb", "otb_exact"]
# Summary groupings of GROUP_ROWS: energy-weighted means (include-self biases them by more than 1/N), and the two
# granularities whose leave-one-out forms coincide at N = 2 (a single other response's weight cancels).
ENERGY_WEIGHTED = ["opo", "sequence_proxy", "eob", "otb", "otb_exact"]
SEQUENCE_LEVEL = ["rloo", "opo", "sequence_proxy", "eob"]
TOKEN_LEVEL = ["token_mean", "otb", "otb_exact"]
DEFAULT_OUT = "docs/exact_table.md"


def parity_reward(enum) -> torch.Tensor:
    """Outcome reward ``[M, L]``: 1 when the response holds an odd number of token 1."""
    ones = ((enum.tokens == 1).double() * enum.mask).sum(-1)
    return outcome_rewards(enum, (ones % 2 == 1).double())


def _policies(vocab: int, horizon: int, seed: int):
    return {
        "tree": TreePolicy(vocab, horizon, seed=seed),
        "shared": SharedPolicy(vocab, horizon, width=3, seed=seed),
    }


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: float) -> str:
    """The table's number format: every number of the summary is printed the same way as the cells."""
    return f"{value:.4f}"


def population_results(vocab: int, horizons: list[int], seed: int) -> dict[tuple[str, int], dict[str, float]]:
    """``{(policy, L): {estimator: Var / Var(B**)}}`` plus the number of responses under ``"responses"``."""
    results = {}
    for horizon in horizons:
        for kind, policy in _policies(vocab, horizon, seed).items():
            enum = enumerate_policy(policy, keep_scores=False)
            rewards = parity_reward(enum)
            variance = {
                n: estimator_moments(enum, population_advantages(enum, rewards, n), rewards).variance
                for n in POPULATION_ROWS
            }
            best = variance["optimal"]
            results[kind, horizon] = {n: variance[n] / best for n in POPULATION_ROWS}
            results[kind, horizon]["responses"] = enum.tokens.shape[0]
    return results


def _population_markdown(results: dict[tuple[str, int], dict[str, float]]) -> str:
    header = ["policy", "L", "responses"] + POPULATION_ROWS
    rows = [
        [kind, str(horizon), str(r["responses"])] + [_cell(r[n]) for n in POPULATION_ROWS]
        for (kind, horizon), r in results.items()
    ]
    return _markdown(header, rows)


def group_results(
    vocab: int, horizons: list[int], seed: int, group_sizes: list[int], max_groups: int = MAX_TUPLES
) -> tuple[list[dict], list[str]]:
    """One record per (policy, L, N, estimator): relative bias and ``N·Var/Var(B**)``, include-self and
    leave-one-out; and the cells skipped for having more than ``max_groups`` distinct groups."""
    records, skipped = [], []
    for horizon in horizons:
        for kind, policy in _policies(vocab, horizon, seed).items():
            enum = enumerate_policy(policy, keep_scores=True)
            rewards = parity_reward(enum)
            reference = estimator_moments(enum, population_advantages(enum, rewards, "none"), rewards)
            best = estimator_moments(enum, population_advantages(enum, rewards, "optimal"), rewards).variance
            gradient_norm = float(reference.mean.norm())
            for size in group_sizes:
                num_groups = math.comb(enum.tokens.shape[0] + size - 1, size)
                if num_groups > min(max_groups, MAX_TUPLES):
                    skipped.append(f"{kind} L={horizon} N={size} ({num_groups} groups)")
                    continue
                for name in GROUP_ROWS:
                    record = {"policy": kind, "L": horizon, "N": size, "estimator": name}
                    for leave_one_out, key in ((False, "self"), (True, "loo")):
                        m = group_moments(enum, rewards, name, size, leave_one_out=leave_one_out)
                        record[f"bias_{key}"] = m.bias_norm / gradient_norm
                        record[f"var_{key}"] = size * m.variance / best
                    records.append(record)
    return records, skipped


def _group_markdown(records: list[dict], skipped: list[str]) -> str:
    header = [
        "policy",
        "L",
        "N",
        "estimator",
        "bias (include-self)",
        "N·Var/Var(B**) (include-self)",
        "bias (leave-one-out)",
        "N·Var/Var(B**) (leave-one-out)",
    ]
    rows = []
    for r in records:
        label = "grpo (std-scaled)" if ESTIMATORS[r["estimator"]].std_normalize else r["estimator"]
        cells = [_cell(r[key]) for key in ("bias_self", "var_self", "bias_loo", "var_loo")]
        rows.append([r["policy"], str(r["L"]), str(r["N"]), label] + cells)
    table = _markdown(header, rows)
    if skipped:
        table += "\n\nSkipped (more distinct groups than --max-groups): " + ", ".join(skipped)
    return table


def group_table(
    vocab: int, horizons: list[int], seed: int, group_sizes: list[int], max_groups: int = MAX_TUPLES
) -> str:
    return _group_markdown(*group_results(vocab, horizons, seed, group_sizes, max_groups))


def _range(cells: list[str]) -> str:
    low, high = min(cells, key=float), max(cells, key=float)
    return low if low == high else f"{low} to {high}"


def _horizon_list(horizons: list[int]) -> str:
    return ", ".join(str(h) for h in horizons)


def summary(population: dict[tuple[str, int], dict[str, float]], records: list[dict]) -> str:
    """Ranges and orderings read off the two exact tables.

    Everything is computed from the printed cells (4 decimals), so each number here is a cell of the tables or a
    difference of two cells, and an ordering is "equal" when the cells are.
    """
    items = []
    for kind in dict.fromkeys(k for k, _ in population):
        cells = {h: {n: _cell(r[n]) for n in POPULATION_ROWS} for (k, h), r in population.items() if k == kind}
        otb = {h: c["otb"] for h, c in cells.items()}
        low, high = min(otb, key=lambda h: float(otb[h])), max(otb, key=lambda h: float(otb[h]))
        items.append(f"{kind}: `otb` / B** from {otb[low]} (L={low}) to {otb[high]} (L={high}).")
        for name in ("otb", "otb_exact"):
            order = {"above": [], "below": [], "equal to": []}
            for h, c in cells.items():
                a, b = float(c[name]), float(c["eob"])
                order["equal to" if a == b else "above" if a > b else "below"].append(h)
            relations = [f"{word} `eob` at L={_horizon_list(hs)}" for word, hs in order.items() if hs]
            items.append(f"{kind}: `{name}` " + "; ".join(relations) + ".")
        shift = {h: float(c["otb"]) - float(c["otb_exact"]) for h, c in cells.items()}
        if all(_cell(v) == _cell(0.0) for v in shift.values()):
            items.append(f"{kind}: `otb` equals `otb_exact` (proxy instead of exact energies) at every L.")
        else:
            low, high = min(shift, key=shift.get), max(shift, key=shift.get)
            items.append(
                f"{kind}: `otb` − `otb_exact` (proxy instead of exact energies, in units of Var(B**)) from "
                f"{shift[low]:+.4f} (L={low}) to {shift[high]:+.4f} (L={high})."
            )
    parts = ["Population baselines (first table):", _bullets(items)]
    if not records:
        return "\n\n".join(parts)
    items = []
    sizes = sorted({r["N"] for r in records})
    loo_bias = [_cell(r["bias_loo"]) for r in records if not ESTIMATORS[r["estimator"]].std_normalize]
    items.append(f"leave-one-out bias of every estimator but `grpo (std-scaled)`: at most {max(loo_bias, key=float)}.")
    for size in sizes:
        at = [r for r in records if r["N"] == size]
        mean = [_cell(r["bias_self"]) for r in at if r["estimator"] == "rloo"]
        weighted = [_cell(r["bias_self"]) for r in at if r["estimator"] in ENERGY_WEIGHTED]
        std = [_cell(r["bias_loo"]) for r in at if ESTIMATORS[r["estimator"]].std_normalize]
        items.append(
            f"N = {size}: bias of the include-self plain mean (`rloo` include-self) {_range(mean)}; of include-self "
            f"{', '.join(ENERGY_WEIGHTED)} {_range(weighted)}; of `grpo (std-scaled)` leave-one-out {_range(std)}."
        )
    if 2 in sizes:
        same, differ = [], []
        for kind, horizon in dict.fromkeys((r["policy"], r["L"]) for r in records if r["N"] == 2):
            var = {
                r["estimator"]: _cell(r["var_loo"])
                for r in records
                if (r["policy"], r["L"], r["N"]) == (kind, horizon, 2)
            }
            within = len({var[n] for n in SEQUENCE_LEVEL}) == 1 and len({var[n] for n in TOKEN_LEVEL}) == 1
            if not within:
                differ.append(f"{kind} L={horizon} (estimators of one granularity differ)")
            elif var[SEQUENCE_LEVEL[0]] == var[TOKEN_LEVEL[0]]:
                same.append(f"{kind} L={horizon} ({var[SEQUENCE_LEVEL[0]]})")
            else:
                differ.append(f"{kind} L={horizon} ({var[SEQUENCE_LEVEL[0]]} vs {var[TOKEN_LEVEL[0]]})")
        items.append(
            f"N = 2, leave-one-out N·Var/Var(B**), sequence level ({', '.join(SEQUENCE_LEVEL)}) vs token level "
            f"({', '.join(TOKEN_LEVEL)}): equal at {'; '.join(same) or 'none'}; different at "
            f"{'; '.join(differ) or 'none'}."
        )
    parts += ["Finite groups (second table):", _bullets(items)]
    return "\n\n".join(parts)


def _bullets(items: list[str]) -> str:
    """Markdown list, wrapped at 120 characters."""
    wrap = textwrap.TextWrapper(120, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(wrap.fill(item) for item in items)


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D samples (continuous values: no ties to average)."""
    rx = x.argsort().argsort().double()
    ry = y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx @ ry) / (rx.norm() * ry.norm()))


def proxy_table(seed: int, batch: int = 16, length: int = 12) -> str:
    """Realized proxy energy W_t vs exact ||S_t||² on a tiny random-init Qwen2 (F6 approximation, measured)."""
    from otb_ref.exact.grad_norms import prefix_grad_norms_sq_fp64
    from otb_ref.proxy import sum_pi_squared, token_energy
    from otb_train.tiny_models import tiny_causal_lm

    rows = []
    for init in (0.02, 0.3, 1.0):
        sizes = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
        model = tiny_causal_lm("qwen2", seed, initializer_range=init, tie_word_embeddings=False, **sizes)
        model = model.double().eval()
        ids = torch.randint(1, 32, (batch, 2))  # two prompt tokens
        with torch.no_grad():
            for _ in range(length):  # sample responses from the model itself
                logits = model(ids).logits[:, -1]
                ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], dim=1)
            logits = model(ids).logits[:, :-1]  # position j − 1 predicts token j
        mask = torch.zeros_like(ids, dtype=torch.float64)
        mask[:, 2:] = 1.0
        log_probs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
        proxy = token_energy(log_probs, sum_pi_squared(logits)) * mask[:, 1:]
        zero = torch.zeros(batch, 1, dtype=torch.float64)
        realized = torch.cat([zero, proxy.cumsum(-1)], dim=1) * mask  # W_t [B, L]
        exact_all = prefix_grad_norms_sq_fp64(model, ids, mask)  # ||S_t||², all parameters
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        model.lm_head.weight.requires_grad_(True)
        exact_head = prefix_grad_norms_sq_fp64(model, ids, mask)  # LM-head weight only
        valid = mask.bool()
        positions = range(2, ids.shape[1])
        within = sum(_spearman(realized[:, t], exact_all[:, t]) for t in positions) / len(positions)
        rows.append(
            [
                f"{init}",
                f"{float(torch.exp(log_probs[:, 1:]).mean()):.3f}",
                f"{_spearman(realized[valid], exact_all[valid]):.3f}",
                f"{within:.3f}",
                f"{_spearman(realized[:, -1], exact_all[:, -1]):.3f}",
                f"{_spearman(realized[valid], exact_head[valid]):.3f}",
            ]
        )
    # ‖·‖ rather than ||·|| in the header: a literal | would split a markdown table cell.
    header = [
        "init std",
        "mean π(y)",
        "Spearman W_t vs ‖S_t‖² pooled (all θ)",
        "same, within position (mean over t)",
        "W_T vs ‖S‖² across responses (all θ)",
        "W_t vs ‖S_t‖² pooled (LM head only)",
    ]
    return _markdown(header, rows)


def render(args: argparse.Namespace) -> str:
    """The whole table as markdown (deterministic: no timings)."""
    population = population_results(args.vocab, args.horizons, args.seed)
    records, skipped = group_results(args.vocab, args.group_horizons, args.seed, args.group_sizes, args.max_groups)
    parts = [
        f"# Exact variance table (vocab {args.vocab} with EOS, outcome reward: odd count of token 1, seed {args.seed})",
        "## Population baselines: Var / Var(B**)  (1 = the F4 optimum; `none` is plain REINFORCE; `grpo` is the "
        "mean E[R] that grpo and rloo estimate, without std scaling)",
        _population_markdown(population),
        "## Finite groups (compute_advantages): relative bias ||E ĝ − ∇J|| / ||∇J|| and N·Var(ĝ) / Var(B**)",
        _group_markdown(records, skipped),
    ]
    if not args.skip_transformer:
        parts += [
            "## Proxy vs exact energies on a tiny random-init Qwen2 (2 layers, d=16, V=32; "
            "16 responses of 12 tokens sampled from it)",
            proxy_table(args.seed),
        ]
    parts += ["## Summary (read off the two exact tables above by the same command)", summary(population, records)]
    return "\n\n".join(parts) + "\n"


def _settings(args: argparse.Namespace) -> str:
    """The flags that determine the text (everything but --out), as a command line."""
    flags = [
        f"--vocab {args.vocab}",
        "--horizons " + " ".join(map(str, args.horizons)),
        "--group-horizons " + " ".join(map(str, args.group_horizons)),
        "--group-sizes " + " ".join(map(str, args.group_sizes)),
        f"--max-groups {args.max_groups}",
        f"--seed {args.seed}",
    ]
    return " ".join(flags + (["--skip-transformer"] if args.skip_transformer else []))


def versions(args: argparse.Namespace) -> str:
    """The library versions the text depends on: torch (all sections) and transformers (the tiny Qwen2's init)."""
    found = [f"torch {torch.__version__}"]
    if not args.skip_transformer:
        import transformers

        found.append(f"transformers {transformers.__version__}")
    return ", ".join(found)


def file_text(args: argparse.Namespace, table: str) -> str:
    """What ``--out`` writes: a provenance comment, then the table."""
    return (
        f"<!-- Written by\n     python -m experiments.exact_table {_settings(args)} --out <this file>\n"
        f"     with {versions(args)}. Do not edit by hand: regenerate. -->\n\n" + table
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Exact variance table for small enumerable policies.")
    parser.add_argument("--vocab", type=int, default=3, help="vocabulary size including EOS (>= 2)")
    parser.add_argument("--horizons", type=int, nargs="+", default=[2, 3, 4, 5, 6], help="horizons L to tabulate")
    parser.add_argument(
        "--group-horizons", type=int, nargs="+", default=[2, 3, 4], help="horizons for the finite-group table"
    )
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4], help="group sizes N")
    parser.add_argument(
        "--max-groups",
        type=int,
        default=20000,
        help=f"skip finite-group cells with more distinct groups (at most {MAX_TUPLES})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the policies' parameters")
    parser.add_argument(
        "--skip-transformer", action="store_true", help="skip the proxy-vs-exact section on a tiny Qwen2"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"also write the table (without the timing line) to this file; the committed copy is {DEFAULT_OUT}",
    )
    args = parser.parse_args(argv)
    if args.vocab < 2:
        parser.error("--vocab must be >= 2 (EOS and one more token)")
    if min(args.horizons + args.group_horizons) < 1:
        parser.error("--horizons and --group-horizons must be >= 1")
    if min(args.group_sizes) < 1:
        parser.error("--group-sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    table = render(args)
    print(table)
    print(f"(computed exactly in {time.perf_counter() - start:.1f} s)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(file_text(args, table), encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
