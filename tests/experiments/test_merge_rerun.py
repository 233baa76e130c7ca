"""experiments/merge_rerun.py: the step-by-step comparison of two compact variance_lr records (the reruns
themselves are ~5 minutes each: not in the suite)."""

import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import merge_rerun

from common import variance_runs


def _record() -> dict:
    return json.loads((ROOT / "results" / "variance_lr" / f"{merge_rerun.RECORD}.json").read_text())


def test_compare_finds_the_first_differing_step_and_the_largest_difference():
    a = _record()
    assert variance_runs.compare(a, copy.deepcopy(a))["first_step"] is None
    b = copy.deepcopy(a)
    column = a["columns"].index("grad_norm")
    b["steps"][6][column] += 0.5
    b["steps"][40][column] -= 0.25
    result = variance_runs.compare(a, b)
    assert result["first_step"] == a["steps"][6][0] == 7
    assert result["largest"]["grad_norm"] == 0.5 and result["largest"]["reward_mean"] == 0


def test_metrics_are_the_pilot_metric_and_final_reward():
    a = _record()
    rewards = [row[a["columns"].index("reward_mean")] for row in a["steps"]]
    tokens = [row[a["columns"].index("generated_tokens")] for row in a["steps"]]
    m = variance_runs.metrics(a)
    assert abs(m["M"] - sum(r * t for r, t in zip(rewards, tokens)) / sum(tokens)) < 1e-12
    assert abs(m["final"] - sum(rewards[-15:]) / 15) < 1e-12


def test_results_md_quotes_the_reruns():
    loaded = merge_rerun.load(ROOT / "results")
    assert loaded is not None, "the committed reruns are missing"
    committed, reruns = loaded
    text = " ".join((ROOT / "docs" / "RESULTS.md").read_text().split())
    metrics = [variance_runs.metrics(r) for r in (committed, *reruns.values())]
    assert len({(round(m["M"], 4), round(m["final"], 4)) for m in metrics}) == 1
    assert f"M = {metrics[0]['M']:.4f} and final reward {metrics[0]['final']:.4f} in both" in text
    pre, merged = reruns.values()
    both = variance_runs.compare(pre, merged)
    assert (
        f"first differ at step {both['first_step']}, in grad_norm by at most {both['largest']['grad_norm']:.2g}" in text
    )
    assert both["largest"]["reward_mean"] == 0 and both["largest"]["generated_tokens"] == 0
    own = variance_runs.compare(committed, pre)
    assert f"(from step {own['first_step']}; grad_norm {own['largest']['grad_norm']:.2g})" in text
