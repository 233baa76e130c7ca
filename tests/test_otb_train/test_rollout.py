"""otb_train.rollout: inverse-CDF sampling, top-p, EOS and variable lengths, rank-layout invariance, KV-cache use."""

import functools
import threading

import pytest
import torch

from otb_train.rollout import (
    draw_disagreement_probability,
    generate,
    position_ids_from_mask,
    sample_tokens,
    sampling_uniforms,
)


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


def test_draw_disagreement_probability_is_the_measure_of_uniforms_where_the_draws_differ():
    """Against sample_tokens itself on a grid of N uniforms (k + ½)/N: the grid's fraction of differing draws is the
    measure of the differing set to within one grid cell per breakpoint (2V of them). Rows: generic logits, a shared
    prefix, zero-probability tokens (-inf), identical rows (0), point masses on different tokens (1), temperature."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(6, 7, generator=generator, dtype=torch.float64) * 2
    b = a + torch.randn(6, 7, generator=generator, dtype=torch.float64) * 0.5
    b[1, :3] = a[1, :3]  # the same first boundaries
    a[2, 4], b[2, 1] = -torch.inf, -torch.inf  # tokens of probability 0
    b[3] = a[3]  # identical: never differ
    a[4], b[4] = torch.full((7,), -50.0, dtype=torch.float64), torch.full((7,), -50.0, dtype=torch.float64)
    a[4, 0], b[4, 6] = 50.0, 50.0  # point masses on different tokens: always differ
    n = 200_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for temperature in (1.0, 0.7):
        exact = draw_disagreement_probability(a, b, temperature)
        for row in range(a.shape[0]):
            draws = [sample_tokens(x[row].expand(n, -1), u, temperature) for x in (a, b)]
            grid = (draws[0] != draws[1]).double().mean().item()
            assert abs(grid - exact[row].item()) <= (2 * a.shape[1] + 1) / n, (row, temperature)
    assert exact[3].item() == 0.0 and exact[4].item() == pytest.approx(1.0, abs=1e-12)


def test_draw_disagreement_probability_is_at_most_the_coupling_bound():
    generator = torch.Generator().manual_seed(4)
    a = torch.randn(50, 30, generator=generator, dtype=torch.float64)
    b = a + 0.3 * torch.randn(50, 30, generator=generator, dtype=torch.float64)
    bound = (torch.softmax(a, -1).cumsum(-1) - torch.softmax(b, -1).cumsum(-1)).abs().sum(-1)
    exact = draw_disagreement_probability(a, b)
    assert bool((exact <= bound + 1e-12).all()) and bool((exact > 0).all())


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


class EndingToyLM(ToyLM):
    """ToyLM whose EOS (id 1) wins from position 6 on, so rows end at known columns; ``select_rows`` records the
    batch it is narrowed to (its logits are row-local, so narrowing cannot change a row's tokens)."""

    def __init__(self):
        super().__init__()
        self.narrowed = []

    def __call__(self, input_ids, attention_mask, position_ids, cache):
        logits, cache = super().__call__(input_ids, attention_mask, position_ids, cache)
        logits[position_ids[:, -1] >= 6, 1] = 100.0
        return logits, cache

    def select_rows(self, rows):
        self.narrowed.append(rows.tolist())


def test_drop_finished_keeps_one_dead_row_while_another_rank_goes_on():
    """Every row of this rank has ended by the first check (columns 2-5, check after 8 tokens) while keep_going says
    go on (another rank's rows): the batch narrows to one dead row (not to none: a batch of 0 rows is no batch for
    the decoder), and the rollout equals the one without narrowing."""
    prompt_ids, prompt_mask = _prompts()
    uniforms = sampling_uniforms(0, 0, num_rows=4, max_new_tokens=20)
    kwargs = dict(eos_token_ids=[1], pad_token_id=0, max_new_tokens=20, check_every=8, keep_going=lambda alive: True)
    whole = generate(EndingToyLM(), prompt_ids, prompt_mask, uniforms, **kwargs)
    lm = EndingToyLM()
    narrowed = generate(lm, prompt_ids, prompt_mask, uniforms, drop_finished=True, **kwargs)
    assert lm.narrowed == [[0]] and whole.finished.all() and whole.response_ids.shape[1] == 20
    assert all(torch.equal(got, want) for got, want in zip(narrowed, whole))


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
    halves = [
        generate(ToyLM(), prompt_ids[r], prompt_mask[r], uniforms[r], keep_going=lambda alive: True, **kwargs)
        for r in (slice(0, 2), slice(2, 4))
    ]
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
    stopped = generate(
        ToyLM(),
        prompt_ids,
        prompt_mask,
        uniforms,
        eos_token_ids=[99],
        pad_token_id=0,
        max_new_tokens=3,
        keep_going=lambda alive: False,
    )
    assert stopped.response_ids.shape == (4, 1)


def test_sampling_uniforms_depend_only_on_seed_and_step():
    a = sampling_uniforms(1, 2, 8, 4)
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(a, sampling_uniforms(1, 2, 8, 4))
    assert not torch.equal(a, sampling_uniforms(1, 3, 8, 4)) and not torch.equal(a, sampling_uniforms(2, 2, 8, 4))
    assert a.dtype == torch.float64 and float(a.min()) >= 0 and float(a.max()) < 1


# ----------------------------------------------------------------------------- float32 sampling and its tie rule


def _boundary_distance(logits, uniforms, top_p=1.0):
    """float64 distance from x = u·M to the nearest CDF boundary, and to top_p from the nearest nucleus boundary."""
    probs = torch.softmax(logits.double(), dim=-1)
    probs, _ = torch.sort(probs, dim=-1, descending=True, stable=True) if top_p < 1.0 else (probs, None)
    before = torch.nn.functional.pad(probs.cumsum(-1)[:, :-1], (1, 0))
    nucleus_gap = (before - top_p).abs().min(-1).values if top_p < 1.0 else torch.full((len(probs),), 1.0)
    probs = torch.where(before < top_p, probs, 0.0) if top_p < 1.0 else probs
    cdf = probs.cumsum(-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    return (cdf - target).abs().min(-1).values, nucleus_gap


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_float32_sampling_matches_float64_except_near_a_boundary(top_p):
    """Differences only where x (or top_p) is within the float32 rounding of the CDF of a boundary."""
    generator = torch.Generator().manual_seed(0)
    vocab = 2000
    logits = 4.0 * torch.randn(4000, vocab, generator=generator)
    uniforms = torch.rand(4000, generator=generator, dtype=torch.float64)
    fp32 = sample_tokens(logits, uniforms, top_p=top_p, dtype=torch.float32)
    fp64 = sample_tokens(logits, uniforms, top_p=top_p, dtype=torch.float64)
    differ = fp32 != fp64
    boundary, nucleus = _boundary_distance(logits, uniforms, top_p)
    tolerance = (vocab + 2) * 2.0**-24  # the documented bound on |c32 - c64| (relative to M <= 1)
    assert bool(((boundary < tolerance) | (nucleus < tolerance))[differ].all())
    assert int(differ.sum()) <= 4  # rare: a few in 4000 at most


def test_exact_ties_go_to_the_next_token_in_both_precisions():
    """Uniform p = 1/4 is exact in float32 and float64: x == c_i belongs to token i + 1."""
    logits = torch.zeros(5, 4)
    uniforms = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.999])
    for dtype in (torch.float32, torch.float64):
        assert sample_tokens(logits, uniforms, dtype=dtype).tolist() == [0, 1, 2, 3, 3]
    # top-p: p = (1/8, 3/8, 3/8, 1/8) exactly; equal probabilities keep vocabulary order (1 before 2).
    logits = torch.log(torch.tensor([[1.0, 3.0, 3.0, 1.0]])).expand(4, -1)
    for dtype in (torch.float32, torch.float64):
        # nucleus of top_p = 0.375: token 1 alone (mass before token 2 is 0.375, not < 0.375)
        assert sample_tokens(logits, torch.tensor([0.0, 0.3, 0.6, 0.99]), top_p=0.375, dtype=dtype).tolist() == [1] * 4
        # top_p = 0.5: tokens 1 and 2 (3/8 each, kept mass 3/4); x = u * 3/4 ties at 3/8 when u = 0.5
        uniforms = torch.tensor([0.0, 0.4999, 0.5, 0.99])
        assert sample_tokens(logits, uniforms, top_p=0.5, dtype=dtype).tolist() == [1, 1, 2, 2]


