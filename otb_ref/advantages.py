"""Advantage estimators: one family, two axes plus flags (THEORY.md §3, F7).

Every estimator subtracts a weighted group mean of the return:

    granularity "sequence":  b_i   = Σ_j v_j R_j     / (Σ_j v_j     + ε)
    granularity "token":     B_t^i = Σ_j W_t^j G_t^j / (Σ_j W_t^j   + ε)      (F7)

(``ε`` only for the energy-weighted rows of the table, proxy and exact; counts
divide exactly, so e.g. GRPO's baseline is the exact group mean)

where ``j`` runs over the responses of the same prompt (all of them, or all
but ``i`` with ``leave_one_out``), ``G_t = Σ_{k≥t} r_k`` is the return to go,
``R = G_1`` the total return, and at position ``t`` only responses alive there
(``m_t = 1``) count. The energy axis says what the weights are:

    =========  ==========================  ==================================
    energy     sequence weight ``v``        token weight ``W_t`` (cumulative)
    =========  ==========================  ==================================
    uniform    1 per response               1 per alive response
    length     Σ_t m_t (response length)    Σ_{j≤t} m_j
    proxy      Σ_t m_t w_t                  Σ_{j≤t} m_j w_j   (realized energy)
    exact      ||S||² (``grad_norms_sq``)   ||S_t||² (``cumulative_energy``)
    =========  ==========================  ==================================

with ``w_t = 1 − 2π_t(y_t) + Σ_v π_{t,v}²`` the logit-gradient proxy (F6),
multiplied by ``ρ̄_t²`` when rollout importance weights are given (§4).
Advantages are ``(R − b) m_t`` or ``(G_t − B_t) m_t``, optionally divided by
the group's reward standard deviation (GRPO). A group of one response gets no
baseline: its advantage is its return.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from otb_ref import _checks
from otb_ref.proxy import token_energy

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "compute_advantages",
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
]

GRANULARITIES = ("sequence", "token")
ENERGIES = ("uniform", "length", "proxy", "exact")

# Slack for Σπ² above 1: fp32 evaluation of an exact 1 may round up this much.
_SUM_PI_SQUARED_SLACK = 1e-6


@dataclass(frozen=True)
class Estimator:
    """One cell of the estimator table (THEORY §3) with its flags."""

    granularity: str
    energy: str
    leave_one_out: bool = False
    std_normalize: bool = False


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("sequence", "uniform", std_normalize=True),
    "rloo": Estimator("sequence", "uniform", leave_one_out=True),
    "opo": Estimator("sequence", "length"),
    "sequence_proxy": Estimator("sequence", "proxy"),
    "eob": Estimator("sequence", "exact"),
    "token_mean": Estimator("token", "uniform"),
    "token_length": Estimator("token", "length"),
    "otb": Estimator("token", "proxy"),
    "otb_exact": Estimator("token", "exact"),
}


class _Batch(NamedTuple):
    """Validated inputs, converted to the computation dtype; nothing aliases a caller's tensor that is written."""

    rewards: torch.Tensor  # [B, T] zero off the mask
    valid: torch.Tensor  # [B, T] bool
    group: torch.Tensor  # [B] int64 dense group numbers
    num_groups: int
    dtype: torch.dtype


# ---------------------------------------------------------------------------
# Segment (group) reductions: the whole vectorisation lives here.
# ---------------------------------------------------------------------------


