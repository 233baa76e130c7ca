"""``OTBGRPOTrainer`` through TRL's own ``trainer.train()`` on a tiny Qwen2, offline, CPU (skipped without TRL).

Install: ``pip install -e ".[trl]"``. The tiny model, data and reward are examples/trl_otb.py's.
"""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optional import import_or_skip

from otb_ref import compute_advantages, logprobs_and_sum_pi_squared

trl = import_or_skip("trl", reason="TRL not installed (pip install -e .[trl])")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from otb_ref.integrations.trl import OTBGRPOTrainer, _outcome_at_last_token  # noqa: E402

_spec = importlib.util.spec_from_file_location("trl_otb", Path(__file__).parents[3] / "examples" / "trl_otb.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _trainer(cls, tmp_path, trainer_kwargs=None, **config):
    model, tokenizer = example.tiny_model_and_tokenizer(seed=0)
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=3, learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, seed=0,
        save_strategy="no", disable_tqdm=True, temperature=0.9, bf16=False,  # fp32: exact comparisons
    )  # fmt: skip
    settings.update(config)
    return cls(
        model=model, reward_funcs=example.contains_answer, args=GRPOConfig(**settings),
        train_dataset=example.synthetic_dataset(), processing_class=tokenizer, **(trainer_kwargs or {}),
    )  # fmt: skip


def _history(trainer, key):
    return [record[key] for record in trainer.state.log_history if key in record and "train_runtime" not in record]


@pytest.mark.parametrize(
    "config",
    [{}, {"num_iterations": 2}, {"gradient_accumulation_steps": 2}],
    ids=["default", "num_iterations=2", "gradient_accumulation=2"],
)
def test_grpo_estimator_reproduces_trls_own_trainer(tmp_path, config):
    """estimator="grpo" (std scaling, TRL's ε 1e-4): the same loss and gradient norm at every step as GRPOTrainer."""
    theirs = _trainer(GRPOTrainer, tmp_path / "trl", **config)
    theirs.train()
    ours = _trainer(OTBGRPOTrainer, tmp_path / "ours", {"estimator": "grpo"}, **config)
    ours.train()
    assert len(_history(ours, "grad_norm")) == 3
    for key in ("grad_norm", "loss", "reward"):
        torch.testing.assert_close(_history(ours, key), _history(theirs, key), rtol=1e-5, atol=1e-7)
    assert any(abs(x) > 0 for x in _history(theirs, "grad_norm"))  # a step that moved, not a vacuous comparison


def _recording(trainer):
    """Wrap the instance's rollout hook: keep each output and otb_ref's own log π and Σπ² on the same weights."""
    records, inner = [], trainer._generate_and_score_completions

    def generate_and_score(inputs):
        output = inner(inputs)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        keep = output["completion_ids"].shape[1]
        with torch.no_grad():
            hidden = trainer.model.model(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
            log_probs, sum_sq = logprobs_and_sum_pi_squared(
                hidden, trainer.model.lm_head.weight, ids[:, 1:], temperature=trainer.temperature
            )
        rewards = trainer._otb_rewards_per_func.nansum(dim=1)
        records.append(dict(output=output, log_probs=log_probs[:, -keep:], sum_sq=sum_sq[:, -keep:], rewards=rewards))
        return output

    trainer._generate_and_score_completions = generate_and_score
    return records


@pytest.mark.parametrize(
    "config",
    [{}, {"num_iterations": 2}, {"gradient_accumulation_steps": 2}],
    ids=["added pass", "TRL's pass", "gradient_accumulation=2"],
)
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_otb_advantages_equal_compute_advantages_and_vary_along_t(tmp_path, config, leave_one_out):
    """The [B, T] advantages handed to the loss are compute_advantages("otb") of the rollout, with log π and Σπ²
    recomputed by otb_ref (fp32, 1e-5); they are not constant along a completion."""
    trainer = _trainer(OTBGRPOTrainer, tmp_path, {"leave_one_out": leave_one_out}, max_steps=2, **config)
    records = _recording(trainer)
    trainer.train()
    assert records
    varies = False
    for record in records:
        output = record["output"]
        mask = output["completion_mask"].float()
        want, _ = compute_advantages(
            "otb", _outcome_at_last_token(record["rewards"], mask), mask, torch.arange(len(mask)) // 4,
            old_log_probs=record["log_probs"], sum_pi_squared=record["sum_sq"], leave_one_out=leave_one_out,
        )  # fmt: skip
        got = output["advantages"]
        assert got.shape == mask.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        spread = torch.where(mask > 0, got, -math.inf).amax(1) - torch.where(mask > 0, got, math.inf).amin(1)
        varies |= bool((spread[mask.sum(1) > 1] > 1e-4).any())
    assert varies
    extra = _history(trainer, "otb/extra_pass_seconds")
    assert (len(extra) > 0) == ("num_iterations" not in config)  # no second pass where TRL runs its own


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_token_advantages_train_with_every_per_token_loss(tmp_path, loss_type):
    """TRL's other per-token losses take the [B, T] advantages: a step runs and moves the weights."""
    trainer = _trainer(OTBGRPOTrainer, tmp_path, loss_type=loss_type, max_steps=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert math.isfinite(_history(trainer, "grad_norm")[0])
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_trls_sum_pi_squared_equals_otb_refs():
    """TRL's fused LM head ``log_sum_sq_probs`` (temperature 0.7) is log of otb_ref's chunked Σπ²; same log π."""
    model, _ = example.tiny_model_and_tokenizer(seed=1)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "log_sum_sq_probs"))
    ids = torch.randint(3, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        log_probs, sum_sq = logprobs_and_sum_pi_squared(hidden, model.lm_head.weight, ids[:, 1:], temperature=0.7)
    torch.testing.assert_close(out.log_sum_sq_probs.exp(), sum_sq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_probs, log_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        ({"loss_type": "vespo"}, {}, "loss_type='vespo' assumes one advantage per sequence"),
        ({"importance_sampling_level": "sequence"}, {}, "importance_sampling_level='sequence'"),
        ({"off_policy_mask_threshold": 0.5}, {}, "off_policy_mask_threshold"),
        ({"scale_rewards": "batch"}, {}, "scale_rewards='batch'"),
        ({"multi_objective_aggregation": "normalize_then_sum"}, {}, "multi_objective_aggregation"),
        ({}, {"estimator": "eob"}, "estimator: energy 'exact' needs per-response gradient norms"),
        ({}, {"estimator": "otb_exact"}, "estimator: energy 'exact'"),
    ],
)
def test_refuses_at_construction_what_it_cannot_honour(tmp_path, config, kwargs, message):
    with pytest.raises(ValueError, match=f"OTBGRPOTrainer cannot honour this set-up: .*{message}"):
        _trainer(OTBGRPOTrainer, tmp_path, kwargs, **config)


