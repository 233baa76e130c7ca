"""otb_ref.grad_norms: every response's ||S||² in one forward + backward equals the exact per-row gradients.

The reference is otb_ref.exact.sequence_grad_norms_sq_fp64 (a torch.func gradient per row on a float64 copy with
float32 islands promoted). The models here are float64; the one-pass result is float32 (accumulated in
float64), so the tolerance is 1e-6 relative: float32 rounding of the result (6e-8) plus transformers' float32
islands inside a float64 forward (RMSNorm, rotary, softmax: ~1e-8 relative, see otb_ref.exact.grad_norms).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from otb_ref import grad_norms
from otb_ref.exact import sequence_grad_norms_sq_fp64 as exact_norms
from otb_ref.grad_norms import embedding_norms_sq, linear_weight_norms_sq, row_grad_norms_sq, sequence_grad_norms_sq
from otb_train.tiny_models import tiny_causal_lm  # a leaf module: torch and transformers only

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-6


def enable_hf_activation_checkpointing(model: nn.Module) -> None:
    """transformers' own non-reentrant activation checkpointing of ``model``'s layers:
    ``activation_checkpointing_enable`` from transformers 5.23 on, ``gradient_checkpointing_enable`` before (as
    otb_train.model does; not imported from there, so that these tests need otb_ref only)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def tiny_lm(family: str, tied: bool, seed: int = 0, **extra) -> nn.Module:
    sizes = dict(vocab_size=29, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return tiny_causal_lm(family, seed, **sizes, tie_word_embeddings=tied, **extra).double()


def padded_batch(seed: int = 0, vocab: int = 29):
    """Rows with left padding, right padding, holes, an empty response and variable prompt/response lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (6, 11), generator=gen)
    attention = torch.ones(6, 11, dtype=torch.long)
    response = torch.zeros(6, 11)
    response[0, 4:] = 1  # prompt 4, response 7
    attention[1, :3] = 0  # left padding 3, prompt 3
    response[1, 6:] = 1
    attention[2, 8:] = 0  # right padding
    response[2, 2:8] = 1
    response[3, 5:] = 1  # a hole (tool output) at 7-8
    response[3, 7:9] = 0
    response[4, :] = 0  # empty response
    attention[5, :1] = 0
    response[5, 9:] = 1  # one-token prompt... two-token response
    return ids, response, attention


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("method", ["auto", "gram", "materialize"])
def test_f3_one_pass_norms_equal_exact_per_row_gradients(family, tied, method):
    """||S_i||² from one forward + backward equals a separate exact gradient per row (padding, holes, ties)."""
    model = tiny_lm(family, tied)
    ids, response, attention = padded_batch()
    got = sequence_grad_norms_sq(model, ids, response, attention, linear_method=method)
    assert got.dtype == torch.float32 and got.shape == (6,)
    expected = exact_norms(model, ids, response, attention)
    torch.testing.assert_close(got.double(), expected, rtol=RTOL, atol=0)
    assert float(got[4]) == 0.0  # the empty response


def test_f3_temperature_and_no_attention_mask():
    """Logits divided by τ, no attention mask: still the exact norms (and τ matters)."""
    model = tiny_lm("qwen2", tied=True, seed=1)
    ids, response, _ = padded_batch(seed=1)
    got = sequence_grad_norms_sq(model, ids, response, temperature=0.6)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response, temperature=0.6), rtol=RTOL, atol=0)
    assert not torch.allclose(got, sequence_grad_norms_sq(model, ids, response))


class LayerNormLM(nn.Module):
    """Embedding -> LayerNorm (weight and bias) -> Linear with bias -> GELU -> LayerNorm -> tied LM head."""

    def __init__(self, vocab: int = 13, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm_in = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, attention_mask=None):
        h = self.norm_in(self.embed(input_ids))
        h = h + torch.nn.functional.gelu(self.mix(h)).cumsum(dim=1)  # causal mixing along positions
        return self.head(self.norm_out(h))


def test_f3_layernorm_bias_and_tied_head_custom_model():
    """LayerNorm weights and biases, Linear biases and a tied head outside transformers: exact."""
    torch.manual_seed(2)
    model = LayerNormLM().double()
    with torch.no_grad():  # non-trivial norm parameters
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids, response, _ = padded_batch(seed=2, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


class OnePlusRMSNorm(nn.Module):
    """Gemma-style ``(1 + w) ⊙ x / rms(x)``: not of the form ``w ⊙ n(x)``, so the vjp fallback is used."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


def test_f3_norm_layer_not_affine_in_its_weight_takes_the_exact_fallback():
    """A (1 + w) RMSNorm: the per-row vector-Jacobian product still gives the exact norms."""
    torch.manual_seed(10)
    model = LayerNormLM().double()
    model.norm_out = OnePlusRMSNorm(8).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids, response, _ = padded_batch(seed=10, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


def test_frozen_parameters_are_not_counted():
    """θ is the trainable parameters: freezing the embedding removes exactly its contribution."""
    model = tiny_lm("llama", tied=False, seed=3)
    model.get_input_embeddings().weight.requires_grad_(False)
    ids, response, attention = padded_batch(seed=3)
    got = sequence_grad_norms_sq(model, ids, response, attention)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response, attention), rtol=RTOL, atol=0)


def test_grad_fields_and_train_eval_modes_are_left_alone():
    """.grad fields (None or set) and every module's training flag are as before; dropout is off inside."""
    model = tiny_lm("qwen2", tied=False, seed=4, attention_dropout=0.5)
    ids, response, attention = padded_batch(seed=4)
    expected = sequence_grad_norms_sq(model.eval(), ids, response, attention)
    model.train()
    model.model.layers[0].eval()  # a mixed state
    modes = {name: m.training for name, m in model.named_modules()}
    marker = torch.full_like(model.lm_head.weight, 7.0)
    model.lm_head.weight.grad = marker
    got = sequence_grad_norms_sq(model, ids, response, attention)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert model.lm_head.weight.grad is marker and bool((marker == 7.0).all())
    assert all(p.grad is None for n, p in model.named_parameters() if n != "lm_head.weight")


