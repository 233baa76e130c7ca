"""Regenerate the conformance vectors: ``python conformance/generate.py`` writes ``conformance/vectors.json``.

Each case is one input set (shared by many cases) × one estimator × one combination of the options that apply,
with the expected ``advantages`` (``otb_ref.compute_advantages``), the tolerance it asks, and tags:

* the input's tags (what the data holds: ``outcome``, ``dense``, ``holes``, ``ties``, ``confident``, ``fp32``, ...);
* the options it sets (``leave_one_out``, ``std``, ``multi_turn``, ``zero_tail``, ``is_weights``, ``epsilon=0``, ...);
* the rules it exercises (``clamp``, ``epsilon``, ``precision``, ``group_of_one``, ``zero_spread``, ``off_mask``):
  a rule's tag is on a case exactly when the port of ``conformance/ports/numpy_port.py`` with that one rule
  switched off fails the case. So a port that differs from otb_ref in one rule fails exactly that rule's cases.

Tolerance (absolute, per case): 16 × the largest change of the expected advantages when log π and Σπ² are moved
by up to 4 units in the last place of their dtype (three draws; the case's own conditioning), when the rows come in
another order (two draws: another summation order in every group sum) or, with leave-one-out, when the others'
sums are formed directly instead of as "all minus own"; plus 64 units in the last place of the output's scale
(with std scaling, times its amplification max|A| / max|G − B|): what a port that computes the same formulas with
other rounding can differ by. Where that tolerance exceeds 1e-3 of the advantages' size (rounding-level ties under
std scaling: the values are not determined by the inputs beyond rounding), the case also carries ``max_abs``,
2 × its largest |A|: a port must stay within it (the rule of THEORY §3 bounds the scaled advantages; a baseline
that leaks to 0 does not, e.g. |A| = 1.3e7).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "ports"))
sys.path.insert(0, str(HERE))
import check  # noqa: E402
import numpy_port  # noqa: E402
import otb_ref_numpy  # noqa: E402

from otb_ref import ESTIMATORS  # noqa: E402

OUT = HERE / "vectors.json"
RULES = {
    "clamp": "w_t = 1 − 2π(y_t) + Σπ² is clamped into [0, 2]",
    "epsilon": "B = (Σ a G + ε Ḡ) / (Σ a + ε) with Ḡ the members' plain mean; Ḡ where the denominator is 0",
    "precision": "group sums, baselines, σ and G − B in fp64, the advantage rounded to the compute dtype once",
    "group_of_one": "a group of one response gets no baseline (A = G)",
    "zero_spread": "std scaling leaves a group whose centred values are all equal unscaled",
    "off_mask": "values where the mask is 0 are ignored, whatever they are",
}
TOKEN_INPUTS = ("old_log_probs", "sum_pi_squared", "cumulative_energy", "rollout_is_weights")


def _proxy(rng, shape, confident=False, vocab=4):
    """log π(y) and Σπ² of one sampled distribution per token (π(y) = exp(−1e−4) when ``confident``)."""
    logits = rng.normal(size=(*shape, vocab)) * 2.0
    pi = np.exp(logits - logits.max(-1, keepdims=True))
    pi /= pi.sum(-1, keepdims=True)
    if confident:
        top = math.exp(-1e-4)
        rest = pi[..., 1:] / pi[..., 1:].sum(-1, keepdims=True) * (1 - top)
        pi = np.concatenate([np.full((*shape, 1), top), rest], -1)
    y = np.zeros(shape, int) if confident else np.argmax(pi, -1)
    return np.log(np.take_along_axis(pi, y[..., None], -1)[..., 0]), (pi**2).sum(-1)


def _mask(lengths, length, holes=()):
    mask = (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)
    for row, t in holes:
        mask[row, t] = 0.0
    return mask


def _outcome(mask, values):
    rewards = np.zeros_like(mask)
    for i, row in enumerate(mask):
        alive = np.flatnonzero(row)
        if alive.size:
            rewards[i, alive[-1]] = values[i]
    return rewards


def _common(rng, mask, index, rewards, confident=False, dtype="float64"):
    lp, s = _proxy(rng, mask.shape, confident)
    batch, length = mask.shape
    rho = rng.uniform(0.0, 2.0, size=mask.shape) * (rng.uniform(size=mask.shape) > 0.1)
    energy = rng.uniform(0.0, 3.0, size=mask.shape) * (rng.uniform(size=mask.shape) > 0.1)
    arrays = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        old_log_probs=lp,
        sum_pi_squared=s,
        rollout_is_weights=rho,
        cumulative_energy=energy * mask,
        grad_norms_sq=rng.uniform(0.0, 3.0, size=batch) * (np.arange(batch) % 5 != 4),
    )
    return dict(dtype=dtype, index=index, **arrays)


def build_inputs() -> dict[str, dict]:
    """The shared input sets, each with its tags. Deterministic (one seeded generator)."""
    rng = np.random.default_rng(20261125)
    inputs = {}
    six, groups = _mask([6, 4, 5, 3, 6, 2], 6), [0, 0, 0, 1, 1, 1]
    inputs["outcome"] = (_common(rng, six, groups, _outcome(six, [1, 0, 1, 0, 0, 1])), ["outcome"])
    inputs["dense"] = (_common(rng, six, groups, rng.uniform(size=six.shape) * six), ["dense"])
    holes = _mask([7, 5, 7, 0, 6, 4, 7], 7, holes=[(0, 2), (0, 3), (1, 1), (4, 2), (5, 1), (6, 4)])
    inputs["holes"] = (
        _common(rng, holes, [0, 0, 0, 0, 1, 1, 1], rng.uniform(size=holes.shape) * holes),
        ["holes", "dense", "empty_response"],
    )
    four = _mask([3, 4, 2, 4], 4)
    inputs["group_of_one"] = (
        _common(rng, four, ["p0", "p1", "p1", "p2"], _outcome(four, [1, 0, 1, 1])),
        ["singleton_group", "string_ids", "outcome"],
    )
    eight = _mask([5, 5, 5, 5, 3, 5, 4, 5], 5)
    equal = _outcome(eight, [1.0] * 8)
    inputs["equal_outcome_confident"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, equal, confident=True),
        ["equal_outcome", "confident", "outcome"],
    )
    inputs["equal_outcome_confident_fp32"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, equal, confident=True, dtype="float32"),
        ["equal_outcome", "confident", "outcome", "fp32"],
    )
    inputs["dense_tied_totals_fp32"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, _tied_dense(rng, eight, np.float32), True, "float32"),
        ["ties", "dense", "confident", "fp32"],
    )
    inputs["dense_tied_totals"] = (
        _common(rng, eight, [0] * 4 + [1] * 4, _tied_dense(rng, eight, np.float64), True),
        ["ties", "dense", "confident"],
    )
    inputs["inconsistent_energies"] = (_inconsistent(rng), ["inconsistent_energies", "dense"])
    zero = _common(rng, six, groups, rng.uniform(size=six.shape) * six)
    zero.update(old_log_probs=np.zeros_like(six), sum_pi_squared=np.ones_like(six))
    zero["rollout_is_weights"][3:] = 0.0
    zero["cumulative_energy"][:] = 0.0
    zero["grad_norms_sq"][:] = 0.0
    inputs["zero_energies"] = (zero, ["zero_energies", "dense"])
    one = _mask([1, 1, 1, 0, 1, 1], 1)
    inputs["t_equals_1"] = (_common(rng, one, [0, 0, 1, 1, 2, 3], rng.uniform(size=one.shape) * one), ["T1"])
    inputs["off_mask"] = (_off_mask(rng), ["off_mask_values", "holes", "dense"])
    inputs["dominant_row_fp32"] = (_dominant_row(rng), ["dominant_row", "outcome", "fp32"])
    big = _mask(rng.integers(3, 9, size=16), 8)
    inputs["large_group"] = (_common(rng, big, [7] * 16, rng.uniform(size=big.shape) * big), ["dense", "N16"])
    return inputs


def _tied_dense(rng, mask, dtype):
    """Dense rewards whose totals are 1 up to rounding in ``dtype`` (each row: a partition of 1, summed in dtype)."""
    rewards = np.zeros(mask.shape)
    for i, row in enumerate(mask):
        alive = np.flatnonzero(row)
        parts = rng.uniform(size=alive.size)
        rewards[i, alive] = (parts / parts.sum()).astype(dtype)
    return rewards


def _inconsistent(rng):
    """Σπ² below 2π − 1 (w < 0 before the clamp) and Σπ² at 1 + 5e-7 with π(y) ≈ 0 (w > 2 before the clamp)."""
    mask = _mask([5, 5, 4, 5, 3, 5], 5)
    arrays = _common(rng, mask, [0, 0, 0, 1, 1, 1], rng.uniform(size=mask.shape) * mask)
    arrays["old_log_probs"][0, :3] = math.log(0.9)
    arrays["sum_pi_squared"][0, :3] = 0.5  # 1 − 1.8 + 0.5 = −0.3
    arrays["old_log_probs"][3, 1:4] = -30.0
    arrays["sum_pi_squared"][3, 1:4] = 1.0 + 5e-7  # ≈ 2 + 5e-7
    return arrays


def _dominant_row(rng):
    """fp32; in each group one response's energy dwarfs the others' (IS weights 1e-3 on the others): leave-one-out
    sums formed in fp32 lose the others entirely."""
    mask = _mask([8, 8, 8, 8, 8, 8], 8)
    arrays = _common(rng, mask, [0, 0, 0, 1, 1, 1], _outcome(mask, [0.7, 2.0, 1.0, 0.0, 1.0, 0.5]), dtype="float32")
    arrays["rollout_is_weights"] = np.where(np.arange(6)[:, None] % 3 == 0, 1.0, 1e-3) * mask
    arrays["old_log_probs"], arrays["sum_pi_squared"] = np.full(mask.shape, math.log(0.5)), np.full(mask.shape, 0.5)
    return arrays


def _off_mask(rng):
    """Values off the mask far outside every input's range (finite, so that JSON carries them)."""
    mask = _mask([6, 3, 6, 5, 6, 4], 6, holes=[(0, 2), (2, 1), (4, 3)])
    arrays = _common(rng, mask, [0, 0, 0, 1, 1, 1], rng.uniform(size=mask.shape) * mask)
    off = mask == 0
    for name, value in [
        ("token_level_rewards", 1e30),
        ("old_log_probs", 5.0),
        ("sum_pi_squared", 7.0),
        ("rollout_is_weights", -3.0),
        ("cumulative_energy", -1e20),
    ]:
        arrays[name] = np.where(off, value, arrays[name])
    return arrays


