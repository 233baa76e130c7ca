"""Σπ² through verl's V1 trainer (``trainer.use_v1=true``, verl 0.9.1; skipped without verl), on the CPU.

The trainer is the class ``get_trainer_cls(mode)`` gives for each mode, built by its own ``__init__``; its own
``_balance_batch``, ``_compute_old_log_prob``, ``_compute_ref_log_prob``, ``_compute_advantage`` and
``_compute_metrics`` run. The old-log-prob pass goes through ``ActorRolloutRefWorker.compute_log_prob`` →
``TrainingWorker.infer_batch`` → the FSDP engine (its ``__init__``, micro-batching, dynamic batch size,
``forward_step``) on a tiny Qwen2 patched by verl's ``apply_monkey_patch``. Stand-ins (tests/verl_cpu.py) only for
TransferQueue's ``kv_batch_get/put``, the worker-group dispatch, the accelerator platform and the device mesh. No test
writes ``sum_pi_squared``, ``old_log_probs`` or ``rollout_is_weights``: the engine computes them in the trainer's
pass. Expected advantages: a plain Hugging Face full-logits forward of the same weights, fed to
``compute_advantages``.

CPU quirk: without flash-attention, packed (remove-padding) sequences attend across each other, so remove-padding
runs use a dynamic-batch token budget that holds one sequence per micro-batch; padded runs hold several.
"""

import numpy as np
import pytest
import torch
from optional import import_or_skip

from otb_ref import ESTIMATORS, compute_advantages, variance_proxy_metrics
from otb_train.tiny_models import tiny_causal_lm

trainer_base = import_or_skip("verl.trainer.ppo.v1.trainer_base", reason="verl not installed (pip install -e .[verl])")

import transformers  # noqa: E402
import verl  # noqa: E402
import verl_cpu  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.models.transformers import monkey_patch  # noqa: E402
from verl.plugin.platform import platform_manager  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

from otb_ref.integrations import verl as plugin  # noqa: E402
from otb_ref.integrations import verl_v1  # noqa: E402

MODES = ["sync", "colocate_async", "separate_async"]
SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
HEAD_SCALE = 40.0  # a random tiny head gives Σπ² ≈ 1/V everywhere; scaled, the policy is peaked and Σπ² varies
TEMPERATURE = 0.7
PLAIN_FORWARD = transformers.Qwen2ForCausalLM.forward  # before any verl patch
LAYOUTS = {"rmpad": (True, 12), "padded": (False, 200)}  # remove-padding, token budget per micro-batch
MULTI_OUTPUT = {(0, 1): 2}  # prompt 0's session 1 returns two outputs


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    import torch.distributed as dist

    made = verl_cpu.ensure_process_group(tmp_path_factory.mktemp("gloo") / "store")
    yield
    if made:
        dist.destroy_process_group()


@pytest.fixture
def store(monkeypatch, process_group):
    """TQ's kv interface in memory, the CPU platform, and verl's class-level model patches undone after."""
    from transformers.integrations import flash_attention

    flash = flash_attention._flash_attention_forward
    previous = verl_cpu.use_cpu_platform()
    kv = verl_cpu.KVStore()
    kv.install(monkeypatch)
    yield kv
    platform_manager._current_platform = previous
    transformers.Qwen2ForCausalLM.forward = PLAIN_FORWARD
    flash_attention._flash_attention_forward = flash


def _model(seed: int, fused: bool, remove_padding: bool):
    model = tiny_causal_lm("qwen2", seed=seed, **SIZES).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    transformers.Qwen2ForCausalLM.forward = PLAIN_FORWARD
    monkey_patch.apply_monkey_patch(
        model, use_remove_padding=remove_padding, use_fused_kernels=fused, fused_kernels_backend="torch"
    )
    return model


