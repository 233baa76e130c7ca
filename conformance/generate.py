"""Regenerate the conformance vectors: ``python conformance/generate.py`` writes ``conformance/vectors.json``.

Each case is one input set of ``conformance/inputs.py`` (shared by many cases) × one estimator × one combination
of the options that apply (or none: ``omitted_flags`` cases pass no flag, the defaults decide), with the expected
``advantages`` (``otb_ref.compute_advantages``), the tolerance it asks, and tags:

* the input's tags (what the data holds: ``outcome``, ``dense``, ``holes``, ``ties``, ``cancelling``, ``fp32``, ...);
* the options it sets (``leave_one_out``, ``std``, ``multi_turn``, ``zero_tail``, ``is_weights``, ``epsilon=0``,
  ``flags_off``, ``omitted_flags``, ...);
* the rules it exercises (``RULES``, one per misreading of docs/PORTING.md): a rule's tag is on a case exactly
  when that rule's port in ``conformance/ports/bugs/one_rule.py`` (``vector_port.py`` with that one rule broken)
  fails the case, as judged by the checker.

Tolerance of the advantages (absolute, per case): 16 × the largest change of the expected advantages when log π
and Σπ² are moved by up to 4 units in the last place of their dtype (three draws; another ``exp``), when the rows
come in another order (two draws: another summation order in every group sum) or, with leave-one-out, when the
others' sums are formed directly instead of as "all minus own"; plus 64 units in the last place of the output's
dtype at the advantages' scale (1 + max|A|), plus 64 fp64 units at the scale of the fp64 intermediates
(1 + max|G|, times std scaling's amplification max|A| / max|G − B|): what a port that computes the same formulas
with other rounding can differ by. So an fp32 case whose returns are 1e8 while its advantages are O(1) is held to
the advantages' fp32 ulps: a port that rounds G, σ or G − B to fp32 fails it. Where the tolerance exceeds 1e-3 of
the advantages' size (rounding-level ties under std scaling: the values are not determined by the inputs beyond
rounding), the case also carries ``max_abs``, 2 × its largest |A| ("bound-only": never a rule's only evidence).
Tolerance of the returns (per input and granularity): 64 ulps of the dtype at 1 + max|G| plus 64 fp64 ulps at
1 + the largest Σ_t |r_t|.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from pathlib import Path

import check  # beside this file (run as `python conformance/generate.py`, or from tests/test_conformance.py)
import inputs
import numpy as np

from otb_ref import ESTIMATORS

HERE = Path(__file__).resolve().parent
PORTS = HERE / "ports"
# The ports are files, loaded by their paths (check.load_module), or the modules of those names already loaded.
numpy_port, otb_ref_numpy, vector_port = (
    sys.modules.get(name) or check.load_module(PORTS / f"{name}.py")
    for name in ("numpy_port", "otb_ref_numpy", "vector_port")
)
one_rule = sys.modules.get("one_rule") or check.load_module(PORTS / "bugs" / "one_rule.py")

OUT = HERE / "vectors.json"
RULES = {rule: f"PORTING item {item}; its port: {what}" for rule, (item, what) in one_rule.RULES.items()}
LONG_ESTIMATORS = ("grpo", "rloo", "opo", "sequence_proxy", "token_mean", "token_length", "otb")


def option_grid(name: str, long: bool = False) -> list[dict]:
    """Every combination of the options that apply to ``name``: leave_one_out × std_normalize × (multi_turn ×
    handle_zero_tail, token estimators) × (IS weights, energies length and proxy) at ε = 1e-8, leave_one_out ×
    std_normalize × IS weights at ε = 0 and ε = 0.1, and one case that passes no flag. ``long``: ε = 1e-8 without
    multi_turn and handle_zero_tail, and no flag."""
    spec = ESTIMATORS[name]
    token = spec.granularity == "token" and not long
    is_options = [False, True] if spec.energy in ("length", "proxy") else [False]
    flags = dict(multi_turn=False, handle_zero_tail=False)
    grid = [
        dict(leave_one_out=loo, std_normalize=std, multi_turn=mt, handle_zero_tail=zt, is_weights=is_w, epsilon=1e-8)
        for loo, std, mt, zt, is_w in itertools.product(
            [False, True],
            [False, True],
            [False, True] if token else [False],
            [False, True] if token else [False],
            is_options,
        )
    ]
    if not long:
        grid += [
            dict(leave_one_out=loo, std_normalize=std, is_weights=is_w, epsilon=eps, **flags)
            for eps, loo, std, is_w in itertools.product([0.0, 0.1], [False, True], [False, True], is_options)
        ]
    return grid + [dict(omitted=True, is_weights=False)]


def effective(name: str, options: dict) -> dict:
    """The options a case means: an ``omitted`` case's are the defaults (the estimator's flags, ε = 1e-8)."""
    if not options.get("omitted"):
        return options
    spec = ESTIMATORS[name]
    return dict(
        leave_one_out=spec.leave_one_out,
        std_normalize=spec.std_normalize,
        multi_turn=False,
        handle_zero_tail=False,
        is_weights=options["is_weights"],
        epsilon=1e-8,
    )


def call_arguments(arrays: dict, name: str, options: dict, dtype) -> tuple[list, dict]:
    """The positional and keyword arguments of ``fn(estimator, rewards, mask, index, **inputs_and_options)``."""
    spec = ESTIMATORS[name]
    needed = {"proxy": ["old_log_probs", "sum_pi_squared"], "exact": []}.get(spec.energy, [])
    if spec.energy == "exact":
        needed = ["grad_norms_sq"] if spec.granularity == "sequence" else ["cumulative_energy"]
    if options["is_weights"]:
        needed.append("rollout_is_weights")
    kwargs = {key: np.asarray(arrays[key], dtype) for key in needed}
    if not options.get("omitted"):
        kwargs.update(
            leave_one_out=options["leave_one_out"], std_normalize=options["std_normalize"], epsilon=options["epsilon"]
        )
        if spec.granularity == "token":
            kwargs.update(multi_turn=options["multi_turn"], handle_zero_tail=options["handle_zero_tail"])
    index = np.asarray(arrays["index"])
    return [name, np.asarray(arrays["token_level_rewards"], dtype), np.asarray(arrays["response_mask"]), index], kwargs


def option_tags(options: dict) -> list[str]:
    if options.get("omitted"):
        return ["omitted_flags"]
    names = [("leave_one_out", "leave_one_out"), ("std_normalize", "std"), ("multi_turn", "multi_turn")]
    names += [("handle_zero_tail", "zero_tail"), ("is_weights", "is_weights")]
    tags = [tag for key, tag in names if options[key]]
    tags += [f"epsilon={options['epsilon']:g}"] if options["epsilon"] != 1e-8 else []
    return tags or ["flags_off"]


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
    for key in ("token_level_rewards", "response_mask", "grad_norms_sq", *inputs.MATRICES):
        out[key] = np.asarray(arrays[key])[order]
    out["index"] = [arrays["index"][i] for i in order]
    return out


def max_error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest absolute difference; inf where shapes differ or one side is not finite where the other is."""
    got = np.asarray(got, np.float64)
    if got.shape != want.shape or not np.array_equal(np.isfinite(got), np.isfinite(want)):
        return float("inf")
    return float(np.max(np.abs(got - want), initial=0.0))


