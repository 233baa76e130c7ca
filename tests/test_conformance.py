"""The conformance vectors (conformance/vectors.json) and their checker (conformance/check.py).

The library and every correct port (loops, vectorised, other summation orders) pass every case; each rule of the
porting contract has a port of its own that breaks it alone (conformance/ports/bugs/) and fails the cases tagged
with it (the precision rules: at least 3 cases by at least 2× their tolerance); the checker runs without torch,
checks dtypes, reports failures by case (exit 1) and refuses what it cannot honour (exit 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "conformance" / "check.py"
VECTORS = ROOT / "conformance" / "vectors.json"
PORTS = ROOT / "conformance" / "ports"
NUMPY_PORT = PORTS / "numpy_port.py"
for folder in (PORTS / "bugs", PORTS, ROOT / "conformance"):
    sys.path.insert(0, str(folder))

import check  # noqa: E402
import generate  # noqa: E402
import inputs  # noqa: E402
import one_rule  # noqa: E402

PRECISION = ["precision_G", "precision_W", "precision_v", "precision_sigma", "precision_G_minus_B"]


@pytest.fixture(scope="module")
def document():
    return check.load_vectors(VECTORS)


def _failing(port, document, cases=None) -> dict[str, float]:
    """``{case id: error / atol}`` of the cases ``port`` fails (inf for a raise, a dtype or a bound)."""
    out = {}
    for case in document["cases"] if cases is None else cases:
        data = document["inputs"][case["input"]]
        passed, _ = check.check_case(port, case, data)
        if not passed:
            args, kwargs = check.arguments(case, data)
            try:
                error = check.errors(port(*args, **kwargs)[0], case["advantages"])[0]
            except Exception:  # noqa: BLE001
                error = np.inf
            out[case["id"]] = error / case["atol"] if error > case["atol"] else np.inf
    return out


def test_otb_ref_passes_every_case(capsys):
    """``otb_ref.compute_advantages`` (wrapped for NumPy) meets every case's advantages, returns and dtypes."""
    status = check.main([f"{PORTS / 'otb_ref_numpy.py'}:compute_advantages"])
    out = capsys.readouterr().out
    assert status == 0, out
    summary, bound = out.strip().splitlines()[-2:]
    assert summary.endswith(" 0 failed") and bound.startswith("of which bound-only") and bound.endswith(" 0 failed")


@pytest.mark.parametrize("order", ["compute_advantages", "pairwise", "direct", "welford"])
def test_correct_ports_in_other_orders_pass_every_case(document, order):
    """The vectorised port as written, and with v and group sums pairwise, leave-one-out sums direct, or σ by
    Welford's update: the tolerances admit every summation order the contract leaves free."""
    import vector_port

    assert _failing(getattr(vector_port, order), document) == {}


@pytest.mark.parametrize("rule", sorted(one_rule.RULES))
def test_each_rule_has_a_port_that_fails_exactly_its_cases(document, rule):
    """The port breaking ``rule`` alone fails every case tagged with it, at least one of them a case with a
    tolerance (not bound-only), and passes the untagged cases (all of its input sets' cases, 300 others drawn)."""
    port = one_rule.port(rule)
    tagged = [case for case in document["cases"] if rule in case["tags"]]
    assert tagged, f"no case exercises {rule}"
    assert sorted(_failing(port, document, tagged)) == sorted(case["id"] for case in tagged)
    assert any("max_abs" not in case for case in tagged), f"{rule}: bound-only cases are its only evidence"
    inputs_of_rule = {case["input"] for case in tagged}
    others = [case for case in document["cases"] if rule not in case["tags"]]
    drawn = np.random.default_rng(0).choice(len(others), size=min(300, len(others)), replace=False)
    sample = [case for case in others if case["input"] in inputs_of_rule] + [others[i] for i in drawn]
    assert _failing(port, document, sample) == {}


@pytest.mark.parametrize("rule", PRECISION)
def test_each_precision_port_fails_three_cases_by_twice_their_tolerance(document, rule):
    """G, W, v, σ and G − B accumulated in the compute dtype, each in a port of its own: each fails at least 3
    cases (not bound-only) by at least 2× their atol."""
    tagged = [case for case in document["cases"] if rule in case["tags"] and "max_abs" not in case]
    ratios = _failing(one_rule.port(rule), document, tagged)
    assert sum(ratio >= 2.0 for ratio in ratios.values()) >= 3, ratios


