"""otb_ref's estimators inside verl, as a plugin: ``algorithm.adv_estimator=otb_ref.<name>`` (tested: verl 0.9.1).

Installing otb_ref beside verl is enough: ``import verl`` loads the entry point ``otb_ref`` of the group
``verl.plugins`` (pyproject.toml), which imports :mod:`otb_ref.integrations.verl_plugin` and so calls
:func:`install`. Names: ``otb_ref.<estimator>`` for every estimator of :data:`otb_ref.ESTIMATORS`, with the
suffixes ``_loo`` (leave-one-out) and ``_std`` (std scaling), e.g. ``otb_ref.otb_loo``. Options, all optional:
``+algorithm.otb_ref.{leave_one_out,std_normalize,handle_zero_tail,multi_turn,epsilon}=...``; their defaults are
:func:`otb_ref.compute_advantages`' (so ``otb_ref.otb`` equals verl's ``optimal_token_baseline`` with
``+algorithm.otb_ref.handle_zero_tail=true``, verl's default there).

What works in verl 0.9.1, on its default V1 trainer (``trainer.use_v1=true``, every ``trainer.v1.trainer_mode``)
and on the legacy one alike:

==========================================  ===========================================================
estimators                                  V1 and legacy trainers
==========================================  ===========================================================
rewards only: grpo, rloo, opo,              yes
token_mean, token_length
proxy: otb, sequence_proxy, and verl's own  with ``actor.calculate_sum_pi_squared=true``; engines and
optimal_token_baseline and                  fused kernels: the next table
tir_optimal_token_baseline
exact: eob, otb_exact                       no: verl computes no per-response gradient norms
==========================================  ===========================================================

Where proxy estimators get Σπ² (``actor.calculate_sum_pi_squared=true``); every "refused" is refused by
``validate_config`` before any worker starts, with the keys to change:

==================================================  ========================================================
actor engine (``actor.strategy``) and model         Σπ²
==================================================  ========================================================
fsdp / fsdp2, ``model.use_fused_kernels=false``     verl's own, from the full logits
fsdp / fsdp2, fused kernels with                    otb_ref's route (:mod:`otb_ref.integrations.verl_fused`):
``fused_kernel_options.impl_backend=torch`` (or     in verl's fused chunk loop, no ``[T, V]`` logits, fp32
``liger`` without liger-kernel: the same forward)   under verl's autocast; remove-padding on and off
fused kernels, ``impl_backend=triton``              refused: ``impl_backend=torch`` or
                                                    ``use_fused_kernels=false``
fused kernels, ``liger`` with liger-kernel          refused: as triton
fused kernels, vision-language model, or a head     refused: ``use_fused_kernels=false`` (known at validation
that rescales or caps its logits (Granite,          when ``model.path`` is a local directory; otherwise at
Cohere, Gemma2/3: config keys)                      the first old-log-prob pass)
megatron, veomni (or fsdp_turbo), fused kernels     refused: ``use_fused_kernels=false``
megatron, veomni, fsdp_turbo without fused kernels  verl's own
automodel, torchtitan (any mode)                    refused: ``actor.strategy=fsdp`` (they compute no Σπ²)
``algorithm.rollout_correction.bypass_mode=true``   refused: ``bypass_mode=false`` (no old-log-prob pass)
==================================================  ========================================================

Proxy estimators need Σπ² and old log-probs; verl passes them (and rollout IS weights) only to its own two OTB
names, and its V1 trainer computes no Σπ² at all. :func:`install` therefore wraps ``compute_advantage`` in both
modules that hold it (``ray_trainer`` and ``v1.utils``) so that ``otb_ref.*`` names receive the same three keys,
installs the V1 route (:mod:`otb_ref.integrations.verl_v1`: the old-log-prob pass asks for Σπ², which reaches the
advantage step and the W-score metrics; opt out with ``OTB_REF_VERL_V1_ROUTE=0``) and the fused-kernel route, and
wraps ``validate_config`` so that a configuration that cannot feed the chosen estimator fails before training
starts, with one message naming the keys to set. ``validate_config`` also refuses, for any estimator, an
environment with a TRL that verl's FSDP model build cannot import (TRL 1.16: install the extras apart). The wraps
are installed for the verl versions in :data:`TESTED_VERL` only. ``python -m otb_ref.integrations.verl --check
[overrides…]`` (:mod:`otb_ref.integrations.verl_check`) reports all of this for a run, in a fresh interpreter.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import logging
from pathlib import Path
from typing import Any

from otb_ref.advantages import compute_advantages
from otb_ref.estimators import ESTIMATORS
from otb_ref.integrations import verl_fused, verl_v1

__all__ = ["PREFIX", "TESTED_VERL", "install", "resolve", "config_problems", "registered_names"]

PREFIX = "otb_ref."
TESTED_VERL = ("0.9.1",)
ROUTE_KEYS = ("sum_pi_squared", "old_log_probs", "rollout_is_weights")  # what verl hands its own OTB
OPTIONS = ("leave_one_out", "std_normalize", "handle_zero_tail", "multi_turn", "epsilon")
SUFFIXES = {"_loo": "leave_one_out", "_std": "std_normalize"}
_log = logging.getLogger(__name__)
_route_installed = False
_fused_route_installed = False
_v1_route_installed = False
VERL_PROXY_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")  # verl's own OTB (needs Σπ²)

EXACT_UNSUPPORTED = (
    "verl computes no per-response gradient norms (||S||², ||S_t||²); use otb_ref.otb (the proxy) in verl, "
    "or train.py --estimator {name} on a small model"
)


def registered_names() -> list[str]:
    """Every name :func:`install` registers: ``otb_ref.<estimator>[_loo][_std]``."""
    return [PREFIX + name + loo + std for name in ESTIMATORS for loo in ("", "_loo") for std in ("", "_std")]


def _name_of(adv_estimator: Any) -> str:
    return str(getattr(adv_estimator, "value", adv_estimator))


def is_ours(adv_estimator: Any) -> bool:
    return _name_of(adv_estimator).startswith(PREFIX)


def resolve(adv_estimator: Any, config: Any = None) -> tuple[str, dict]:
    """``(estimator name, compute_advantages options)`` of ``otb_ref.<name>[_loo][_std]`` and the optional
    ``algorithm.otb_ref`` section of ``config``. Raises ValueError naming the config key that is wrong."""
    name = _name_of(adv_estimator).removeprefix(PREFIX)
    options: dict[str, Any] = {}
    for suffix in ("_std", "_loo"):  # "_std" comes last when both are given
        if name.endswith(suffix):
            name, options[SUFFIXES[suffix]] = name.removesuffix(suffix), True
    if name not in ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator: unknown otb_ref estimator {_name_of(adv_estimator)!r}; "
            f"choose otb_ref.<name>[_loo][_std] with <name> one of {sorted(ESTIMATORS)}"
        )
    section = config.get("otb_ref", None) if config is not None and hasattr(config, "get") else None
    for key in section.keys() if section is not None else ():
        if key not in OPTIONS:
            raise ValueError(f"algorithm.otb_ref.{key}: unknown option; the options are {list(OPTIONS)}")
        value = section[key]
        if key in options and value is not None and bool(value) != options[key]:
            raise ValueError(
                f"algorithm.otb_ref.{key}={value} contradicts the name {_name_of(adv_estimator)!r}; drop one"
            )
        if value is not None:
            options[key] = float(value) if key == "epsilon" else bool(value)
    return name, options


FSDP_STRATEGIES = ("fsdp", "fsdp2")
NO_SUM_PI_SQUARED_ENGINES = ("automodel", "torchtitan")  # verl 0.9.1's engines that compute no Σπ² in any mode
# Model types whose fused forward is not verl's text-model one (models/transformers/monkey_patch.py, verl 0.9.1).
VISION_LANGUAGE_TYPES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "qwen3_5",
    "qwen3_5_moe",
    "kimi_vl",
)


def config_problems(config: Any) -> list[str]:
    """What a full verl config (``DictConfig``) lacks to feed its estimator, one line per key: an ``otb_ref.*`` name,
    or verl's own OTB (:data:`VERL_PROXY_ESTIMATORS`, which needs Σπ² as ours do); ``[]`` when it is fine or the
    estimator is another of verl's (but for an environment in which verl cannot build a model, refused whatever the
    estimator)."""
    problems = _environment_problems(config)
    adv_estimator = config.algorithm.adv_estimator
    if not is_ours(adv_estimator):
        return problems + (_proxy_problems(config) if _name_of(adv_estimator) in VERL_PROXY_ESTIMATORS else [])
    name, _ = resolve(adv_estimator, config.algorithm)
    energy = ESTIMATORS[name].energy
    if energy == "exact":
        return problems + [
            f"algorithm.adv_estimator={_name_of(adv_estimator)}: unsupported: " + EXACT_UNSUPPORTED.format(name=name)
        ]
    return problems + (_proxy_problems(config) if energy == "proxy" else [])


def _proxy_problems(config: Any) -> list[str]:
    """What a config lacks to give an estimator Σπ² and old log-probs (any trainer, engine, kernels)."""
    problems = []
    if not _route_installed:
        problems.append(f"verl {_verl_version()} is not a tested version {TESTED_VERL}: no route for Σπ²")
    elif config.trainer.get("use_v1", True):
        problems.extend(_v1_problems(config))
    if not config.actor_rollout_ref.actor.get("calculate_sum_pi_squared", False):
        problems.append("actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    correction = config.algorithm.get("rollout_correction", None)
    if correction is not None and correction.get("bypass_mode", False):
        problems.append(
            "algorithm.rollout_correction.bypass_mode=false (bypass mode skips the old-log-prob pass, "
            "the one that computes Σπ²)"
        )
    return problems + _engine_problems(config.actor_rollout_ref)


def _v1_problems(config: Any) -> list[str]:
    """Why the V1 trainer the config selects would not deliver Σπ² (otb_ref's V1 route off or bypassed)."""
    if not _v1_route_installed:
        reason = f"{verl_v1.OPT_OUT}=0 turned it off" if verl_v1.opted_out() else f"verl {_verl_version()}'s V1 differs"
        return [
            f"unset {verl_v1.OPT_OUT} or trainer.use_v1=false (otb_ref's V1 route for Σπ² is not installed: {reason})"
        ]
    mode = _trainer_mode(config)
    problem = verl_v1.trainer_problem(mode)
    return [f"trainer.v1.trainer_mode=sync, colocate_async or separate_async ({problem})"] if problem else []


def _trainer_mode(config: Any) -> str:
    v1 = config.trainer.get("v1", None)
    return str(v1.get("trainer_mode", "sync")) if v1 is not None else "sync"


def _engine_problems(actor_rollout_ref: Any) -> list[str]:
    """The actor's engine and fused-kernel settings that give no Σπ² (verl 0.9.1)."""
    actor, model = actor_rollout_ref.actor, actor_rollout_ref.model
    strategy = actor.get("strategy", "fsdp")
    if strategy in NO_SUM_PI_SQUARED_ENGINES:
        return [f"actor_rollout_ref.actor.strategy=fsdp (or fsdp2, megatron; the {strategy} engine computes no Σπ²)"]
    if not (model.get("use_fused_kernels", False) or actor.get("use_fused_kernels", False)):
        return []
    reason = _fused_refusal(strategy, model)
    return [f"actor_rollout_ref.model.use_fused_kernels=false ({reason})"] if reason else []


def _fused_refusal(strategy: str, model: Any) -> str | None:
    """Why fused kernels give no Σπ² with this engine and model config, or None where otb_ref's route covers them."""
    if strategy not in FSDP_STRATEGIES:
        return (
            f"verl computes no Σπ² in fused kernels on the {strategy} engine; otb_ref's route covers the FSDP engine, "
            "actor_rollout_ref.actor.strategy=fsdp or fsdp2"
        )
    if not _fused_route_installed:
        return f"otb_ref's fused-kernel route for Σπ² is not installed on verl {_verl_version()}"
    options = model.get("fused_kernel_options", None)
    backend = options.get("impl_backend", "torch") if options is not None else "torch"
    keep_fused = "; or keep fused kernels with actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"
    if backend not in ("torch", "liger"):
        return f"the {backend} backend's kernel gives no Σπ²" + keep_fused
    if backend == "liger" and importlib.util.find_spec("liger_kernel") is not None:
        return "liger-kernel is installed, so the liger backend runs liger's kernel, which gives no Σπ²" + keep_fused
    hf_config = _local_hf_config(model.get("path", None))
    if hf_config is None:
        return None
    if "vision_config" in hf_config or hf_config.get("model_type") in VISION_LANGUAGE_TYPES:
        return "a vision-language model: verl's fused forward for it is not covered"
    rescaled = verl_fused.logit_rescaling(hf_config)
    if rescaled is not None:
        return f"the model's head rescales or caps its logits ({rescaled}), which verl's fused forward does not apply"
    return None


def _local_hf_config(path: Any) -> dict | None:
    """config.json of the model at ``path`` (a local directory), or None if unreadable (the engine then checks the
    loaded model at the first old-log-prob pass instead)."""
    config_file = Path(str(path)) / "config.json" if path else None
    if config_file is None or not config_file.is_file():
        return None
    try:
        hf_config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return hf_config if isinstance(hf_config, dict) else None


def _environment_problems(config: Any) -> list[str]:
    """verl 0.9.1's FSDP model build imports trl's AutoModelForCausalLMWithValueHead whenever TRL is installed."""
    from omegaconf import OmegaConf

    actor = OmegaConf.select(config, "actor_rollout_ref.actor", default=None) if OmegaConf.is_config(config) else None
    strategy = actor.get("strategy", "fsdp") if actor is not None else "fsdp"
    if strategy not in FSDP_STRATEGIES or importlib.util.find_spec("trl") is None:
        return []
    for module in ("trl.experimental.ppo", "trl"):
        try:
            if hasattr(importlib.import_module(module), "AutoModelForCausalLMWithValueHead"):
                return []
        except ImportError:
            continue
    return [
        "an environment without TRL (pip uninstall trl; install otb_ref's extras [verl] and [trl] in separate "
        "environments): verl's FSDP model build imports trl's AutoModelForCausalLMWithValueHead, which this TRL "
        "lacks"
    ]


def _missing_inputs_message(registered: str) -> str:
    return (
        f"{registered} needs sum_pi_squared and old_log_probs, which verl did not pass. Set "
        "actor_rollout_ref.actor.calculate_sum_pi_squared=true and algorithm.rollout_correction.bypass_mode=false; "
        "fused kernels need the FSDP engine's torch backend. `python -m otb_ref.integrations.verl --check "
        "[your overrides]` lists every key to change"
        + ("" if _route_installed else f"; and use a tested verl {TESTED_VERL} (found {_verl_version()})")
    )


def _advantage_fn(registered: str):
    """The function registered under ``registered`` (``otb_ref.<name>[_loo][_std]``), called by verl as
    ``fn(token_level_rewards=, response_mask=, config=, index=uid, [reward_baselines=], [the ROUTE_KEYS])``."""

    def otb_ref_advantage(
        token_level_rewards,
        response_mask,
        index=None,
        config=None,
        sum_pi_squared=None,
        old_log_probs=None,
        rollout_is_weights=None,
        **unused,
    ):
        name, options = resolve(registered, config)
        energy = ESTIMATORS[name].energy
        if energy == "exact":
            raise ValueError(f"{registered}: unsupported: " + EXACT_UNSUPPORTED.format(name=name))
        if index is None:
            raise ValueError(f"{registered}: index: verl passed no uid; groups are the responses of one uid")
        inputs = {}
        if energy == "proxy":
            if sum_pi_squared is None or old_log_probs is None:
                raise ValueError(_missing_inputs_message(registered))
            inputs = dict(old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared)
        if energy in ("length", "proxy") and rollout_is_weights is not None:
            inputs["rollout_is_weights"] = rollout_is_weights  # per-token energies only (§4)
        return compute_advantages(name, token_level_rewards, response_mask, index, **inputs, **options)

    otb_ref_advantage.__qualname__ = otb_ref_advantage.__name__ = registered.replace(".", "_")
    return otb_ref_advantage


def _with_proxy_route(original):
    """``compute_advantage`` that hands ``otb_ref.*`` estimators the ROUTE_KEYS present in ``data.batch`` (verl
    does this for its own OTB only); every other estimator goes to verl's function unchanged."""
    if getattr(original, "_otb_ref_route", False):
        return original
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_advantage(data, adv_estimator, *args, **kwargs):
        if not is_ours(adv_estimator):
            return original(data, adv_estimator, *args, **kwargs)
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.ray_trainer import compute_response_mask

        config = signature.bind(data, adv_estimator, *args, **kwargs).arguments.get("config")
        if "response_mask" not in data.batch.keys():
            data.batch["response_mask"] = compute_response_mask(data)
        inputs = {key: data.batch[key] for key in ROUTE_KEYS if key in data.batch.keys()}
        if "uid" in data.non_tensor_batch:
            inputs["index"] = data.non_tensor_batch["uid"]
        fn = core_algos.get_adv_estimator_fn(_name_of(adv_estimator))
        advantages, returns = fn(
            token_level_rewards=data.batch["token_level_rewards"],
            response_mask=data.batch["response_mask"],
            config=config,
            **inputs,
        )
        data.batch["advantages"], data.batch["returns"] = advantages, returns
        return data

    compute_advantage._otb_ref_route = True
    return compute_advantage


def _with_config_check(original):
    """``validate_config`` that also refuses an ``otb_ref.*`` estimator its configuration cannot feed."""
    if getattr(original, "_otb_ref_check", False):
        return original

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        problems = config_problems(config)  # first: the cheapest check, and the one a user of ours most needs
        if problems:
            raise ValueError(
                f"algorithm.adv_estimator={_name_of(config.algorithm.adv_estimator)} cannot run with this config; "
                "set: " + "; ".join(problems)
            )
        return original(config, *args, **kwargs)

    validate_config._otb_ref_check = True
    return validate_config


def _verl_version() -> str:
    import verl

    return getattr(verl, "__version__", "unknown")


def installed_routes() -> dict[str, bool]:
    """Which routes :func:`install` put in place in this interpreter: ``compute_advantage`` (ray_trainer's and
    v1.utils', with the config check), ``fused_kernels`` (Σπ² from verl's fused LM head) and ``v1_trainer``."""
    return dict(
        compute_advantage=_route_installed, fused_kernels=_fused_route_installed, v1_trainer=_v1_route_installed
    )


def install() -> None:
    """Register every ``otb_ref.*`` name in verl's estimator registry; on a tested verl, wrap
    ``compute_advantage`` (ray_trainer and v1.utils) and ``validate_config``, and install the fused-kernel route
    for Σπ² (:func:`otb_ref.integrations.verl_fused.install`). Idempotent."""
    global _route_installed, _fused_route_installed, _v1_route_installed
    from verl.trainer.ppo import core_algos

    for registered in registered_names():
        if registered not in core_algos.ADV_ESTIMATOR_REGISTRY:
            core_algos.register_adv_est(registered)(_advantage_fn(registered))
    if _verl_version() not in TESTED_VERL:
        _log.warning("otb_ref: verl %s is untested %s: proxy estimators get no Σπ²", _verl_version(), TESTED_VERL)
        return
    try:
        import verl.utils.config as config_module
        from verl.trainer.ppo import ray_trainer
        from verl.trainer.ppo.v1 import utils as v1_utils
    except ImportError as error:  # e.g. a verl installed without its trainer's dependencies
        _log.warning("otb_ref: verl's trainer does not import (%s): proxy estimators get no Σπ²", error)
        return
    config_module.validate_config = _with_config_check(config_module.validate_config)
    for module in (ray_trainer, v1_utils):
        module.compute_advantage = _with_proxy_route(module.compute_advantage)
    _route_installed = True
    _fused_route_installed = verl_fused.install()
    if not _fused_route_installed:
        _log.warning("otb_ref: verl's fused LM-head path is not the expected one: no Σπ² with fused kernels")
    _v1_route_installed = verl_v1.install()
    if not _v1_route_installed and not verl_v1.opted_out():
        _log.warning("otb_ref: verl's V1 trainer is not the expected one: no Σπ² on trainer.use_v1=true")


if __name__ == "__main__":  # python -m otb_ref.integrations.verl --check [hydra overrides…]
    from otb_ref.integrations.verl_check import main

    raise SystemExit(main())
