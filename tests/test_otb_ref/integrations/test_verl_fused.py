"""Σπ² from verl's fused LM-head path, through verl's own code on CPU (verl 0.9.1; skipped without verl).

Models are built with verl's own ``apply_monkey_patch`` (TRL neither hidden nor stubbed: in an environment where
TRL is installed and verl cannot import its class, the model-build test fails). The old-log-prob pass is the FSDP
engine's ``prepare_model_inputs`` → model → ``prepare_model_outputs`` (what its ``forward_step`` runs, without the
accelerator move). CPU quirks: without flash-attention, packed (remove-padding) sequences attend across each other,
so fused and non-fused runs are compared within one padding mode; without remove-padding, verl's own fused and
non-fused log-probs differ at each sequence's last token (how labels are rolled), so log-probs are compared
between fused runs.
"""

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from optional import import_or_skip

from otb_ref import compute_advantages, logprobs_and_sum_pi_squared
from otb_train.tiny_models import tiny_causal_lm

monkey_patch = import_or_skip(
    "verl.models.transformers.monkey_patch", reason="verl not installed (pip install -e .[verl])"
)

import transformers  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils import torch_functional as verl_torch_functional  # noqa: E402
from verl.utils.experimental import torch_functional as verl_functional  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from otb_ref.integrations import verl as plugin  # noqa: E402
from otb_ref.integrations import verl_fused  # noqa: E402

FP32 = dict(rtol=1e-6, atol=1e-6)
FAMILIES = ["qwen2", "llama"]
CLASSES = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
TEMPERATURE = 0.7
BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
_PLAIN_FORWARD = {family: cls.forward for family, cls in CLASSES.items()}  # before any verl patch


@pytest.fixture
def restore_verl_patches():
    """verl's monkey patch replaces class attributes (each model class's forward, flash-attention's function)."""
    from transformers.integrations import flash_attention

    saved = {cls: cls.forward for cls in (*CLASSES.values(), transformers.GraniteForCausalLM)}
    flash = flash_attention._flash_attention_forward
    yield
    for cls, forward in saved.items():
        cls.forward = forward
    flash_attention._flash_attention_forward = flash


def _model(family: str, fused: bool, remove_padding: bool, backend: str = "torch"):
    """A tiny model patched by verl's own apply_monkey_patch, as verl's FSDP engine does at model build; without
    fused kernels the class forward is the plain Hugging Face one."""
    model = tiny_causal_lm(family, seed=1, **SIZES).eval()
    CLASSES[family].forward = _PLAIN_FORWARD[family]
    monkey_patch.apply_monkey_patch(
        model, use_remove_padding=remove_padding, use_fused_kernels=fused, fused_kernels_backend=backend
    )
    return model


def test_verl_builds_a_model_through_its_own_monkey_patch(restore_verl_patches):
    """The CI environment for verl: verl's model build (which imports TRL's value-head class whenever TRL is
    installed) works, and the fused forward runs."""
    model = _model("qwen2", fused=True, remove_padding=True)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 7))
    out = model(input_ids=ids, return_dict=True, temperature=1.0)
    assert out.log_probs.shape == (2, 7) and out.entropy.shape == (2, 7)


def _engine(model) -> FSDPEngineWithLMHead:
    """verl's FSDP engine class around ``model``, with the attributes its input/output preparation reads (no
    process group: the engine's constructor needs one)."""
    engine = object.__new__(FSDPEngineWithLMHead)
    engine.module, engine.pad_to_length, engine.use_ulysses_sp = model, False, False
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits = verl_torch_functional.entropy_from_logits  # use_torch_compile=false
    return engine


