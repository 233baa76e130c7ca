"""train.py end to end on CPU: one process and torchrun with 2 gloo ranks, resume, every estimator, bad inputs.

Runs are tiny (2-4 steps, 16-64 responses of at most 8 tokens). Most runs call ``train.main`` in this
process (a process group of one) to skip the ~6 s interpreter + transformers start-up; the command-line
behaviour (exit codes, one-line errors, the progress bar, torchrun) is tested in subprocesses.
"""

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_hooks import run_train  # train.py's main, run from its file, with the tests' hooks

import otb_ref.readable
from otb_ref import ESTIMATORS
from otb_train import checkpoints, config, distributed
from otb_train.config import TOKENIZER_FILES, UserError, check_run_directory, parse_config
from otb_train.data import check_prompts, encode_prompt, problem_at
from otb_train.energies import exact_energies
from otb_train.model import load_tokenizer
from otb_train.tasks import Problem
from otb_train.tiny_models import tiny_causal_lm

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--prompts-per-step", "4", "--group-size", "4"]
# Seed 3 with 8 x 8 responses gives rewards in several groups at steps 1-2, so the
# gradients are not trivially zero (an untrained policy scores ~2% on the copy task).
SMALL = ["--prompts-per-step", "8", "--group-size", "8", "--seed", "3"]
REQUIRED_KEYS = {
    "step",
    "tokens",
    "reward_mean",
    "reward_std",
    "response_length_mean",
    "response_length_max",
    "loss",
    "grad_norm",
    "update_norm",
    "lr",
    "variance_proxy/proxy1_signal_strength",
    "variance_proxy/proxy2_total_power",
    "variance_proxy/proxy3_pure_noise",
    "time/rollout",
    "time/logprobs",
    "time/advantages",
    "time/update",
    "time/step",
    "throughput/generation_tokens_per_s",
    "throughput/update_tokens_per_s",
    "generated_tokens",
    "truncated_fraction",
    "zero_variance_group_fraction",
    "entropy",
    "entropy_renyi2",
}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(record: dict) -> dict:
    """A metrics record without wall-clock fields."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "throughput/", "memory/"))}


# train.py's processes turn FutureWarnings (transformers' and torch's deprecations) into errors: `-W` for the
# interpreter started here, and PYTHONWARNINGS for the ranks that torchrun starts (they do not inherit `-W`).
STRICT_WARNINGS = "error::FutureWarning"


def strict_env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": STRICT_WARNINGS}


def run_subprocess(
    args: list[str], torchrun: bool = False, hooks: list[str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """train.py in a new process (torchrun with 2 ranks, or python); ``hooks``: through tests/train_hooks.py."""
    launcher = (
        [sys.executable, "-W", STRICT_WARNINGS, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        if torchrun
        else [sys.executable, "-W", STRICT_WARNINGS]
    )
    return subprocess.run(
        [
            *launcher,
            *([str(ROOT / "tests" / "train_hooks.py"), *hooks, "--"] if hooks else [str(ROOT / "train.py")]),
            *args,
        ],
        cwd=ROOT,
        env=strict_env(),
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def load_params(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Model parameters of a DCP checkpoint, via DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / (checkpoint.parent.parent.name + checkpoint.name + ".pt")
    dcp_to_torch_save(str(checkpoint), str(target))
    return torch.load(target, weights_only=False)["model"]


def dumped_rows(dump: Path, step: int, world: int) -> dict[str, torch.Tensor]:
    """The dumped per-rank tensors of one step, reassembled in global row order."""
    parts = [torch.load(dump / f"step{step}_rank{rank}.pt") for rank in range(world)]
    order = torch.cat([p["rows"] for p in parts]).argsort()
    return {key: torch.cat([p[key] for p in parts])[order] for key in ("advantages", "rewards", "response_ids", "mask")}


# --------------------------------------------------------------------------- command line


def test_python_train_py_runs_and_writes_metrics_and_a_checkpoint(tmp_path):
    """`python train.py` (no torchrun) for 2 steps: progress bar, no deprecation message, metrics.jsonl, complete
    checkpoints, pruning."""
    out = run_subprocess(
        [*TINY, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "1", "--output-dir", str(tmp_path / "run")]
    )
    assert out.returncode == 0, out.stderr
    assert "train: 100%" in out.stderr  # the progress bar
    assert "deprecat" not in out.stderr.lower() + out.stdout.lower()  # nor in transformers' log
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert REQUIRED_KEYS <= set(record)
        assert record["response_length_max"] <= 8 and 1 <= record["response_length_mean"] <= 8
        # non-pad tokens of the update: 16 rows of a 5-token copy prompt ("37  =": --copy-lengths 1 4) + responses
        assert record["sequence_tokens"] == 16 * 5 + record["generated_tokens"]
    assert records[1]["tokens"] == records[0]["tokens"] + round(records[1]["response_length_mean"] * 16)
    assert checkpoints.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_00000002"
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]  # step 1 pruned
    assert json.loads((tmp_path / "run" / "config.json").read_text())["estimator"] == "otb"


def test_torchrun_two_ranks_equals_one_rank(tmp_path):
    """torchrun --nproc_per_node=2 (gloo) vs one process, same seed and global batch.

    The responses must be identical: sampling uses per-row uniforms of the global batch. Advantages,
    the loss, the gradient norm and the parameters after steps 1 and 2 agree up to float32 rounding:
    the two runs split the batch differently (8-row micro-batches on 2 ranks vs one 64-row
    micro-batch; 1 vs 2 threads), which changes summation order (~1e-7 relative). Tolerances:
    advantages 1e-5 absolute (they are O(0.3)); gradient norm 1e-5 relative; loss 1e-4 relative (a
    sum of terms of both signs); parameters 1e-2 x the step-1 learning rate (Adam moves each
    parameter by about lr x sign(g), so rounding-level differences in g move it by << lr).
    Adam's first step is scale-invariant, so a gradient-averaging bug (a factor of the world size)
    would not show in the parameters; it shows in the gradient norm and the loss, which are checked.
    """
    common = [*SMALL, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "0", "--device", "cpu"]
    two = run_subprocess(
        [
            *common,
            "--micro-batch-size",
            "8",
            "--output-dir",
            str(tmp_path / "two"),
        ],
        torchrun=True,
        hooks=["--dump", str(tmp_path / "dump2")],
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "deprecat" not in two.stderr.lower() + two.stdout.lower()  # nor in transformers' log
    run_train(
        [
            *common,
            "--micro-batch-size",
            "64",
            "--output-dir",
            str(tmp_path / "one"),
        ],
        dump=str(tmp_path / "dump1"),
    )
    one_records, two_records = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for step in (1, 2):
        one, two_ = dumped_rows(tmp_path / "dump1", step, 1), dumped_rows(tmp_path / "dump2", step, 2)
        assert torch.equal(one["response_ids"], two_["response_ids"])
        assert torch.allclose(one["rewards"], two_["rewards"], rtol=0, atol=1e-7)
        assert torch.allclose(one["advantages"], two_["advantages"], rtol=0, atol=1e-5)
        a, b = one_records[step - 1], two_records[step - 1]
        assert a["tokens"] == b["tokens"] and a["response_length_max"] == b["response_length_max"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-10)
        p1 = load_params(tmp_path / "one" / "checkpoints" / f"step_{step:08d}", tmp_path)
        p2 = load_params(tmp_path / "two" / "checkpoints" / f"step_{step:08d}", tmp_path)
        assert p1.keys() == p2.keys()
        worst = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
        assert worst <= 1e-2 * one_records[0]["lr"], worst
    assert (
        one_records[0]["grad_norm"] > 1e-3 and dumped_rows(tmp_path / "dump1", 1, 1)["advantages"].abs().max() > 0.05
    )  # not a trivial comparison
    p0 = load_params(tmp_path / "one" / "checkpoints" / "step_00000001", tmp_path)
    assert any(float((p0[k] - p1[k]).abs().max()) > 0 for k in p0)  # step 2 moved the parameters


def _bad_input_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    math_data = tmp_path / "math.jsonl"
    math_data.write_text('{"prompt": "12+30=", "answer": "42"}\n{"prompt": "What is 2+2?", "answer": "4"}\n')
    no_tokenizer = _tiny_hf_checkpoint(tmp_path / "no_tokenizer")
    for name in TOKENIZER_FILES + ("special_tokens_map.json",):
        (no_tokenizer / name).unlink(missing_ok=True)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": 4\n')
    wrong_keys = tmp_path / "keys.jsonl"
    wrong_keys.write_text('{"question": "1+1?", "answer": "2"}\n')
    (tmp_path / "empty_dir").mkdir()
    return {
        "missing model": (["--model", str(tmp_path / "nope")], "--model"),
        "not a checkpoint": (["--model", str(tmp_path / "empty_dir")], "config.json"),
        "malformed json": (["--data", str(bad_json)], f"{bad_json}:2: malformed JSON"),
        "wrong keys": (["--data", str(wrong_keys)], f"{wrong_keys}:1:"),
        "missing data": (["--data", str(tmp_path / "none.jsonl")], "--data"),
        "group size": (["--group-size", "0"], "--group-size must be >= 1"),
        "not an int": (["--steps", "many"], "--steps"),
        "unknown estimator": (["--estimator", "ppo"], "--estimator"),
        "top-p": (["--top-p", "0"], "--top-p"),
        "unknown flag": (["--group_size", "4"], "--group_size"),
        "resume without dir": (["--resume"], "--output-dir"),
        "data without model": (["--data", str(math_data)], f"--data {math_data}:2: the prompt cannot be encoded"),
        "no tokenizer files": (["--model", str(no_tokenizer)], "no tokenizer files"),
        "copy lengths": (["--copy-lengths", "5", "2"], "--copy-lengths"),
        "long horizon add": (["--long-horizon", "--task", "add"], "--long-horizon"),
    }


def test_bad_inputs_exit_nonzero_with_one_line_and_no_traceback(tmp_path):
    """Each mistake: exit status 2, one line naming the flag or file, no traceback, and no output directory."""
    cases = _bad_input_cases(tmp_path)
    out = {name: tmp_path / f"out_{i}" for i, name in enumerate(cases)}
    running = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-W",
                STRICT_WARNINGS,
                str(ROOT / "train.py"),
                *args,
                *([] if name == "resume without dir" else ["--output-dir", str(out[name])]),
            ],
            cwd=ROOT,
            env=strict_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, (args, _) in cases.items()
    }
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        assert process.returncode == 2, (name, stderr)
        assert len(lines) == 1 and "Traceback" not in stderr, (name, stderr)
        assert lines[0].startswith("train.py: error: ") and cases[name][1] in lines[0], (name, lines[0])
        assert not out[name].exists(), name  # checked before anything is written


def test_torchrun_mistake_is_reported_once(tmp_path):
    """Under torchrun every rank finds the mistake; only rank 0 prints it (torchrun then adds its own report)."""
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "What is 2+2?", "answer": "4"}\n')
    out = run_subprocess(["--data", str(data), "--device", "cpu", "--output-dir", str(tmp_path / "run")], torchrun=True)
    assert out.returncode != 0 and 'train.py", line' not in out.stderr  # torchrun's own traceback only
    assert out.stderr.count("train.py: error: --data") == 1, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_more_processes_than_gpus_is_refused(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU machine: a clear message instead of CUDA's invalid device ordinal."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "--nproc_per_node=1" in distributed.device_problem("auto")
    assert distributed.device_problem("cpu") is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert distributed.device_problem("auto") is None


def test_output_dir_that_cannot_be_a_directory_is_one_line(tmp_path, monkeypatch):
    """A run directory that is a file, lies under one, is a broken link or is not writable is refused before anything
    is built (every rank checks), writing nothing; so is the default runs/<date-time> under a file named runs; and a
    --data that is a directory."""
    cfg = parse_config(TINY)
    file, broken = tmp_path / "taken.jsonl", tmp_path / "broken"
    file.write_text("")
    broken.symlink_to(tmp_path / "nowhere")
    for output_dir, message in [(file, f"{file} is not a directory"), (file / "run", f"{file} is not a directory"),
                                (broken / "run", f"{broken} is a broken symbolic link")]:  # fmt: skip
        with pytest.raises(UserError, match=f"^--output-dir {output_dir}: {message}$"):
            check_run_directory(cfg, output_dir)
    with monkeypatch.context() as patch:  # (tests run as root here, for whom everything is writable)
        patch.setattr(config.os, "access", lambda path, mode: Path(path) != tmp_path)
        with pytest.raises(UserError, match=f"^--output-dir {tmp_path / 'new'}: {tmp_path} is not writable$"):
            check_run_directory(cfg, tmp_path / "new")
    monkeypatch.chdir(tmp_path)
    Path("runs").write_text("")
    with pytest.raises(UserError, match="^--output-dir runs/.*: runs is not a directory$"):
        run_train([*TINY, "--steps", "1"])
    with pytest.raises(UserError, match="^--data .*: a directory, not a file$"):
        parse_config([*TINY, "--data", str(tmp_path)])
    assert check_run_directory(cfg, tmp_path / "new" / "run") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "runs", "taken.jsonl"]


def test_existing_run_directory_needs_resume(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="--resume"):
        run_train([*TINY, "--steps", "1", "--output-dir", str(tmp_path / "run")])


# --------------------------------------------------------------------------- in-process runs


def test_resume_is_bitwise_exact_and_skips_incomplete_checkpoints(tmp_path, capsys):
    """4 steps straight vs 2 steps, 'preempted', then --resume: steps 3-4 are bitwise equal.

    Before resuming, a newer checkpoint without its COMPLETE marker, a leftover .tmp directory and a
    metrics line logged after the checkpoint are planted: the resume must ignore the first two,
    drop the line, and continue from step 2.
    """
    common = [*SMALL, "--steps", "4"]
    run_train([*common, "--output-dir", str(tmp_path / "straight")])
    run_train([*common, "--output-dir", str(tmp_path / "resumed")], stop_after=2)
    assert [r["step"] for r in metrics(tmp_path / "resumed")] == [1, 2]
    saved = tmp_path / "resumed" / "checkpoints"
    (saved / "step_00000003").mkdir()
    (saved / "step_00000003" / ".metadata").write_text("torn write")
    (saved / "step_00000004.tmp").mkdir()
    assert checkpoints.latest_checkpoint(tmp_path / "resumed") == saved / "step_00000002"
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as file:
        file.write(json.dumps({"step": 3, "tokens": -1}) + "\n")
    with pytest.raises(RuntimeError, match="incomplete"):
        checkpoints.load_checkpoint(saved / "step_00000003", None, None, {}, None)
    capsys.readouterr()
    run_train([*common, "--output-dir", str(tmp_path / "resumed"), "--resume"])
    assert "resumed from step_00000002" in capsys.readouterr().err
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]
    assert straight[3]["grad_norm"] > 0


def test_resume_without_a_checkpoint_starts_from_scratch(tmp_path, capsys):
    run_train([*TINY, "--steps", "1", "--output-dir", str(tmp_path / "fresh"), "--resume"])
    assert "no complete checkpoint found" in capsys.readouterr().err
    assert [r["step"] for r in metrics(tmp_path / "fresh")] == [1]


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_every_estimator_runs_a_step(tmp_path, estimator):
    extra = ["--leave-one-out"] if estimator in ("otb", "grpo") else []
    run_train([*TINY, "--steps", "1", "--estimator", estimator, *extra, "--output-dir", str(tmp_path / estimator)])
    (record,) = metrics(tmp_path / estimator)
    assert record["skipped"] == 0 and math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


def _train_namespace() -> dict:
    """train.py's functions, from its file (nothing imports it as a module)."""
    return runpy.run_path(str(ROOT / "train.py"), run_name="train_script")


