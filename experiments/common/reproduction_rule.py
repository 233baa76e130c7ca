"""reproduction's committed design and verdict analysis: read by reproduction's report and by readings.

* Design: :data:`TASK`, :data:`STEPS`, :data:`WINDOW_TOKENS`, :data:`PLATEAU_STEPS`, :data:`DELTA`.
* Analysis: :func:`smoothed` (the trailing curve), :func:`step_mean`, :func:`window`, :func:`reference_level` (τ),
  :func:`tokens_to` (T), :func:`saving_interval` (the saving and its bootstrap interval), :func:`analyse` (every
  number the verdict uses), :func:`saving_text`.

The design in words: the docstring of ``experiments/reproduction.py``.
"""

from __future__ import annotations

import math
import random
import statistics

TASK = ["--task", "copy_exact", "--copy-lengths", "64", "80", "--max-new-tokens", "96"]
STEPS = 200
WINDOW_TOKENS = 20_000
PLATEAU_STEPS = 40
DELTA = 0.02


def smoothed(rows: list[dict], window: int) -> list[tuple[int, float]]:
    """(tokens, mean reward of the responses generated in the last ``window`` tokens) after every step."""
    points = []
    for i, row in enumerate(rows):
        total, weight = 0.0, 0
        for earlier in reversed(rows[: i + 1]):
            if weight and row["tokens"] - earlier["tokens"] >= window:
                break
            total += earlier["reward_mean"] * earlier["generated_tokens"]
            weight += earlier["generated_tokens"]
        points.append((row["tokens"], total / weight))
    return points


def step_mean(rows: list[dict]) -> float:
    """Mean reward per response over ``rows`` (weighted by generated tokens, as the curves are)."""
    return sum(r["reward_mean"] * r["generated_tokens"] for r in rows) / sum(r["generated_tokens"] for r in rows)


def window(rows: list[dict]) -> int:
    """PLATEAU_STEPS, or half the run when it is shorter than two windows (--quick)."""
    return min(PLATEAU_STEPS, max(1, len(rows) // 2))


def reference_level(runs: dict[int, list[dict]]) -> dict:
    """τ (mean over seeds of the last PLATEAU_STEPS steps) and whether the reference had plateaued."""
    last = [step_mean(rows[-window(rows) :]) for rows in runs.values()]
    before = [step_mean(rows[-2 * window(rows) : -window(rows)]) for rows in runs.values()]
    tau, gain = statistics.mean(last), statistics.mean(last) - statistics.mean(before)
    return {"tau": tau, "gain_last_window": gain, "plateau": gain < DELTA}


def tokens_to(rows: list[dict], level: float) -> tuple[int, bool]:
    """(generated tokens when the trailing curve first reaches ``level``, reached?); censored at the last step."""
    for tokens, reward in smoothed(rows, WINDOW_TOKENS):
        if reward >= level:
            return tokens, True
    return rows[-1]["tokens"], False


def saving_interval(ours: list[int], reference: list[int], draws: int = 10_000) -> tuple[float, float, float]:
    """``1 − mean(ours) / mean(reference)`` and its 95% bootstrap interval (seeds resampled per arm)."""
    rng = random.Random(0)
    point = 1 - statistics.mean(ours) / statistics.mean(reference)
    samples = sorted(
        1 - statistics.mean(rng.choices(ours, k=len(ours))) / statistics.mean(rng.choices(reference, k=len(reference)))
        for _ in range(draws)
    )
    return point, samples[int(0.025 * draws)], samples[int(0.975 * draws) - 1]


def analyse(by_arm: dict[str, dict[int, list[dict]]]) -> dict:
    """Every number the verdict uses, from the records."""
    level = reference_level(by_arm["grpo_n32"])
    target = level["tau"] - DELTA
    hits = {arm: {seed: tokens_to(rows, target) for seed, rows in runs.items()} for arm, runs in by_arm.items()}
    # Censoring, conservatively: a reference run that never reaches the target counts its last token count (a lower
    # bound on its T, so the saving is understated); another arm's unreached run counts as never (T = inf).
    reference = [tokens for tokens, _ in hits["grpo_n32"].values()]
    savings = {
        arm: saving_interval([tokens if reached else math.inf for tokens, reached in arm_hits.values()], reference)
        for arm, arm_hits in hits.items()
        if arm != "grpo_n32"
    }
    return {**level, "target": target, "hits": hits, "savings": savings}


def saving_text(point: float, low: float, high: float) -> str:
    """``0.85 [0.80, 0.90]``; −∞ (a resampled run that never reached the target) printed as ``−inf``."""
    show = lambda x: f"{x:.2f}" if math.isfinite(x) else "−inf"  # noqa: E731
    return f"{show(point)} [{show(low)}, {show(high)}]"
