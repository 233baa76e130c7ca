"""Every estimator and option of ``compute_advantages`` against the loop oracle, conformance/ports/numpy_port.py
(tests/oracle.py; F7, §3, §4)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracle import oracle_advantages
from strategies import rollout_batches

from otb_ref import ESTIMATORS, Estimator, compute_advantages, readable

pytestmark = pytest.mark.usefixtures("row_blocking")

SEQUENCE = [n for n, e in ESTIMATORS.items() if e.granularity == "sequence"]
TOKEN = [n for n, e in ESTIMATORS.items() if e.granularity == "token"]
# fp64 throughout; library and oracle differ in summation order and in the rounding of
# exp. Leave-one-out subtracts a row's own term from its group's total, which loses
# ulp(total) / (what remains) ≈ 1e-16 / 6e-6 (the smallest energy the strategies draw)
# in relative terms; 1e-9 covers that with margin.
TOL = dict(rtol=1e-9, atol=1e-9)
# std_normalize divides by (σ + ε); equal returns (zero spread) are left unscaled, but returns that differ by
# rounding only would amplify rounding by 1/ε. ε = 1e-4 bounds that amplification at 1e4 (well inside TOL).
_STD_EPS = {True: dict(epsilon=1e-4), False: {}}


def _run_both(name, batch, **flags):
    got = compute_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs, **flags)
    want = oracle_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs, **flags)
    return got, want


@given(rollout_batches(), st.sampled_from(SEQUENCE), st.booleans(), st.booleans())
def test_sequence_estimators_match_loop(batch, name, leave_one_out, std_normalize):
    """Sequence-level estimators equal the loop oracle for every flag combination."""
    (adv, ret), (want_adv, want_ret) = _run_both(
        name, batch, leave_one_out=leave_one_out, std_normalize=std_normalize, **_STD_EPS[std_normalize]
    )
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


@given(rollout_batches(), st.sampled_from(TOKEN), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_token_estimators_match_loop(batch, name, leave_one_out, multi_turn, handle_zero_tail, std_normalize):
    """Token-level estimators equal the loop oracle, incl. multi-turn alignment and the zero tail."""
    flags = dict(
        leave_one_out=leave_one_out,
        multi_turn=multi_turn,
        handle_zero_tail=handle_zero_tail,
        std_normalize=std_normalize,
    )
    (adv, ret), (want_adv, want_ret) = _run_both(name, batch, **flags, **_STD_EPS[std_normalize])
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


@pytest.mark.parametrize("name", TOKEN)
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_multi_turn_equal_runs_with_an_empty_response_leave_a_group_of_one(name, leave_one_out):
    """multi_turn: an empty response takes no part in its group. In groups laid out as equal runs of two rows, one
    of them empty, the other row is a group of one response: no baseline, its advantage is its return (§3, §4), as
    the loop oracle says; the empty row's advantage is 0."""
    generator = torch.Generator().manual_seed(5)
    batch, length = 6, 5
    mask = torch.ones(batch, length, dtype=torch.float64)
    mask[1] = 0  # group 0: rows 0 and 1, row 1 empty
    mask[0, 1] = mask[4, 3:] = 0  # a hole, a short response
    rewards = torch.randn(batch, length, generator=generator, dtype=torch.float64) * mask
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    inputs = {
        "old_log_probs": -torch.rand(batch, length, generator=generator, dtype=torch.float64),
        "sum_pi_squared": 0.2 + 0.8 * torch.rand(batch, length, generator=generator, dtype=torch.float64),
        "cumulative_energy": torch.rand(batch, length, generator=generator, dtype=torch.float64).cumsum(-1),
    }
    inputs = {k: v for k, v in inputs.items() if k in ESTIMATORS[name].inputs}
    flags = dict(multi_turn=True, leave_one_out=leave_one_out)
    adv, ret = compute_advantages(name, rewards, mask, index, **inputs, **flags)
    torch.testing.assert_close(adv[0], ret[0] * mask[0], rtol=0, atol=0)
    assert bool((adv[1] == 0).all())
    want_adv, want_ret = oracle_advantages(name, rewards, mask, index, **inputs, **flags)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


