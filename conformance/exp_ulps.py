"""How far fp32 ``exp`` implementations are from the correctly rounded value: why the vectors cannot tell whether a
port evaluates the per-token energy ``w_t`` in fp32 or fp64 (``conformance/ports/bugs/one_rule.py``, UNCHECKED).

    python conformance/exp_ulps.py    # prints one JSON line per range; conformance/records/exp_ulps.jsonl

For 200,000 fp32 log-probabilities drawn uniformly in each range, the share of NumPy's (and torch's, when
installed) fp32 ``exp`` results that differ from ``exp`` in fp64 rounded once to fp32, and the largest error in
fp32 ulps of the result.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np


def cpu() -> str:
    """The CPU's model name (Linux), else what ``platform`` says."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def measure(low: float, draws: int = 200_000, seed: int = 0) -> dict:
    log_probs = (-np.random.default_rng(seed).uniform(0.0, low, draws)).astype(np.float32)
    exact = np.exp(log_probs.astype(np.float64))
    rounded = exact.astype(np.float32)
    ulp = np.spacing(rounded).astype(np.float64)
    results = {"numpy": np.exp(log_probs)}
    try:
        import torch

        results[f"torch {torch.__version__}"] = torch.exp(torch.from_numpy(log_probs)).numpy()
    except ImportError:
        pass
    results[f"numpy {np.__version__}"] = results.pop("numpy")
    row = dict(log_prob_range=[-low, 0.0], draws=draws, cpu=cpu())
    for name, got in results.items():
        row[f"{name}: share differing"] = float(np.mean(got != rounded))
        row[f"{name}: max ulps"] = round(float(np.max(np.abs(got.astype(np.float64) - exact) / ulp)), 3)
    return row


def main() -> None:
    for low in (3e-4, 1e-2, 1.0):
        print(json.dumps(measure(low)))


if __name__ == "__main__":
    main()