def test_non_reentrant_activation_checkpointing_gives_the_same_norms():
    """transformers' gradient checkpointing (use_reentrant=False) recomputes activations: same norms."""
    model = tiny_lm("llama", tied=True, seed=5)
    ids, response, attention = padded_batch(seed=5)
    expected = sequence_grad_norms_sq(model, ids, response, attention)
    enable_hf_activation_checkpointing(model)
    model.train()  # transformers checkpoints only in training mode; the function evaluates in eval mode
    for layer in model.model.layers:
        layer.gradient_checkpointing = True
        layer.training = True
    got = row_grad_norms_sq(model, lambda: _log_likelihood(model, ids, response, attention))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def _log_likelihood(model, ids, response, attention):
    logits = model(ids, attention_mask=attention, use_cache=False).logits.double()
    log_probs = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (log_probs * response[:, 1:]).sum(dim=1)


def test_reentrant_checkpointing_is_refused():
    """Reentrant checkpointing hides layer outputs from autograd in the forward: a clear error, not wrong norms
    (torch's own RuntimeError, which names use_reentrant, or ours)."""
    model = tiny_lm("llama", tied=False, seed=6)
    ids, response, attention = padded_batch(seed=6)

    def objective():
        hidden = model.model.embed_tokens(ids)
        hidden = torch.utils.checkpoint.checkpoint(model.lm_head, model.model.norm(hidden), use_reentrant=True)
        return hidden.sum(dim=(1, 2))

    with pytest.raises((ValueError, RuntimeError), match="reentrant"):
        row_grad_norms_sq(model, objective)


class ConvLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.conv = nn.Conv1d(4, 5, 1)

    def forward(self, input_ids, attention_mask=None):
        return self.conv(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)


