"""experiments/variance_lr.py: its quick mode (records, aim lines, resume, report and figure, all in a tmp path), its
selection and decision rules on synthetic records (both directions and neither), never the verdict."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import variance_lr

from common import variance_rule, variance_runs


def test_variance_lr_quick_records_every_run_resumes_and_reports(tmp_path):
    """Quick mode: one selection and one test run per arm, each with its per-step rows and aim lines; a second call
    runs nothing (every record is left as it was) and reports."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    report = variance_lr.main(["--quick", "--runs-dir", str(runs), "--out-dir", str(out)])
    records = out / "variance_lr"
    names = sorted(p.name for p in records.glob("*.json"))
    assert names == sorted(f"{arm}_n2_lr0.001_seed{s}.json" for arm in variance_runs.PRIMARY for s in (0, 1))
    record = json.loads((records / names[0]).read_text())
    assert record["columns"] == variance_runs.COLUMNS and [row[0] for row in record["steps"]] == [1, 2]
    assert [line["step"] for line in record["aim"]] == [1] and "cos_update" in record["aim"][0]
    assert "--grad-clip" in record["flags"] and record["flags"][record["flags"].index("--grad-clip") + 1] == "0"
    text = report.read_text()
    assert "Verdict: " in text and "Machine:" in text and "| rloo | 2 | 0.001 | 1 |" in text
    assert (out / "variance_lr.png").read_bytes()[:4] == b"\x89PNG"
    stamps = {p.name: p.stat().st_mtime_ns for p in records.iterdir()}
    variance_lr.main(["--quick", "--runs-dir", str(runs), "--out-dir", str(out)])
    assert {p.name: p.stat().st_mtime_ns for p in records.iterdir()} == stamps


def _record(arm: str, n: int, lr: float, seed: int, reward: float) -> dict:
    rows = [{"step": i + 1, "tokens": 100 * (i + 1), "generated_tokens": 100, "reward_mean": reward,
             "update_norm": 0.01} for i in range(10)]  # fmt: skip
    return {"arm": arm, "group_size": n, "lr": lr, "seed": seed, "rows": rows, "aim": []}


def _grid(otb_test: list[float], rloo_test: list[float]) -> dict:
    """Selection: rloo best at 1e-3, otb_loo at 3e-3 (and a tie at 1e-4 and 3e-4 for otb_loo); test seeds 3-7."""
    selection = {
        "rloo": {1e-4: 0.3, 3e-4: 0.4, 1e-3: 0.5, 3e-3: 0.1},
        "otb_loo": {1e-4: 0.6, 3e-4: 0.6, 1e-3: 0.5, 3e-3: 0.7},
    }
    runs = [
        _record(arm, 4, lr, s, value)
        for arm, by_lr in selection.items()
        for lr, value in by_lr.items()
        for s in (0, 1, 2)
    ]
    runs += [_record("otb_loo", 4, 3e-3, 3 + i, v) for i, v in enumerate(otb_test)]
    runs += [_record("rloo", 4, 1e-3, 3 + i, v) for i, v in enumerate(rloo_test)]
    return variance_lr.cells(runs)


def test_selection_rule_takes_the_best_mean_and_the_smaller_rate_on_a_tie():
    by_cell = _grid([0.5] * 5, [0.5] * 5)
    lrs = (1e-4, 3e-4, 1e-3, 3e-3)
    assert variance_lr.select(by_cell, "rloo", 4, lrs, (0, 1, 2)) == 1e-3
    assert variance_lr.select(by_cell, "otb_loo", 4, lrs, (0, 1, 2)) == 3e-3
    assert variance_lr.select(by_cell, "otb_loo", 4, lrs[:2], (0, 1, 2)) == 1e-4  # tie: the smaller rate
    assert variance_lr.select(by_cell, "rloo", 4, (*lrs, 1e-2), (0, 1, 2)) is None  # a rate without records


