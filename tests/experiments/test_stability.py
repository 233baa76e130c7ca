"""experiments/stability.py --quick: its report and invariants, never the verdict."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import stability  # noqa: E402


def test_stability_quick_reports_every_estimator(tmp_path):
    report = stability.main(["--quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out")])
    text = report.read_text()
    for name in stability.ARMS:
        assert f"| {name} | 1 |" in text
    summary = json.loads((tmp_path / "out" / "stability.json").read_text())
    for runs in summary.values():
        (run,) = runs
        assert run["grad_norm_max"] >= run["grad_norm_median"] >= 0 and run["grad_norm_spikes"] >= 0
        assert run["collapsed"] == (run["final_reward"] < 0.5 * run["start_reward"])
    assert (tmp_path / "out" / "stability.png").read_bytes()[:4] == b"\x89PNG"
