"""Bad input: a ValueError naming the argument and the problem, and nothing modified."""

import numpy as np
import pytest
import torch

from otb_ref import compute_advantages, compute_optimal_token_baseline_advantage

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
    """PORTING.md's defaults per entry point: the verl-interface OTB functions zero the tail unless told not to."""
    from otb_ref import compute_multi_turn_optimal_token_baseline_advantage

    good = _good()
    args = [good[k] for k in ("token_level_rewards", "response_mask", "index", "old_log_probs", "sum_pi_squared")]
    for function in (compute_optimal_token_baseline_advantage, compute_multi_turn_optimal_token_baseline_advantage):
        default, _ = function(*args)
        with_tail, _ = function(*args, handle_zero_tail=True)
        without, _ = function(*args, handle_zero_tail=False)
        torch.testing.assert_close(default, with_tail, rtol=0, atol=0)
        assert not torch.equal(default, without), "the batch must have a zero tail for this test to mean anything"
