"""The README's first snippet ("1. Advantages in your trainer") runs as printed, on a tiny random Qwen2, and gives
what the README says: no graph (forward only), and compute_advantages' OTB of the response part, which equals the
readable statement of OTB fed with a plain softmax over the full logits."""

import re
from pathlib import Path

import torch

from otb_ref.readable import otb_advantages
from otb_train.tiny_models import tiny_causal_lm

ROOT = Path(__file__).resolve().parents[1]


def _snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**1. Advantages in your trainer**") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_trainer_snippet_runs_and_gives_otb_of_the_response():
    B, P, T = 4, 3, 5
    model = tiny_causal_lm(seed=0, vocab_size=32, hidden_size=32, num_attention_heads=2)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 32, (B, P + T), generator=generator)
    response_mask = torch.ones(B, T)
    response_mask[1, 3:] = 0  # a shorter response
    token_level_rewards = torch.zeros(B, T)
    token_level_rewards[torch.arange(B), response_mask.sum(1).long() - 1] = torch.tensor([1.0, 0.0, 0.5, 1.0])
    names = dict(model=model, input_ids=input_ids, P=P, token_level_rewards=token_level_rewards,
                 response_mask=response_mask, prompt_ids=[0, 0, 1, 1])  # fmt: skip
    exec(_snippet(), names)
    advantages, old_log_probs = names["advantages"], names["old_log_probs"]
    assert advantages.shape == (B, T) and not old_log_probs.requires_grad  # "forward only"
    with torch.no_grad():
        probs = model(input_ids).logits[:, P - 1 : -1].double().softmax(-1)  # the T response predictions
    log_pi_y = probs.gather(-1, input_ids[:, P:, None]).squeeze(-1).log()
    expected = otb_advantages(token_level_rewards, response_mask, torch.tensor([0, 0, 1, 1]), log_pi_y,
                              probs.square().sum(-1))  # fmt: skip
    torch.testing.assert_close(advantages.double(), expected, rtol=1e-5, atol=1e-6)  # fp32 head vs fp64 softmax
