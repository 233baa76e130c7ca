"""Pin of the LM heads' numbers (issue 40, item 3): a hash of seeded outputs, to compare before and after a refactor.

    PYTHONPATH=$PWD python tools/pin_lm_heads.py          # prints one hash per case and the hash of all

Covers ``otb_ref.proxy``'s public functions (``sum_pi_squared``, ``token_energy``, ``logprobs_and_sum_pi_squared``
eager and fused (CPU: the plain functions), values and gradients) and ``otb_ref.grad_norms`` (``lm_head_log_probs``
values and gradients, ``sequence_grad_norms_sq`` / ``row_grad_norms_sq`` on tiny Qwen2s, tied and untied, full and
chunked heads, every linear method), in fp32 and fp64 (bf16 where the function takes it). Same machine, same torch:
the hashes must not move. Runs on one thread in a few seconds.
"""

from __future__ import annotations

import functools
import hashlib
import inspect

import torch
from torch import nn

from otb_ref import grad_norms, proxy


def _bytes(value) -> bytes:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return f"{t.dtype}{tuple(t.shape)}".encode() + t.view(torch.uint8).numpy().tobytes()
    return b"".join(_bytes(v) for v in value)


def _proxy_cases(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 7, 33, generator=gen) * 4).to(dtype)
    logits[0, 0, :5] = -torch.inf
    for tau in (1.0, 0.7):
        yield f"sum_pi_squared tau={tau}", proxy.sum_pi_squared(logits, temperature=tau)
    log_probs = torch.log_softmax(logits.float(), -1)[..., 3].to(dtype)
    yield "token_energy", proxy.token_energy(log_probs, proxy.sum_pi_squared(logits))
    hidden = torch.randn(3, 9, 8, generator=gen).to(dtype)
    weight = torch.randn(41, 8, generator=gen).to(dtype)
    targets = torch.randint(0, 41, (3, 9), generator=gen)
    upstream = torch.randn(3, 9, generator=gen)
    for implementation in ("eager", "fused"):
        for chunk_size, tau in ((None, 1.0), (4, 1.3), (27, 0.8)):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out = proxy.logprobs_and_sum_pi_squared(
                h, w, targets, temperature=tau, chunk_size=chunk_size, implementation=implementation
            )
            grads = torch.autograd.grad(out[0], [h, w], upstream.to(out[0].dtype))
            yield f"logprobs_and_sum_pi_squared {implementation} chunk={chunk_size} tau={tau}", (*out, *grads)


def _head_cases(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 5, 6, generator=gen).to(dtype)
    torch.manual_seed(3)
    head = nn.Linear(6, 23, bias=False).to(dtype)
    targets = torch.randint(0, 23, (3, 5), generator=gen)
    upstream = torch.randn(3, 5, generator=gen)
    for chunk_size, tau in ((None, 1.0), (4, 1.3), (7, 0.6)):
        h = hidden.clone().requires_grad_()
        out = grad_norms.lm_head_log_probs(h, head, targets, temperature=tau, chunk_size=chunk_size)
        grads = torch.autograd.grad(out, [h, head.weight], upstream.to(out.dtype))
        yield f"lm_head_log_probs chunk={chunk_size} tau={tau}", (out, *grads)


def _tiny_qwen2(tied: bool, dtype: torch.dtype) -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=29,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _norm_cases(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 29, (4, 10), generator=gen)
    response = torch.zeros(4, 10)
    response[0, 4:], response[1, 6:], response[2, 2:8], response[3, 9:] = 1, 1, 1, 1
    attention = torch.ones(4, 10, dtype=torch.long)
    attention[1, :2] = 0
    for tied in (False, True):
        model = _tiny_qwen2(tied, dtype)
        for method in ("auto", "gram", "materialize"):
            for chunked, chunk_size in ((False, None), (True, None), (True, 8)):
                got = _sequence_norms(model, ids, response, attention, chunked, chunk_size, method)
                yield f"sequence_grad_norms_sq tied={tied} {method} chunked={chunked} chunk={chunk_size}", got


def _sequence_norms(model, ids, response, attention, chunked, chunk_size, method):
    """The linear method as an argument (after issue 40), or through the module global it replaced (before)."""
    call = functools.partial(
        grad_norms.sequence_grad_norms_sq, model, ids, response, attention, 0.9, chunked, chunk_size
    )
    if "linear_method" in inspect.signature(grad_norms.sequence_grad_norms_sq).parameters:
        return call(linear_method=method)
    grad_norms.LINEAR_METHOD = method
    try:
        return call()
    finally:
        grad_norms.LINEAR_METHOD = "auto"


def main() -> None:
    torch.set_num_threads(1)
    total = hashlib.sha256()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        cases = [_proxy_cases(dtype)]
        if dtype != torch.bfloat16:
            cases += [_head_cases(dtype), _norm_cases(dtype)]
        for generator in cases:
            for name, value in generator:
                digest = hashlib.sha256(_bytes(value)).hexdigest()[:16]
                total.update(digest.encode())
                print(f"{str(dtype)[6:]:9} {name:70} {digest}")
    print(f"all {total.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
