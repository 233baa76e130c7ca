"""otb_ref as a verl plugin, run through verl's own ``compute_advantage`` (verl 0.9.1; skipped without verl).

Install: ``pip install -e ".[verl]"`` (or ``.ci/run``'s lines). The entry point comes from otb_ref's own metadata, so
a test fails when the installed package lacks it.
"""

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from optional import import_or_skip

from otb_ref import ESTIMATORS, compute_advantages

ray_trainer = import_or_skip("verl.trainer.ppo.ray_trainer", reason="verl not installed (pip install -e .[verl])")

import verl  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.v1 import utils as v1_utils  # noqa: E402

from otb_ref.integrations import verl as plugin  # noqa: E402

FEEDABLE = [name for name, spec in ESTIMATORS.items() if spec.energy != "exact"]
FP32 = dict(rtol=1e-6, atol=1e-6)


def test_installed_package_has_the_entry_point():
    points = importlib.metadata.entry_points(group="verl.plugins")
    assert "otb_ref.integrations.verl_plugin" in {point.value for point in points if point.name == "otb_ref"}


def test_bare_import_verl_registers_every_name_and_the_route():
    """A fresh interpreter: ``import verl`` alone (verl hides plugin errors, so this is the check)."""
    code = textwrap.dedent(
        """
        import verl
        from verl.trainer.ppo import core_algos, ray_trainer
        from verl.trainer.ppo.v1 import utils
        import verl.utils.config as config
        names = sorted(n for n in core_algos.ADV_ESTIMATOR_REGISTRY if n.startswith("otb_ref."))
        print(",".join(names))
        from otb_ref.integrations import verl as plugin
        print(ray_trainer.compute_advantage._otb_ref_route, utils.compute_advantage._otb_ref_route,
              config.validate_config._otb_ref_check, plugin._fused_route_installed, plugin._v1_route_installed)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names, flags = out.stdout.strip().splitlines()[-2:]
    assert names.split(",") == sorted(plugin.registered_names())
    assert flags == "True True True True True"


def _batch(seed: int, with_is: bool, with_proxy: bool = True, B: int = 12, T: int = 9) -> DataProto:
    """A verl batch: 3 prompts × 4 responses, variable lengths, outcome rewards, fp32."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = torch.tensor(np.arange(T)[None, :] < lengths[:, None], dtype=torch.float32)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), torch.tensor(lengths - 1)] = torch.tensor(
        rng.choice([0.0, 1.0], size=B), dtype=torch.float32
    )
    tensors = {"token_level_rewards": rewards, "response_mask": mask}
    if with_proxy:
        probs = torch.tensor(rng.dirichlet(np.ones(5), size=(B, T)), dtype=torch.float32)
        tensors["old_log_probs"] = probs[..., 0].log()
        tensors["sum_pi_squared"] = probs.square().sum(-1)
    if with_is:
        tensors["rollout_is_weights"] = torch.tensor(rng.uniform(0.2, 2.0, size=(B, T)), dtype=torch.float32)
    uid = np.array([f"p{i % 3}" for i in rng.permutation(B)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def _expected(data: DataProto, name: str, **options):
    energy = ESTIMATORS[name].energy
    inputs = {}
    if energy == "proxy":
        inputs = {key: data.batch[key] for key in ("old_log_probs", "sum_pi_squared")}
    if energy in ("length", "proxy") and "rollout_is_weights" in data.batch.keys():
        inputs["rollout_is_weights"] = data.batch["rollout_is_weights"]
    batch = data.batch
    return compute_advantages(
        name, batch["token_level_rewards"], batch["response_mask"], list(data.non_tensor_batch["uid"]), **inputs,
        **options,
    )  # fmt: skip


@pytest.mark.parametrize("name", FEEDABLE)
@pytest.mark.parametrize("suffix", ["", "_loo", "_std", "_loo_std"])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("module", [ray_trainer, v1_utils], ids=["legacy", "v1"])
def test_every_name_equals_compute_advantages(name, suffix, with_is, module):
    """Through verl's ``compute_advantage`` (legacy) and V1's ``compute_advantage_for_multi_trajectories``."""
    data = _batch(seed=len(name) + len(suffix), with_is=with_is)
    options = dict(leave_one_out="_loo" in suffix or None, std_normalize="_std" in suffix or None)
    want_adv, want_ret = _expected(data, name, **options)
    config = OmegaConf.create({"adv_estimator": f"otb_ref.{name}{suffix}"})
    if module is ray_trainer:
        out = ray_trainer.compute_advantage(data, adv_estimator=f"otb_ref.{name}{suffix}", config=config)
    else:
        keys = [f"{uid}_0_{i}" for i, uid in enumerate(data.non_tensor_batch["uid"])]
        out = v1_utils.compute_advantage_for_multi_trajectories(
            data, batch_keys=keys, adv_estimator=f"otb_ref.{name}{suffix}", config=config
        )
    torch.testing.assert_close(out.batch["advantages"], want_adv, **FP32)
    torch.testing.assert_close(out.batch["returns"], want_ret, **FP32)


def test_config_options_reach_the_estimator_and_match_verls_own_otb():
    """``algorithm.otb_ref.handle_zero_tail=true``: otb_ref.otb equals verl's optimal_token_baseline (IS weights on),
    and a multi-turn option reaches compute_advantages."""
    data = _batch(seed=3, with_is=True)
    ours = (
        ray_trainer.compute_advantage(
            data, adv_estimator="otb_ref.otb", config=OmegaConf.create({"otb_ref": {"handle_zero_tail": True}})
        )
        .batch["advantages"]
        .clone()
    )
    theirs = ray_trainer.compute_advantage(
        data, adv_estimator="optimal_token_baseline", config=OmegaConf.create({})
    ).batch["advantages"]
    # Equal up to ε |Ḡ| / (Σ W + ε) (THEORY §3: otb_ref's baseline shares ε with the members' mean): here Σ W ≥ 0.1.
    torch.testing.assert_close(
        ours, theirs, rtol=1e-6, atol=1e-6 + 1e-7 * float(data.batch["token_level_rewards"].abs().sum(-1).max())
    )
    config = OmegaConf.create({"otb_ref": {"multi_turn": True, "epsilon": 1e-6, "leave_one_out": True}})
    got = ray_trainer.compute_advantage(data, adv_estimator="otb_ref.otb", config=config).batch["advantages"]
    want, _ = _expected(data, "otb", multi_turn=True, epsilon=1e-6, leave_one_out=True)
    torch.testing.assert_close(got, want, **FP32)


def test_other_estimators_still_go_to_verl():
    data = _batch(seed=4, with_is=False)
    out = ray_trainer.compute_advantage(data, adv_estimator="rloo", config=OmegaConf.create({}))
    theirs, _ = core_algos.compute_rloo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    torch.testing.assert_close(out.batch["advantages"], theirs, **FP32)


@pytest.mark.parametrize("name", ["otb", "sequence_proxy"])
def test_proxy_name_without_sum_pi_squared_names_the_config_keys(name):
    data = _batch(seed=5, with_is=False, with_proxy=False)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true.*--check"):
        ray_trainer.compute_advantage(data, adv_estimator=f"otb_ref.{name}", config=OmegaConf.create({}))


@pytest.mark.parametrize("name", ["eob", "otb_exact"])
def test_exact_energies_are_refused(name):
    with pytest.raises(ValueError, match="unsupported: verl computes no per-response gradient norms"):
        ray_trainer.compute_advantage(_batch(6, False), adv_estimator=f"otb_ref.{name}", config=OmegaConf.create({}))


def test_bad_names_and_options_name_the_config_key():
    with pytest.raises(ValueError, match="algorithm.adv_estimator: unknown otb_ref estimator 'otb_ref.obt'"):
        plugin.resolve("otb_ref.obt")
    with pytest.raises(ValueError, match="algorithm.otb_ref.zero_tail: unknown option"):
        plugin.resolve("otb_ref.otb", OmegaConf.create({"otb_ref": {"zero_tail": True}}))
    with pytest.raises(ValueError, match="algorithm.otb_ref.leave_one_out=False contradicts the name"):
        plugin.resolve("otb_ref.otb_loo", OmegaConf.create({"otb_ref": {"leave_one_out": False}}))
    assert plugin.resolve("otb_ref.token_mean_loo_std") == ("token_mean", dict(leave_one_out=True, std_normalize=True))


def _full_config(**overrides):
    """verl's own generated trainer config with dotted overrides."""
    path = f"{verl.__path__[0]}/trainer/config/_generated_ppo_trainer.yaml"
    config = OmegaConf.load(path)
    for key, value in overrides.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def test_config_problems_name_every_key_to_set_before_training():
    """The check ``validate_config`` runs: no Σπ² is refused for otb, with the key to set; the default V1 trainer
    is fine (otb_ref's V1 route), and so is the legacy one."""
    problems = plugin.config_problems(_full_config(**{"algorithm.adv_estimator": "otb_ref.otb"}))
    assert problems == ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    fixed = {"algorithm.adv_estimator": "otb_ref.otb", "actor_rollout_ref.actor.calculate_sum_pi_squared": True}
    assert plugin.config_problems(_full_config(**fixed)) == []
    assert plugin.config_problems(_full_config(**fixed, **{"trainer.use_v1": False})) == []
    fused = {"actor_rollout_ref.model.use_fused_kernels": True}  # the torch backend: otb_ref's route (test_verl_fused)
    assert plugin.config_problems(_full_config(**fixed, **fused)) == []
    triton = {**fused, "actor_rollout_ref.model.fused_kernel_options.impl_backend": "triton"}
    assert "use_fused_kernels=false" in plugin.config_problems(_full_config(**fixed, **triton))[0]
    assert plugin.config_problems(_full_config(**{"algorithm.adv_estimator": "otb_ref.token_mean"})) == []
    assert "unsupported" in plugin.config_problems(_full_config(**{"algorithm.adv_estimator": "otb_ref.eob"}))[0]


@pytest.mark.parametrize("name", plugin.VERL_PROXY_ESTIMATORS)
def test_verls_own_otb_is_checked_like_ours(name):
    """verl's own OTB needs Σπ² too: refused at validation without it (verl itself stops only at the first
    advantage step, after rollout); fine with it, on V1 as on legacy."""
    problems = plugin.config_problems(_full_config(**{"algorithm.adv_estimator": name}))
    assert problems == ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    fixed = {"algorithm.adv_estimator": name, "actor_rollout_ref.actor.calculate_sum_pi_squared": True}
    assert plugin.config_problems(_full_config(**fixed)) == []
    assert plugin.config_problems(_full_config(**{"algorithm.adv_estimator": "grpo"})) == []


def test_validate_config_refuses_before_training():
    """verl's ``validate_config`` (the wrapped one main_ppo imports) raises for otb without Σπ², on the default V1
    trainer, naming the key."""
    import verl.utils.config as config_module

    with pytest.raises(ValueError, match="otb_ref.otb cannot run with this config; set: .*calculate_sum_pi_squared"):
        config_module.validate_config(
            _full_config(**{"algorithm.adv_estimator": "otb_ref.otb"}), use_reference_policy=False, use_critic=False
        )


def test_opting_out_of_the_v1_route_leaves_verl_alone_and_refuses_proxies_on_v1():
    """``OTB_REF_VERL_V1_ROUTE=0`` (a fresh interpreter): V1's methods are verl's, and otb on V1 is refused with
    the way back; on legacy it still runs."""
    code = textwrap.dedent(
        """
        import verl
        from omegaconf import OmegaConf
        from verl.trainer.ppo.v1 import trainer_base
        from otb_ref.integrations import verl as plugin
        config = OmegaConf.load(f"{verl.__path__[0]}/trainer/config/_generated_ppo_trainer.yaml")
        OmegaConf.update(config, "algorithm.adv_estimator", "otb_ref.otb")
        OmegaConf.update(config, "actor_rollout_ref.actor.calculate_sum_pi_squared", True)
        print(hasattr(trainer_base.PPOTrainer._compute_advantage, "__wrapped__"), plugin._v1_route_installed)
        print(plugin.config_problems(config))
        OmegaConf.update(config, "trainer.use_v1", False)
        print(plugin.config_problems(config))
        """
    )
    env = {**os.environ, "OTB_REF_VERL_V1_ROUTE": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    flags, v1, legacy = out.stdout.strip().splitlines()[-3:]
    assert flags == "False False"
    assert "unset OTB_REF_VERL_V1_ROUTE or trainer.use_v1=false" in v1
    assert legacy == "[]"