def rounding_change(arrays: dict, name: str, options: dict, expected: np.ndarray, rng) -> float:
    """The largest change of the advantages under another exp, another row order and direct leave-one-out sums."""
    dtype = np.dtype(arrays["dtype"]).type
    args, kwargs = call_arguments(arrays, name, options, dtype)
    change = 0.0
    if options["leave_one_out"]:  # "all minus own" (otb_ref) or direct sums over the others: either is correct
        change = max_error(vector_port.direct(*args, **kwargs)[0], expected)
    for _ in range(3):
        moved_args, moved_kwargs = call_arguments(perturbed(arrays, rng, dtype), name, options, dtype)
        change = max(change, max_error(otb_ref_numpy.compute_advantages(*moved_args, **moved_kwargs)[0], expected))
    for _ in range(2):  # rows in another order: another summation order in every group sum
        order = rng.permutation(len(arrays["index"]))
        moved_args, moved_kwargs = call_arguments(reordered(arrays, order), name, options, dtype)
        moved = np.empty_like(expected)
        moved[order] = otb_ref_numpy.compute_advantages(*moved_args, **moved_kwargs)[0]
        change = max(change, max_error(moved, expected))
    return change


def tolerance(arrays: dict, name: str, options: dict, expected: np.ndarray, returns: np.ndarray, rng) -> float:
    """The advantages' absolute tolerance (module docstring)."""
    dtype = np.dtype(arrays["dtype"]).type
    largest = float(np.max(np.abs(expected), initial=0.0))
    amplification = 1.0
    if options["std_normalize"]:  # rounding in G − B, amplified by 1/(σ + ε)
        unscaled = call_arguments(arrays, name, dict(options, std_normalize=False), dtype)
        centred = np.abs(otb_ref_numpy.compute_advantages(*unscaled[0], **unscaled[1])[0])
        amplification = max(1.0, largest / max(float(centred.max(initial=0.0)), 1e-300))
    scale_out = float(np.finfo(dtype).eps) * (1.0 + largest)
    scale_fp64 = float(np.finfo(np.float64).eps) * (1.0 + float(np.max(np.abs(returns), initial=0.0))) * amplification
    change = rounding_change(arrays, name, options, expected, rng)
    return 16.0 * change + 64.0 * (scale_out + scale_fp64)


