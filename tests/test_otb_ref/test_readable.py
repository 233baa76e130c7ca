"""otb_ref.readable (the readable form) equals compute_advantages (the fast path) for every estimator and flag."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import rollout_batches

from otb_ref import ESTIMATORS, compute_advantages, readable

pytestmark = pytest.mark.usefixtures("row_blocking")
# Both fp64; they differ in summation order (blocked segment sums vs one index_add) and in where the
# leave-one-out term is subtracted. Same bound as tests/test_otb_ref/test_advantages.py: 1e-16 / 6e-6 ≈ 2e-11 relative.
TOL = dict(rtol=1e-9, atol=1e-9)


def _flags(name, leave_one_out, std_normalize, multi_turn, zero_tail, epsilon) -> dict:
    """The keyword flags of one draw; multi_turn and handle_zero_tail only for token-level estimators."""
    token = ESTIMATORS[name].granularity == "token"
    return dict(
        leave_one_out=leave_one_out,
        std_normalize=std_normalize,
        epsilon=epsilon,
        multi_turn=multi_turn and token,
        handle_zero_tail=zero_tail and token,
    )


@given(
    rollout_batches(),
    st.sampled_from(sorted(ESTIMATORS)),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.0, 1e-8, 1e-4]),
)
def test_readable_equals_fast_path(batch, name, leave_one_out, std_normalize, multi_turn, zero_tail, with_is, epsilon):
    """Every estimator, every flag: the plain form and the fast path give the same advantages and returns."""
    flags = _flags(name, leave_one_out, std_normalize, multi_turn, zero_tail, 1e-4 if std_normalize else epsilon)
    inputs = dict(batch.inputs)
    if with_is and ESTIMATORS[name].energy in ("length", "proxy"):
        inputs["rollout_is_weights"] = batch.rollout_is_weights
    fast = compute_advantages(name, batch.rewards, batch.mask, batch.index, **inputs, **flags)
    plain = readable.advantages(name, batch.rewards, batch.mask, batch.index, **inputs, **flags)
    for got, want in zip(fast, plain):
        torch.testing.assert_close(got, want, **TOL)


@given(
    rollout_batches(),
    st.sampled_from(sorted(ESTIMATORS)),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.0, 1e-8]),
)
def test_readable_equals_fast_path_in_fp32(batch, name, leave_one_out, std_normalize, multi_turn, zero_tail, epsilon):
    """fp32 inputs: both compute w_t in fp32 by the same expression and everything after it in fp64 (the precision
    rule). What differs: torch's fp32 ``exp`` is vectorised by chunks, so a block and the whole tensor can round
    π(y) one ulp apart (2^-23 relative), and fp64 summation order. Bound (otb_ref/readable.py states it): 4 fp32 ulps
    of the returns' scale, times std scaling's amplification max|A| / max|G − B|, plus 2 ulps of the value."""
    flags = _flags(name, leave_one_out, std_normalize, multi_turn, zero_tail, epsilon)
    as32 = lambda x: x.float() if isinstance(x, torch.Tensor) else x  # noqa: E731
    inputs = {key: as32(value) for key, value in batch.inputs.items()}
    fast = compute_advantages(name, as32(batch.rewards), batch.mask, batch.index, **inputs, **flags)
    plain = readable.advantages(name, as32(batch.rewards), batch.mask, batch.index, **inputs, **flags)
    unscaled = compute_advantages(
        name, as32(batch.rewards), batch.mask, batch.index, **inputs, **dict(flags, std_normalize=False)
    )[0]
    largest = lambda x: float(x.abs().max()) if x.numel() else 0.0  # noqa: E731
    amplification = max(1.0, largest(fast[0]) / largest(unscaled)) if largest(unscaled) > 0 else 1.0
    atol = 4 * 2.0**-23 * (1.0 + largest(fast[1])) * amplification
    for got, want in zip(fast, plain):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2 * 2.0**-23, atol=atol)


@given(rollout_batches(), st.booleans(), st.sampled_from([0.0, 1e-8, 1e-4]))
def test_otb_advantages_self_contained_equals_compute_advantages(batch, leave_one_out, epsilon):
    """The one-function statement of OTB (the README's first hop) gives compute_advantages("otb")'s numbers, with and
    without leave-one-out, holes, groups of one and empty responses included (the strategy draws them)."""
    fast, _ = compute_advantages(
        "otb",
        batch.rewards,
        batch.mask,
        batch.index,
        old_log_probs=batch.old_log_probs,
        sum_pi_squared=batch.sum_pi_squared,
        leave_one_out=leave_one_out,
        epsilon=epsilon,
    )
    plain = readable.otb_advantages(
        batch.rewards, batch.mask, batch.index, batch.old_log_probs, batch.sum_pi_squared, leave_one_out, epsilon
    )
    torch.testing.assert_close(fast, plain.to(fast.dtype), **TOL)


def test_readable_returns_to_go_is_the_reverse_cumulative_sum():
    """G_t = Σ_{k ≥ t} m_k r_k, holes included (a hole holds the reward still to come)."""
    rewards = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    assert readable.returns_to_go(rewards, mask).tolist() == [[13.0, 12.0, 12.0, 8.0]]


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_readable_zero_tail_with_tied_longest_responses_and_holes(leave_one_out):
    """Two responses tie for longest (3 tokens), one with a hole reaching position 3: no zero tail (not unique)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 2.0], [0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    flags = dict(handle_zero_tail=True, leave_one_out=leave_one_out)
    fast = compute_advantages("token_mean", rewards, mask, [0, 0, 0], **flags)
    plain = readable.advantages("token_mean", rewards, mask, [0, 0, 0], **flags)
    for got, want in zip(fast, plain):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if not leave_one_out:  # row 1 is alone at position 3: include-self baseline = its own G_3 = 2, unless zeroed
        assert float(fast[0][1, 3]) == 0.0


def test_readable_zero_tail_after_a_group_of_one():
    """A group of one (no tail) listed before a group with a unique longest response: the second group's tail is
    still zeroed (the groups are independent), as in the fast path."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    fast = compute_advantages("token_mean", rewards, mask, [0, 1, 1], handle_zero_tail=True)
    plain = readable.advantages("token_mean", rewards, mask, [0, 1, 1], handle_zero_tail=True)
    for got, want in zip(fast, plain):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert float(plain[0][1, 3]) == 1.0  # alone at position 3 beyond the other's length: baseline zeroed, A = G_3


@pytest.mark.parametrize("name", ["otb", "token_mean", "sequence_proxy"])
def test_readable_std_scaling_leaves_equal_negative_returns_unscaled(name):
    """Equal returns (here −0.7, negative) have zero spread: std scaling leaves their advantage, a rounding residue
    of B − G, unscaled instead of amplifying it by 1/ε; positions no response reaches (T = 5 > every length) take no
    part in the spread. Energies of 0.1, 0.2, 0.3 make the residue nonzero."""
    rewards = torch.zeros(3, 5, dtype=torch.float64)
    rewards[:, 3] = -0.7
    mask = torch.zeros(3, 5, dtype=torch.float64)
    mask[:, :4] = 1.0
    log_probs = torch.log(torch.tensor([0.9, 0.8, 0.7], dtype=torch.float64))[:, None].expand(3, 5).contiguous()
    inputs = dict(old_log_probs=log_probs, sum_pi_squared=log_probs.exp().square())
    inputs = inputs if ESTIMATORS[name].energy == "proxy" else {}
    flags = dict(std_normalize=True, epsilon=1e-8)
    fast = compute_advantages(name, rewards, mask, [0, 0, 0], **inputs, **flags)[0]
    plain = readable.advantages(name, rewards, mask, [0, 0, 0], **inputs, **flags)[0]
    torch.testing.assert_close(plain, fast, rtol=0, atol=1e-12)
    assert float(plain.abs().max()) < 1e-12


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_readable_ignores_whatever_stands_off_the_mask_and_takes_zero_positions(name):
    """NaN and inf off the mask (every [B, T] input, IS weights included) change nothing, as in the fast path;
    T = 0 gives [B, 0] outputs."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    clean = dict(
        old_log_probs=-torch.rand(3, 4, generator=g, dtype=torch.float64),
        sum_pi_squared=torch.full((3, 4), 0.5, dtype=torch.float64),
        cumulative_energy=torch.rand(3, 4, generator=g, dtype=torch.float64),
        grad_norms_sq=torch.rand(3, generator=g, dtype=torch.float64),
    )
    if ESTIMATORS[name].energy in ("length", "proxy"):
        clean["rollout_is_weights"] = 2 * torch.rand(3, 4, generator=g, dtype=torch.float64)
    rewards = torch.randn(3, 4, generator=g, dtype=torch.float64)
    off = mask == 0
    dirty = {k: v if v.dim() == 1 else v.masked_fill(off, float("nan")) for k, v in clean.items()}
    want = compute_advantages(name, rewards, mask, [0, 0, 0], **clean)
    got = readable.advantages(name, rewards.masked_fill(off, float("inf")), mask, [0, 0, 0], **dirty)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    empty = {k: v if v.dim() == 1 else v[:, :0] for k, v in clean.items()}
    got = readable.advantages(name, rewards[:, :0], mask[:, :0], [0, 0, 0], **empty)
    assert [tuple(x.shape) for x in got] == [(3, 0), (3, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_f6_otb_advantages_clamps_energies_like_compute_advantages(dtype):
    """Log-probs and Σπ² that are each valid but not from one distribution (Σπ² < 2π − 1: w = −0.3 before the
    clamp; π ≈ 0 with Σπ² = 1 + 5e-7: w > 2): the self-contained form clamps w_t into [0, 2] as token_energy does
    (THEORY F6's rule), so both forms give the same advantages; without the clamp they differ by ~1."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.5]], dtype=dtype)
    mask = torch.ones(3, 3, dtype=dtype)
    log_probs = torch.tensor([[math.log(0.9)] * 3, [-30.0] * 3, [math.log(0.5)] * 3], dtype=dtype)
    sum_pi_squared = torch.tensor([[0.5] * 3, [1.0 + 5e-7] * 3, [0.5] * 3], dtype=dtype)
    fast, _ = compute_advantages(
        "otb", rewards, mask, [0, 0, 0], old_log_probs=log_probs, sum_pi_squared=sum_pi_squared
    )
    plain = readable.otb_advantages(rewards, mask, [0, 0, 0], log_probs, sum_pi_squared)
    torch.testing.assert_close(plain, fast, rtol=1e-6, atol=1e-6)
    # t = 0: W = (0, 2, 0.5) after the clamp, G = (1, 0, 0.5): B = 0.25 / 2.5 = 0.1 (ε negligible), A = 0.9.
    assert float(fast[0, 0]) == pytest.approx(0.9, abs=1e-6)


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_otb_advantages_ignores_whatever_stands_off_the_mask(leave_one_out):
    """The self-contained form's rule "values off the mask are ignored, whatever they are": finite garbage (which
    would enter the returns to go of earlier tokens) and NaN change nothing."""
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    rewards = torch.randn(3, 4, generator=g, dtype=torch.float64)
    log_probs = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    sum_pi_squared = torch.full((3, 4), 0.5, dtype=torch.float64)
    off = mask == 0
    want = readable.otb_advantages(rewards, mask, [0, 0, 0], log_probs, sum_pi_squared, leave_one_out)
    for garbage in (5.0, float("nan")):
        dirty = [x.masked_fill(off, garbage) for x in (rewards, log_probs, sum_pi_squared)]
        got = readable.otb_advantages(dirty[0], mask, [0, 0, 0], *dirty[1:], leave_one_out)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_group_std_is_zero_where_no_position_has_two_alive_rows():
    """group_std's rule: σ = 0 (no spread) for a group whose positions each have at most one alive row, and the
    pooled unbiased std for a group with two alive rows at some position."""
    values = torch.tensor([[1.0, 2.0], [5.0, 7.0], [1.0, 4.0], [3.0, 0.0]], dtype=torch.float64)
    alive = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    sd, spread = readable.group_std(values, alive, torch.tensor([0, 0, 1, 1]))
    assert sd.tolist()[:2] == [0.0, 0.0] and spread.tolist() == [False, False, True, True]
    # position 0 of group 1: values 1 and 3, unbiased variance exactly 2; σ is torch's square root of it (torch's
    # float64 sqrt is not correctly rounded everywhere: 1 ulp below math.sqrt(2) with AVX-512)
    assert torch.equal(sd[2:], torch.tensor([2.0, 2.0], dtype=torch.float64).sqrt())


def test_sequence_advantages_leave_rows_not_counted_out():
    """sequence_advantages' rule: rows not counted neither contribute nor get a baseline, whatever their v and R."""
    R = torch.tensor([1.0, 3.0, 7.0, 2.0], dtype=torch.float64)
    v = torch.tensor([0.5, 2.0, 0.0, 9.0], dtype=torch.float64)
    mask, group = torch.ones(4, 2, dtype=torch.float64), torch.tensor([0, 0, 0, 0])
    counted = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    got = readable.sequence_advantages(R, v, mask, group, counted, False, 1e-8)
    kept = [0, 1, 3]
    want = readable.sequence_advantages(R[kept], v[kept], mask[kept], group[kept], counted[kept], False, 1e-8)
    torch.testing.assert_close(got[kept], want, rtol=1e-15, atol=0)
    torch.testing.assert_close(got[2], R[2].expand(2), rtol=0, atol=0)  # no baseline: its own R


def test_readable_takes_cells_built_at_run_time_an_empty_batch_and_keyword_only_inputs():
    """As compute_advantages: an Estimator whose strings were built at run time is the table's cell; a batch of no
    rows gives [0, T] outputs; the inputs after index are keyword-only, the leading four may be named."""
    import dataclasses

    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(4, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    inputs = dict(
        old_log_probs=-torch.rand(4, 3, generator=g, dtype=torch.float64),
        sum_pi_squared=torch.full((4, 3), 0.5, dtype=torch.float64),
        cumulative_energy=torch.rand(4, 3, generator=g, dtype=torch.float64).cumsum(-1),
        grad_norms_sq=torch.rand(4, generator=g, dtype=torch.float64),
    )
    for name, cell in ESTIMATORS.items():
        fresh = {field: "".join(list(getattr(cell, field))) for field in ("granularity", "energy")}
        built = readable.advantages(dataclasses.replace(cell, **fresh), rewards, mask, [0, 0, 1, 1], **inputs)
        for a, b in zip(built, readable.advantages(name, rewards, mask, [0, 0, 1, 1], **inputs)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        empty = {k: v[:0] for k, v in inputs.items()}
        got = readable.advantages(name, rewards[:0], mask[:0], [], **empty)
        assert [tuple(x.shape) for x in got] == [(0, 3), (0, 3)], name
    leading = dict(rewards=rewards, mask=mask, index=[0, 0, 1, 1])
    by_name = readable.advantages(estimator="otb", **leading, **inputs)
    torch.testing.assert_close(by_name[0], readable.advantages("otb", *leading.values(), **inputs)[0], rtol=0, atol=0)
    with pytest.raises(TypeError):
        readable.advantages("otb", *leading.values(), inputs["old_log_probs"], inputs["sum_pi_squared"])


def test_otb_advantages_edge_rules():
    """otb_advantages' rules at the edges: with ε = 0 and no energy (confident tokens) B_t = Ḡ_t; energies above 2
    (Σπ² beyond 1 by compute_advantages' slack, π(y) ≈ 0) are clamped to 2, as the fast path does."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.float64)
    confident = torch.zeros(3, 2, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64)  # w = 1 − 2 + 1 = 0
    got = readable.otb_advantages(rewards, mask, [0, 0, 0], *confident, epsilon=0.0)
    G = rewards.flip(-1).cumsum(-1).flip(-1)  # one group: Ḡ_t is the mean over the rows
    torch.testing.assert_close(got, G - G.mean(dim=0), rtol=0, atol=1e-15)
    edge = torch.full((3, 2), -50.0, dtype=torch.float64), torch.full((3, 2), 1 + 1e-6, dtype=torch.float64)
    edge[0][1], edge[1][1] = -0.5, 0.5  # row 1 ordinary: unequal energies, so the clamp moves the baseline
    want, _ = compute_advantages("otb", rewards, mask, [0, 0, 1], old_log_probs=edge[0], sum_pi_squared=edge[1])
    torch.testing.assert_close(readable.otb_advantages(rewards, mask, [0, 0, 1], *edge), want, rtol=0, atol=0)


def test_readable_default_flags_are_compute_advantages():
    """Defaults as compute_advantages: no zero tail, not multi-turn (a batch with a unique longest response)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    inputs = dict(old_log_probs=torch.full((2, 3), -0.5, dtype=torch.float64))
    inputs["sum_pi_squared"] = torch.full((2, 3), 0.5, dtype=torch.float64)
    default = readable.advantages("otb", rewards, mask, [0, 0], **inputs)[0]
    torch.testing.assert_close(default, compute_advantages("otb", rewards, mask, [0, 0], **inputs)[0])
    tail = readable.advantages("otb", rewards, mask, [0, 0], **inputs, handle_zero_tail=True)[0]
    assert not torch.equal(default, tail)
