"""The estimator family in plain vectorised torch: the form to read, and to port (THEORY §3, F7).

:func:`otb_ref.compute_advantages` computes exactly these numbers: it checks shapes, devices and dtypes once,
then runs a blocked, fused path (``otb_ref.advantages``) that checks each block's values as it reads them (the
checks are ``otb_ref._validation``'s). This module states the same maths with no blocking, no validation and no
speed tricks, and shares no code with the fast path but the table (``otb_ref.estimators``) and F6's per-token
energy (``otb_ref.proxy.token_energy``); a hypothesis test checks that the two agree everywhere the strategies
reach, and both are tested against the NumPy loops of ``conformance/ports/numpy_port.py``.

Estimator names and their cells (granularity × energy, flags) are the one table
:data:`otb_ref.estimators.ESTIMATORS`; :mod:`otb_ref.exact` takes its population baselines' energies from
:func:`energies` below.

Notation (THEORY §1): B responses, T positions; ``m_t`` the response mask (holes allowed); rewards ``r_t``;
``G_t = Σ_{k ≥ t} m_k r_k`` the return-to-go and ``R = G_0`` the return. Groups are the responses of one
prompt.

* Energies. Per-token energy ``w_t`` (``length``: 1; ``proxy``: ``1 − 2π(y_t) + Σπ²``), times ``ρ̄_t²`` with IS
  weights. Sequence weight ``v = Σ_t m_t w_t`` (``uniform``: 1; ``exact``: ``‖S‖²``). Realized energy
  ``W_t = Σ_{j ≤ t} m_j w_j`` (``uniform``: 1; ``exact``: ``‖S_t‖²``, the caller's ``cumulative_energy``).
* Sequence baselines: ``b_i = (Σ_{j ∈ g} v_j R_j + ε R̄) / (Σ_{j ∈ g} v_j + ε)`` with ``R̄`` the members' plain
  mean, then ``A_it = (R_i − b_i) m_it``.
* Token baselines: ``B_it = (Σ_{j ∈ g} m_jt W_jt G_jt + ε Ḡ_t) / (Σ_{j ∈ g} m_jt W_jt + ε)`` with ``Ḡ_t`` the plain
  mean of the members alive at t, then ``A_it = (G_it − B_it) m_it``.
* Every baseline is a convex combination of its members' values (ε is shared among them): ``|G − B|`` never
  exceeds the members' spread, whatever the energies (:func:`group_baseline`). Where the denominator is 0 it is
  the plain mean.
* Leave-one-out: the sums over ``g`` skip ``j = i`` (unbiased, F7). No baseline (0): groups of one, a
  leave-one-out row with no other member alive at its position, and the zero tail below.
* Std scaling (GRPO): ``A ← A / (σ_g + ε)`` with ``σ_g`` the group's unbiased std of what its baseline centres
  (:func:`group_std`): ``R`` for sequence cells, ``G_t`` pooled within positions for token cells (THEORY §3).
  A group whose centred values do not differ (zero spread) is left unscaled.
* ``ε`` (the baseline's) applies to energy-weighted baselines (``proxy``, ``exact``) only; counts divide exactly.
* Precision: stated once per function, where it is applied (where :func:`advantages` and :func:`otb_advantages`
  choose the compute dtype).
* Energies: ``w_t`` is clamped into [0, 2] (:func:`otb_ref.proxy.token_energy`).
* Empty responses (``m ≡ 0``) count as members of their group (with ``R = 0``), except with multi-turn.
* Multi-turn: positions are generated-token ranks ``k`` (the k-th token with ``m = 1``) instead of ``t``;
  empty responses take no part in their group.
* Zero tail: the unique longest response of a group (length = number of tokens with ``m = 1``) gets baseline
  0 at positions ``≥`` the second-longest length: ranks with multi-turn, absolute positions without (as in
  verl; with holes and no multi-turn, lengths and positions then differ).

Where each rule is applied in :func:`advantages` (one place each; ``tests/test_otb_ref/test_independence.py``
checks that the names exist; :func:`otb_advantages` states OTB's rules in its own lines):

    per-token energy w_t, the clamp, ρ̄_t²; v, W_t    energies (token_energy: F6's one definition)
    G_t (from the end), R                            returns_to_go, advantages
    values off the mask ignored                      advantages
    the baseline, ε shared, Ḡ, leave-one-out         group_baseline
    ε only for energies                              advantages (Estimator.epsilon_applies)
    a group of one: no baseline                      sequence_advantages, token_advantages (_group_size)
    std scaling, zero spread                         group_std, std_scaled
    multi-turn ranks                                 generated_token_rank, to_slots
    zero tail                                        _zero_tail_start
    precision                                        advantages (where dt is chosen)

Values off the mask are ignored, whatever they are (NaN included). Leave-one-out sums are "group total minus
own term" in fp64, as in the fast path: when the others' weights are below ~1e-16 of a row's own and ε = 0, that
difference is rounding (computing ``Σ_{j ≠ i}`` directly, as :func:`otb_advantages` does, gives other numbers
there); with ε > 0 the error in B is at most ~1e-16 × (own weight) / ε of the members' values. Combinations that
``compute_advantages`` rejects (``multi_turn`` or ``handle_zero_tail`` on sequence estimators, IS weights with
``uniform`` or ``exact`` energy) are undefined here: this module does not validate.
"""