def test_unsupported_parameterised_layer_fails_loudly():
    """A parameter outside Linear / Embedding / norm layers raises, naming it."""
    ids = torch.tensor([[1, 2, 3]])
    response = torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match=r"^model: parameter 'conv.weight' belongs to Conv1d"):
        sequence_grad_norms_sq(ConvLM(), ids, response)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=torch.zeros(2, 3)), "^input_ids: expected integer ids"),
        (dict(input_ids=torch.tensor([1, 2, 3])), r"^input_ids: expected integer ids \[B, L\], got torch.int64 \(3,\)"),
        (dict(input_ids=torch.ones(2, 3, 1, dtype=torch.long)), r"^input_ids: expected integer ids \[B, L\]"),
        (dict(input_ids=torch.ones(2, 3, dtype=torch.bool)), r"^input_ids: expected integer ids \[B, L\]"),
        (dict(response_mask=torch.ones(2, 4)), "^response_mask: shape"),
        (dict(response_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])), "^response_mask: column 0 must be 0"),
        (dict(response_mask=torch.tensor([[0, 2, 1], [0, 1, 1]])), "^response_mask"),
        (dict(attention_mask=torch.ones(2, 2)), "^attention_mask: shape"),
        (dict(temperature=0.0), "^temperature"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(kwargs, message):
    model = tiny_lm("qwen2", tied=False)
    args = dict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), response_mask=torch.tensor([[0, 1, 1], [0, 0, 1]]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        sequence_grad_norms_sq(model, **args)


def test_objective_must_return_per_row_values():
    model = tiny_lm("qwen2", tied=False)
    with pytest.raises(ValueError, match=r"^objective: expected a \[B\] tensor of per-row values, got shape \(\)$"):
        row_grad_norms_sq(model, lambda: model(torch.tensor([[1, 2]])).logits.sum())
    with pytest.raises(ValueError, match=r"^objective: expected a \[B\] tensor of per-row values, got shape \(1, 2\)$"):
        row_grad_norms_sq(model, lambda: model(torch.tensor([[1, 2]])).logits.sum(dim=-1))
    with pytest.raises(ValueError, match=r"^objective: expected a \[B\] tensor of per-row values, got float$"):
        row_grad_norms_sq(model, lambda: float(model(torch.tensor([[1, 2]])).logits.detach().sum()))


# --------------------------------------------------------------------------- the per-layer formulas


def test_linear_gram_and_materialised_forms_equal_the_brute_force_norm():
    """||Σ_t g_t a_tᵀ||² per row, both forms, against per-row outer products summed then squared."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    expected = torch.stack([sum(torch.outer(g[i, t], a[i, t]) for t in range(5)).square().sum() for i in range(3)])
    for method in ("gram", "materialize", "auto"):
        torch.testing.assert_close(linear_weight_norms_sq(a, g, method), expected, rtol=1e-13, atol=0)


def test_embedding_norm_adds_repeated_tokens_before_squaring():
    """Σ_v ||Σ_{x_t = v} g_t||²: a repeated id's gradients add (squaring each alone would be wrong)."""
    ids = torch.tensor([[3, 1, 3, 3], [0, 2, 1, 2]])
    g = torch.randn(2, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    dense = torch.zeros(2, 6, 5, dtype=torch.float64)
    dense.index_put_((torch.arange(2)[:, None].expand(2, 4), ids), g, accumulate=True)  # per-row dense gradient
    torch.testing.assert_close(embedding_norms_sq(ids, g, vocab=6), dense.square().sum(dim=(1, 2)), rtol=1e-13, atol=0)
    assert not torch.allclose(embedding_norms_sq(ids, g, 6), g.square().sum(dim=(1, 2)))


def test_benchmark_command_quick():
    """`python benchmarks/grad_norms.py --quick` prints a record per case (the model's own head, the chunked one)
    whose one-pass norms agree with the loop."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grad_norms.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["head"], "error" in r) for r in records] == [("full", False), ("chunked", False)]
    for record in records:
        assert record["one_pass_s"] > 0 and record["ordinary_s"] > 0 and record["loop_s"] > 0
        assert record["max_rel_diff_one_pass_vs_loop"] < 1e-5  # float32 model: rounding only
        assert len(record["paired_ratios"]) == 5 and record["one_pass_over_ordinary_paired"] > 0


# --------------------------------------------------------------------------- shared parameters, layer forms, rules


class SharedLM(nn.Module):
    """Every sharing the cross terms handle: an embedding called twice (once AFTER the tied head, so a pair starts
    with the Linear), a Linear called twice, two Linears with one weight, a head tied to the embedding; plus a call
    whose output never reaches the objective and one under no_grad (neither is part of the gradient)."""

    def __init__(self, vocab: int = 13, width: int = 8, tied: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width, bias=False)
        self.other = nn.Linear(width, width, bias=False)
        self.other.weight = self.mix.weight
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, input_ids, attention_mask=None):
        previous = torch.nn.functional.pad(input_ids[:, :-1], (1, 0))
        h = self.embed(input_ids)
        h = h + torch.tanh(self.mix(h)).cumsum(dim=1)
        h = h + torch.tanh(self.mix(h)) + torch.tanh(self.other(h)).cumsum(dim=1)
        self.mix(h)  # computed, never used
        with torch.no_grad():
            self.other(h)
        logits = self.head(self.norm(h))
        gate = torch.tanh(self.embed(previous).sum(dim=-1, keepdim=True))  # the embedding's second call
        return logits * (1 + 0.5 * gate)


@pytest.mark.parametrize("tied", [True, False])
def test_f3_every_kind_of_shared_parameter_gives_the_exact_norms(tied):
    """||G + H||² with the cross terms of Linear-Linear, Embedding-Embedding and Linear-Embedding sharing, in
    either call order (untied: the embedding shared with itself only), equals a separate exact gradient per row."""
    torch.manual_seed(11)
    model = SharedLM(tied=tied).double()
    ids, response, _ = padded_batch(seed=11, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


def test_a_linear_bias_used_by_two_calls_is_refused():
    """Sharing is supported between Linear and Embedding weights; a bias used twice raises, naming both uses."""
    model = LayerNormLM().double()
    forward = model.forward
    model.forward = lambda input_ids, attention_mask=None: forward(input_ids) + model.mix(model.embed(input_ids)).sum()
    with pytest.raises(ValueError, match=r"shared by Linear\.bias and Linear\.bias"):
        sequence_grad_norms_sq(model, *padded_batch(seed=12, vocab=13)[:2])


class GainNorm(nn.Module):
    """An affine RMSNorm with one more trainable parameter (a scalar gain): not only weight and bias."""

    def __init__(self, width: int):
        super().__init__()
        self.weight, self.gain = nn.Parameter(torch.ones(width)), nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.gain * self.weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


class PositionNorm(nn.Module):
    """A norm whose weight runs along positions (dim 1), not the last dim: w ⊙ n(x) does not broadcast."""

    def __init__(self, positions: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(positions))

    def forward(self, x):
        return self.weight[:, None] * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


class MeanWeightNorm(nn.Module):
    """mean(w) × x / rms(x): equal to w ⊙ n(x) whenever w is constant (a weight of ones at init), not otherwise."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight.mean() * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


class SmallOnePlusRMSNorm(OnePlusRMSNorm):
    """(1 + w) ⊙ x / rms(x) × 1e-8: outputs far below 1 (the form check's tolerance is relative to them)."""

    def forward(self, x):
        return 1e-8 * super().forward(x)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, RTOL), (torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_norm_layers_of_the_form_w_n_plus_b_take_the_fast_path_and_the_rest_the_exact_fallback(
    dtype, rtol, monkeypatch
):
    """The documented rule of _norm_layer_row_grads: LayerNorm and RMSNorm (w ⊙ n(x) + b, w along the last dim) use
    ∇w = Σ g ⊙ n; a (1 + w) norm (also with outputs of 1e-8), a norm with an extra parameter and one whose weight
    runs along positions take the vmapped vector-Jacobian product. Either way the norms are exact (bf16: 10%)."""
    monkeypatch.setattr(grad_norms, "_AFFINE_NORM_CLASSES", {})
    fallback, real = [], grad_norms._norm_layer_row_grads_vjp
    monkeypatch.setattr(
        grad_norms, "_norm_layer_row_grads_vjp", lambda call, *a: fallback.append(call.module) or real(call, *a)
    )
    ids, response, _ = padded_batch(seed=13, vocab=13)
    for case, (norm, fast) in enumerate(
        [
            (nn.RMSNorm(8), True),
            (OnePlusRMSNorm(8), False),
            (SmallOnePlusRMSNorm(8), False),
            (GainNorm(8), False),
            (PositionNorm(ids.shape[1]), False),  # 11 positions, width 16 below (a weight shorter than the width)
            (PositionNorm(ids.shape[1]), False),  # the same at width 8 (a weight longer than the width)
            (MeanWeightNorm(8), False),  # left at its weight of ones below
        ]
    ):
        torch.manual_seed(13)
        model = LayerNormLM(width=16 if case == 4 else 8)
        model.norm_out = norm
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
            if isinstance(norm, (OnePlusRMSNorm, MeanWeightNorm)):
                norm.weight.fill_(1.0)  # w = 1: only a non-constant probe tells these from w ⊙ n(x)
        model = model.to(dtype)
        fallback.clear()
        got = sequence_grad_norms_sq(model, ids, response)
        torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=rtol, atol=0)
        assert fallback == ([] if fast else [model.norm_out]), type(norm).__name__  # LayerNorms: fast path


class DoubledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class DoubledEmbedding(nn.Embedding):
    def forward(self, ids):
        return 2 * super().forward(ids)


@pytest.mark.parametrize(
    "layer, message",
    [
        ("mix", "belongs to DoubledLinear"),
        ("embed", "belongs to DoubledEmbedding"),
        ("max_norm", "uses max_norm, scale_grad_by_freq or sparse"),
        ("scale_grad_by_freq", "uses max_norm, scale_grad_by_freq or sparse"),
        ("sparse", "uses max_norm, scale_grad_by_freq or sparse"),
    ],
)
def test_layers_whose_gradient_is_not_the_textbook_one_are_refused(layer, message):
    """A Linear or Embedding subclass with its own forward, or an embedding with max_norm, scale_grad_by_freq or
    sparse gradients: the formulas would not hold, so the call raises instead of returning wrong norms."""
    model = LayerNormLM().double()
    if layer == "mix":
        model.mix = DoubledLinear(8, 8).double()
    elif layer == "embed":
        model.embed = DoubledEmbedding(13, 8).double()
        model.head.weight = model.embed.weight
    else:
        setattr(model.embed, layer, 1.0 if layer == "max_norm" else True)
    with pytest.raises(ValueError, match=message):
        sequence_grad_norms_sq(model, *padded_batch(seed=14, vocab=13)[:2])


class FlatLM(LayerNormLM):
    """Runs its Linear on [B·T, d]: the row dimension is not first."""

    def forward(self, input_ids, attention_mask=None):
        h = self.norm_in(self.embed(input_ids))
        return self.head(self.mix(h.flatten(0, 1)).view_as(h))


class KeywordLM(LayerNormLM):
    """Calls its Linear with the input as a keyword: a forward hook sees no positional tensor."""

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.mix(input=self.norm_in(self.embed(input_ids))))


class FewRowsLM(LayerNormLM):
    """Runs its Linear on the first row only: the layer sees fewer rows than the objective."""

    def forward(self, input_ids, attention_mask=None):
        h = self.norm_in(self.embed(input_ids))
        return self.head(h) + self.mix(h[:1]).sum()


