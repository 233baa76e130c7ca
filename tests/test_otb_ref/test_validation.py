"""Bad input: a ValueError naming the argument and the problem, and nothing modified."""

import math
import re

import numpy as np
import pytest
import torch

from otb_ref import compute_advantages, compute_optimal_token_baseline_advantage
from otb_ref.estimators import ESTIMATORS

B, T = 4, 3


def _good():
    return dict(
        token_level_rewards=torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]),
        response_mask=torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32),
        index=[0, 0, 1, 1],
        old_log_probs=torch.full((B, T), -0.7),
        sum_pi_squared=torch.full((B, T), 0.4),
        grad_norms_sq=torch.ones(B),
        cumulative_energy=torch.ones(B, T),
    )


def _with(**changes):
    kwargs = _good()
    kwargs.update(changes)
    return kwargs


def _otb_inputs(good):
    return {k: good[k] for k in ("old_log_probs", "sum_pi_squared")}


# Log-probabilities whose energies differ from token to token and row to row (so that ε and the alignment matter).
_UNEQUAL_LOG_PROBS = torch.tensor([[-0.1, -2.0, -0.5], [-1.0, -0.3, -0.2], [-0.05, -1.5, -0.9], [-0.7, -0.7, -0.7]])


def _nan_at_valid(name):
    value = _good()[name].clone()
    value.view(-1)[0] = float("nan")
    return value


CASES = [
    ("otb", _with(response_mask=torch.ones(B, T + 1)), "response_mask", "shape"),
    ("otb", _with(response_mask=torch.full((B, T), 0.5)), "response_mask", "0 and 1"),
    ("otb", _with(token_level_rewards=torch.zeros(B)), "token_level_rewards", "shape"),
    ("otb", _with(token_level_rewards=_nan_at_valid("token_level_rewards")), "token_level_rewards", "non-finite"),
    ("otb", _with(old_log_probs=_nan_at_valid("old_log_probs")), "old_log_probs", "non-finite"),
    ("otb", _with(old_log_probs=torch.full((B, T), float("-inf"))), "old_log_probs", "non-finite"),
    ("otb", _with(old_log_probs=torch.full((B, T), 0.5)), "old_log_probs", "log-probability"),
    ("otb", _with(rollout_is_weights=torch.full((B, T), 1e20)), "rollout_is_weights", "finite"),
    ("otb", _with(response_mask=_good()["response_mask"].double() * (1 + 1e-12)), "response_mask", "0 and 1"),
    ("otb", _with(index=[0.0, 0.0, 1.0, 1.0]), "index", "float"),
    ("otb", _with(sum_pi_squared=torch.zeros(B, T)), "sum_pi_squared", r"\(0, 1"),
    ("otb", _with(sum_pi_squared=torch.full((B, T), 1.5)), "sum_pi_squared", r"\(0, 1"),
    ("otb", _with(sum_pi_squared=torch.full((B, T), -0.5)), "sum_pi_squared", r"\(0, 1"),
    ("otb", _with(sum_pi_squared=torch.full((B, T - 1), 0.5)), "sum_pi_squared", "shape"),
    ("otb", _with(rollout_is_weights=-torch.ones(B, T)), "rollout_is_weights", ">= 0"),
    (
        "otb",
        _with(rollout_is_weights=torch.ones(B, T).index_fill(1, torch.tensor([0]), float("nan"))),
        "rollout_is_weights",
        "non-finite",
    ),
    ("otb", _with(old_log_probs=None), "old_log_probs", "required"),
    ("sequence_proxy", _with(sum_pi_squared=None), "sum_pi_squared", "required"),
    ("eob", _with(grad_norms_sq=None), "grad_norms_sq", "required"),
    ("eob", _with(grad_norms_sq=-torch.ones(B)), "grad_norms_sq", ">= 0"),
    ("eob", _with(grad_norms_sq=torch.full((B,), float("inf"))), "grad_norms_sq", "non-finite"),
    ("eob", _with(grad_norms_sq=torch.ones(B + 1)), "grad_norms_sq", "shape"),
    ("otb_exact", _with(cumulative_energy=None), "cumulative_energy", "required"),
    ("otb_exact", _with(cumulative_energy=-torch.ones(B, T)), "cumulative_energy", ">= 0"),
    ("otb", _with(index=[0, 0, 1]), "index", "length"),
    ("otb", _with(index=[0, 0, 1, 1, 1]), "index", "length"),
    ("otb", _with(index=np.zeros(B + 2, dtype=int)), "index", "length"),
    ("otb", _with(index=torch.zeros(B)), "index", "integer"),
    ("otb", _with(index=[[0], [0], [1], [1]]), "index", "hashable"),
    ("otb", _with(index="0011"), "index", "expected"),
    ("otb", _with(epsilon=-1.0), "epsilon", "non-negative"),
    ("otb", _with(epsilon=float("nan")), "epsilon", "non-negative"),
    ("nope", _good(), "estimator", "unknown"),
    ("grpo", _with(multi_turn=True), "multi_turn", "token-level"),
    ("opo", _with(handle_zero_tail=True), "handle_zero_tail", "token-level"),
    ("grpo", _with(rollout_is_weights=torch.ones(B, T)), "rollout_is_weights", "per-token energies"),
    ("otb", _with(old_log_probs=torch.full((B, T), -1, dtype=torch.long)), "old_log_probs", "floating"),
]


