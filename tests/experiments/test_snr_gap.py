"""experiments/snr_gap.py --quick: one record per setting with every estimator's SNR at every N, resume, report."""

import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import pytest
import snr_gap
import torch


@pytest.fixture
def tiny_sample():
    """A 1-layer random-init Qwen2 and 2 prompts x 4 sampled responses of the graded copy task."""
    import gradient_variance

    from otb_train.config import Config
    from otb_train.model import build_model_and_tokenizer
    from otb_train.tasks import synthetic_problem

    torch.manual_seed(0)
    lm, *_ = build_model_and_tokenizer(Config(hidden_size=32, num_layers=1))
    lm.eval()
    problems = [synthetic_problem("copy", 0, i, copy_lengths=(2, 3)) for i in range(2)]
    sample = gradient_variance.sample_batch(lm, problems, 4, 1, 5, 0, "copy")
    scores = torch.rand(len(sample.mask), generator=torch.Generator().manual_seed(1))
    lengths = sample.mask.sum(dim=1)
    sample.rewards = torch.zeros(sample.mask.shape).scatter_(1, (lengths - 1)[:, None], scores[:, None])
    return lm, sample


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


def test_factor_runs_record_what_they_changed_and_report_beside_their_setting(tmp_path):
    out, warm = tmp_path / "out", tmp_path / "warm"
    report = snr_gap.main(["--quick", "--warm-dir", str(warm), "--out-dir", str(out), "--factors", "all"])
    text = report.read_text()
    for name, (base, options) in snr_gap.QUICK_FACTORS.items():
        record = json.loads((out / "snr_gap_factors" / f"{name}.json").read_text())
        assert record["factor"] == options and math.isfinite(record["n_star_par"])
        assert f"| {name} | {base} | {json.dumps(options)} |" in text
    assert "| quick | quick | nothing (the setting) |" in text
    assert (warm / "quick_warm_seed1" / "config.json").exists()  # a recipe factor trains its own warm start
    base = json.loads((out / "snr_gap" / "quick.json").read_text())["snr"]
    for name in snr_gap.QUICK_FACTORS:  # each factor changes the gradients (fresh prompts, scale, reward, model)
        assert json.loads((out / "snr_gap_factors" / f"{name}.json").read_text())["snr"] != base, name
    with pytest.raises(SystemExit):
        snr_gap.main(["--quick", "--warm-dir", str(warm), "--out-dir", str(out), "--factors", "nope"])


def test_per_response_normalisation_is_the_token_mean_rescaled(tiny_sample):
    lm, sample = tiny_sample
    token_mean = snr_gap.batch_gradients(lm, sample, (2, 4))
    per_response = snr_gap.batch_gradients(lm, sample, (2, 4), per_response=True)
    groups = len(sample.mask) // sample.group_size
    for k, n in enumerate((2, 4)):
        rows = [g * sample.group_size + i for g in range(groups) for i in range(n)]
        tokens = float(sample.mask[rows].sum())
        torch.testing.assert_close(per_response[:, k] * len(rows), token_mean[:, k] * tokens)


def test_prefix_reward_scores_a_response_that_begins_with_the_answer(tiny_sample):
    from otb_train.tasks import CharTokenizer, Problem

    _, sample = tiny_sample
    tokenizer, lengths = CharTokenizer(), sample.mask.sum(dim=1)
    texts = [tokenizer.decode(r[: int(n)].tolist()) for r, n in zip(sample.sequences[:, sample.num_prompt :], lengths)]
    # answers: the first character of each group's first non-empty response, so that some response begins with its
    # answer without being it (the case that separates this reward from copy_exact)
    groups = [texts[g : g + sample.group_size] for g in range(0, len(texts), sample.group_size)]
    answers = [next(t for t in group if t)[0] for group in groups]
    snr_gap.rescore_prefix(sample, [Problem("", a) for a in answers])
    expected = [float(t.startswith(a)) for group, a in zip(groups, answers) for t in group]
    assert sample.rewards.sum(dim=1).tolist() == expected
    assert any(t.startswith(a) and t != a for group, a in zip(groups, answers) for t in group)
    assert all(sample.rewards[i, int(n) - 1] == v for i, (n, v) in enumerate(zip(lengths, expected)))


def _quoted(text: str, marker: str, label: str) -> list[str]:
    """The first ``label = x [a, b]`` after ``marker`` in ``text``, as the printed strings."""
    match = re.search(re.escape(label) + r" = ([0-9.]+) \[([0-9.]+), ([0-9.]+)\]", text[text.index(marker) :])
    return list(match.groups())


def _close(printed: str, value: float) -> bool:
    """``printed`` is ``value`` rounded to the digits it shows."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(float(printed) - value) <= 0.5 * 10**-decimals + 1e-12


def test_results_md_quotes_the_committed_records():
    text = " ".join((ROOT / "docs" / "RESULTS.md").read_text().split())
    records = {
        p.stem: json.loads(p.read_text())
        for p in [
            *(ROOT / "results" / "snr_gap").glob("*.json"),
            *(ROOT / "results" / "snr_gap_factors").glob("*.json"),
        ]
    }
    quotes = [
        ("1–4 digits (warm start 0.50)", "copy1_4", ("n_star", "n_star_par")),
        ("7–15 digits (0.547)", "copy7_15", ("n_star", "n_star_par")),
        ("16–24 digits (0.414)", "copy16_24", ("n_star", "n_star_par")),
        ("A reward that does not require EOS", "copy7_15_prefix_reward", ("n_star", "n_star_par")),
        ("A slower warm-start recipe", "copy1_4_warm_lr1e-3", ("n_star",)),
    ]
    for marker, name, keys in quotes:
        for key in keys:
            printed = _quoted(text, marker, {"n_star": "N*", "n_star_par": "N*∥"}[key])
            values = [records[name][key], *records[name][f"{key}_90"]]
            assert all(_close(p, v) for p, v in zip(printed, values)), (name, key, printed, values)
    grpo = records["copy7_15"]["snr"][records["copy7_15"]["estimators"].index("grpo")]
    low, high = re.search(r"([0-9.]+) → ([0-9.]+) here", text).groups()
    assert _close(low, grpo[0]) and _close(high, grpo[-1])
    never = re.search(r"never reached in (\d+)% of the bootstrap draws", text).group(1)
    assert int(never) == round(100 * records["copy1_4_resampled"]["n_star_never"])