def test_torch_fp32_returns_fail_the_long_case(document):
    """G by torch's fp32 cumsum on CPU (accumulated in double, each G_t rounded to fp32 once) fails the long-T
    case with dense cancelling fp32 rewards (and passes the cases where G_t is small beside A)."""
    long_cases = [case for case in document["cases"] if case["input"] == "long_T_fp32"]
    assert long_cases and len(long_cases[0]["advantages"][0]) >= 4096
    assert _failing(one_rule.torch_returns_fp32, document, long_cases)
    outcome = [case for case in document["cases"] if case["input"] == "outcome"]
    assert _failing(one_rule.torch_returns_fp32, document, outcome) == {}


def test_unchecked_rules_are_stated_and_their_ports_pass(document):
    """w_t's dtype cannot be checked (fp32 exps differ by more than its effect): its port passes every case, as
    one_rule.UNCHECKED and docs/PORTING.md say."""
    assert set(one_rule.UNCHECKED) == {"w_dtype"}
    assert "w_dtype" in (ROOT / "docs" / "PORTING.md").read_text()
    assert _failing(one_rule.port("w_dtype"), document) == {}


def test_every_rule_is_in_the_vectors_and_the_docs(document):
    """The vectors' rules are one_rule's; PORTING.md names each tag."""
    assert set(document["rules"]) == set(one_rule.RULES)
    porting = (ROOT / "docs" / "PORTING.md").read_text()
    assert [rule for rule in one_rule.RULES if f"`{rule}`" not in porting] == []


def test_omitted_flag_cases_pass_no_flag_and_the_defaults_decide(document):
    """``omitted_flags`` cases pass no flag keyword; the all-off cases are named ``flags_off``."""
    omitted = [case for case in document["cases"] if "omitted_flags" in case["tags"]]
    assert omitted and all(set(case["options"]) == {"rollout_is_weights"} for case in omitted)
    assert all(case["id"].endswith("/defaults") for case in omitted)
    off = [case for case in document["cases"] if "flags_off" in case["tags"]]
    assert off and all(not any(case["options"].get(key) for key in ("leave_one_out", "std_normalize")) for case in off)
    for rule, estimators in [("defaults", {"grpo", "rloo"}), ("default_epsilon", {"otb", "grpo"})]:
        assert estimators <= {case["estimator"] for case in omitted if rule in case["tags"]}, rule


def test_off_mask_values_are_nan_and_infinite_in_every_input_each_estimator_reads(document):
    """In the off-mask inputs (fp64 and fp32), every [B, T] input holds NaN, +Inf and −Inf off the mask."""
    for name in ("off_mask", "off_mask_fp32"):
        data = document["inputs"][name]
        for key in check.MATRICES:
            off = data[key][data["response_mask"] == 0]
            assert np.isnan(off).any() and (off == np.inf).any() and (off == -np.inf).any(), (name, key)