def test_static_decode_is_on_by_default_with_cuda_for_a_supported_model(capsys):
    """--static-decode unset: the static decoder on CUDA when the model is supported (else the model's forward,
    said once), the model's forward on CPU; given, the flag wins; asked for a model it cannot run, one UserError
    naming the flag."""
    import transformers

    use = _train_namespace()["use_static_decode"]
    env = {kind: distributed.Dist(0, 1, 0, torch.device(kind), None) for kind in ("cpu", "cuda")}
    qwen = tiny_causal_lm("qwen2")
    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    unset, on, off = (parse_config(flags) for flags in ([], ["--static-decode"], ["--no-static-decode"]))
    assert unset.static_decode is None
    assert use(unset, qwen, env["cuda"]) is True and use(unset, qwen, env["cpu"]) is False
    assert use(on, qwen, env["cpu"]) is True and use(off, qwen, env["cuda"]) is False
    assert capsys.readouterr().err == ""
    assert use(unset, gpt2, env["cuda"]) is False
    assert "model's own forward (static decode: model_type 'gpt2'" in capsys.readouterr().err
    assert use(unset, gpt2, env["cpu"]) is False and capsys.readouterr().err == ""
    with pytest.raises(UserError, match="--static-decode: model_type 'gpt2'"):
        use(on, gpt2, env["cuda"])
    drop, drop_on = (
        parse_config(flags) for flags in (["--drop-finished-rows"], ["--drop-finished-rows", "--static-decode"])
    )
    assert use(drop, qwen, env["cuda"]) is True and use(drop_on, qwen, env["cpu"]) is True
    drop_off = parse_config(["--drop-finished-rows", "--no-static-decode"])
    refusals = ((drop, qwen, "cpu"), (drop, gpt2, "cuda"), (drop_off, qwen, "cuda"))
    for cfg, model, device in refusals:  # no static decoder: --drop-finished-rows cannot be honoured
        with pytest.raises(UserError, match="^--drop-finished-rows: only the static decoder drops rows"):
            use(cfg, model, env[device])


