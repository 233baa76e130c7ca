"""A third implementation of ``otb_ref.compute_advantages``, vectorised NumPy, written from docs/PORTING.md.

    python conformance/check.py conformance/ports/vector_port.py:compute_advantages   # the contract, as written
    python conformance/check.py conformance/ports/vector_port.py:pairwise             # v and group sums pairwise
    python conformance/check.py conformance/ports/vector_port.py:direct               # leave-one-out sums direct
    python conformance/check.py conformance/ports/vector_port.py:welford              # σ by Welford's one pass

As it stands it is correct: every rule of the contract, group sums in row order, ``v`` and ``W`` summed along
the row, two-pass σ (as otb_ref). ``order`` picks another summation order the contract leaves free (each of
them passes every case); ``bug`` breaks exactly one rule (``conformance/ports/bugs/one_rule.py`` names them and
says what each does), so that each rule of the contract has a port that fails the cases exercising it. Unlike
``numpy_port.py`` (loops, the generator's cross-check), this one is fast enough for the long-T cases.
"""

from __future__ import annotations

import numpy as np

F32, F64 = np.float32, np.float64
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
ORDERS = ("sequential", "pairwise", "direct", "welford")


def compute_advantages(
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
    epsilon=None,
    order="sequential",
    bug=None,
    returns_fn=None,
):
    """``(advantages, returns)`` in the compute dtype. ``returns_fn(rewards_in_dtype) -> G`` replaces the fp64
    returns to go (a bug port's hook); ``order`` one of :data:`ORDERS`; ``bug`` a rule name of ``one_rule.py``."""
    granularity, energy, loo, std = ESTIMATORS[estimator]
    if bug == "defaults":  # the estimator's own flags ignored: an omitted flag is off
        loo, std = bool(leave_one_out), bool(std_normalize)
    else:
        loo = loo if leave_one_out is None else bool(leave_one_out)
        std = std if std_normalize is None else bool(std_normalize)
    if epsilon is None:
        epsilon = 0.0 if bug == "default_epsilon" else 1e-8
    values = [token_level_rewards, old_log_probs, sum_pi_squared, grad_norms_sq, cumulative_energy, rollout_is_weights]
    if bug == "mask_dtype":
        values.append(response_mask)
    floating = [np.asarray(x) for x in values if x is not None and np.asarray(x).dtype.kind == "f"]
    dt = F64 if any(x.dtype == F64 for x in floating) else F32  # the compute dtype
    m = np.asarray(response_mask) != 0
    ctx = _Context(dt, m, bug, order)
    r = ctx.read(token_level_rewards)
    rho = None if rollout_is_weights is None else ctx.read(rollout_is_weights)
    if energy in ("length", "proxy"):
        lp, s = (None if x is None else ctx.read(x) for x in (old_log_probs, sum_pi_squared))
        w = _token_energy(ctx, energy, lp, s, rho)
        v, W = ctx.row_sum(w), ctx.prefix_sum(w)
    elif energy == "exact":
        v = None if grad_norms_sq is None else np.asarray(grad_norms_sq, dt).astype(F64)
        W = None if cumulative_energy is None else ctx.read(cumulative_energy).astype(F64)
    else:
        v, W = np.ones(m.shape[0]), np.ones(m.shape)
    G = ctx.returns_to_go(r) if returns_fn is None else np.asarray(returns_fn(r), F64)
    R = G[:, 0] if m.shape[1] else np.zeros(m.shape[0])
    group = _groups(index, bug)
    lengths = m.sum(axis=1)
    counted = lengths > 0 if (multi_turn or bug == "empty_responses") else np.ones(m.shape[0], bool)
    counts = np.bincount(group, weights=counted, minlength=group.max(initial=-1) + 1)
    has_baseline = counts[group] >= 2 if bug != "group_of_one" else np.ones(m.shape[0], bool)
    eps_b = epsilon if energy in ("proxy", "exact") else 0.0
    if bug == "epsilon_counts" or (bug == "epsilon_is_lengths" and energy == "length" and rho is not None):
        eps_b = epsilon
    if granularity == "sequence":
        alive = counted[:, None].astype(F64)
        b = _baseline(ctx, (v * counted)[:, None], alive, R[:, None], group, loo, eps_b)[:, 0]
        adv = ctx.difference(R, np.where(has_baseline, b, 0.0))[:, None] * m
        centred, alive_c = R[:, None], alive
    else:
        rank = _coordinates(m, multi_turn and bug != "multi_turn_ranks")
        G_a, W_a, alive = (_aligned(x, m, rank) for x in (G, W, m.astype(F64)))
        alive = alive * counted[:, None]
        b = _baseline(ctx, W_a * alive, alive, G_a, group, loo, eps_b)
        b = np.where(has_baseline[:, None], b, 0.0)
        if handle_zero_tail:
            start = _tail_start(lengths, counted, group, m.shape[1])
            coordinate = np.arange(m.shape[1])[None, :]
            tail = coordinate > start[:, None] if bug == "zero_tail_start" else coordinate >= start[:, None]
            b = np.where(tail, 0.0, b)
        adv = _unaligned(ctx.difference(G_a, b) * alive, m, rank)
        centred, alive_c = G_a, alive
    if std:
        adv = _std_scaled(ctx, adv, centred, alive_c, group, counted & has_baseline, epsilon, eps_b)
    ret = G if granularity == "token" or bug == "returns" else R[:, None] * m
    if bug == "output_dtype":
        return adv.astype(F64), ret.astype(F64)
    return adv.astype(dt), ret.astype(dt)


