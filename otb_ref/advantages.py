"""Advantage estimators, fast: one family, two axes plus flags (THEORY.md §3, F7).

The readable statement of the same numbers is :mod:`otb_ref.readable` (tested equal); the table of estimators is
:mod:`otb_ref.estimators`; the whole contract for ports is docs/PORTING.md ("The porting contract").

Every estimator subtracts a weighted group mean of the return, a convex combination of its members' values:

    granularity "sequence":  b_i   = (Σ_j v_j R_j     + ε R̄)   / (Σ_j v_j   + ε)
    granularity "token":     B_t^i = (Σ_j W_t^j G_t^j + ε Ḡ_t) / (Σ_j W_t^j + ε)      (F7, THEORY §3)

(``R̄``, ``Ḡ_t``: the members' plain mean, also the baseline where the denominator is 0; ``ε`` only for the
energy-weighted rows of the table, proxy and exact: counts divide exactly, so e.g. GRPO's baseline is the exact
group mean) where ``j`` runs over the responses of the same prompt (all of them, or all but ``i`` with
``leave_one_out``), ``G_t = Σ_{k≥t} m_k r_k`` is the return to go (rewards off the mask are ignored), ``R = G_0``
the total return (positions from 0), and at position ``t`` only responses alive there (``m_t = 1``) count.
The energy axis says what the weights are:

    =========  ==========================  ==================================
    energy     sequence weight ``v``        realized energy ``W_t``
    =========  ==========================  ==================================
    uniform    1 per response               1 per alive response
    length     Σ_t m_t (response length)    Σ_{j≤t} m_j
    proxy      Σ_t m_t w_t                  Σ_{j≤t} m_j w_j   (realized energy)
    exact      ||S||² (``grad_norms_sq``)   ||S_t||² (``cumulative_energy``)
    =========  ==========================  ==================================

with ``w_t = clamp(1 − 2π_t(y_t) + Σ_v π_{t,v}², 0, 2)`` the logit-gradient proxy (F6), multiplied by ``ρ̄_t²``
when rollout importance weights are given (§4). Advantages are ``(R − b) m_t`` or ``(G_t − B_t) m_t``, optionally
divided by the group's std of what the baseline centres (GRPO; ``R``, or ``G_t`` pooled within positions). A group
of one response gets no baseline: its advantage is its return. The precision rule is stated once, where it is
applied: at ``_GROUP_DTYPE`` below.

Where each rule of THEORY §3 and §4 is applied here (one place each; ``tests/test_otb_ref/test_independence.py``
checks that the names exist):

    per-token energy w_t, the clamp, ρ̄_t²        _per_token_energy (token_energy: F6's one definition)
    values off the mask ignored                   _apply_mask
    W_t                                           _realized_energy
    G_t (from the end)                            _token_block
    v, R                                          _sequence_advantages
    the group's members and their sums            _GroupSums, _GroupBlock.sum
    the baseline, ε shared, Ḡ where Σ a + ε = 0   _baseline_from_sums
    ε only for energies                           compute_advantages (Estimator.epsilon_applies)
    leave-one-out                                 _GroupSums.minus
    a group of one: no baseline                   _token_block (group_has_baseline), _sequence_advantages (in_group)
    std scaling, zero spread                      _std_scale
    multi-turn ranks                              _generated_token_rank, _to_slots, _at_slots
    zero tail                                     _zero_tail_start
    precision                                     _GROUP_DTYPE
    input rules (every error)                     otb_ref._validation
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from otb_ref import _validation
from otb_ref.estimators import ESTIMATORS, Estimator, resolve_estimator
from otb_ref.proxy import token_energy  # F6: the one definition of the per-token energy, shared on purpose

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "compute_advantages",
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
]


class _Block(NamedTuple):
    """One block of rows, read and checked; every tensor is zero off the mask."""

    rows: slice | torch.Tensor
    mask: torch.Tensor  # [b, T] 0/1 in the computation dtype (multiplying by it is cheap; bool ops are not)
    rewards: torch.Tensor  # [b, T]
    w: torch.Tensor | None  # [b, T] per-token energy w_t ρ̄_t² (energy length or proxy), else None
    W: torch.Tensor | None  # [b, T] realized energy ||S_t||² as given (token exact), else None
    norms: torch.Tensor | None  # [b] ||S||² as given (sequence exact), else None


# ---------------------------------------------------------------------------
# Segment (group) reductions: the vectorisation over groups lives here.
# ---------------------------------------------------------------------------


def _segment_sum(
    values: torch.Tensor, group: torch.Tensor, num_groups: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-group sums: ``[B, *] -> [num_groups, *]`` (in ``out`` if given)."""
    out = values.new_zeros((num_groups, *values.shape[1:])) if out is None else out.zero_()
    return out.index_add_(0, group, values)


