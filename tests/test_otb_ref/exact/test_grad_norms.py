"""Exact ||S||² and ||S_t||² on real batches (otb_ref.exact.grad_norms) against plain autograd loops."""

import copy

import pytest
import torch
from torch import nn

import otb_ref.exact.grad_norms as grad_norms
from otb_ref import compute_advantages
from otb_ref.exact.grad_norms import prefix_grad_norms_sq_fp64, sequence_grad_norms_sq_fp64
from otb_train.tiny_models import tiny_causal_lm

# Both sides are float64 computations of the same function at the same
# parameters; they differ only in the order of floating-point reductions
# (vmapped / batched backward vs one backward per token, per-block vs
# concatenated norms): a few ulps per operation, observed below 1e-15 relative.
# 1e-10 leaves four orders of margin for that, while every real mistake
# (an off-by-one position, a lost mask, a wrong temperature) changes the
# norms by O(1) relative.
RTOL = 1e-10

TINY = dict(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    initializer_range=0.3,
)
# initializer_range 0.3 (HF default 0.02) makes π far from uniform, so the
# F6 check below is not a near-constant.


def _qwen2(seed=0, **overrides):
    return tiny_causal_lm("qwen2", seed, **{**TINY, **overrides})


def _llama(seed=1, **overrides):
    return tiny_causal_lm("llama", seed, **{**TINY, **overrides})


MODELS = {
    "qwen2": _qwen2,
    "llama": _llama,
    "qwen2_tied": lambda: _qwen2(seed=2, tie_word_embeddings=True),
}


