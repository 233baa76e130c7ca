"""Check a port of ``otb_ref.compute_advantages`` against the conformance vectors. NumPy only (no torch needed).

    python conformance/check.py FILE.py:FUNCTION [--estimator otb] [--tag clamp] [--vectors conformance/vectors.json]

``FUNCTION`` is called like ``otb_ref.compute_advantages`` with NumPy arrays:

    fn(estimator, token_level_rewards, response_mask, index, **inputs_and_options)

``token_level_rewards`` and the ``[B, T]`` inputs (``old_log_probs``, ``sum_pi_squared``, ``cumulative_energy``,
``rollout_is_weights``) come in the case's dtype (float64, or float32 for cases tagged ``fp32``), ``response_mask``
as 0/1 float64, ``grad_norms_sq`` ``[B]``, ``index`` a 1-D array of ints or strings; the options are
``leave_one_out``, ``std_normalize``, ``epsilon`` and, for token-level estimators, ``multi_turn`` and
``handle_zero_tail``. Only the inputs an estimator reads are passed. It returns the advantages ``[B, T]`` or
``(advantages, returns)``; both are compared with the expected fp64 values within the case's absolute tolerance
(``atol``), and where a case carries ``max_abs`` (rounding-level ties under std scaling) every |A| must stay within it.

Prints one line per failing case (its id, estimator, options, tags, max abs and rel error, tolerance), then a
summary; exits 1 if any case fails, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np

DEFAULT_VECTORS = Path(__file__).resolve().parent / "vectors.json"
MATRICES = ("old_log_probs", "sum_pi_squared", "cumulative_energy", "rollout_is_weights")
TOKEN_OPTIONS = ("multi_turn", "handle_zero_tail")


def load_function(target: str):
    """``FILE.py:FUNCTION`` -> the callable."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise SystemExit(f"usage: FILE.py:FUNCTION, got {target!r}")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"no such file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise SystemExit(f"{path} has no function {name!r}")
    return getattr(module, name)


def arguments(case: dict, data: dict) -> tuple[list, dict]:
    """The call's positional and keyword arguments for one case."""
    dtype = np.float32 if data["dtype"] == "float32" else np.float64
    options = dict(case["options"])
    wants_is = options.pop("rollout_is_weights")
    kwargs = {key: value for key, value in options.items()}
    energy = {"otb": "proxy", "sequence_proxy": "proxy", "eob": "grad_norms_sq", "otb_exact": "cumulative_energy"}
    needed = energy.get(case["estimator"])
    if needed == "proxy":
        kwargs.update(old_log_probs=np.asarray(data["old_log_probs"], dtype))
        kwargs.update(sum_pi_squared=np.asarray(data["sum_pi_squared"], dtype))
    elif needed is not None:
        kwargs[needed] = np.asarray(data[needed], dtype)
    if wants_is:
        kwargs["rollout_is_weights"] = np.asarray(data["rollout_is_weights"], dtype)
    rewards = np.asarray(data["token_level_rewards"], dtype)
    return [
        case["estimator"],
        rewards,
        np.asarray(data["response_mask"], np.float64),
        np.asarray(data["index"]),
    ], kwargs


def errors(got, want: np.ndarray) -> tuple[float, float]:
    """(max abs, max rel) error; inf for a wrong shape or a non-finite value where a finite one is expected."""
    try:
        got = np.asarray(got, np.float64)
    except (TypeError, ValueError):
        return math.inf, math.inf
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return math.inf, math.inf
    diff = np.abs(got - want)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        rel = diff / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
    return float(diff.max(initial=0.0)), float(np.where(diff > 0, rel, 0.0).max(initial=0.0))


def check_case(fn, case: dict, data: dict) -> tuple[bool, str]:
    """Run one case; ``(passed, detail)``."""
    args, kwargs = arguments(case, data)
    try:
        result = fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (a port that raises fails the case, with the reason)
        return False, f"raised {type(error).__name__}: {error}"
    advantages, returns = result if isinstance(result, tuple) else (result, None)
    granularity = "sequence" if case["estimator"] in ("grpo", "rloo", "opo", "sequence_proxy", "eob") else "token"
    worst = errors(advantages, np.asarray(case["advantages"], np.float64))
    if returns is not None:
        worst = max(worst, errors(returns, np.asarray(data["returns"][granularity], np.float64)))
    detail = f"max abs {worst[0]:.3g}, max rel {worst[1]:.3g} (tolerance {case['atol']:.3g} abs)"
    if "max_abs" in case:  # ill-conditioned case: the size of the advantages is pinned as well
        size = float(np.max(np.abs(np.asarray(advantages, np.float64)), initial=0.0))
        detail += f"; max |A| {size:.3g} (at most {case['max_abs']:.3g})"
        if not size <= case["max_abs"]:
            return False, detail
    return worst[0] <= case["atol"], detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", help="FILE.py:FUNCTION, called like otb_ref.compute_advantages on NumPy arrays")
    parser.add_argument("--estimator", action="append", help="only this estimator (repeatable)")
    parser.add_argument("--tag", action="append", help="only cases with this tag (repeatable: any of them)")
    parser.add_argument("--vectors", default=str(DEFAULT_VECTORS), help="the vectors file (default: %(default)s)")
    args = parser.parse_args(argv)
    document = json.loads(Path(args.vectors).read_text())
    known = {case["estimator"] for case in document["cases"]}
    for name in args.estimator or []:
        if name not in known:
            parser.error(f"--estimator: unknown estimator {name!r}; choose from {sorted(known)}")
    fn = load_function(args.port)
    cases = [
        case
        for case in document["cases"]
        if (not args.estimator or case["estimator"] in args.estimator)
        and (not args.tag or any(tag in case["tags"] for tag in args.tag))
    ]
    failed = 0
    for case in cases:
        passed, detail = check_case(fn, case, document["inputs"][case["input"]])
        if not passed:
            failed += 1
            options = ",".join(f"{k}={v}" for k, v in case["options"].items())
            print(
                f"FAIL {case['id']}  estimator={case['estimator']} {options}  tags={','.join(case['tags'])}  {detail}"
            )
    print(f"{len(cases)} cases: {len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