@pytest.mark.parametrize("estimator,kwargs,name,problem", CASES, ids=[f"{c[2]}-{c[3]}" for c in CASES])
def test_bad_input_names_argument_and_leaves_inputs_untouched(estimator, kwargs, name, problem):
    """ValueError starts with the argument's name, says the problem, and no tensor changes."""
    snapshot = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    args = [kwargs.pop(k) for k in ("token_level_rewards", "response_mask", "index")]
    with pytest.raises(ValueError, match=rf"^{name}: .*{problem}"):
        compute_advantages(estimator, *args, **kwargs)
    after = dict(zip(("token_level_rewards", "response_mask", "index"), args), **kwargs)
    for key, value in snapshot.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True, msg=key)


def test_device_mismatch_is_named():
    """A tensor on another device is named (meta device stands in for a GPU on CPU-only CI)."""
    kwargs = _with(old_log_probs=torch.full((B, T), -0.7, device="meta"))
    args = [kwargs.pop(k) for k in ("token_level_rewards", "response_mask", "index")]
    with pytest.raises(ValueError, match="^old_log_probs: on device meta"):
        compute_advantages("otb", *args, **kwargs)


def test_unknown_keyword_is_rejected():
    """A misspelt input is an error, never silently ignored."""
    good = _good()
    with pytest.raises(TypeError, match="old_logprobs"):
        compute_advantages(
            "otb", good["token_level_rewards"], good["response_mask"], good["index"], old_logprobs=good["old_log_probs"]
        )


def test_verl_compatible_function_validates_too():
    good = _good()
    with pytest.raises(ValueError, match="^sum_pi_squared"):
        compute_optimal_token_baseline_advantage(
            good["token_level_rewards"],
            good["response_mask"],
            good["index"],
            good["old_log_probs"],
            torch.full((B, T), 2.0),
        )


@pytest.mark.parametrize("shape", [(B,), (B, T, 1)])
def test_rewards_must_be_batch_by_tokens(shape):
    good = _good()
    with pytest.raises(ValueError, match=r"^token_level_rewards: expected shape \[B, T\]"):
        compute_advantages("otb", torch.zeros(shape), good["response_mask"], good["index"])


@pytest.mark.parametrize("name", ["sum_pi_squared", "rollout_is_weights", "cumulative_energy"])
def test_a_later_input_is_checked_when_an_earlier_one_is_absent(name):
    """Each given token input is validated whatever the others are (here old_log_probs is not given)."""
    good = _good()
    with pytest.raises(ValueError, match=f"^{name}: shape"):
        compute_advantages(
            "grpo", good["token_level_rewards"], good["response_mask"], good["index"], **{name: torch.zeros(B, T + 1)}
        )


