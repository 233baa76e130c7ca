"""Exact variance table: ``python -m otb_ref.exact [--vocab 3] [--horizons 2 3 4 5 6] [--seed 0]``.

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

Nothing here is asserted: it is measured. The theorems are in ``proofs/``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from otb_ref.advantages import ESTIMATORS
from otb_ref.exact.groups import MAX_TUPLES, group_moments
from otb_ref.exact.moments import estimator_moments, outcome_rewards, population_advantages
from otb_ref.exact.policies import SharedPolicy, TreePolicy, enumerate_policy

POPULATION_ROWS = ["none", "mean", "opo", "sequence_proxy", "eob", "token_mean", "token_length", "otb", "otb_exact", "optimal"]
GROUP_ROWS = ["grpo", "rloo", "opo", "sequence_proxy", "eob", "token_mean", "otb", "otb_exact"]


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


def population_table(vocab: int, horizons: list[int], seed: int) -> str:
    header = ["policy", "L", "responses"] + [f"{name}" for name in POPULATION_ROWS]
    rows = []
    for horizon in horizons:
        for kind, policy in _policies(vocab, horizon, seed).items():
            enum = enumerate_policy(policy, keep_scores=False)
            rewards = parity_reward(enum)
            variance = {n: estimator_moments(enum, population_advantages(enum, rewards, n), rewards).variance for n in POPULATION_ROWS}
            best = variance["optimal"]
            rows.append([kind, str(horizon), str(enum.tokens.shape[0])] + [f"{variance[n] / best:.4f}" for n in POPULATION_ROWS])
    return _markdown(header, rows)


def group_table(vocab: int, horizons: list[int], seed: int, group_sizes: list[int], max_groups: int = MAX_TUPLES) -> str:
    header = ["policy", "L", "N", "estimator", "bias (include-self)", "N·Var/Var(B**) (include-self)", "bias (leave-one-out)", "N·Var/Var(B**) (leave-one-out)"]
    rows, skipped = [], []
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
                    cells = []
                    for leave_one_out in (False, True):
                        m = group_moments(enum, rewards, name, size, leave_one_out=leave_one_out)
                        cells += [f"{m.bias_norm / gradient_norm:.4f}", f"{size * m.variance / best:.4f}"]
                    label = "grpo (std-scaled)" if ESTIMATORS[name].std_normalize else name
                    rows.append([kind, str(horizon), str(size), label] + cells)
    table = _markdown(header, rows)
    if skipped:
        table += "\n\nSkipped (more distinct groups than --max-groups): " + ", ".join(skipped)
    return table


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D samples (average ranks for ties are not needed: continuous values)."""
    rx = x.argsort().argsort().double()
    ry = y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx @ ry) / (rx.norm() * ry.norm()))


def proxy_table(seed: int, batch: int = 16, length: int = 12) -> str:
    """Realized proxy energy W_t vs exact ||S_t||² on a tiny random-init Qwen2 (F6 approximation, measured)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from otb_ref.exact.grad_norms import prefix_grad_norms_sq
    from otb_ref.proxy import sum_pi_squared, token_energy

    rows = []
    for init in (0.02, 0.3, 1.0):
        torch.manual_seed(seed)
        config = Qwen2Config(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, initializer_range=init, tie_word_embeddings=False,
        )
        model = Qwen2ForCausalLM(config).double().eval()
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
        realized = torch.cat([torch.zeros(batch, 1, dtype=torch.float64), proxy.cumsum(-1)], dim=1) * mask  # W_t [B, L]
        exact_all = prefix_grad_norms_sq(model, ids, mask)  # ||S_t||², all parameters
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        model.lm_head.weight.requires_grad_(True)
        exact_head = prefix_grad_norms_sq(model, ids, mask)  # LM-head weight only
        valid = mask.bool()
        rows.append([
            f"{init}", f"{float(torch.exp(log_probs[:, 1:]).mean()):.3f}",
            f"{_spearman(realized[valid], exact_all[valid]):.3f}",
            f"{sum(_spearman(realized[:, t], exact_all[:, t]) for t in range(2, ids.shape[1])) / (ids.shape[1] - 2):.3f}",
            f"{_spearman(realized[:, -1], exact_all[:, -1]):.3f}",
            f"{_spearman(realized[valid], exact_head[valid]):.3f}",
        ])
    header = [
        "init std", "mean π(y)", "Spearman W_t vs ||S_t||² pooled (all θ)", "same, within position (mean over t)",
        "W_T vs ||S||² across responses (all θ)", "W_t vs ||S_t||² pooled (LM head only)",
    ]
    return _markdown(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="Exact variance table for small enumerable policies.")
    parser.add_argument("--vocab", type=int, default=3, help="vocabulary size including EOS (>= 2)")
    parser.add_argument("--horizons", type=int, nargs="+", default=[2, 3, 4, 5, 6], help="horizons L to tabulate")
    parser.add_argument("--group-horizons", type=int, nargs="+", default=[2, 3, 4], help="horizons for the finite-group table")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4], help="group sizes N")
    parser.add_argument("--max-groups", type=int, default=20000, help=f"skip finite-group cells with more distinct groups (at most {MAX_TUPLES})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the policies' parameters")
    parser.add_argument("--skip-transformer", action="store_true", help="skip the proxy-vs-exact section on a tiny Qwen2")
    args = parser.parse_args()
    if args.vocab < 2:
        parser.error("--vocab must be >= 2 (EOS and one more token)")
    if min(args.horizons + args.group_horizons) < 1:
        parser.error("--horizons and --group-horizons must be >= 1")
    if min(args.group_sizes) < 1:
        parser.error("--group-sizes must be >= 1")
    start = time.perf_counter()
    print(f"# Exact variance table (vocab {args.vocab} with EOS, outcome reward: odd count of token 1, seed {args.seed})\n")
    print("## Population baselines: Var / Var(B**)  (1 = the F4 optimum; `none` is plain REINFORCE)\n")
    print(population_table(args.vocab, args.horizons, args.seed))
    print("\n## Finite groups (compute_advantages): relative bias ||E ĝ − ∇J|| / ||∇J|| and N·Var(ĝ) / Var(B**)\n")
    print(group_table(args.vocab, args.group_horizons, args.seed, args.group_sizes, args.max_groups))
    if not args.skip_transformer:
        print(f"\n## Proxy vs exact energies on a tiny random-init Qwen2 (2 layers, d=16, V=32; {16} responses of 12 tokens sampled from it)\n")
        print(proxy_table(args.seed))
    print(f"\n(computed exactly in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
