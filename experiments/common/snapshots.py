"""Policy snapshots for the experiments that need no training of their own (gradient_variance, proxy_fidelity; the
command line is ``experiments/snapshots.py``): at init, after the supervised warm start, and after RL from it (mid
and late), each a local Hugging Face checkpoint directory.

``snapshots(setting, cache)`` returns ``{"init": dir, "warm": dir, "mid": dir, "late": dir}`` and builds what is
missing (cached under ``cache``, by default ``runs/snapshots``; delete it to rebuild). RL is ``train.py --estimator
otb`` from the warm start; "mid" and "late" are its checkpoints after ``rl_steps // 2`` and ``rl_steps`` steps,
converted with DCP's ``dcp_to_torch_save`` and written next to the warm start's config and tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common import ROOT
from otb_train.warm_start import main as train_warm_start

SNAPSHOT_ROOT = ROOT / "runs" / "snapshots"


@dataclass(frozen=True)
class Setting:
    """A task and model size, the warm start's target and the RL run."""

    name: str
    copy_lengths: tuple[int, int]
    hidden_size: int
    target_reward: float
    rl_steps: int
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4

    def task_flags(self) -> list[str]:
        low, high = self.copy_lengths
        return ["--task", "copy_exact", "--copy-lengths", str(low), str(high), "--max-new-tokens", str(high + 8)]


SETTINGS = {
    "copy16": Setting("copy16", (16, 24), 64, 0.3, 60),
    "copy64": Setting("copy64", (64, 80), 128, 0.3, 40),
    "quick": Setting("quick", (4, 6), 32, 0.05, 2, prompts_per_step=4, group_size=4),
}


def _init_and_warm(setting: Setting, root: Path) -> None:
    low, high = setting.copy_lengths
    common = ["--copy-lengths", str(low), str(high), "--hidden-size", str(setting.hidden_size)]
    if not (root / "init" / "config.json").exists():
        shutil.rmtree(root / "init", ignore_errors=True)
        train_warm_start(["--out", str(root / "init"), *common, "--steps", "0"])
    if not (root / "warm" / "config.json").exists():
        shutil.rmtree(root / "warm", ignore_errors=True)
        extra = ["--steps", "30", "--eval-every", "5", "--eval-prompts", "16"] if setting.name == "quick" else []
        train_warm_start(["--out", str(root / "warm"), *common, "--target-reward", str(setting.target_reward), *extra])


def _export(checkpoint: Path, template: Path, out: Path) -> None:
    """A DCP checkpoint of train.py's policy -> a Hugging Face directory (template's config and tokenizer)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    flat = out.with_suffix(".pt")
    dcp_to_torch_save(str(checkpoint), str(flat))
    state = {k.removeprefix("lm."): v for k, v in torch.load(flat, weights_only=False)["model"].items()}
    flat.unlink()
    lm = AutoModelForCausalLM.from_pretrained(template, dtype=torch.float32)
    lm.load_state_dict(state)
    lm.save_pretrained(out)
    for file in template.iterdir():
        if "token" in file.name:
            shutil.copy(file, out / file.name)


def add_snapshots_dir(parser: argparse.ArgumentParser) -> None:
    """The ``--snapshots-dir`` option of the experiments that read snapshots."""
    parser.add_argument(
        "--snapshots-dir", type=Path, default=SNAPSHOT_ROOT, help="where snapshots are cached (default runs/snapshots)"
    )


def snapshots(name: str = "copy16", cache: Path = SNAPSHOT_ROOT) -> dict[str, Path]:
    """``{"init", "warm", "mid", "late"}`` -> checkpoint directories of setting ``name`` under ``cache / name``
    (built if missing)."""
    setting, root = SETTINGS[name], Path(cache) / name
    _init_and_warm(setting, root)
    paths = {k: root / k for k in ("init", "warm", "mid", "late")}
    if all((paths[k] / "config.json").exists() for k in ("mid", "late")):
        return paths
    run = root / "rl_run"
    shutil.rmtree(run, ignore_errors=True)
    mid = max(1, setting.rl_steps // 2)
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "--model",
        str(paths["warm"]),
        *setting.task_flags(),
        "--estimator",
        "otb",
        "--steps",
        str(setting.rl_steps),
        "--save-every",
        str(mid),
        "--keep-checkpoints",
        "0",
        "--prompts-per-step",
        str(setting.prompts_per_step),
        "--group-size",
        str(setting.group_size),
        "--lr",
        str(setting.lr),
        "--micro-batch-size",
        "64",
        "--device",
        "cpu",
        "--output-dir",
        str(run),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"RL for the snapshots failed:\n{done.stderr[-3000:]}")
    for key, step in (("mid", mid), ("late", setting.rl_steps)):
        shutil.rmtree(paths[key], ignore_errors=True)
        _export(run / "checkpoints" / f"step_{step:08d}", paths["warm"], paths[key])
    return paths