def option_grid(name: str) -> list[dict]:
    """Every combination of the options that apply to ``name``: leave_one_out × std_normalize × (multi_turn ×
    handle_zero_tail, token estimators) × (IS weights, energies length and proxy) at ε = 1e-8, and leave_one_out ×
    std_normalize × IS weights at ε = 0 and ε = 0.1."""
    spec = ESTIMATORS[name]
    token = spec.granularity == "token"
    is_options = [False, True] if spec.energy in ("length", "proxy") else [False]
    grid = []
    for loo, std, mt, zt, is_w in itertools.product(
        [False, True],
        [False, True],
        [False, True] if token else [False],
        [False, True] if token else [False],
        is_options,
    ):
        grid.append(
            dict(
                leave_one_out=loo, std_normalize=std, multi_turn=mt, handle_zero_tail=zt, is_weights=is_w, epsilon=1e-8
            )
        )
    for eps, loo, std, is_w in itertools.product([0.0, 0.1], [False, True], [False, True], is_options):
        grid.append(
            dict(
                leave_one_out=loo,
                std_normalize=std,
                multi_turn=False,
                handle_zero_tail=False,
                is_weights=is_w,
                epsilon=eps,
            )
        )
    return grid


def call_arguments(arrays: dict, name: str, options: dict, dtype) -> tuple[list, dict]:
    """The positional and keyword arguments of ``fn(estimator, rewards, mask, index, **inputs_and_options)``."""
    spec = ESTIMATORS[name]
    needed = {"proxy": ["old_log_probs", "sum_pi_squared"], "exact": []}.get(spec.energy, [])
    if spec.energy == "exact":
        needed = ["grad_norms_sq"] if spec.granularity == "sequence" else ["cumulative_energy"]
    if options["is_weights"]:
        needed.append("rollout_is_weights")
    kwargs = {key: np.asarray(arrays[key], dtype) for key in needed}
    kwargs.update(
        leave_one_out=options["leave_one_out"], std_normalize=options["std_normalize"], epsilon=options["epsilon"]
    )
    if spec.granularity == "token":
        kwargs.update(multi_turn=options["multi_turn"], handle_zero_tail=options["handle_zero_tail"])
    index = np.asarray(arrays["index"])
    return [name, np.asarray(arrays["token_level_rewards"], dtype), np.asarray(arrays["response_mask"]), index], kwargs


