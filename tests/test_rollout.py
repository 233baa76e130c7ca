"""otb_ref.rollout: inverse-CDF sampling, top-p, EOS and variable lengths, rank-layout invariance, KV-cache use."""

import pytest
import torch

from otb_ref.rollout import generate, position_ids_from_mask, sample_tokens, sampling_uniforms


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 5))
    uniforms = torch.tensor([0.0, 0.05, 0.1, 0.35, 0.999])
    assert sample_tokens(logits, uniforms).tolist() == [0, 0, 1, 2, 3]


def test_sampling_frequencies_match_softmax_with_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    uniforms = sampling_uniforms(seed=0, step=0, num_rows=1, max_new_tokens=40_000)[0]
    tokens = sample_tokens(logits.expand(len(uniforms), -1), uniforms, temperature=2.0)
    frequencies = torch.bincount(tokens, minlength=4).double() / len(tokens)
    expected = torch.softmax(logits[0].double() / 2.0, dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.01)  # 4 sigma at n = 40k is < 0.01


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    uniforms = torch.linspace(0, 0.999, 1000)
    tokens = sample_tokens(logits.expand(1000, -1), uniforms, top_p=0.7)
    assert set(tokens.tolist()) == {1, 3}  # 0.5 + 0.25 reaches 0.7
    frequencies = torch.bincount(tokens, minlength=4).double() / 1000
    assert frequencies[1] == pytest.approx(0.5 / 0.75, abs=0.01)
    assert set(sample_tokens(logits.expand(1000, -1), uniforms, top_p=0.3).tolist()) == {1}  # at least the top token


class ToyLM:
    """Deterministic next-token logits from (last token, position): enough to test the loop's bookkeeping.

    Counts calls and checks that the cache grows by one token per call and that positions skip padding.
    """

    def __init__(self, vocab=6):
        self.vocab, self.calls = vocab, 0

    def __call__(self, input_ids, attention_mask, position_ids, cache):
        self.calls += 1
        if cache is None:
            assert torch.equal(position_ids, position_ids_from_mask(attention_mask))
            cache = input_ids.shape[1]
        else:
            assert input_ids.shape[1] == 1 and attention_mask.shape[1] == cache + 1
            cache += 1
        last, position = input_ids[:, -1], position_ids[:, -1]
        logits = torch.sin(torch.arange(self.vocab)[None, :] * (1.0 + last[:, None]) + 0.7 * position[:, None])
        return 3.0 * logits, cache


def _prompts():
    prompt_ids = torch.tensor([[0, 0, 3, 4], [0, 2, 5, 3], [4, 3, 2, 5], [0, 0, 0, 2]])
    return prompt_ids, (prompt_ids != 0).long()


def test_generate_stops_rows_at_eos_and_pads_after():
    prompt_ids, prompt_mask = _prompts()
    uniforms = sampling_uniforms(7, 1, num_rows=4, max_new_tokens=12)
    out = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, eos_token_ids=[1], pad_token_id=0, max_new_tokens=12)
    ids, mask = out.response_ids, out.response_mask
    lengths = mask.sum(1)
    for row in range(4):
        n = int(lengths[row])
        assert mask[row, :n].all() and not mask[row, n:].any()  # contiguous from the start
        assert (ids[row, n:] == 0).all()
        assert bool(out.finished[row]) == (int(ids[row, n - 1]) == 1)  # finished iff the last token is EOS
        assert not (ids[row, : n - 1] == 1).any()  # no EOS before the end
    assert ids.shape[1] == int(lengths.max())  # the loop stops when every row is done


def test_generate_is_invariant_to_how_rows_are_split():
    """Rows sampled in one batch or in two halves (two ranks) get identical tokens."""
    prompt_ids, prompt_mask = _prompts()
    uniforms = sampling_uniforms(3, 5, num_rows=4, max_new_tokens=10)
    kwargs = dict(eos_token_ids=[1, 5], pad_token_id=0, max_new_tokens=10, temperature=0.8, top_p=0.9)
    whole = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, **kwargs)
    halves = [generate(ToyLM(), prompt_ids[r], prompt_mask[r], uniforms[r], keep_going=lambda alive: True, **kwargs) for r in (slice(0, 2), slice(2, 4))]
    for r, half in zip((slice(0, 2), slice(2, 4)), halves):
        t = half.response_ids.shape[1]
        assert t == 10  # keep_going=True: ran to max_new_tokens, as a rank waiting for others does
        width = whole.response_ids.shape[1]
        assert torch.equal(half.response_ids[:, :width], whole.response_ids[r])
        assert not half.response_mask[:, width:].any()
        assert torch.equal(half.finished, whole.finished[r])


def test_generate_respects_max_new_tokens_and_keep_going():
    prompt_ids, prompt_mask = _prompts()
    uniforms = sampling_uniforms(0, 0, num_rows=4, max_new_tokens=3)
    lm = ToyLM()
    out = generate(lm, prompt_ids, prompt_mask, uniforms, eos_token_ids=[99], pad_token_id=0, max_new_tokens=3)
    assert out.response_ids.shape == (4, 3) and out.response_mask.all() and not out.finished.any()
    assert lm.calls == 3  # prompt + 2 decoding calls; the last sampled token needs no forward
    stopped = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, eos_token_ids=[99], pad_token_id=0, max_new_tokens=3, keep_going=lambda alive: False)
    assert stopped.response_ids.shape == (4, 1)


def test_sampling_uniforms_depend_only_on_seed_and_step():
    a = sampling_uniforms(1, 2, 8, 4)
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(a, sampling_uniforms(1, 2, 8, 4))
    assert not torch.equal(a, sampling_uniforms(1, 3, 8, 4)) and not torch.equal(a, sampling_uniforms(2, 2, 8, 4))
    assert a.dtype == torch.float64 and float(a.min()) >= 0 and float(a.max()) < 1