@pytest.mark.parametrize(
    "model, message",
    [
        (FlatLM, r"^model: Linear saw 66 rows in dim 0, the objective has 6: layers must keep the batch"),
        (FewRowsLM, r"^model: Linear saw 1 rows in dim 0, the objective has 6"),
        (KeywordLM, "must take and return"),
    ],
)
def test_layers_that_break_the_row_layout_are_refused(model, message):
    with pytest.raises(ValueError, match=message):
        sequence_grad_norms_sq(model().double(), *padded_batch(seed=15, vocab=13)[:2])


def test_no_hook_is_left_on_the_model():
    """The forward hooks that record layer calls are removed when the call returns (and when it raises)."""
    model = LayerNormLM().double()
    ids, response, _ = padded_batch(seed=17, vocab=13)
    sequence_grad_norms_sq(model, ids, response)
    with pytest.raises(ValueError):
        row_grad_norms_sq(model, lambda: model(ids).sum())
    assert not any(m._forward_hooks for m in model.modules())


def test_an_empty_sequence_has_a_zero_weight_gradient():
    """T = 0 positions: ||Σ_t g_t a_tᵀ||² = 0 in either form."""
    a, g = torch.zeros(2, 0, 3, dtype=torch.float64), torch.zeros(2, 0, 4, dtype=torch.float64)
    for method in ("gram", "materialize", "auto"):
        assert linear_weight_norms_sq(a, g, method).tolist() == [0.0, 0.0]


def test_many_rows_are_one_batch():
    """300 rows (row counts are compared by value, not identity) give each row its own exact norm."""
    torch.manual_seed(16)
    model = LayerNormLM().double()
    ids = torch.randint(0, 13, (300, 3), generator=torch.Generator().manual_seed(16))
    response = torch.tensor([[0, 1, 1]]).expand(300, 3)
    got = sequence_grad_norms_sq(model, ids, response)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


def test_linear_weight_norms_use_the_form_asked_for_and_auto_picks_the_cheaper(monkeypatch):
    """method="gram" multiplies [T, T] Gram matrices, "materialize" builds the [d_out, d_in] gradient, and "auto"
    the cheaper: Gram when T² (d_in + d_out) < T d_in d_out (T = 4, d = 10: 320 < 400), else materialised."""
    shapes, real = [], grad_norms.batched_matmul
    monkeypatch.setattr(
        grad_norms, "batched_matmul", lambda x, y: shapes.append(tuple(real(x, y).shape[1:])) or real(x, y)
    )
    a, g = torch.randn(1, 4, 10, dtype=torch.float64), torch.randn(1, 4, 10, dtype=torch.float64)
    for method, expected in [("gram", (4, 4)), ("materialize", (10, 10)), ("auto", (4, 4))]:
        shapes.clear()
        linear_weight_norms_sq(a, g, "".join(method))  # a name built at run time (not the interned literal)
        assert set(shapes) == {expected}, method
    for d_in, d_out in [(2, 3), (3, 3)]:  # 16 · 5 > 4 · 2 · 3 and 16 · 6 > 4 · 3 · 3: materialised
        shapes.clear()
        linear_weight_norms_sq(a[:, :, :d_in], torch.randn(1, 4, d_out, dtype=torch.float64), "auto")
        assert shapes == [(d_out, d_in)]


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the rule reads ``is_cuda`` only)."""

    @property
    def is_cuda(self):
        return True


class EmbeddingLinearHead(nn.Module):
    """Embedding [13, 10] -> Linear 10 -> 10 (a layer call) -> an untied head [13, 10] through lm_head_log_probs."""

    def __init__(self):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(13, 10), nn.Linear(10, 10), nn.Linear(10, 13, bias=False)

    def objective(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.mix(self.embed(ids))  # [B, T, 10]
        return grad_norms.lm_head_log_probs(hidden, self.head, ids, chunk_size=5).sum(dim=1)


@pytest.mark.parametrize(
    "method, linear_shapes, head_shapes",
    [("gram", {(4, 4)}, {(4, 4)}), ("materialize", {(10, 10)}, {(5, 10), (3, 10)}), ("auto", {(4, 4)}, {(4, 4)})],
)
def test_linear_method_reaches_every_linear_call_and_the_chunked_head(method, linear_shapes, head_shapes, monkeypatch):
    """row_grad_norms_sq's linear_method picks the form of every linear layer call (T = 4, d = 10: Gram [T, T]
    products, or materialised [d_out, d_in] gradients) and of the chunked head (Gram, or [chunk, d] per vocabulary
    chunk of 5, 5, 3 rows); every form gives the same norms."""
    torch.manual_seed(17)
    model = EmbeddingLinearHead().double()
    ids = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(17))
    shapes, real = [], grad_norms.batched_matmul
    monkeypatch.setattr(
        grad_norms, "batched_matmul", lambda x, y: shapes.append(tuple(real(x, y).shape[1:])) or real(x, y)
    )
    got = row_grad_norms_sq(model, lambda: model.objective(ids), linear_method="".join(method))
    assert set(shapes) == linear_shapes | head_shapes
    monkeypatch.undo()
    for other in grad_norms.LINEAR_METHODS:
        torch.testing.assert_close(got, row_grad_norms_sq(model, lambda: model.objective(ids), linear_method=other))
    assert grad_norms.recorded_calls() == []  # outside a recording


def test_a_recording_inside_another_objective_is_its_own():
    """row_grad_norms_sq called inside another's objective records into its own, innermost tape: the inner call's
    recorded_calls() are its model's, and the inner call's norms (chunked head included) and the outer call's are
    each what they are alone."""
    torch.manual_seed(5)
    outer_model, inner_model = EmbeddingLinearHead().double(), EmbeddingLinearHead().double()
    ids = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(5))
    inner_alone = row_grad_norms_sq(inner_model, lambda: inner_model.objective(ids))
    outer_alone = row_grad_norms_sq(outer_model, lambda: outer_model.objective(ids))
    seen = {}

    def inner_objective():
        f = inner_model.objective(ids)
        seen["modules"] = {call.module for call in grad_norms.recorded_calls()}
        return f

    def outer_objective():
        seen["inner"] = row_grad_norms_sq(inner_model, inner_objective)
        return outer_model.objective(ids)

    outer = row_grad_norms_sq(outer_model, outer_objective)
    assert seen["modules"] and seen["modules"] <= set(inner_model.modules())
    torch.testing.assert_close(seen["inner"], inner_alone, rtol=1e-6, atol=0)
    torch.testing.assert_close(outer, outer_alone, rtol=1e-6, atol=0)


def test_linear_method_is_keyword_only():
    """By keyword it is taken (the call runs, so a mutation of the signature is reached by this test); by position
    it is refused."""
    model = EmbeddingLinearHead()
    ids = torch.tensor([[1, 2, 3]])
    by_keyword = row_grad_norms_sq(model, lambda: model.objective(ids), linear_method="auto")
    assert torch.isfinite(by_keyword).all()
    with pytest.raises(TypeError):
        row_grad_norms_sq(model, lambda: model.objective(ids), "auto")


def test_linear_method_must_be_one_of_the_three():
    model = EmbeddingLinearHead()
    ids = torch.tensor([[1, 2, 3]])
    for bad in ("Gram", None, "exact"):
        with pytest.raises(ValueError, match=r"^linear_method: expected one of \('auto', 'gram', 'materialize'\)"):
            row_grad_norms_sq(model, lambda: model.objective(ids), linear_method=bad)
        with pytest.raises(ValueError, match=r"^linear_method: expected one of"):
            sequence_grad_norms_sq(tiny_lm("qwen2", tied=False), ids, torch.tensor([[0, 1, 1]]), linear_method=bad)


@pytest.mark.parametrize("refusal", [None, TypeError, RuntimeError])
def test_half_inputs_on_cuda_go_to_bmm_as_they_are_with_a_float32_result(refusal, monkeypatch):
    """batched_matmul's rule: bf16 inputs on CUDA are multiplied as bf16 with a float32 result (out_dtype); where
    torch.bmm takes no out_dtype (TypeError) or the device refuses it (RuntimeError), both are upcast to float32
    first."""
    calls, real = [], torch.bmm

    def bmm(x, y, **options):
        calls.append((x.dtype, options))
        if options and refusal:
            raise refusal("out_dtype")
        return real(x.float(), y.float()) if options else real(x, y)

    monkeypatch.setattr(torch, "bmm", bmm)
    x = torch.randn(2, 3, 4).to(torch.bfloat16).as_subclass(OnCuda)
    y = torch.randn(2, 4, 5).to(torch.bfloat16).as_subclass(OnCuda)
    got = grad_norms.batched_matmul(x, y)
    assert got.dtype == torch.float32 and torch.equal(got, real(x.float(), y.float()))
    expected = [(torch.bfloat16, {"out_dtype": torch.float32})] + ([(torch.float32, {})] if refusal else [])
    assert calls == expected
    calls.clear()
    grad_norms.batched_matmul(torch.randn(2, 3, 4).to(torch.bfloat16), torch.randn(2, 4, 5).to(torch.bfloat16))  # CPU
    assert calls == [(torch.float32, {})]


def test_logits_are_read_from_a_tensor_an_object_or_the_first_item_of_a_tuple():
    from types import SimpleNamespace

    logits, other = torch.randn(2, 3), torch.randn(2, 3)
    for output in (logits, SimpleNamespace(logits=logits), (logits, other), [logits]):
        assert grad_norms.logits_of(output) is logits
    for output in ({"logits": logits}, (), ("x", logits)):
        with pytest.raises(ValueError, match="holds no logits"):
            grad_norms.logits_of(output)


def test_accepts_keyword_reads_the_signature_and_says_no_when_there_is_none():
    from types import SimpleNamespace

    assert grad_norms.accepts_keyword(LayerNormLM(), "attention_mask")
    assert not grad_norms.accepts_keyword(LayerNormLM(), "use_cache")
    assert not grad_norms.accepts_keyword(SimpleNamespace(forward=torch.relu), "input")  # ValueError: no signature
    assert not grad_norms.accepts_keyword(SimpleNamespace(forward=42), "input")  # TypeError: not callable


class FrozenFeatureLM(LayerNormLM):
    """A Linear reading frozen features (its input needs no gradient) beside a trainable embedding, and a second
    such call whose output is never used."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Embedding(13, 8).requires_grad_(False)

    def forward(self, input_ids, attention_mask=None):
        self.mix(self.frozen(input_ids).flip(1))  # unused
        return self.head(self.norm_in(self.embed(input_ids) + torch.tanh(self.mix(self.frozen(input_ids)))))