class _Context:
    """The compute dtype, the mask, the bug and the order: how each step reads and sums."""

    def __init__(self, dt, m, bug, order):
        if order not in ORDERS:
            raise ValueError(f"order: one of {ORDERS}, got {order!r}")
        self.dt, self.m, self.bug, self.order = dt, m, bug, order

    def read(self, x):
        """An input in the compute dtype, 0 off the mask whatever stood there (the bug: ``x * m``)."""
        x = np.asarray(x, self.dt)
        if self.bug == "off_mask":
            with np.errstate(invalid="ignore"):
                return x * self.m
        return np.where(self.m, x, self.dt(0.0))

    def row_sum(self, w):
        """``v = Σ_t m_t w_t`` in fp64 (``w`` already fp64 and 0 off the mask)."""
        if self.bug == "precision_v":  # accumulated in the compute dtype, one token after the other
            return np.cumsum(w.astype(self.dt), axis=1)[:, -1].astype(F64) if w.shape[1] else np.zeros(len(w))
        if self.order == "pairwise":
            return w.sum(axis=1)  # NumPy sums a contiguous row pairwise
        return np.cumsum(w, axis=1)[:, -1] if w.shape[1] else np.zeros(len(w))

    def prefix_sum(self, w):
        """``W_t = Σ_{j≤t} m_j w_j`` in fp64."""
        return np.cumsum(w.astype(self.dt), axis=1).astype(F64) if self.bug == "precision_W" else np.cumsum(w, axis=1)

    def returns_to_go(self, r):
        """``G_t = m_t r_t + G_{t+1}``, summed from the end, in fp64."""
        dt = self.dt if self.bug == "precision_G" else F64
        return np.cumsum(r.astype(dt)[:, ::-1], axis=1)[:, ::-1].astype(F64)

    def group_dtype(self):
        return self.dt if self.bug == "precision_group_sums" else F64

    def group_total(self, y, group):
        """Each row's group total of ``y`` [B, P] (row order, or pairwise over the members)."""
        dt, num_groups = self.group_dtype(), group.max(initial=-1) + 1
        y = y.astype(dt)
        total = np.zeros((num_groups, *y.shape[1:]), dt)
        if self.order == "pairwise":
            for g in range(num_groups):
                members = np.ascontiguousarray(np.moveaxis(y[group == g], 0, -1))
                total[g] = members.sum(axis=-1)
        else:
            np.add.at(total, group, y)
        return total[group]

    def others(self, y, group):
        """Each row's sum of ``y`` over the other members: group total minus own term, or summed directly."""
        if self.order == "direct":
            dt = self.group_dtype()
            others = (group[:, None] == group[None, :]) & ~np.eye(len(group), dtype=bool)
            return np.stack([y.astype(dt)[row].sum(axis=0) for row in others]) if len(group) else y.astype(dt)
        return self.group_total(y, group) - y.astype(self.group_dtype())

    def difference(self, x, b):
        """``G − B`` in fp64 (the bug: each rounded to the compute dtype and subtracted there)."""
        if self.bug == "precision_G_minus_B":
            return (np.asarray(x).astype(self.dt) - np.asarray(b).astype(self.dt)).astype(F64)
        return np.asarray(x, F64) - np.asarray(b, F64)