def test_a_constructed_near_tie_is_where_float32_and_float64_may_differ():
    """x between the float32 and the float64 value of a boundary: the two samplers pick adjacent tokens."""
    logits = torch.tensor([[0.3, -1.7, 2.2, 0.05, -0.4]])
    p64 = torch.softmax(logits.double(), -1)[0]
    p32 = torch.softmax(logits, -1)[0].double()
    c64, c32 = p64.cumsum(0), p32.cumsum(0).float().double()
    found = 0
    for i in range(4):
        if c32[i] == c64[i]:
            continue
        for u in torch.linspace(float(min(c32[i], c64[i])), float(max(c32[i], c64[i])), 7, dtype=torch.float64)[1:-1]:
            a = int(sample_tokens(logits, u[None], dtype=torch.float32))
            b = int(sample_tokens(logits, u[None], dtype=torch.float64))
            assert abs(a - b) <= 1 and {a, b} <= {i, i + 1}
            assert abs(float(u) - float(c64[i])) <= 7 * 2.0**-24  # within the documented rounding of c_i
            found += a != b
    assert found > 0  # the construction does produce a disagreement


def test_u_rounding_up_to_one_never_picks_a_zero_probability_token():
    """x >= M (u rounded to 1 in float32) gives the first token where the CDF reaches M."""
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")], [0.0, -40.0, float("-inf"), 0.0]])
    uniforms = torch.full((2,), 1.0 - 2.0**-40, dtype=torch.float64)
    assert sample_tokens(logits, uniforms).tolist() == [1, 3]
    assert sample_tokens(logits, uniforms, dtype=torch.float64).tolist() == [1, 3]
    top = sample_tokens(logits, uniforms, top_p=0.5)
    assert top.tolist() == [0, 0]  # nucleus: the first of two equal tokens (mass before the second is 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_rows_token_depends_only_on_its_logits_and_uniform(dtype, top_p):
    """Rank-layout invariance of the sampler: the whole batch, single rows and a permuted batch agree."""
    generator = torch.Generator().manual_seed(1)
    logits = 3.0 * torch.randn(64, 500, generator=generator)
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    whole = sample_tokens(logits, uniforms, temperature=0.7, top_p=top_p, dtype=dtype)
    rows = torch.cat([sample_tokens(logits[i : i + 1], uniforms[i : i + 1], 0.7, top_p, dtype) for i in range(64)])
    order = torch.randperm(64, generator=generator)
    permuted = sample_tokens(logits[order], uniforms[order], 0.7, top_p, dtype)
    assert torch.equal(whole, rows) and torch.equal(whole[order], permuted)


