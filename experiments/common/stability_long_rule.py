"""stability_long's arms and committed reading: read by stability_long's report and by readings.

* :data:`ARMS`, :data:`SPIKE`, :data:`MEAN_BASELINE`, :data:`OTB`; :func:`spikes` (a run's KL spikes),
  :func:`unstable`, :func:`reading` (the reading fixed before the runs).

The design in words: the docstring of ``experiments/stability_long.py``.
"""

from __future__ import annotations

import statistics

from common import collapse

ARMS = {
    "grpo_n8": ["--estimator", "grpo", "--group-size", "8"],
    "rloo_n8": ["--estimator", "rloo", "--group-size", "8"],
    "otb_n8": ["--estimator", "otb", "--group-size", "8"],
    "otb_loo_n8": ["--estimator", "otb", "--group-size", "8", "--leave-one-out"],
}
SPIKE = 10.0
MEAN_BASELINE, OTB = ("grpo_n8", "rloo_n8"), ("otb_n8", "otb_loo_n8")


def spikes(rows: list[dict]) -> int:
    """Steps whose update KL exceeds :data:`SPIKE` x the run's median KL."""
    kls = [r["approx_kl"] for r in rows if r["approx_kl"] is not None]
    median = statistics.median(kls) if kls else 0.0
    return sum(kl > SPIKE * median for kl in kls) if median > 0 else 0


def unstable(runs: dict[int, list[dict]]) -> int:
    """Runs of an arm that collapsed, plus its KL spikes summed over seeds."""
    return sum(collapse(rows)["collapsed"] for rows in runs.values()) + sum(map(spikes, runs.values()))


def reading(by_arm: dict[str, dict[int, list[dict]]]) -> str:
    """The reading fixed before the runs."""
    if not all(arm in by_arm for arm in ARMS):
        return "Reading: not computed yet (every arm is needed)."
    counts = {arm: unstable(by_arm[arm]) for arm in ARMS}
    mean_baseline, otb = sum(counts[a] for a in MEAN_BASELINE), sum(counts[a] for a in OTB)
    collapsed = sum(collapse(rows)["collapsed"] for runs in by_arm.values() for rows in runs.values())
    if collapsed == 0 and max(counts.values()) - min(counts.values()) < 2:
        word = "at a small step nothing is unstable here; with part (a), the step size is the cause"
    elif mean_baseline >= otb + 2:
        word = "the variance: OTB's arms are steadier at the same step"
    elif otb >= mean_baseline + 2:
        word = "against OTB: its arms are less steady at the same step"
    else:
        word = "mixed"
    detail = ", ".join(f"{arm} {count}" for arm, count in counts.items())
    return f"Reading: collapses + KL spikes per arm ({detail}); {collapsed} runs collapsed: {word}."
