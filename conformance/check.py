"""Check a port of ``otb_ref.compute_advantages`` against the conformance vectors. NumPy only (no torch needed).

    python conformance/check.py FILE.py:FUNCTION [--estimator otb] [--tag clamp] [--vectors conformance/vectors.json]

``FUNCTION`` is called like ``otb_ref.compute_advantages`` with NumPy arrays:

    fn(estimator, token_level_rewards, response_mask, index, **inputs_and_options)

``token_level_rewards`` and the ``[B, T]`` inputs (``old_log_probs``, ``sum_pi_squared``, ``cumulative_energy``,
``rollout_is_weights``) come in the case's dtype (float64, or float32 for cases tagged ``fp32``), ``response_mask``
as 0/1 float64 (its dtype does not count toward the compute dtype), ``grad_norms_sq`` ``[B]``, ``index`` a 1-D
NumPy array of ints or strings. Values off the mask can be anything, NaN and ±Inf included. The options are
``leave_one_out``, ``std_normalize``, ``epsilon`` and, for token-level estimators, ``multi_turn`` and
``handle_zero_tail``; cases tagged ``omitted_flags`` pass none of them (the defaults decide). Only the inputs an
estimator reads are passed. It returns the advantages ``[B, T]`` or ``(advantages, returns)``, NumPy arrays in
the compute dtype; each is compared with the expected values within the case's absolute tolerance (``atol`` for
the advantages, the input's ``returns_atol`` for the returns), and where a case carries ``max_abs``
(rounding-level ties under std scaling, "bound-only": the inputs decide the advantages only up to rounding)
every |A| must stay within it.

Prints one line per failing case (its id, estimator, options, tags, max abs and rel error, tolerance), then a
summary, the bound-only cases on a line of their own; exits 1 if any case fails, 2 on a usage error (a port file
or function that is not there, an unknown ``--estimator`` or ``--tag``, a vectors file of another format or whose
values off the mask are all finite).
Input validation (PORTING item 8: which inputs raise ``ValueError``) is outside these vectors.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import math
import sys
import zlib
from pathlib import Path

import numpy as np

DEFAULT_VECTORS = Path(__file__).resolve().parent / "vectors.json"
FORMAT = "otb_ref conformance vectors, version 2"
MATRICES = ("token_level_rewards", "old_log_probs", "sum_pi_squared", "cumulative_energy", "rollout_is_weights")
SEQUENCE_ESTIMATORS = ("grpo", "rloo", "opo", "sequence_proxy", "eob")


def pack(array: np.ndarray) -> dict:
    """An array as strict JSON: little-endian bytes, zlib-compressed, base64 (NaN and ±Inf included)."""
    array = np.ascontiguousarray(array)
    data = zlib.compress(array.astype(array.dtype.newbyteorder("<")).tobytes(), 9)
    return dict(dtype=array.dtype.name, shape=list(array.shape), zlib_base64=base64.b64encode(data).decode("ascii"))


def unpack(packed: dict) -> np.ndarray:
    """The inverse of :func:`pack`."""
    raw = zlib.decompress(base64.b64decode(packed["zlib_base64"]))
    dtype = np.dtype(packed["dtype"]).newbyteorder("<")
    return np.frombuffer(raw, dtype).astype(np.dtype(packed["dtype"])).reshape(packed["shape"])


def load_vectors(path: str | Path) -> dict:
    """The vectors file with every array decoded; ``ValueError`` for another format or all-finite off-mask values."""
    document = json.loads(Path(path).read_text())
    if document.get("format") != FORMAT:
        raise ValueError(f"format {document.get('format')!r}, expected {FORMAT!r}: regenerate or update the checker")
    for data in document["inputs"].values():
        for key, value in list(data["arrays"].items()):
            data[key] = unpack(value)
        data["returns"] = {granularity: unpack(value) for granularity, value in data["returns"].items()}
    for case in document["cases"]:
        case["advantages"] = unpack(case["advantages"])
    off = [data[key][data["response_mask"] == 0] for data in document["inputs"].values() for key in MATRICES]
    off = np.concatenate([x.astype(np.float64) for x in off]) if off else np.zeros(0)
    missing = [
        name
        for name, seen in [("NaN", np.isnan(off)), ("+Inf", off == np.inf), ("-Inf", off == -np.inf)]
        if not seen.any()
    ]
    if missing:
        raise ValueError(f"no {', '.join(missing)} off the mask in any input: the off-mask rule could not fail")
    return document


class PortNotFound(Exception):
    """The port's file or function is not there: a usage error (exit 2). Errors the port raises are its own."""


