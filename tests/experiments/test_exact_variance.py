"""experiments/exact_variance.py in its quick mode: the report's structure, and the invariants that are theorems
(F1, F3, F4, F6, F7, E2 of docs/THEORY.md and proofs/). No measured number or ordering that is not a theorem."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import exact_variance as ev

TOL = 1e-9


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("exact_variance")
    return ev.main(["--quick", "--out-dir", str(out_dir)]), out_dir


def test_quick_report_has_every_estimator_case_and_plot(quick):
    outcome, out_dir = quick
    assert outcome.report == out_dir / "exact_variance.md"
    text = outcome.report.read_text()
    for part in ("Machine:", "Wall time:", "## What this shows", "## Population baselines", "## Finite groups"):
        assert part in text
    saved = json.loads((out_dir / "exact_variance_records.json").read_text())  # the numbers behind the figures
    assert len(saved["population"]) == len(outcome.population) and len(saved["groups"]) == len(outcome.groups)
    header = "| V | L | responses | " + " | ".join(ev.population_label(n) for n in ev.POPULATION) + " |"
    assert text.count(header) == len({lengths for lengths, _, _ in ev.QUICK.population}) * len(ev.PANELS)
    lines = text.splitlines()
    for name in ev.GROUP + ev.REFERENCES:  # a row in every group table, and one in the group summary
        rows = [line for line in lines if line.startswith(f"| {ev.label(name)} | ")]
        assert len(rows) == len(ev.QUICK.groups) * len(ev.PANELS) + 1, name
    pngs = sorted(out_dir.glob("exact_variance*.png"))
    assert len(pngs) == len({(lengths, v) for lengths, v, _ in ev.QUICK.population}) + 2
    for png in pngs:
        assert png.read_bytes()[:4] == b"\x89PNG" and f"]({png.name})" in text
    cases = sum(len(horizons) for _, _, horizons in ev.QUICK.population) * len(ev.QUICK.seeds)
    assert len(outcome.population) == cases * len(ev.POLICIES) * len(ev.REWARDS)
    assert {tuple(r["var"]) for r in outcome.population} == {tuple(ev.POPULATION)}
    per_cell = len(ev.PANELS) * len(ev.QUICK.sizes) * len(ev.GROUP + ev.REFERENCES)
    assert len(outcome.groups) == len(ev.QUICK.groups) * per_cell


def test_f4_bstar_ratio_is_one_and_per_position_constant_baselines_are_above_it(quick):
    """F4: B** minimises the variance over vectors of per-position constants. Those are: no baseline, every
    token-level population baseline, and, under outcome reward only, every sequence-level one (Corollary 3)."""
    for r in quick[0].population:
        assert r["var"]["optimal"] == pytest.approx(1.0, abs=1e-12)
        constants = ["none"] + ev.TOKEN_LEVEL + (ev.SEQUENCE_LEVEL if r["reward"] == "outcome" else [])
        for name in constants:
            assert r["var"][name] >= 1 - TOL, (name, r)


def test_f3_eob_is_the_variance_optimal_sequence_constant(quick):
    """F3 (any reward function R of the response, here the total return): Var(EOB) <= Var(b) for every constant b,
    the baselines of grpo/rloo mean, opo, sequence_proxy included; b = 0 is no baseline under outcome reward."""
    for r in quick[0].population:
        others = ["grpo", "opo", "sequence_proxy"] + (["none"] if r["reward"] == "outcome" else [])
        for name in others:
            assert r["var"]["eob"] <= r["var"][name] * (1 + TOL), (name, r)


def test_f1_population_baselines_are_unbiased(quick):
    for r in quick[0].population:
        for name, bias in r["bias"].items():
            assert bias <= TOL, (name, r)


def test_f6_tree_policy_proxy_is_exact_so_otb_equals_otb_exact(quick):
    for r in quick[0].population:
        if r["policy"] == "tree":
            assert r["var"]["otb"] == pytest.approx(r["var"]["otb_exact"], rel=TOL, abs=TOL), r


def test_e2_tree_fixed_length_outcome_otb_between_bstar_and_eob(quick):
    cases = [r for r in quick[0].population if (r["policy"], r["lengths"], r["reward"]) == ("tree", "fixed", "outcome")]
    assert cases
    for r in cases:
        assert 1 - TOL <= r["var"]["otb"] <= r["var"]["eob"] * (1 + TOL), r


def test_f7_leave_one_out_is_unbiased_and_include_self_mean_is_scaled_leave_one_out(quick):
    """F7(a): leave-one-out is unbiased (std scaling excepted, F7(c)); F7(b): the include-self plain mean is
    (N-1)/N times its leave-one-out version (sequence level always; token level when all lengths are equal)."""
    for r in quick[0].groups:
        if r["estimator"] != "grpo":
            assert r["bias_loo"] <= TOL, r
        scaled = r["estimator"] == "rloo" or (r["estimator"] == "token_mean" and r["lengths"] == "fixed")
        if scaled:
            factor = (r["N"] - 1) / r["N"]
            assert r["bias_self"] == pytest.approx(1 / r["N"], rel=1e-6), r
            assert r["var_self"] == pytest.approx(factor**2 * r["var_loo"], rel=1e-6), r
        if r["estimator"] == "optimal":
            assert r["var_self"] == r["var_loo"] == pytest.approx(1.0, abs=1e-12)