def option_tags(options: dict) -> list[str]:
    tags = [
        tag
        for key, tag in [
            ("leave_one_out", "leave_one_out"),
            ("std_normalize", "std"),
            ("multi_turn", "multi_turn"),
            ("handle_zero_tail", "zero_tail"),
            ("is_weights", "is_weights"),
        ]
        if options[key]
    ]
    return tags + ([f"epsilon={options['epsilon']:g}"] if options["epsilon"] != 1e-8 else [])


def perturbed(arrays: dict, rng, dtype) -> dict:
    """log π and Σπ² moved by up to 4 units in the last place: what another ``exp`` or order of ``1 − 2π + Σπ²``
    does. (A port reads the other inputs as they are; it must sum ``G_t`` from the end, ``G_t = m_t r_t + G_{t+1}``.)"""
    ulp = np.finfo(dtype).eps
    out = dict(arrays)
    for key in ("old_log_probs", "sum_pi_squared"):
        x = np.asarray(arrays[key], np.float64)
        out[key] = (x * (1.0 + rng.uniform(-4, 4, size=x.shape) * ulp)).astype(dtype)
    return out


def reordered(arrays: dict, order: np.ndarray) -> dict:
    """The same responses in another row order (what a port that groups rows differently sums in)."""
    out = dict(arrays)
    for key in ("token_level_rewards", "response_mask", "grad_norms_sq", *TOKEN_INPUTS):
        out[key] = np.asarray(arrays[key])[order]
    out["index"] = [arrays["index"][i] for i in order]
    return out