@given(
    rollout_batches(),
    st.sampled_from(["opo", "sequence_proxy", "token_length", "otb"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_rollout_is_weights_match_loop(batch, name, leave_one_out, multi_turn, handle_zero_tail):
    """IS weights scale per-token energies by ρ̄² before summing (§4), with every flag."""
    flags = dict(leave_one_out=leave_one_out)
    if ESTIMATORS[name].granularity == "token":
        flags.update(multi_turn=multi_turn, handle_zero_tail=handle_zero_tail)
    (adv, _), (want, _) = _run_both(name, batch, rollout_is_weights=batch.rollout_is_weights, **flags)
    torch.testing.assert_close(adv, want, **TOL)


@given(
    rollout_batches(),
    st.sampled_from(sorted(ESTIMATORS)),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_readable_matches_loop(batch, name, leave_one_out, std_normalize, multi_turn, handle_zero_tail, with_is):
    """The readable form, like the fast path, equals the loop oracle (it is tested against the fast path too, in
    tests/test_otb_ref/test_readable.py): every estimator and flag, with IS weights where they apply. TOL as
    above (readable's leave-one-out sums are also "group total minus own term")."""
    spec = ESTIMATORS[name]
    flags = dict(leave_one_out=leave_one_out, std_normalize=std_normalize, **_STD_EPS[std_normalize])
    if spec.granularity == "token":
        flags.update(multi_turn=multi_turn, handle_zero_tail=handle_zero_tail)
    inputs = dict(batch.inputs)
    if with_is and spec.per_token_energy:
        inputs["rollout_is_weights"] = batch.rollout_is_weights
    adv, ret = readable.advantages(name, batch.rewards, batch.mask, batch.index, **inputs, **flags)
    want_adv, want_ret = oracle_advantages(name, batch.rewards, batch.mask, batch.index, **inputs, **flags)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


@given(rollout_batches(uniform_mix=0.3), st.sampled_from(sorted(ESTIMATORS)), st.booleans(), st.booleans())
def test_fp32_matches_loop(batch, name, leave_one_out, with_is):
    """fp32 inputs against the fp64 oracle on the same (fp32-rounded) values.

    Tolerance: with a 30% uniform mixture π_y <= 0.85, so every proxy energy is >= 0.0225 and its
    fp32 evaluation (|error| <~ 2e-7) is relative-accurate to 1e-5; products with ρ̄² and cumulative
    sums of positive terms keep that. A weighted mean of returns then errs by <~ 1e-5 · 2 max|G|,
    and leave-one-out sums are formed in fp64. atol = 1e-4 (1 + max|G|) leaves a 5x margin.
    """
    flags = dict(leave_one_out=leave_one_out, std_normalize=False)
    inputs32 = {k: v.float() for k, v in batch.inputs.items()}
    if with_is and ESTIMATORS[name].energy in ("length", "proxy"):
        inputs32["rollout_is_weights"] = batch.rollout_is_weights.float()
    got, _ = compute_advantages(name, batch.rewards.float(), batch.mask.float(), batch.index, **inputs32, **flags)
    inputs64 = {k: v.double() for k, v in inputs32.items()}  # the fp64 oracle on the same fp32-rounded values
    want, _ = oracle_advantages(name, batch.rewards.float().double(), batch.mask, batch.index, **inputs64, **flags)
    assert got.dtype == torch.float32
    scale = 1.0 + float(batch.rewards.abs().sum(-1).max())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4 * scale)


def test_leave_one_out_with_a_dominant_row_in_fp32():
    """One response's weight dwarfs the other's: the leave-one-out baseline must still be the other's return.

    Regression: group sums minus the own term in fp32 lost the small row entirely
    (baseline 3051.8 for returns 0.7 and 2).
    """
    length = 1000
    rewards = torch.zeros(2, length)
    rewards[0, -1], rewards[1, -1] = 0.7, 2.0
    mask = torch.ones(2, length)
    half = torch.full((2, length), 0.5)
    rho = torch.ones(2, length)
    rho[1] = 1.24e-4
    for dtype in (torch.float32, torch.float64):
        adv, ret = compute_advantages(
            "sequence_proxy",
            rewards.to(dtype),
            mask,
            [0, 0],
            old_log_probs=half.log().to(dtype),
            sum_pi_squared=half.to(dtype),
            rollout_is_weights=rho.to(dtype),
            leave_one_out=True,
        )
        # Row 0's baseline is (v_1 · 2 + ε · 2) / (v_1 + ε) = 2, row 1's return (a mean of one member, THEORY §3),
        # although v_1 = 1000 · 0.5 · 1.24e-4² ≈ 7.7e-6 is ~1e-6 of v_0.
        assert abs(float(ret[0, 0] - adv[0, 0]) - 2.0) < 1e-6, dtype


@pytest.mark.parametrize("name", ["opo", "sequence_proxy", "eob"])
def test_sequence_weight_v_is_fp64_in_fp32(name):
    """The precision rule for ``v`` (PORTING item 5): fp32 inputs give ``w`` in fp32, then ``v = Σ_t m_t w_t`` in
    fp64, never rounded to fp32 before the baseline. The fast path equals the readable form and a direct fp64
    statement bit for bit, and ``v`` rounded to fp32 would change some advantages of this draw (so the test can fail).
    """
    g = torch.Generator().manual_seed(0)
    batch, length = 64, 48
    rho, rewards = torch.rand(batch, length, generator=g) * 2, torch.rand(batch, length, generator=g)
    mask, index = torch.ones(batch, length), [i // 8 for i in range(batch)]
    w = (rho * rho).double()  # opo with IS weights: w_t = ρ̄_t², an fp32 product, exact in fp64
    inputs = dict(rollout_is_weights=rho)
    if name == "sequence_proxy":  # π = 1/2 and Σπ² = 1/2: w_t = 1/2 exactly, times ρ̄_t²
        half = torch.full((batch, length), 0.5)
        inputs.update(old_log_probs=half.log(), sum_pi_squared=half)
        w = w / 2
    if name == "eob":  # v = grad_norms_sq, fp32 values whose sums in fp64 are not fp32 numbers
        inputs = dict(grad_norms_sq=w.sum(-1).float() * (1 + torch.rand(batch, generator=g)))
        w = inputs["grad_norms_sq"].double()[:, None]
    fast, _ = compute_advantages(name, rewards, mask, index, **inputs)
    plain, _ = readable.advantages(name, rewards, mask, index, **inputs)
    R = rewards.double().sum(-1)

    def direct(v):  # b = Σ v R / Σ v over each group of 8 (ε = 1e-8 for the energies proxy and exact)
        eps = 0.0 if name == "opo" else 1e-8
        v, R8 = v.view(-1, 8), R.view(-1, 8)
        b = ((v * R8).sum(-1, keepdim=True) + eps * R8.mean(-1, keepdim=True)) / (v.sum(-1, keepdim=True) + eps)
        return (R8 - b).flatten().float()

    v = w.sum(-1)
    assert torch.equal(fast[:, 0], plain[:, 0]) and torch.equal(fast[:, 0], direct(v))
    if name != "eob":  # eob's v is the caller's fp32 value: rounding it again changes nothing
        assert not torch.equal(direct(v.float().double()), direct(v))


@given(rollout_batches(max_group_size=64, max_groups=2, max_length=4), st.sampled_from(sorted(ESTIMATORS)))
def test_large_groups_match_loop(batch, name):
    """Group sizes up to 64."""
    (adv, _), (want, _) = _run_both(name, batch)
    torch.testing.assert_close(adv, want, **TOL)


@given(rollout_batches(holes=False, equal_lengths=True))
def test_uniform_token_baseline_with_equal_lengths_is_grpo_mean(batch):
    """Uniform energy, equal lengths, outcome reward: the token baseline is the group mean at every position."""
    outcome = torch.zeros_like(batch.rewards)
    outcome[:, -1] = batch.rewards.sum(-1)
    token, _ = compute_advantages("token_mean", outcome, batch.mask, batch.index, epsilon=0.0)
    grpo, _ = compute_advantages("grpo", outcome, batch.mask, batch.index, std_normalize=False, epsilon=0.0)
    torch.testing.assert_close(token, grpo, **TOL)


@given(rollout_batches(max_group_size=1), st.sampled_from(sorted(ESTIMATORS)), st.booleans())
def test_groups_of_one_get_the_return(batch, name, leave_one_out):
    """N = 1: no baseline, advantage = return (G_t for token level, R for sequence level)."""
    adv, ret = compute_advantages(
        name, batch.rewards, batch.mask, batch.index, leave_one_out=leave_one_out, **batch.inputs
    )
    torch.testing.assert_close(adv, ret * batch.mask, rtol=0, atol=0)


@given(rollout_batches(), st.sampled_from(sorted(ESTIMATORS)))
def test_values_off_the_mask_are_ignored(batch, name):
    """Garbage (NaN, inf, negatives) where the mask is 0 does not change any output."""
    off = batch.mask == 0
    poisoned = {k: (v.masked_fill(off, float("nan")) if v.dim() == 2 else v) for k, v in batch.inputs.items()}
    rewards = batch.rewards.masked_fill(off, float("inf"))
    is_flags, poisoned_is = {}, {}
    if ESTIMATORS[name].energy in ("length", "proxy"):  # huge but finite ρ̄ off the mask: ρ̄² would overflow
        is_flags = {"rollout_is_weights": batch.rollout_is_weights.float()}
        poisoned_is = {"rollout_is_weights": batch.rollout_is_weights.float().masked_fill(off, 1e30)}
    adv, ret = compute_advantages(name, rewards, batch.mask, batch.index, **poisoned, **poisoned_is)
    want_adv, want_ret = compute_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs, **is_flags)
    torch.testing.assert_close(adv, want_adv, rtol=0, atol=0)
    torch.testing.assert_close(ret * batch.mask, want_ret * batch.mask, rtol=0, atol=0)
    assert bool((adv[off] == 0).all())


@given(rollout_batches(), st.sampled_from(sorted(ESTIMATORS)))
def test_empty_rows_get_zero_advantage_and_inputs_are_untouched(batch, name):
    """Rows with an all-zero mask get zero advantage; no input tensor is modified."""
    before = {k: v.clone() for k, v in batch.inputs.items()}
    rewards, mask = batch.rewards.clone(), batch.mask.clone()
    adv, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs)
    assert bool((adv[batch.mask.sum(-1) == 0] == 0).all())
    assert torch.equal(rewards, batch.rewards) and torch.equal(mask, batch.mask)
    for k, v in before.items():
        assert torch.equal(v, batch.inputs[k]), k


@given(rollout_batches(), st.sampled_from(sorted(ESTIMATORS)))
def test_values_off_the_mask_stay_in_the_callers_tensors(batch, name):
    """Finite values off the mask are dropped by multiplying by the mask: on the function's own copies, never in
    place on the caller's tensors (which may hold anything there)."""
    off = batch.mask == 0
    fill = {"old_log_probs": -0.5}  # every input's range holds 0.5, log-probabilities' holds -0.5
    rewards = batch.rewards.masked_fill(off, 0.5)
    inputs = {k: v.masked_fill(off, fill.get(k, 0.5)) if v.dim() == 2 else v for k, v in batch.inputs.items()}
    before = {k: v.clone() for k, v in inputs.items()}
    kept = rewards.clone()
    compute_advantages(name, rewards, batch.mask, batch.index, **inputs)
    assert torch.equal(rewards, kept)
    for k, v in before.items():
        assert torch.equal(v, inputs[k]), k


@given(rollout_batches(string_ids=False))
def test_index_forms_agree(batch):
    """A list, a numpy array, an int tensor and string ids give identical results."""
    import numpy as np

    ids = torch.tensor(batch.index)
    forms = [
        batch.index,
        np.array(batch.index),
        ids,
        [f"id{i}" for i in batch.index],
        np.array([f"s{i}" for i in batch.index]),
    ]
    results = [compute_advantages("otb", batch.rewards, batch.mask, f, **batch.inputs)[0] for f in forms]
    for other in results[1:]:
        assert torch.equal(results[0], other)


@given(rollout_batches(), st.sampled_from(sorted(ESTIMATORS)))
def test_group_order_does_not_matter(batch, name):
    """Permuting rows permutes the advantages (groups are sets)."""
    B = batch.rewards.shape[0]
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B))
    adv, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs)
    permuted = {k: v[perm] for k, v in batch.inputs.items()}
    adv_p, _ = compute_advantages(
        name, batch.rewards[perm], batch.mask[perm], [batch.index[i] for i in perm], **permuted
    )
    torch.testing.assert_close(adv_p, adv[perm], **TOL)


