"""Small autoregressive policies whose every response can be enumerated (THEORY §1).

A policy has a vocabulary of ``V`` tokens, token 0 being EOS (unless
``eos=False``: then every response has exactly ``L`` tokens), and a horizon
``L``. A response is ``y_1..y_T``, ending at the first EOS (included, with
``m_T = 1``) or cut at ``L``. Parameters are one flat float64 vector ``θ [P]``
so that ``torch.func`` gives per-token scores ``s_t = ∇_θ log π(y_t | h_t)``.

Two kinds:

* :class:`TreePolicy` — tabular: every prefix ``h`` owns its logit vector
  ``θ_h ∈ R^V``. Distinct prefixes of one response use disjoint parameters,
  so ``||S_t||² = Σ_{j≤t} ||s_j||²`` exactly and the proxy is exact (F6a).
* :class:`SharedPolicy` — parameter-shared: ``logits_t = U tanh(E[y_{t−1}] +
  P_t) + b``. Scores of different positions overlap, the proxy is not exact.

:func:`enumerate_policy` lists every response with its probability, proxy
energies and the within-response score Gram matrix ``K[t, u] = <s_t, s_u>``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch.func import jacrev, vmap

from otb_ref.proxy import token_energy

__all__ = ["TreePolicy", "SharedPolicy", "Enumeration", "enumerate_policy", "enumerate_responses", "keeps_scores"]

EOS = 0


def enumerate_responses(vocab: int, horizon: int, eos: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every response: ``(tokens [M, L] int64, mask [M, L] float64)``; padding is token 0 with mask 0."""
    if vocab < 2 or horizon < 1:
        raise ValueError(f"vocab: need >= 2 tokens and horizon >= 1, got vocab={vocab}, horizon={horizon}")
    rows: list[list[int]] = []
    if not eos:
        rows = [list(seq) for seq in itertools.product(range(vocab), repeat=horizon)]
    else:
        words = range(1, vocab)
        for length in range(1, horizon):  # ends with EOS before the horizon
            rows += [list(seq) + [EOS] for seq in itertools.product(words, repeat=length - 1)]
        rows += [list(seq) + [last] for seq in itertools.product(words, repeat=horizon - 1) for last in range(vocab)]
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.zeros((len(rows), horizon), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    mask = (torch.arange(horizon)[None, :] < lengths[:, None]).to(torch.float64)
    return tokens, mask


@dataclass
class TreePolicy:
    """Tabular policy: prefix ``h`` (of non-EOS tokens) owns logits ``θ_h ∈ R^V``, drawn ``N(0, scale²)`` from
    ``torch.Generator().manual_seed(seed)``; the defaults (``eos=True``, ``scale=1.0``, ``seed=0``) are part of the
    API: ``TreePolicy(V, L)`` is always the same policy."""

    vocab: int
    horizon: int
    eos: bool = True
    scale: float = 1.0
    seed: int = 0
    theta: torch.Tensor = field(init=False)

    def __post_init__(self):
        base = self.vocab - 1 if self.eos else self.vocab
        self._base = base
        self._offsets = [sum(base**k for k in range(t)) for t in range(self.horizon + 1)]
        generator = torch.Generator().manual_seed(self.seed)
        num_prefixes = self._offsets[self.horizon]
        self.theta = torch.randn(num_prefixes * self.vocab, generator=generator, dtype=torch.float64) * self.scale

    def logits(self, theta: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[..., L] -> [..., L, V]``: logits at each position, teacher-forced."""
        table = theta.view(-1, self.vocab)  # [num_prefixes, V]
        digits = (tokens - 1 if self.eos else tokens).clamp(min=0)  # after EOS: masked anyway
        code = torch.zeros_like(tokens[..., 0])
        prefix_ids = []
        for t in range(self.horizon):  # Horner: code of (y_1..y_{t-1}) in base V−1 (or V)
            prefix_ids.append(self._offsets[t] + code)
            code = code * self._base + digits[..., t]
        prefix = torch.stack(prefix_ids, dim=-1).clamp(max=table.shape[0] - 1)  # [..., L]
        return table[prefix]


@dataclass
class SharedPolicy:
    """Parameter-shared policy ``logits_t = U tanh(E[y_{t−1}] + P_t) + b`` (``y_0`` = BOS), θ drawn as in
    :class:`TreePolicy`; the defaults (``eos=True``, ``width=3``, ``scale=1.0``, ``seed=0``) are part of the API."""

    vocab: int
    horizon: int
    eos: bool = True
    width: int = 3
    scale: float = 1.0
    seed: int = 0
    theta: torch.Tensor = field(init=False)

    def __post_init__(self):
        v, d, L = self.vocab, self.width, self.horizon
        self._shapes = {"E": (v + 1, d), "P": (L, d), "U": (v, d), "b": (v,)}
        size = sum(torch.Size(s).numel() for s in self._shapes.values())
        generator = torch.Generator().manual_seed(self.seed)
        self.theta = torch.randn(size, generator=generator, dtype=torch.float64) * self.scale

    def _unpack(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, shape in self._shapes.items():
            n = torch.Size(shape).numel()
            out[name] = theta[start : start + n].view(shape)
            start += n
        return out

    def logits(self, theta: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        w = self._unpack(theta)
        bos = torch.full_like(tokens[..., :1], self.vocab)
        previous = torch.cat([bos, tokens[..., :-1]], dim=-1)  # [..., L]
        hidden = torch.tanh(w["E"][previous] + w["P"])  # [..., L, d]
        return hidden @ w["U"].T + w["b"]  # [..., L, V]


@dataclass
class Enumeration:
    """Every response of a policy with the exact quantities the estimators need (float64)."""

    policy: TreePolicy | SharedPolicy
    tokens: torch.Tensor  # [M, L] int64
    mask: torch.Tensor  # [M, L] m_t
    probs: torch.Tensor  # [M] P(y)
    log_probs: torch.Tensor  # [M, L] log π(y_t | h_t), 0 off the mask
    sum_pi_squared: torch.Tensor  # [M, L] Σ_v π_v², 1 off the mask
    energy: torch.Tensor  # [M, L] proxy w_t = 1 − 2π_t + Σπ², 0 off the mask (F6)
    gram: torch.Tensor  # [M, L, L] K[t, u] = m_t m_u <s_t, s_u>
    scores: torch.Tensor | None  # [M, L, P] s_t (kept when small enough), 0 off the mask

    @property
    def num_params(self) -> int:
        return self.policy.theta.numel()

    @property
    def token_energy_exact(self) -> torch.Tensor:
        """``[M, L]``: ``||s_t||²``."""
        return torch.diagonal(self.gram, dim1=1, dim2=2)

    @property
    def prefix_energy_exact(self) -> torch.Tensor:
        """``[M, L]``: ``||S_t||² = Σ_{j,k≤t} <s_j, s_k>`` (0 off the mask)."""
        cumulative = self.gram.cumsum(1).cumsum(2)
        return torch.diagonal(cumulative, dim1=1, dim2=2) * self.mask

    @property
    def sequence_energy_exact(self) -> torch.Tensor:
        """``[M]``: ``||S||²``."""
        return self.gram.sum(dim=(1, 2))

    @property
    def prefix_energy_proxy(self) -> torch.Tensor:
        """``[M, L]``: realized energy ``W_t = Σ_{j≤t} m_j w_j`` (0 off the mask)."""
        return self.energy.cumsum(-1) * self.mask

    def score_sum(self, coefficients: torch.Tensor) -> torch.Tensor:
        """``Σ_y Σ_t c[y, t] s_t(y)`` as a ``[P]`` vector, by one backward pass.

        With ``c = P(y) a_t(y)`` this is ``E[Σ_t a_t s_t]``, the mean of an estimator.
        """
        theta = self.policy.theta.detach().clone().requires_grad_(True)
        log_probs = _token_log_probs(self.policy, theta, self.tokens)  # [M, L]
        (grad,) = torch.autograd.grad((coefficients.detach() * self.mask * log_probs).sum(), theta)
        return grad

    def gram_quadratic(self, advantages: torch.Tensor) -> torch.Tensor:
        """``[M]``: ``||Σ_t a_t s_t(y)||² = a_yᵀ K_y a_y`` for every response."""
        return torch.einsum("mt,mtu,mu->m", advantages, self.gram, advantages)


def _token_log_probs(policy, theta: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log π(y_t | h_t)`` for every position: ``[..., L]``."""
    log_softmax = torch.log_softmax(policy.logits(theta, tokens), dim=-1)
    return log_softmax.gather(-1, tokens[..., None]).squeeze(-1)


# Keep per-token scores [M, L, P] when they take at most this many float64 elements.
_MAX_SCORE_ELEMENTS = 1 << 23
_JACOBIAN_CHUNK_ELEMENTS = 1 << 22


def keeps_scores(num_rows: int, length: int, num_params: int) -> bool:
    """Whether :func:`enumerate_policy` keeps the scores ``[M, L, P]`` by default: at most 2**23 numbers."""
    return num_rows * length * num_params <= _MAX_SCORE_ELEMENTS


def enumerate_policy(policy: TreePolicy | SharedPolicy, keep_scores: bool | None = None) -> Enumeration:
    """Enumerate every response of ``policy`` with probabilities, proxy energies and score Gram matrices.

    Scores come from ``torch.func`` (``vmap`` over responses of ``jacrev`` of
    the per-token log-probabilities), chunked so that at most a few million
    float64 numbers exist at once. ``keep_scores`` keeps ``s_t`` for every
    response, needed by finite-group moments; by default it is kept when the
    scores take at most 2**23 float64 numbers (64 MiB; :func:`keeps_scores`).
    """
    tokens, mask = enumerate_responses(policy.vocab, policy.horizon, policy.eos)
    theta = policy.theta.detach()
    with torch.no_grad():
        logits = policy.logits(theta, tokens)  # [M, L, V]
        log_softmax = torch.log_softmax(logits, dim=-1)
        log_probs = log_softmax.gather(-1, tokens[..., None]).squeeze(-1) * mask  # [M, L]
        probs = torch.exp(log_probs.sum(-1))  # [M]
        sum_pi_squared = torch.where(mask > 0, log_softmax.exp().square().sum(-1), 1.0)  # [M, L]
        energy = token_energy(log_probs, sum_pi_squared) * mask

    num_rows, length = tokens.shape
    num_params = theta.numel()
    if keep_scores is None:
        keep_scores = keeps_scores(num_rows, length, num_params)
    per_row = lambda th, row: _token_log_probs(policy, th, row)  # noqa: E731  [L]
    jacobian = vmap(jacrev(per_row), in_dims=(None, 0))  # [c, L, P]
    chunk = max(1, _JACOBIAN_CHUNK_ELEMENTS // (length * num_params))
    grams, kept = [], []
    for start in range(0, num_rows, chunk):
        scores = jacobian(theta, tokens[start : start + chunk]) * mask[start : start + chunk, :, None]
        grams.append(scores @ scores.transpose(1, 2))  # [c, L, L]
        if keep_scores:
            kept.append(scores)
    gram = torch.cat(grams)
    return Enumeration(
        policy=policy,
        tokens=tokens,
        mask=mask,
        probs=probs,
        log_probs=log_probs,
        sum_pi_squared=sum_pi_squared,
        energy=energy,
        gram=gram,
        scores=torch.cat(kept) if keep_scores else None,
    )
