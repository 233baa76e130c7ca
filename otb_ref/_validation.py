"""The input rules of :func:`otb_ref.compute_advantages`: every check, and every error it raises, lives here.

Two kinds of checks, with ``_checks``' primitives (messages that start with the argument's name):

* :func:`validate`, once per call: everything that is not a value (types, shapes, devices, dtypes, which inputs
  the estimator needs and which flags apply, ``index``, ``epsilon``), ``grad_norms_sq`` (``[B]``, one host read),
  and the compute dtype.
* :func:`check_block`, once per block the fast path reads: the values of the block's rows (0/1 mask; finite and in
  range where the mask is 1). The fast path calls it on each block of whole groups just before its arithmetic on
  the same rows, so the check's min/max reductions and the formula read a block that sits in cache (the CPU blocks
  hold ~2^17 elements): one pass over the inputs, not a validation pass and then a compute pass.

This module does no arithmetic on values beyond range checks (min, max, comparisons, the mask's ``Σ frac(m)``);
it never modifies an input.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from otb_ref import _checks
from otb_ref.estimators import Estimator

__all__ = ["Inputs", "BlockRead", "validate", "check_block"]

# Slack for Σπ² above 1 and log-probabilities above 0: rounding of an exact 1 or 0.
_SUM_PI_SQUARED_SLACK = 1e-6
_LOG_PROB_SLACK = 1e-6

# The [B, T] inputs besides rewards and mask, in the order their errors are reported.
_TOKEN_INPUTS = ("old_log_probs", "sum_pi_squared", "rollout_is_weights", "cumulative_energy")


class Inputs(NamedTuple):
    """The caller's tensors after the checks of everything but their values; never written to."""

    rewards: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T]
    old_log_probs: torch.Tensor | None  # [B, T]
    sum_pi_squared: torch.Tensor | None  # [B, T]
    rollout_is_weights: torch.Tensor | None  # [B, T]
    cumulative_energy: torch.Tensor | None  # [B, T]
    grad_norms_sq: torch.Tensor | None  # [B], values checked
    group: torch.Tensor  # [B] int64 dense group numbers
    num_groups: int
    dtype: torch.dtype  # the compute dtype (_checks.compute_dtype of the value inputs)
    epsilon: float  # checked: finite, >= 0


class BlockRead(NamedTuple):
    """One block's rows of the value inputs, checked, in the inputs' own dtypes (not yet converted or masked)."""

    mask: torch.Tensor  # [b, T] the caller's mask rows (0/1, any dtype)
    values: dict[str, torch.Tensor]  # name -> [b, T] rows of each value input the estimator reads
    clean: dict[str, bool]  # name -> every entry of the block (on the mask or off it) finite and in range
    valid: torch.Tensor | None  # mask != 0 [b, T] when some input was not clean, else None


class _Range(NamedTuple):
    """Valid values of an input: ``low <(=) v <= high`` and finite."""

    low: float = -math.inf
    high: float = math.inf
    low_inclusive: bool = False
    rule: str = ""

    def holds(self, bounds: list[float]) -> bool:
        """True when the ``[min, max]`` of some values lies in the range (NaN in either fails)."""
        lo, hi = bounds
        above_low = lo >= self.low if self.low_inclusive else lo > self.low
        return above_low and hi <= self.high and math.isfinite(lo) and math.isfinite(hi)


# A value inside each input's range: round 2 of the checks puts it off the mask, so that the min and max
# of the result concern the valid entries alone.
_FILL = {
    "token_level_rewards": 0.0,
    "old_log_probs": 0.0,
    "sum_pi_squared": 1.0,
    "cumulative_energy": 0.0,
    "rollout_is_weights": 0.0,
}


def _value_inputs(spec: Estimator, inputs: Inputs) -> list[tuple[str, torch.Tensor]]:
    """The ``[B, T]`` value inputs this estimator reads, in the order their errors are reported."""
    named = [("token_level_rewards", inputs.rewards)]
    named += [(name, getattr(inputs, name)) for name in spec.inputs if name in _TOKEN_INPUTS]
    if spec.per_token_energy and inputs.rollout_is_weights is not None:
        named.append(("rollout_is_weights", inputs.rollout_is_weights))
    return named


