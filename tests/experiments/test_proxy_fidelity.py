"""experiments/proxy_fidelity.py --quick: the report's structure and the invariants of F6, never the verdict."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import proxy_fidelity


def test_quick_run_writes_the_report_and_respects_f6(tmp_path, snapshots_dir):
    records = proxy_fidelity.main(["--quick", "--out-dir", str(tmp_path), "--snapshots-dir", str(snapshots_dir)])

    report = (tmp_path / "proxy_fidelity.md").read_text()
    for figure in ("tokens", "sequences", "normalized"):
        assert (tmp_path / f"proxy_fidelity_{figure}.png").stat().st_size > 0
        assert f"proxy_fidelity_{figure}.png" in report
    assert "## What this shows" in report
    assert list(records) == list(proxy_fidelity.SNAPSHOTS)
    saved = json.loads((tmp_path / "proxy_fidelity_records.json").read_text())  # the numbers behind the figures
    assert list(saved["snapshots"]) == list(records)
    for name, record in records.items():
        assert saved["snapshots"][name]["token"]["pearson"] == pytest.approx(record["token"]["pearson"], rel=1e-5)
        assert len(saved["snapshots"][name]["arrays"]["W"]) == record["responses"]
    for name, record in records.items():
        assert sum(line.startswith(f"| {name} |") for line in report.splitlines()) == 4  # policy + 3 tables
        for kind in ("token", "sequence", "normalized"):
            fit = record[kind]
            for key in ("pearson", "spearman"):
                assert -1.0 - 1e-12 <= fit[key] <= 1.0 + 1e-12, (name, kind, key)
            assert fit["c"] > 0 and math.isfinite(fit["residual"])
        for key in ("pearson", "spearman"):
            value = record["position"][key]
            assert math.isnan(value) or -1.0 - 1e-12 <= value <= 1.0 + 1e-12

        arrays = record["arrays"]
        mask = arrays["mask"]
        assert mask.any(axis=1).all()  # every response has at least one token
        w, W = arrays["w"][mask], arrays["W"]
        assert (w >= 0).all() and (w <= 2).all()  # F6: ||e_y - pi||² in [0, 2]
        assert (np.diff(W, axis=1)[mask[:, 1:]] >= 0).all()  # W_t nondecreasing along each response
        assert np.allclose(W[mask], np.cumsum(arrays["w"], axis=1)[mask])
        assert (arrays["S_t"][mask] >= 0).all() and (arrays["S"] >= 0).all()
        last = arrays["S_t"][np.arange(len(arrays["last"])), arrays["last"]]
        assert np.allclose(last, arrays["S"], rtol=1e-5)  # ||S_t||² at the last token is ||S||²
