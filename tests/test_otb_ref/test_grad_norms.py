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
from tiny_models import tiny_causal_lm
from torch import nn

from otb_ref import grad_norms
from otb_ref.exact import sequence_grad_norms_sq_fp64 as exact_norms
from otb_ref.grad_norms import embedding_norms_sq, linear_weight_norms_sq, row_grad_norms_sq, sequence_grad_norms_sq
from otb_train.model import enable_hf_activation_checkpointing

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-6


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
def test_f3_one_pass_norms_equal_exact_per_row_gradients(family, tied, method, monkeypatch):
    """||S_i||² from one forward + backward equals a separate exact gradient per row (padding, holes, ties)."""
    monkeypatch.setattr(grad_norms, "LINEAR_METHOD", method)
    model = tiny_lm(family, tied)
    ids, response, attention = padded_batch()
    got = sequence_grad_norms_sq(model, ids, response, attention)
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
    with pytest.raises(ValueError, match=r"^objective: expected a \[B\] tensor"):
        row_grad_norms_sq(model, lambda: model(torch.tensor([[1, 2]])).logits.sum())


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


# --------------------------------------------------------------------------- the trainer


def test_trainer_sequence_norms_equal_exact_on_left_padded_rows():
    """sequence_norms (policy forward, positions from the mask) == otb_ref.exact on each unpadded row."""
    from otb_train.config import Config
    from otb_train.energies import exact_energies, sequence_norms
    from otb_train.model import Policy, build_model_and_tokenizer
    from otb_train.rollout import position_ids_from_mask

    lm, _, _, _ = build_model_and_tokenizer(Config(hidden_size=32, num_layers=1))
    lm = lm.double()
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(2, lm.config.vocab_size, (4, 9), generator=gen)
    attention = torch.ones(4, 9, dtype=torch.bool)
    attention[1, :2] = False
    attention[3, :1] = False
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2, 3:] = False
    attention[:, 4:] = mask
    positions = position_ids_from_mask(attention)
    policy = Policy(lm, 1.0, None)
    got = sequence_norms(policy, ids, attention, positions, ids[:, 4:], mask.double())
    expected = exact_energies("eob", lm, ids, attention, mask, 1.0)["grad_norms_sq"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_fsdp2_two_ranks_with_and_without_activation_checkpointing(tmp_path):
    """torchrun, 2 gloo ranks: each rank's rows of a sharded policy give the unsharded norms; no .grad set."""
    out = tmp_path / "fsdp.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).with_name("fsdp_grad_norms_worker.py")),
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 4
    for case, result in results.items():
        torch.testing.assert_close(
            torch.tensor(result["sharded"]), torch.tensor(result["reference"]), rtol=1e-6, atol=0, msg=case
        )
        assert not result["grads_set"] and result["backward_after"], case


def test_benchmark_command_quick():
    """`python benchmarks/grad_norms.py --quick` prints a record per case whose one-pass norms agree with the loop."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grad_norms.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1 and "error" not in records[0]
    record = records[0]
    assert record["one_pass_s"] > 0 and record["ordinary_s"] > 0 and record["loop_s"] > 0
    assert record["max_rel_diff_one_pass_vs_loop"] < 1e-5  # float32 model: rounding only
