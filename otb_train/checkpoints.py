"""Checkpoints of train.py: ``torch.distributed.checkpoint`` (DCP) of the model, optimizer, trainer counters and
each rank's RNG state.

A checkpoint is written into ``step_XXXXXXXX.tmp/``, renamed to ``step_XXXXXXXX/``, then a ``COMPLETE`` file is
written last; only directories with ``COMPLETE`` are ever loaded, so a crash mid-save loses nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from otb_train.distributed import Dist, barrier

COMPLETE_MARKER = "COMPLETE"


_CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / "checkpoints" / f"step_{step:08d}"


def latest_checkpoint(root: Path) -> Path | None:
    """The newest ``step_XXXXXXXX`` directory under ``root/checkpoints`` that has the COMPLETE marker."""
    folder = Path(root) / "checkpoints"
    if not folder.is_dir():
        return None
    complete = [p for p in folder.iterdir() if _CHECKPOINT_NAME.match(p.name) and (p / COMPLETE_MARKER).is_file()]
    return max(complete, key=lambda p: p.name, default=None)


def _app_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, trainer: dict[str, Any], env: Dist
) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # Trainer values travel as one JSON string (exact for ints and floats); one RNG entry per rank
    # (different keys, so DCP keeps each rank's own).
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "trainer": json.dumps(trainer),
        "rng": {f"rank{env.rank}": rng_state()},
    }


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer: dict[str, Any],
    env: Dist,
    keep: int,
) -> Path:
    """Write a checkpoint for ``step`` (a collective); mark it complete only once fully written.

    ``trainer`` holds plain Python values (step, counters, scheduler state).
    Keeps the newest ``keep`` complete checkpoints (``keep <= 0``: all).
    """
    final = checkpoint_dir(root, step)
    temporary = final.with_name(final.name + ".tmp")
    if env.is_main:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    barrier()
    dcp.save(_app_state(model, optimizer, trainer, env), checkpoint_id=str(temporary))
    barrier()
    if env.is_main:
        shutil.rmtree(final, ignore_errors=True)
        temporary.rename(final)
        with open(final / COMPLETE_MARKER, "w") as marker:
            marker.write(f"{step}\n")
            marker.flush()
            os.fsync(marker.fileno())
        if keep > 0:
            complete = sorted(
                p for p in final.parent.iterdir() if _CHECKPOINT_NAME.match(p.name) and (p / COMPLETE_MARKER).is_file()
            )
            for old in complete[:-keep]:
                (old / COMPLETE_MARKER).unlink()  # unmark first: a crash mid-delete leaves it ignored
                shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, trainer: dict[str, Any], env: Dist
) -> dict[str, Any]:
    """Load a complete checkpoint into ``model`` and ``optimizer`` (in place) and this rank's RNG state;
    returns the saved ``trainer`` dict (``trainer`` gives its keys)."""
    if not (Path(path) / COMPLETE_MARKER).is_file():
        raise RuntimeError(f"{path}: checkpoint is incomplete (no {COMPLETE_MARKER} marker)")
    state = _app_state(model, optimizer, dict(trainer), env)
    dcp.load(state, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rng = state["rng"].get(f"rank{env.rank}")
    if rng is not None:
        set_rng_state(rng)
    return json.loads(state["trainer"])