def _batch(L=10, vocab=16, seed=0):
    """Rows: full response; left padding + hole; right padding; empty; other left padding; one token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (6, L), generator=g)
    response = torch.zeros(6, L, dtype=torch.int32)
    attention = torch.ones(6, L, dtype=torch.int64)
    response[0, 3:] = 1  # prompt 0..2, response 3..L-1
    attention[1, :2] = 0  # left padding 0..1, prompt 2..4
    response[1, 5:] = 1
    response[1, 7] = 0  # hole (tool output) inside the response
    response[2, 4:7] = 1  # prompt 0..3, response 4..6
    attention[2, 7:] = 0  # right padding
    # row 3: empty response
    attention[4, :3] = 0  # another left-padding pattern
    response[4, 6:] = 1
    response[5, L - 1] = 1  # single-token response at the last position
    return ids, response, attention


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def _reference(model, ids, response, attention=None, temperature=1.0):
    """Plain loop: per row (fed alone), per token, torch.autograd.grad on a float64 copy."""
    model64 = copy.deepcopy(model).double().eval()
    params = [p for p in model64.parameters() if p.requires_grad]
    B, L = ids.shape
    sequence = torch.zeros(B, dtype=torch.float64)
    prefix = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        kwargs = {} if attention is None else {"attention_mask": attention[b : b + 1]}
        # The same float64 promotion as the code under test: transformers' RMSNorm
        # computes in float32 even on a float64 model, which would round the
        # gradients to ~1e-8. The promotion itself is checked against an
        # island-free model in test_float32_islands_are_promoted.
        with grad_norms._Float64Mode():
            logits = _logits(model64(ids[b : b + 1], **kwargs))[0]  # [L, V]
        log_probs = (
            torch.log_softmax(logits[:-1] / temperature, -1).gather(-1, ids[b, 1:, None]).squeeze(-1)
        )  # [L-1]: token j at j-1
        mask = response[b].double()  # [L]

        def flat_grad(scalar):
            grads = torch.autograd.grad(scalar, params, retain_graph=True, allow_unused=True)
            return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)])

        sequence[b] = flat_grad((log_probs * mask[1:]).sum()).square().sum()
        running = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
        for j in range(1, L):
            if mask[j]:
                running = running + flat_grad(log_probs[j - 1])
                prefix[b, j] = running.square().sum()
    return sequence, prefix


@pytest.fixture(params=["vmap", "vmap_one_row_chunks", "row_loop"])
def row_path(request, monkeypatch):
    """Run with rows vmapped in one chunk, vmapped one row per chunk, and a plain loop over rows."""
    if request.param == "row_loop":
        monkeypatch.setattr(grad_norms, "_VMAP_ROWS", False)
    if request.param == "vmap_one_row_chunks":
        monkeypatch.setattr(grad_norms, "_VMAP_ELEMENTS", 1)
    return request.param


@pytest.fixture(scope="module")
def references():
    """Reference norms per model (computed once), with and without attention mask and temperature."""
    ids, response, attention = _batch()
    out = {}
    for name, build in MODELS.items():
        model = build()
        out[name] = (model, _reference(model, ids, response, attention, temperature=0.7))
    return ids, response, attention, out


@pytest.mark.parametrize("model_name", list(MODELS))
def test_sequence_grad_norms_match_autograd_loop(model_name, references, row_path):
    ids, response, attention, refs = references
    model, (expected, _) = refs[model_name]
    got = sequence_grad_norms_sq_fp64(model, ids, response, attention, temperature=0.7)
    assert got.dtype == torch.float64 and got.shape == (ids.shape[0],)
    assert got[3] == 0  # empty response
    assert bool((expected[[0, 1, 2, 4, 5]] > 1e-6).all())  # the comparison is not vacuous
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=0)


def test_sequence_grad_norms_without_attention_mask_and_temperature_one():
    model = _qwen2(seed=5)
    ids, response, _ = _batch(seed=3)
    expected, _ = _reference(model, ids, response)
    torch.testing.assert_close(sequence_grad_norms_sq_fp64(model, ids, response), expected, rtol=RTOL, atol=0)
    # temperature matters (guards against it being ignored)
    assert not torch.allclose(sequence_grad_norms_sq_fp64(model, ids, response, temperature=0.5), expected)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_prefix_grad_norms_match_autograd_loop(model_name, references, row_path):
    ids, response, attention, refs = references
    model, (_, expected) = refs[model_name]
    got = prefix_grad_norms_sq_fp64(model, ids, response, attention, temperature=0.7)
    assert got.dtype == torch.float64 and got.shape == ids.shape
    off = response == 0
    assert bool((got[off] == 0).all())  # exactly zero off the mask: prompt, padding, hole, empty row
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=0)


def test_prefix_last_position_equals_sequence_norm():
    model = _llama(seed=4)
    ids, response, attention = _batch(seed=7)
    prefix = prefix_grad_norms_sq_fp64(model, ids, response, attention, temperature=1.3)
    sequence = sequence_grad_norms_sq_fp64(model, ids, response, attention, temperature=1.3)
    for b in range(ids.shape[0]):
        positions = response[b].nonzero().flatten()
        if positions.numel() == 0:
            assert sequence[b] == 0 and bool((prefix[b] == 0).all())
            continue
        torch.testing.assert_close(prefix[b, positions[-1]], sequence[b], rtol=RTOL, atol=0)
    # and the [B, T] response slice feeds the exact estimators
    T = 7
    rewards = torch.zeros(ids.shape[0], T, dtype=torch.float64)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    index = [0, 0, 0, 1, 1, 1]
    advantages, _ = compute_advantages("otb_exact", rewards, response[:, -T:], index, cumulative_energy=prefix[:, -T:])
    assert advantages.shape == (ids.shape[0], T) and bool(torch.isfinite(advantages).all())
    advantages, _ = compute_advantages("eob", rewards, response[:, -T:], index, grad_norms_sq=sequence)
    assert bool(torch.isfinite(advantages).all())


def test_lm_head_weight_proxy_identity():
    """F6 (b): with z = U h trainable in U only, ||∇_U log π(y_j)||² = (1 − 2π_j + Σπ²) ||h_{j−1}||² / τ²."""
    temperature = 0.8
    model = _qwen2(seed=6, tie_word_embeddings=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    L = 9
    ids = torch.randint(0, 16, (1, L), generator=torch.Generator().manual_seed(11)).repeat(L - 1, 1)
    response = torch.zeros(L - 1, L)
    response[torch.arange(L - 1), torch.arange(1, L)] = 1  # row k: one response token, at position k + 1
    got = prefix_grad_norms_sq_fp64(model, ids, response, temperature=temperature)[
        torch.arange(L - 1), torch.arange(1, L)
    ]  # [L-1]

    model64 = copy.deepcopy(model).double().eval()
    captured = {}
    model64.lm_head.register_forward_hook(lambda module, args, out: captured.update(h=args[0]))
    with torch.no_grad(), grad_norms._Float64Mode():  # h in float64 (see _reference)
        logits = model64(ids[:1]).logits[0]  # [L, V]
    h = captured["h"][0]  # [L, H]: final hidden state feeding the head
    pi = torch.softmax(logits / temperature, -1)  # [L, V]
    pi_y = pi[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)  # [L-1]: π_j(y_j) at position j − 1
    expected = (1 - 2 * pi_y + pi[:-1].square().sum(-1)) * h[:-1].square().sum(-1) / temperature**2
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=0)
    # a single-token response's sequence norm is the same quantity
    sequence = sequence_grad_norms_sq_fp64(model, ids, response, temperature=temperature)
    torch.testing.assert_close(sequence, expected, rtol=RTOL, atol=0)


def test_caller_model_untouched():
    model = _qwen2(seed=8, attention_dropout=0.5).float().train()  # dropout on in the caller's mode
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    ids, response, attention = _batch(seed=9)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}

    with torch.no_grad():  # a caller under no_grad still gets gradients
        sequence = sequence_grad_norms_sq_fp64(model, ids, response, attention)
    with torch.inference_mode():  # and so does a caller under inference_mode
        prefix = prefix_grad_norms_sq_fp64(model, ids, response, attention)

    for k, v in model.state_dict().items():
        assert v.dtype == state[k].dtype and torch.equal(v, state[k]), k
    for n, p in model.named_parameters():
        assert p.requires_grad == flags[n], n
        if n in grads:
            assert p.grad is not None and p.grad.dtype == grads[n].dtype and torch.equal(p.grad, grads[n]), n
        else:
            assert p.grad is None, n
    assert {n: m.training for n, m in model.named_modules()} == modes
    # dropout was off in the computation (eval-mode reference); the frozen weight is not in θ
    expected_sequence, expected_prefix = _reference(model, ids, response, attention)
    torch.testing.assert_close(sequence, expected_sequence, rtol=RTOL, atol=0)
    torch.testing.assert_close(prefix, expected_prefix, rtol=RTOL, atol=0)


class _ToyLM(nn.Module):
    """A small causal LM returning a plain logits tensor, with optional float32
    islands (as in transformers' RMSNorm / eager attention) and optional
    data-dependent Python control flow (which vmap over rows cannot trace)."""

    def __init__(self, vocab=7, width=5, island=False, branch=False):
        super().__init__()
        self.island, self.branch = island, branch
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        h = self.embed(input_ids)  # [1, L, H]
        dtype = h.dtype
        counts = torch.arange(1, h.shape[1] + 1, dtype=dtype)[None, :, None]
        h = h.cumsum(1) / counts  # causal running mean
        if self.island:
            h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMS norm
        h = h * torch.softmax(h, dim=-1, dtype=torch.float32 if self.island else None)
        h = torch.tanh(self.mix(h.to(dtype)))
        if self.branch and int(input_ids.max()) > 3:  # data-dependent branch
            h = h * 1.5
        return self.head(h)  # [1, L, V]


_TOY_IDS = torch.tensor([[1, 2, 3, 1, 2, 0], [5, 6, 0, 1, 6, 2], [0, 1, 1, 2, 2, 3]])
_TOY_RESPONSE = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 0, 1], [0, 1, 1, 1, 0, 0]])


@pytest.fixture
def vmap_record(monkeypatch):
    """Records, after each chunk of rows, whether it ran under vmap (False: the row-loop fallback)."""
    record = []
    original = grad_norms._run_chunk

    def spy(job, *args):
        out = original(job, *args)
        record.append(job.use_vmap)
        return out

    monkeypatch.setattr(grad_norms, "_run_chunk", spy)
    return record


def test_hf_models_take_the_vmap_path(vmap_record):
    """Rows grouped by attention-mask pattern vmap fine on transformers' SDPA models (no silent fallback)."""
    ids, response, attention = _batch()
    for build in (_qwen2, _llama):
        model = build()
        sequence_grad_norms_sq_fp64(model, ids, response, attention)
        prefix_grad_norms_sq_fp64(model, ids, response, attention)
        prefix_grad_norms_sq_fp64(model, ids, response)
    assert len(vmap_record) == 2 * (4 + 4 + 1)  # 4 attention patterns among the rows with a response
    assert all(vmap_record)


def test_vmap_failure_falls_back_to_row_loop(vmap_record):
    torch.manual_seed(12)
    model = _ToyLM(branch=True)
    expected_sequence, expected_prefix = _reference(model, _TOY_IDS, _TOY_RESPONSE, temperature=1.2)
    got_sequence = sequence_grad_norms_sq_fp64(model, _TOY_IDS, _TOY_RESPONSE, temperature=1.2)
    got_prefix = prefix_grad_norms_sq_fp64(model, _TOY_IDS, _TOY_RESPONSE, temperature=1.2)
    torch.testing.assert_close(got_sequence, expected_sequence, rtol=RTOL, atol=0)
    torch.testing.assert_close(got_prefix, expected_prefix, rtol=RTOL, atol=0)
    assert vmap_record == [False, False]  # each call fell back to the row loop


def test_float32_islands_are_promoted():
    """A float32 island inside the forward is computed in float64: the norms equal the island-free model's."""
    torch.manual_seed(13)
    island = _ToyLM(island=True)
    plain = _ToyLM(island=False)
    plain.load_state_dict(island.state_dict())
    expected_sequence, expected_prefix = _reference(plain, _TOY_IDS, _TOY_RESPONSE)
    torch.testing.assert_close(
        sequence_grad_norms_sq_fp64(island, _TOY_IDS, _TOY_RESPONSE), expected_sequence, rtol=RTOL, atol=0
    )
    torch.testing.assert_close(
        prefix_grad_norms_sq_fp64(island, _TOY_IDS, _TOY_RESPONSE), expected_prefix, rtol=RTOL, atol=0
    )
    # the island does round when not promoted (so the check above is not vacuous)
    island64 = copy.deepcopy(island).double()
    h = island64(_TOY_IDS[:1])
    assert h.dtype == torch.float64
    assert not torch.allclose(h, plain.double()(_TOY_IDS[:1]), rtol=1e-12, atol=0)


def _bad_cases():
    ids, response, attention = _batch()
    frozen = _qwen2(seed=0)
    for p in frozen.parameters():
        p.requires_grad_(False)
    column0 = response.clone()
    column0[0, 0] = 1
    on_padding = response.clone()
    on_padding[2, 8] = 1  # row 2 is right-padded from position 7
    on_left_padding = torch.zeros_like(response)
    on_left_padding[1, 2] = 1  # row 1's first real token, predicted from padding
    two = response.clone()
    two[0, 4] = 2
    return [
        ("input_ids", dict(input_ids=ids[0])),
        ("input_ids", dict(input_ids=ids.double())),
        ("input_ids", dict(input_ids=ids.tolist())),
        ("input_ids", dict(input_ids=ids - 1)),
        ("input_ids", dict(input_ids=ids + 16)),
        ("response_mask", dict(response_mask=response[:, :-1])),
        ("response_mask", dict(response_mask=two)),
        ("response_mask", dict(response_mask=column0)),
        ("response_mask", dict(response_mask=on_padding)),
        ("response_mask", dict(response_mask=on_left_padding)),
        ("response_mask", dict(response_mask=None)),
        ("attention_mask", dict(attention_mask=attention[:, 1:])),
        ("attention_mask", dict(attention_mask=attention * 3)),
        ("attention_mask", dict(attention_mask=attention[0])),
        ("temperature", dict(temperature=0.0)),
        ("temperature", dict(temperature=-1.0)),
        ("temperature", dict(temperature=float("nan"))),
        ("temperature", dict(temperature="hot")),
        ("temperature", dict(temperature=True)),
        ("model", dict(model=frozen)),
        ("model", dict(model=lambda x: x)),
    ]


@pytest.mark.parametrize("function", [sequence_grad_norms_sq_fp64, prefix_grad_norms_sq_fp64])
def test_bad_inputs_name_the_argument(function):
    ids, response, attention = _batch()
    good = dict(model=_qwen2(seed=0), input_ids=ids, response_mask=response, attention_mask=attention, temperature=1.0)
    function(**good)  # the good call works
    for name, change in _bad_cases():
        with pytest.raises(ValueError, match=rf"^{name}: "):
            function(**{**good, **change})


@pytest.mark.parametrize("cut", ["last position", "vocabulary dim", "extra position", "extra dim"])
def test_a_model_whose_logits_do_not_cover_the_row_is_refused(cut):
    """Logits of shape (1, L − 1, V) or (1, L) for a row of L tokens: an error naming the shape, not a silent
    misalignment."""

    class Truncated(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = _qwen2()

        def forward(self, input_ids, **kwargs):
            logits = self.lm(input_ids, **kwargs).logits
            if cut == "extra position":
                return torch.cat([logits, logits[:, -1:]], dim=1)
            if cut == "extra dim":
                return logits[:, :, None]
            return logits[:, :-1] if cut == "last position" else logits[..., 0]

    model = Truncated()
    ids, response = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[0, 0, 1, 1]])
    with pytest.raises(ValueError, match=r"^model: expected logits of shape \(1, 4, V\) for one row, got \(1, "):
        sequence_grad_norms_sq_fp64(model, ids, response)