def _token_energy(ctx, energy, lp, s, rho):
    """``w_t = clamp((1 − 2π) + Σπ², 0, 2)`` (``length``: 1), times ``ρ̄_t²``, in the compute dtype; then fp64."""
    dt = F64 if ctx.bug == "w_dtype" else ctx.dt
    if energy == "length":
        w = ctx.m.astype(dt)
    else:
        w = (dt(1.0) - dt(2.0) * np.exp(lp.astype(dt))) + s.astype(dt)
        if ctx.bug == "is_after_clamp" and rho is not None:
            w = w * (rho.astype(dt) * rho.astype(dt))
        if ctx.bug != "clamp":
            w = np.clip(w, dt(0.0), dt(2.0))
    if rho is not None and not (ctx.bug == "is_after_clamp" and energy == "proxy"):
        w = w * (rho.astype(dt) if ctx.bug == "is_squared" else rho.astype(dt) * rho.astype(dt))
    with np.errstate(invalid="ignore"):
        w = w * ctx.m if ctx.bug == "off_mask" else np.where(ctx.m, w, dt(0.0))
    return w.astype(F64)


def _groups(index, bug):
    """Group numbers: equal ids form a group wherever they stand (the bug: runs of equal neighbours)."""
    ids = np.asarray(index).tolist()
    if bug == "groups":
        return np.cumsum([i == 0 or ids[i] != ids[i - 1] for i in range(len(ids))], dtype=np.int64) - 1
    first = {key: g for g, key in enumerate(dict.fromkeys(ids))}
    return np.asarray([first[key] for key in ids], np.int64)


def _baseline(ctx, a, alive, x, group, loo, eps):
    """``(Σ a x + ε x̄) / (Σ a + ε)`` over each row's members (``x̄`` where the denominator is 0, 0 without
    members); arrays [B, P]. The bugs ``epsilon`` (verl's ``Σ a x / (Σ a + ε)``) and ``loo_alone``."""
    terms = (alive, a * x, a, alive * x)
    n, num, den, total = (ctx.others(y, group) if loo else ctx.group_total(y, group) for y in terms)
    dt = ctx.group_dtype()
    mean = np.where(n > 0, total / np.maximum(n, dt(1.0)), dt(0.0))
    den = den + dt(eps)
    positive = den > 0
    if ctx.bug == "epsilon":
        b = np.where(positive, num / np.where(positive, den, dt(1.0)), dt(0.0))
    else:
        b = np.where(positive, (num + dt(eps) * mean) / np.where(positive, den, dt(1.0)), mean)
    if ctx.bug == "loo_alone" and loo:  # a row alone at its coordinate takes its own value as baseline
        b = np.where((n == 0) & (alive > 0), x, b)
    return b.astype(F64)


def _coordinates(m, by_rank):
    """Each token's coordinate: its generated-token rank (``multi_turn``) or its position."""
    return np.cumsum(m, axis=1) - 1 if by_rank else np.broadcast_to(np.arange(m.shape[1]), m.shape)


def _aligned(x, m, coordinate):
    """``x`` moved to its tokens' coordinates, 0 where no token stands."""
    out = np.zeros(m.shape)
    rows, cols = np.nonzero(m)
    out[rows, coordinate[rows, cols]] = x[rows, cols]
    return out


def _unaligned(x, m, coordinate):
    out = np.zeros(m.shape)
    rows, cols = np.nonzero(m)
    out[rows, cols] = x[rows, coordinate[rows, cols]]
    return out