from __future__ import annotations

import torch

from otb_ref.estimators import Estimator, resolve_estimator
from otb_ref.proxy import token_energy

__all__ = [
    "otb_advantages",
    "returns_to_go",
    "generated_token_rank",
    "to_slots",
    "energies",
    "group_baseline",
    "sequence_advantages",
    "token_advantages",
    "group_std",
    "std_scaled",
    "advantages",
]


def otb_advantages(rewards, mask, index, old_log_probs, sum_pi_squared, leave_one_out=False, epsilon=1e-8):
    """The Optimal Token Baseline with the logit-gradient proxy, self-contained: advantages [B, T].

        w_t = clamp(1 − 2 π(y_t) + Σ_v π_v², 0, 2)          per-token energy (F6; π(y_t) = exp(old_log_probs))
        W_t = Σ_{j ≤ t} m_j w_j                             realized energy up to token t
        G_t = Σ_{k ≥ t} m_k r_k                             return to go
        Ḡ_t = Σ_{j ∈ g} m_jt G_jt / Σ_{j ∈ g} m_jt           plain mean of the members alive at t
        B_t = (Σ_{j ∈ g} m_jt W_jt G_jt + ε Ḡ_t) / (Σ_{j ∈ g} m_jt W_jt + ε)   per-position baseline (F5, THEORY §3)
        A_t = (G_t − B_t) m_t

    ``g`` is the responses with the same ``index`` (the same prompt), or the others with ``leave_one_out``
    (unbiased, F7). Every rule that decides a number, each in its own line below:

    * clamp: ``w_t`` is clamped into [0, 2], where it lies when log π and Σπ² come from one distribution; the
      clamp removes rounding (a confident token cancels to ± a few ulps) and inputs from different distributions.
    * ε: shared among the members (weight ``ε/n`` each beside ``m W``), so ``B_t`` is a convex combination of
      the members' ``G_t``: ``|G_t − B_t|`` never exceeds their spread, whatever the energies; where every energy
      is 0, ``B_t = Ḡ_t``; where the denominator is 0 (ε = 0, no energy), ``B_t = Ḡ_t`` too.
    * no baseline (``B_t = 0``): a group of one response; a leave-one-out row with no other member alive at t.
    * precision: ``w`` in the compute dtype (fp64 if any value input is fp64, else fp32); from there on fp64 (``W``,
      ``G`` summed from the end, the group sums, ``Ḡ``, ``B``, ``G − B``); the advantage rounded to the compute
      dtype once, at the end.

    rewards, mask, old_log_probs, sum_pi_squared: [B, T]; index: [B] prompt ids. Equal to ``compute_advantages("otb",
    ...)`` (tests/test_otb_ref/test_readable.py); :func:`advantages` adds the other estimators and options.
    """
    fp64 = torch.float64 in (rewards.dtype, old_log_probs.dtype, sum_pi_squared.dtype)
    dt = torch.float64 if fp64 else torch.float32  # the compute dtype
    m = (mask != 0).to(dt)  # values off the mask are ignored, whatever they are
    r = torch.where(m > 0, rewards.to(dt), 0.0)
    w = torch.where(m > 0, (1 - 2 * old_log_probs.to(dt).exp() + sum_pi_squared.to(dt)).clamp(0.0, 2.0), 0.0)  # w_t
    W = w.double().cumsum(dim=-1)  # W_t, carried through holes; from here on fp64
    G = r.double().flip(-1).cumsum(dim=-1).flip(-1)  # G_t, summed from the end
    ids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    same = torch.tensor([[a == b for b in ids] for a in ids], dtype=torch.float64, device=m.device)  # [B, B]
    members = same - torch.eye(len(ids), dtype=torch.float64, device=m.device) if leave_one_out else same
    alive, a, x = m.double(), m.double() * W, G
    n, num, den = members @ alive, members @ (a * x), members @ a + epsilon  # at each t: n, Σ m W G, Σ m W + ε
    mean = torch.where(n > 0, (members @ (alive * x)) / n.clamp(min=1), 0.0)  # Ḡ_t (0 where no member)
    baseline = torch.where(den > 0, (num + epsilon * mean) / torch.where(den > 0, den, 1.0), mean)  # B_t
    baseline = torch.where(same.sum(dim=1, keepdim=True) >= 2, baseline, 0.0)  # a group of one: no baseline
    return ((x - baseline) * alive).to(dt)


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``G_t = Σ_{k ≥ t} m_k r_k``. rewards, mask: [B, T]. Returns [B, T]."""
    return (rewards * mask).flip(-1).cumsum(-1).flip(-1)


def energies(
    spec: Estimator,
    mask,
    old_log_probs=None,
    sum_pi_squared=None,
    grad_norms_sq=None,
    cumulative_energy=None,
    rollout_is_weights=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v [B], W [B, T])``: each response's sequence weight and its realized energy at every position.

    Inputs are zero off the mask (see :func:`advantages`). ``W`` is not masked: it carries through holes and past
    the end (``length``, ``proxy``), is 1 everywhere (``uniform``), or is the caller's ``cumulative_energy``
    (``exact``); callers weight by ``m_t W_t``. ``w`` is computed in the inputs' dtype, ``v`` and ``W`` in fp64."""
    if spec.energy == "uniform":
        return mask.new_ones(mask.shape[0]).double(), torch.ones_like(mask).double()
    if spec.energy == "exact":
        return tuple(None if x is None else x.double() for x in (grad_norms_sq, cumulative_energy))
    w = torch.ones_like(mask) if spec.energy == "length" else token_energy(old_log_probs, sum_pi_squared)  # [B, T]
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.square()
    w = (w * mask).double()
    return w.sum(dim=-1), w.cumsum(dim=-1)  # v = Σ_t w_t, W_t = Σ_{j ≤ t} w_j