# Precision rule (THEORY §3), the one statement of it in this module: per-token energies w_t are computed in the
# compute dtype (Inputs.dtype: fp64 if any value input is fp64, else fp32; the mask does not count); from there on
# (W_t, G_t, R, v, every group statistic, σ, G − B) in _GROUP_DTYPE, float64, converted with .to(_GROUP_DTYPE) where
# a block's values enter the group arithmetic; advantages and returns are rounded to the compute dtype once, as they
# are put in the outputs (_put, _put_masked).
# Leave-one-out forms are "group total minus own term": in fp32 that subtraction loses the others' share when one
# row's weight dominates its group (a baseline of 3e3 for returns of size 1 was seen); in fp64 it is rounding.
_GROUP_DTYPE = torch.float64


class _GroupSums(NamedTuple):
    """Sums over a group's members that a baseline is made of (:func:`_baseline_from_sums`), fp64: ``[g]`` per
    group (sequence cells, ``a = v``, ``x = R``) or ``[g, T]`` per group and position (token cells, ``a = W_t``,
    ``x = G_t``, over the rows alive there: ``m_t = 1``, generated-token rank with multi-turn). The same names hold
    one row's own terms, and the sums read back at each row (``[b]`` or ``[b, T]``)."""

    members: torch.Tensor  # n = Σ_j m^j
    weighted: torch.Tensor  # Σ_j m^j a^j x^j
    weight: torch.Tensor  # Σ_j m^j a^j
    total: torch.Tensor  # Σ_j m^j x^j

    def minus(self, own: _GroupSums) -> _GroupSums:
        """Leave-one-out: the others' sums, the group's minus the row's own terms."""
        return _GroupSums(
            self.members - own.members, self.weighted - own.weighted, self.weight - own.weight, self.total - own.total
        )


def _baseline_from_sums(sums: _GroupSums, epsilon: float) -> torch.Tensor:
    """``B = (Σ a x + ε x̄) / (Σ a + ε)`` from the sums over a row's members (fp64, same shapes), with
    ``x̄ = Σ x / n`` (0 where ``n = 0``: the sum is then 0). ``B = x̄`` where ``Σ a + ε`` is 0 (every ``a ≥ 0``:
    only with ``ε = 0``). A convex combination of the members' values (THEORY §3).

    Computed in the sums' own buffers, which it consumes (no allocation per block): a caller reads what else it
    needs of the sums (std scaling's σ) first."""
    mean = sums.total.div_(sums.members.clamp_(min=1))  # x̄
    if epsilon > 0:  # Σ a ≥ 0 (a leave-one-out difference too: a rounded sum of terms ≥ 0 is ≥ each of them)
        return sums.weighted.add_(mean.mul_(epsilon)).div_(sums.weight.add_(epsilon))  # (Σ a x + ε x̄) / (Σ a + ε)
    return torch.where(sums.weight > 0, sums.weighted.div_(sums.weight), mean)  # (0/0 where it is not taken)