def _tail_start(lengths, counted, group, T):
    """The second-longest length of the group for its unique longest response, else ``T``."""
    start = np.full(len(lengths), T)
    for g in np.unique(group):
        rows = np.flatnonzero((group == g) & counted)
        ordered = np.sort(lengths[rows])[::-1]
        if len(rows) >= 2 and ordered[0] > ordered[1]:
            start[rows[lengths[rows] == ordered[0]]] = ordered[1]
    return start


def _std_scaled(ctx, adv, x, alive, group, applies, epsilon, eps_b):
    """``A / (σ_g + ε)``, σ_g the pooled within-coordinate unbiased std of the centred values ``x`` [B, P]."""
    sigma, spread = _sigma(ctx, x, alive, group)
    if ctx.bug == "zero_spread":
        spread = np.ones_like(spread)
    eps = eps_b if ctx.bug == "std_epsilon" else epsilon
    scaled = applies & spread[group] & (sigma[group] + eps > 0)
    return np.where(scaled[:, None], adv / np.where(scaled, sigma[group] + eps, 1.0)[:, None], adv)


def _sigma(ctx, x, alive, group):
    """``(σ [G], spread [G])``: pooled within coordinates, two-pass (or Welford's one pass)."""
    num_groups = group.max(initial=-1) + 1
    if ctx.bug == "std_pooled":  # not pooled within coordinates: every alive value of the group at one coordinate
        x, alive, group = x.reshape(-1, 1), alive.reshape(-1, 1), np.repeat(group, x.shape[1])
    dt = ctx.dt if ctx.bug == "precision_sigma" else F64
    x, alive = x.astype(dt), alive.astype(dt)
    n = np.zeros((num_groups, x.shape[1]), dt)
    np.add.at(n, group, alive)
    if ctx.order == "welford":
        squares = _welford(x, alive, group, num_groups)
    else:
        total = np.zeros_like(n)
        np.add.at(total, group, alive * x)
        mean = np.where(n > 0, total / np.maximum(n, dt(1.0)), dt(0.0))
        deviations = np.zeros_like(n)
        np.add.at(deviations, group, alive * (x - mean[group]) ** 2)
        squares = np.cumsum(deviations, axis=1)[:, -1] if ctx.bug == "precision_sigma" else deviations.sum(axis=1)
    dof = (n if ctx.bug == "std_unbiased" else np.maximum(n - 1, 0)).sum(axis=1)
    sigma = np.sqrt(np.where(dof > 0, squares / np.maximum(dof, 1), 0.0)).astype(F64)
    live = alive > 0
    high, low = np.full(n.shape, -np.inf), np.full(n.shape, np.inf)
    np.maximum.at(high, group, np.where(live, x, -np.inf))
    np.minimum.at(low, group, np.where(live, x, np.inf))
    return sigma, (high > low).any(axis=1)


def _welford(x, alive, group, num_groups):
    """Σ_p Σ_j (x_jp − x̄_gp)² by Welford's running update over the rows, per group and coordinate."""
    n = np.zeros((num_groups, x.shape[1]))
    mean, m2 = np.zeros_like(n), np.zeros_like(n)
    for row in range(len(x)):
        g, live = group[row], alive[row] > 0
        n[g] += live
        delta = np.where(live, x[row] - mean[g], 0.0)
        mean[g] += np.where(live, delta / np.maximum(n[g], 1.0), 0.0)
        m2[g] += np.where(live, delta * (x[row] - mean[g]), 0.0)
    return m2.sum(axis=1)


def pairwise(*args, **kwargs):
    """Correct, another order: ``v`` and the group sums by NumPy's pairwise summation."""
    return compute_advantages(*args, order="pairwise", **kwargs)


def direct(*args, **kwargs):
    """Correct, another order: leave-one-out sums formed over the others directly, not as total minus own."""
    return compute_advantages(*args, order="direct", **kwargs)


def welford(*args, **kwargs):
    """Correct, another order: σ's squared deviations by Welford's one-pass update."""
    return compute_advantages(*args, order="welford", **kwargs)
