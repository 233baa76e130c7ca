"""The configuration of train.py: every flag as a field of :class:`Config`, its validation in one place, and the
checks of a run directory before anything is written.

A mistake in flags or files is a :class:`UserError`: train.py reports it as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from otb_ref import ESTIMATORS
from otb_train.losses import AGGREGATIONS, KL_ESTIMATORS
from otb_train.tasks import SYNTHETIC_TASKS

DESCRIPTION = "RL for language models with every otb_ref advantage estimator: one process, or torchrun + FSDP2."
# Defaults for pretrained models (--model), unless the flag is given: a from-scratch learning rate and an
# 8-token cap would wreck or silently truncate a real model (lr 1e-6 is the common choice for 0.5B-7B RL).
REAL_MODEL_DEFAULTS = {"lr": 1e-6, "max_new_tokens": 1024, "micro_batch_size": 8}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Flags that define a run: --resume refuses to continue it if any of these differs from its config.json.
# Every other flag (--steps, saving, logging, micro-batching, devices, decoding speed-ups) may change.
RUN_DEFINING = (
    "seed",
    "model",
    "data",
    "task",
    "copy_lengths",
    "long_horizon",
    "hidden_size",
    "num_layers",
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "temperature",
    "top_p",
    "estimator",
    "leave_one_out",
    "std_normalize",
    "no_baseline",
    "lr",
    "weight_decay",
    "warmup_steps",
    "min_lr_ratio",
    "grad_clip",
    "clip_low",
    "clip_high",
    "loss_agg",
    "kl_coef",
    "kl_estimator",
    "mini_batches",
    "epochs",
    "token_budget",
    "mixed_precision",
)


def _flag(default, help, choices=None, nargs=None):
    return field(default=default, metadata={"help": help, "choices": choices, "nargs": nargs})


@dataclass
class Config:
    """Every flag of train.py (``--steps`` is ``steps``); ``validate`` checks them all in one place."""

    steps: int = _flag(300, "RL steps; with --token-budget, a cap on steps (default then 1000000)")
    token_budget: int = _flag(0, "stop after this many generated tokens; the LR schedule runs on tokens (0: off)")
    seed: int = _flag(0, "seed of model init, prompt order and sampling")
    output_dir: str = _flag(
        "", "directory for metrics.jsonl, samples.jsonl, config.json, checkpoints (default: runs/<date-time>)"
    )
    resume: bool = _flag(
        False, "continue the run in --output-dir from its newest complete checkpoint (from step 0 if none)"
    )
    save_every: int = _flag(50, "checkpoint every this many steps (and after the last); 0: only after the last")
    keep_checkpoints: int = _flag(2, "complete checkpoints to keep (0: all)")
    model: str = _flag("", "local Hugging Face checkpoint directory (default: a tiny random-init Qwen2)")
    data: str = _flag("", 'JSONL file of {"prompt": ..., "answer": ...} rows, math-answer reward (default: synthetic)')
    task: str = _flag("copy", "built-in synthetic task when --data is not given", SYNTHETIC_TASKS)
    copy_lengths: tuple[int, int] | None = _flag(
        None, "copy task: MIN MAX answer digits (default 1 4; 63 511 with --long-horizon)", nargs=2
    )
    long_horizon: bool = _flag(False, "copy tasks with 64-512 token responses and --max-new-tokens 512 (for GPUs)")
    hidden_size: int = _flag(64, "width of the built-in model")
    num_layers: int = _flag(2, "decoder layers of the built-in model")
    prompts_per_step: int = _flag(32, "prompts per step, over all ranks")
    group_size: int = _flag(8, "responses per prompt (N)")
    max_new_tokens: int = _flag(8, "response length cap (default 1024 with --model, 512 with --long-horizon)")
    temperature: float = _flag(1.0, "sampling temperature (log-probs use the same temperature)")
    top_p: float = _flag(1.0, "nucleus sampling mass")
    estimator: str = _flag("otb", "advantage estimator", tuple(ESTIMATORS))
    leave_one_out: bool | None = _flag(None, "leave-one-out baselines (default: the estimator's; only rloo has them)")
    no_baseline: bool = _flag(False, "control: every response is its own group, so advantage = return (REINFORCE)")
    std_normalize: bool | None = _flag(
        None, "divide advantages by the group's reward std (default: the estimator's; only grpo does)"
    )
    lr: float = _flag(1e-3, "peak learning rate, AdamW (default 1e-6 with --model)")
    weight_decay: float = _flag(0.0, "AdamW weight decay")
    warmup_steps: int = _flag(5, "linear warmup, in optimizer steps")
    min_lr_ratio: float = _flag(0.1, "cosine decays the learning rate to this fraction of --lr")
    grad_clip: float = _flag(1.0, "clip the global gradient norm to this (0: no clipping)")
    clip_low: float = _flag(0.2, "PPO ratio clip below: 1 - clip_low")
    clip_high: float = _flag(0.2, "PPO ratio clip above: 1 + clip_high")
    loss_agg: str = _flag("token-mean", "loss aggregation", AGGREGATIONS)
    kl_coef: float = _flag(0.0, "weight of the KL loss to the frozen initial policy (0: no reference model)")
    kl_estimator: str = _flag("k3", "per-token KL estimator", KL_ESTIMATORS)
    mini_batches: int = _flag(1, "optimizer steps per RL step (the batch is split into this many)")
    epochs: int = _flag(1, "passes over the batch per RL step")
    micro_batch_size: int = _flag(64, "responses per forward/backward on each rank (default 8 with --model)")
    device: str = _flag("auto", "auto: CUDA when available", ("auto", "cpu", "cuda"))
    mixed_precision: str = _flag(
        "auto", "auto: bf16 parameters (fp32 reductions) on GPU, fp32 on CPU", ("auto", "bf16", "fp32")
    )
    activation_checkpointing: bool = _flag(False, "recompute decoder-layer activations in backward")
    static_decode: bool | None = _flag(
        None,
        "generate with otb_train.static_decode (static KV cache, CUDA graphs on GPU); default: on with CUDA when the "
        "model is supported, off on CPU",
    )
    drop_finished_rows: bool = _flag(
        False,
        "static decoder: once at most half the rows being generated are alive at a check, generate the alive ones "
        "only (rollouts equal up to kernel rounding; not yet measured on a GPU, so off by default)",
    )
    compile_layers: bool = _flag(False, "torch.compile each decoder layer (the first steps compile)")
    logprob_chunk_size: int = _flag(0, "rows per chunk of the LM-head log-prob pass (0: library default)")
    sample_every: int = _flag(
        10, "write prompts, responses and rewards to samples.jsonl every this many steps (0: never)"
    )
    num_samples: int = _flag(4, "responses written to samples.jsonl each time (one per prompt)")
    tensorboard: bool = _flag(False, "also write TensorBoard scalars (needs the tensorboard package)")

    def apply_implied_defaults(self, given: set[str]) -> None:
        """Defaults that depend on other flags, for the fields not given on the command line."""
        implied = dict(REAL_MODEL_DEFAULTS) if self.model else {}
        if self.long_horizon:
            implied.update(max_new_tokens=512)
        if self.token_budget:
            implied["steps"] = 1_000_000
        for name, value in implied.items():
            if name not in given:
                setattr(self, name, value)
        if self.copy_lengths is None:
            self.copy_lengths = (63, 511) if self.long_horizon else (1, 4)
        self.copy_lengths = tuple(self.copy_lengths)

    def validate(self) -> None:
        """Raise :class:`UserError` naming the first flag whose value is wrong (before anything is written)."""
        low, high = self.copy_lengths
        checks = [
            (self.steps >= 1, "--steps must be >= 1"),
            (self.token_budget >= 0, "--token-budget must be >= 0"),
            (self.group_size >= 1, "--group-size must be >= 1"),
            (self.prompts_per_step >= 1, "--prompts-per-step must be >= 1"),
            (self.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
            (self.temperature > 0, "--temperature must be > 0"),
            (0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
            (self.lr > 0, "--lr must be > 0"),
            (0 <= self.clip_low < 1, "--clip-low must be in [0, 1)"),
            (self.clip_high >= 0, "--clip-high must be >= 0"),
            (self.kl_coef >= 0, "--kl-coef must be >= 0"),
            (self.grad_clip >= 0, "--grad-clip must be >= 0"),
            (self.warmup_steps >= 0, "--warmup-steps must be >= 0"),
            (0 <= self.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
            (self.mini_batches >= 1, "--mini-batches must be >= 1"),
            (self.epochs >= 1, "--epochs must be >= 1"),
            (self.micro_batch_size >= 1, "--micro-batch-size must be >= 1"),
            (self.save_every >= 0, "--save-every must be >= 0"),
            (self.hidden_size >= 32 and self.hidden_size % 32 == 0, "--hidden-size must be a positive multiple of 32"),
            (self.num_layers >= 1, "--num-layers must be >= 1"),
            (self.logprob_chunk_size >= 0, "--logprob-chunk-size must be >= 0"),
            (1 <= low <= high, "--copy-lengths MIN MAX needs 1 <= MIN <= MAX"),
            (self.sample_every >= 0, "--sample-every must be >= 0"),
            (self.num_samples >= 0, "--num-samples must be >= 0"),
            (
                not (self.long_horizon and self.task == "add"),
                "--long-horizon is for the copy tasks, not --task add",
            ),
            (not self.resume or self.output_dir, "--resume needs --output-dir (the run to continue)"),
            (self.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device is available"),
            (
                not self.tensorboard or importlib.util.find_spec("tensorboard"),
                "--tensorboard needs the tensorboard package (pip install tensorboard)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        self._validate_paths()

    def _validate_paths(self) -> None:
        model = Path(self.model)
        if self.model and not model.is_dir():
            raise UserError(f"--model {self.model}: no such directory")
        if self.model and not (model / "config.json").is_file():
            raise UserError(f"--model {self.model}: no config.json (not a Hugging Face checkpoint directory)")
        if self.model and not any((model / name).is_file() for name in TOKENIZER_FILES):
            raise UserError(f"--model {self.model}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
        if self.data and not Path(self.data).is_file():
            raise UserError(
                f"--data {self.data}: " + ("a directory, not a file" if Path(self.data).is_dir() else "no such file")
            )


def _check_output_dir(output_dir: Path) -> None:
    """The run's directory (``--output-dir``, or the default ``runs/<date-time>``) is a directory, or one can be made
    there: its nearest existing ancestor is a writable directory. A mistake is one line before anything is built,
    not a traceback at the first write; nothing is written."""
    try:
        nearest = next(p for p in (output_dir, *output_dir.parents) if p.exists() or p.is_symlink())  # "." at last
        if not nearest.is_dir():
            what = "not a directory" if nearest.exists() else "a broken symbolic link"
            raise UserError(f"--output-dir {output_dir}: {nearest} is {what}")
        if not os.access(nearest, os.W_OK | os.X_OK):
            raise UserError(f"--output-dir {output_dir}: {nearest} is not writable")
    except OSError as error:  # e.g. an ancestor that cannot be searched
        where = f" ({error.filename})" if error.filename else ""
        raise UserError(f"--output-dir {output_dir}: {error.strerror or error}{where}") from None


class UserError(Exception):
    """A mistake in flags or files: reported as one line, exit status 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