def test_the_numpy_port_passes_and_the_checker_needs_no_torch():
    """The checker and the NumPy port run in an interpreter where ``import torch`` fails."""
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = ['check.py', {str(NUMPY_PORT) + ':compute_advantages'!r}, '--estimator', 'otb', "
        f"'--estimator', 'grpo']; runpy.run_path({str(CHECK)!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-2].endswith(" 0 failed")


def test_checker_names_each_failing_case_and_exits_1(tmp_path):
    """A port that returns zeros fails; each failing line names the case, its estimator, options and tags."""
    path = tmp_path / "zeros.py"
    path.write_text(
        "import numpy as np\n\n\ndef port(estimator, rewards, mask, index, **kw):\n    return np.zeros(rewards.shape)\n"
    )
    result = subprocess.run(
        [sys.executable, str(CHECK), f"{path}:port", "--estimator", "rloo"], capture_output=True, text=True
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert "failed" in lines[-2] and lines[-1].startswith("of which bound-only")
    fail = [line for line in lines if line.startswith("FAIL ")]
    assert fail and all("estimator=rloo" in line and "tags=" in line and "max abs" in line for line in fail)
    assert any("dtype float64, expected float32" in line for line in fail)  # zeros in fp64 for fp32 cases


@pytest.mark.parametrize("flag, value", [("--estimator", "ppo"), ("--tag", "is_weight")])
def test_checker_refuses_an_unknown_estimator_or_tag_with_status_2(flag, value):
    result = subprocess.run(
        [sys.executable, str(CHECK), f"{NUMPY_PORT}:compute_advantages", flag, value], capture_output=True, text=True
    )
    assert result.returncode == 2 and flag in result.stderr and value in result.stderr
    if flag == "--tag":  # the known tags are listed
        assert "'is_weights'" in result.stderr and "'clamp'" in result.stderr


@pytest.mark.parametrize(
    "target, message",
    [("missing.py:port", "no such file"), ("NUMPY:no_such_function", "has no function 'no_such_function'"),
     ("NUMPY", "expected FILE.py:FUNCTION")],
)  # fmt: skip
def test_checker_refuses_a_port_that_is_not_there_with_status_2(target, message):
    """A missing port file or function is a usage error (exit 2, one line naming it), not a failing case (exit 1)."""
    target = target.replace("NUMPY", str(NUMPY_PORT))
    result = subprocess.run([sys.executable, str(CHECK), target], capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_checker_reports_a_port_s_own_import_error_as_it_is(tmp_path):
    """A KeyError raised while the port is imported is the port's error (a traceback, exit 1), not "not there"."""
    path = tmp_path / "broken_port.py"
    path.write_text("{}['missing_key']\n")
    result = subprocess.run([sys.executable, str(CHECK), f"{path}:port"], capture_output=True, text=True)
    assert result.returncode == 1 and "KeyError: 'missing_key'" in result.stderr


def _rewritten(tmp_path: Path, change) -> Path:
    raw = json.loads(VECTORS.read_text())
    change(raw)
    path = tmp_path / "vectors.json"
    path.write_text(json.dumps(raw))
    return path


def _finite_off_mask(raw: dict) -> None:
    for data in raw["inputs"].values():
        mask = check.unpack(data["arrays"]["response_mask"])
        for key in check.MATRICES:
            data["arrays"][key] = check.pack(np.where(mask != 0, check.unpack(data["arrays"][key]), 0.0))


@pytest.mark.parametrize(
    "change, message",
    [
        (_finite_off_mask, "off the mask"),
        (lambda raw: raw.update(format="otb_ref conformance vectors, version 1"), "format"),
    ],
)
def test_checker_refuses_vectors_it_cannot_honour(tmp_path, change, message):
    """A vectors file whose values off the mask are all finite (the off-mask rule could not fail) or of another
    format: exit 2, saying why."""
    path = _rewritten(tmp_path, change)
    result = subprocess.run(
        [sys.executable, str(CHECK), f"{NUMPY_PORT}:compute_advantages", "--vectors", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and message in result.stderr


def test_vectors_hold_the_generators_inputs_and_every_estimator_and_option(document):
    """The committed inputs are the ones ``python conformance/generate.py`` builds (same seeds), the long input
    bit for bit (its SHA-256, stored), and the cases cover every estimator of ESTIMATORS with every option that
    applies; the file is format 2 and under 10 MB."""
    from otb_ref import ESTIMATORS

    assert document["format"] == check.FORMAT and VECTORS.stat().st_size < 10e6
    for name, (arrays, _) in inputs.build_inputs().items():
        stored = document["inputs"][name]
        dtype = np.dtype(arrays["dtype"]).type
        if name == "long_T_fp32":  # raw PCG64 bits and IEEE arithmetic: the same bits on every NumPy version
            assert inputs.checksum(arrays) == inputs.checksum(stored) == stored["sha256"]
            continue
        # Equal to a few units in the last place, not bit for bit: numpy's SIMD exp and log round differently on
        # different CPUs (seen: 2e-16 relative in one log-probability, AMD EPYC with AVX2 against an Intel Xeon with
        # AVX-512). The committed inputs are the contract; every expected output is computed from them.
        for key in inputs.ARRAYS:
            regenerated = np.asarray(arrays[key]).astype(dtype)
            ulps = 8 * np.finfo(dtype).eps
            np.testing.assert_allclose(stored[key], regenerated, rtol=ulps, atol=0, err_msg=key)
    assert {case["estimator"] for case in document["cases"]} == set(ESTIMATORS)
    for name in ESTIMATORS:
        cases = [case for case in document["cases"] if case["estimator"] == name and case["input"] == "outcome"]
        assert len({tuple(sorted(case["options"].items())) for case in cases}) == len(generate.option_grid(name))