def _config(mode: str, estimator: str, rows: int | None = None, **overrides):
    """verl's generated trainer config with the test's settings. ``rows``: a batch of that many rows needs no
    synthetic padding (the mini-batch is the batch); else a multiple of 12 rows is asked (rollout.n 3, mini-batch 4)."""
    config = OmegaConf.load(f"{verl.__path__[0]}/trainer/config/_generated_ppo_trainer.yaml")
    prompts = rows if rows is not None else 4
    settings = {
        "trainer.v1.trainer_mode": mode,
        "algorithm.adv_estimator": estimator,
        "actor_rollout_ref.actor.calculate_sum_pi_squared": True,
        "actor_rollout_ref.rollout.n": 1 if rows is not None else 3,
        "actor_rollout_ref.rollout.temperature": TEMPERATURE,
        "actor_rollout_ref.rollout.calculate_log_probs": False,
        "data.train_batch_size": prompts,
        "actor_rollout_ref.actor.ppo_mini_batch_size": prompts,
        "critic.enable": False,
        "actor_rollout_ref.rollout.nnodes": 1,  # separate_async's own checks
        "actor_rollout_ref.rollout.n_gpus_per_node": 1,
        "actor_rollout_ref.rollout.checkpoint_engine.backend": "nccl",
        "trainer.v1.separate_async.parameter_sync_step": 1,
    }
    for key, value in {**settings, **overrides}.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def _trainer(config, actor_worker, ref_worker=None, store=None):
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config)
    trainer.actor_rollout_wg = verl_cpu.WorkerGroup(actor_worker, store)
    trainer.ref_policy_wg = verl_cpu.WorkerGroup(ref_worker, store) if ref_worker is not None else None
    trainer.ref_in_actor, trainer.global_steps = False, 1
    trainer.tokenizer = type("Tokenizer", (), {"eos_token_id": 0, "pad_token_id": 0})()
    trainer.resource_pool_manager = type("Pool", (), {"get_n_gpus": staticmethod(lambda: 1)})()
    return trainer


def _put_rollout(store, samples) -> KVBatchMeta:
    """The agent loop's puts, and the batch meta the replay buffer hands the step (temperature in extra_info)."""
    keys, fields, tags = samples
    store.kv_batch_put(keys, "train", fields=list_of_dict_to_tensordict(fields), tags=tags)
    return KVBatchMeta(keys=list(keys), tags=tags, partition_id="train", extra_info={"temperature": TEMPERATURE})


def _fetch(store, keys, name) -> torch.Tensor:
    return store.kv_batch_get(keys, "train", select_fields=[name])[name].to_padded_tensor(0.0)


def _worker(model, layout, fused, config, detach=False, autocast_dtype=torch.float32):
    remove_padding, budget = LAYOUTS[layout]
    actor = verl_cpu.training_worker(
        model, remove_padding=remove_padding, fused=fused, max_tokens=budget, autocast_dtype=autocast_dtype
    )
    return verl_cpu.actor_rollout_ref_worker(actor, config=config.actor_rollout_ref, detach=detach)


def _run_v1(store, config, model, samples, layout="rmpad", fused=False, ref_worker=None, metrics=None):
    """The V1 step from the balance to the advantages; returns (trainer, batch meta, metrics)."""
    detach = config.trainer.v1.trainer_mode == "separate_async"
    trainer = _trainer(config, _worker(model, layout, fused, config, detach), ref_worker, store)
    metrics = {} if metrics is None else metrics
    batch = trainer._balance_batch(_put_rollout(store, samples), metrics=metrics)
    batch = trainer._compute_old_log_prob(batch, metrics=metrics)
    if ref_worker is not None:
        batch = trainer._compute_ref_log_prob(batch, metrics=metrics)
    batch = trainer._compute_advantage(batch, metrics=metrics)
    return trainer, batch, metrics


def _tolerance(rewards, mask) -> float:
    return 1e-6 * max(1.0, float((rewards * mask).sum(-1).abs().max()))