def test_update_model_flops_are_six_per_parameter_and_non_pad_token():
    """add_timings: seconds per phase, and the update's model FLOP rate 6 x parameters x non-pad tokens x epochs
    / update seconds (the MFU numerator of benchmarks/gpu_train_step.py)."""
    add_timings = _train_namespace()["add_timings"]
    record = {"generated_tokens": 30, "sequence_tokens": 100}
    add_timings(record, {"start": 1.0, "rollout": 2.0, "logprobs": 2.5, "advantages": 2.75, "update": 4.75}, 3, 10**9)
    assert [record[f"time/{k}"] for k in ("rollout", "logprobs", "advantages", "update", "step")] == [
        1.0, 0.5, 0.25, 2.0, 3.75
    ]  # fmt: skip
    assert record["throughput/generation_tokens_per_s"] == 30.0 and record["throughput/update_tokens_per_s"] == 45.0
    assert record["throughput/update_model_tflops"] == 6 * 10**9 * 100 * 3 / 2.0 / 1e12


def test_static_decode_gives_the_same_rollouts(tmp_path, monkeypatch):
    """--static-decode (static KV cache; no CUDA graphs on CPU) samples the same responses as the model's forward,
    with --drop-finished-rows too (48 new tokens: three checks of generate, so the batch narrows); config.json
    records the decoder that ran (the default on CPU: the model's forward)."""
    from otb_train.static_decode import StaticKVDecoder

    narrowed, select_rows = [], StaticKVDecoder.select_rows
    monkeypatch.setattr(
        StaticKVDecoder, "select_rows", lambda self, rows: narrowed.append(len(rows)) or select_rows(self, rows)
    )
    runs = {}
    drop = ["--static-decode", "--drop-finished-rows"]
    for name, extra in (("forward", []), ("static", ["--static-decode"]), ("drop", drop)):
        run_train(
            [
                *SMALL,
                "--steps",
                "2",
                "--output-dir",
                str(tmp_path / name),
                "--max-new-tokens",
                "48",
                *extra,
            ],
            dump=str(tmp_path / f"d_{name}"),
        )
        runs[name] = [dumped_rows(tmp_path / f"d_{name}", step, 1) for step in (1, 2)]
    for name, expected in (("forward", False), ("static", True)):
        assert json.loads((tmp_path / name / "config.json").read_text())["static_decode"] is expected
    assert len(narrowed) >= 2  # the drop run's batches did narrow
    for forward, static, drop in zip(runs["forward"], runs["static"], runs["drop"]):
        assert torch.equal(forward["response_ids"], static["response_ids"])
        assert torch.equal(forward["response_ids"], drop["response_ids"])
        torch.testing.assert_close(forward["advantages"], static["advantages"], rtol=0, atol=0)
        torch.testing.assert_close(forward["advantages"], drop["advantages"], rtol=0, atol=0)