def _rollout(seed: int = 0, B: int = 6, P: int = 5, R: int = 7, V: int = SIZES["vocab_size"]) -> DataProto:
    """A verl rollout batch: left-padded prompts, right-padded responses, 2 prompts × 3 responses, rewards."""
    rng = np.random.default_rng(seed)
    prompt_len, response_len = rng.integers(2, P + 1, size=B), rng.integers(1, R + 1, size=B)
    prompt_mask = torch.tensor(np.arange(P)[None, :] >= (P - prompt_len)[:, None], dtype=torch.int64)
    response_mask = torch.tensor(np.arange(R)[None, :] < response_len[:, None], dtype=torch.int64)
    prompts = torch.tensor(rng.integers(0, V, size=(B, P))) * prompt_mask
    responses = torch.tensor(rng.integers(0, V, size=(B, R))) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), torch.tensor(response_len - 1)] = torch.tensor(rng.choice([0.0, 1.0], size=B)).float()
    tensors = dict(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        response_mask=response_mask,
        token_level_rewards=rewards,
    )
    uid = np.array([f"p{i % 2}" for i in range(B)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def _old_log_prob_pass(model, rollout: DataProto, remove_padding: bool, fused: bool, sum_pi_squared: bool):
    """The engine's old-log-prob micro-batch: its inputs as verl's trainer sends them, prepare_model_inputs →
    model → prepare_model_outputs; returns (model_output, the no-padding tensordict)."""
    micro_batch = left_right_2_no_padding(rollout.to_tensordict())
    tu.assign_non_tensor(
        micro_batch, use_remove_padding=remove_padding, use_fused_kernels=fused, calculate_entropy=True,
        calculate_sum_pi_squared=sum_pi_squared, temperature=TEMPERATURE,
    )  # fmt: skip
    engine = _engine(model)
    with torch.no_grad():
        model_inputs, output_args = engine.prepare_model_inputs(micro_batch=micro_batch)
        raw = engine.module(**model_inputs, use_cache=False)
        model_output = engine.prepare_model_outputs(raw, output_args, micro_batch, logits_processor_func=None)
    return model_output, micro_batch


def _response_part(nested, micro_batch):
    return no_padding_2_padding(nested, micro_batch)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_fused_sum_pi_squared_equals_the_non_fused_path(family, remove_padding, restore_verl_patches):
    """Σπ² from the fused forward equals verl's own (from full logits) to 1e-6 in fp32, laid out as the log-probs;
    log-probs and entropy equal verl's fused ones without Σπ² (the same numbers, exactly)."""
    rollout = _rollout(seed=len(family))
    plain, _ = _old_log_prob_pass(_model(family, False, remove_padding), rollout, remove_padding, False, True)
    model = _model(family, True, remove_padding)
    without, _ = _old_log_prob_pass(model, rollout, remove_padding, True, False)
    with_it, micro_batch = _old_log_prob_pass(model, rollout, remove_padding, True, True)
    assert "sum_pi_squared" not in without
    assert with_it["sum_pi_squared"].is_nested
    torch.testing.assert_close(with_it["sum_pi_squared"].offsets(), with_it["log_probs"].offsets(), rtol=0, atol=0)
    torch.testing.assert_close(with_it["sum_pi_squared"].values(), plain["sum_pi_squared"].values(), **FP32)
    torch.testing.assert_close(with_it["log_probs"].values(), without["log_probs"].values(), rtol=0, atol=0)
    torch.testing.assert_close(with_it["entropy"].values(), without["entropy"].values(), rtol=0, atol=0)
    if remove_padding:  # verl's fused and non-fused log-probs agree here (not at padded last tokens on CPU)
        torch.testing.assert_close(with_it["log_probs"].values(), plain["log_probs"].values(), **FP32)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_otb_through_compute_advantage_with_the_fused_batch(family, remove_padding, restore_verl_patches):
    """The pass's response part, as verl's trainer builds it, through verl's compute_advantage with otb_ref.otb:
    equal to compute_advantages."""
    rollout = _rollout(seed=3)
    model = _model(family, True, remove_padding)
    output, micro_batch = _old_log_prob_pass(model, rollout, remove_padding, True, True)
    old_log_probs = _response_part(output["log_probs"], micro_batch).float()
    sum_pi_squared = _response_part(output["sum_pi_squared"], micro_batch).float()
    rollout.batch["old_log_probs"], rollout.batch["sum_pi_squared"] = old_log_probs, sum_pi_squared
    mask = rollout.batch["response_mask"].float()
    out = ray_trainer.compute_advantage(rollout, adv_estimator="otb_ref.otb", config=OmegaConf.create({}))
    want, _ = compute_advantages(
        "otb", rollout.batch["token_level_rewards"], mask, list(rollout.non_tensor_batch["uid"]),
        old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared,
    )  # fmt: skip
    torch.testing.assert_close(out.batch["advantages"], want, **FP32)
    assert bool(((sum_pi_squared > 0) | (mask == 0)).all())


def test_liger_backend_without_liger_kernel_takes_the_same_route(restore_verl_patches):
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed: the liger backend runs liger's kernel (refused)")
    rollout = _rollout(seed=5)
    torch_out, _ = _old_log_prob_pass(_model("qwen2", True, True, "torch"), rollout, True, True, True)
    liger_out, _ = _old_log_prob_pass(_model("qwen2", True, True, "liger"), rollout, True, True, True)
    torch.testing.assert_close(liger_out["sum_pi_squared"].values(), torch_out["sum_pi_squared"].values())


def test_triton_backend_is_refused_at_the_pass_with_the_keys(restore_verl_patches):
    model = _model("qwen2", True, True, "triton")  # patching only: the kernel itself needs a GPU
    with pytest.raises(NotImplementedError, match="backend 'triton'.*use_fused_kernels=false"):
        _old_log_prob_pass(model, _rollout(), True, True, True)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 5, 512])
