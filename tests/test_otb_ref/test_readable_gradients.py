"""Gradients through otb_ref.readable (issue 42): its advantages are linear in the rewards, with finite gradients
everywhere, even where a baseline's denominator or a mean's count is 0 (ε = 0 with zero energies, a position no
member reaches, a leave-one-out group of one). The placeholder divisors of its ``torch.where``s are there for this:
a divisor of 0 in the branch not taken leaves the forward values alone but makes the backward NaN."""

import pytest
import torch

from otb_ref import ESTIMATORS, readable

# Group 0: rows 0-2, lengths 3, 2, 1 with a hole (position 3 reached by none of them); group 1: row 3 alone.
INDEX = [0, 0, 0, 1]
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
# π(y) = 1 and Σπ² = 1: every token's energy 1 − 2π(y) + Σπ² is 0.
CERTAIN = dict(
    old_log_probs=torch.zeros(4, 4, dtype=torch.float64), sum_pi_squared=torch.ones(4, 4, dtype=torch.float64)
)


def _jacobian_by_basis(advantages) -> torch.Tensor:
    """[B·T, B·T]: column k is the advantages of the k-th unit reward (they are linear in the rewards)."""
    columns = []
    for k in range(MASK.numel()):
        unit = torch.zeros(MASK.numel(), dtype=torch.float64)
        unit[k] = 1.0
        columns.append(advantages(unit.view_as(MASK)).flatten())
    return torch.stack(columns, dim=1)


def _check_gradient(advantages) -> None:
    rewards = torch.linspace(-1.0, 2.0, MASK.numel(), dtype=torch.float64).view_as(MASK).requires_grad_()
    weights = torch.linspace(0.5, 1.5, MASK.numel(), dtype=torch.float64).view_as(MASK)
    (grad,) = torch.autograd.grad((advantages(rewards) * weights).sum(), rewards)
    assert torch.isfinite(grad).all(), grad
    expected = (_jacobian_by_basis(lambda r: advantages(r).detach()).T @ weights.flatten()).view_as(MASK)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_otb_advantages_gradient_is_finite_at_zero_energy_and_zero_epsilon(leave_one_out):
    _check_gradient(
        lambda r: readable.otb_advantages(r, MASK, INDEX, **CERTAIN, leave_one_out=leave_one_out, epsilon=0.0)
    )


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_readable_advantages_gradient_is_finite_at_zero_energy_and_zero_epsilon(name, leave_one_out):
    inputs = dict(CERTAIN, grad_norms_sq=torch.zeros(4, dtype=torch.float64), cumulative_energy=torch.zeros_like(MASK))
    _check_gradient(
        lambda r: readable.advantages(
            name, r, MASK, INDEX, **inputs, leave_one_out=leave_one_out, std_normalize=False, epsilon=0.0
        )[0]
    )
