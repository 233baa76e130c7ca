"""Hypothesis strategies shared by the tests (small shapes, float64 unless said)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st


@dataclass
class RolloutBatch:
    """A synthetic batch of responses with everything an estimator may read."""

    rewards: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float 0/1
    index: list  # B ids
    old_log_probs: torch.Tensor  # [B, T]
    sum_pi_squared: torch.Tensor  # [B, T]
    rollout_is_weights: torch.Tensor  # [B, T]
    grad_norms_sq: torch.Tensor  # [B]
    cumulative_energy: torch.Tensor  # [B, T]

    @property
    def inputs(self) -> dict:
        return {
            "old_log_probs": self.old_log_probs,
            "sum_pi_squared": self.sum_pi_squared,
            "grad_norms_sq": self.grad_norms_sq,
            "cumulative_energy": self.cumulative_energy,
        }


def _consistent_probabilities(rng: np.random.Generator, shape: tuple[int, int], vocab: int, uniform_mix: float = 0.01):
    """Sampled-token log-probs and Σπ² of real softmax distributions."""
    logits = rng.normal(size=(*shape, vocab)) * rng.uniform(0.1, 4.0)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    # 1% uniform mixture: π_y <= 0.9975, so every energy is >= (1 - π_y)² > 6e-6 and
    # fp64 rounding of tiny energies cannot dominate a weighted mean (see TOL in the tests).
    probs = (1 - uniform_mix) * probs + uniform_mix / vocab
    tokens = np.array([[rng.choice(vocab, p=p) for p in row] for row in probs]).reshape(shape)
    pi_y = np.take_along_axis(probs, tokens[..., None], -1)[..., 0]
    return np.log(pi_y), (probs**2).sum(-1)


@st.composite
def rollout_batches(
    draw,
    max_groups: int = 4,
    max_group_size: int = 6,
    max_length: int = 7,
    holes: bool = True,
    dense_rewards: bool = True,
    string_ids: bool | None = None,
    allow_empty: bool = True,
    equal_lengths: bool = False,
    uniform_mix: float = 0.01,
) -> RolloutBatch:
    """Groups of 1..max_group_size responses with variable lengths, holes, rewards and energies."""
    num_groups = draw(st.integers(1, max_groups))
    sizes = [draw(st.integers(1, max_group_size)) for _ in range(num_groups)]
    length = draw(st.integers(1, max_length))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    batch = sum(sizes)
    min_len = 0 if allow_empty else 1
    if equal_lengths:
        lengths = np.full(batch, length)
    else:
        lengths = rng.integers(min_len, length + 1, size=batch)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)
    if holes and draw(st.booleans()):
        # Tool output inside a response: zero some interior positions.
        interior = rng.random(mask.shape) < 0.25
        mask = np.where(interior & (np.arange(length)[None, :] < lengths[:, None] - 1), 0.0, mask)
    if dense_rewards and draw(st.booleans()):
        rewards = rng.normal(size=mask.shape) * mask
    else:
        # Outcome reward at the last valid token.
        rewards = np.zeros(mask.shape)
        outcome = rng.choice([0.0, 1.0, rng.normal()], size=batch)
        for i in range(batch):
            valid = np.flatnonzero(mask[i])
            if valid.size:
                rewards[i, valid[-1]] = outcome[i]
    log_probs, sum_pi_squared = _consistent_probabilities(rng, mask.shape, int(rng.integers(2, 6)), uniform_mix)
    use_strings = draw(st.booleans()) if string_ids is None else string_ids
    labels = rng.permutation(num_groups * 7)[:num_groups]
    index = [
        f"prompt-{labels[g]}" if use_strings else int(labels[g]) for g in range(num_groups) for _ in range(sizes[g])
    ]
    order = rng.permutation(batch)  # groups interleaved, as after shuffling
    t = lambda x: torch.tensor(np.asarray(x)[order], dtype=torch.float64)  # noqa: E731
    return RolloutBatch(
        rewards=t(rewards),
        mask=t(mask),
        index=[index[i] for i in order],
        old_log_probs=t(log_probs),
        sum_pi_squared=t(sum_pi_squared),
        rollout_is_weights=t(rng.uniform(0.0, 2.0, size=mask.shape)),
        grad_norms_sq=t(rng.exponential(size=batch) * (rng.random(batch) > 0.1)),
        cumulative_energy=t(rng.exponential(size=mask.shape)),
    )


def logits_tensors(max_rows: int = 6, max_vocab: int = 9):
    """Logit matrices ``[rows, V]`` of mixed scale, as float64."""

    @st.composite
    def build(draw):
        rows = draw(st.integers(1, max_rows))
        vocab = draw(st.integers(1, max_vocab))
        scale = draw(st.sampled_from([1e-3, 1.0, 10.0, 1e3, 1e4]))
        seed = draw(st.integers(0, 2**32 - 1))
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * scale

    return build()


@dataclass
class PolicyCase:
    """A small enumerable policy with rewards of every response."""

    enum: object  # otb_ref.exact.policies.Enumeration
    rewards: torch.Tensor  # [M, L]
    outcome: bool


@st.composite
def policy_cases(
    draw,
    kinds=("tree", "shared"),
    max_vocab: int = 4,
    max_horizon: int = 4,
    outcome=None,
    eos=None,
    max_responses: int = 400,
):
    """A tree or shared policy (vocab 2..max_vocab with EOS, horizon 1..max_horizon) with outcome or dense rewards."""
    from otb_ref.exact.policies import SharedPolicy, TreePolicy, enumerate_policy

    kind = draw(st.sampled_from(kinds))
    use_eos = draw(st.booleans()) if eos is None else eos
    vocab = draw(st.integers(2, max_vocab))
    horizon = draw(st.integers(1, max_horizon))
    while (vocab**horizon if not use_eos else vocab * (vocab - 1) ** max(horizon - 1, 0) + horizon) > max_responses:
        horizon -= 1
    horizon = max(horizon, 1)
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.3, 1.0, 2.0]))
    policy = (TreePolicy if kind == "tree" else SharedPolicy)(vocab, horizon, eos=use_eos, scale=scale, seed=seed)
    enum = enumerate_policy(policy, keep_scores=True)
    use_outcome = draw(st.booleans()) if outcome is None else outcome
    rng = np.random.default_rng(seed)
    num = enum.tokens.shape[0]
    if use_outcome:
        from otb_ref.exact.moments import outcome_rewards

        values = rng.choice([0.0, 1.0, rng.normal()], size=num)
        rewards = outcome_rewards(enum, torch.tensor(values))
    else:
        # Dense token rewards must be causal: r_t is a function of y_1..y_t (a random table over prefixes).
        table: dict = {}
        rewards = torch.zeros_like(enum.mask)
        for y in range(num):
            for t in range(int(enum.mask[y].sum())):
                key = tuple(enum.tokens[y, : t + 1].tolist())
                rewards[y, t] = table.setdefault(key, float(rng.normal()))
    return PolicyCase(enum, rewards, use_outcome)
