"""Σπ² through verl's V1 trainer (``trainer.use_v1=true``, verl's default; verl 0.9.1), for any estimator.

Keyed on ``actor_rollout_ref.actor.calculate_sum_pi_squared=true``, as the legacy trainer is: the route does not
look at the estimator, so ``otb_ref.*`` names and verl's own ``optimal_token_baseline`` and
``tir_optimal_token_baseline`` are fed alike. V1 keeps a batch in TransferQueue (TQ) and hands workers only keys;
:func:`install` wraps three methods of the V1 base class ``PPOTrainer`` (every mode's trainer inherits them; the
separate-async trainer's own ``_compute_old_log_prob`` delegates to the base one) and one function its module
imported:

1. ``_compute_old_log_prob``: puts ``calculate_sum_pi_squared=True`` in the batch's ``extra_info`` for the actor's
   pass only (verl's worker bridge turns ``extra_info`` into the worker's flags, and writes every tensor output
   back, so the engine's full-sequence ``sum_pi_squared`` lands in TQ beside ``log_probs``); right after the pass
   it cuts the response part with verl's ``response_from_nested``, as verl cuts ``old_log_probs``, and stores it
   in fp32 under :data:`SNAPSHOT`. The flag is removed after the pass, and the snapshot has a name no worker
   writes, so a reference pass (other weights) cannot overwrite the actor's Σπ².
2. ``_compute_advantage``: reads :data:`SNAPSHOT` and hands it, padded like verl's other inputs, to the advantage
   step as ``sum_pi_squared`` (through ``compute_advantage_for_multi_trajectories``, whose batch verl builds from a
   field list local to the method); verl's ``compute_advantage`` then passes it, the old log-probs and rollout IS
   weights to its own OTB, and otb_ref's wrap (:mod:`otb_ref.integrations.verl`) to ``otb_ref.*`` names.
3. ``_compute_metrics``: verl's V1 fetches no Σπ² for the W-score metrics (``variance_proxy/*``); after verl's
   metrics, the same function verl's legacy trainer uses computes them on the batch's real (non-padding) rows.

Rows: V1's synthetic padding rows (``_balance_batch``) share one ``pad…`` uid and an all-zero response mask: they
form their own group, get zero advantages and move no real row's baseline. An agent loop that returns several
outputs per session (keys ``{uid}_{session}_{i}``) puts each output in its uid's group as a response of its own
(verl's rule for every estimator but GRPO). Opt out with the environment variable ``OTB_REF_VERL_V1_ROUTE=0``
(set where the trainer runs): the V1 trainer is then verl's, unchanged, and proxy estimators on it are refused at
``validate_config``.
"""

from __future__ import annotations

import contextvars
import functools
import os
from typing import Any

import torch

__all__ = ["SNAPSHOT", "OPT_OUT", "install", "opted_out", "wants_sum_pi_squared", "trainer_problem"]

SNAPSHOT = "otb_ref_old_sum_pi_squared"  # TQ field: the actor's Σπ² of the old-log-prob pass, response part, fp32
ENGINE_FIELD = "sum_pi_squared"  # what verl's engine returns (full sequence, like log_probs)
FLAG = "calculate_sum_pi_squared"  # the worker flag verl's engines read
OPT_OUT = "OTB_REF_VERL_V1_ROUTE"
METHODS = ("_compute_old_log_prob", "_compute_advantage", "_compute_metrics")
# Overrides in verl 0.9.1's registered trainers that call the base method (read in its source).
DELEGATING_OVERRIDES = {("PPOTrainerSeparateAsync", "_compute_old_log_prob")}
_MARK = "_otb_ref_v1_route"
_PENDING: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("otb_ref_v1_spsq", default=None)


def opted_out() -> bool:
    return os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "off", "no")


def _bypass(config: Any) -> bool:
    correction = config.algorithm.get("rollout_correction", None)
    return bool(correction is not None and correction.get("bypass_mode", False))


def wants_sum_pi_squared(config: Any) -> bool:
    """The legacy trainer's rule: ``actor.calculate_sum_pi_squared`` set and an old-log-prob pass that runs."""
    return bool(config.actor_rollout_ref.actor.get(FLAG, False)) and not _bypass(config)


def _kv():
    import transfer_queue as tq

    return tq


