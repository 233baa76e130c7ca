"""Processes and devices for train.py: torchrun, the process group, FSDP2 sharding and the collectives.

* :func:`init` — one process (``python train.py``) or torchrun: gloo on CPU, NCCL on GPU, and an explicit device
  mesh (``init_device_mesh("cpu", ...)`` on CPU: the default would pick CUDA whenever a GPU is visible).
* :func:`shard` — FSDP2: ``fully_shard`` per decoder layer, then the root; bf16 parameters with fp32 gradient
  reduction on GPU; optional activation checkpointing. Gradients are SUMMED over ranks (no FSDP averaging): the
  trainer divides its loss by the global token/sequence count itself.
* :func:`all_reduce_named`, :func:`any_rank`, :func:`broadcast_object` — the few collectives the loop needs.

Checkpoints are :mod:`otb_train.checkpoints`; the JSONL logs :mod:`otb_train.run_log`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


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
    model: nn.Module,
    layers: list[nn.Module],
    env: Dist,
    *,
    bf16: bool,
    activation_checkpointing: bool,
    compile_layers: bool = False,
) -> nn.Module:
    """FSDP2: ``fully_shard`` each of ``layers`` (in place), then ``model`` as the root.

    ``layers`` are the decoder layers (children of ``model``); with ``compile_layers`` each is compiled in place
    (``nn.Module.compile``: parameter names and the module tree stay as they are, FSDP's hooks run outside the
    compiled graph); with ``activation_checkpointing`` each is then wrapped so that its activations are recomputed
    in backward. Gradients are reduced with a plain SUM.
    """
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for layer in layers if compile_layers else ():
        layer.compile()
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
