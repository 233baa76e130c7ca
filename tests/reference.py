"""Plain-loop oracles: the specification form of the estimators (THEORY §3, F7).

Slow and obvious on purpose: loops over prompts, rows and positions in Python
floats. The library's vectorised functions are tested against these.
"""

from __future__ import annotations

import math

import torch

from otb_ref.advantages import ESTIMATORS


def reference_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: list,
    old_log_probs=None,
    sum_pi_squared=None,
    grad_norms_sq=None,
    cumulative_energy=None,
    rollout_is_weights=None,
    leave_one_out=None,
    std_normalize=None,
    multi_turn=False,
    handle_zero_tail=False,
    epsilon=1e-8,
):
    spec = ESTIMATORS[estimator]
    loo = spec.leave_one_out if leave_one_out is None else leave_one_out
    std_norm = spec.std_normalize if std_normalize is None else std_normalize
    B, T = rewards.shape
    valid = [[bool(mask[i, t] != 0) for t in range(T)] for i in range(B)]
    r = [[float(rewards[i, t]) if valid[i][t] else 0.0 for t in range(T)] for i in range(B)]
    G = [[sum(r[i][k] for k in range(t, T)) for t in range(T)] for i in range(B)]
    R = [G[i][0] if T else 0.0 for i in range(B)]
    lengths = [sum(valid[i]) for i in range(B)]

    def token_w(i, t):
        if not valid[i][t]:
            return 0.0
        if spec.energy == "length":
            w = 1.0
        else:
            w = 1.0 - 2.0 * math.exp(float(old_log_probs[i, t])) + float(sum_pi_squared[i, t])
            w = min(max(w, 0.0), 2.0)
        if rollout_is_weights is not None:
            w *= float(rollout_is_weights[i, t]) ** 2
        return w

    def seq_weight(i):
        if spec.energy == "uniform":
            return 1.0
        if spec.energy == "exact":
            return float(grad_norms_sq[i])
        return sum(token_w(i, t) for t in range(T))

    def cum_weight(i, t):  # W_t at absolute position t (valid)
        if spec.energy == "uniform":
            return 1.0
        if spec.energy == "exact":
            return float(cumulative_energy[i, t])
        return sum(token_w(i, k) for k in range(t + 1))

    def baseline(weights, values):  # (Σ a x + ε x̄) / (Σ a + ε) over the members; x̄ if that denominator is 0
        if not values:
            return 0.0
        eps = epsilon if spec.energy in ("proxy", "exact") else 0.0
        mean = sum(values) / len(values)
        den = sum(weights) + eps
        return (sum(a * x for a, x in zip(weights, values)) + eps * mean) / den if den > 0 else mean

    groups: dict = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(i)
    counted = [lengths[i] > 0 if multi_turn else True for i in range(B)]

    # absolute position of a row's k-th valid token (multi-turn alignment)
    positions = [[t for t in range(T) if valid[i][t]] for i in range(B)]

    def centred_columns(rows):  # what the baseline centres, one list of alive values per coordinate
        if spec.granularity == "sequence":
            return [[R[j] for j in rows]]
        if multi_turn:
            return [[G[j][positions[j][k]] for j in rows if k < lengths[j]] for k in range(T)]
        return [[G[j][t] for j in rows if valid[j][t]] for t in range(T)]

    def group_spread(rows):  # pooled within-coordinate unbiased std; do the alive values differ somewhere?
        columns = centred_columns(rows)
        squares = sum(sum((x - sum(c) / len(c)) ** 2 for x in c) for c in columns if c)
        dof = sum(max(len(c) - 1, 0) for c in columns)
        return (math.sqrt(squares / dof) if dof else 0.0), any(max(c) > min(c) for c in columns if c)

    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for members in groups.values():
        rows = [i for i in members if counted[i]]
        n = len(rows)
        for i in members:
            others = [j for j in rows if not (loo and j == i)]
            if spec.granularity == "sequence":
                b = 0.0
                if n >= 2 and counted[i]:
                    b = baseline([seq_weight(j) for j in others], [R[j] for j in others])
                for t in range(T):
                    if valid[i][t]:
                        ret[i][t] = R[i]
                        adv[i][t] = R[i] - b
            else:
                for t in range(T):
                    ret[i][t] = G[i][t]
                for k, t in enumerate(positions[i]):
                    p = k if multi_turn else t  # coordinate of this token
                    weights, values = [], []
                    for j in others:
                        if multi_turn:
                            if p >= lengths[j]:
                                continue
                            tj = positions[j][p]
                        else:
                            if not valid[j][p]:
                                continue
                            tj = p
                        weights.append(cum_weight(j, tj))
                        values.append(G[j][tj])
                    b = baseline(weights, values) if (n >= 2 and counted[i]) else 0.0
                    if handle_zero_tail and n >= 2 and counted[i]:
                        group_lengths = sorted(lengths[j] for j in rows)
                        longest, second = group_lengths[-1], group_lengths[-2]
                        unique = sum(lengths[j] == longest for j in rows) == 1
                        if unique and lengths[i] == longest and p >= second:
                            b = 0.0
                    adv[i][t] = G[i][t] - b
            if std_norm and n >= 2 and counted[i]:
                std, spread = group_spread(rows)
                if spread and std + epsilon > 0:
                    adv[i] = [a / (std + epsilon) for a in adv[i]]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.float64).reshape(B, T)  # noqa: E731
    return as_tensor(adv), as_tensor(ret)
