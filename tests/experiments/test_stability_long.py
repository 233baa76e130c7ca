"""experiments/stability_long.py --quick: its warm-start summary, records, report and reading rule (never the
verdict)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import stability_long


def test_stability_long_quick_records_and_reports_every_arm(tmp_path):
    out = tmp_path / "out"
    report = stability_long.main(["--quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(out)])
    text = report.read_text()
    for name in stability_long.ARMS:
        assert f"| {name} | 1 |" in text
        record = json.loads((out / "stability_long" / f"{name}_seed0.json").read_text())
        assert [row[0] for row in record["steps"]] == [1, 2] and "--epochs" in record["flags"]
    assert json.loads((out / "stability_long_warm_start.json").read_text())["steps_run"] >= 1
    assert "warm start: " in text and "Reading:" in text
    assert (out / "stability_long.png").read_bytes()[:4] == b"\x89PNG"


def _rows(rewards, kls):
    return [{"step": i + 1, "reward_mean": r, "approx_kl": k} for i, (r, k) in enumerate(zip(rewards, kls))]


def test_spikes_and_the_reading_rule():
    """A spike is a step's KL above 10x the run's median; the reading compares the mean-baseline and OTB arms."""
    calm, spiky = [1e-4] * 20, [1e-4] * 18 + [5e-3, 5e-3]
    assert stability_long.spikes(_rows([0.1] * 20, calm)) == 0 and stability_long.spikes(_rows([0.1] * 20, spiky)) == 2
    steady = {seed: _rows([0.1] * 20, calm) for seed in range(3)}
    shaky = {seed: _rows([0.1] * 20, spiky) for seed in range(3)}

    def arms(mean_baseline, otb):
        return {"grpo_n8": mean_baseline, "rloo_n8": mean_baseline, "otb_n8": otb, "otb_loo_n8": otb}

    assert "the step size is the cause" in stability_long.reading(arms(steady, steady))
    assert "the variance" in stability_long.reading(arms(shaky, steady))
    assert "against OTB" in stability_long.reading(arms(steady, shaky))
    assert "not computed yet" in stability_long.reading({"grpo_n8": steady})