def test_chunk_statistics_equal_verls_fused_values_and_otb_refs_sum_pi_squared(temperature, chunk_size):
    """One matmul per chunk: verl's fused log-probs and entropy unchanged (exactly), Σπ² equal to
    otb_ref.logprobs_and_sum_pi_squared's."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 11, 16) * 2, torch.randn(50, 16)
    labels = torch.randint(0, 50, (3, 11))
    log_probs, entropy, spsq = verl_fused.chunk_statistics(hidden, weight, labels, temperature, chunk_size)
    verl_log_probs, verl_entropy = verl_functional.FusedLinearForPPOFunction.apply(
        hidden, weight, labels, temperature, chunk_size
    )
    torch.testing.assert_close(log_probs, verl_log_probs, rtol=0, atol=0)
    torch.testing.assert_close(entropy, verl_entropy, rtol=0, atol=0)
    _, want = logprobs_and_sum_pi_squared(hidden, weight, labels, temperature=temperature)
    torch.testing.assert_close(spsq, want, **FP32)


def _integer_head(rows: int = 400, d: int = 8, V: int = 50, seed: int = 0):
    """Hidden states and LM-head weights of small integers: their logits are integers below 256, exact in bf16, so a
    matmul under bf16 autocast gives the fp32 logits and the fp64 reference below is the exact one."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-4, 5, (rows, d), generator=generator).float()
    weight = torch.randint(-4, 5, (V, d), generator=generator).float()
    logits = hidden.double() @ weight.double().t()
    labels = logits.argmax(-1)  # the most likely token: many rows have π(y) > 0.99
    return hidden, weight, labels, logits