# ----------------------------------------------------------------------------- checking "all rows done" every k tokens


def _rollout_kwargs(max_new_tokens=12, eos=(1,), **extra):
    return dict(eos_token_ids=list(eos), pad_token_id=0, max_new_tokens=max_new_tokens, **extra)


@pytest.mark.parametrize("check_every", [2, 3, 5, 16, 100])
@pytest.mark.parametrize("max_new_tokens", [1, 4, 12])
def test_check_every_k_gives_exactly_the_per_token_rollout(check_every, max_new_tokens):
    prompt_ids, prompt_mask = _prompts()
    for seed in range(6):
        uniforms = sampling_uniforms(seed, 2, num_rows=4, max_new_tokens=max_new_tokens)
        for eos in ((1,), (1, 5), (99,)):
            kwargs = _rollout_kwargs(max_new_tokens, eos, temperature=0.9, top_p=0.95)
            one = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, check_every=1, **kwargs)
            lm = ToyLM()
            k = generate(lm, prompt_ids, prompt_mask, uniforms, check_every=check_every, **kwargs)
            assert torch.equal(one.response_ids, k.response_ids) and torch.equal(one.response_mask, k.response_mask)
            assert torch.equal(one.finished, k.finished)
            assert lm.calls <= one.response_ids.shape[1] + check_every  # at most k - 1 extra forward calls