def test_f3_a_layer_whose_input_needs_no_gradient_is_counted():
    """The backward starts at every layer whose input needs no gradient, not only at the embedding."""
    torch.manual_seed(18)
    model = FrozenFeatureLM().double()
    ids, response, _ = padded_batch(seed=18, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


def test_row_norms_of_a_model_whose_input_needs_a_gradient():
    """row_grad_norms_sq on inputs that require grad (no layer input is free of it): each row's ||∇θ f_i||²
    equals a backward per row."""
    torch.manual_seed(19)
    first, second = nn.Linear(3, 4).double(), nn.Linear(4, 1).double()
    model = nn.Sequential(first, second)
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)

    got = row_grad_norms_sq(model, lambda: model(x).sum(dim=(1, 2)))
    expected = []
    for i in range(5):
        grads = torch.autograd.grad(model(x[i : i + 1]).sum(), list(model.parameters()))
        expected.append(sum(g.square().sum() for g in grads))
    torch.testing.assert_close(got.double(), torch.stack(expected), rtol=RTOL, atol=0)


def test_an_objective_that_does_not_depend_on_the_parameters_has_zero_norms():
    model = LayerNormLM().double()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert row_grad_norms_sq(model, lambda: model(ids).sum(dim=(1, 2)).detach()).tolist() == [0.0, 0.0]


def test_row_blocks_under_a_small_budget_give_the_same_norms(monkeypatch):
    """Rows go through the per-row temporaries in blocks of at most _BLOCK_ELEMENTS elements; a row larger than the
    budget is a block of its own. The blocks change memory only, not the norms."""
    torch.manual_seed(20)
    model = LayerNormLM().double()
    ids, response, _ = padded_batch(seed=20, vocab=13)
    want = sequence_grad_norms_sq(model, ids, response)
    monkeypatch.setattr(grad_norms, "_BLOCK_ELEMENTS", 4)
    torch.testing.assert_close(sequence_grad_norms_sq(model, ids, response), want, rtol=1e-6, atol=0)  # float32