def _value_range(name: str, inputs: Inputs) -> _Range:
    if name == "old_log_probs":
        return _Range(high=_LOG_PROB_SLACK, rule="a log-probability is <= 0")
    if name == "sum_pi_squared":
        return _Range(low=0.0, high=1.0 + _SUM_PI_SQUARED_SLACK, rule="Σπ² of a distribution lies in (0, 1]")
    if name == "cumulative_energy":
        return _Range(low=0.0, low_inclusive=True, rule="must be >= 0")
    if name == "rollout_is_weights":
        # ρ̄² times an energy <= 2, summed over every token of the batch, must stay finite in dtype.
        batch_size, length = inputs.rewards.shape
        rho_max = math.sqrt(torch.finfo(inputs.dtype).max / (4.0 * max(batch_size * length, 1)))
        rule = f"must be >= 0, and <= {rho_max:.3g} so that ρ̄² sums stay finite in {inputs.dtype}"
        return _Range(0.0, rho_max, True, rule)
    return _Range()


def _host_read(stats: list[torch.Tensor]) -> list[float]:
    """Every statistic (0-d tensors, any dtypes) in ONE device-to-host transfer: the only sync of a check round."""
    return torch.stack(stats).tolist() if stats else []


def _mask_stats(raw_mask: torch.Tensor) -> list[torch.Tensor]:
    """``[min, max, Σ frac(m)]`` of a non-bool mask, in its own dtype (ints as float64); ``[]`` for bool."""
    if raw_mask.dtype == torch.bool or not raw_mask.numel():
        return []
    as_float = raw_mask if raw_mask.is_floating_point() else raw_mask.double()
    return [*torch.aminmax(as_float), torch.sum(torch.frac(as_float))]


def _mask_is_binary(stats: list[float]) -> bool:
    """Binary iff every entry lies in [0, 1] and Σ frac(m) = 0 (on [0, 1] each term is >= 0, and 0 only at 0
    and 1; a sum of terms >= 0 is 0 only if every term is)."""
    return _Range(0.0, 1.0, low_inclusive=True).holds(stats[:2]) and stats[2] == 0.0


def _raise_if_invalid(name: str, full: torch.Tensor, value_range: _Range, where: torch.Tensor | None) -> None:
    """Locate a bad entry of ``full`` (among those ``where`` marks valid, if given) and raise naming it."""
    _checks.require_finite(name, full, where=where)
    _checks.require_in_range(
        name,
        full,
        value_range.low,
        value_range.high,
        where=where,
        low_inclusive=value_range.low_inclusive,
        rule=value_range.rule,
    )


def check_block(spec: Estimator, inputs: Inputs, rows: slice | torch.Tensor) -> BlockRead:
    """Read the block ``rows`` of every value input the estimator uses and check it, with ONE host read in the
    common case; raises ValueError naming the input (and the entry's index in the whole batch) if one is bad.

    Round 1 reduces the mask's binary test and the min and max of every input over all the block's entries and
    reads them in one transfer. An input whose block is "clean" (every entry, on the mask or off it, in range) is
    done. Round 2, only for inputs with something out of range somewhere (allowed off the mask: it is ignored),
    checks their valid entries (one more transfer) and raises if one is bad.
    """
    raw_mask = inputs.mask[rows]
    reads = [(name, full, full[rows]) for name, full in _value_inputs(spec, inputs)]
    mask_stats = _mask_stats(raw_mask)
    values = _host_read(mask_stats + [stat for _, _, raw in reads if raw.numel() for stat in torch.aminmax(raw)])
    if mask_stats and not _mask_is_binary(values[:3]):
        _checks.binary_mask("response_mask", inputs.mask)  # raises with the offending value
    values, clean = values[len(mask_stats) :], {}
    for name, _, raw in reads:
        clean[name] = not raw.numel() or _value_range(name, inputs).holds(values[:2])
        values = values[2 if raw.numel() else 0 :]
    block = {name: raw for name, _, raw in reads}
    if all(clean.values()):
        return BlockRead(raw_mask, block, clean, None)
    valid = raw_mask != 0
    unclean = [(name, full, raw) for name, full, raw in reads if not clean[name]]
    # Off the mask each input is replaced by a fill inside its range: min and max then concern the valid entries.
    filled = [torch.where(valid, raw, _FILL[name]) for name, _, raw in unclean]
    values = _host_read([stat for tensor in filled for stat in torch.aminmax(tensor)])
    for i, (name, full, _) in enumerate(unclean):
        if not _value_range(name, inputs).holds(values[2 * i : 2 * i + 2]):
            where = torch.zeros(full.shape, dtype=torch.bool, device=full.device)
            where[rows] = valid
            _raise_if_invalid(name, full, _value_range(name, inputs), where)
    return BlockRead(raw_mask, block, clean, valid)


