"""verl 0.9.1's V1 trainer on one CPU process: its own classes, with stand-ins only where verl needs Ray, a
TransferQueue (TQ) server or an accelerator.

* :class:`KVStore`: ``transfer_queue.kv_batch_get/put/clear`` in memory. It stores each sample's value of each
  field apart and packs a get with TQ's own ``AsyncSimpleStorageManager._pack_field_values`` (jagged nested tensors,
  dense stacks of scalars, ``NonTensorStack``), as TQ's storage does; a get drops the requested fields that no
  sample has (as ``BatchMeta.select_fields``) and refuses a field some samples lack (TQ: "not ready").
* :class:`WorkerGroup`: the worker-group dispatch on one rank. A ``KVBatchMeta`` argument becomes the worker's
  ``TensorDict`` as verl's ``tqbridge`` makes it (the meta's fields, ``extra_info`` as non-tensor data), and every
  tensor output is written back to the store; the real worker method runs in between.
* :class:`CPUPlatform`: verl's platform plugin interface (``set_platform``) pointed at the CPU, so that the FSDP
  engine's ``forward_step`` (device moves, ``torch.autocast``) runs here; a one-rank gloo process group stands for
  NCCL, and the engine's module is the plain model (no FSDP wrap, no device mesh).

Nothing here adds, renames or filters a field: what reaches the trainer comes from verl's methods.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transfer_queue import KVBatchMeta
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.utils import tensordict_utils as tu


class KVStore:
    """In-memory ``kv_batch_get`` / ``kv_batch_put`` / ``kv_clear`` with TQ's per-sample storage and packing."""

    def __init__(self):
        self.rows: dict[tuple[str, str], dict] = {}
        self.tags: dict[tuple[str, str], dict] = {}

    @staticmethod
    def _sample(value, i: int):
        if isinstance(value, torch.Tensor):
            return value.unbind()[i] if value.is_nested else value[i]
        if isinstance(value, NonTensorStack):
            return value.tolist()[i]
        raise TypeError(f"TQ stores tensors and NonTensorStack columns, not {type(value).__name__}")

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None, data_parser=None) -> KVBatchMeta:
        if fields is None and tags is None:
            raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
        if fields is not None and fields.batch_size[0] != len(keys):
            raise ValueError("`keys` does not match the `fields` TensorDict")
        for i, key in enumerate(keys):
            row = self.rows.setdefault((partition_id, key), {})
            self.tags.setdefault((partition_id, key), {}).update(tags[i] if tags is not None else {})
            for name in fields.keys() if fields is not None else ():
                row[name] = self._sample(fields.get(name), i)
        common = set.intersection(*(set(self.rows[(partition_id, key)]) for key in keys))
        return KVBatchMeta(
            keys=list(keys),
            tags=[copy.deepcopy(self.tags[(partition_id, key)]) for key in keys],
            partition_id=partition_id,
            fields=sorted(common),
        )

    def kv_batch_get(self, keys, partition_id, select_fields=None) -> TensorDict:
        """TQ's ``kv_batch_get``: a field some requested samples lack is not ready (an error)."""
        return self.get(keys, partition_id, select_fields, strict=True)

    def get(self, keys, partition_id, select_fields=None, strict=False) -> TensorDict:
        """``strict=False``: TQ's storage read behind ``tqbridge`` (no readiness check): a sample that lacks a field
        gives ``None`` there, and the column packs as a ``NonTensorStack``."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        if any((partition_id, key) not in self.rows for key in keys):
            raise ValueError("keys or partition were not found!")
        rows = [self.rows[(partition_id, key)] for key in keys]
        present = set().union(*rows)
        wanted = [select_fields] if isinstance(select_fields, str) else select_fields
        fields = [name for name in (sorted(present) if wanted is None else wanted) if name in present]
        if strict and any(name not in row for row in rows for name in fields):
            raise ValueError("Some fields are not ready in all the requested keys!")
        pack = AsyncSimpleStorageManager._pack_field_values
        return TensorDict({name: pack([row.get(name) for row in rows]) for name in fields}, batch_size=len(keys))

    def kv_clear(self, keys, partition_id) -> None:
        for key in [keys] if isinstance(keys, str) else keys:
            self.rows.pop((partition_id, key), None)
            self.tags.pop((partition_id, key), None)

    def install(self, monkeypatch) -> None:
        import transfer_queue

        for name in ("kv_batch_get", "kv_batch_put", "kv_clear"):
            monkeypatch.setattr(transfer_queue, name, getattr(self, name))


class WorkerGroup:
    """One rank's worker behind verl's dispatch: ``KVBatchMeta`` in and out as ``tqbridge`` converts them."""

    def __init__(self, worker, store: KVStore):
        self.worker, self.store = worker, store
        self._dispatch_info = {}

    def _query_dispatch_info(self, mesh_name):
        return [0]  # one data-parallel rank

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        method = getattr(self.worker, name)

        def call(*args, **kwargs):
            meta = next((arg for arg in args if isinstance(arg, KVBatchMeta)), None)
            if meta is None:
                return method(*args, **kwargs)
            output = method(self._to_data(meta), *args[1:], **kwargs)
            return self._write_back(output, meta)

        return call

    def _to_data(self, meta: KVBatchMeta) -> TensorDict:
        data = self.store.get(meta.keys, meta.partition_id, select_fields=meta.fields)
        for key, value in copy.deepcopy(meta.extra_info).items():
            if isinstance(value, NonTensorData | NonTensorStack):
                data[key] = value
            else:
                tu.assign_non_tensor_data(tensor_dict=data, key=key, val=value)
        return data

    def _write_back(self, output, meta: KVBatchMeta):
        if not (isinstance(output, TensorDict) and output.batch_size):
            return output
        fields, extra = [], {}
        for key, value in output.items():
            if isinstance(value, torch.Tensor | NonTensorStack):
                fields.append(key)
            elif isinstance(value, NonTensorData):
                extra[key] = value.data
            else:
                raise ValueError(f"Unsupported type {type(value)} for key {key} in output TensorDict.")
        result = self.store.kv_batch_put(meta.keys, meta.partition_id, fields=output.select(*fields))
        result.extra_info, result.tags = extra, meta.tags
        return result


class _CPUModule:
    """``torch.cpu`` with the memory queries verl's worker logs (no accelerator memory: 0)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def max_memory_allocated(self, *args):
        return 0

    def max_memory_reserved(self, *args):
        return 0

    def empty_cache(self):
        return None

    def get_device_name(self, *args):
        return "CPU"


