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


# ----------------------------------------------------------------------------- issue 38: the numbers quoted, parsed

SIGNED = r"[+−-]?\d+\.\d+"


def _section(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def _variance_lr_texts() -> dict[str, str]:
    row = next(line for line in RESULTS_MD.splitlines() if line.startswith("| Lower variance itself buys"))
    return {
        # up to the step-matched test, whose numbers tests/experiments/test_equal_rate.py checks
        "RESULTS.md": row + _section(RESULTS_MD, "- **Variance at each estimator's best", "  - **Step-matched test**"),
        "README.md": _section(README, "- **Variance vs step size**", "- **Variance at equal step size**"),
    }


def _signed(value: float, digits: int) -> set[str]:
    """The ways a doc may write ``value``: with or without its sign, ASCII or typographic minus."""
    text = f"{value:+.{digits}f}"
    return {text, text.replace("-", "−"), text.lstrip("+"), text.lstrip("+-")}


def _recomputed(fresh) -> dict[str, set[str]]:
    """Every number the variance_lr passages may quote, by kind, from the records (through readings.py)."""
    v, dep = fresh["variance_lr"], fresh["variance_lr_dependence"]
    three, p_values, counts = set(), {"0.05", "0.0625", "0.25"}, set()
    for n in ("4", "16"):
        three |= {x for d in v[n]["d_metric"] for x in _signed(d, 3)}
        three |= {x for d in v[n]["d_metric_interval"] for x in _signed(d, 3)}
        p_values.add(f"{v[n]['sign_flip_p']:.3f}")
        test = dep["per_n"][n]["test"]
        three |= {x for key in ("mean", "low", "high") for x in _signed(test["calm"][key], 3)}
        three |= {x for ms in dep["per_n"][n]["selection_metric_at_1e-3"].values() for m in ms.values()
                  for x in _signed(m, 3)}  # fmt: skip
        for sign in (1, -1):
            k = sum(sign * d >= 0.0104 for d in v[n]["d_metric"])
            counts.add(f"{k} of {len(v[n]['d_metric'])}")
    collapses = dep["collapses_at_1e-3"]
    p_values.add(f"{collapses['fisher_p']:.2f}")
    counts |= {f"{collapses[arm][0]} of {collapses[arm][1]}" for arm in ("otb_loo", "rloo")}
    pairs = dep["equal_rate_pairs"]
    selection = [p for p in pairs if not p[5]]
    counts |= {f"{sum(p[3] > 0 for p in ps)} of {len(ps)}" for ps in (selection, pairs)}
    three |= {x for p in pairs if p[4] for x in _signed(p[3], 3)}
    return {"three": three, "p": p_values, "counts": counts}


def test_variance_lr_numbers_quoted_are_recomputed_from_the_records(fresh):
    """Every 3-decimal number, p value and "k of n" count of the variance_lr passages of RESULTS.md and the README
    is one recomputed from the committed records (stale or hand-made numbers fail); the key ones are present."""
    allowed = _recomputed(fresh)
    for name, text in _variance_lr_texts().items():
        numbers = re.findall(r"(?<![\d.])[+−-]?\d\.\d{3}(?![\d×])", text)
        assert not [x for x in numbers if x not in allowed["three"] | allowed["p"]], name
        p_values = re.findall(r"p (?:=|≤) (\d\.\d+)", text)
        assert p_values and not [x for x in p_values if x not in allowed["p"]], name
        counts = re.findall(r"\b(\d+ of \d+)\b", text)
        assert not [x for x in counts if x not in allowed["counts"]], name
    dep = fresh["variance_lr_dependence"]
    results = _variance_lr_texts()["RESULTS.md"]
    for quoted in ("−0.007", "+0.160 [+0.152, +0.167]", "M = 0.183", "p = 0.27", "18 of 18", "22 of 23", "1 of 16"):
        assert quoted in results
    assert f"{dep['per_n']['16']['test']['calm']['mean']:+.3f}".replace("-", "−") == "−0.007"
    assert dep["per_n"]["4"]["chosen_without_lone_collapses"] == {"rloo": 0.001, "otb_loo": 0.001}
    assert dep["per_n"]["4"]["chosen"] == {"rloo": 0.0003, "otb_loo": 0.001}
    assert dep["per_n"]["16"]["test"]["collapsed"] == {"rloo": [5, 7], "otb_loo": []}


def test_update_size_ratio_table_is_the_records(fresh):
    """The per-window table of RESULTS.md, parsed row by row, against the ratios recomputed from the records."""
    windows = fresh["variance_lr_dependence"]["windows"]
    rows = re.findall(r"^ *\| (4|16) \| (1e-4|3e-4|1e-3) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      RESULTS_MD, flags=re.M)  # fmt: skip
    assert len(rows) == 6
    for n, lr, *quoted in rows:
        values = windows[f"{n} {float(lr):g}"]
        assert quoted == [f"{values[w]:.2f}" for w in ("1-150", "11-150", "11-50", "51-150")]


def test_pilot_and_stability_numbers_quoted(fresh):
    pilot, short = fresh["variance_lr_pilot"], fresh["stability"]
    for key in ("otb_over_grpo", "otb_over_rloo"):
        values = pilot[key]
        assert f"{min(values):.1f}–{max(values):.1f}×" in RESULTS_MD
    assert f"{pilot['contrast_pilot']:.2f} at\n  N = 4 as a ratio of seed means" in RESULTS_MD
    assert f"but {pilot['contrast_snr_gap']:.2f}, below the 1.5 label" in RESULTS_MD
    assert pilot["contrast_snr_gap"] < 1.5 <= pilot["contrast_pilot"]
    steps = short["zero_reward_from_step"]
    quoted = f"steps {', '.join(map(str, steps['otb_n32']))} against {', '.join(map(str, steps['otb_n8']))}"
    assert quoted in RESULTS_MD.replace("\n    ", " ")