@pytest.mark.parametrize("chunk_size", [7, 512])
def test_chunk_statistics_are_exact_under_bf16_autocast(chunk_size):
    """verl's FSDP engine runs the forward under bf16 autocast by default. Under CPU bf16 autocast the route's Σπ²
    and energy 1 − 2π + Σπ² equal the exact ones within 1e-6 (a bf16 reduction was off by ~5e-3 and made confident
    tokens' energies negative); positive where 0.99 < π(y) < 0.999 (energy ≥ (1 − π)² ≥ 1e-6), never below
    fp32 rounding (−1e-7) where π(y) → 1; log-probs and entropy are verl's own fused ones under the same autocast."""
    hidden, weight, labels, logits = _integer_head()
    pi = logits.softmax(-1)
    p_label = pi.gather(-1, labels[:, None]).squeeze(-1)
    exact = 1 - 2 * p_label + pi.square().sum(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs, entropy, spsq = verl_fused.chunk_statistics(hidden, weight, labels, 1.0, chunk_size)
        verl_log_probs, verl_entropy = verl_functional.FusedLinearForPPOFunction.apply(
            hidden, weight, labels, 1.0, chunk_size
        )
    energy = 1 - 2 * log_probs.double().exp() + spsq.double()
    assert spsq.dtype == torch.float32
    assert float((energy - exact).abs().max()) <= 1e-6
    confident = (p_label > 0.99) & (p_label < 0.999)
    assert int(confident.sum()) >= 20 and bool((energy[confident] > 0).all())
    assert float(energy.min()) >= -1e-7
    torch.testing.assert_close(log_probs, verl_log_probs, rtol=0, atol=0)
    torch.testing.assert_close(entropy, verl_entropy, rtol=0, atol=0)
    # The reduction left to autocast (the route before issue 37): a bf16 matmul, off by more than 1e-3.
    probs = logits.float().softmax(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_spsq = torch.einsum("rv,rv->r", probs, probs)
    bf16_energy = 1 - 2 * log_probs.double().exp() + bf16_spsq.double()
    assert float((bf16_energy - exact).abs().max()) > 1e-3 and bool((bf16_energy < -1e-4).any())


def test_verls_full_logits_sum_pi_squared_runs_in_fp32():
    """verl's non-fused Σπ² (``calculate_sum_pi_squared_from_logits``), as the plugin wraps it: within 1e-6
    (relative) of the exact Σπ² on fp32 and on bf16 logits; verl's own formula is within 1e-5 on fp32 logits (its
    exp of a difference of log-sum-exps rounds more) and off by more than 1e-3 on bf16 ones; 700 rows cross the
    512-row blocks."""
    wrapped = verl_torch_functional.calculate_sum_pi_squared_from_logits
    verls = wrapped.__wrapped__
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 350, 50, generator=generator) * 6
    exact = logits.double().softmax(-1).square().sum(-1)
    assert float(((wrapped(logits).double() - exact) / exact).abs().max()) <= 1e-6
    assert float(((verls(logits).double() - exact) / exact).abs().max()) <= 1e-5
    bf16 = logits.to(torch.bfloat16)
    exact = bf16.double().softmax(-1).square().sum(-1)
    assert wrapped(bf16).dtype == torch.float32
    assert float(((wrapped(bf16).double() - exact) / exact).abs().max()) <= 1e-6
    assert float(((verls(bf16).double() - exact) / exact).abs().max()) > 1e-3


RESCALING = {
    "granite": ({"model_type": "granite", "logits_scaling": 8.0}, "logits_scaling=8.0"),
    "cohere_default": ({"model_type": "cohere"}, "logit_scale=0.0625"),
    "cohere2": ({"model_type": "cohere2", "logit_scale": 0.25}, "logit_scale=0.25"),
    "gemma2_default": ({"model_type": "gemma2"}, "final_logit_softcapping=30.0"),
    "gemma3_text_config": (
        {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "final_logit_softcapping": 30.0}},
        "final_logit_softcapping=30.0",
    ),
    "any_model_with_the_key": ({"model_type": "mine", "final_logit_softcapping": 50.0}, "final_logit_softcapping"),
}