class CPUPlatform(PlatformCUDA):
    """verl's platform interface on the CPU: device ``cpu``, autocast on the CPU, gloo."""

    device_name = "cpu"
    device_module = _CPUModule()

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def communication_backend_name(self) -> str:
        return "gloo"


def use_cpu_platform():
    """Set :class:`CPUPlatform`; returns the previous platform (restore with ``platform_manager._current_platform``)."""
    previous = platform_manager._current_platform
    platform_manager._current_platform = CPUPlatform()
    return previous


def ensure_process_group(path) -> bool:
    """A one-rank gloo process group (what verl's engine all-reduces over); True if this call made it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{path}")
    return True


def training_worker(model, *, remove_padding: bool, fused: bool, autocast_dtype=torch.float32, max_tokens=None):
    """verl's ``TrainingWorker`` around a real ``FSDPEngineWithLMHead`` (its own ``__init__``; the module is the
    model itself). ``max_tokens``: dynamic batch size with that token budget per micro-batch, else 2 per batch."""
    from verl.utils.flops_counter import FlopsCounter
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import TrainingWorker

    engine_config = FSDPEngineConfig(
        use_torch_compile=False,
        strategy="fsdp",
        use_dynamic_bsz=max_tokens is not None,
        infer_max_token_len_per_gpu=max_tokens,
        infer_micro_batch_size_per_gpu=2,
    )
    engine_config.use_remove_padding, engine_config.use_fused_kernels = remove_padding, fused  # as TrainingWorker
    model_config = SimpleNamespace(use_remove_padding=remove_padding, lora_rank=0)
    engine = FSDPEngineWithLMHead(model_config, engine_config, optimizer_config=None, checkpoint_config=None)
    engine.module, engine._autocast_dtype = model, autocast_dtype  # what _build_fsdp_module sets
    worker = object.__new__(TrainingWorker)
    worker.engine, worker.engine_config, worker.device_name = engine, engine_config, "cpu"
    worker.model_config = {"use_remove_padding": remove_padding, "use_fused_kernels": fused}
    worker.flops_counter, worker.loss_fn = FlopsCounter(model.config), None
    return worker


def actor_rollout_ref_worker(actor, ref=None, config=None, detach: bool = False):
    """verl's ``ActorRolloutRefWorker`` (or the separate-async trainer's ``DetachActorWorker``) holding ``actor``
    (and ``ref``) training workers."""
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = object.__new__(DetachActorWorker if detach else ActorRolloutRefWorker)
    worker.actor, worker.ref, worker.config = actor, ref, config
    worker.enable_routing_replay, worker._strategy_handlers = False, None
    return worker


def agent_loop_samples(seed: int, prompts: int, n: int, vocab: int, outputs_per_session=None):
    """(keys, fields, tags) as V1's agent loop puts them in TQ (``AgentLoopOutput.as_dict()`` and the fields its
    post-processing adds): ``{uid}_{session}_{i}`` keys, one sample per output with its prompt, response, masks, the
    rollout's log-probs, rewards on the last response token. Sequences have 7 to 12 tokens (two never fit a budget of
    12: one sequence per remove-padding micro-batch). ``outputs_per_session``: a dict
    ``(prompt, session) -> k`` of sessions that return k outputs (the earlier ones get the final reward, as verl)."""
    rng = np.random.default_rng(seed)
    keys, fields, tags = [], [], []
    for p in range(prompts):
        uid = f"u{p}x{seed}"
        prompt = torch.tensor(rng.integers(0, vocab, size=int(rng.integers(4, 6))))
        for s in range(n):
            k = (outputs_per_session or {}).get((p, s), 1)
            reward = float(rng.choice([0.0, 1.0, 0.5]))
            for i in range(k):
                response = torch.tensor(rng.integers(0, vocab, size=int(rng.integers(3, 8))))
                mask = torch.ones_like(response)
                if len(response) > 3 and rng.random() < 0.3:
                    mask[1] = 0  # a tool token inside a multi-turn response
                scores = torch.zeros(len(response), dtype=torch.float32)
                scores[-1] = reward
                ids = torch.cat([prompt, response])
                steps = dict(min_global_steps=0, max_global_steps=0)
                keys.append(f"{uid}_{s}_{i}")
                fields.append(
                    dict(
                        prompts=prompt, responses=response, response_mask=mask, rm_scores=scores, num_turns=2,
                        rollout_log_probs=-torch.rand(len(response)), extra_fields=steps, uid=uid, session_id=s,
                        global_steps=0, loss_mask=mask, input_ids=ids, position_ids=torch.arange(len(ids)),
                        multi_modal_inputs={},
                    )
                )  # fmt: skip
                tags.append(dict(status="success", prompt_len=len(prompt), response_len=len(response),
                                 seq_len=len(ids), global_steps=0, **steps))  # fmt: skip
    return keys, fields, tags


def reference_inputs(forward, model, samples, temperature: float):
    """``(rewards, mask, index, old_log_probs, sum_pi_squared)`` [B, R] from a plain full-logits forward of
    ``model`` (``forward``: the Hugging Face class forward), one sequence at a time, fp32 logits, fp64 after."""
    _, fields, _ = samples
    width = max(len(f["responses"]) for f in fields)
    out = {name: torch.zeros(len(fields), width, dtype=torch.float64) for name in ("r", "m", "lp", "sp")}
    with torch.no_grad():
        for row, f in enumerate(fields):
            logits = forward(model, input_ids=f["input_ids"][None]).logits[0].double() / temperature
            P, R = len(f["prompts"]), len(f["responses"])
            log_probs = logits[P - 1 : P + R - 1].log_softmax(-1)
            out["lp"][row, :R] = log_probs.gather(-1, f["responses"][:, None]).squeeze(-1)
            out["sp"][row, :R] = log_probs.exp().square().sum(-1)
            out["r"][row, :R], out["m"][row, :R] = f["rm_scores"].double(), f["response_mask"].double()
    index = [f["uid"] for f in fields]
    return out["r"].float(), out["m"].float(), index, out["lp"].float(), out["sp"].float()