def test_one_row_with_a_response_among_empty_ones_gets_its_norm():
    """Rows without a response are skipped (norm 0); a batch with exactly one response row still computes it."""
    model = _qwen2(seed=6)
    ids, response, _ = _batch(seed=6)
    only = torch.zeros_like(response)
    only[1] = response[1]
    expected, _ = _reference(model, ids, only)
    got = sequence_grad_norms_sq_fp64(model, ids, only)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=0)
    assert float(got[1]) > 0 and float(got.sum() - got[1]) == 0.0


def test_exact_under_inference_mode_and_without_a_warning():
    """The float64 copy runs autograd even when the caller is under torch.inference_mode, and warns about nothing
    (the warning is for logits that stay below float64)."""
    import warnings

    model = _qwen2(seed=7)
    ids, response, attention = _batch(seed=7)
    want = sequence_grad_norms_sq_fp64(model, ids, response, attention)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            got = sequence_grad_norms_sq_fp64(model, ids, response, attention)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_first_bad_response_position_is_named():
    """A response token on padding: the error names the first such (row, position) in row-major order."""
    model = _qwen2(seed=8)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    attention = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]])
    response = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])  # (0, 1) is predicted from padding; (1, 2), (1, 3) too
    with pytest.raises(ValueError, match=r"at \(row 0, position 1\)"):
        sequence_grad_norms_sq_fp64(model, ids, response, attention)