def returns_tolerance(arrays: dict, returns: np.ndarray) -> float:
    rewards = np.where(np.asarray(arrays["response_mask"]) != 0, np.asarray(arrays["token_level_rewards"]), 0.0)
    largest = float(np.max(np.abs(returns), initial=0.0))
    total = float(np.max(np.abs(rewards).sum(axis=1), initial=0.0))
    eps = float(np.finfo(np.dtype(arrays["dtype"])).eps)
    return float(f"{64.0 * (eps * (1.0 + largest) + np.finfo(np.float64).eps * (1.0 + total)):.3g}")


def make_case(input_name: str, arrays: dict, tags: list[str], name: str, options: dict, rng) -> tuple[dict, np.ndarray]:
    """One case (the expected advantages, tolerance and tags) and its returns (fp64, rounded to the dtype)."""
    dtype = np.dtype(arrays["dtype"]).type
    meant = effective(name, options)
    args, kwargs = call_arguments(arrays, name, options, dtype)
    advantages, returns = otb_ref_numpy.compute_advantages(*args, **kwargs)
    if options.get("omitted"):  # the defaults are the meant flags
        spelled_args, spelled_kwargs = call_arguments(arrays, name, meant, dtype)
        spelled = otb_ref_numpy.compute_advantages(*spelled_args, **spelled_kwargs)[0]
        assert np.array_equal(spelled, advantages), f"{input_name}/{name}: defaults differ from the spelled flags"
    expected = np.asarray(advantages, np.float64)
    returns = np.asarray(returns, np.float64)
    atol = tolerance(arrays, name, meant, expected, returns, rng)
    bound = {}
    largest = float(np.max(np.abs(expected), initial=0.0))
    if atol > 1e-3 * (1.0 + largest):  # ill-conditioned (rounding-level ties under std scaling): pin the size instead
        bound = dict(max_abs=float(f"{2.0 * largest + 1e-12:.3g}"))
    options_out = {key: value for key, value in kwargs.items() if not isinstance(value, np.ndarray)}
    options_out["rollout_is_weights"] = options["is_weights"]
    case = dict(
        id=f"{input_name}/{name}/{','.join(option_tags(options)) if not options.get('omitted') else 'defaults'}",
        input=input_name,
        estimator=name,
        options=options_out,
        tags=sorted(set(tags + option_tags(options))),
        atol=float(f"{atol:.3g}"),
        **bound,
        advantages=np.asarray(advantages),
    )
    return case, returns