def _snapshot(batch):
    """Cut the actor's full-sequence Σπ² to its response part (as verl cuts old_log_probs) and store it."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_from_nested

    tq = _kv()
    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=[ENGINE_FIELD, "response_mask"]
    )
    if ENGINE_FIELD not in data.keys():
        raise RuntimeError(
            "otb_ref: the actor's old-log-prob pass returned no sum_pi_squared although asked "
            "(actor_rollout_ref.actor.calculate_sum_pi_squared=true); its engine computes none: set "
            "actor_rollout_ref.actor.strategy=fsdp, or see `python -m otb_ref.integrations.verl --check`"
        )
    values = response_from_nested(data[ENGINE_FIELD], data["response_mask"])
    values = torch.nested.nested_tensor_from_jagged(values.values().float(), values.offsets())
    fields = TensorDict({SNAPSHOT: values}, batch_size=len(batch.keys))
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)


def _old_log_prob(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, metrics):
        if not wants_sum_pi_squared(self.config):
            return original(self, batch, metrics)
        if batch.extra_info is None:
            batch.extra_info = {}
        asked = batch.extra_info
        asked[FLAG] = True
        try:
            result = original(self, batch, metrics)
        finally:
            asked.pop(FLAG, None)  # the reference pass and the update do not compute Σπ²
        if result.extra_info is not None:
            result.extra_info.pop(FLAG, None)
        return _snapshot(result)

    return _compute_old_log_prob


def _advantage(original):
    @functools.wraps(original)
    def _compute_advantage(self, batch, metrics):
        if not wants_sum_pi_squared(self.config):
            return original(self, batch, metrics)
        data = _kv().kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[SNAPSHOT])
        if SNAPSHOT not in data.keys():
            raise RuntimeError(
                f"otb_ref: no {SNAPSHOT} in TransferQueue at the advantage step: the old-log-prob pass did not run "
                f"through otb_ref's V1 route (a trainer whose _compute_old_log_prob does not call PPOTrainer's)"
            )
        token = _PENDING.set(data[SNAPSHOT].to_padded_tensor(0.0))
        try:
            return original(self, batch, metrics)
        finally:
            _PENDING.reset(token)

    return _compute_advantage


def _multi_trajectories(original):
    """``compute_advantage_for_multi_trajectories`` that adds the pending Σπ² to verl's padded batch."""

    @functools.wraps(original)
    def compute_advantage_for_multi_trajectories(data, *args, **kwargs):
        pending = _PENDING.get()
        if pending is not None:
            mask = data.batch["response_mask"]
            if pending.shape != mask.shape:
                raise RuntimeError(f"otb_ref: Σπ² {tuple(pending.shape)} is not laid out as {tuple(mask.shape)}")
            data.batch[ENGINE_FIELD] = pending.to(mask.device)
        return original(data, *args, **kwargs)

    return compute_advantage_for_multi_trajectories


def variance_proxy_metrics(batch, gradient_norm) -> dict:
    """verl's ``compute_variance_proxy_metrics`` on the batch's real rows, with the snapshot as ``sum_pi_squared``."""
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    real = [not tag.get("is_padding", False) for tag in batch.tags]
    keys = [key for key, keep in zip(batch.keys, real, strict=True) if keep] if any(real) else list(batch.keys)
    fields = ["advantages", "response_mask", "old_log_probs", SNAPSHOT, "rollout_is_weights"]
    data = _kv().kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields)
    if SNAPSHOT not in data.keys():
        return {}
    padded = data.to_padded_tensor()
    padded[ENGINE_FIELD] = padded.pop(SNAPSHOT)
    return compute_variance_proxy_metrics(batch=DataProto(batch=padded), gradient_norm=gradient_norm)


def _metrics(original):
    @functools.wraps(original)
    def _compute_metrics(self, batch, metrics, *args, **kwargs):
        result = original(self, batch, metrics, *args, **kwargs)
        if wants_sum_pi_squared(self.config):
            metrics.update(variance_proxy_metrics(batch, metrics.get("actor/grad_norm", None)))
        return result

    return _compute_metrics


WRAPS = {"_compute_old_log_prob": _old_log_prob, "_compute_advantage": _advantage, "_compute_metrics": _metrics}


def install() -> bool:
    """Wrap the V1 base trainer's methods (idempotent); ``False`` where opted out or verl's V1 is not the expected
    one."""
    if opted_out():
        return False
    try:
        from verl.trainer.ppo.v1 import trainer_base
    except ImportError:
        return False
    base = trainer_base.PPOTrainer
    if any(getattr(base, name, None) is None for name in METHODS) or not hasattr(
        trainer_base, "compute_advantage_for_multi_trajectories"
    ):
        return False
    for name, wrap in WRAPS.items():
        current = getattr(base, name)
        if not getattr(current, _MARK, False):
            wrapped = wrap(current)
            setattr(wrapped, _MARK, True)
            setattr(base, name, wrapped)
    current = trainer_base.compute_advantage_for_multi_trajectories
    if not getattr(current, _MARK, False):
        wrapped = _multi_trajectories(current)
        setattr(wrapped, _MARK, True)
        trainer_base.compute_advantage_for_multi_trajectories = wrapped
    return True


def trainer_problem(mode: str) -> str | None:
    """Why the V1 trainer of ``mode`` does not run the route (an override that bypasses it), or None."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    try:
        cls = get_trainer_cls(mode)
    except ValueError as error:
        return str(error)
    for name in METHODS:
        method = getattr(cls, name)
        if getattr(method, _MARK, False) or (cls.__name__, name) in DELEGATING_OVERRIDES:
            continue
        return f"the trainer {cls.__name__} ({mode!r}) overrides {name} without otb_ref's V1 route"
    return None