# --------------------------------------------------------------------------- the LM head chunked over the vocabulary


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("method", ["gram", "materialize"])
@pytest.mark.parametrize("chunk_size", [1, 5, None])
def test_f3_chunked_lm_head_gives_the_exact_norms(family, tied, method, chunk_size):
    """No [B, L, V] logits: the head's norm (and a tied head's cross term) summed over vocabulary chunks, exact."""
    model = tiny_lm(family, tied, seed=11)
    ids, response, attention = padded_batch(seed=11)
    got = sequence_grad_norms_sq(model, ids, response, attention, 0.7, True, chunk_size, linear_method=method)
    expected = exact_norms(model, ids, response, attention, temperature=0.7)
    torch.testing.assert_close(got.double(), expected, rtol=RTOL, atol=0)
    assert float(got[4]) == 0.0


def test_lm_head_log_probs_and_gradients_equal_the_full_logits(monkeypatch):
    """Values, and gradients in hidden and W under any upstream gradient, equal log_softmax of full logits; every
    logits buffer has at most chunk_size columns."""
    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(3, 4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    head = nn.Linear(6, 11, bias=False).double()
    targets = torch.randint(0, 11, (3, 4), generator=gen)
    upstream = torch.randn(3, 4, dtype=torch.float64, generator=gen)
    widths = []
    real_chunk_logits = grad_norms.chunk_logits  # otb_ref.proxy.chunk_logits, as grad_norms calls it

    def spy(h, w, inv_tau, dtype):
        widths.append(w.shape[0])
        return real_chunk_logits(h, w, inv_tau, dtype)

    monkeypatch.setattr(grad_norms, "chunk_logits", spy)
    got = grad_norms.lm_head_log_probs(hidden, head, targets, temperature=1.3, chunk_size=4)
    got_grads = torch.autograd.grad(got, [hidden, head.weight], upstream)
    monkeypatch.undo()
    full = torch.log_softmax(head(hidden) / 1.3, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    expected_grads = torch.autograd.grad(full, [hidden, head.weight], upstream)
    assert got.dtype == torch.float64 and got.shape == (3, 4)
    torch.testing.assert_close(got, full, rtol=1e-13, atol=1e-14)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    assert widths == [4, 4, 3] * 2  # forward, then backward recomputes each chunk


def test_a_frozen_body_under_a_trainable_chunked_head_counts_the_head():
    """Hidden states that need no gradient: the head's call starts the backward and its norm is counted."""
    model = tiny_lm("qwen2", tied=False, seed=13)
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    ids, response, attention = padded_batch(seed=13)
    got = sequence_grad_norms_sq(model, ids, response, attention, chunked_lm_head=True, chunk_size=7)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response, attention), rtol=RTOL, atol=0)
    assert float(got.min()) == 0.0 and float(got.max()) > 0  # the empty response; the others


def test_chunked_lm_head_refuses_what_it_cannot_compute():
    hidden, targets = torch.randn(2, 3, 8, dtype=torch.float64), torch.ones(2, 3, dtype=torch.long)
    head = nn.Linear(8, 29, bias=False).double()
    cases = [
        (dict(lm_head=nn.Linear(8, 29).double()), "^lm_head: expected an nn.Linear without bias"),
        (dict(lm_head=head.float()), "^lm_head: weight torch.float32"),
        (dict(lm_head=nn.Linear(7, 29, bias=False).double()), r"^lm_head: weight torch.float64 \(29, 7\)"),
        (dict(lm_head=nn.Linear(9, 29, bias=False).double()), r"^lm_head: weight torch.float64 \(29, 9\)"),
        (dict(hidden=hidden.to("meta")), "^lm_head: weight .* on cpu does not match hidden .* on meta"),
        (dict(hidden=hidden[0]), r"^hidden: expected floating \[B, T, d\]"),
        (dict(hidden=hidden[None]), r"^hidden: expected floating \[B, T, d\]"),
        (dict(targets=targets.double()), "^targets: expected integer ids"),
        (dict(targets=targets[:, :2]), r"^targets: expected integer ids \(2, 3\), got torch.int64 \(2, 2\)$"),
        (dict(targets=torch.ones(2, 4, dtype=torch.long)), r"^targets: expected integer ids \(2, 3\)"),
        (dict(targets=targets * 29), r"^targets: token ids must lie in \[0, 29\)"),
        (dict(targets=targets * 40), r"^targets: token ids must lie in \[0, 29\)"),
        (dict(targets=-targets), r"^targets: token ids must lie in \[0, 29\)"),
        (dict(chunk_size=0), "^chunk_size: expected a positive integer"),
        (dict(chunk_size=True), "^chunk_size: expected a positive integer"),
        (dict(temperature=-1.0), "^temperature"),
    ]
    for change, message in cases:
        args = dict(hidden=hidden, lm_head=nn.Linear(8, 29, bias=False).double(), targets=targets) | change
        with pytest.raises(ValueError, match=message):
            grad_norms.lm_head_log_probs(**args)


def test_chunked_lm_head_takes_only_plain_logits_from_a_model():
    """A head bias, no Linear head, soft-capping or a logit scale other than 1 are refused; a scale of 1 is not."""
    ids, response = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[0, 1, 1], [0, 0, 1]])
    message = "^chunked_lm_head: the model must be a causal LM"
    for change in ("bias", "no_head", "softcap", "scale", "granite"):
        model = tiny_lm("qwen2", tied=False)
        if change == "bias":
            model.lm_head.bias = nn.Parameter(torch.zeros(29, dtype=torch.float64))
        elif change == "no_head":
            model.get_output_embeddings = lambda: None
        elif change == "softcap":
            model.config.final_logit_softcapping = 30.0
        elif change == "granite":  # Granite divides its logits by logits_scaling
            model.config.logits_scaling = 8.0
        else:
            model.config.logit_scale = 2.0
        with pytest.raises(ValueError, match=message):
            sequence_grad_norms_sq(model, ids, response, chunked_lm_head=True)
    with pytest.raises(ValueError, match=message):
        sequence_grad_norms_sq(ConvLM(), ids, response, chunked_lm_head=True)
    model = tiny_lm("qwen2", tied=False)
    model.config.logit_scale = 1.0
    expected = sequence_grad_norms_sq(model, ids, response)
    torch.testing.assert_close(sequence_grad_norms_sq(model, ids, response, chunked_lm_head=True), expected)


