"""The Logit-Gradient Proxy (F6): identities, stability, the chunked LM-head path."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import logits_tensors

from otb_ref import logprobs_and_sum_pi_squared, sum_pi_squared, token_energy

# fp64 identities hold to rounding: a few ulps of quantities of size <= 2.
EXACT = dict(rtol=1e-12, atol=1e-12)


def _naive(hidden, weight, targets, temperature=1.0):
    """Full-logits reference: log π(y) and Σπ² from the [N, V] matrix."""
    logits = (hidden @ weight.T).to(torch.float64 if hidden.dtype == torch.float64 else torch.float32) / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    return log_probs, log_softmax.exp().square().sum(-1)


@given(logits_tensors(), st.data(), st.sampled_from([1.0, 0.7, 1.6]))
def test_logit_gradient_identity(logits, data, temperature):
    """||∇_u log softmax(u/τ)_y||² · τ² = 1 − 2π_y + Σπ² (autograd vs the formula)."""
    y = torch.tensor(
        data.draw(st.lists(st.integers(0, logits.shape[1] - 1), min_size=logits.shape[0], max_size=logits.shape[0]))
    )
    u = logits.clone().requires_grad_(True)
    log_probs = torch.log_softmax(u / temperature, -1).gather(-1, y[:, None]).squeeze(-1)
    (grad,) = torch.autograd.grad(log_probs.sum(), u)  # rows are independent
    autograd_energy = grad.square().sum(-1) * temperature**2
    formula = token_energy(log_probs.detach(), sum_pi_squared(logits, temperature=temperature))
    torch.testing.assert_close(formula, autograd_energy, **EXACT)
    assert bool(((formula >= 0) & (formula <= 2)).all())


@given(logits_tensors(max_vocab=12))
def test_sum_pi_squared_matches_logsumexp_form(logits):
    """Σπ² = exp(logsumexp(2z) − 2 logsumexp(z)) = Σ softmax(z)², at every logit scale up to 1e4."""
    got = sum_pi_squared(logits)
    direct = torch.softmax(logits, -1).square().sum(-1)
    torch.testing.assert_close(got, direct, **EXACT)
    if logits.abs().max() < 100:  # the logsumexp form itself is only stable at moderate scale
        lse_form = torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1))
        torch.testing.assert_close(got, lse_form, **EXACT)
    assert bool(((got >= 1 / logits.shape[-1] - 1e-15) & (got <= 1)).all())


def test_sum_pi_squared_extreme_scales():
    """|z| = 1e4 and ties: one-hot gives exactly 1, a k-way tie gives 1/k."""
    z = torch.tensor([[1e4, -1e4, 0.0], [1e4, 1e4, -1e4], [-1e4, -1e4, -1e4]], dtype=torch.float32)
    torch.testing.assert_close(sum_pi_squared(z), torch.tensor([1.0, 0.5, 1 / 3]), rtol=1e-6, atol=0)


def test_sum_pi_squared_masked_vocabulary():
    """-inf logits drop out: Σπ² equals that of the remaining entries."""
    z = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    masked = z.clone()
    masked[:, 4:] = float("-inf")
    torch.testing.assert_close(sum_pi_squared(masked), sum_pi_squared(z[:, :4]), **EXACT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_pi_squared_low_precision_inputs(dtype):
    """Low-precision logits are evaluated in fp32: equal to fp64 on the same rounded values to fp32 accuracy."""
    z = (torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    got = sum_pi_squared(z)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), sum_pi_squared(z.double()), rtol=1e-5, atol=0)


def test_sum_pi_squared_rejects_undefined_rows():
    """A row with NaN, +inf or no finite logit has no distribution: ValueError naming logits."""
    for bad in [float("nan"), float("inf")]:
        z = torch.zeros(2, 3)
        z[1, 0] = bad
        with pytest.raises(ValueError, match="logits"):
            sum_pi_squared(z)
    with pytest.raises(ValueError, match="logits"):
        sum_pi_squared(torch.full((1, 3), float("-inf")))
    with pytest.raises(ValueError, match="temperature"):
        sum_pi_squared(torch.zeros(1, 3), temperature=0.0)


def test_sum_pi_squared_does_not_modify_input():
    z = torch.randn(3, 4, dtype=torch.float32)
    before = z.clone()
    sum_pi_squared(z, temperature=0.5)
    assert torch.equal(z, before)


@given(st.integers(1, 5), st.integers(1, 6), st.integers(2, 8), st.integers(0, 2**31 - 1))
def test_lm_head_identity(rows, d, vocab, seed):
    """For z = U h: ||∇_U log π(y)||_F² = (1 − 2π_y + Σπ²) ||h||² (F6 case b), per row."""
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(vocab, d, dtype=torch.float64, generator=g)
    for _ in range(rows):
        h = torch.randn(d, dtype=torch.float64, generator=g)
        y = int(torch.randint(vocab, (1,), generator=g))
        weight = U.clone().requires_grad_(True)
        log_probs, sum_pi_sq = logprobs_and_sum_pi_squared(h[None], weight, torch.tensor([y]))
        (grad,) = torch.autograd.grad(log_probs.sum(), weight)
        predicted = token_energy(log_probs.detach(), sum_pi_sq)[0] * h.square().sum()
        torch.testing.assert_close(grad.square().sum(), predicted, **EXACT)


@given(
    st.integers(1, 40),
    st.integers(1, 8),
    st.integers(1, 30),
    st.integers(1, 50),
    st.sampled_from([1.0, 0.6]),
    st.integers(0, 2**31 - 1),
)
def test_chunked_equals_naive_values_and_gradients_fp64(n, d, vocab, chunk_size, temperature, seed):
    """Chunked log-probs, Σπ² and both gradients equal the full-logits computation (fp64)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, dtype=torch.float64, generator=g) * 2
    weight = torch.randn(vocab, d, dtype=torch.float64, generator=g)
    targets = torch.randint(vocab, (n,), generator=g)
    upstream = torch.randn(n, dtype=torch.float64, generator=g)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, sum_pi_sq = logprobs_and_sum_pi_squared(h1, w1, targets, temperature=temperature, chunk_size=chunk_size)
    (lp * upstream).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp_ref, sps_ref = _naive(h2, w2, targets, temperature)
    (lp_ref * upstream).sum().backward()
    torch.testing.assert_close(lp, lp_ref, **EXACT)
    torch.testing.assert_close(sum_pi_sq, sps_ref, **EXACT)
    torch.testing.assert_close(h1.grad, h2.grad, **EXACT)
    torch.testing.assert_close(w1.grad, w2.grad, **EXACT)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_chunked_equals_naive_low_precision(dtype, tol):
    """fp32 and bf16 inputs: chunked equals naive to the rounding of the input dtype (3-D hidden too)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 25, 16, generator=g).to(dtype)
    weight = (torch.randn(300, 16, generator=g) / 4).to(dtype)
    targets = torch.randint(300, (4, 25), generator=g)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, sum_pi_sq = logprobs_and_sum_pi_squared(h1, w1, targets, chunk_size=7)
    lp.sum().backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp_ref, sps_ref = _naive(h2, w2, targets)
    lp_ref.sum().backward()
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    torch.testing.assert_close(lp, lp_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(sum_pi_sq, sps_ref, rtol=tol, atol=tol)
    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(w1.grad.float(), w2.grad.float(), rtol=tol, atol=tol)


def test_chunked_saves_no_logits_for_backward():
    """Backward keeps hidden, weight, targets and one scalar per row, never a [*, V] buffer."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp, sum_pi_sq = logprobs_and_sum_pi_squared(hidden, weight, torch.randint(1000, (64,)), chunk_size=16)
    assert saved, "the hook saw the saved tensors"
    assert max(t.numel() for t in saved) == weight.numel()
    assert sum(t.numel() for t in saved) <= weight.numel() + hidden.numel() + 2 * 64
    assert not sum_pi_sq.requires_grad


