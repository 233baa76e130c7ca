"""A second implementation of ``otb_ref.compute_advantages`` in plain NumPy loops, written from THEORY §3 and
``otb_ref/readable.py``: every rule of the porting contract (docs/PORTING.md) in the open.

    python conformance/check.py conformance/ports/numpy_port.py:compute_advantages

It is the independent oracle the tests compare otb_ref against (tests/oracle.py, with ``direct=True``),
torch-free and sharing no code with otb_ref. The vectors' expected values are otb_ref's; the conformance
generator checks this port on every case beside them (a cross-check). The ports that break one rule each are
``conformance/ports/bugs/one_rule.py``, built on ``vector_port.py``. ``direct=True`` forms leave-one-out sums
over the others instead of "all minus own" (both are legitimate; the vectors' tolerance admits either). Slow on
purpose (Python loops over groups, rows and positions); NumPy only.
"""

from __future__ import annotations

import numpy as np

ESTIMATORS = {  # name: (granularity, energy, leave_one_out, std_normalize), THEORY §3
    "grpo": ("sequence", "uniform", False, True),
    "rloo": ("sequence", "uniform", True, False),
    "opo": ("sequence", "length", False, False),
    "sequence_proxy": ("sequence", "proxy", False, False),
    "eob": ("sequence", "exact", False, False),
    "token_mean": ("token", "uniform", False, False),
    "token_length": ("token", "length", False, False),
    "otb": ("token", "proxy", False, False),
    "otb_exact": ("token", "exact", False, False),
}


def _baseline(weights, values, own, epsilon, direct):
    """``(Σ a x + ε x̄) / (Σ a + ε)`` over the members, ``x̄`` their plain mean (``x̄`` if the denominator is 0).

    ``weights``, ``values``: the members alive there, the row itself included; ``own``: ``(a_i, x_i)`` to leave out
    (leave-one-out), else None. Leave-one-out sums are "all members minus own term" (otb_ref's rule), or, with
    ``direct``, sums over the others (another rounding where one row's weight dwarfs the others')."""
    a, x = np.asarray(weights, dtype=np.float64), np.asarray(values, dtype=np.float64)
    n, num, den, total = np.float64(len(x)), (a * x).sum(), a.sum(), x.sum()
    if own is not None:
        a_i, x_i = np.float64(own[0]), np.float64(own[1])
        if direct:
            keep = np.ones(len(x), bool)
            keep[own[2]] = False
            n, num, den, total = np.float64(keep.sum()), (a * x)[keep].sum(), a[keep].sum(), x[keep].sum()
        else:
            n, num, den, total = n - 1, num - a_i * x_i, den - a_i, total - x_i
    if n == 0:
        return 0.0
    mean = total / n
    den = den + np.float64(epsilon)
    return (num + np.float64(epsilon) * mean) / den if den > 0 else mean


def _energies(energy, m, dt, lp, s, rho, grad_norms_sq, cumulative_energy):
    """``(v [B], W [B, T])`` in fp64, from per-token energies ``w`` computed in the compute dtype ``dt``."""
    batch, length = m.shape
    if energy == "uniform":
        return np.ones(batch), m.astype(np.float64)
    if energy == "exact":
        v = None if grad_norms_sq is None else np.asarray(np.asarray(grad_norms_sq, dt), np.float64)
        return v, (None if cumulative_energy is None else cumulative_energy.astype(np.float64))
    w = m.astype(dt) if energy == "length" else (dt(1.0) - dt(2.0) * np.exp(lp) + s)
    if energy == "proxy":
        w = np.clip(w, 0.0, 2.0).astype(dt)
    if rho is not None:
        w = w * rho * rho
    w = np.where(m, w, dt(0.0)).astype(dt).astype(np.float64)
    return w.sum(axis=1), np.cumsum(w, axis=1)


def _pooled_std(columns):
    """Pooled within-coordinate unbiased std of the alive values, and whether they differ somewhere."""
    squares = sum(
        float(((np.asarray(c, np.float64) - np.mean(np.asarray(c, np.float64))) ** 2).sum()) for c in columns if c
    )
    dof = sum(max(len(c) - 1, 0) for c in columns)
    spread = any(max(c) > min(c) for c in columns if c)
    return (np.sqrt(squares / dof) if dof else 0.0), spread


