"""Distributed plumbing for train.py: torchrun, FSDP2, DCP checkpoints, RNG, metrics files.

The only module besides train.py that knows about processes, devices and files.

* :func:`init` — one process (``python train.py``) or torchrun: gloo on CPU,
  NCCL on GPU, and an explicit device mesh (``init_device_mesh("cpu", ...)``
  on CPU: the default would pick CUDA whenever a GPU is visible).
* :func:`shard` — FSDP2: ``fully_shard`` per decoder layer, then the root;
  bf16 parameters with fp32 gradient reduction on GPU; optional activation
  checkpointing. Gradients are SUMMED over ranks (no FSDP averaging): the
  trainer divides its loss by the global token/sequence count itself.
* :func:`save_checkpoint` / :func:`latest_checkpoint` / :func:`load_checkpoint`
  — ``torch.distributed.checkpoint`` into ``step_XXXXXXXX.tmp/``, renamed to
  ``step_XXXXXXXX/``, then a ``COMPLETE`` file is written last. Only
  directories with ``COMPLETE`` are ever loaded.
* :class:`MetricsLog` — ``metrics.jsonl`` (rank 0), one JSON object per step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

COMPLETE_MARKER = "COMPLETE"
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class Dist:
    """This process's place: ``rank`` of ``world_size``, its ``device`` and device mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device: str = "auto") -> Dist:
    """Join (or create) the process group. ``device``: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.

    Under torchrun (``RANK`` in the environment) the env:// rendezvous is used;
    a plain ``python train.py`` forms a group of one through an in-memory store.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=torch.device("cuda", local_rank) if use_cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    device_type = "cuda" if use_cuda else "cpu"
    mesh = init_device_mesh(device_type, (world_size,))
    torch_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return Dist(rank, world_size, local_rank, torch_device, mesh)


def device_problem(device: str) -> str | None:
    """Why this process cannot get a device of its own under ``device`` (``auto``, ``cpu``, ``cuda``), or None.

    torchrun gives each process the GPU of its ``LOCAL_RANK``: more processes per node than visible GPUs
    would otherwise fail later with CUDA's "invalid device ordinal".
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    visible = torch.cuda.device_count() if use_cuda else 0
    if use_cuda and per_node > visible:
        return (
            f"torchrun started {per_node} processes on this node but {visible} GPU(s) are visible: "
            f"use --nproc_per_node={visible}, or --device cpu"
        )
    return None


def shutdown(wait_for_peers: bool = False) -> None:
    """Leave the process group. ``wait_for_peers``: a barrier first, so that no rank tears the group down while
    another is still in a collective (gloo then aborts both: "terminate called without an active exception", seen
    in 1 of 6 two-rank runs on a loaded 2-core machine). Only on the normal path, where every rank gets here."""
    if dist.is_initialized():
        if wait_for_peers and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    dist.barrier()


def shard(
    model: nn.Module, layers: list[nn.Module], env: Dist, *, bf16: bool, activation_checkpointing: bool
) -> nn.Module:
    """FSDP2: ``fully_shard`` each of ``layers`` (in place), then ``model`` as the root.

    ``layers`` are the decoder layers (children of ``model``); with
    ``activation_checkpointing`` each is wrapped first so that its activations
    are recomputed in backward. Gradients are reduced with a plain SUM.
    """
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
        wrapped = []
        for layer in layers:
            parent, name = parents[id(layer)]
            wrapper = checkpoint_wrapper(layer, preserve_rng_state=False)
            parent.register_module(name, wrapper)
            wrapped.append(wrapper)
        layers = wrapped
    for layer in layers:
        fully_shard(layer, mesh=env.mesh, mp_policy=policy)
    fully_shard(model, mesh=env.mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # SUM over ranks: FSDP's default AVG (and gloo's emulation of it) would divide by the world size.
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return model


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Keep every FSDP unit's full parameters between forward calls (one all-gather per unit
    for a whole generation instead of one per decoding step); reshard on exit."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)


def all_reduce(values: list[float] | torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) of float64 ``values`` over ranks; returns a CPU float64 tensor."""
    tensor = torch.as_tensor(values, dtype=torch.float64).clone()
    backend_device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    )
    tensor = tensor.to(backend_device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.cpu()


def all_reduce_named(values: dict[str, float], op: str = "sum") -> dict[str, float]:
    """Sum (or max) over ranks of each named float64 value: one collective for the whole record."""
    return dict(zip(values, all_reduce(list(values.values()), op=op).tolist()))


def any_rank(flag: bool) -> bool:
    """True if ``flag`` is True on any rank (a collective: every rank must call it)."""
    if dist.get_world_size() == 1:
        return flag
    return bool(all_reduce([float(flag)], op="max")[0] > 0)


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded ``state_dict`` of an FSDP model on every rank (a collective; small models only)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


# ---------------------------------------------------------------------------
# RNG states.
# ---------------------------------------------------------------------------


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------
# Checkpoints.
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Metrics.
# ---------------------------------------------------------------------------


class MetricsLog:
    """A JSONL writer of per-step records, ``metrics.jsonl`` by default (a no-op off rank 0), optionally
    mirrored to TensorBoard.

    ``resume_step``: keep only lines with ``step <= resume_step`` (lines logged
    after the checkpoint that is being resumed are dropped); ``None`` starts a new file.
    """

    def __init__(
        self,
        output_dir: Path,
        env: Dist,
        resume_step: int | None,
        tensorboard: bool = False,
        name: str = "metrics.jsonl",
    ) -> None:
        self.path = Path(output_dir) / name
        self.enabled = env.is_main
        self.writer = None
        if not self.enabled:
            return
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step
            ]
        self.path.write_text("".join(line + "\n" for line in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # NaN/inf (a skipped step's loss) become null: metrics.jsonl stays strict JSON.
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