def test_check_every_k_calls_keep_going_only_every_k_tokens():
    prompt_ids, prompt_mask = _prompts()
    uniforms = sampling_uniforms(0, 0, num_rows=4, max_new_tokens=40)
    calls = []

    def keep_going(any_alive):
        calls.append(any_alive)
        return True

    kwargs = _rollout_kwargs(40)
    out = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, keep_going=keep_going, check_every=8, **kwargs)
    assert out.response_ids.shape[1] == 40
    assert len(calls) == 4 + 7  # after tokens 8, 16, 24, 32; then the replay of 33..39 (the 40th is never checked)


def test_rows_finished_before_a_check_keep_emitting_masked_pad():
    """Every row ends early, the loop runs to the next check, and the trimmed result is the per-token one."""
    prompt_ids, prompt_mask = _prompts()
    uniforms = sampling_uniforms(7, 1, num_rows=4, max_new_tokens=30)
    kwargs = _rollout_kwargs(30, (1, 2, 3), top_p=0.9)
    one = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, check_every=1, **kwargs)
    many = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, check_every=29, **kwargs)
    assert one.response_ids.shape[1] < 29 and torch.equal(one.response_ids, many.response_ids)
    lengths = many.response_mask.sum(1)
    assert bool(many.finished.all()) and int(lengths.max()) == many.response_ids.shape[1]
    for row, n in enumerate(lengths.tolist()):
        assert int(many.response_ids[row, n - 1]) in (1, 2, 3) and (many.response_ids[row, n:] == 0).all()


def test_ranks_in_lockstep_stop_together_with_check_every_k():
    """Two threads play two ranks whose keep_going is an all-reduce (any): same length on both, equal to one rank."""
    prompt_ids, prompt_mask = _prompts()
    uniforms = sampling_uniforms(3, 5, num_rows=4, max_new_tokens=24)
    kwargs = _rollout_kwargs(24, (1, 5), temperature=0.8, top_p=0.9)
    whole = generate(ToyLM(), prompt_ids, prompt_mask, uniforms, **kwargs)
    for check_every in (1, 3, 7):
        barrier, flags, results = threading.Barrier(2), [False, False], [None, None]

        def all_reduce_any(rank, flag):
            flags[rank] = flag
            barrier.wait()
            result = any(flags)
            barrier.wait()
            return result

        def rank_main(rank, rows):
            keep = functools.partial(all_reduce_any, rank)
            results[rank] = generate(
                ToyLM(),
                prompt_ids[rows],
                prompt_mask[rows],
                uniforms[rows],
                keep_going=keep,
                check_every=check_every,
                **kwargs,
            )

        threads = [threading.Thread(target=rank_main, args=(r, slice(2 * r, 2 * r + 2))) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert torch.equal(torch.cat([r.response_ids for r in results]), whole.response_ids)
        assert torch.equal(torch.cat([r.response_mask for r in results]), whole.response_mask)


def test_check_every_must_be_positive():
    prompt_ids, prompt_mask = _prompts()
    with pytest.raises(ValueError, match="^check_every"):
        generate(ToyLM(), prompt_ids, prompt_mask, sampling_uniforms(0, 0, 4, 3), check_every=0, **_rollout_kwargs(3))
