"""experiments/warm_start.py, snapshots.py and reproduction.py in their quick modes: outputs and invariants only."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import reproduction  # noqa: E402
import warm_start  # noqa: E402

import train  # noqa: E402
from otb_ref.tasks import CharTokenizer  # noqa: E402


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
    tokenizer = train.load_tokenizer(str(out))
    assert train.encode_prompt(tokenizer, "12 =") == CharTokenizer().encode("12 =")
    cfg = train.parse_config(["--model", str(out)])
    lm, _, eos, pad = train.build_model_and_tokenizer(cfg)
    assert eos == [1] and pad == 0 and lm.config.vocab_size == len(CharTokenizer())
    rewards = [e["sampled_reward"] for e in record["evaluations"]]
    assert all(0 <= r <= 1 for r in rewards) and len(record["loss"]) == record["steps_run"]
    assert all(r < 0.99 for r in rewards[:-1])
    assert record["steps_run"] == 12 or rewards[-1] >= 0.99
    saved = json.loads((out / "warm_start.json").read_text())
    assert saved["evaluations"] == record["evaluations"]


def test_reproduction_quick_writes_its_report_and_stops_every_run_at_the_budget(tmp_path):
    report = reproduction.main(["--quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out")])
    text = report.read_text()
    assert "| grpo_n4 | 1 |" in text and "| otb_n4 | 1 |" in text and "Verdict" in text and "Machine:" in text
    assert (tmp_path / "out" / "reproduction.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "out" / "reproduction.json").read_text())
    for arm in ("grpo_n4", "otb_n4"):
        (run,) = summary[arm]
        assert 0 <= run["final_reward"] <= 1 and 0 <= run["peak_reward"] <= 1 and run["grad_norm_spikes"] >= 0
        records = [json.loads(line) for line in (tmp_path / "runs" / f"{arm}_seed0" / "metrics.jsonl").open()]
        assert records[-1]["tokens"] >= 400 > records[-2]["tokens"]  # --token-budget 400
    torch.testing.assert_close(
        reproduction.smoothed(
            [
                {"tokens": 10, "reward_mean": 1.0, "generated_tokens": 10},
                {"tokens": 40, "reward_mean": 0.0, "generated_tokens": 30},
            ],
            35,  # both steps lie within the window: (1 x 10 + 0 x 30) / 40
        )[1][1],
        0.25,
    )