def parse_config(argv: list[str]) -> Config:
    """Flags -> a validated :class:`Config` (implied defaults applied to the flags not given)."""
    parser = _Parser(description=DESCRIPTION, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    for f in dataclasses.fields(Config):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        default = "" if f.type.startswith("bool") or "default" in meta["help"] else f" (default: {f.default})"
        kwargs = dict(help=meta["help"] + default)
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", **kwargs)
        elif f.type.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            kind = {"float": float, "str": str}.get(f.type, int)
            parser.add_argument(flag, type=kind, choices=meta["choices"], nargs=meta["nargs"], **kwargs)
    given = vars(parser.parse_args(argv))
    cfg = Config(**given)
    cfg.apply_implied_defaults(set(given))
    cfg.validate()
    return cfg


def config_record(cfg: Config) -> dict:
    """The configuration as JSON values (what config.json holds)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_changes(before: dict, after: dict) -> dict[str, list]:
    """``{flag: [before, after]}`` for every configuration field whose JSON value differs."""
    return {k: [before.get(k), after.get(k)] for k in {**before, **after} if before.get(k) != after.get(k)}


def describe(cfg: Config) -> str:
    """The effective configuration, ``name=value`` wrapped to 118 columns (printed at start)."""
    pairs = [f"{k}={v}" for k, v in config_record(cfg).items()]
    return textwrap.fill(" ".join(pairs), width=118, initial_indent="config: ", subsequent_indent="  ")


def check_run_directory(cfg: Config, output_dir: Path) -> dict | None:
    """The run's first configuration when ``--resume`` continues it, else None; refuses what cannot work.

    The directory must be one, or one must be makeable there; a new run needs a directory without a run; a resumed
    run must match its config.json on every RUN_DEFINING flag (the differences are listed).
    """
    _check_output_dir(output_dir)
    holds_run = (output_dir / "metrics.jsonl").exists() or (output_dir / "checkpoints").exists()
    if not cfg.resume:
        if holds_run:
            raise UserError(
                f"--output-dir {output_dir} already holds a run: pass --resume to continue it, "
                "or choose another directory"
            )
        return None
    config_file = output_dir / "config.json"
    if not config_file.is_file():
        if holds_run:
            raise UserError(f"--resume: {output_dir} holds a run but no config.json to check the flags against")
        return None
    first = json.loads(config_file.read_text())
    changes = config_changes(first, config_record(cfg))
    changed = [f"--{k.replace('_', '-')} {changes[k][0]!r} -> {changes[k][1]!r}" for k in RUN_DEFINING if k in changes]
    if changed:
        raise UserError(
            f"--resume: flags that define the run differ from {config_file}: {'; '.join(changed)} "
            "(start a new --output-dir to change them)"
        )
    return first
