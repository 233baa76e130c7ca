"""benchmarks/gpu_train_paths.py --quick runs every code path on CPU and prints its JSON records
(no timing asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_quick_on_cpu():
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_train_paths.py"), "--quick", "--no-profile"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r for r in records if r["bench"] == "error"] == []
    paths = {r["path"]: r for r in records if r["bench"] == "generation"}
    assert set(paths) == {"old", "new_sampling", "static_eager", "static_graphs"}  # graphs: skipped on CPU
    for path in ("new_sampling", "static_eager"):
        assert paths[path]["agreement_with_old"] == 1.0 and paths[path]["tokens_per_s"] > 0  # fp32 CPU: same tokens
    check = next(r for r in records if r["bench"] == "decoder_check")
    assert check["max_abs_logit_diff"] < 1e-4
    update = [r for r in records if r["bench"] == "update"]
    assert {r["activation_checkpointing"] for r in update} == {False, True}
    assert all(r["mfu"] >= 0 and r["tokens_per_s"] > 0 for r in update)
    assert {r["top_p"] for r in records if r["bench"] == "sampling"} == {1.0, 0.9}
    (decode,) = [r for r in records if r["bench"] == "decode_breakdown"]
    parts = ("decoder_ms", "sample_float64_ms", "sample_float32_ms", "bookkeeping_ms")
    assert decode["steps"] == 6 and all(decode[k] > 0 for k in parts)


def test_train_step_benchmark_quick_on_cpu():
    """benchmarks/gpu_train_step.py --quick: train.py runs under torchrun and on checkpoints whose EOS never wins a
    draw (every response runs to the cap), and the records carry per-phase seconds; no timing asserted."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_train_step.py"), "--quick", "--variants", "micro16"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r for r in records if "error" in r] == []
    assert [r["bench"] for r in records] == ["torchrun"] + ["generation"] * 6 + ["train_step", "train_step"]
    assert records[0]["steps"] == 3 and records[0]["backend"] == "gloo"
    for record in records[1:]:  # CPU: the model's own forward by default; the drop case asks for the static decoder
        assert record["static_decode"] is (record.get("case") == "qwen05b_eos_reachable_drop")
    generation = [r for r in records if r["bench"] == "generation"]
    assert [(r["case"], r["eos_reachable"], r["drop_finished_rows"]) for r in generation] == [
        ("built_in_v64", False, False),
        ("built_in_v64", False, False),
        ("qwen05b_eos_reachable", True, False),
        ("qwen05b_eos_reachable", True, False),
        ("qwen05b_eos_reachable_drop", True, True),
        ("qwen05b_eos_reachable_drop", True, True),
    ]
    assert all(r["truncated_fraction"] == 1.0 for r in generation[:2])
    step = records[-1]
    assert set(step["seconds"]) == {"rollout", "logprobs", "advantages", "update"} and step["mfu"] >= 0


@pytest.mark.parametrize("vocab", [300, 20_000])
def test_reach_eos_gives_the_eos_probability_asked_for(vocab):
    """EOS's probability per token is the target on fresh random prompts, not only on the calibration prompts: the
    mean within 3x (responses end at mixed lengths), and the median position within 3x too (not a few outlier
    positions carrying the mean). 20,000 ids is a vocabulary far larger than the 256 calibration positions, the regime
    of V = 151,936 where an EOS row fitted to the calibration prompts' mean hidden state gave fresh prompts ~1/V."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_train_step import reach_eos

    from otb_train.tiny_models import tiny_causal_lm

    lm = tiny_causal_lm("qwen2", 0, vocab_size=vocab, hidden_size=32, intermediate_size=64, tie_word_embeddings=True)
    reported = reach_eos(lm, eos_id=7, probability=0.02)
    ids = torch.randint(0, vocab, (16, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fresh = lm(ids).logits.softmax(-1)[..., 7]
    assert 0.02 / 3 < fresh.mean().item() < 0.02 * 3 and 0.02 / 3 < fresh.median().item() < 0.02 * 3
    assert 0.02 / 3 < reported < 0.02 * 3  # what the record reports: measured on prompts it was not fitted to