def load_module(path: str | Path):
    """The Python file ``path`` as a module named by its stem (a port is a file, not a package: loaded by its path,
    nothing added to ``sys.path``)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise PortNotFound(f"no such file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_function(target: str):
    """``FILE.py:FUNCTION`` -> the callable."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise PortNotFound(f"expected FILE.py:FUNCTION, got {target!r}")
    module = load_module(path)
    if not callable(getattr(module, name, None)):
        raise PortNotFound(f"{path} has no function {name!r}")
    return getattr(module, name)


def arguments(case: dict, data: dict) -> tuple[list, dict]:
    """The call's positional and keyword arguments for one case (arrays in the input's stored dtypes)."""
    options = dict(case["options"])
    wants_is = options.pop("rollout_is_weights")
    kwargs = dict(options)
    energy = {"otb": "proxy", "sequence_proxy": "proxy", "eob": "grad_norms_sq", "otb_exact": "cumulative_energy"}
    needed = energy.get(case["estimator"])
    if needed == "proxy":
        kwargs.update(old_log_probs=data["old_log_probs"], sum_pi_squared=data["sum_pi_squared"])
    elif needed is not None:
        kwargs[needed] = data[needed]
    if wants_is:
        kwargs["rollout_is_weights"] = data["rollout_is_weights"]
    return [case["estimator"], data["token_level_rewards"], data["response_mask"], np.asarray(data["index"])], kwargs


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
    granularity = "sequence" if case["estimator"] in SEQUENCE_ESTIMATORS else "token"
    worst = errors(advantages, case["advantages"])
    passed = worst[0] <= case["atol"]
    detail = f"max abs {worst[0]:.3g}, max rel {worst[1]:.3g} (tolerance {case['atol']:.3g} abs)"
    if returns is not None:
        returns_error = errors(returns, data["returns"][granularity])
        passed &= returns_error[0] <= data["returns_atol"][granularity]
        detail += f"; returns max abs {returns_error[0]:.3g} (tolerance {data['returns_atol'][granularity]:.3g})"
    wrong = [
        f"{what} dtype {getattr(x, 'dtype', type(x).__name__)}, expected {data['dtype']}"
        for what, x in (("advantages", advantages), ("returns", returns))
        if x is not None and getattr(x, "dtype", None) != np.dtype(data["dtype"])
    ]
    if wrong:
        passed, detail = False, detail + "; " + "; ".join(wrong)
    if "max_abs" in case:  # bound-only case: the size of the advantages is pinned as well
        size = float(np.max(np.abs(np.asarray(advantages, np.float64)), initial=0.0))
        detail += f"; max |A| {size:.3g} (at most {case['max_abs']:.3g})"
        passed &= size <= case["max_abs"]
    return bool(passed), detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", help="FILE.py:FUNCTION, called like otb_ref.compute_advantages on NumPy arrays")
    parser.add_argument("--estimator", action="append", help="only this estimator (repeatable)")
    parser.add_argument("--tag", action="append", help="only cases with this tag (repeatable: any of them)")
    parser.add_argument("--vectors", default=str(DEFAULT_VECTORS), help="the vectors file (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        document = load_vectors(args.vectors)
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"--vectors {args.vectors}: {error}")
    known = sorted({case["estimator"] for case in document["cases"]})
    for name in args.estimator or []:
        if name not in known:
            parser.error(f"--estimator: unknown estimator {name!r}; choose from {known}")
    tags = sorted({tag for case in document["cases"] for tag in case["tags"]})
    for tag in args.tag or []:
        if tag not in tags:
            parser.error(f"--tag: unknown tag {tag!r}; choose from {tags}")
    try:
        fn = load_function(args.port)
    except PortNotFound as error:  # a usage error (exit 2), not a failing case (exit 1)
        parser.error(f"port: {error}")
    cases = [
        case
        for case in document["cases"]
        if (not args.estimator or case["estimator"] in args.estimator)
        and (not args.tag or any(tag in case["tags"] for tag in args.tag))
    ]
    failed, bound_only = [], [case for case in cases if "max_abs" in case]
    for case in cases:
        passed, detail = check_case(fn, case, document["inputs"][case["input"]])
        if not passed:
            failed.append(case["id"])
            options = ",".join(f"{k}={v}" for k, v in case["options"].items())
            print(
                f"FAIL {case['id']}  estimator={case['estimator']} {options}  tags={','.join(case['tags'])}  {detail}"
            )
    bound_failed = sum(case["id"] in failed for case in bound_only)
    print(f"{len(cases)} cases: {len(cases) - len(failed)} passed, {len(failed)} failed")
    print(
        f"of which bound-only (max_abs; ties under std scaling, no rule's only evidence): {len(bound_only)} cases: "
        f"{len(bound_only) - bound_failed} passed, {bound_failed} failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
