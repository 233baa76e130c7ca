"""The conformance vectors (conformance/vectors.json) and their checker (conformance/check.py).

The library passes every case; the NumPy port with one rule switched off fails exactly the cases tagged with that
rule; the checker runs without torch and reports failures by case, with exit status 1.
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
NUMPY_PORT = ROOT / "conformance" / "ports" / "numpy_port.py"
sys.path.insert(0, str(ROOT / "conformance"))

import check  # noqa: E402
import generate  # noqa: E402


@pytest.fixture(scope="module")
def document():
    return json.loads(VECTORS.read_text())


def test_otb_ref_passes_every_case(capsys):
    """``otb_ref.compute_advantages`` (wrapped for NumPy) meets every case's expected advantages and returns."""
    status = check.main([f"{ROOT / 'conformance/ports/otb_ref_numpy.py'}:compute_advantages"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.strip().endswith("0 failed")


def _broken_port(tmp_path: Path, rule: str) -> str:
    """A port file: the NumPy port with one rule switched off."""
    path = tmp_path / f"broken_{rule}.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(NUMPY_PORT.parent)!r})\nimport numpy_port\n\n\n"
        f"def port(*args, **kwargs):\n    return numpy_port.compute_advantages(*args, broken={{{rule!r}}}, **kwargs)\n"
    )
    return f"{path}:port"


@pytest.mark.parametrize("rule", sorted(generate.RULES))
def test_a_port_breaking_one_rule_fails_exactly_its_cases(tmp_path, capsys, document, rule):
    """For each rule: the failing cases (estimators otb, sequence_proxy, grpo, token_length: every rule is tagged
    among them) are exactly the cases tagged with the rule, and there is at least one."""
    estimators = ["otb", "sequence_proxy", "grpo", "token_length"]
    flags = [arg for name in estimators for arg in ("--estimator", name)]
    status = check.main([_broken_port(tmp_path, rule), *flags])
    failed = {line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL ")}
    tagged = {case["id"] for case in document["cases"] if case["estimator"] in estimators and rule in case["tags"]}
    assert tagged, f"no case exercises {rule}"
    assert status == 1
    assert failed == tagged


def test_the_numpy_port_passes_and_the_checker_needs_no_torch():
    """The checker and the NumPy port run in an interpreter where ``import torch`` fails."""
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = ['check.py', {str(NUMPY_PORT) + ':compute_advantages'!r}, '--estimator', 'otb', "
        "'--estimator', 'grpo']; runpy.run_path(sys.argv[0] if False else "
        f"{str(CHECK)!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("0 failed")


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
    assert lines[-1].startswith(f"{len(lines) - 1} cases") or "failed" in lines[-1]
    fail = [line for line in lines if line.startswith("FAIL ")]
    assert fail and all("estimator=rloo" in line and "tags=" in line and "max abs" in line for line in fail)


def test_checker_refuses_an_unknown_estimator_with_status_2(tmp_path):
    result = subprocess.run(
        [sys.executable, str(CHECK), f"{NUMPY_PORT}:compute_advantages", "--estimator", "ppo"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--estimator" in result.stderr


def test_vectors_hold_the_generators_inputs_and_every_estimator_and_option(document):
    """The committed inputs are the ones ``python conformance/generate.py`` builds (same seed), and the cases cover
    every estimator of ESTIMATORS with every option that applies."""
    from otb_ref import ESTIMATORS

    for name, (arrays, _) in generate.build_inputs().items():
        stored = document["inputs"][name]
        dtype = np.dtype(arrays["dtype"]).type
        # Equal to a few units in the last place, not bit for bit: numpy's SIMD exp and log round differently on
        # different CPUs (seen: 2e-16 relative in one log-probability, AMD EPYC with AVX2 against an Intel Xeon with
        # AVX-512). The committed inputs are the contract; every expected output is computed from them.
        for key in ("token_level_rewards", "response_mask", "grad_norms_sq", *generate.TOKEN_INPUTS):
            regenerated = np.asarray(arrays[key]).astype(dtype)
            ulps = 8 * np.finfo(dtype).eps
            np.testing.assert_allclose(np.asarray(stored[key]), regenerated, rtol=ulps, atol=0, err_msg=key)
    assert {case["estimator"] for case in document["cases"]} == set(ESTIMATORS)
    for name in ESTIMATORS:
        seen = {tuple(sorted(case["options"].items())) for case in document["cases"] if case["estimator"] == name}
        assert len(seen) == len(generate.option_grid(name))
