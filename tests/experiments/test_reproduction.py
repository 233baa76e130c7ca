"""experiments/warm_start.py, snapshots.py and reproduction.py in their quick modes: outputs and invariants only."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import reproduction
import warm_start

import common
from otb_train.config import parse_config
from otb_train.data import encode_prompt
from otb_train.model import build_model_and_tokenizer, load_tokenizer
from otb_train.tasks import CharTokenizer


def test_warm_start_writes_a_checkpoint_that_train_py_loads(tmp_path):
    """The checkpoint has the built-in vocabulary's ids, its record covers every evaluation, and the stopping
    rule holds: it stops at the first evaluation at or above the target, or after --steps."""
    out = tmp_path / "warm"
    record = warm_start.main(
        [
            "--out",
            str(out),
            "--copy-lengths",
            "2",
            "3",
            "--hidden-size",
            "32",
            "--steps",
            "12",
            "--eval-every",
            "4",
            "--eval-prompts",
            "8",
            "--target-reward",
            "0.99",
        ]
    )
    tokenizer = load_tokenizer(str(out))
    assert encode_prompt(tokenizer, "12 =") == CharTokenizer().encode("12 =")
    cfg = parse_config(["--model", str(out)])
    lm, _, eos, pad = build_model_and_tokenizer(cfg)
    assert eos == [1] and pad == 0 and lm.config.vocab_size == len(CharTokenizer())
    rewards = [e["sampled_reward"] for e in record["evaluations"]]
    assert all(0 <= r <= 1 for r in rewards) and len(record["loss"]) == record["steps_run"]
    assert all(r < 0.99 for r in rewards[:-1])
    assert record["steps_run"] == 12 or rewards[-1] >= 0.99
    saved = json.loads((out / "warm_start.json").read_text())
    assert saved["evaluations"] == record["evaluations"]


def test_reproduction_quick_records_every_arm_resumes_and_reports(tmp_path):
    """Quick mode: one compact record per arm, equal steps; a second call runs nothing (resume) and reports."""
    out = tmp_path / "out"
    report = reproduction.main(["--quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(out)])
    text = report.read_text()
    assert all(f"| {arm} | 1 | 2 |" in text for arm in reproduction.ARMS) and "Verdict" in text and "Machine:" in text
    assert (out / "reproduction.png").read_bytes()[:4] == b"\x89PNG"
    for arm in reproduction.ARMS:
        record = json.loads((out / "reproduction" / f"{arm}_seed0.json").read_text())
        assert record["columns"] == common.RECORD_COLUMNS and [row[0] for row in record["steps"]] == [1, 2]
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "reproduction").iterdir()}
    reproduction.main(["--quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(out)])
    assert {p.name: p.stat().st_mtime_ns for p in (out / "reproduction").iterdir()} == stamps


def _rows(rewards: list[float], tokens_per_step: int) -> list[dict]:
    return [
        {"step": i + 1, "tokens": (i + 1) * tokens_per_step, "generated_tokens": tokens_per_step, "reward_mean": r}
        for i, r in enumerate(rewards)
    ]


def _records(otb_rise: int, reinforce_rise: int) -> dict:
    """Synthetic arms: reward 0 then 1 from step ``rise`` on; GRPO N=32 (8x the tokens a step) rises at step 100."""
    steps = 200
    curve = lambda rise: [0.0] * rise + [1.0] * (steps - rise)  # noqa: E731
    seeds = range(5)
    return {
        "grpo_n32": {s: _rows(curve(100), 8000) for s in seeds},
        "otb_n4": {s: _rows(curve(otb_rise), 1000) for s in seeds},
        "grpo_n4": {s: _rows(curve(150), 1000) for s in seeds},
        "reinforce_n4": {s: _rows(curve(reinforce_rise), 1000) for s in seeds},
    }


def test_verdict_rule_can_fail_and_can_pass():
    """The rule's outcomes on synthetic records (rises at step k; 200 = never): OTB reaches GRPO N=32's level and
    the no-baseline control never does (reproduced); both do (not attributable to OTB); OTB never does, so a run
    cut off at fewer tokens than the reference is no saving (not reproduced)."""
    verdict = lambda otb, control: reproduction.verdict(reproduction.analyse(_records(otb, control)))  # noqa: E731
    assert "**reproduced**" in verdict(100, 200)
    assert "not attributable to OTB" in verdict(100, 100)
    assert "**not reproduced**" in verdict(200, 200)
