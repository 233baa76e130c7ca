"""The input sets of the conformance vectors (``conformance/generate.py`` builds the cases on them).

Short inputs (T ≤ 8) come from one seeded ``np.random.default_rng``; the long one (T = 4,096) from the raw output
of a seeded PCG64 bit generator, through IEEE arithmetic only (no ``exp``, ``log`` or distribution methods), so
that every NumPy version gives the same bits; the vectors store its SHA-256 (:func:`checksum`).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

MATRICES = ("token_level_rewards", "old_log_probs", "sum_pi_squared", "cumulative_energy", "rollout_is_weights")
ARRAYS = (
    "token_level_rewards",
    "response_mask",
    "grad_norms_sq",
    "old_log_probs",
    "sum_pi_squared",
    "cumulative_energy",
    "rollout_is_weights",
)
LONG_SEED, LONG_SHAPE = 20261126, (6, 4096)


def _proxy(rng, shape, confident=False, vocab=4):
    """log π(y) and Σπ² of one sampled distribution per token (π(y) = exp(−1e−4) when ``confident``)."""
    logits = rng.normal(size=(*shape, vocab)) * 2.0
    pi = np.exp(logits - logits.max(-1, keepdims=True))
    pi /= pi.sum(-1, keepdims=True)
    if confident:
        top = math.exp(-1e-4)
        rest = pi[..., 1:] / pi[..., 1:].sum(-1, keepdims=True) * (1 - top)
        pi = np.concatenate([np.full((*shape, 1), top), rest], -1)
    y = np.zeros(shape, int) if confident else np.argmax(pi, -1)
    return np.log(np.take_along_axis(pi, y[..., None], -1)[..., 0]), (pi**2).sum(-1)


def _mask(lengths, length, holes=()):
    mask = (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)
    for row, t in holes:
        mask[row, t] = 0.0
    return mask


def _outcome(mask, values):
    rewards = np.zeros_like(mask)
    for i, row in enumerate(mask):
        alive = np.flatnonzero(row)
        if alive.size:
            rewards[i, alive[-1]] = values[i]
    return rewards


def _common(rng, mask, index, rewards, confident=False, dtype="float64"):
    lp, s = _proxy(rng, mask.shape, confident)
    batch, length = mask.shape
    rho = rng.uniform(0.0, 2.0, size=mask.shape) * (rng.uniform(size=mask.shape) > 0.1)
    energy = rng.uniform(0.0, 3.0, size=mask.shape) * (rng.uniform(size=mask.shape) > 0.1)
    arrays = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        old_log_probs=lp,
        sum_pi_squared=s,
        rollout_is_weights=rho,
        cumulative_energy=energy * mask,
        grad_norms_sq=rng.uniform(0.0, 3.0, size=batch) * (np.arange(batch) % 5 != 4),
    )
    return dict(dtype=dtype, index=index, **arrays)


def build_inputs() -> dict[str, dict]:
    """The shared input sets, each with its tags. Deterministic: one seeded ``default_rng`` for the short inputs
    (reproduced to a few ulps: NumPy's SIMD ``exp`` and ``log`` differ between CPUs), and :func:`long_input`."""
    rng = np.random.default_rng(20261125)
    inputs = {}
    six, groups = _mask([6, 4, 5, 3, 6, 2], 6), [0, 0, 0, 1, 1, 1]
    inputs["outcome"] = (_common(rng, six, groups, _outcome(six, [1, 0, 1, 0, 0, 1])), ["outcome"])
    inputs["dense"] = (_common(rng, six, groups, rng.uniform(size=six.shape) * six), ["dense"])
    holes = _mask([7, 5, 7, 0, 6, 4, 7], 7, holes=[(0, 2), (0, 3), (1, 1), (4, 2), (5, 1), (6, 4)])
    inputs["holes"] = (
        _common(rng, holes, [0, 0, 0, 0, 1, 1, 1], rng.uniform(size=holes.shape) * holes),
        ["holes", "dense", "empty_response"],
    )
    four = _mask([3, 4, 2, 4], 4)
    inputs["group_of_one"] = (
        _common(rng, four, ["p0", "p1", "p1", "p2"], _outcome(four, [1, 0, 1, 1])),
        ["singleton_group", "string_ids", "outcome"],
    )
    eight = _mask([5, 5, 5, 5, 3, 5, 4, 5], 5)
    equal = _outcome(eight, [1.0] * 8)
    inputs["equal_outcome_confident"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, equal, confident=True),
        ["equal_outcome", "confident", "outcome"],
    )
    inputs["equal_outcome_confident_fp32"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, equal, confident=True, dtype="float32"),
        ["equal_outcome", "confident", "outcome", "fp32"],
    )
    inputs["dense_tied_totals_fp32"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, _tied_dense(rng, eight, np.float32), True, "float32"),
        ["ties", "dense", "confident", "fp32"],
    )
    inputs["dense_tied_totals"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, _tied_dense(rng, eight, np.float64), True),
        ["ties", "dense", "confident"],
    )
    inputs["inconsistent_energies"] = (_inconsistent(rng), ["inconsistent_energies", "dense"])
    zero = _common(rng, six, groups, rng.uniform(size=six.shape) * six)
    zero.update(old_log_probs=np.zeros_like(six), sum_pi_squared=np.ones_like(six))
    zero["rollout_is_weights"][3:] = 0.0
    zero["cumulative_energy"][:] = 0.0
    zero["grad_norms_sq"][:] = 0.0
    inputs["zero_energies"] = (zero, ["zero_energies", "dense"])
    one = _mask([1, 1, 1, 0, 1, 1], 1)
    inputs["t_equals_1"] = (_common(rng, one, [0, 0, 1, 1, 2, 3], rng.uniform(size=one.shape) * one), ["T1"])
    inputs["off_mask"] = (_off_mask(rng), ["off_mask_values", "holes", "dense"])
    inputs["dominant_row_fp32"] = (_dominant_row(rng), ["dominant_row", "outcome", "fp32"])
    big = _mask(rng.integers(3, 9, size=16), 8)
    inputs["large_group"] = (_common(rng, big, [7] * 16, rng.uniform(size=big.shape) * big), ["dense", "N16"])
    inputs["cancelling_fp32"] = (_cancelling(rng), ["cancelling", "dense", "fp32"])
    inputs["interleaved_groups"] = (_interleaved(rng), ["interleaved_ids", "string_ids", "holes", "dense"])
    inputs["off_mask_fp32"] = (_off_mask(rng, "float32"), ["off_mask_values", "holes", "dense", "fp32"])
    inputs["long_T_fp32"] = (long_input(), ["long_T", "cancelling", "dense", "fp32"])
    return inputs