def group_baseline(weights, alive, values, group, leave_one_out: bool, epsilon: float, num_groups=None) -> torch.Tensor:
    """Each row's baseline in fp64: a convex combination of its group's members' values (THEORY §3),

        B = (Σ_j a_j x_j + ε x̄) / (Σ_j a_j + ε),   x̄ = Σ_j x_j / n   (B = x̄ where the denominator is 0),

    over the n members j (rows ``alive`` there, of the same group; ``j ≠ i`` with leave-one-out), with energy weights
    ``a_j ≥ 0`` and ε shared among them; 0 where there is no member. Leave-one-out sums are "group total minus own
    term" in fp64 (as in the fast path). weights, alive, values: [B, ...], alive 0/1; group: [B] ids in [0, G);
    ``num_groups``: G when the caller knows it (no host read)."""
    if num_groups is None:
        num_groups = int(group.max()) + 1 if group.numel() else 0
    a, x, alive = weights.double(), values.double(), alive.double()

    def sums(y):  # Σ over each row's members, [B, ...]
        total = y.new_zeros(num_groups, *y.shape[1:]).index_add_(0, group, y)[group]
        return total - y if leave_one_out else total

    n, num, den = sums(alive), sums(a * x), sums(a) + epsilon
    mean = torch.where(n > 0, sums(alive * x) / n.clamp(min=1), 0.0)  # x̄, 0 where no member
    return torch.where(den > 0, (num + epsilon * mean) / torch.where(den > 0, den, 1.0), mean)


def sequence_advantages(R, v, mask, group, counted, leave_one_out: bool, epsilon: float) -> torch.Tensor:
    """``A_it = (R_i − b_i) m_it`` (fp64) with ``b_i`` the v-weighted group mean of R (:func:`group_baseline`).
    R, v, group: [B]; counted: [B] 0/1 float; mask: [B, T]. Rows not ``counted`` neither contribute nor get a
    baseline."""
    b = group_baseline(v * counted, counted, R, group, leave_one_out, epsilon)  # [B] fp64
    b = torch.where(_group_size(group, counted) >= 2, b, 0.0) * counted
    return (R.double() - b)[:, None] * mask.double()