def test_verl_style_otb_functions_handle_the_zero_tail_by_default():
    """PORTING.md's defaults per entry point: the verl-interface OTB functions zero the tail unless told not to, and
    take ε = 1e-8."""
    from otb_ref import compute_multi_turn_optimal_token_baseline_advantage

    good = _good()
    args = [good[k] for k in ("token_level_rewards", "response_mask", "index", "old_log_probs", "sum_pi_squared")]
    for function in (compute_optimal_token_baseline_advantage, compute_multi_turn_optimal_token_baseline_advantage):
        default, _ = function(*args)
        with_tail, _ = function(*args, handle_zero_tail=True)
        without, _ = function(*args, handle_zero_tail=False)
        torch.testing.assert_close(default, with_tail, rtol=0, atol=0)
        assert not torch.equal(default, without), "the batch must have a zero tail for this test to mean anything"
    args[3] = _UNEQUAL_LOG_PROBS  # unequal energies, so that ε moves the baseline
    for function in (compute_optimal_token_baseline_advantage, compute_multi_turn_optimal_token_baseline_advantage):
        default, _ = function(*args)
        torch.testing.assert_close(default, function(*args, epsilon=1e-8)[0], rtol=0, atol=0)
        assert not torch.equal(default, function(*args, epsilon=1.0)[0]), "ε must matter on this batch"


def _holes():
    """_good() with a hole inside row 1 (multi-turn style) besides the padded tails; the inputs named by estimator."""
    good = _good()
    good["response_mask"][1] = torch.tensor([1.0, 0.0, 1.0])
    good["token_level_rewards"][1] = torch.tensor([0.0, 0.0, 1.0])
    good["rollout_is_weights"] = torch.full((B, T), 1.5)
    return good


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_any_value_off_the_mask_is_ignored(estimator):
    """Out-of-range values where the mask is 0 (inf rewards, NaN log-probs, Σπ² = 0, negative energies and IS
    weights) neither raise nor change the outputs: the second check round looks at the valid entries only."""
    good = _holes()
    off = good["response_mask"] == 0
    garbage = {
        "token_level_rewards": float("inf"),
        "old_log_probs": float("nan"),
        "sum_pi_squared": 0.0,
        "cumulative_energy": -1.0,
        "rollout_is_weights": -1.0,
    }
    spec = ESTIMATORS[estimator]
    names = ["old_log_probs", "sum_pi_squared", "grad_norms_sq", "cumulative_energy"]
    names += ["rollout_is_weights"] if spec.energy in ("length", "proxy") else []
    clean = {k: good[k] for k in names}
    dirty = {k: v.masked_fill(off, garbage[k]) if k in garbage else v for k, v in clean.items()}
    args = good["response_mask"], good["index"]
    want, want_returns = compute_advantages(estimator, good["token_level_rewards"], *args, **clean)
    rewards = good["token_level_rewards"].masked_fill(off, garbage["token_level_rewards"])
    got, got_returns = compute_advantages(estimator, rewards, *args, **dirty)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_returns * ~off, want_returns * ~off, rtol=0, atol=0)


@pytest.mark.parametrize("batch_size, length", [(3, 5), (1, 1)])
def test_is_weights_bound_is_the_largest_whose_squared_sums_stay_finite(batch_size, length):
    """The rule the error states: ρ̄ <= √(max(dtype) / (4 B T)), so that ρ̄² × w (w <= 2) summed over every token
    of the batch stays finite. Just below the bound is accepted, just above it refused."""
    bound = math.sqrt(torch.finfo(torch.float32).max / (4.0 * batch_size * length))
    rewards, mask = torch.ones(batch_size, length), torch.ones(batch_size, length)
    inputs = dict(old_log_probs=torch.full((batch_size, length), -0.7), sum_pi_squared=torch.full_like(mask, 0.4))
    rule = re.escape(f"outside [0.0, {bound!r}] (must be >= 0, and <= {bound:.3g}")
    below, above = (torch.full((batch_size, length), factor * bound) for factor in (0.99, 1.01))
    advantages, _ = compute_advantages("otb", rewards, mask, [0] * batch_size, rollout_is_weights=below, **inputs)
    assert bool(torch.isfinite(advantages).all())
    with pytest.raises(ValueError, match=f"^rollout_is_weights: .*{rule}"):
        compute_advantages("otb", rewards, mask, [0] * batch_size, rollout_is_weights=above, **inputs)