def test_dtypes_fp32_computation_and_fp64_preserved():
    """bf16/fp32 inputs compute in fp32; fp64 stays fp64; integer rewards are accepted."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    lp, sum_pi_squared = torch.full((3, 2), -0.5), torch.full((3, 2), 0.5)
    for dtype, want in [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ]:
        adv, ret = compute_advantages(
            "otb",
            rewards.to(dtype),
            mask,
            [0, 0, 0],
            old_log_probs=lp.to(dtype),
            sum_pi_squared=sum_pi_squared.to(dtype),
        )
        assert adv.dtype == want and ret.dtype == want
    adv, _ = compute_advantages("grpo", rewards.long(), mask.bool(), [0, 0, 1])
    assert adv.dtype == torch.float32


def test_estimator_spec_object_is_accepted():
    """An Estimator instance spans the whole table, e.g. token-level with std scaling."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    adv, _ = compute_advantages(Estimator("token", "length", std_normalize=True), rewards, mask, [0, 0], epsilon=0.0)
    # W_t = t for both rows, G = (1, 1) and (0, 0): baseline 1/2 at both positions; std of R = sqrt(1/2).
    expected = torch.tensor([[0.5, 0.5], [-0.5, -0.5]], dtype=torch.float64) / 0.5**0.5
    torch.testing.assert_close(adv, expected, **TOL)