def _std_scale(
    centred: torch.Tensor, alive: torch.Tensor, groups: _GroupBlock, epsilon: float, sums: _GroupSums
) -> torch.Tensor:
    """``[b]`` factor ``1/(σ_g + ε)`` of std scaling (fp64), σ_g the group's pooled within-position unbiased std of
    what its baseline centres (``R`` [b, 1], or ``G_t`` [b, T]) over its ``alive`` entries (0/1, fp64), from the
    group sums ``[g, P]`` the caller has, ``members = Σ alive`` and ``total = Σ alive·x`` (THEORY §3):

        σ_g² = Σ_p Σ_{j ∈ g} a_jp (x_jp − x̄_gp)² / Σ_p (n_gp − 1)₊,   x̄_gp = total / members (0 where no member).

    1 where the group's alive values are equal at every position (zero spread, decided exactly by max > min: no
    division of an ε residue by ε); a group of one alive row has none, and a row with nothing alive has advantage 0."""
    group, members = groups.group, sums.members
    mean = sums.total / members.clamp(min=1)  # x̄_gp (0 where no member: the total is then 0)
    deviations = groups.sum(alive * (centred - mean[group]).square()).sum(-1)  # [g]
    dof = (members - 1).clamp(min=0).sum(-1)  # Σ_p (n_gp − 1)₊
    sd = (deviations / dof.clamp(min=1)).sqrt()[group] + epsilon  # (no degree of freedom: no deviation either)
    live, rows = alive > 0, group[:, None].expand_as(centred)
    highest = centred.new_full(members.shape, -math.inf).scatter_reduce_(
        0, rows, centred.where(live, -math.inf), "amax"
    )
    lowest = centred.new_full(members.shape, math.inf).scatter_reduce_(0, rows, centred.where(live, math.inf), "amin")
    spread = (highest > lowest).any(-1)[group]
    return torch.where(spread & (sd > 0), 1.0 / torch.where(sd > 0, sd, 1.0), 1.0)


def _generated_token_rank(mask: torch.Tensor) -> torch.Tensor:
    """``[b, T]`` rank k of each token among its row's generated tokens (``m = 1``); ``T`` off the mask."""
    rank = mask.long().cumsum(dim=-1) - 1
    return torch.where(mask != 0, rank, mask.shape[1])


