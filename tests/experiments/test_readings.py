"""experiments/readings.py on the committed records: it reproduces results/readings.json, the facts the docs rest
on hold, and docs/RESULTS.md, the README and the later readings of results/ quote its numbers (about 10-20 s)."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import readings

RESULTS_MD = (ROOT / "docs" / "RESULTS.md").read_text()
README = (ROOT / "README.md").read_text()
LATER = {name: (ROOT / "results" / f"{name}.md").read_text().split("## Later reading")[-1]
         for name in ("stability", "stability_long")}  # fmt: skip


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("readings")
    return json.loads(json.dumps(readings.main(["--out-dir", str(out)])))


def test_permutation_p_enumerates_every_split():
    assert readings.permutation_p([0, 0, 0], [1, 1, 1]) == pytest.approx(2 / 20)  # the two extreme splits
    assert readings.permutation_p([0, 1], [2, 3]) == pytest.approx(2 / 6)
    assert readings.permutation_p([1, 2], [2, 1]) == 1.0


def test_sign_flip_p_enumerates_every_sign():
    assert readings.sign_flip_p([1, 1, 1]) == pytest.approx(2 / 8)  # all plus and all minus
    assert readings.sign_flip_p([2, 1]) == pytest.approx(2 / 4)
    assert readings.sign_flip_p([1, -1]) == 1.0
    assert readings.sign_flip_p([1.0] * 5) == pytest.approx(2 / 32)  # the smallest p at n = 5


def test_variance_lr_reading_is_inconclusive_and_quoted(fresh):
    """The committed rule's words, the test seeds' intervals and p, as RESULTS.md and the README quote them; no
    comparison separable by the sign-flip test (p > 0.05 at both N)."""
    v = fresh["variance_lr"]
    assert v["4"]["rule"] == "variance reduction matters" and v["16"]["rule"].startswith("no difference")
    for n, quoted in (("4", "N = 4 "), ("16", "N = 16 ")):
        mean, low, high = v[n]["d_metric_interval"]
        text = f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]".replace("-", "−")
        assert v[n]["sign_flip_p"] > 0.05
        assert f"{quoted}{text}, sign-flip p = {v[n]['sign_flip_p']:.3f}" in RESULTS_MD
        assert f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]".replace("-", "−") in README


def test_the_committed_record_is_what_the_command_writes(fresh):
    committed = json.loads((ROOT / "results" / "readings.json").read_text())
    assert {k: v for k, v in fresh.items() if k != "command"} == {k: v for k, v in committed.items() if k != "command"}


def test_the_facts_the_docs_rest_on(fresh):
    long, short, repro = fresh["stability_long"], fresh["stability"], fresh["reproduction"]
    assert "against OTB" in long["committed_reading"] and long["collapsed_runs"] == 0
    assert long["spikes_own_median"] == {"grpo_n8": [4, 4, 6], "rloo_n8": [1, 4, 5], "otb_n8": [4, 6, 8],
                                         "otb_loo_n8": [5, 5, 2]}  # fmt: skip
    assert long["every_run_spikes_at_step_1"] and long["step_1_same_in_every_arm"]
    assert long["spikes_own_median_p"] > 0.05 and long["spikes_shared_threshold_p"] > 0.05  # inconclusive
    assert short["runs_largest_update_at_step_1"] == short["runs"] == short["collapsed_runs"] == 15
    assert all(reached == 5 for arm, reached in repro["reached"].items() if arm in ("otb_n4", "reinforce_n4"))
    assert repro["saving_if_reached_at_last_step"][1] > 0.65 and repro["saving_at_token_cap"][1] > 0.65
    assert fresh["parameters"] == {"64": 125376, "128": 496512}


def _span(values) -> str:
    return f"{min(values)}–{max(values)}"


def test_the_docs_quote_the_readings(fresh):
    long, short, repro = fresh["stability_long"], fresh["stability"], fresh["reproduction"]
    ratio, own, shared = long["kl_ratio_otb_to_grpo"], long["spikes_own_median"], long["spikes_shared_threshold"]
    runs = lambda counts, arms: ", ".join(str(c) for arm in arms for c in counts[arm])  # noqa: E731
    threshold = re.sub(r"e-0(\d)", r"e-\1", f"{long['shared_threshold']:.1e}")
    stability_long = [
        f"{ratio['mean_of_run_medians']:.2f}× GRPO's", f"{min(ratio.values()):.2f}–{max(ratio.values()):.2f}×",
        f"{long['kl_ratio_otb_arms_to_mean_baseline_arms']:.2f}×",
        runs(own, ("grpo_n8", "rloo_n8")), runs(own, ("otb_n8", "otb_loo_n8")),
        f"p = {long['spikes_own_median_p']:.2f}", f": {threshold})",
        f"{sum(map(sum, (shared[a] for a in ('grpo_n8', 'rloo_n8'))))} vs "
        f"{sum(map(sum, (shared[a] for a in ('otb_n8', 'otb_loo_n8'))))} (p = {long['spikes_shared_threshold_p']:.2f})",
        f"{long['step_1_reward']['otb_n8']:.3f}", f"p = {long['end_reward_p']:.3f}",
        *[f"{long['start_reward'][a]:.3f} → {long['end_reward'][a]:.3f}" for a in long["start_reward"]],
    ]  # fmt: skip
    stability = [
        f"{short['runs_largest_update_at_step_1']} of {short['runs']} runs",
        "–".join(f"{v:.2f}" for v in short["step_1_update_norm_range"]),
        "–".join(f"{v:.2f}" for v in short["step_1_grad_norm_range"]),
        f"{short['runs_largest_grad_norm_at_step_1']} of {short['runs']} runs",
        *[_span(short["zero_reward_from_step"][arm]) for arm in ("grpo_n8", "grpo_n32", "otb_n8", "otb_n32")],
        f"p = {short['zero_reward_from_step_p']['grpo_n8 vs grpo_n32']:.2f}",
    ]
    point, low, high = repro["saving_if_reached_at_last_step"]
    reproduction = [
        f"{repro['most_tokens_of_an_n4_run']:,}", f"{point:.3f} [{low:.3f}, {high:.3f}]", f"{repro['n4_token_cap']:,}",
        "{:.2f} [{:.2f}, {:.2f}]".format(*repro["saving_at_token_cap"]),
        "{:.2f} [{:.2f}, {:.2f}]".format(*repro["savings"]["otb_n4"]),
        "{:.2f} [{:.2f}, {:.2f}]".format(*repro["savings"]["reinforce_n4"]),
    ]  # fmt: skip
    seconds = [f"{t['seconds']} s of runs" for t in fresh["run_seconds"].values()]
    parameters = [f"{n:,}" for n in fresh["parameters"].values()]
    missing = [q for q in stability_long + stability + reproduction + seconds + parameters if q not in RESULTS_MD]
    assert not missing, f"docs/RESULTS.md does not quote {missing}"
    readme = [f"p = {long['spikes_own_median_p']:.2f}", *parameters, *reproduction[-2:]]
    assert not [q for q in readme if q not in README]
    assert not [q for q in stability_long[:7] if q not in LATER["stability_long"]]
    assert not [q for q in stability[:4] if q not in LATER["stability"]]


@pytest.mark.parametrize("path", ["README.md", "docs/RESULTS.md", "docs/EXPERIMENTS.md", "results/stability.md"])
def test_no_stale_parameter_count_or_ratio(path):
    text = (ROOT / path).read_text()
    assert not [stale for stale in ("0.1–0.4M", "~125k", "about half of GRPO") if stale in text]