def test_chunked_only_one_input_needs_grad():
    """Gradients flow to whichever of hidden / weight requires them."""
    hidden, weight = torch.randn(5, 3), torch.randn(7, 3)
    targets = torch.randint(7, (5,))
    for h_grad, w_grad in [(True, False), (False, True)]:
        h, w = hidden.clone().requires_grad_(h_grad), weight.clone().requires_grad_(w_grad)
        logprobs_and_sum_pi_squared(h, w, targets)[0].sum().backward()
        assert (h.grad is not None) == h_grad and (w.grad is not None) == w_grad


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 3), targets=torch.zeros(3, dtype=torch.long)), "hidden"),
        (
            dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 4).double(), targets=torch.zeros(3, dtype=torch.long)),
            "weight",
        ),
        (dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 4), targets=torch.zeros(2, dtype=torch.long)), "targets"),
        (dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 4), targets=torch.full((3,), 5)), "targets"),
        (dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 4), targets=torch.zeros(3)), "targets"),
        (
            dict(
                hidden=torch.randn(3, 4),
                weight=torch.randn(5, 4),
                targets=torch.zeros(3, dtype=torch.long),
                chunk_size=0,
            ),
            "chunk_size",
        ),
        (
            dict(
                hidden=torch.randn(3, 4),
                weight=torch.randn(5, 4),
                targets=torch.zeros(3, dtype=torch.long),
                temperature=-1,
            ),
            "temperature",
        ),
    ],
)
def test_chunked_rejects_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        logprobs_and_sum_pi_squared(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_energy_absolute_error_near_deterministic_tokens(dtype):
    """token_energy's error is absolute, a few ulp of 1, even where w ~ (1 − π_y)² is far below that (π_y → 1).

    Reference: ``(1 − π_y)² + Σ_{v≠y} π_v²`` with ``1 − π_y = −expm1(log π_y)``, in fp64 from fp64 logits (no
    cancellation). Bound: 8 ulp(1) of the dtype (the rounding of Σπ², exp and two additions near 1).
    """
    gaps = torch.tensor([0.0, 1.0, 5.0, 10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    logits = torch.stack([gaps, torch.zeros_like(gaps), -gaps / 2], dim=-1)  # [7, 3]; token 0 sampled
    log_probs = torch.log_softmax(logits, -1)
    others = log_probs[:, 1:].exp().square().sum(-1)
    reference = torch.expm1(log_probs[:, 0]).square() + others  # [7], exact to ~1e-16 relative
    got = token_energy(log_probs[:, 0].to(dtype), sum_pi_squared(logits.to(dtype))).double()
    bound = 8 * torch.finfo(dtype).eps
    assert float((got - reference).abs().max()) <= bound
    assert float(reference[-1]) < 1e-30  # the regime where that absolute error is all of w


def test_f6_token_energy_rejects_shape_mismatch_and_clamps():
    for shapes in [((2, 3), (3, 2)), ((3, 4), (3, 2)), ((3,), (3, 1)), ((3, 1), (3,))]:  # no broadcasting either
        with pytest.raises(ValueError, match="sum_pi_squared"):
            token_energy(torch.zeros(shapes[0]), torch.zeros(shapes[1]))
    # Inconsistent inputs (Σπ² below π_y²) are clamped into [0, 2].
    assert float(token_energy(torch.tensor([0.0]), torch.tensor([0.5]))) == 0.0


def test_sum_pi_squared_reduces_the_last_dim_of_any_batch_shape():
    """[B, T, V] logits: each [b, t] is its own distribution over the last dim (not over T or B)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64) * 3
    got = sum_pi_squared(logits)
    assert got.shape == (2, 3)
    want = torch.stack(
        [torch.stack([torch.softmax(logits[b, t], -1).square().sum() for t in range(3)]) for b in range(2)]
    )
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5)])
def test_sum_pi_squared_of_no_rows_is_empty(shape):
    assert sum_pi_squared(torch.zeros(shape)).shape == shape[:-1]


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0), ()])
def test_sum_pi_squared_needs_a_vocabulary(shape):
    with pytest.raises(ValueError, match="^logits: needs a non-empty last"):
        sum_pi_squared(torch.zeros(shape))


@pytest.mark.parametrize("chunk_size", [True, 2.0, "2", -1])
def test_chunk_size_must_be_a_positive_int(chunk_size):
    with pytest.raises(ValueError, match="^chunk_size: expected a positive integer"):
        logprobs_and_sum_pi_squared(
            torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), chunk_size=chunk_size
        )


def test_auto_uses_the_compiled_kernels_only_on_cuda(monkeypatch):
    """implementation="auto" picks the fused (Triton) path on CUDA only, even where Triton is importable."""
    from otb_ref import proxy

    monkeypatch.setattr(proxy, "has_triton", lambda: True)
    assert not proxy.takes_fused_path("auto", torch.zeros(1, 2))
    assert not proxy.takes_fused_path("auto", torch.zeros(1, 2, device="meta"))
    assert not proxy.takes_fused_path("fused", torch.zeros(1, 2, dtype=torch.float64))  # fp64: always eager
    assert proxy.takes_fused_path("fused", torch.zeros(1, 2))
    monkeypatch.setattr(proxy, "has_triton", lambda: False)
    assert not proxy.takes_fused_path("auto", torch.zeros(1, 2))


def test_implementation_rule_on_cuda(monkeypatch):
    """On CUDA with Triton: "auto" and "fused" are fused, "eager" and fp64 are not, whatever the strings' identity
    (names read from a config are equal to the literals, not the same objects). Only dtype and device are read."""
    from types import SimpleNamespace

    from otb_ref import proxy

    cuda = SimpleNamespace(dtype=torch.float32, device=torch.device("cuda"))
    monkeypatch.setattr(proxy, "has_triton", lambda: True)
    for name in proxy.IMPLEMENTATIONS:
        built = "".join(list(name))  # equal, not identical
        assert proxy.takes_fused_path(built, cuda) == (name != "eager"), name
    assert not proxy.takes_fused_path("auto", SimpleNamespace(dtype=torch.float64, device=torch.device("cuda")))
    monkeypatch.setattr(proxy, "has_triton", lambda: False)
    assert not proxy.takes_fused_path("auto", cuda) and proxy.takes_fused_path("fused", cuda)


def _lm_head(hidden_shape=(3, 4), vocab=5, targets=None):
    hidden, weight = torch.randn(*hidden_shape), torch.randn(vocab, hidden_shape[-1] if hidden_shape else 4)
    if targets is None:
        targets = torch.zeros(hidden_shape[:-1], dtype=torch.long)
    return dict(hidden=hidden, weight=weight, targets=targets)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(weight=torch.randn(5)), "weight"),
        (dict(weight=torch.randn(5, 4, 1)), "weight"),
        (dict(hidden=torch.tensor(1.0), targets=torch.tensor(0)), "hidden"),
        (dict(hidden=torch.randn(3, 6)), "hidden"),
        (dict(hidden=torch.randn(3, 2)), "hidden"),
        (dict(targets=torch.zeros(2, dtype=torch.long)), "targets"),
        (dict(targets=torch.zeros(4, dtype=torch.long)), "targets"),
        (dict(targets=torch.tensor([0, -1, 0])), "targets"),
        (dict(targets=torch.tensor([0, 5, 0])), "targets"),
        (dict(targets=torch.tensor([0, 9, 0])), "targets"),
    ],
)
def test_lm_head_input_rules(change, name):
    """weight [V, d]; hidden [..., d] with at least one dim; targets of hidden's leading shape, ids in [0, V)."""
    with pytest.raises(ValueError, match=f"^{name}"):
        logprobs_and_sum_pi_squared(**{**_lm_head(), **change})


def test_lm_head_accepts_one_position_and_the_edge_ids():
    """A single hidden vector [d] with a 0-D target, and the ids 0 and V − 1, are valid."""
    log_probs, spp = logprobs_and_sum_pi_squared(**_lm_head(hidden_shape=(4,), targets=torch.tensor(4)))
    assert log_probs.shape == spp.shape == ()
    logprobs_and_sum_pi_squared(**_lm_head(targets=torch.tensor([0, 4, 0])))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sum_pi_squared_divides_the_logits_by_the_temperature(temperature):
    """F6 at temperature τ is Σπ² of the logits divided by τ, for τ below and above 1."""
    logits = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 3
    torch.testing.assert_close(sum_pi_squared(logits, temperature=temperature), sum_pi_squared(logits / temperature))
    assert not torch.allclose(sum_pi_squared(logits, temperature=temperature), sum_pi_squared(logits))


@pytest.mark.parametrize("rows, vocab", [(2, (1 << 22) + 3), (1100, 4096)])
def test_default_chunks_are_invisible_past_the_cpu_budget(rows, vocab):
    """The default chunk holds about 4M logits on CPU: a vocabulary above that (one row a chunk) and more rows than
    one chunk holds give the full-logits values."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(rows, 1, generator=g), torch.randn(vocab, 1, generator=g)
    targets = torch.randint(vocab, (rows,), generator=g)
    log_probs, spp = logprobs_and_sum_pi_squared(hidden, weight, targets)
    want_log_probs, want_spp = _naive(hidden, weight, targets)
    torch.testing.assert_close(log_probs, want_log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(spp, want_spp, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("vocab", [0, 5])
def test_lm_head_of_no_rows_is_empty_whatever_the_vocabulary(vocab):
    log_probs, spp = logprobs_and_sum_pi_squared(torch.zeros(0, 4), torch.zeros(vocab, 4), torch.zeros(0).long())
    assert log_probs.shape == spp.shape == (0,)


@pytest.mark.parametrize("implementation, dtype", [("eager", torch.float64), ("fused", torch.float32)])
def test_lm_head_is_differentiable_once(implementation, dtype):
    """Backward is marked once-differentiable (its saved logsumexp carries no graph): a second derivative raises
    instead of being silently wrong."""
    hidden = torch.randn(3, 4, dtype=dtype, requires_grad=True)
    weight = torch.randn(5, 4, dtype=dtype, requires_grad=True)
    log_probs, _ = logprobs_and_sum_pi_squared(hidden, weight, torch.tensor([0, 4, 2]), implementation=implementation)
    upstream = torch.ones(3, dtype=log_probs.dtype, requires_grad=True)  # so the gradient has a graph to follow
    (grad_hidden,) = torch.autograd.grad(log_probs, hidden, grad_outputs=upstream, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_hidden.sum().backward()


def test_lm_head_compares_sizes_by_value():
    """d above 256 (beyond CPython's cached small ints) matches the weight's d."""
    hidden, weight = torch.randn(2, 300, dtype=torch.float64), torch.randn(3, 300, dtype=torch.float64)
    targets = torch.tensor([2, 0])
    log_probs, spp = logprobs_and_sum_pi_squared(hidden, weight, targets)
    want_log_probs, want_spp = _naive(hidden, weight, targets)
    torch.testing.assert_close(log_probs, want_log_probs, **EXACT)
    torch.testing.assert_close(spp, want_spp, **EXACT)


def test_lm_head_errors_state_the_shapes_they_compare():
    """The messages quote weight's d and hidden's leading dims (what the user must match)."""
    hidden, weight = torch.randn(2, 3, 4), torch.randn(5, 6)
    with pytest.raises(ValueError, match=r"^hidden: last dim of shape \(2, 3, 4\) does not match weight's d = 6$"):
        logprobs_and_sum_pi_squared(hidden, weight, torch.zeros(2, 3).long())
    with pytest.raises(ValueError, match=r"^targets: shape \(2, 2\) does not match hidden's leading dims \(2, 3\)$"):
        logprobs_and_sum_pi_squared(hidden, torch.randn(5, 4), torch.zeros(2, 2).long())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("implementation", ["eager", "fused"])
def test_lm_head_temperatures_below_and_above_one(temperature, implementation):
    """The LM-head path at τ = 0.5 and 2 (1/τ = 2 and 0.5) equals the full-logits reference."""
    g = torch.Generator().manual_seed(5)
    dtype = torch.float64 if implementation == "eager" else torch.float32
    hidden, weight = torch.randn(6, 3, generator=g, dtype=dtype), torch.randn(9, 3, generator=g, dtype=dtype)
    targets = torch.randint(9, (6,), generator=g)
    got = logprobs_and_sum_pi_squared(hidden, weight, targets, temperature=temperature, implementation=implementation)
    want = _naive(hidden, weight, targets, temperature)
    tol = EXACT if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