def test_named_sequence_estimators_are_their_textbook_forms():
    """With its own flags each named sequence estimator is the one of the literature (THEORY §3's table), worked
    by hand on one outcome-reward group, independently of the table: GRPO (R − mean) / (unbiased std + ε), RLOO
    R − the others' mean, OPO R − the length-weighted mean (ε = 0, so no ε share)."""
    R = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    lengths = torch.tensor([1, 3, 2, 4])
    mask = (torch.arange(4) < lengths[:, None]).double()
    rewards = torch.zeros(4, 4, dtype=torch.float64)
    rewards[torch.arange(4), lengths - 1] = R
    expected = {
        "grpo": (R - R.mean()) / R.std(),
        "rloo": R - (R.sum() - R) / 3,
        "opo": R - (lengths * R).sum() / lengths.sum(),
    }
    for name, want in expected.items():
        adv, _ = compute_advantages(name, rewards, mask, [0, 0, 0, 0], epsilon=0.0)
        torch.testing.assert_close(adv, want[:, None] * mask, **TOL, msg=name)


def test_empty_batch_and_zero_length():
    """B = 0 and T = 0 are legal and give empty outputs."""
    for shape in [(0, 4), (3, 0)]:
        rewards, mask = torch.zeros(shape), torch.zeros(shape)
        for name in ["grpo", "token_mean"]:
            adv, ret = compute_advantages(name, rewards, mask, list(range(shape[0])))
            assert adv.shape == shape and ret.shape == shape


