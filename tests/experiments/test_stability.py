"""experiments/stability.py --quick: its records, report and reading rule, never the verdict."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import stability


def test_stability_quick_records_and_reports_every_arm(tmp_path):
    report = stability.main(["--quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out")])
    text = report.read_text()
    for name in stability.ARMS:
        assert f"| {name} | 1 |" in text
        record = json.loads((tmp_path / "out" / "stability" / f"{name}_seed0.json").read_text())
        assert [row[0] for row in record["steps"]] == [1, 2] and "--epochs" in record["flags"]
    assert "Reading:" in text and (tmp_path / "out" / "stability.png").read_bytes()[:4] == b"\x89PNG"


def _rows(rewards):
    return [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]


def test_collapse_and_the_reading_rule():
    """Collapse: the last 5 steps below half the first 5; the reading compares N = 8 with N = 32."""
    fall, keep = [0.5] * 10 + [0.0] * 10, [0.5] * 20
    assert stability.collapse(_rows(fall)) == {"start": 0.5, "end": 0.0, "collapsed": True, "zero_from": 11}
    assert not stability.collapse(_rows(keep))["collapsed"]
    runs = lambda curve: {seed: _rows(curve) for seed in range(3)}  # noqa: E731
    assert "the step size" in stability.reading({"grpo_n8": runs(fall), "grpo_n32": runs(fall)})
    assert "the variance" in stability.reading({"grpo_n8": runs(fall), "grpo_n32": runs(keep)})
    assert "nothing to explain" in stability.reading({"grpo_n8": runs(keep), "grpo_n32": runs(keep)})