@pytest.mark.parametrize("case", sorted(RESCALING))
def test_models_whose_head_rescales_logits_are_refused_with_fused_kernels(case, tmp_path):
    """verl's fused forward applies no logit scaling or soft-capping: such a model (config key, or its model type's
    default) is refused at validation with fused kernels, and fine without."""
    hf_config, pattern = RESCALING[case]
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    problems = plugin.config_problems(_config(**{"actor_rollout_ref.model.path": str(tmp_path)}))
    assert len(problems) == 1 and "rescales or caps its logits" in problems[0] and pattern in problems[0]
    assert "use_fused_kernels=false" in problems[0]
    unfused = {"actor_rollout_ref.model.path": str(tmp_path), "actor_rollout_ref.model.use_fused_kernels": False}
    assert plugin.config_problems(_config(**unfused)) == []


@pytest.mark.parametrize(
    "hf_config",
    [{"model_type": "granite", "logits_scaling": 1.0}, {"model_type": "gemma3_text", "final_logit_softcapping": None}],
)
def test_no_op_rescaling_values_are_accepted(hf_config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    assert plugin.config_problems(_config(**{"actor_rollout_ref.model.path": str(tmp_path)})) == []


def test_a_rescaling_model_is_refused_at_the_pass_when_validation_cannot_read_it(restore_verl_patches):
    """A model path validation cannot read (a hub id): the engine's first fused old-log-prob pass refuses it."""
    config = transformers.GraniteConfig(logits_scaling=4.0, **{k: v for k, v in SIZES.items()})
    model = transformers.GraniteForCausalLM(config).eval()
    monkey_patch.apply_monkey_patch(
        model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch"
    )
    with pytest.raises(NotImplementedError, match="rescales or caps its logits .logits_scaling=4.0"):
        _old_log_prob_pass(model, _rollout(), True, True, True)


def test_runs_that_do_not_ask_go_through_verls_functions(restore_verl_patches):
    """No request: the wrapped FusedLinearForPPO calls verl's, and no keyword reaches the model."""
    model = _model("qwen2", True, True)
    micro_batch = left_right_2_no_padding(_rollout().to_tensordict())
    tu.assign_non_tensor(micro_batch, use_remove_padding=True, use_fused_kernels=True, temperature=1.0)
    inputs, _ = _engine(model).prepare_model_inputs(micro_batch=micro_batch)
    assert verl_fused.FLAG not in inputs
    calls = []
    original = verl_functional.FusedLinearForPPOFunction.apply
    verl_functional.FusedLinearForPPOFunction.apply = lambda *a: calls.append(1) or original(*a)
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        verl_functional.FusedLinearForPPOFunction.apply = original
    assert calls == [1]


# ---- validation: what the plugin accepts and refuses before training -------------------------------------------


def _config(**overrides):
    path = f"{importlib.import_module('verl').__path__[0]}/trainer/config/_generated_ppo_trainer.yaml"
    config = OmegaConf.load(path)
    base = {
        "algorithm.adv_estimator": "otb_ref.otb",
        "trainer.use_v1": False,
        "actor_rollout_ref.actor.calculate_sum_pi_squared": True,
        "actor_rollout_ref.model.use_fused_kernels": True,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,  # verl's own checks need these
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
        "trainer.n_gpus_per_node": 1,
    }
    for key, value in {**base, **overrides}.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def test_fused_kernels_pass_validate_config_on_the_legacy_trainer():
    import verl.utils.config as config_module

    config = _config()
    assert plugin.config_problems(config) == []
    config_module.validate_config(config, use_reference_policy=False, use_critic=False)  # no raise
    liger = {"actor_rollout_ref.model.fused_kernel_options.impl_backend": "liger"}  # falls back to torch here
    assert plugin.config_problems(_config(**liger)) == [] or importlib.util.find_spec("liger_kernel") is not None
    assert plugin.config_problems(_config(**{"actor_rollout_ref.model.use_remove_padding": False})) == []


REFUSED = {
    "triton": ({"actor_rollout_ref.model.fused_kernel_options.impl_backend": "triton"}, "impl_backend=torch"),
    "megatron": ({"actor_rollout_ref.actor.strategy": "megatron"}, "use_fused_kernels=false.*megatron"),
    "veomni": ({"actor_rollout_ref.actor.strategy": "veomni"}, "use_fused_kernels=false.*veomni"),
    "automodel": ({"actor_rollout_ref.actor.strategy": "automodel"}, "strategy=fsdp"),
    "torchtitan_unfused": (
        {"actor_rollout_ref.actor.strategy": "torchtitan", "actor_rollout_ref.model.use_fused_kernels": False},
        "strategy=fsdp",
    ),
    "bypass": ({"algorithm.rollout_correction.bypass_mode": True}, "rollout_correction.bypass_mode=false"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_settings_that_give_no_sum_pi_squared_are_refused_with_the_keys(case):
    import verl.utils.config as config_module

    overrides, pattern = REFUSED[case]
    with pytest.raises(ValueError, match=f"otb_ref.otb cannot run with this config; set: .*{pattern}"):
        config_module.validate_config(_config(**overrides), use_reference_policy=False, use_critic=False)


def test_liger_is_refused_where_liger_kernel_is_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a)
    )
    problems = plugin.config_problems(_config(**{"actor_rollout_ref.model.fused_kernel_options.impl_backend": "liger"}))
    assert problems and "impl_backend=torch" in problems[0]


def test_vision_language_models_are_refused_with_fused_kernels(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    problems = plugin.config_problems(_config(**{"actor_rollout_ref.model.path": str(tmp_path)}))
    assert problems and "vision-language" in problems[0] and "use_fused_kernels=false" in problems[0]
    unfused = _config(
        **{"actor_rollout_ref.model.path": str(tmp_path), "actor_rollout_ref.model.use_fused_kernels": False}
    )
    assert plugin.config_problems(unfused) == []


def test_an_environment_whose_trl_verl_cannot_import_is_refused(monkeypatch):
    """verl's FSDP model build would fail with an ImportError; validate_config says so first, for any estimator."""
    real_spec, real_import = importlib.util.find_spec, importlib.import_module
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "trl" else real_spec(name, *a)
    )
    monkeypatch.setattr(
        importlib,
        "import_module",
        lambda name, *a: SimpleNamespace() if name.startswith("trl") else real_import(name, *a),
    )
    for estimator in ("otb_ref.otb", "grpo"):
        problems = plugin.config_problems(_config(**{"algorithm.adv_estimator": estimator}))
        assert len(problems) == 1 and "without TRL" in problems[0]


def test_a_forward_with_gradients_that_asks_for_sum_pi_squared_is_refused(restore_verl_patches):
    """Σπ² is computed in the no-grad old-log-prob pass only (the route has no backward of its own)."""
    model = _model("qwen2", True, True)
    ids = torch.randint(0, SIZES["vocab_size"], (1, 6))
    with pytest.raises(NotImplementedError, match="no-grad passes only"):
        model(input_ids=ids, return_dict=True, temperature=1.0, **{verl_fused.FLAG: True})
    with torch.no_grad():
        out = model(input_ids=ids, return_dict=True, temperature=1.0, **{verl_fused.FLAG: True})
    assert out["sum_pi_squared"].shape == out.log_probs.shape == (1, 6)


def test_benchmark_measures_each_variant_at_a_tiny_shape(restore_verl_patches):
    """benchmarks/verl_fused.py's measurement (every variant, one round)."""
    spec = importlib.util.spec_from_file_location("verl_fused_bench", BENCHMARKS / "verl_fused.py")
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCHMARKS))
    args = SimpleNamespace(tokens=32, hidden=28, intermediate=32, vocab=300, layers=1, sequences=2, repeats=1)
    records = bench.run(args)
    assert sorted(records) == sorted(bench.VARIANTS)
    for variant, record in records.items():
        assert record["seconds"] > 0 and record["peak_rss_above_start_gib"] >= 0 and record["variant"] == variant