def test_std_normalize_with_zero_std_and_zero_epsilon_is_zero_not_nan():
    """Equal rewards in a group, ε = 0: advantages are 0 (no 0/0)."""
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(3, 2)
    for name in ["grpo", "token_mean"]:
        adv, _ = compute_advantages(name, rewards, mask, [0, 0, 1], std_normalize=True, epsilon=0.0)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:2], torch.zeros(2, 2, dtype=torch.float64))


_LAYOUTS = {
    "runs": [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
    "runs, unequal": [0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3],
    "interleaved": [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 3, 3],
    "ids unsorted": [5, 5, 1, 1, 7, 7, 7, 2, 2, 2, 0, 0],
}


@pytest.mark.parametrize("device", ["cpu", "cuda", "meta"])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("budget", [1, 4 * 3, 7 * 3, 1 << 18])
def test_group_blocks_hold_whole_groups_and_every_row_once(device, layout, budget):
    """The fast path reads the batch in blocks of whole groups on CPU (about 2^18 elements each, a larger group
    alone) and whole on accelerators; each block's group numbers name its groups, and ``equal`` only where the
    block is runs of equally many rows."""
    from otb_ref import _checks, advantages

    batch_size, length = len(_LAYOUTS[layout]), 3
    group, num_groups = _checks.group_ids(torch.tensor(_LAYOUTS[layout]), batch_size, torch.device("cpu"))
    blocks = advantages._group_blocks(group, num_groups, batch_size, length, torch.device(device), budget)
    rows = [torch.arange(batch_size)[block.rows].tolist() for block in blocks]
    assert sorted(r for block in rows for r in block) == list(range(batch_size))
    if device != "cpu" or budget >= batch_size * length:
        assert len(blocks) == 1 and blocks[0].rows == slice(0, batch_size)
    seen = set()
    for block, block_rows in zip(blocks, rows):
        global_groups = group[block_rows]
        assert not seen & set(global_groups.tolist())  # whole groups: none split between blocks
        seen |= set(global_groups.tolist())
        assert block.size == len(set(global_groups.tolist()))
        pairs = set(zip(block.group.tolist(), global_groups.tolist()))
        assert len(pairs) == block.size and {local for local, _ in pairs} == set(range(block.size))
        values = torch.randint(-1000, 1000, (len(block_rows), 2)).double()  # sums exact in any order
        direct = torch.zeros(block.size, 2, dtype=torch.float64).index_add_(0, block.group, values)
        assert torch.equal(block.sum(values), direct)
        if block.equal:
            assert set(torch.bincount(block.group).tolist()) == {block.equal}
            assert block.group.tolist() == sorted(block.group.tolist())
    if device == "cpu" and budget < batch_size * length:
        assert len(blocks) > 1
        assert all(isinstance(block.rows, slice) for block in blocks) == (layout != "interleaved")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "opo", "otb"])