def _tied_dense(rng, mask, dtype):
    """Dense rewards whose totals are 1 up to rounding in ``dtype`` (each row: a partition of 1, summed in dtype)."""
    rewards = np.zeros(mask.shape)
    for i, row in enumerate(mask):
        alive = np.flatnonzero(row)
        parts = rng.uniform(size=alive.size)
        rewards[i, alive] = (parts / parts.sum()).astype(dtype)
    return rewards


def _inconsistent(rng):
    """Σπ² below 2π − 1 (w < 0 before the clamp) and Σπ² at 1 + 5e-7 with π(y) ≈ 0 (w > 2 before the clamp)."""
    mask = _mask([5, 5, 4, 5, 3, 5], 5)
    arrays = _common(rng, mask, [0, 0, 0, 1, 1, 1], rng.uniform(size=mask.shape) * mask)
    arrays["old_log_probs"][0, :3] = math.log(0.9)
    arrays["sum_pi_squared"][0, :3] = 0.5  # 1 − 1.8 + 0.5 = −0.3
    arrays["old_log_probs"][3, 1:4] = -30.0
    arrays["sum_pi_squared"][3, 1:4] = 1.0 + 5e-7  # ≈ 2 + 5e-7
    return arrays


def _dominant_row(rng):
    """fp32; in each group one response's energy dwarfs the others' (IS weights 1e-3 on the others): leave-one-out
    sums formed in fp32 lose the others entirely."""
    mask = _mask([8, 8, 8, 8, 8, 8], 8)
    arrays = _common(rng, mask, [0, 0, 0, 1, 1, 1], _outcome(mask, [0.7, 2.0, 1.0, 0.0, 1.0, 0.5]), dtype="float32")
    arrays["rollout_is_weights"] = np.where(np.arange(6)[:, None] % 3 == 0, 1.0, 1e-3) * mask
    arrays["old_log_probs"], arrays["sum_pi_squared"] = np.full(mask.shape, math.log(0.5)), np.full(mask.shape, 0.5)
    return arrays


def _off_mask(rng, dtype="float64"):
    """NaN, +Inf and −Inf off the mask in every ``[B, T]`` input (each holds all three): ``x · m`` is NaN there."""
    mask = _mask([6, 3, 6, 5, 6, 4], 6, holes=[(0, 2), (2, 1), (4, 3)])
    arrays = _common(rng, mask, [0, 0, 0, 1, 1, 1], rng.uniform(size=mask.shape) * mask, dtype=dtype)
    off = np.flatnonzero(mask == 0)
    specials = np.array([np.nan, np.inf, -np.inf])
    for shift, name in enumerate(MATRICES):
        arrays[name] = np.array(arrays[name], np.float64)
        arrays[name].flat[off] = specials[(np.arange(off.size) + shift) % 3]
    return arrays