@pytest.mark.parametrize("outlier", [2.0, -1.0, 3.0, -2.0])
def test_a_mask_with_an_integer_outside_0_1_is_refused(outlier):
    """Σ frac(m) = 0 holds for every integer entry: the binary test rests on min ≥ 0 and max ≤ 1 for an otherwise
    binary mask with one entry of 2, −1, 3 or −2."""
    mask = torch.ones(B * T)
    mask[1], mask[2] = 0.0, outlier
    mask = mask.reshape(B, T)
    assert float(torch.frac(mask).sum()) == 0.0
    good = _good()
    with pytest.raises(ValueError, match="^response_mask: .*0 and 1"):
        compute_advantages("otb", good["token_level_rewards"], mask, good["index"], **_otb_inputs(good))


@pytest.mark.parametrize("outlier, halves", [(2.0, 8), (-0.5, 3)])
def test_a_mask_whose_non_binary_terms_cancel_is_refused(outlier, halves):
    """Σ m(1 − m) = 0 means binary only when every entry lies in [0, 1]: entries of 0.5 (+0.25 each) and one of 2
    (−2) or of −0.5 (−0.75) also sum to 0 and must be refused."""
    mask = torch.ones(B * T)
    mask[:halves], mask[halves] = 0.5, outlier
    mask = mask.reshape(B, T)
    assert float((mask * (1 - mask)).sum()) == 0.0
    good = _good()
    with pytest.raises(ValueError, match="^response_mask: .*0 and 1"):
        compute_advantages("otb", good["token_level_rewards"], mask, good["index"], **_otb_inputs(good))


def test_the_four_leading_arguments_take_keywords_and_the_inputs_only_keywords():
    """compute_advantages(estimator, token_level_rewards, response_mask, index, *, inputs...): the leading four may
    be named (as verl's callers do); an input passed by position is refused rather than bound to the wrong name."""
    good = _good()
    inputs = _otb_inputs(good)
    leading = {k: good[k] for k in ("token_level_rewards", "response_mask", "index")}
    by_name, _ = compute_advantages(estimator="otb", **leading, **inputs)
    by_position, _ = compute_advantages("otb", *leading.values(), **inputs)
    torch.testing.assert_close(by_name, by_position, rtol=0, atol=0)
    with pytest.raises(TypeError):
        compute_advantages("otb", *leading.values(), *inputs.values())


def test_the_multi_turn_verl_function_compares_generated_token_ranks():
    """compute_multi_turn_optimal_token_baseline_advantage is compute_advantages("otb", multi_turn=True), which on a
    batch with a hole inside a response differs from comparing absolute positions."""
    from otb_ref import compute_multi_turn_optimal_token_baseline_advantage

    good = _holes()
    good["token_level_rewards"] = torch.tensor([[0.3, 0.0, 1.0], [0.5, 0.0, 0.2], [0.0, 0.4, 0.0], [1.0, 0.0, 0.0]])
    good["old_log_probs"] = _UNEQUAL_LOG_PROBS
    args = [good[k] for k in ("token_level_rewards", "response_mask", "index")]
    inputs = _otb_inputs(good)
    got, _ = compute_multi_turn_optimal_token_baseline_advantage(*args, **inputs)
    want, _ = compute_advantages("otb", *args, **inputs, multi_turn=True, handle_zero_tail=True)
    by_position, _ = compute_advantages("otb", *args, **inputs, multi_turn=False, handle_zero_tail=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, by_position), "the hole must matter on this batch"