def _expected(reference, name, **options):
    rewards, mask, index, log_probs, spsq = reference
    inputs = dict(old_log_probs=log_probs, sum_pi_squared=spsq) if ESTIMATORS[name].energy == "proxy" else {}
    return compute_advantages(name, rewards, mask, index, **inputs, **options)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [False, True], ids=["full_logits", "fused"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_v1_trainer_feeds_otb_the_engines_sum_pi_squared(mode, fused, layout, store):
    """Each mode's trainer, its own old-log-prob pass (Σπ² from the engine) and advantage step: equal to
    compute_advantages on a plain full-logits forward, in fp32 within 1e-6 of the returns' scale; a session with two
    outputs counts each in its uid's group; synthetic padding rows (padded layout: 6 rows, a multiple of 12 asked)
    get zero advantages and move no real row. Σπ² = 1/V or grpo instead move the advantages by ≥ 1000× that."""
    samples = verl_cpu.agent_loop_samples(
        seed=11, prompts=2, n=3, vocab=SIZES["vocab_size"], outputs_per_session=MULTI_OUTPUT
    )
    config = _config(mode, "otb_ref.otb", rows=None if layout == "padded" else len(samples[0]))
    model = _model(seed=3, fused=fused, remove_padding=LAYOUTS[layout][0])
    reference = verl_cpu.reference_inputs(PLAIN_FORWARD, model, samples, TEMPERATURE)
    _, batch, _ = _run_v1(store, config, model, samples, layout, fused)
    real = samples[0]
    got = _fetch(store, real, "advantages")
    want = _expected(reference, "otb")
    tol = _tolerance(reference[0], reference[1])
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    padding = [key for key in batch.keys if key not in real]
    assert (len(padding) == 12 - len(real)) if layout == "padded" else not padding
    if padding:
        assert float(_fetch(store, padding, "advantages").abs().max()) == 0.0
    flat = reference[:4] + (torch.full_like(reference[4], 1.0 / SIZES["vocab_size"]),)
    for other in (_expected(flat, "otb"), _expected(reference, "grpo")):
        assert float((other - got).abs().max()) >= 1000 * tol


NAMES = [name for name, spec in ESTIMATORS.items() if spec.energy != "exact"]


@pytest.mark.parametrize("name", NAMES)
def test_every_otb_ref_estimator_on_v1(name, store):
    """Every otb_ref name that runs on the legacy trainer, on V1 (sync, full logits), with the _loo_std suffixes."""
    samples = verl_cpu.agent_loop_samples(seed=5, prompts=2, n=3, vocab=SIZES["vocab_size"])
    model = _model(seed=4, fused=False, remove_padding=True)
    reference = verl_cpu.reference_inputs(PLAIN_FORWARD, model, samples, TEMPERATURE)
    _run_v1(store, _config("sync", f"otb_ref.{name}_loo_std", rows=len(samples[0])), model, samples)
    got = _fetch(store, samples[0], "advantages")
    want = _expected(reference, name, leave_one_out=True, std_normalize=True)
    torch.testing.assert_close(got, want, rtol=0, atol=_tolerance(reference[0], reference[1]))


def _legacy_advantages(config, model, samples, layout="rmpad"):
    """verl's legacy trainer (trainer.use_v1=false) on the same samples: its own _compute_old_log_prob on a padded
    DataProto through the same worker, and compute_advantage."""
    _, fields, _ = samples
    P, R = max(len(f["prompts"]) for f in fields), max(len(f["responses"]) for f in fields)
    rows = {name: [] for name in ("prompts", "responses", "attention_mask", "response_mask", "token_level_rewards")}
    for f in fields:
        p, r = len(f["prompts"]), len(f["responses"])
        rows["prompts"].append(torch.cat([torch.zeros(P - p, dtype=torch.long), f["prompts"]]))
        rows["responses"].append(torch.cat([f["responses"], torch.zeros(R - r, dtype=torch.long)]))
        ones = torch.ones(p + r, dtype=torch.long)
        rows["attention_mask"].append(
            torch.cat([torch.zeros(P - p, dtype=torch.long), ones, torch.zeros(R - r, dtype=torch.long)])
        )
        rows["response_mask"].append(torch.cat([f["response_mask"], torch.zeros(R - r, dtype=torch.long)]))
        rows["token_level_rewards"].append(torch.cat([f["rm_scores"], torch.zeros(R - r)]))
    tensors = {name: torch.stack(value) for name, value in rows.items()}
    tensors["input_ids"] = torch.cat([tensors["prompts"], tensors["responses"]], dim=1)
    tensors["position_ids"] = (tensors["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    uid = np.array([f["uid"] for f in fields], dtype=object)
    lengths = tensors["attention_mask"].sum(-1).tolist()
    meta_info = {"temperature": TEMPERATURE, "global_token_num": lengths}
    data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}, meta_info=meta_info)
    legacy = object.__new__(ray_trainer.RayPPOTrainer)
    legacy.config = config
    legacy.actor_rollout_wg = verl_cpu.WorkerGroup(_worker(model, layout, False, config), None)
    old, _ = legacy._compute_old_log_prob(data)
    data = data.union(old)
    out = ray_trainer.compute_advantage(data, adv_estimator=config.algorithm.adv_estimator, config=config.algorithm)
    return out.batch["advantages"]


@pytest.mark.parametrize("estimator", ["otb_ref.otb", "optimal_token_baseline", "tir_optimal_token_baseline"])
def test_v1_equals_legacy_for_otb_ref_and_verls_own_otb(estimator, store):
    """V1 = legacy (fp32, 1e-6 of the returns' scale) for otb_ref.otb and verl's own two OTB estimators, which stop
    on V1 without the route; verl's own equal otb_ref.otb with handle_zero_tail (multi_turn for tir) up to
    ε |Ḡ| / (Σ W + ε) (docs/PORTING.md)."""
    samples = verl_cpu.agent_loop_samples(seed=8, prompts=2, n=3, vocab=SIZES["vocab_size"])
    config = _config("sync", estimator, rows=len(samples[0]))
    model = _model(seed=6, fused=False, remove_padding=True)
    reference = verl_cpu.reference_inputs(PLAIN_FORWARD, model, samples, TEMPERATURE)
    _run_v1(store, config, model, samples)
    got = _fetch(store, samples[0], "advantages")
    tol = _tolerance(reference[0], reference[1])
    torch.testing.assert_close(got, _legacy_advantages(config, model, samples), rtol=0, atol=tol)
    if estimator == "otb_ref.otb":
        return
    multi_turn = estimator.startswith("tir")
    ours = _expected(reference, "otb", handle_zero_tail=True, multi_turn=multi_turn)
    R = reference[0].sum(-1).abs().max()
    torch.testing.assert_close(got, ours, rtol=0, atol=tol + 1e-8 * float(R) / 1e-2)


def test_without_the_route_v1_gives_no_sum_pi_squared(store, monkeypatch):
    """The same step with the route's wraps removed: verl's V1 passes no Σπ² (verl's own OTB stops at its
    assertion, otb_ref's names at the missing-input message), so the tests above depend on the route."""
    for name in verl_v1.METHODS:
        monkeypatch.setattr(trainer_base.PPOTrainer, name, getattr(trainer_base.PPOTrainer, name).__wrapped__)
    wrapped = trainer_base.compute_advantage_for_multi_trajectories
    monkeypatch.setattr(trainer_base, "compute_advantage_for_multi_trajectories", wrapped.__wrapped__)
    samples = verl_cpu.agent_loop_samples(seed=9, prompts=2, n=3, vocab=SIZES["vocab_size"])
    model = _model(seed=2, fused=False, remove_padding=True)
    with pytest.raises(ValueError, match="needs sum_pi_squared and old_log_probs"):
        _run_v1(store, _config("sync", "otb_ref.otb", rows=6), model, samples)
    with pytest.raises(AssertionError, match="requires sum_pi_squared"):
        _run_v1(verl_cpu_fresh(store), _config("sync", "optimal_token_baseline", rows=6), model, samples)


def verl_cpu_fresh(store):
    store.rows.clear()
    store.tags.clear()
    return store


def test_a_reference_pass_with_other_weights_leaves_the_actors_sum_pi_squared(store):
    """With a reference policy whose weights differ (its pass rewrites the worker-output fields), the advantages
    use the actor's Σπ² and old log-probs."""
    samples = verl_cpu.agent_loop_samples(seed=12, prompts=2, n=3, vocab=SIZES["vocab_size"])
    config = _config("sync", "otb_ref.otb", rows=6, **{"actor_rollout_ref.actor.use_kl_loss": True})
    model, ref_model = (
        _model(seed=7, fused=False, remove_padding=True),
        _model(seed=8, fused=False, remove_padding=True),
    )
    reference = verl_cpu.reference_inputs(PLAIN_FORWARD, model, samples, TEMPERATURE)
    ref = verl_cpu.training_worker(ref_model, remove_padding=True, fused=False, max_tokens=12)
    ref_worker = verl_cpu.actor_rollout_ref_worker(None, ref=ref, config=config.actor_rollout_ref)
    trainer, _, _ = _run_v1(store, config, model, samples, ref_worker=ref_worker)
    assert trainer.use_reference_policy
    assert not torch.equal(_fetch(store, samples[0], "ref_log_prob"), _fetch(store, samples[0], "old_log_probs"))
    got = _fetch(store, samples[0], "advantages")
    torch.testing.assert_close(got, _expected(reference, "otb"), rtol=0, atol=_tolerance(reference[0], reference[1]))


def test_separate_async_takes_sum_pi_squared_from_the_saved_old_policy(store):
    """separate_async, second mini-batch of a sync cycle: the trainer restores π_old (saved at the first) for the
    pass; Σπ² and old log-probs are π_old's, and the live weights come back."""
    config = _config("separate_async", "otb_ref.otb", rows=6)
    model = _model(seed=9, fused=True, remove_padding=True)
    first = verl_cpu.agent_loop_samples(seed=13, prompts=2, n=3, vocab=SIZES["vocab_size"])
    second = verl_cpu.agent_loop_samples(seed=14, prompts=2, n=3, vocab=SIZES["vocab_size"])
    reference = verl_cpu.reference_inputs(PLAIN_FORWARD, model, second, TEMPERATURE)
    trainer, _, _ = _run_v1(store, config, model, first, fused=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # the update after the first mini-batch
    live = model.lm_head.weight.clone()
    trainer.local_trigger_step = 1
    batch = trainer._compute_old_log_prob(_put_rollout(store, second), metrics={})
    trainer._compute_advantage(batch, metrics={})
    got = _fetch(store, second[0], "advantages")
    torch.testing.assert_close(got, _expected(reference, "otb"), rtol=0, atol=_tolerance(reference[0], reference[1]))
    assert torch.equal(model.lm_head.weight, live)


def test_w_score_metrics_reach_v1_metrics(store):
    """verl's V1 _compute_metrics, which fetches no Σπ², now logs the variance-proxy metrics (real rows only):
    equal to otb_ref.variance_proxy_metrics on the reference inputs and the step's advantages."""
    samples = verl_cpu.agent_loop_samples(seed=15, prompts=2, n=3, vocab=SIZES["vocab_size"])
    config = _config("sync", "otb_ref.otb")
    model = _model(seed=10, fused=False, remove_padding=False)
    reference = verl_cpu.reference_inputs(PLAIN_FORWARD, model, samples, TEMPERATURE)
    trainer, batch, metrics = _run_v1(store, config, model, samples, layout="padded", metrics={"actor/grad_norm": 0.5})
    assert len(batch) == 12  # 6 real rows and 6 padding rows
    trainer._compute_metrics(batch, metrics, timing_raw={"step": 1.0}, global_steps=1, epoch=0)
    rewards, mask, _, log_probs, spsq = reference
    advantages = _fetch(store, samples[0], "advantages")
    want = variance_proxy_metrics(advantages, mask, log_probs, spsq, grad_norm=0.5)
    assert want and set(want) <= set(metrics)
    for key, value in want.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_route_flags_and_trainer_coverage():
    """install() wrapped the V1 base methods; every registered mode runs the route."""
    assert plugin._v1_route_installed
    for mode in MODES:
        assert verl_v1.trainer_problem(mode) is None
    for name in verl_v1.METHODS:
        assert getattr(getattr(trainer_base.PPOTrainer, name), verl_v1._MARK, False)


def test_a_custom_trainer_that_overrides_the_advantage_step_is_refused():
    class Custom(trainer_base.PPOTrainer):
        def _compute_advantage(self, batch, metrics):
            return batch

    name = "otb_ref_test_custom"
    trainer_base.TRAINER_REGISTRY[name] = Custom
    try:
        assert "overrides _compute_advantage" in verl_v1.trainer_problem(name)
        config = _config(name, "otb_ref.otb")
        assert any("trainer.v1.trainer_mode=" in p for p in plugin.config_problems(config))
    finally:
        del trainer_base.TRAINER_REGISTRY[name]


def test_fused_route_under_the_engines_bf16_autocast(store, monkeypatch):
    """The V1 old-log-prob pass with fused kernels, the FSDP engine's forward_step under its default bf16 autocast:
    the route runs inside that autocast, and its Σπ² equals the exact one of the logits the LM head gave there
    (recomputed in fp64) within 1e-6; confident tokens' energies are positive; the snapshot holds those values."""
    from otb_ref.integrations import verl_fused

    calls = []
    original = verl_fused.chunk_statistics

    def recording(hidden, weight, labels, temperature, chunk_size, cross_entropy=None):
        out = original(hidden, weight, labels, temperature, chunk_size, cross_entropy)
        calls.append((torch.is_autocast_enabled("cpu"), hidden, weight, labels, temperature, out))
        return out

    monkeypatch.setattr(verl_fused, "chunk_statistics", recording)
    samples = verl_cpu.agent_loop_samples(seed=16, prompts=2, n=3, vocab=SIZES["vocab_size"])
    config = _config("sync", "otb_ref.otb", rows=6)
    model = _model(seed=12, fused=True, remove_padding=True)
    trainer = _trainer(config, _worker(model, "rmpad", True, config, autocast_dtype=torch.bfloat16), store=store)
    batch = trainer._compute_old_log_prob(_put_rollout(store, samples), metrics={})
    assert len(calls) == 6 and all(call[0] for call in calls)  # one micro-batch per sequence, all under autocast
    for _, hidden, weight, labels, temperature, (log_probs, _, spsq) in calls:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()) / temperature  # the route's logits
        pi = logits.double().softmax(-1)
        p_label = pi.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
        assert float((spsq.reshape(-1).double() - pi.square().sum(-1)).abs().max()) <= 1e-6
        energy = 1 - 2 * log_probs.reshape(-1).double().exp() + spsq.reshape(-1).double()
        exact = 1 - 2 * p_label + pi.square().sum(-1)
        assert float((energy - exact).abs().max()) <= 1e-6
        assert bool((energy[(p_label > 0.99) & (p_label < 0.999)] > 0).all())
    snapshot = store.kv_batch_get(batch.keys, "train", select_fields=[verl_v1.SNAPSHOT])[verl_v1.SNAPSHOT]
    assert snapshot.dtype == torch.float32 and len(snapshot.offsets()) == len(batch.keys) + 1


@pytest.mark.parametrize("fused", [False, True], ids=["full_logits", "fused"])
def test_sum_pi_squared_is_exact_under_the_engines_bf16_autocast(fused, store):
    """The V1 old-log-prob pass under the FSDP engine's default bf16 autocast, fused and not: the snapshot's Σπ²
    equals the exact Σπ² of the bf16 logits the model gives under that autocast within 1e-5 relative. Without fused
    kernels verl's own formula ran in bf16 there (off by up to ~10% on this model)."""
    samples = verl_cpu.agent_loop_samples(seed=17, prompts=2, n=3, vocab=SIZES["vocab_size"])
    config = _config("sync", "otb_ref.otb", rows=6)
    model = _model(seed=13, fused=fused, remove_padding=True)
    trainer = _trainer(config, _worker(model, "rmpad", fused, config, autocast_dtype=torch.bfloat16), store=store)
    trainer._compute_old_log_prob(_put_rollout(store, samples), metrics={})
    got = _fetch(store, samples[0], verl_v1.SNAPSHOT)
    for row, fields in enumerate(samples[1]):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = PLAIN_FORWARD(model, input_ids=fields["input_ids"][None]).logits[0]
        # the temperature as each path applies it to the bf16 logits: verl's fused forward as a Python float, its
        # non-fused path as a tensor cast to the logits' dtype (0.7 becomes 0.69921875)
        logits = logits / (TEMPERATURE if fused else torch.tensor(TEMPERATURE).to(logits.dtype))
        P, R = len(fields["prompts"]), len(fields["responses"])
        exact = logits[P - 1 : P + R - 1].double().softmax(-1).square().sum(-1)
        assert float(((got[row, :R].double() - exact) / exact).abs().max()) <= 1e-5
