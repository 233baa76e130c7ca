"""Promises of otb_ref.exact that no formula test checks (issue 42): the norms are ordinary tensors even under
inference mode, a warning about the model names the caller's line, small enumerations keep their scores by default
(at most 2**23 numbers), and the random policies' defaults are fixed."""

import pytest
import torch
from torch import nn

from otb_ref.exact import SharedPolicy, TreePolicy, enumerate_policy, group_moments
from otb_ref.exact.grad_norms import prefix_grad_norms_sq_fp64, sequence_grad_norms_sq_fp64
from otb_ref.exact.policies import keeps_scores


class TinyLM(nn.Module):
    """Embedding, one linear layer, a head; ``cast`` (a tensor type) casts the logits, out of the float64 mode's
    reach (a tensor type, not a dtype)."""

    def __init__(self, cast=None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen)
        self.cast = cast

    def forward(self, input_ids, attention_mask=None):
        logits = self.head(torch.tanh(self.mix(self.embed(input_ids))).cumsum(dim=1))
        return logits if self.cast is None else logits.type(self.cast)


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 1, 2]])
RESPONSE = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])


@pytest.mark.parametrize("norms", [sequence_grad_norms_sq_fp64, prefix_grad_norms_sq_fp64])
def test_exact_norms_are_ordinary_tensors_even_under_inference_mode(norms):
    expected = norms(TinyLM(), IDS, RESPONSE)
    assert not expected.is_inference()
    with torch.inference_mode():
        got = norms(TinyLM(), IDS, RESPONSE)
    assert not got.is_inference()
    got.mul_(2.0)  # in place, outside inference mode: refused for an inference tensor
    torch.testing.assert_close(got, 2.0 * expected, rtol=1e-12, atol=0)


def test_a_float32_logits_warning_names_the_callers_line():
    with pytest.warns(UserWarning, match="the float64 copy produced torch.float32 logits") as record:
        sequence_grad_norms_sq_fp64(TinyLM(cast=torch.FloatTensor), IDS, RESPONSE)
    assert {w.filename for w in record if "float64 copy" in str(w.message)} == {__file__}


def test_default_keeps_the_scores_up_to_2_to_the_23_numbers():
    for sizes in ((2**23, 1, 1), (2**10, 2**5, 2**8), (3, 5, 7), (1, 1, 1)):
        assert keeps_scores(*sizes), sizes
    for sizes in ((2**23 + 1, 1, 1), (2**10, 2**5, 2**8 + 1), (2**12, 2**12, 1), (3, 2**22, 1)):
        assert not keeps_scores(*sizes), sizes


@pytest.mark.parametrize("policy", [TreePolicy(3, 2), SharedPolicy(3, 3)])
def test_small_enumerations_keep_their_scores_for_group_moments(policy):
    enum = enumerate_policy(policy)
    num_rows, length = enum.tokens.shape
    assert enum.scores is not None and enum.scores.shape == (num_rows, length, policy.theta.numel())
    rewards = enum.mask * torch.arange(num_rows, dtype=torch.float64)[:, None]
    assert torch.isfinite(torch.as_tensor(group_moments(enum, rewards, "otb", 2).variance)).all()
    assert enumerate_policy(policy, keep_scores=False).scores is None


def test_the_random_policies_defaults_are_fixed():
    torch.testing.assert_close(TreePolicy(3, 2).theta, TreePolicy(3, 2, eos=True, scale=1.0, seed=0).theta)
    torch.testing.assert_close(SharedPolicy(3, 2).theta, SharedPolicy(3, 2, eos=True, width=3, scale=1.0, seed=0).theta)
    assert TreePolicy(3, 2).theta.numel() == (1 + 2) * 3  # prefixes of length 0 and 1 (two non-EOS tokens), V each
    assert SharedPolicy(3, 2).theta.numel() == 4 * 3 + 2 * 3 + 3 * 3 + 3  # E, P, U, b with width 3
    assert not torch.equal(TreePolicy(3, 2).theta, TreePolicy(3, 2, seed=1).theta)
