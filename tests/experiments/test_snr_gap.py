"""experiments/snr_gap.py --quick: one record per setting with every estimator's SNR at every N, resume, report."""

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import snr_gap


def test_snr_gap_quick_records_resumes_and_reports(tmp_path):
    out = tmp_path / "out"
    report = snr_gap.main(["--quick", "--warm-dir", str(tmp_path / "runs"), "--out-dir", str(out)])
    record = json.loads((out / "snr_gap" / "quick.json").read_text())
    assert record["estimators"] == list(snr_gap.ESTIMATORS) and record["group_sizes"] == [2, 4]
    assert all(len(row) == 2 and all(math.isfinite(v) for v in row) for row in record["snr"])
    assert "| quick |" in report.read_text()
    rloo, top = record["estimators"].index("rloo"), len(record["group_sizes"]) - 1
    assert record["cosine"][rloo][top] == 1.0  # ∇J is RLOO's mean at the largest N
    assert record["mse_rel"][rloo][top] >= 0 and all(len(row) == 2 for row in record["snr_par"])
    assert all(lo <= hi for row in record["cosine_90"] for lo, hi in row)
    assert "n_star_par" in record and record["reference_noise"] >= 0
    assert len(record["code"]["commit"]) == 40 and isinstance(record["code"]["clean"], bool)
    assert "**quick**: N*∥" in report.read_text() and "| otb | SNR∥ |" in report.read_text()
    stamp = (out / "snr_gap" / "quick.json").stat().st_mtime_ns
    snr_gap.main(["--quick", "--warm-dir", str(tmp_path / "runs"), "--out-dir", str(out)])
    assert (out / "snr_gap" / "quick.json").stat().st_mtime_ns == stamp