def test_decision_rule_comes_out_either_way():
    """otb_loo ahead by ≥ δ in 4 of 5 seeds, rloo ahead by ≥ δ in 4 of 5, and neither, each read at the arms' own
    selected rates; the verdict states the paired interval."""
    lrs, delta = (1e-4, 3e-4, 1e-3, 3e-3), 0.02

    def verdict(otb, rloo):
        comparison = variance_lr.test_comparison(_grid(otb, rloo), 4, lrs, (0, 1, 2), (3, 4, 5, 6, 7))
        return variance_lr.verdict({4: comparison}, {4: 2.0}, delta), comparison

    text, comparison = verdict([0.6, 0.6, 0.6, 0.6, 0.5], [0.5] * 5)
    assert "**variance reduction matters**" in text and comparison["chosen"] == {"rloo": 1e-3, "otb_loo": 3e-3}
    assert "[" in text and "≥ δ in 4" in text
    assert "**RLOO better**" in verdict([0.5] * 5, [0.6, 0.6, 0.6, 0.6, 0.5])[0]
    assert "**no difference of δ" in verdict([0.51, 0.6, 0.5, 0.5, 0.4], [0.5] * 5)[0]
    assert variance_lr.decide([0.1, 0.1, 0.1], delta) == "not decided yet"
    no_contrast = variance_lr.verdict({4: verdict([0.6] * 5, [0.5] * 5)[1]}, {4: 1.2}, delta)
    assert "no variance contrast: not read as a test" in no_contrast


def test_fisher_and_two_sided_sign_flip_are_exact():
    assert variance_rule.fisher_p(3, 3, 0, 3) == pytest.approx(0.1)  # tables k = 3 and k = 0, 1/20 each
    assert variance_rule.fisher_p(1, 3, 2, 3) == pytest.approx(1.0)
    assert variance_rule.fisher_p(1, 16, 3, 11) == pytest.approx(variance_rule.fisher_p(3, 11, 1, 16))
    assert variance_lr.sign_flip_p([1.0] * 5) == pytest.approx(2 / 32)
    assert variance_lr.sign_flip_p([1.0, -1.0]) == 1.0


def test_reading_states_its_criterion_and_comes_out_either_way():
    five = {4: {"d_metric": {"diffs": [0.1] * 5}}}
    assert "**inconclusive**" in variance_lr.reading(five) and "p ≤ 0.05" in variance_lr.reading(five)
    six = {4: {"d_metric": {"diffs": [0.1] * 6}}, 16: {"d_metric": {"diffs": [-0.1] * 6}}}
    assert "**otb_loo better at N = 4; rloo better at N = 16**" in variance_lr.reading(six)


def test_selection_without_a_lone_collapse_and_window_ratios():
    """One collapsed seed of three is dropped (its cell's mean is then the others'); two of three are not."""
    runs = [_record("rloo", 4, 3e-4, s, 0.6) for s in (0, 1, 2)]
    runs += [_record("rloo", 4, 1e-3, s, 0.7) for s in (0, 2)]
    lone = _record("rloo", 4, 1e-3, 1, 0.7)
    for row in lone["rows"][5:]:
        row["reward_mean"] = 0.0  # collapsed: its final reward below half its start
    runs.append(lone)
    by_cell = variance_lr.cells(runs)
    assert variance_lr.select(by_cell, "rloo", 4, (3e-4, 1e-3), (0, 1, 2)) == 3e-4
    rate, dropped = variance_rule.selection_without_lone_collapses(by_cell, "rloo", 4, (3e-4, 1e-3), (0, 1, 2))
    assert rate == 1e-3 and dropped == [(1e-3, 1, pytest.approx(0.35))]
    for s in (0, 2):
        for row in by_cell[("rloo", 4, 1e-3)][s]["rows"][5:]:
            row["reward_mean"] = 0.0
    assert variance_rule.selection_without_lone_collapses(by_cell, "rloo", 4, (3e-4, 1e-3), (0, 1, 2)) == (3e-4, [])
    for s in (0, 1, 2):
        by_cell[("otb_loo", 4, 3e-4)] = by_cell.get(("otb_loo", 4, 3e-4), {})
        record = _record("otb_loo", 4, 3e-4, s, 0.5)
        for row in record["rows"]:
            row["update_norm"] = 0.02 if row["step"] <= 5 else 0.03
        by_cell[("otb_loo", 4, 3e-4)][s] = record
    assert variance_rule.window_ratio(by_cell, 4, 3e-4, (1, 5), (0, 1, 2)) == pytest.approx(2.0)
    assert variance_rule.window_ratio(by_cell, 4, 3e-4, (6, 10), (0, 1, 2)) == pytest.approx(3.0)