def test_refuses_unknown_estimators_and_untested_trl_versions(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="estimator: unknown estimator 'obt'"):
        _trainer(OTBGRPOTrainer, tmp_path, {"estimator": "obt"})
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(ValueError, match=r"trl 1.17.0 is untested \(tested: 1.16.x\)"):
        _trainer(OTBGRPOTrainer, tmp_path)


def test_scale_rewards_none_turns_grpo_std_off(tmp_path):
    trainer = _trainer(OTBGRPOTrainer, tmp_path, {"estimator": "grpo"}, scale_rewards="none")
    assert not trainer.otb_estimator.std_normalize and trainer.otb_epsilon == 1e-8


def _pad(tensors, fill):
    length = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, length - t.shape[1]), value=fill) for t in tensors])


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_two_processes_with_groups_spanning_them(tmp_path, leave_one_out):
    """torchrun, 2 CPU processes (gloo), 2 completions per process and 4 per prompt: each rank's advantages are its
    rows of compute_advantages over the whole generation batch (otb_ref's own log π and Σπ²)."""
    worker = Path(__file__).with_name("trl_two_process_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker), str(tmp_path)]
    done = subprocess.run(
        [*command, "loo" if leave_one_out else "include"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert len(ranks[0]) == len(ranks[1]) >= 2
    for step in range(len(ranks[0])):
        parts = [ranks[rank][step] for rank in range(2)]
        mask = _pad([p["mask"].float() for p in parts], 0.0)
        rewards = parts[0]["rewards"]
        assert torch.equal(rewards, parts[1]["rewards"]) and len(rewards) == 4  # one group, both processes
        want, _ = compute_advantages(
            "otb", _outcome_at_last_token(rewards, mask), mask, [0, 0, 0, 0],
            old_log_probs=_pad([p["log_probs"] for p in parts], 0.0),
            sum_pi_squared=_pad([p["sum_sq"] for p in parts], 1.0), leave_one_out=leave_one_out,
        )  # fmt: skip
        for rank, part in enumerate(parts):
            length = part["mask"].shape[1]
            torch.testing.assert_close(part["advantages"], want[2 * rank : 2 * rank + 2, :length], rtol=1e-5, atol=1e-5)


def test_example_trains_a_saved_checkpoint_on_a_jsonl_file(tmp_path):
    """examples/trl_otb.py --model DIR --data FILE: the real loading path, on a checkpoint and data made here."""
    model, tokenizer = example.tiny_model_and_tokenizer(seed=2)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "say w{i} w{i + 1} answer", "answer": "w{i}"}}\n' for i in range(8)))
    command = [sys.executable, str(Path(example.__file__)), "--model", str(tmp_path / "model"), "--data", str(data),
               "--steps", "1", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"step": 1' in done.stdout
    missing = subprocess.run([*command[:4], "--data", str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2 and "--data: no such file" in missing.stderr