def _check_grad_norms(value: Any, shape: tuple[int, ...], device: torch.device) -> None:
    """``grad_norms_sq`` [B]: a floating tensor, finite and >= 0 (decided with one host read)."""
    value = _checks.require_tensor("grad_norms_sq", value)
    _checks.require_shape("grad_norms_sq", value, shape[:1], "the batch size of token_level_rewards")
    _checks.require_device("grad_norms_sq", value, device, "token_level_rewards")
    if not value.is_floating_point():
        raise ValueError(f"grad_norms_sq: expected a floating dtype, got {value.dtype}")
    norms_range = _Range(0.0, math.inf, low_inclusive=True, rule="squared norms are >= 0")
    if value.numel() and not norms_range.holds(_host_read(list(torch.aminmax(value)))):
        _raise_if_invalid("grad_norms_sq", value, norms_range, None)


def _check_applies(spec: Estimator, named: dict[str, Any], multi_turn: bool, handle_zero_tail: bool) -> None:
    """The estimator's inputs are given, and the flags and IS weights given apply to it."""
    for name in spec.inputs:
        if named[name] is None:
            raise ValueError(
                f"{name}: required by the {spec.granularity}-level {spec.energy!r}-energy estimator, but not given"
            )
    if named["rollout_is_weights"] is not None and not spec.per_token_energy:
        raise ValueError(
            "rollout_is_weights: scales per-token energies (energy 'length' or 'proxy'); "
            f"this estimator's energy is {spec.energy!r}"
        )
    if spec.granularity == "sequence" and (multi_turn or handle_zero_tail):
        flag = "multi_turn" if multi_turn else "handle_zero_tail"
        raise ValueError(f"{flag}: applies to token-level estimators only; this estimator is sequence-level")


def validate(
    spec: Estimator,
    token_level_rewards: Any,
    response_mask: Any,
    index: Any,
    named: dict[str, Any],
    multi_turn: bool,
    handle_zero_tail: bool,
    epsilon: Any,
) -> Inputs:
    """Every check of :func:`otb_ref.compute_advantages` but the ``[B, T]`` values (:func:`check_block`).
    ``named``: the optional inputs by name (``None`` where not given)."""
    rewards = _checks.require_tensor("token_level_rewards", token_level_rewards)
    if rewards.dim() != 2:
        raise ValueError(f"token_level_rewards: expected shape [B, T], got {tuple(rewards.shape)}")
    if rewards.is_complex():
        raise ValueError(f"token_level_rewards: expected a real dtype, got {rewards.dtype}")
    shape, device = tuple(rewards.shape), rewards.device
    mask = _checks.require_tensor("response_mask", response_mask)
    _checks.require_shape("response_mask", mask, shape, "token_level_rewards")
    _checks.require_device("response_mask", mask, device, "token_level_rewards")
    if mask.is_complex():
        raise ValueError(f"response_mask: expected 0/1 entries, got complex dtype {mask.dtype}")
    group, num_groups = _checks.group_ids(index, shape[0], device)
    for name in _TOKEN_INPUTS:
        if named[name] is None:
            continue
        value = _checks.require_tensor(name, named[name])
        _checks.require_shape(name, value, shape, "token_level_rewards")
        _checks.require_device(name, value, device, "token_level_rewards")
        if not value.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {value.dtype}")
    if named["grad_norms_sq"] is not None:
        _check_grad_norms(named["grad_norms_sq"], shape, device)
    _check_applies(spec, named, multi_turn, handle_zero_tail)
    floating = [rewards] if rewards.is_floating_point() else []
    dtype = _checks.compute_dtype(*floating, *(named[name] for name in _TOKEN_INPUTS + ("grad_norms_sq",)))
    epsilon = _checks.nonnegative_scalar("epsilon", epsilon)
    return Inputs(
        rewards,
        mask,
        named["old_log_probs"],
        named["sum_pi_squared"],
        named["rollout_is_weights"],
        named["cumulative_energy"],
        named["grad_norms_sq"],
        group,
        num_groups,
        dtype,
        epsilon,
    )