def _segment_sum(values: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums: ``[B, *] -> [num_groups, *]``."""
    out = values.new_zeros((num_groups, *values.shape[1:]))
    return out.index_add_(0, group, values)


def _safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` where the denominator is positive, else 0."""
    positive = denominator > 0
    return torch.where(positive, numerator / torch.where(positive, denominator, 1.0), 0.0)


def _group_weighted_mean(
    values: torch.Tensor,
    weights: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    leave_one_out: bool,
    epsilon: float,
) -> torch.Tensor:
    """Baseline ``Σ_j w_j x_j / (Σ_j w_j + ε)`` over each row's group (F7).

    values, weights: ``[B]`` or ``[B, T]`` (weights zero where a row does not
    count). With ``leave_one_out`` the row's own term is removed from both sums.
    Returns the baseline for every row, shaped like ``values``.
    """
    weighted = weights * values  # [B, *]
    numerator = _segment_sum(weighted, group, num_groups)  # [G, *]
    denominator = _segment_sum(weights, group, num_groups)  # [G, *]
    if not leave_one_out:
        # One ratio per group, then one gather: [G, *] -> [B, *].
        return _safe_ratio(numerator, denominator + epsilon)[group]
    numerator = numerator[group] - weighted  # [B, *]
    denominator = denominator[group] - weights  # [B, *]
    return _safe_ratio(numerator, denominator + epsilon)


def _group_std(
    values: torch.Tensor, counted: torch.Tensor, group: torch.Tensor, num_groups: int, counts: torch.Tensor
) -> torch.Tensor:
    """Unbiased standard deviation of ``values [B]`` over each group's counted rows, gathered to ``[B]``."""
    mean = _segment_sum(torch.where(counted, values, 0.0), group, num_groups) / counts.clamp(min=1)  # [G]
    deviations = torch.where(counted, values - mean[group], 0.0)  # [B]
    squares = _segment_sum(deviations.square(), group, num_groups)  # [G]
    return (squares / (counts - 1).clamp(min=1)).sqrt()[group]


# ---------------------------------------------------------------------------
# Energies (the second axis of the table).
# ---------------------------------------------------------------------------


def _per_token_energy(energy: str, batch: _Batch, inputs: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """``w_t [B, T]``: 1 (length) or the proxy (F6), times ``ρ̄_t²``, zero off the mask."""
    if energy == "length":
        w = batch.valid.to(batch.dtype)
    else:  # proxy
        w = token_energy(inputs["old_log_probs"].to(batch.dtype), inputs["sum_pi_squared"].to(batch.dtype))
    if inputs["rollout_is_weights"] is not None:
        w = w * inputs["rollout_is_weights"].to(batch.dtype).square()
    return torch.where(batch.valid, w, 0.0)


def _sequence_weights(energy: str, batch: _Batch, inputs: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """Per-response weight ``v [B]`` of the sequence baseline."""
    if energy == "uniform":
        return torch.ones(batch.rewards.shape[0], dtype=batch.dtype, device=batch.rewards.device)
    if energy == "exact":
        return inputs["grad_norms_sq"].to(batch.dtype)
    return _per_token_energy(energy, batch, inputs).sum(dim=-1)


def _cumulative_weights(energy: str, batch: _Batch, inputs: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """Realized energy ``W_t [B, T]`` of the token baseline, zero off the mask."""
    if energy == "uniform":
        return batch.valid.to(batch.dtype)
    if energy == "exact":
        return torch.where(batch.valid, inputs["cumulative_energy"].to(batch.dtype), 0.0)
    return _per_token_energy(energy, batch, inputs).cumsum(dim=-1)


# ---------------------------------------------------------------------------
# Token-level pieces: alignment for multi-turn, the zero tail.
# ---------------------------------------------------------------------------


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``G_t = Σ_{k≥t} x_k`` along the last dim."""
    return x.flip(-1).cumsum(-1).flip(-1)


def _to_slots(values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Move each valid entry of ``values [B, T]`` to column ``slot`` (``T`` = discard)."""
    batch_size, length = values.shape
    out = values.new_zeros((batch_size, length + 1))
    return out.scatter_(1, slot, values)[:, :length]


def _zero_tail(
    baseline: torch.Tensor,
    lengths: torch.Tensor,
    counted: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Zero the baseline of a group's unique longest response past the second-longest length.

    baseline: ``[B, T]`` in slot coordinates; lengths: ``[B]`` valid-token
    counts; counted: ``[B]`` rows that take part in their group.
    """
    lengths = torch.where(counted, lengths, -1)
    longest = lengths.new_full((num_groups,), -1).scatter_reduce_(0, group, lengths, "amax")  # [G]
    is_longest = lengths == longest[group]  # [B] (uncounted rows have length -1)
    num_longest = _segment_sum(is_longest.long(), group, num_groups)  # [G]
    others = torch.where(is_longest, -1, lengths)
    second = others.new_full((num_groups,), -1).scatter_reduce_(0, group, others, "amax")  # [G]
    unique_longest = is_longest & (num_longest[group] == 1) & (counts[group] >= 2)  # [B]
    positions = torch.arange(baseline.shape[1], device=baseline.device)  # [T]
    tail = unique_longest[:, None] & (positions[None, :] >= second[group][:, None])  # [B, T]
    return baseline.masked_fill(tail, 0.0)


def _token_baseline(
    returns_to_go: torch.Tensor,
    cumulative_weights: torch.Tensor,
    batch: _Batch,
    counted: torch.Tensor,
    counts: torch.Tensor,
    leave_one_out: bool,
    multi_turn: bool,
    handle_zero_tail: bool,
    epsilon: float,
) -> torch.Tensor:
    """Per-position baseline ``B_t [B, T]`` (F7), on absolute or generated-token positions."""
    valid = batch.valid
    lengths = valid.sum(dim=-1)  # [B]
    if multi_turn:
        # Slot k holds a response's k-th generated (unmasked) token.
        slot = torch.where(valid, valid.cumsum(dim=-1) - 1, valid.shape[1])  # [B, T]
        returns_to_go = _to_slots(returns_to_go, slot)
        cumulative_weights = _to_slots(cumulative_weights, slot)
        positions = torch.arange(valid.shape[1], device=valid.device)
        valid = positions[None, :] < lengths[:, None]  # [B, T] alive in slot space
    weights = torch.where(valid, cumulative_weights, 0.0)  # [B, T]
    baseline = _group_weighted_mean(returns_to_go, weights, batch.group, batch.num_groups, leave_one_out, epsilon)
    baseline = baseline.masked_fill(~(counted & (counts[batch.group] >= 2))[:, None], 0.0)
    if handle_zero_tail:
        baseline = _zero_tail(baseline, lengths, counted, batch.group, batch.num_groups, counts)
    if multi_turn:
        baseline = baseline.gather(1, slot.clamp(max=valid.shape[1] - 1))
    return baseline


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


def _resolve_estimator(estimator: str | Estimator, leave_one_out: bool | None, std_normalize: bool | None) -> Estimator:
    if isinstance(estimator, Estimator):
        spec = estimator
        if spec.granularity not in GRANULARITIES:
            raise ValueError(f"estimator: granularity must be one of {GRANULARITIES}, got {spec.granularity!r}")
        if spec.energy not in ENERGIES:
            raise ValueError(f"estimator: energy must be one of {ENERGIES}, got {spec.energy!r}")
    elif isinstance(estimator, str) and estimator in ESTIMATORS:
        spec = ESTIMATORS[estimator]
    else:
        raise ValueError(f"estimator: unknown estimator {estimator!r}; choose one of {sorted(ESTIMATORS)}")
    if leave_one_out is not None:
        spec = replace(spec, leave_one_out=bool(leave_one_out))
    if std_normalize is not None:
        spec = replace(spec, std_normalize=bool(std_normalize))
    return spec


def _validate(
    spec: Estimator,
    token_level_rewards: Any,
    response_mask: Any,
    index: Any,
    inputs: dict[str, Any],
    multi_turn: bool,
    handle_zero_tail: bool,
    epsilon: Any,
) -> tuple[_Batch, float]:
    rewards = _checks.require_tensor("token_level_rewards", token_level_rewards)
    if rewards.dim() != 2:
        raise ValueError(f"token_level_rewards: expected shape [B, T], got {tuple(rewards.shape)}")
    if not (rewards.is_floating_point() or rewards.dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool)):
        raise ValueError(f"token_level_rewards: expected a real dtype, got {rewards.dtype}")
    shape, device = tuple(rewards.shape), rewards.device
    mask = _checks.require_tensor("response_mask", response_mask)
    _checks.require_shape("response_mask", mask, shape, "token_level_rewards")
    _checks.require_device("response_mask", mask, device, "token_level_rewards")
    valid = _checks.binary_mask("response_mask", mask)
    _checks.require_finite("token_level_rewards", rewards, where=valid)
    group, num_groups = _checks.group_ids(index, shape[0], device)

    token_inputs = ("old_log_probs", "sum_pi_squared", "rollout_is_weights", "cumulative_energy")
    for name in token_inputs:
        if inputs[name] is None:
            continue
        value = _checks.require_tensor(name, inputs[name])
        _checks.require_shape(name, value, shape, "token_level_rewards")
        _checks.require_device(name, value, device, "token_level_rewards")
        if not value.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {value.dtype}")
        _checks.require_finite(name, value, where=valid)
    if inputs["sum_pi_squared"] is not None:
        _checks.require_in_range(
            "sum_pi_squared", inputs["sum_pi_squared"], 0.0, 1.0 + _SUM_PI_SQUARED_SLACK,
            where=valid, low_inclusive=False, rule="Σπ² of a distribution lies in (0, 1]",
        )
    for name in ("rollout_is_weights", "cumulative_energy"):
        if inputs[name] is not None:
            _checks.require_in_range(name, inputs[name], 0.0, float("inf"), where=valid, rule="must be >= 0")
    if inputs["grad_norms_sq"] is not None:
        value = _checks.require_tensor("grad_norms_sq", inputs["grad_norms_sq"])
        _checks.require_shape("grad_norms_sq", value, shape[:1], "the batch size of token_level_rewards")
        _checks.require_device("grad_norms_sq", value, device, "token_level_rewards")
        if not value.is_floating_point():
            raise ValueError(f"grad_norms_sq: expected a floating dtype, got {value.dtype}")
        _checks.require_finite("grad_norms_sq", value)
        _checks.require_in_range("grad_norms_sq", value, 0.0, float("inf"), rule="squared norms are >= 0")

    required = {
        ("sequence", "proxy"): ("old_log_probs", "sum_pi_squared"),
        ("token", "proxy"): ("old_log_probs", "sum_pi_squared"),
        ("sequence", "exact"): ("grad_norms_sq",),
        ("token", "exact"): ("cumulative_energy",),
    }.get((spec.granularity, spec.energy), ())
    for name in required:
        if inputs[name] is None:
            raise ValueError(
                f"{name}: required by the {spec.granularity}-level {spec.energy!r}-energy estimator, but not given"
            )
    if inputs["rollout_is_weights"] is not None and spec.energy in ("uniform", "exact"):
        raise ValueError(
            f"rollout_is_weights: scales per-token energies (energy 'length' or 'proxy'); "
            f"this estimator's energy is {spec.energy!r}"
        )
    if spec.granularity == "sequence" and (multi_turn or handle_zero_tail):
        flag = "multi_turn" if multi_turn else "handle_zero_tail"
        raise ValueError(f"{flag}: applies to token-level estimators only; this estimator is sequence-level")
    eps = _checks.nonnegative_scalar("epsilon", epsilon)

    dtype = _checks.compute_dtype(
        rewards if rewards.is_floating_point() else None, *(inputs[name] for name in token_inputs + ("grad_norms_sq",))
    )
    masked_rewards = torch.where(valid, rewards.to(dtype), 0.0)  # fresh tensor: NaN off the mask is dropped
    return _Batch(masked_rewards, valid, group, num_groups, dtype), eps


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def compute_advantages(
    estimator: str | Estimator,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    *,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    grad_norms_sq: torch.Tensor | None = None,
    cumulative_energy: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    leave_one_out: bool | None = None,
    std_normalize: bool | None = None,
    multi_turn: bool = False,
    handle_zero_tail: bool = False,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of one estimator of the family (THEORY §3, F7).

    Args:
        estimator: a name of :data:`ESTIMATORS` (``"grpo"``, ``"rloo"``,
            ``"opo"``, ``"sequence_proxy"``, ``"eob"``, ``"token_mean"``,
            ``"token_length"``, ``"otb"``, ``"otb_exact"``) or an
            :class:`Estimator`.
        token_level_rewards: ``[B, T]`` rewards ``r_t`` (outcome reward: the
            reward at the last valid token, zeros elsewhere).
        response_mask: ``[B, T]`` 0/1 (any dtype); 1 marks tokens the policy
            generated. Holes (tool output inside a response) are allowed; a
            row of zeros (empty response) gets zero advantage. Values of any
            input where the mask is 0 are ignored, whatever they are.
        index: ``B`` prompt ids (1-D int tensor, numpy array, or list of
            hashable ids such as strings); equal ids form a group.
        old_log_probs: ``[B, T]`` log π_old(y_t) (energy ``proxy``).
        sum_pi_squared: ``[B, T]`` Σ_v π_old(v)² in (0, 1] (energy ``proxy``).
        grad_norms_sq: ``[B]`` ``||S||²`` per response (``eob``), e.g. from
            ``otb_ref.exact.sequence_grad_norms_sq``.
        cumulative_energy: ``[B, T]`` ``||S_t||²`` (``otb_exact``), e.g. from
            ``otb_ref.exact.prefix_grad_norms_sq``.
        rollout_is_weights: ``[B, T]`` truncated IS weights ``ρ̄_t ≥ 0``;
            per-token energies (``length``, ``proxy``) are multiplied by ``ρ̄_t²``.
        leave_one_out: build each response's baseline from the other
            responses only (unbiased, F7). Default: the estimator's
            (``True`` for ``"rloo"`` only).
        std_normalize: divide advantages by the group's (unbiased) reward
            standard deviation ``+ ε``. Default: the estimator's (``True`` for
            ``"grpo"`` only). Biases the estimator (F7).
        multi_turn: token-level only. Align responses by their k-th generated
            token instead of absolute position; rows with empty masks take no
            part in their group (as in the authors' multi-turn variant).
        handle_zero_tail: token-level only. In each group, zero the baseline
            of the unique longest response beyond the second-longest length
            (absolute positions, or generated-token positions with
            ``multi_turn``). Without it an include-self baseline there equals
            the response's own return.
        epsilon: ``ε ≥ 0`` added to the denominator of energy-weighted
            baselines (``proxy``, ``exact``) and to the standard deviation of
            ``std_normalize``. ``uniform`` and ``length`` weights are counts
            (or sums of ``ρ̄²``) and divide exactly. Where a denominator is 0
            (nothing to average) the baseline is 0.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, fp32 (fp64 if any input is
        fp64). ``returns`` is what the baseline is subtracted from: ``G_t``
        (token level; the reverse cumulative sum of masked rewards, so a hole
        holds the reward still to come) or ``R m_t`` (sequence level).
        ``advantages`` is zero wherever the mask is 0. Inputs are not modified.

    Raises:
        ValueError: naming the argument, for unknown estimators, missing
            inputs, wrong shapes or devices, non-binary masks, NaN/inf at
            valid positions, negative energies or IS weights, Σπ² outside
            (0, 1], ``index`` of the wrong length, flags that do not apply.
    """
    spec = _resolve_estimator(estimator, leave_one_out, std_normalize)
    inputs = {
        "old_log_probs": old_log_probs,
        "sum_pi_squared": sum_pi_squared,
        "grad_norms_sq": grad_norms_sq,
        "cumulative_energy": cumulative_energy,
        "rollout_is_weights": rollout_is_weights,
    }
    batch, eps = _validate(spec, token_level_rewards, response_mask, index, inputs, multi_turn, handle_zero_tail, epsilon)
    # Counts need no guard: only sums of energies can be tiny but positive.
    baseline_eps = eps if spec.energy in ("proxy", "exact") else 0.0
    with torch.no_grad():
        returns_to_go = _reverse_cumsum(batch.rewards)  # [B, T]
        # Rows that take part in their group, and each group's size.
        counted = batch.valid.any(dim=-1) if multi_turn else torch.ones_like(batch.group, dtype=torch.bool)
        counts = _segment_sum(counted.long(), batch.group, batch.num_groups)  # [G]
        total_return = returns_to_go[:, 0] if returns_to_go.shape[1] else batch.rewards.new_zeros(batch.rewards.shape[0])

        if spec.granularity == "sequence":
            weights = _sequence_weights(spec.energy, batch, inputs)  # [B]
            baseline = _group_weighted_mean(
                total_return, weights, batch.group, batch.num_groups, spec.leave_one_out, baseline_eps
            )
            baseline = torch.where(counts[batch.group] >= 2, baseline, 0.0)  # [B]
            returns = torch.where(batch.valid, total_return[:, None], 0.0)  # [B, T]
            advantages = returns - torch.where(batch.valid, baseline[:, None], 0.0)
        else:
            cumulative = _cumulative_weights(spec.energy, batch, inputs)  # [B, T]
            baseline = _token_baseline(
                returns_to_go, cumulative, batch, counted, counts,
                spec.leave_one_out, multi_turn, handle_zero_tail, baseline_eps,
            )  # [B, T]
            returns = returns_to_go
            advantages = torch.where(batch.valid, returns_to_go - baseline, 0.0)

        if spec.std_normalize:
            std = _group_std(total_return, counted, batch.group, batch.num_groups, counts)  # [B]
            scale = torch.where(counts[batch.group] >= 2, 1.0 / (std + eps), 1.0)
            advantages = advantages * scale[:, None]
    return advantages, returns


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB advantages with the argument names, order, defaults and outputs of verl.

    ``B_t = Σ_j W_t^j G_t^j / (Σ_j W_t^j + ε)`` over each prompt's group
    (self included), ``W_t = Σ_{j≤t} m_j ρ̄_j² (1 − 2π_j + Σπ_j²)`` (F5, F6,
    §4). Shapes ``[B, T]``; see :func:`compute_advantages` (``"otb"``).
    Returns ``(advantages, returns)``.
    """
    return compute_advantages(
        "otb", token_level_rewards, response_mask, index,
        old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights, handle_zero_tail=handle_zero_tail, epsilon=epsilon,
    )


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn OTB with verl's interface: positions are generated-token ranks.

    Tool-output tokens are holes in ``response_mask``; the k-th generated
    token of each response is compared with the k-th of the others (§4).
    See :func:`compute_advantages` (``"otb"``, ``multi_turn=True``).
    """
    return compute_advantages(
        "otb", token_level_rewards, response_mask, index,
        old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights, multi_turn=True,
        handle_zero_tail=handle_zero_tail, epsilon=epsilon,
    )