def compute_advantages(  # noqa: C901 (one loop per rule, on purpose)
    estimator,
    token_level_rewards,
    response_mask,
    index,
    *,
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
    direct=False,
):
    granularity, energy, loo, std = ESTIMATORS[estimator]
    loo = loo if leave_one_out is None else bool(leave_one_out)
    std = std if std_normalize is None else bool(std_normalize)
    given = [
        x
        for x in (
            token_level_rewards,
            old_log_probs,
            sum_pi_squared,
            grad_norms_sq,
            cumulative_energy,
            rollout_is_weights,
        )
        if x is not None and np.asarray(x).dtype.kind == "f"
    ]
    dt = np.float64 if any(np.asarray(x).dtype == np.float64 for x in given) else np.float32
    m = np.asarray(response_mask) != 0
    batch, length = m.shape
    keep = lambda x: np.where(m, np.asarray(x, dt), 0)  # noqa: E731 (values off the mask: 0, whatever they are)
    r = keep(token_level_rewards).astype(dt)
    lp, s, rho, ce = (
        None if x is None else keep(x).astype(dt)
        for x in (old_log_probs, sum_pi_squared, rollout_is_weights, cumulative_energy)
    )
    v, W = _energies(energy, m, dt, lp, s, rho, grad_norms_sq, ce)
    G = np.cumsum(r.astype(np.float64)[:, ::-1], axis=1)[:, ::-1]  # summed from the end, in fp64
    R = G[:, 0] if length else np.zeros(batch)
    lengths = m.sum(axis=1)
    counted = lengths > 0 if multi_turn else np.ones(batch, bool)
    positions = [np.flatnonzero(m[i]) for i in range(batch)]
    eps_b = epsilon if energy in ("proxy", "exact") else 0.0
    adv = np.zeros((batch, length), np.float64)
    groups = {}
    for i, key in enumerate(np.asarray(index).tolist()):
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        rows = [i for i in members if counted[i]]
        has_baseline = len(rows) >= 2
        for i in rows:
            if granularity == "sequence":
                own = (v[i], R[i], rows.index(i)) if loo else None
                b = _baseline([v[j] for j in rows], [R[j] for j in rows], own, eps_b, direct)
                adv[i] = (np.float64(R[i]) - np.float64(b if has_baseline else 0.0)) * m[i]
                continue
            for k, t in enumerate(positions[i]):
                p = k if multi_turn else t  # the coordinate: generated-token rank or absolute position
                alive = [
                    (j, positions[j][p] if multi_turn else p)
                    for j in rows
                    if (lengths[j] > p if multi_turn else m[j, p])
                ]
                own = (W[i, t], G[i, t], [j for j, _ in alive].index(i)) if loo else None
                b = _baseline([W[j, u] for j, u in alive], [G[j, u] for j, u in alive], own, eps_b, direct)
                if not has_baseline or _in_zero_tail(handle_zero_tail, rows, lengths, i, p):
                    b = 0.0
                adv[i, t] = np.float64(G[i, t]) - np.float64(b)
        if std and has_baseline:
            scale_rows(adv, rows, granularity, multi_turn, R, G, m, lengths, positions, epsilon)
    returns = (R[:, None] * m).astype(dt) if granularity == "sequence" else G.astype(dt)
    return adv.astype(dt), returns


def _in_zero_tail(handle_zero_tail, rows, lengths, i, p):
    """The unique longest row of a group, at coordinates from the second-longest length on."""
    if not handle_zero_tail or len(rows) < 2:
        return False
    ordered = sorted((lengths[j] for j in rows), reverse=True)
    return ordered[0] > ordered[1] and lengths[i] == ordered[0] and p >= ordered[1]


def scale_rows(adv, rows, granularity, multi_turn, R, G, m, lengths, positions, epsilon):
    """GRPO's std scaling of one group's rows, in place: σ of what the baseline centres, pooled within coordinates."""
    if granularity == "sequence":
        columns = [[R[j] for j in rows]]
    elif multi_turn:
        columns = [[G[j, positions[j][k]] for j in rows if k < lengths[j]] for k in range(m.shape[1])]
    else:
        columns = [[G[j, t] for j in rows if m[j, t]] for t in range(m.shape[1])]
    sigma, spread = _pooled_std(columns)
    if spread and sigma + epsilon > 0:
        for i in rows:
            adv[i] = adv[i] / (sigma + epsilon)