def _cancelling(rng):
    """fp32 dense rewards with ±L (L ~ 1e8, the same within a group) at the first and last token: G_t is ~1e8 in
    between while the advantages are O(1). G summed in fp32 (from the end, or rounded once per token as torch's
    CPU cumsum does), G − B in fp32 and σ from fp32 values lose the small rewards."""
    mask = _mask([6, 6, 6, 6, 6, 6], 6)
    rewards = rng.uniform(size=mask.shape)
    big = np.array([2.0**27, 2.0**27, 2.0**27, -3 * 2.0**25, -3 * 2.0**25, -3 * 2.0**25])
    rewards[:, 0], rewards[:, -1] = big, -big
    return _common(rng, mask, [0, 0, 0, 1, 1, 1], rewards, dtype="float32")


def _interleaved(rng):
    """String ids whose groups are not contiguous: equal ids form a group wherever they stand."""
    mask = _mask([5, 4, 5, 3, 5, 2, 4], 5, holes=[(0, 1), (2, 3)])
    ids = ["b", "a", "b", "c", "a", "b", "c"]
    return _common(rng, mask, ids, rng.uniform(size=mask.shape) * mask)


def raw_uniform(bitgen: np.random.PCG64, shape) -> np.ndarray:
    """Uniform [0, 1) doubles from the bit generator's raw 64-bit output (the top 53 bits): the same on every
    NumPy version, unlike the distribution methods of ``Generator``."""
    raw = bitgen.random_raw(int(np.prod(shape)))
    return ((raw >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(shape)


def _rounding_biased(base: np.ndarray, directions: np.ndarray, choices: int = 32) -> np.ndarray:
    """fp32 IS weights ρ near ``base`` [B, T] such that summing ρ² in fp32, one token after the other, rounds
    the same way at almost every step, by almost half an ulp of the running sum (down for rows with direction
    −1, up for +1): each ρ_t is the one of ``2 choices + 1`` fp32 values around ``base`` (their squares an ulp of
    the running sum apart in all) whose ρ_t² moves the fp32 running sum furthest in that direction. Exact sums in
    fp64 are unaffected; sequential fp32 sums of W_t and v drift ~1e-4 (relative) from them over 4,096 tokens."""
    base = base.astype(np.float32)
    steps = np.arange(-choices, choices + 1, dtype=np.float64) / choices
    out, running = np.empty_like(base), np.zeros(len(base), np.float32)
    rows = np.arange(len(base))
    for t in range(base.shape[1]):
        u = base[:, t].astype(np.float64)
        reach = np.maximum(np.spacing(running), np.spacing(base[:, t] * base[:, t])).astype(np.float64) / (2 * u)
        candidates = (u[:, None] + steps[None, :] * reach[:, None]).astype(np.float32)
        squares = candidates * candidates  # fp32 products
        summed = running[:, None] + squares  # fp32 sums
        error = summed.astype(np.float64) - (running.astype(np.float64)[:, None] + squares.astype(np.float64))
        pick = np.argmax(directions[:, None] * error, axis=1)
        out[:, t], running = candidates[rows, pick], summed[rows, pick]
    return out


def long_input() -> dict:
    """T = 4,096, fp32, two groups of 3 full-length responses. Rewards: dense and cancelling, ±1e4 at each token,
    the same for a group's rows, plus each row's own outcome in [0, 100) at the last token: |G_t| ~ 1e5 where
    |A| < 100 at every position. IS weights whose squares round one way in fp32 running sums
    (:func:`_rounding_biased`); random proxy inputs (log π in [−3, 0], Σπ² in (0, 1]) and energies."""
    bitgen = np.random.PCG64(LONG_SEED)
    batch, length = LONG_SHAPE
    mask = np.ones(LONG_SHAPE)
    shared = (raw_uniform(bitgen, (2, length)) - 0.5) * 2e4
    rewards = shared[[0, 0, 0, 1, 1, 1]]
    rewards[:, -1] += 100.0 * raw_uniform(bitgen, (batch,))
    rewards = rewards.astype(np.float32)
    rho = _rounding_biased(raw_uniform(bitgen, LONG_SHAPE) + 0.5, np.array([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0]))
    return dict(
        dtype="float32",
        index=[0, 0, 0, 1, 1, 1],
        token_level_rewards=rewards,
        response_mask=mask,
        old_log_probs=(-3.0 * raw_uniform(bitgen, LONG_SHAPE)).astype(np.float32),
        sum_pi_squared=(1.0 - raw_uniform(bitgen, LONG_SHAPE)).astype(np.float32),
        rollout_is_weights=rho,
        cumulative_energy=(3.0 * raw_uniform(bitgen, LONG_SHAPE)).astype(np.float32),
        grad_norms_sq=(3.0 * raw_uniform(bitgen, (batch,))).astype(np.float32),
    )


def checksum(arrays: dict) -> str:
    """SHA-256 of an input's arrays in its dtype (mask in float64), little-endian, in :data:`ARRAYS` order."""
    digest = hashlib.sha256()
    for key in ARRAYS:
        dtype = np.float64 if key == "response_mask" else np.dtype(arrays["dtype"])
        digest.update(np.ascontiguousarray(arrays[key], np.dtype(dtype).newbyteorder("<")).tobytes())
    return digest.hexdigest()
