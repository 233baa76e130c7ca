"""The fused chunked LM-head path equals the eager path: values, both gradients, every option.

On CPU the fused functions run as plain torch (on accelerators the same
functions are compiled); ``implementation`` selects the path.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from otb_ref import logprobs_and_sum_pi_squared, proxy


def _run(hidden, weight, targets, upstream, implementation, needs=(True, True), **kwargs):
    """``(log_probs, Σπ², ∂hidden, ∂weight)`` of ``Σ upstream · log_probs``."""
    h = hidden.clone().requires_grad_(needs[0])
    w = weight.clone().requires_grad_(needs[1])
    log_probs, sum_pi_squared = logprobs_and_sum_pi_squared(h, w, targets, implementation=implementation, **kwargs)
    (log_probs * upstream.to(log_probs.dtype)).sum().backward()
    return log_probs, sum_pi_squared, h.grad, w.grad


def _inputs(n, d, vocab, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, d, generator=g) * 2).to(dtype)
    weight = torch.randn(vocab, d, generator=g).to(dtype)
    targets = torch.randint(vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    return hidden, weight, targets, upstream


@given(
    st.integers(1, 40),
    st.integers(1, 8),
    st.integers(1, 50),
    st.integers(1, 50),
    st.sampled_from([1.0, 0.6, 1.7]),
    st.integers(0, 2**31 - 1),
)
def test_fused_equals_eager_fp32(n, d, vocab, chunk_size, temperature, seed):
    """fp32: values bit-equal (the same operations); gradients equal to fp32 rounding.

    The two paths form the logits' gradient in a different order
    (``(−πg + g e_y)/τ`` vs ``(e_y − π)·(g/τ)``): each entry differs by a few
    ulps of ``|g|/τ`` (absolute: ``1 − π`` may cancel, so not relative to the
    entry). A gradient entry sums at most max(N, V) of them times ``|W|`` or
    ``|h|``: atol = 4·2^-23·max(N, V)·max|g|/τ·max(|h|, |W|), plus rtol 2e-5
    for the matmuls' own rounding.
    """
    hidden, weight, targets, upstream = _inputs(n, d, vocab, seed)
    kwargs = dict(temperature=temperature, chunk_size=chunk_size)
    eager = _run(hidden, weight, targets, upstream, "eager", **kwargs)
    fused = _run(hidden, weight, targets, upstream, "fused", **kwargs)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
    scale = float(upstream.abs().max()) / temperature * max(float(hidden.abs().max()), float(weight.abs().max()))
    atol = 4 * 2**-23 * max(n, vocab) * scale
    for got, want in zip(fused[2:], eager[2:]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=atol)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_fused_gradient_sign_and_temperature(temperature):
    """Against full-logits autograd in fp64 arithmetic on fp32 data: catches a flipped grad_z or a missing 1/τ."""
    hidden, weight, targets, upstream = _inputs(23, 5, 17, seed=7)
    got = _run(hidden, weight, targets, upstream, "fused", temperature=temperature, chunk_size=6)
    h, w = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    log_probs = torch.log_softmax((h @ w.T) / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    (log_probs * upstream.double()).sum().backward()
    torch.testing.assert_close(got[0].double(), log_probs.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2].double(), h.grad, rtol=1e-4, atol=1e-4 * float(h.grad.abs().max()))
    torch.testing.assert_close(got[3].double(), w.grad, rtol=1e-4, atol=1e-4 * float(w.grad.abs().max()))


def test_fused_equals_eager_bf16():
    """bf16: values bit-equal; gradients within the rounding the two accumulation orders allow.

    Both paths round the logits' gradient to bf16 (unit roundoff u = 2^-8)
    before the matmuls. The eager path adds each chunk's bf16 ∂W in an fp32
    buffer; the fused path adds it into the bf16 result (one rounding per
    chunk). With K chunks each path is within (K + 2)·u·max|∂| of the exact
    gradient of the same bf16 inputs (computed in fp64 here), and so is
    checked; the fused-vs-eager difference then is at most twice that.
    """
    hidden, weight, targets, upstream = _inputs(50, 16, 300, seed=3, dtype=torch.bfloat16)
    weight = weight / 4
    chunk_size, num_chunks = 16, 4
    eager = _run(hidden, weight, targets, upstream, "eager", chunk_size=chunk_size, temperature=0.8)
    fused = _run(hidden, weight, targets, upstream, "fused", chunk_size=chunk_size, temperature=0.8)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
    exact = _run(hidden.double(), weight.double(), targets, upstream, "eager", chunk_size=chunk_size, temperature=0.8)
    for got, want, ref in zip(fused[2:], eager[2:], exact[2:]):
        assert got.dtype == torch.bfloat16
        bound = (num_chunks + 2) * 2**-8 * float(ref.abs().max())
        assert float((got.double() - ref).abs().max()) <= bound
        assert float((want.double() - ref).abs().max()) <= bound


def test_fused_fp64_is_the_eager_path():
    """fp64 input takes the eager path whatever is asked: bit-equal."""
    hidden, weight, targets, upstream = _inputs(30, 4, 20, seed=5, dtype=torch.float64)
    eager = _run(hidden, weight, targets, upstream, "eager", chunk_size=7, temperature=0.6)
    fused = _run(hidden, weight, targets, upstream, "fused", chunk_size=7, temperature=0.6)
    for got, want in zip(fused, eager):
        assert got.dtype == torch.float64 and torch.equal(got, want)


def test_fused_masked_vocabulary():
    """-inf logits (masked vocabulary) drop out as in the eager path; the weight gradient matches.

    Column 0 of ``hidden`` is 1 and column 0 of ``weight`` is -inf on masked
    rows, so those logits are exactly -inf (the hidden gradient is NaN there
    on both paths: 0 · -inf; only the weight's is compared).
    """
    hidden, weight, targets, upstream = _inputs(20, 6, 30, seed=11)
    hidden[:, 0] = 1.0
    weight[20:, 0] = float("-inf")
    targets = targets % 20
    kwargs = dict(chunk_size=8, temperature=0.7, needs=(False, True))
    eager = _run(hidden, weight, targets, upstream, "eager", **kwargs)
    fused = _run(hidden, weight, targets, upstream, "fused", **kwargs)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
    unmasked = logprobs_and_sum_pi_squared(hidden, weight[:20], targets, temperature=0.7, implementation="fused")
    torch.testing.assert_close(fused[0], unmasked[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused[1], unmasked[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(fused[3][20:], torch.zeros_like(fused[3][20:]))
    torch.testing.assert_close(fused[3], eager[3], rtol=2e-5, atol=2e-5 * float(eager[3].abs().max()))


def test_fused_default_chunk_3d_hidden_and_one_input_needing_grad():
    """Default chunk, [B, L, d] hidden, and gradients only where asked."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(3, 7, 4, generator=g), torch.randn(9, 4, generator=g)
    targets = torch.randint(9, (3, 7), generator=g)
    upstream = torch.randn(3, 7, generator=g)
    for needs in [(True, False), (False, True)]:
        eager = _run(hidden, weight, targets, upstream, "eager", needs=needs)
        fused = _run(hidden, weight, targets, upstream, "fused", needs=needs)
        assert fused[0].shape == targets.shape and torch.equal(fused[0], eager[0])
        for got, want, need in zip(fused[2:], eager[2:], needs):
            assert (got is not None) == need
            if need:
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_fused_empty_input():
    """No rows: empty outputs, a zero weight gradient."""
    hidden = torch.zeros(0, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    targets = torch.zeros(0, dtype=torch.long)
    log_probs, sum_pi_squared = logprobs_and_sum_pi_squared(hidden, weight, targets, implementation="fused")
    assert log_probs.shape == sum_pi_squared.shape == (0,)
    log_probs.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_fused_backward_twice_with_retain_graph():
    """Backward starts from the last chunk's logits kept from forward and overwrites them: a second
    backward (retain_graph) must recompute them and give the same gradients."""
    hidden, weight, targets, upstream = _inputs(37, 5, 40, seed=17)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_probs, _ = logprobs_and_sum_pi_squared(h, w, targets, chunk_size=10, temperature=0.8, implementation="fused")
    loss = (log_probs * upstream).sum()
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_fused_saves_no_logits_for_backward():
    """Saved tensors are hidden, weight, targets and one scalar per row, never a [*, V] buffer.

    (The last chunk's logits ride on the autograd context from forward to backward: one chunk, not saved.)
    """
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logprobs_and_sum_pi_squared(hidden, weight, torch.randint(1000, (64,)), chunk_size=16, implementation="fused")
    assert max(t.numel() for t in saved) == weight.numel()
    assert sum(t.numel() for t in saved) <= weight.numel() + hidden.numel() + 2 * 64


def test_implementation_choice():
    """ "auto" is fused only on CUDA (with Triton); fp64 is always eager; unknown names are rejected."""
    cpu = torch.zeros(2, 3)
    assert not proxy.takes_fused_path("auto", cpu)
    assert proxy.takes_fused_path("fused", cpu) and not proxy.takes_fused_path("eager", cpu)
    assert not proxy.takes_fused_path("fused", cpu.double())
    with pytest.raises(ValueError, match="^implementation"):
        logprobs_and_sum_pi_squared(cpu, torch.zeros(5, 3), torch.zeros(2, dtype=torch.long), implementation="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fused_equals_eager_on_cuda(dtype):
    """On the GPU the compiled kernels match the eager path (rows not a multiple of the chunk, τ = 0.7).

    Tolerance: fp32, both paths compute in fp32 with different reduction
    orders and exp implementations (~1e-6 relative); bf16 gradients as in
    :func:`test_fused_equals_eager_bf16` (K = 5 chunks): (K + 2)·2^-8 of the scale.
    """
    hidden, weight, targets, upstream = (t.cuda() for t in _inputs(300, 32, 1000, seed=13))
    hidden, weight = hidden.to(dtype), (weight / 4).to(dtype)
    eager = _run(hidden, weight, targets, upstream, "eager", chunk_size=64, temperature=0.7)
    fused = _run(hidden, weight, targets, upstream, "fused", chunk_size=64, temperature=0.7)
    value_tol = 1e-5 if dtype == torch.float32 else 1e-4
    for got, want in zip(fused[:2], eager[:2]):
        torch.testing.assert_close(got, want, rtol=value_tol, atol=value_tol)
    grad_tol = 1e-4 if dtype == torch.float32 else 7 * 2**-8
    for got, want in zip(fused[2:], eager[2:]):
        assert got.dtype == dtype
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=grad_tol, atol=grad_tol * scale)


def test_fused_name_from_a_config_takes_the_fused_path(monkeypatch):
    """implementation="fused" built at run time (equal to the literal, not the same object) runs the fused
    functions on CPU, and "eager" does not."""
    calls = []
    real = proxy.fused_chunk_statistics
    monkeypatch.setattr(proxy, "fused_chunk_statistics", lambda *args: calls.append(1) or real(*args))
    hidden, weight, targets, _ = _inputs(6, 3, 7, seed=1)
    for name, fused in [("fused", True), ("eager", False)]:
        calls.clear()
        logprobs_and_sum_pi_squared(hidden, weight, targets, chunk_size=4, implementation="".join(list(name)))
        assert len(calls) == (2 if fused else 0), name


def test_compiled_wrapper_one_graph_for_every_row_count_and_no_graph_breaks(monkeypatch):
    """The accelerator wrapper: first (row) dim of every tensor argument dynamic, so chunks of any length share one
    graph; fullgraph, so a function that would fall back to eager in parts is refused. Checked with torch.compile's
    "eager" backend (dynamo's tracing and guards without code generation), which runs on CPU."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    statistics = proxy._compile_rows_dynamic(proxy.fused_chunk_statistics)
    for rows in (3, 5, 8):
        hidden, weight, targets, _ = _inputs(rows, 3, 7, seed=rows)
        got = statistics(hidden @ weight.T, targets, 0.5)
        for a, b in zip(got, proxy.fused_chunk_statistics(hidden @ weight.T, targets, 0.5)):
            torch.testing.assert_close(a, b)
    assert counters["stats"]["unique_graphs"] == 1

    def breaks_the_graph(x):
        y = x * 2
        torch._dynamo.graph_break()  # what an unsupported op does: the function would run as two graphs
        return y + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        proxy._compile_rows_dynamic(breaks_the_graph)(torch.ones(2, 3))
    torch._dynamo.reset()


def test_compiled_kernels_are_built_once():
    assert proxy._compiled_kernels() is proxy._compiled_kernels()