def _to_slots(values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``values[i, t]`` moved to column ``slot[i, t]`` (off-mask tokens to a discarded column ``T``): ``[b, T]``."""
    return values.new_zeros(values.shape[0], values.shape[1] + 1).scatter_(1, slot, values)[:, :-1]


# ---------------------------------------------------------------------------
# Reading the inputs block by block (checks ride along on data in cache).
# ---------------------------------------------------------------------------

# Elements per block on CPU: a token block's five fp64 rows of scratch per row (and its reads) stay in cache; a
# sequence block keeps one fp64 row per row and takes _SEQUENCE_BLOCK_FACTOR times as many elements (each setting
# the fastest of a sweep on a 2-core EPYC VM). Accelerators take all rows at once. Speed settings: every budget gives
# the one-block numbers (tested).
_CPU_BLOCK_ELEMENTS = 1 << 17
_SEQUENCE_BLOCK_FACTOR = 4


class _GroupBlock(NamedTuple):
    """Rows of whole groups, read and finished together."""

    rows: slice | torch.Tensor  # the block's rows: a slice, or their numbers where groups interleave in the batch
    group: torch.Tensor  # [b] each row's group number within the block, in [0, size)
    size: int  # groups in the block
    equal: int  # n when the block is ``size`` consecutive runs of n rows (its sums are a reshape), else 0

    def sum(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-group sums ``[b, *] -> [size, *]`` (in ``out[:size]`` if given: scratch reused block after block)."""
        out = None if out is None else out[: self.size]
        if self.equal:
            return torch.sum(values.reshape(self.size, self.equal, *values.shape[1:]), 1, out=out)
        return _segment_sum(values, self.group, self.size, out)


def _group_blocks(
    group: torch.Tensor, num_groups: int, batch_size: int, length: int, device: torch.device, elements: int
) -> list[_GroupBlock]:
    """The batch as blocks of whole groups: one on accelerators (or when it fits one block); on CPU consecutive
    groups (numbered by first appearance) up to ~``elements`` elements a block, a larger group alone.
    Groups laid out as runs of rows (as trainers lay them out) give slices; interleaved groups, row numbers."""
    if device.type != "cpu" or batch_size * length <= elements or num_groups == 0:
        return [_GroupBlock(slice(0, batch_size), group, num_groups, 0)]
    rows = torch.arange(batch_size)
    first = torch.full((num_groups,), batch_size).scatter_reduce_(0, group, rows, "amin")  # first row of each group
    renumber = torch.empty_like(first).scatter_(0, first.argsort(), torch.arange(num_groups))
    ordered = renumber[group]  # group numbers in order of first appearance
    order = ordered.argsort(stable=True)  # rows, group by group (the identity for runs)
    sizes = torch.bincount(ordered, minlength=num_groups)
    starts = sizes.cumsum(0) - sizes  # first position of each group in `order`
    runs = (ordered[1:] >= ordered[:-1]).all()
    plan = torch.cat([starts, sizes, runs.long()[None]]).tolist()  # one host read
    starts, sizes, runs = plan[:num_groups], plan[num_groups:-1], bool(plan[-1])
    per_block, blocks, first_group = max(1, elements // max(length, 1)), [], 0
    sorted_groups = ordered if runs else ordered[order]
    while first_group < num_groups:
        end_group = first_group + 1
        while end_group < num_groups and starts[end_group] // per_block == starts[first_group] // per_block:
            end_group += 1
        start, stop = starts[first_group], starts[end_group - 1] + sizes[end_group - 1]
        block_sizes = sizes[first_group:end_group]
        equal = block_sizes[0] if min(block_sizes) == max(block_sizes) else 0
        block_rows = slice(start, stop) if runs else order[start:stop]
        local = sorted_groups[start:stop] - first_group
        blocks.append(_GroupBlock(block_rows, local, end_group - first_group, equal))
        first_group = end_group
    return blocks


def _apply_mask(
    values: torch.Tensor, clean: bool, mask: torch.Tensor, valid: torch.Tensor | None, fresh: bool = False
) -> torch.Tensor:
    """``values`` where the mask is 1, zero elsewhere, whatever stood there (in place when ``fresh``: a tensor of
    this function's caller, never the user's).

    Multiplying by the 0/1 mask is exact when every entry is finite (``clean``);
    otherwise ``where`` drops NaN and inf off the mask.
    """
    if clean:
        return values.mul_(mask) if fresh else values * mask
    return torch.where(valid, values, 0.0)


def _per_token_energy(
    spec: Estimator, values: dict[str, torch.Tensor], mask: torch.Tensor, clean: bool, valid: torch.Tensor | None
) -> torch.Tensor:
    """Per-token energy ``w_t ρ̄_t²`` of the energies ``length`` (w = 1) and ``proxy`` (F6) from the block's values,
    zero off the mask (``clean``, ``valid``: see :func:`_apply_mask`)."""
    if spec.energy == "length" and "rollout_is_weights" not in values:
        return mask  # w_t = 1 on the mask, already zero off it
    if spec.energy == "length":
        w = mask
    else:
        w = token_energy(values["old_log_probs"], values["sum_pi_squared"])  # 1 − 2π + Σπ² (F6)
    if "rollout_is_weights" in values:
        w = w * values["rollout_is_weights"].square()
    return _apply_mask(w, clean, mask, valid, fresh=True)


def _read_block(spec: Estimator, inputs: _validation.Inputs, rows: slice | torch.Tensor) -> _Block:
    """Read one block of rows, checked (:func:`otb_ref._validation.check_block`, on these rows just before the
    arithmetic below reads them again from cache), zero it off the mask, compute its per-token energies ``w`` (or
    take ``W`` or ``‖S‖²`` as given).

    Inputs in range everywhere are masked by multiplication (exact, and cheaper than ``where`` on CPU); the others
    with ``where``.
    """
    dtype = inputs.dtype
    read = _validation.check_block(spec, inputs, rows)
    mask = read.mask.to(dtype)  # [b, T] exact: entries are 0 or 1
    values = {name: raw.to(dtype) for name, raw in read.values.items()}
    rewards = _apply_mask(values.pop("token_level_rewards"), read.clean["token_level_rewards"], mask, read.valid)
    all_clean = all(read.clean[name] for name in values)
    w = W = norms = None
    if spec.per_token_energy:
        w = _per_token_energy(spec, values, mask, all_clean, read.valid)
    elif "cumulative_energy" in values:
        W = _apply_mask(values["cumulative_energy"], all_clean, mask, read.valid)  # ||S_t||², already realized
    if "grad_norms_sq" in spec.inputs:
        norms = inputs.grad_norms_sq[rows].to(dtype)  # ||S||², checked whole by _validation.validate
    return _Block(rows, mask, rewards, w, W, norms)


def _put(out: torch.Tensor, rows: slice | torch.Tensor, value: torch.Tensor) -> None:
    """``out[rows] = value``, rounded to ``out``'s dtype once, as it is written."""
    if isinstance(rows, slice):
        out[rows].copy_(value)
    else:
        out[rows] = value.to(out.dtype)


def _put_difference(
    out: torch.Tensor, rows: slice | torch.Tensor, G: torch.Tensor, baseline: torch.Tensor, mask: torch.Tensor
) -> None:
    """``out[rows] = (G − B) m`` [b, T]: the fp64 difference, in ``G``'s buffer (the block's own, consumed here),
    rounded once as it is stored in ``out``'s dtype, then masked there (``mask`` in that dtype: × 0/1 is exact).
    ``baseline`` is ``[b, T]``, or ``[g, 1, T]`` for rows that are g equal runs (broadcast from the group's row,
    not gathered)."""
    if baseline.dim() == 3:
        G.view(baseline.shape[0], -1, G.shape[1]).sub_(baseline)
    else:
        G.sub_(baseline)
    if isinstance(rows, slice):
        out[rows].copy_(G).mul_(mask)
    else:
        out[rows] = G.to(out.dtype).mul_(mask)


def _put_masked(out: torch.Tensor, rows: slice | torch.Tensor, per_row: torch.Tensor, mask: torch.Tensor) -> None:
    """``out[rows] = per_row[:, None] * mask`` (all in the output's dtype), written in place where rows are a slice."""
    if isinstance(rows, slice):
        torch.mul(per_row[:, None], mask, out=out[rows])
    else:
        out[rows] = per_row[:, None] * mask


def _at_slots(values: torch.Tensor, slot: torch.Tensor | None) -> torch.Tensor:
    """Read ``values [b, T]`` (per slot) back at each token's slot; ``slot=None`` (not multi-turn): unchanged."""
    return values if slot is None else values.gather(1, slot)


# ---------------------------------------------------------------------------
# Group statistics that decide where a baseline applies.
# ---------------------------------------------------------------------------


def _zero_tail_start(
    lengths: torch.Tensor, group: torch.Tensor, num_groups: int, counts: torch.Tensor, T: int
) -> torch.Tensor:
    """``[B]``: the second-longest length of the group for its unique longest response, else ``T`` (no tail).

    The baseline of that response is zeroed from this position on (§4, ``handle_zero_tail``). Only groups of two or
    more counted rows (``counts``) have one; an uncounted row (multi-turn, empty) has length 0, below every counted
    row's, so it is never that response nor its second.
    """
    longest = lengths.new_full((num_groups,), -1).scatter_reduce_(0, group, lengths, "amax")  # [G]
    is_longest = lengths == longest[group]  # [B]
    num_longest = _segment_sum(is_longest.long(), group, num_groups)  # [G]
    others = torch.where(is_longest, -1, lengths)
    second = others.new_full((num_groups,), -1).scatter_reduce_(0, group, others, "amax")  # [G]
    unique_longest = is_longest & (num_longest[group] == 1) & (counts[group] >= 2)  # [B]
    return torch.where(unique_longest, second[group], T)


# ---------------------------------------------------------------------------
# The two granularities.
# ---------------------------------------------------------------------------


def _sequence_advantages(
    spec: Estimator, inputs: _validation.Inputs, epsilon: float, baseline_epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R − b) m_t`` with ``b`` the weighted group mean of ``R`` (sequence rows of the table), block by block of
    whole groups (:func:`_group_blocks`)."""
    batch_size, length = inputs.rewards.shape
    device, dtype = inputs.rewards.device, inputs.dtype
    elements = _CPU_BLOCK_ELEMENTS * _SEQUENCE_BLOCK_FACTOR
    blocks = _group_blocks(inputs.group, inputs.num_groups, batch_size, length, device, elements)
    advantages, returns = (torch.empty((batch_size, length), dtype=dtype, device=device) for _ in range(2))
    # fp64 rows that every block reuses (no allocator traffic per block)
    workspace = torch.empty((max(b.group.shape[0] for b in blocks), length), dtype=_GROUP_DTYPE, device=device)
    for groups in blocks:
        block, work = _read_block(spec, inputs, groups.rows), workspace[: groups.group.shape[0]]
        # R = G_0 [b], summed from the end (as G_t: ties stay exact)
        R = work.copy_(block.rewards.flip(-1)).cumsum_(-1)[:, -1].clone() if length else work.sum(-1)
        if block.norms is not None:
            v = block.norms.to(_GROUP_DTYPE)  # v = ||S||²
        elif block.w is not None:
            v = work.copy_(block.w).sum(dim=-1)  # v = Σ_t w_t
        else:
            v = torch.ones_like(R)  # uniform: 1
        own = torch.stack([torch.ones_like(R), v * R, v, R], dim=1)  # each row's own terms [b, 4]
        sums = _GroupSums(*groups.sum(own).unbind(1))  # [g]
        in_group = sums.members >= 2  # [g]
        scale = None
        if spec.std_normalize:  # σ of R over the group (read before the baseline consumes the sums)
            per_coordinate = _GroupSums(*(s[:, None] for s in sums))  # [g, 1]: R is one coordinate
            scale = _std_scale(R[:, None], torch.ones_like(R)[:, None], groups, epsilon, per_coordinate)
        if spec.leave_one_out:  # the others: each row's group's sums minus its own terms [b]
            at = _GroupSums(*(s[groups.group] for s in sums)).minus(_GroupSums(*own.unbind(1)))
            baseline = torch.where(in_group[groups.group], _baseline_from_sums(at, baseline_epsilon), 0.0)
        else:
            baseline = torch.where(in_group, _baseline_from_sums(sums, baseline_epsilon), 0.0)[groups.group]
        advantage = R - baseline  # [b]
        if scale is not None:
            advantage = advantage * scale
        _put_masked(advantages, groups.rows, advantage.to(dtype), block.mask)
        _put_masked(returns, groups.rows, R.to(dtype), block.mask)
    return advantages, returns


def _token_advantages(
    spec: Estimator,
    inputs: _validation.Inputs,
    multi_turn: bool,
    handle_zero_tail: bool,
    epsilon: float,
    baseline_epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G_t − B_t) m_t`` with ``B_t`` the energy-weighted group mean of ``G_t`` per position (F5, F7).

    Everything a token advantage needs lies within its group, so the batch is read once, in blocks of whole groups
    (:func:`_group_blocks`), and each block is finished while in cache (:func:`_token_block`)."""
    batch_size, length = inputs.rewards.shape
    device, dtype = inputs.rewards.device, inputs.dtype
    blocks = _group_blocks(inputs.group, inputs.num_groups, batch_size, length, device, _CPU_BLOCK_ELEMENTS)
    outputs = tuple(torch.empty((batch_size, length), dtype=dtype, device=device) for _ in range(2))  # A, G
    # fp64 rows that every block reuses (no allocator traffic per block): W G, m G, W, m (summed in one call), G;
    # and their group sums
    workspace = torch.empty((max(b.group.shape[0] for b in blocks), 5, length), dtype=_GROUP_DTYPE, device=device)
    sums_scratch = workspace.new_empty((max(b.size for b in blocks), 4, length))
    for block in blocks:
        scratch = (workspace[: block.group.shape[0]], sums_scratch)
        _token_block(spec, inputs, block, multi_turn, handle_zero_tail, epsilon, baseline_epsilon, outputs, scratch)
    return outputs[0], outputs[1]


def _realized_energy(block: _Block, mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``W_t`` [b, T] in ``out`` (fp64): ``Σ_{j≤t} w_j`` zero off the mask, ``||S_t||²`` as given, or 1 while alive."""
    if block.W is not None:
        return out.copy_(block.W)  # ||S_t||², checked and zero off the mask
    if block.w is not None:
        return out.copy_(block.w).cumsum_(-1).mul_(mask)  # W_t = Σ_{j≤t} w_j, 0 off the mask
    return out.copy_(mask)  # uniform: W_t = 1 while alive


def _token_block(
    spec: Estimator,
    inputs: _validation.Inputs,
    groups: _GroupBlock,
    multi_turn: bool,
    handle_zero_tail: bool,
    epsilon: float,
    baseline_epsilon: float,
    outputs: tuple[torch.Tensor, torch.Tensor],
    scratch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Advantages and returns of one block of whole groups into ``outputs`` ([B, T] each, rounded there, once);
    ``scratch``: fp64 ``[b, 5, T]`` rows and ``[≥ g, 4, T]`` group sums."""
    work, sums_scratch = scratch
    block = _read_block(spec, inputs, groups.rows)
    group, length = groups.group, block.mask.shape[1]
    mask = work[:, 3].copy_(block.mask)
    G = work[:, 4].copy_(block.rewards.flip(-1)).cumsum_(-1).flip(-1)  # G_t = Σ_{k≥t} m_k r_k, from the end
    _put(outputs[1], groups.rows, G)
    slot = _generated_token_rank(mask) if multi_turn else None  # compare k-th generated tokens, not positions
    if multi_turn:  # the terms at their slots, in scratch of their own (the natural mask stays in work[:, 3])
        W, terms = _realized_energy(block, mask, torch.empty_like(G)), torch.empty_like(work[:, :4])
        G_s = _to_slots(G, slot)
        terms[:, 2], terms[:, 3] = _to_slots(W, slot), _to_slots(mask, slot)
    else:
        G_s, terms = G, work[:, :4]
        W = _realized_energy(block, mask, terms[:, 2])
    m_s = terms[:, 3]
    torch.mul(terms[:, 2:], G_s[:, None], out=terms[:, :2])  # each row's terms of its group's sums: W G, m G, W, m
    summed = groups.sum(terms, out=sums_scratch)  # [g, 4, T], one call
    sums = _GroupSums(members=summed[:, 3], weighted=summed[:, 0], weight=summed[:, 2], total=summed[:, 1])
    lengths = block.mask.sum(dim=-1).long() if multi_turn or handle_zero_tail else None  # generated tokens per row
    # A baseline applies to counted rows of groups with two or more counted rows
    # (uncounted rows are empty: their advantage is zero anyway); equal runs of n >= 2 rows, all counted: every group.
    every_group = groups.equal >= 2 and not multi_turn
    counts = None
    if handle_zero_tail or not every_group:  # counted rows per group [g]
        counts = groups.sum((lengths > 0).long()) if multi_turn else groups.sum(torch.ones_like(group))
    group_has_baseline = None if every_group else (counts >= 2).to(_GROUP_DTYPE)  # [g]
    back = slot.clamp(max=max(length - 1, 0)) if multi_turn else None  # each token's slot, to read sums back
    # σ of G_t pooled within positions (ranks with multi_turn), over the group's alive tokens: read before the
    # baseline consumes the sums
    scale = _std_scale(G_s, m_s, groups, epsilon, sums)[:, None] if spec.std_normalize else None
    if spec.leave_one_out:  # the others: group sums at each token's position minus the row's own terms
        at = _GroupSums(*(_at_slots(s[group], back) for s in sums))
        own = _GroupSums(mask, W * G, W, mask * G) if multi_turn else _GroupSums(m_s, terms[:, 0], W, terms[:, 1])
        baseline = _baseline_from_sums(at.minus(own), baseline_epsilon)
        if group_has_baseline is not None:
            baseline.mul_(group_has_baseline[group, None])
    else:
        baseline_of_group = _baseline_from_sums(sums, baseline_epsilon)  # [g, T]
        if group_has_baseline is not None:
            baseline_of_group.mul_(group_has_baseline[:, None])
        if not (multi_turn or handle_zero_tail or spec.std_normalize):  # (G − B) m, rounded as it is written
            baseline = baseline_of_group[:, None, :] if groups.equal else baseline_of_group[group]
            _put_difference(outputs[0], groups.rows, G, baseline, block.mask)
            return
        baseline = _at_slots(baseline_of_group[group], back)  # [b, T]
    if handle_zero_tail:
        tail_start = _zero_tail_start(lengths, group, groups.size, counts, length)
        token_position = back if multi_turn else torch.arange(length, device=mask.device)[None, :]
        baseline = torch.where(token_position < tail_start[:, None], baseline, 0.0)
    if not spec.std_normalize:  # (G − B) m, rounded as it is written
        _put_difference(outputs[0], groups.rows, G, baseline, block.mask)
        return
    advantage = torch.sub(G, baseline, out=baseline).mul_(mask).mul_(scale)  # (G − B) m / (σ + ε), in B's buffer
    _put(outputs[0], groups.rows, advantage)


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
            ``otb_ref.exact.sequence_grad_norms_sq_fp64``.
        cumulative_energy: ``[B, T]`` the realized energy ``W_t = ||S_t||²`` of
            each prefix (``otb_exact``), e.g. from ``otb_ref.exact.prefix_grad_norms_sq_fp64``:
            the squared norm of the cumulative score, not a cumulative sum of per-token
            energies (F5).
        rollout_is_weights: ``[B, T]`` truncated IS weights ``ρ̄_t ≥ 0``;
            per-token energies (``length``, ``proxy``) are multiplied by ``ρ̄_t²``.
        leave_one_out: build each response's baseline from the other
            responses only (unbiased, F7). Default: the estimator's
            (``True`` for ``"rloo"`` only).
        std_normalize: divide advantages by ``σ_g + ε``, σ_g the group's
            unbiased std of what the baseline centres: ``R`` (sequence
            estimators) or ``G_t`` pooled within positions (token estimators;
            THEORY §3). Default: the estimator's (``True`` for ``"grpo"``
            only). Biases the estimator (F7).
        multi_turn: token-level only. Align responses by their k-th generated
            token instead of absolute position; rows with empty masks take no
            part in their group (as in the authors' multi-turn variant).
        handle_zero_tail: token-level only. In each group, zero the baseline
            of the unique longest response beyond the second-longest length
            (absolute positions, or generated-token positions with
            ``multi_turn``). Without it an include-self baseline there equals
            the response's own return.
        epsilon: ``ε ≥ 0`` of energy-weighted baselines (``proxy``,
            ``exact``): ``B = (Σ a G + ε Ḡ) / (Σ a + ε)``, shared among the
            members so that B stays a convex combination of their values
            (``Ḡ`` where the denominator is 0); also added to the standard
            deviation of ``std_normalize``. ``uniform`` and ``length`` weights
            are counts (or sums of ``ρ̄²``) and divide exactly.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, fp32, or fp64 if any value
        input (rewards, log-probs, Σπ², energies, IS weights) is fp64; the
        mask's dtype does not matter; computed in fp64 from the per-token
        energies on and rounded once (THEORY §3).
        ``returns`` is what the baseline is subtracted from: ``G_t``
        (token level; the reverse cumulative sum of masked rewards, so a hole
        holds the reward still to come) or ``R m_t`` (sequence level).
        ``advantages`` is zero wherever the mask is 0. Inputs are not modified.

    Raises:
        ValueError: naming the argument, for unknown estimators, missing
            inputs, wrong shapes or devices, non-binary masks, NaN/inf at
            valid positions, negative energies or IS weights (or IS weights so
            large that ρ̄² would overflow), log-probabilities above 0, Σπ²
            outside (0, 1], ``index`` of the wrong length, flags that do not
            apply.
    """
    spec = resolve_estimator(estimator, leave_one_out, std_normalize)
    named = {
        "old_log_probs": old_log_probs,
        "sum_pi_squared": sum_pi_squared,
        "grad_norms_sq": grad_norms_sq,
        "cumulative_energy": cumulative_energy,
        "rollout_is_weights": rollout_is_weights,
    }
    inputs = _validation.validate(
        spec, token_level_rewards, response_mask, index, named, multi_turn, handle_zero_tail, epsilon
    )
    epsilon = inputs.epsilon
    # ε only where the weights are energies (proxy, exact): counts, and sums of ρ̄² (length with IS weights),
    # divide exactly, as in verl.
    baseline_epsilon = epsilon if spec.epsilon_applies else 0.0
    with torch.no_grad():
        if spec.granularity == "sequence":
            return _sequence_advantages(spec, inputs, epsilon, baseline_epsilon)
        return _token_advantages(spec, inputs, multi_turn, handle_zero_tail, epsilon, baseline_epsilon)


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

    ``B_t = (Σ_j W_t^j G_t^j + ε Ḡ_t) / (Σ_j W_t^j + ε)`` over each prompt's
    group (self included), ``W_t = Σ_{j≤t} m_j ρ̄_j² w_j``, ``w_j`` clamped into
    [0, 2] (F5, F6, §3, §4). verl's numerator has no ``ε Ḡ_t``: the numbers
    differ by ``ε |Ḡ_t| / (Σ_j W_t^j + ε)`` (docs/PORTING.md). Shapes
    ``[B, T]``; see :func:`compute_advantages` (``"otb"``). Returns
    ``(advantages, returns)``.
    """
    return compute_advantages(
        "otb",
        token_level_rewards,
        response_mask,
        index,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        handle_zero_tail=handle_zero_tail,
        epsilon=epsilon,
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
        "otb",
        token_level_rewards,
        response_mask,
        index,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        multi_turn=True,
        handle_zero_tail=handle_zero_tail,
        epsilon=epsilon,
    )