def test_one_block_of_interleaved_groups_puts_each_row_back(estimator, monkeypatch):
    """A budget under the batch that still plans ONE block of interleaved groups (rows read group by group): the
    outputs come back in the caller's row order (sequence estimators once returned them in the block's order)."""
    from otb_ref import _checks, advantages

    index, length = [0, 1, 0, 1, 0, 1], 2
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(len(index), length, generator=g, dtype=torch.float64)
    mask = torch.ones(len(index), length, dtype=torch.float64)
    inputs = dict(
        old_log_probs=-torch.rand(rewards.shape, generator=g, dtype=torch.float64),
        sum_pi_squared=torch.rand(rewards.shape, generator=g, dtype=torch.float64) * 0.8 + 0.1,
    )
    whole = compute_advantages(estimator, rewards, mask, index, **inputs)
    budget = len(index) * length - 1  # 5 rows a block: groups start at rows 0 and 3 of the order, one block
    monkeypatch.setattr(advantages, "_CPU_BLOCK_ELEMENTS", budget)
    monkeypatch.setattr(advantages, "_SEQUENCE_BLOCK_FACTOR", 1)
    group, num_groups = _checks.group_ids(torch.tensor(index), len(index), torch.device("cpu"))
    (block,) = advantages._group_blocks(group, num_groups, len(index), length, torch.device("cpu"), budget)
    assert not isinstance(block.rows, slice)  # the case under test: one block, rows out of order
    for one, other in zip(whole, compute_advantages(estimator, rewards, mask, index, **inputs)):
        torch.testing.assert_close(other, one, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("estimator", ["otb", "rloo", "grpo", "opo", "token_mean"])
def test_group_blocks_give_the_one_block_numbers(layout, estimator, monkeypatch):
    """Any layout of groups, any block budget: the one-block path's numbers (fp64: up to summation order)."""
    from otb_ref import advantages

    index = _LAYOUTS[layout]
    g = torch.Generator().manual_seed(7)
    shape = (len(index), 5)
    mask = (torch.rand(shape, generator=g) < 0.8).double()
    rewards = torch.randn(shape, generator=g, dtype=torch.float64)
    log_probs = -torch.rand(shape, generator=g, dtype=torch.float64)
    inputs = dict(
        old_log_probs=log_probs, sum_pi_squared=torch.rand(shape, generator=g, dtype=torch.float64) * 0.8 + 0.1
    )
    for multi_turn in [False, True] if estimator in ("otb", "token_mean") else [False]:
        monkeypatch.setattr(advantages, "_CPU_BLOCK_ELEMENTS", 1 << 18)
        whole = compute_advantages(estimator, rewards, mask, index, multi_turn=multi_turn, **inputs)
        for budget in (1, 2 * 5, 6 * 5):
            monkeypatch.setattr(advantages, "_CPU_BLOCK_ELEMENTS", budget)
            blocked = compute_advantages(estimator, rewards, mask, index, multi_turn=multi_turn, **inputs)
            for one, other in zip(whole, blocked):
                torch.testing.assert_close(other, one, rtol=1e-13, atol=1e-13)