def stored_input(arrays: dict, tags: list[str]) -> dict:
    """An input as the checker reads it: arrays in the input's dtype (the mask in float64)."""
    dtype = np.dtype(arrays["dtype"])
    data = dict(tags=tags, dtype=arrays["dtype"], index=list(arrays["index"]))
    for key in inputs.ARRAYS:
        data[key] = np.asarray(arrays[key], np.float64 if key == "response_mask" else dtype)
    return data


def build_cases() -> tuple[dict, list]:
    """Every input (as stored) and every case, checked and tagged."""
    rng = np.random.default_rng(7)
    built, stored, cases = inputs.build_inputs(), {}, []
    option_names = {tag for name in ESTIMATORS for options in option_grid(name) for tag in option_tags(options)}
    clash = ({tag for _, tags in built.values() for tag in tags} | option_names) & set(RULES)
    if clash:
        raise AssertionError(f"tags {sorted(clash)} are rule names: a rule's tag must come from its port")
    for input_name, (arrays, tags) in built.items():
        data = stored_input(arrays, tags)
        if input_name == "long_T_fp32":
            data["sha256"] = inputs.checksum(arrays)
        returns = {}
        long = "long_T" in tags
        for name in LONG_ESTIMATORS if long else ESTIMATORS:
            for options in option_grid(name, long):
                case, case_returns = make_case(input_name, data, tags, name, options, rng)
                granularity = ESTIMATORS[name].granularity
                if not np.array_equal(returns.setdefault(granularity, case_returns), case_returns):
                    raise AssertionError(f"{case['id']}: returns differ from the other {granularity} estimators'")
                cases.append(case)
        data["returns"] = {g: returns[g].astype(data["dtype"]) for g in returns}
        data["returns_atol"] = {g: returns_tolerance(data, returns[g]) for g in returns}
        stored[input_name] = data
    for case in cases:
        tag_case(case, stored[case["input"]])
    return stored, cases


def tag_case(case: dict, data: dict) -> None:
    """Check the correct ports on one case, then tag it with every rule whose port fails it."""
    for port in (vector_port.compute_advantages, numpy_port.compute_advantages):
        passed, detail = check.check_case(port, case, data)
        if not passed:
            raise AssertionError(f"{port.__module__} disagrees with otb_ref on {case['id']}: {detail}")
    for rule in RULES:
        if not check.check_case(one_rule.port(rule), case, data)[0]:
            case["tags"] = sorted({*case["tags"], rule})


def document(stored: dict, cases: list) -> dict:
    """The vectors file: strict JSON, every array packed (:func:`check.pack`)."""
    packed_inputs = {}
    for name, data in stored.items():
        entry = {key: value for key, value in data.items() if key not in inputs.ARRAYS and key != "returns"}
        entry["arrays"] = {key: check.pack(data[key]) for key in inputs.ARRAYS}
        entry["returns"] = {g: check.pack(value) for g, value in data["returns"].items()}
        packed_inputs[name] = entry
    packed_cases = [dict(case, advantages=check.pack(case["advantages"])) for case in cases]
    return dict(
        format=check.FORMAT,
        command="python conformance/generate.py",
        check="python conformance/check.py FILE.py:FUNCTION",
        rules=RULES,
        inputs=packed_inputs,
        cases=packed_cases,
    )


def main() -> None:
    stored, cases = build_cases()
    OUT.write_text(json.dumps(document(stored, cases), separators=(",", ":"), ensure_ascii=False) + "\n")
    counts = {rule: sum(rule in case["tags"] for case in cases) for rule in RULES}
    bound = [case["input"] for case in cases if "max_abs" in case]
    print(f"{OUT.name}: {len(cases)} cases over {len(stored)} input sets, {OUT.stat().st_size / 1e6:.2f} MB")
    print(f"bound-only cases: {len(bound)}, by input: {dict(Counter(bound))}")
    for dtype in ("float64", "float32"):
        atol = [case["atol"] for case in cases if stored[case["input"]]["dtype"] == dtype and "max_abs" not in case]
        print(f"median atol of the {dtype} cases with a tolerance: {np.median(atol):.3g}")
    print(f"cases per rule tag: {counts}")


if __name__ == "__main__":
    main()