@pytest.mark.parametrize("ids", [torch.ones(2, 4, 1, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)])
def test_input_ids_must_be_a_2d_integer_tensor(ids):
    response = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    with pytest.raises(ValueError, match="^input_ids: "):
        sequence_grad_norms_sq_fp64(_qwen2(seed=9), ids, response)


def test_inputs_made_under_inference_mode_are_accepted():
    """Ids and masks created under torch.inference_mode (inference tensors) are copied into normal tensors."""
    model = _qwen2(seed=10)
    ids, response, attention = _batch(seed=10)
    want = sequence_grad_norms_sq_fp64(model, ids, response, attention)
    with torch.inference_mode():
        frozen = [t.clone() for t in (ids, response, attention)]
    torch.testing.assert_close(sequence_grad_norms_sq_fp64(model, *frozen), want, rtol=0, atol=0)


def test_an_id_at_the_vocabulary_size_is_refused():
    model = _qwen2(seed=11)
    vocab = model.get_input_embeddings().num_embeddings
    ids, response = torch.tensor([[1, 2, vocab]]), torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match=rf"^input_ids: id {vocab} >= the model's vocabulary size {vocab}"):
        sequence_grad_norms_sq_fp64(model, ids, response)


def test_a_model_that_cannot_name_its_embedding_is_not_range_checked():
    """get_input_embeddings raising (as some wrappers do): no vocabulary check, the norms as for the model inside."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = _qwen2(seed=12)

        def get_input_embeddings(self):
            raise NotImplementedError

        def forward(self, input_ids, **kwargs):
            return self.lm(input_ids, **kwargs)

    wrapper = Wrapper()
    ids, response, attention = _batch(seed=12)
    want = sequence_grad_norms_sq_fp64(wrapper.lm, ids, response, attention)
    torch.testing.assert_close(sequence_grad_norms_sq_fp64(wrapper, ids, response, attention), want, rtol=0, atol=0)