def token_advantages(
    G, W, mask, group, counted, leave_one_out: bool, epsilon: float, tail_start: torch.Tensor | None = None
) -> torch.Tensor:
    """``A_it = (G_it − B_it) m_it`` (fp64) with ``B_it`` the ``m W``-weighted group mean of ``G`` at position t
    (:func:`group_baseline` over the rows alive at t).
    G, W, mask: [B, T] (already aligned: multi-turn callers pass rank-aligned slots); group: [B]; counted: [B]
    0/1 float. ``tail_start`` [B]: the baseline is 0 at positions ``≥`` it (``T`` for no zero tail)."""
    alive = mask * counted[:, None]  # [B, T]: only tokens that exist take part
    b = group_baseline(W * alive, alive, G, group, leave_one_out, epsilon)  # [B, T] fp64
    b = torch.where((_group_size(group, counted) >= 2)[:, None], b, 0.0) * counted[:, None]
    if tail_start is not None:
        b = torch.where(torch.arange(G.shape[1], device=G.device) >= tail_start[:, None], 0.0, b)
    return (G.double() - b) * mask.double()


def _group_size(group, counted) -> torch.Tensor:
    """Number of counted rows in each row's group, [B]."""
    num_groups = int(group.max()) + 1 if group.numel() else 0
    return counted.new_zeros(num_groups).index_add_(0, group, counted)[group]


def _zero_tail_start(lengths, group, counted, T: int) -> torch.Tensor:
    """Second-longest length of the group for the unique longest row of each group; ``T`` (no tail) else."""
    start = torch.full_like(lengths, T)
    for g in group.unique():
        rows = ((group == g) & counted.bool()).nonzero().flatten()
        if rows.numel() < 2:
            continue
        ordered = lengths[rows].sort(descending=True).values
        if ordered[0] > ordered[1]:  # a unique longest response
            start[rows[lengths[rows] == ordered[0]]] = ordered[1]
    return start


def generated_token_rank(mask: torch.Tensor) -> torch.Tensor:
    """``slot[i, t]``: the rank k of token t among row i's generated tokens (T for positions off the mask)."""
    rank = mask.long().cumsum(dim=-1) - 1
    return torch.where(mask.bool(), rank, mask.shape[1])