def max_error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest absolute difference; inf where shapes differ or one side is not finite where the other is."""
    got = np.asarray(got, np.float64)
    if got.shape != want.shape or not np.array_equal(np.isfinite(got), np.isfinite(want)):
        return math.inf
    return float(np.max(np.abs(got - want), initial=0.0))


def make_case(input_name: str, arrays: dict, tags: list[str], name: str, options: dict, rng) -> tuple[dict, list]:
    """One case (the expected advantages, tolerance and tags) and its returns."""
    dtype = np.dtype(arrays["dtype"]).type
    args, kwargs = call_arguments(arrays, name, options, dtype)
    advantages, returns = otb_ref_numpy.compute_advantages(*args, **kwargs)
    expected = np.asarray(advantages, np.float64)
    change = 0.0
    if options["leave_one_out"]:  # "all minus own" (otb_ref) or direct sums over the others: either is correct
        change = max_error(numpy_port.compute_advantages(*args, **kwargs, direct=True)[0], expected)
    for _ in range(3):
        moved_args, moved_kwargs = call_arguments(perturbed(arrays, rng, dtype), name, options, dtype)
        change = max(change, max_error(otb_ref_numpy.compute_advantages(*moved_args, **moved_kwargs)[0], expected))
    for _ in range(2):  # rows in another order: another summation order in every group sum
        order = rng.permutation(len(arrays["index"]))
        moved_args, moved_kwargs = call_arguments(reordered(arrays, order), name, options, dtype)
        moved = np.empty_like(expected)
        moved[order] = otb_ref_numpy.compute_advantages(*moved_args, **moved_kwargs)[0]
        change = max(change, max_error(moved, expected))
    scale = 1.0 + float(np.max(np.abs(expected), initial=0.0)) + float(np.max(np.abs(returns), initial=0.0))
    if options["std_normalize"]:  # rounding in G − B, amplified by 1/(σ + ε)
        unscaled = call_arguments(arrays, name, dict(options, std_normalize=False), dtype)
        centred = np.abs(otb_ref_numpy.compute_advantages(*unscaled[0], **unscaled[1])[0])
        scale *= max(1.0, float(np.max(np.abs(expected), initial=0.0)) / max(float(centred.max(initial=0.0)), 1e-300))
    atol = 16.0 * change + 64.0 * float(np.finfo(dtype).eps) * scale
    bound = {}
    largest = float(np.max(np.abs(expected), initial=0.0))
    if atol > 1e-3 * (1.0 + largest):  # ill-conditioned (rounding-level ties under std scaling): pin the size instead
        bound = dict(max_abs=float(f"{2.0 * largest + 1e-12:.3g}"))
    options_out = {key: value for key, value in kwargs.items() if not isinstance(value, np.ndarray)}
    options_out["rollout_is_weights"] = options["is_weights"]
    flags = ",".join(option_tags(options)) or "defaults"
    case = dict(
        id=f"{input_name}/{name}/{flags}",
        input=input_name,
        estimator=name,
        options=options_out,
        tags=sorted(set(tags + option_tags(options))),
        atol=float(f"{atol:.3g}"),
        **bound,
        advantages=expected.tolist(),
    )
    # The rules this case exercises: those whose single ablation in the NumPy port fails it (judged by the checker).
    data = dict(arrays, returns={ESTIMATORS[name].granularity: np.asarray(returns, np.float64)})
    if not check.check_case(numpy_port.compute_advantages, case, data)[0]:
        raise AssertionError(f"numpy_port disagrees with otb_ref on {case['id']}")
    for rule in RULES:
        if not check.check_case(functools.partial(numpy_port.compute_advantages, broken={rule}), case, data)[0]:
            case["tags"] = sorted({*case["tags"], rule})
    return case, np.asarray(returns, np.float64).tolist()


def main() -> None:
    rng = np.random.default_rng(7)
    inputs, cases, returns = build_inputs(), [], {}
    clash = {tag for _, tags in inputs.values() for tag in tags} & set(RULES)
    if clash:
        raise AssertionError(f"input tags {sorted(clash)} are rule names: a rule's tag must come from its ablation")
    for input_name, (arrays, tags) in inputs.items():
        dtype = np.dtype(arrays["dtype"]).type
        for key in ("token_level_rewards", "grad_norms_sq", *TOKEN_INPUTS):
            arrays[key] = np.asarray(arrays[key]).astype(dtype)
        for name in ESTIMATORS:
            for options in option_grid(name):
                case, case_returns = make_case(input_name, arrays, tags, name, options, rng)
                granularity = ESTIMATORS[name].granularity
                if returns.setdefault((input_name, granularity), case_returns) != case_returns:
                    raise AssertionError(f"{case['id']}: returns differ from the other {granularity} estimators'")
                cases.append(case)
    document = dict(
        format="otb_ref conformance vectors, version 1",
        command="python conformance/generate.py",
        check="python conformance/check.py FILE.py:FUNCTION",
        rules=RULES,
        inputs={
            name: dict(
                tags=tags,
                dtype=arrays["dtype"],
                index=list(arrays["index"]),
                returns={granularity: returns[(name, granularity)] for granularity in ("sequence", "token")},
                **{
                    key: np.asarray(arrays[key], np.float64).tolist()
                    for key in ("token_level_rewards", "response_mask", "grad_norms_sq", *TOKEN_INPUTS)
                },
            )
            for name, (arrays, tags) in inputs.items()
        },
        cases=cases,
    )
    OUT.write_text(json.dumps(document, separators=(",", ":"), ensure_ascii=False) + "\n")
    counts = {rule: sum(rule in case["tags"] for case in cases) for rule in RULES}
    print(f"{OUT.name}: {len(cases)} cases, {OUT.stat().st_size / 1e6:.2f} MB; cases per rule tag: {counts}")


if __name__ == "__main__":
    main()