def test_non_finite_loss_skips_the_update_and_training_continues(tmp_path, capsys):
    run_train(
        [
            *SMALL,
            "--steps",
            "3",
            "--save-every",
            "1",
            "--keep-checkpoints",
            "0",
            "--output-dir",
            str(tmp_path / "nan"),
        ],
        nan_step=2,
    )
    records = metrics(tmp_path / "nan")
    assert [r["skipped"] for r in records] == [0, 1, 0] and records[2]["skipped_total"] == 1
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None  # NaN is logged as null
    assert math.isfinite(records[2]["grad_norm"]) and records[2]["grad_norm"] > 0
    assert "step 2: non-finite loss" in capsys.readouterr().err
    before = load_params(tmp_path / "nan" / "checkpoints" / "step_00000001", tmp_path)
    after = load_params(tmp_path / "nan" / "checkpoints" / "step_00000002", tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step left the parameters alone


def _tiny_hf_checkpoint(directory: Path) -> Path:
    """A 2-layer Qwen2 with tied embeddings and a character-level tokenizer with a chat template, saved locally."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        token: i
        for i, token in enumerate(
            ["<pad>", "<eos>", "<user>", "<assistant>", *"0123456789+=?\\{} abcdefghijklmnopqrstuvwxyz"]
        )
    }
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ["<pad>", "<eos>", "<user>", "<assistant>"]])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="?")
    tokenizer.chat_template = (
        "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tokenizer.save_pretrained(directory)
    sizes = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    special = dict(tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    tiny_causal_lm(**sizes, max_position_embeddings=128, **special).save_pretrained(directory)
    return directory


def test_local_hf_model_with_chat_template_and_jsonl_data(tmp_path):
    """--model (a tiny local checkpoint) and --data (JSONL, prompts of different lengths: left padding),
    with exact sequence norms, a KL loss, two mini-batches and activation checkpointing."""
    model = _tiny_hf_checkpoint(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {a}+{a * 7}?", "answer": 8 * a}) + "\n" for a in range(12)))
    run_train(
        [
            "--model",
            str(model),
            "--data",
            str(data),
            "--steps",
            "2",
            "--prompts-per-step",
            "4",
            "--group-size",
            "2",
            "--max-new-tokens",
            "6",
            "--estimator",
            "eob",
            "--kl-coef",
            "0.05",
            "--mini-batches",
            "2",
            "--activation-checkpointing",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and all("kl_ref" in r for r in records)
    assert records[1]["tokens"] > records[0]["tokens"] > 0


def test_exact_energies_match_unpadded_rows():
    """exact_energies on left-padded rows equals otb_ref.exact on each row without its padding."""
    from otb_ref.exact import prefix_grad_norms_sq_fp64, sequence_grad_norms_sq_fp64

    lm = tiny_causal_lm(vocab_size=12, max_position_embeddings=32).eval()
    sequences = torch.tensor(
        [[0, 0, 5, 6, 7, 3, 1], [4, 5, 6, 7, 8, 9, 0]]
    )  # prompt 5 columns (row 0 left-padded by 2), response 2
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    mask = attention[:, 5:].clone()  # row 1's response is one token (then padding)
    seq = exact_energies("eob", lm, sequences, attention, mask, 1.0)["grad_norms_sq"]
    cum = exact_energies("otb_exact", lm, sequences, attention, mask, 1.0)["cumulative_energy"]
    for row, real in ((0, slice(2, 7)), (1, slice(0, 6))):
        ids = sequences[row : row + 1, real]
        response = torch.cat([torch.zeros(1, 5 - real.start, dtype=torch.long), mask[row : row + 1].long()], dim=1)[
            :, : ids.shape[1]
        ]
        assert float(seq[row]) == pytest.approx(float(sequence_grad_norms_sq_fp64(lm, ids, response)[0]), rel=1e-5)
        expected = prefix_grad_norms_sq_fp64(lm, ids, response)[0, 5 - real.start :]
        assert torch.allclose(cum[row, : expected.shape[0]].double(), expected, rtol=1e-5)


def test_plot_writes_a_png(tmp_path):
    import plot

    for name, rewards in (("a", [0.1, 0.5]), ("b", [0.2, 0.3])):
        run = tmp_path / name
        run.mkdir()
        run.joinpath("metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": i + 1, "tokens": 100 * (i + 1), "reward_mean": r, "grad_norm": None if i else 0.5})
                + "\n"
                for i, r in enumerate(rewards)
            )
        )
    plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--label", "first", "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- real models, resume, visible behaviour


def test_real_model_defaults_apply_unless_flags_are_given(tmp_path):
    model = _tiny_hf_checkpoint(tmp_path / "model")
    cfg = parse_config(["--model", str(model)])
    assert (cfg.lr, cfg.max_new_tokens, cfg.micro_batch_size) == (1e-6, 1024, 8)
    cfg = parse_config(["--model", str(model), "--lr", "3e-6", "--max-new-tokens", "64"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.micro_batch_size) == (3e-6, 64, 8)
    assert parse_config([]).lr == 1e-3 and parse_config(["--long-horizon"]).max_new_tokens == 512
    assert parse_config(["--long-horizon"]).copy_lengths == (63, 511)
    assert parse_config(["--token-budget", "100"]).steps == 1_000_000


def test_tokenizer_without_eos_is_refused(tmp_path):
    from transformers import AutoTokenizer

    model = _tiny_hf_checkpoint(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(model)
    for name in ("config.json", "generation_config.json"):
        path = model / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": None}))
    with pytest.raises(UserError, match="EOS"):
        run_train(["--model", str(model), "--output-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_prompt_that_encodes_to_nothing_is_refused():
    class EmptyTokenizer:  # a tokenizer without a chat template that encodes the prompt to no ids
        chat_template = None

        def __call__(self, text):
            return {"input_ids": []}

    cfg = parse_config(["--data", __file__])  # any existing file: only the path is checked here
    with pytest.raises(UserError, match=r":7: the prompt encodes to no tokens"):
        check_prompts(cfg, [Problem("", "1")], [7], EmptyTokenizer())


def test_resume_refuses_changed_run_flags_and_keeps_the_first_config(tmp_path, capsys):
    run = tmp_path / "run"
    run_train([*TINY, "--steps", "1", "--output-dir", str(run)])
    config = (run / "config.json").read_text()
    changed = ["--lr", "0.002", "--seed", "1", "--estimator", "grpo"]
    with pytest.raises(UserError) as error:
        run_train([*TINY, "--steps", "2", *changed, "--output-dir", str(run), "--resume"])
    for flag in ("--lr 0.001 -> 0.002", "--seed 0 -> 1", "--estimator 'otb' -> 'grpo'"):
        assert flag in str(error.value)
    with pytest.raises(UserError, match="--hidden-size 64 -> 96"):
        run_train([*TINY, "--steps", "2", "--hidden-size", "96", "--output-dir", str(run), "--resume"])
    with pytest.raises(UserError, match="--no-baseline False -> True"):  # the control changes the advantages
        run_train([*TINY, "--steps", "2", "--no-baseline", "--output-dir", str(run), "--resume"])
    assert (run / "config.json").read_text() == config
    assert len((run / "config_history.jsonl").read_text().splitlines()) == 1
    assert [r["step"] for r in metrics(run)] == [1]


def test_extending_steps_on_resume_keeps_the_schedule_and_records_the_change(tmp_path, capsys):
    """--steps 2, then --steps 4 --resume: config.json keeps steps 2, the history records 2 -> 4, and steps 3-4
    run at --min-lr-ratio x --lr (the cosine's horizon stays the first start's --steps)."""
    run, common = tmp_path / "run", [*TINY, "--warmup-steps", "0", "--output-dir", str(tmp_path / "run")]
    run_train([*common, "--steps", "2"])
    run_train([*common, "--steps", "4", "--resume", "--save-every", "3"])
    assert "extends the run past its first --steps 2" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["steps"] == 2
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["from_step"] for h in history] == [0, 2]
    assert history[1]["changed"] == {"steps": [2, 4], "save_every": [50, 3]}
    lrs = [r["lr"] for r in metrics(run)]
    assert lrs[0] == 1e-3 and lrs[2] == lrs[3] == pytest.approx(0.1 * 1e-3, rel=1e-12)
    capsys.readouterr()
    run_train([*common, "--steps", "4", "--resume"])
    assert "nothing to do" in capsys.readouterr().err
    assert len((run / "config_history.jsonl").read_text().splitlines()) == 2


def test_default_output_dir_is_recorded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_train([*TINY, "--steps", "1"])
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "config.json").read_text())["output_dir"] == f"runs/{run.name}"


def test_samples_summary_and_new_metrics(tmp_path, capsys):
    """samples.jsonl every --sample-every steps (and the first and last), the one-line summary, entropy and
    zero-variance groups in their ranges, and the truncation warning (a 2-token cap cuts most responses)."""
    run = tmp_path / "run"
    args = [*TINY, "--steps", "3", "--sample-every", "2", "--num-samples", "3", "--max-new-tokens", "2"]
    run_train([*args, "--output-dir", str(run)])
    err = capsys.readouterr().err
    assert "step 1: " in err and "hit --max-new-tokens 2" in err and "config: steps=3" in err
    (summary,) = [line for line in err.splitlines() if line.startswith("train.py: done: steps 1-3")]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert set(samples[0]) == {"step", "prompt", "answer", "response", "reward", "finished", "length"}
    assert all(s["length"] <= 2 and 0 <= s["reward"] <= 1 for s in samples)
    for record in metrics(run):
        assert 0 <= record["entropy_renyi2"] <= record["entropy"] + 1.0 and record["entropy"] <= math.log(15) + 1.0
        assert 0 <= record["zero_variance_group_fraction"] <= 1 and record["truncated_fraction"] > 0.5


def test_token_budget_stops_the_run_and_shapes_the_schedule(tmp_path):
    run = tmp_path / "run"
    run_train([*TINY, "--token-budget", "200", "--warmup-steps", "0", "--output-dir", str(run)])
    records = metrics(run)
    assert records[-1]["tokens"] >= 200 > records[-2]["tokens"]
    for before, record in zip([{"tokens": 0}, *records], records):  # cosine in tokens generated before the step
        progress = min(1.0, before["tokens"] / 200)
        assert record["lr"] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))), rel=1e-12)
    assert checkpoints.latest_checkpoint(run).name == f"step_{len(records):08d}"


def test_std_normalize_scales_each_group_by_one_constant(tmp_path):
    """--std-normalize on otb: same rollouts; within a group the advantages are the plain ones times 1/(σ + eps),
    σ the std of G_t pooled within positions (THEORY §3); groups with equal rewards are unchanged."""
    dumps = {}
    for name, extra in (("plain", []), ("std", ["--std-normalize"])):
        run_train(
            [
                *SMALL,
                "--steps",
                "1",
                *extra,
                "--output-dir",
                str(tmp_path / name),
            ],
            dump=str(tmp_path / f"d{name}"),
        )
        dumps[name] = dumped_rows(tmp_path / f"d{name}", 1, 1)
    assert torch.equal(dumps["plain"]["response_ids"], dumps["std"]["response_ids"])
    plain, scaled, rewards = dumps["plain"]["advantages"], dumps["std"]["advantages"], dumps["plain"]["rewards"]
    mask = dumps["plain"]["mask"].double()
    returns = rewards.double()[:, None] * mask  # outcome reward at the last token: G_t = R while alive
    sd, spread = otb_ref.readable.group_std(returns, mask, torch.arange(64) // 8)
    moved = 0
    for group in range(8):
        rows = slice(8 * group, 8 * group + 8)
        if not spread[8 * group]:
            assert torch.equal(scaled[rows], plain[rows])
            continue
        expected = plain[rows] / (float(sd[8 * group]) + 1e-8)
        torch.testing.assert_close(scaled[rows], expected, rtol=1e-5, atol=1e-6)
        moved += 1
    assert moved >= 2


def test_copy_lengths_sets_the_answer_lengths():
    cfg = parse_config(["--copy-lengths", "5", "9"])
    lengths = {len(problem_at(cfg, None, i).answer) for i in range(200)}
    assert lengths == set(range(5, 10)) and len(problem_at(cfg, None, 0).prompt) == 10


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    run_train([*TINY, "--steps", "1", "--tensorboard", "--output-dir", str(tmp_path / "run")])
    (events,) = (tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*")
    assert events.stat().st_size > 0


def test_plot_labels_come_from_each_runs_config(tmp_path):
    import plot

    configs = [
        {"estimator": "otb", "group_size": 4, "seed": 0, "lr": 1e-3, "output_dir": "a"},
        {"estimator": "grpo", "group_size": 32, "seed": 0, "lr": 1e-3, "output_dir": "b"},
        {"estimator": "grpo", "group_size": 32, "seed": 0, "lr": 1e-3, "output_dir": "c"},
        {"estimator": "otb", "group_size": 4, "seed": 1, "lr": 2e-3, "output_dir": "d"},
    ]
    runs = [tmp_path / c["output_dir"] for c in configs]
    assert plot.labels_for(runs, configs) == [
        "otb N=4 seed=0 lr=0.001",
        "grpo N=32 seed=0 lr=0.001 (1)",
        "grpo N=32 seed=0 lr=0.001 (2)",
        "otb N=4 seed=1 lr=0.002",
    ]
    assert plot.labels_for([tmp_path / "x"], [{}]) == ["x"]  # no config.json: the directory name


def test_character_tokenizer_of_a_qwen2_checkpoint_keeps_spaces(tmp_path):
    """A generic fast tokenizer saved next to a Qwen2 model encodes as its tokenizer.json says (no byte-level
    pre-tokenizer of the model type dropping the spaces), as the built-in CharTokenizer does."""
    from otb_train.tasks import CharTokenizer, hugging_face_char_tokenizer

    model = _tiny_hf_checkpoint(tmp_path / "model")
    for file in model.iterdir():
        if "token" in file.name or "chat" in file.name:
            file.unlink()
    hugging_face_char_tokenizer().save_pretrained(model)
    tokenizer = load_tokenizer(str(model))
    assert encode_prompt(tokenizer, "37  =") == CharTokenizer().encode("37  =")
    assert tokenizer.decode([5, 9, 14, 1, 0], skip_special_tokens=True) == "37 "


def test_no_baseline_control_gives_the_return_and_update_norm_is_the_parameter_change(tmp_path):
    """--no-baseline: every response its own group, so the advantage is the return (outcome reward on every
    generated token); a step that has a gradient reports a positive update_norm."""
    run, dump = tmp_path / "run", tmp_path / "dump"
    flags = [*SMALL, "--steps", "1", "--save-every", "1", "--keep-checkpoints", "0", "--no-baseline"]
    run_train([*flags, "--output-dir", str(run)], dump=str(dump))
    rows = dumped_rows(dump, 1, 1)
    assert float(rows["rewards"].abs().sum()) > 0  # some response scored, so the test is not vacuous
    expected = rows["rewards"][:, None] * rows["mask"].to(rows["advantages"].dtype)
    torch.testing.assert_close(rows["advantages"], expected)
    record = metrics(run)[0]
    assert record["grad_norm"] > 0 and record["update_norm"] > 0


def test_compile_layers_compiles_each_decoder_layer_in_place_and_computes_the_same_log_probs():
    """--compile-layers (distributed.shard's compile_layers): every decoder layer compiled in place, so parameter
    names (what checkpoints and otb_exact's state dict use) stay; the sharded policy's log-probs and Σπ² equal the
    uncompiled policy's to float32 rounding (compiled kernels may fuse and reorder float32 sums: 1e-5)."""
    from otb_train.model import shard_policy

    cfg = parse_config(["--device", "cpu"])
    env = distributed.init("cpu")
    try:
        plain, compiled = (
            shard_policy(cfg, tiny_causal_lm("qwen2", num_hidden_layers=2), env, False, False, compile_layers)
            for compile_layers in (False, True)
        )
        layers = [layer for layer in compiled.lm.model.layers]
        assert all(layer._compiled_call_impl is not None for layer in layers)
        assert all(layer._compiled_call_impl is None for layer in plain.lm.model.layers)
        assert list(compiled.state_dict()) == list(plain.state_dict())
        ids = torch.randint(2, 16, (3, 7), generator=torch.Generator().manual_seed(0))
        mask, positions = torch.ones_like(ids, dtype=torch.bool), torch.arange(7).expand(3, 7)
        with torch.no_grad():
            want, got = (policy(ids, mask, positions, targets=ids[:, 3:]) for policy in (plain, compiled))
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    finally:
        distributed.shutdown()