def test_lm_head_log_probs_edge_rules():
    """τ = 1 by default; W's gradient without one for hidden; logits far below 0 (a running logsumexp that started
    at 0 would underflow to −inf); d = 300 (beyond CPython's cached ints) is compared by value; a second derivative
    raises instead of being silently wrong."""
    gen = torch.Generator().manual_seed(21)
    head = nn.Linear(300, 7, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(1 + 0.1 * torch.rand(7, 300, dtype=torch.float64, generator=gen))
    hidden = -4.0 + 0.1 * torch.rand(2, 3, 300, dtype=torch.float64, generator=gen)  # logits about −1300
    targets = torch.randint(0, 7, (2, 3), generator=gen)
    got = grad_norms.lm_head_log_probs(hidden, head, targets, chunk_size=3)
    full = torch.log_softmax(head(hidden), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-12)
    (got_w,) = torch.autograd.grad(got.sum(), head.weight)
    (full_w,) = torch.autograd.grad(full.sum(), head.weight)
    torch.testing.assert_close(got_w, full_w, rtol=1e-10, atol=1e-12)
    hidden.requires_grad_(True)
    upstream = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    log_probs = grad_norms.lm_head_log_probs(hidden, head, targets, chunk_size=3)
    (grad_hidden,) = torch.autograd.grad(log_probs, hidden, grad_outputs=upstream, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_hidden.sum().backward()


def test_a_frozen_chunked_head_adds_nothing():
    """A head without a trainable weight is no recorded call: the body's norms alone, exact."""
    model = tiny_lm("qwen2", tied=False, seed=20)
    model.lm_head.weight.requires_grad_(False)
    ids, response, attention = padded_batch(seed=20)
    got = sequence_grad_norms_sq(model, ids, response, attention, chunked_lm_head=True, chunk_size=6)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response, attention), rtol=RTOL, atol=0)


class TupleDecoderLM(nn.Module):
    """A causal LM whose decoder returns a plain tuple (hidden,) rather than an object with last_hidden_state."""

    def __init__(self, vocab: int = 13, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def get_decoder(self):
        return lambda ids, **kwargs: (self.embed(ids) + torch.tanh(self.mix(self.embed(ids))).cumsum(dim=1), None)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.get_decoder()(input_ids)[0]) * self.logit_factor

    logit_factor = 1.0


def test_chunked_lm_head_reads_the_hidden_states_of_a_decoder_returning_a_tuple():
    model = TupleDecoderLM().double()
    ids, response, _ = padded_batch(seed=22, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response, chunked_lm_head=True, chunk_size=4)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


def test_a_head_weight_used_by_a_linear_call_too_is_refused():
    """Both the model's own head call and the chunked one on one weight: a cross term it cannot form; refused."""
    model = tiny_lm("qwen2", tied=False)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def both():
        out = model(ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        chunked = grad_norms.lm_head_log_probs(hidden, model.lm_head, ids)
        return out.logits.sum(dim=(1, 2)) + chunked.sum(dim=1)

    with pytest.raises(ValueError, match="^lm_head: its weight is used by another call"):
        row_grad_norms_sq(model, both)


def test_layer_outputs_are_not_kept_by_the_tape():
    """A call keeps its input only: after the forward nothing holds the outputs of o_proj and down_proj (each goes
    into a residual sum, which saves nothing), where a tape that kept outputs would hold all four."""
    import gc
    import weakref

    model = tiny_lm("llama", tied=False, seed=14)
    ids, response, attention = padded_batch(seed=14)
    outputs = []
    layers = [m for layer in model.model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    handles = [m.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out))) for m in layers]

    def objective():
        f = _log_likelihood(model, ids, response, attention)
        gc.collect()
        assert [ref() is None for ref in outputs] == [True] * 4
        return f

    try:
        got = row_grad_norms_sq(model, objective)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response, attention), rtol=RTOL, atol=0)


# --------------------------------------------------------------------------- activation checkpointing


def _checkpointed(model):
    enable_hf_activation_checkpointing(model)
    model.train()  # transformers checkpoints only in training mode (no dropout in these configs)
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_checkpointed_layers_keep_no_input_until_their_region_is_recomputed(checkpointing):
    """Under checkpointing every decoder-layer call holds nothing after the forward and takes its input back from
    the recomputation, and the norms stay exact; without checkpointing no call waits."""
    model = tiny_lm("qwen2", tied=True, seed=15)
    ids, response, attention = padded_batch(seed=15)
    expected = exact_norms(model, ids, response, attention)  # torch.func: before checkpointing is switched on
    model = _checkpointed(model) if checkpointing else model
    seen = {}

    def objective():
        f = _log_likelihood(model, ids, response, attention)
        calls = grad_norms.recorded_calls()
        outside = (model.model.embed_tokens, model.model.norm, model.lm_head)
        seen["waiting"] = [c.inputs is None and c.output is None for c in calls]
        seen["recomputed"] = [c.recomputed for c in calls]
        seen["outside"] = [c.module in outside for c in calls]
        return f

    got = row_grad_norms_sq(model, objective)
    assert seen["waiting"] == seen["recomputed"] == [checkpointing and not outside for outside in seen["outside"]]
    assert sum(seen["waiting"]) == (2 * (7 + 2) if checkpointing else 0)  # 7 linears and 2 norms in each layer
    torch.testing.assert_close(got.double(), expected, rtol=RTOL, atol=0)


class TwoBlockLM(nn.Module):
    """One block applied twice, each application checkpointed; ``twice_in_one`` calls its linear twice per region
    (``same_first_position``: on inputs equal at position 0);
    ``embed_inside``: one region holds the embedding and one block."""

    def __init__(self, twice_in_one: bool = False, embed_inside: bool = False, vocab: int = 13, width: int = 8):
        super().__init__()
        self.twice_in_one, self.embed_inside, self.checkpointing = twice_in_one, embed_inside, True
        self.same_first_position = False
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width, bias=False)  # a weight shared by two calls has a cross term; a bias none
        self.head = nn.Linear(width, vocab, bias=False)

    def block(self, h):
        if self.twice_in_one and self.same_first_position:  # the second input equals the first at position 0
            return h + torch.nn.functional.pad(
                torch.tanh(self.mix(h + torch.nn.functional.pad(torch.tanh(self.mix(h))[:, :-1], (0, 0, 1, 0))))[
                    :, :-1
                ],
                (0, 0, 1, 0),
            )
        h = h + torch.tanh(self.mix(h)).cumsum(dim=1)
        return h + torch.tanh(self.mix(h)).cumsum(dim=1) if self.twice_in_one else h

    def forward(self, input_ids, attention_mask=None):
        from torch.utils.checkpoint import checkpoint

        if self.embed_inside:  # the embedding and one block in one region
            first = lambda ids: self.block(self.embed(ids))  # noqa: E731
            h = checkpoint(first, input_ids, use_reentrant=False) if self.checkpointing else first(input_ids)
            return self.head(h)
        h = self.embed(input_ids)
        for _ in range(2):
            h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointing else self.block(h)
        return self.head(h)


