"""The chunked LM head's check of the model's own logits (issue 42): it runs the model and its decoder on one row
with that row's attention mask, so a model that refuses a mask whose shape is not its input's (as many decoders
do) passes the check, and the norms are the exact ones."""

import pytest
import torch
from torch import nn

from otb_ref.exact import sequence_grad_norms_sq_fp64 as exact_norms
from otb_ref.grad_norms import sequence_grad_norms_sq


class MaskCheckingLM(nn.Module):
    """A causal LM whose decoder refuses an attention mask of another shape than its input ids, and uses it."""

    def __init__(self, vocab: int = 13, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def decode(self, input_ids, attention_mask=None):
        if attention_mask is None or attention_mask.shape != input_ids.shape:
            shape = None if attention_mask is None else tuple(attention_mask.shape)
            raise ValueError(f"attention_mask of shape {shape} for input_ids of shape {tuple(input_ids.shape)}")
        x = self.embed(input_ids) * attention_mask[..., None].to(self.embed.weight.dtype)
        return (x + torch.tanh(self.mix(x)).cumsum(dim=1),)

    def get_decoder(self):
        return self.decode

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.decode(input_ids, attention_mask)[0])


@pytest.mark.parametrize("rows", [1, 3])
def test_chunked_lm_head_checks_the_logits_of_a_model_that_validates_its_mask(rows):
    gen = torch.Generator().manual_seed(42)
    torch.manual_seed(42)
    model = MaskCheckingLM().double()
    ids = torch.randint(0, 13, (rows, 7), generator=gen)
    attention = torch.ones(rows, 7, dtype=torch.long)
    attention[0, :2] = 0  # left padding on the row the check runs
    response = torch.zeros(rows, 7)
    response[:, 4:] = 1
    got = sequence_grad_norms_sq(model, ids, response, attention, chunked_lm_head=True, chunk_size=4)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response, attention), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="attention_mask of shape"):  # the model's own refusal, for comparison
        model(ids, attention[:, :-1])