def to_slots(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Move ``x[i, t]`` to column ``slot[i, t]`` of a ``[B, T + 1]`` buffer, drop the last (discard) column."""
    return x.new_zeros(x.shape[0], x.shape[1] + 1).scatter_(1, slot, x)[:, :-1]


def advantages(
    estimator,
    rewards,
    mask,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` [B, T] of any estimator: the readable twin of ``compute_advantages``.

    Precision: the rule where the compute dtype ``dt`` is chosen, below. In fp64 this equals the fast path up to
    summation order (~1e-15 relative); in fp32 up to torch's chunked fp32 ``exp`` (π(y) one ulp apart between a block
    and the whole tensor): within 4 fp32 ulps of the returns' scale, times std scaling's amplification
    (tests/test_otb_ref/test_readable.py::test_readable_equals_fast_path_in_fp32)."""
    spec = resolve_estimator(estimator, leave_one_out, std_normalize)  # the table's cell, flags overridden
    tensors = dict(
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        cumulative_energy=cumulative_energy,
        rollout_is_weights=rollout_is_weights,
    )
    floating = [x for x in (rewards, grad_norms_sq, *tensors.values()) if x is not None and x.is_floating_point()]
    # Precision rule: per-token energies w in the compute dtype dt (fp64 if any floating value input is fp64, else
    # fp32; the mask's dtype does not matter); from there on fp64 (W, v, G summed from the end, R = G_0, group sums,
    # baselines, σ, G − B); advantages and returns rounded to dt once, on the last line.
    dt = torch.float64 if any(x.dtype == torch.float64 for x in floating) else torch.float32
    valid = mask != 0
    rewards, mask = torch.where(valid, rewards.to(dt), 0.0), valid.to(dt)  # whatever stood off the mask: 0
    tensors = {name: None if x is None else torch.where(valid, x.to(dt), 0.0) for name, x in tensors.items()}
    grad_norms_sq = None if grad_norms_sq is None else grad_norms_sq.to(dt)
    ids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    first_seen = {key: g for g, key in enumerate(dict.fromkeys(ids))}
    group = torch.tensor([first_seen[key] for key in ids], dtype=torch.long, device=mask.device)  # [B] in [0, G)
    baseline_epsilon = epsilon if spec.epsilon_applies else 0.0  # counts divide exactly
    lengths = mask.sum(dim=-1).long()  # [B]
    counted = (lengths > 0).to(dt) if multi_turn else rewards.new_ones(rewards.shape[0])  # [B] 0/1
    v, W = energies(spec, mask, grad_norms_sq=grad_norms_sq, **tensors)  # fp64
    G = returns_to_go(rewards.double(), mask.double())  # [B, T] fp64, summed from the end
    R = G[:, 0] if mask.shape[1] else G.new_zeros(mask.shape[0])
    if spec.granularity == "sequence":
        adv = sequence_advantages(R, v, mask, group, counted, spec.leave_one_out, baseline_epsilon)  # fp64
        ret = R[:, None] * mask
        centred, alive = R[:, None], counted[:, None]  # what the baseline centres: R, one value per row
    else:
        tail = _zero_tail_start(lengths, group, counted, mask.shape[1]) if handle_zero_tail else None
        centred, alive = G, mask * counted[:, None]
        if multi_turn:  # align by generated-token rank: slot k holds each row's k-th token
            slot = generated_token_rank(mask)  # [B, T]; T (one extra, discarded column) off the mask
            aligned = [to_slots(x, slot) for x in (G, W, mask)]
            adv_slots = token_advantages(*aligned, group, counted, spec.leave_one_out, baseline_epsilon, tail)
            adv = adv_slots.gather(1, slot.clamp(max=mask.shape[1] - 1)) * mask.double()
            centred, alive = aligned[0], aligned[2] * counted[:, None]
        else:
            adv = token_advantages(G, W, mask, group, counted, spec.leave_one_out, baseline_epsilon, tail)
        ret = G
    if spec.std_normalize:
        adv = std_scaled(adv, centred.double(), alive.double(), group, counted.double(), epsilon)
    return adv.to(dt), ret.to(dt)  # fp64 until here; rounded to the compute dtype once


def group_std(values, alive, group, num_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(σ, spread)``, both [B]: each row's group's pooled within-position unbiased std of ``values``, and
    whether the group's alive values differ at some position. values: [B, P]; alive: [B, P] 0/1; group: [B].

        σ_g² = Σ_p Σ_{j ∈ g} a_jp (x_jp − x̄_gp)² / Σ_p (n_gp − 1)₊,   n_gp = Σ_{j ∈ g} a_jp,

    with ``x̄_gp`` the mean of the alive values at p. P = 1 (``x = R``, every counted row alive) is GRPO's std of
    the returns. Token cells pass ``x = G_t`` (THEORY §3): with outcome reward and equal lengths every position
    repeats ``R`` and σ is GRPO's. σ = 0 where no position has two alive rows. ``spread`` is decided exactly
    (max > min), not from σ, which rounding can leave at ~1e-16 for equal values. ``num_groups``: G when the
    caller knows it (no host read)."""
    if num_groups is None:
        num_groups = int(group.max()) + 1 if group.numel() else 0
    sums = lambda x: x.new_zeros(num_groups, *x.shape[1:]).index_add_(0, group, x)  # noqa: E731  [G, P]
    n = sums(alive)
    mean = torch.where(n > 0, sums(alive * values) / n.clamp(min=1), 0.0)  # x̄_gp
    squared_deviations = sums(alive * (values - mean[group]).square()).sum(-1)  # [G]
    dof = (n - 1).clamp(min=0).sum(-1)  # [G]
    sd = torch.where(dof > 0, squared_deviations / dof.clamp(min=1), 0.0).sqrt()
    live, rows = alive > 0, group[:, None].expand_as(values)
    extreme = lambda fill, how: values.new_full(n.shape, fill).scatter_reduce_(  # noqa: E731  [G, P]
        0, rows, torch.where(live, values, fill), how
    )
    return sd[group], (extreme(-torch.inf, "amax") > extreme(torch.inf, "amin")).any(-1)[group]


def std_scaled(adv, centred, alive, group, counted, epsilon: float) -> torch.Tensor:
    """GRPO's ``A / (σ_g + ε)`` with σ_g = :func:`group_std` of the ``centred`` values (``R`` [B, 1] or ``G_t``
    [B, T]) over their ``alive`` entries. Unchanged: rows not counted, groups of one, and groups with zero spread
    (their centred values are equal, so ``A`` is 0 up to rounding; dividing that by ε would amplify it by 1/ε).
    Every baseline is a convex combination of alive values at its position, so ``|A| ≤ √(2 D_g)`` after scaling
    (proofs/F7, remark "What σ is"). adv: [B, T]; group, counted: [B]."""
    sd, spread = group_std(centred, alive, group)
    sd = sd + epsilon
    scale = torch.where(sd > 0, 1.0 / torch.where(sd > 0, sd, 1.0), 1.0)  # 1/(σ + ε)
    applies = (_group_size(group, counted) >= 2) & (counted > 0) & spread  # [B]
    return torch.where(applies[:, None], adv * scale[:, None], adv)