def test_a_layer_shared_by_two_checkpointed_regions_gets_each_input_back():
    """Regions are recomputed last first: each recomputed input goes back to its own call, and the two calls'
    cross term (one weight) is formed from them; exact norms."""
    model = TwoBlockLM().double()
    ids, response, _ = padded_batch(seed=16, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    model.checkpointing = False  # torch.func (the exact norms) does not take saved-tensor hooks
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


@pytest.mark.parametrize("same_first_position", [False, True])
def test_a_layer_called_twice_inside_one_checkpointed_region_gets_each_input_back(same_first_position):
    """Two waiting calls of one layer: each recomputed input goes to the call it reproduces (by content: inputs
    that agree at position 0 too), exact."""
    model = TwoBlockLM(twice_in_one=True).double()
    model.same_first_position = same_first_position
    ids, response, _ = padded_batch(seed=17, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    model.checkpointing = False
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


class RegionsLM(nn.Module):
    """Checkpointed regions the tape must handle: ``kind`` picks one (see the test)."""

    def __init__(self, kind: str, vocab: int = 13, width: int = 8):
        super().__init__()
        self.kind, self.checkpointing = kind, True
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.norm = OnePlusRMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            self.norm.weight.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(0))
        if kind == "frozen_embedding":
            self.embed.weight.requires_grad_(False)
        if kind in ("selective_two_mm", "two_lengths"):  # bias-free: their products are aten.mm
            self.plain_a, self.plain_b = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)

    def region(self, fn, *args):
        from torch.utils.checkpoint import checkpoint

        if not self.checkpointing:
            return fn(*args)
        if self.kind.startswith("selective"):
            import functools

            from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

            def policy(ctx, op, *a, **k):
                return (
                    CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
                )

            context = functools.partial(create_selective_checkpoint_contexts, policy)
            return checkpoint(fn, *args, use_reentrant=False, context_fn=context)
        return checkpoint(fn, *args, use_reentrant=False)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if self.kind == "unused_region":  # the layer in two regions, the second one's output unused
            h = h + self.region(lambda x: torch.tanh(self.mix(x)).cumsum(dim=1), h)
            self.region(lambda x: self.mix(x), h)
            return self.head(h)
        if self.kind == "frozen_embedding":  # a layer on a frozen input (a start of the backward) alone in its region
            return self.head(torch.tanh(self.region(self.mix, h)).cumsum(dim=1))  # its region is never recomputed
        if self.kind == "selective_two_mm":  # two matrix products in one region under a policy that saves them
            return self.head(self.region(lambda x: torch.tanh(self.plain_b(torch.tanh(self.plain_a(x)))), h))
        if self.kind == "two_lengths":  # one layer called twice in a region, on inputs of two sequence lengths
            return self.head(self.region(lambda x: torch.cat([self.plain_a(x[:, :5]), self.plain_a(x[:, 5:])], 1), h))
        # "norm_last" and "selective": the region ends with a (1 + w) norm (the per-row VJP fallback)
        return self.head(self.region(lambda x: self.norm(x + torch.tanh(self.mix(x)).cumsum(dim=1)), h))


class OnePlusRMSNorm(nn.Module):
    """``(1 + w) ⊙ n(x)``: not ``w ⊙ n(x)``, so its per-row gradients take the vmapped VJP."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize(
    "kind", ["unused_region", "frozen_embedding", "norm_last", "selective", "selective_two_mm", "two_lengths"]
)
def test_checkpointed_regions_of_every_kind_give_the_exact_norms(kind):
    """A region never recomputed for a layer's second call; a start of the backward in a region nothing
    recomputes; a norm whose output gradient comes before its region's recomputation (its VJP runs after it);
    selective activation checkpointing, also with two matrix products under a policy that saves them (the tape's
    own ops in the region must not be products: the policy's cache is read back by position); one layer called
    on two sequence lengths in one region (fingerprints of two shapes)."""
    model = RegionsLM(kind).double()
    ids, response, _ = padded_batch(seed=23, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    model.checkpointing = False
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


def test_bias_only_training_without_checkpointing_is_exact():
    """BitFit: only biases train, so a linear on a frozen input saves nothing for backward, and is not taken for a
    checkpointed call."""
    model = tiny_lm("qwen2", tied=False, seed=24)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    ids, response, attention = padded_batch(seed=24)
    got = sequence_grad_norms_sq(model, ids, response, attention)
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response, attention), rtol=RTOL, atol=0)


def test_inputs_saved_through_other_saved_tensor_hooks_are_refused():
    """save_on_cpu takes the saved tensors and nothing recomputes them: refused, not a silently smaller norm."""
    model = tiny_lm("qwen2", tied=False, seed=18)
    ids, response, attention = padded_batch(seed=18)

    def objective():
        with torch.autograd.graph.save_on_cpu():
            return _log_likelihood(model, ids, response, attention)

    with pytest.raises(ValueError, match="^model: the input of .* was saved through other saved-tensor hooks"):
        row_grad_norms_sq(model, objective)


def test_a_tied_embedding_inside_a_checkpointed_region_keeps_its_ids_for_the_cross_term():
    """The embedding's ids are kept even inside a checkpointed region: the tied head's backward, which comes first,
    gathers its logit gradients at them."""
    model = TwoBlockLM(embed_inside=True).double()
    model.head.weight = model.embed.weight
    ids, response, _ = padded_batch(seed=19, vocab=13)
    got = sequence_grad_norms_sq(model, ids, response)
    model.checkpointing = False
    torch.testing.assert_close(got.double(), exact_norms(model, ids, response), rtol=RTOL, atol=0)


def test_chunked_lm_head_checks_the_models_logits_and_takes_a_single_token():
    """Logits scaled in the model's own forward, with nothing in a config: refused by the check on one row; rows of
    one token (nothing to predict) give 0, as with the model's own head."""
    model = TupleDecoderLM().double()
    ids, response, _ = padded_batch(seed=25, vocab=13)
    model.logit_factor = 2.0
    with pytest.raises(ValueError, match="^chunked_lm_head: the model's logits are not its decoder's hidden states"):
        sequence_grad_norms_sq(model, ids, response, chunked_lm_head=True)
    model.logit_factor = 1.0
    one = torch.zeros(ids.shape[0], 1)
    got = sequence_grad_norms_sq(model, ids[:, :1], one, chunked_lm_head=True)
    assert got.tolist() == [0.0] * ids.shape[0] == sequence_grad_norms_sq(model, ids[:, :1], one).tolist()
