"""``python -m otb_ref.integrations.verl --check [overrides…]`` (verl 0.9.1; skipped without verl).

The command runs as a user runs it (a subprocess, which starts its own fresh interpreter for the probe) for the
README's verl line and for what only a fresh interpreter shows (a plugin that raises at load, verl's plugin policy,
the V1 opt-out); every configuration refusal runs through the probe's own functions here.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from optional import import_or_skip

verl = import_or_skip("verl", reason="verl not installed (pip install -e .[verl])")

from otb_ref.integrations import verl as plugin  # noqa: E402
from otb_ref.integrations import verl_check  # noqa: E402

README = Path(__file__).resolve().parents[3] / "README.md"
# What the README's "..." stands for: the keys every verl run sets and verl's own validate_config asks for.
USER_KEYS = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
]


def readme_overrides() -> list[str]:
    """The overrides of the README's ``python -m verl.trainer.main_ppo`` line (and its continuation lines)."""
    text = README.read_text()
    line = re.search(r"python -m verl\.trainer\.main_ppo(.*?\n)(?!\s)", text + "\n", flags=re.S)
    return [token for token in line.group(1).replace("\\\n", " ").split() if "=" in token]


def run_check(overrides, **env):
    command = [sys.executable, "-m", "otb_ref.integrations.verl", "--check", *overrides]
    environment = {**os.environ, **env}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)


def test_the_readme_line_passes_the_check_on_the_default_v1_trainer():
    overrides = readme_overrides()
    assert "algorithm.adv_estimator=otb_ref.otb" in overrides
    assert not any(token.startswith("trainer.use_v1") for token in overrides)
    out = run_check(USER_KEYS + overrides)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "verl.plugins entry point otb_ref = otb_ref.integrations.verl_plugin: loaded" in out.stdout
    assert f"otb_ref names registered: {len(plugin.registered_names())}" in out.stdout
    assert "compute_advantage installed, fused_kernels installed, v1_trainer installed" in out.stdout
    assert "trainer: V1 (trainer.use_v1=true), mode 'sync': PPOTrainerSync" in out.stdout
    assert "no problems" in out.stdout


def _raising_plugin(root: Path) -> Path:
    """A distribution whose ``verl.plugins`` entry point raises when loaded."""
    (root / "raising_plugin.py").write_text("raise RuntimeError('boom at load')\n")
    info = root / "raising_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: raising-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\nraising = raising_plugin\n")
    return root


def test_a_plugin_that_raises_at_load_and_the_v1_opt_out_are_reported(tmp_path):
    """verl logs a plugin's load error at DEBUG only; the check reports it. OTB_REF_VERL_V1_ROUTE=0: the V1 route is
    not installed and otb on V1 is refused."""
    root = _raising_plugin(tmp_path)
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    out = run_check(USER_KEYS + readme_overrides(), PYTHONPATH=path, OTB_REF_VERL_V1_ROUTE="0")
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "verl.plugins entry point raising = raising_plugin: load error: boom at load" in out.stdout
    assert "problem: the verl plugin 'raising' (raising_plugin) fails to load: boom at load" in out.stdout
    assert "v1_trainer not installed" in out.stdout
    assert "problem: set unset OTB_REF_VERL_V1_ROUTE or trainer.use_v1=false" in out.stdout


def test_a_plugin_policy_that_leaves_otb_ref_out_is_reported():
    out = run_check(["algorithm.adv_estimator=otb_ref.otb"], VERL_USE_EXTERNAL_PLUGINS="some_other_plugin")
    assert out.returncode == 1
    assert "problem: VERL_USE_EXTERNAL_PLUGINS=some_other_plugin keeps verl from loading otb_ref" in out.stdout
    assert "problem: algorithm.adv_estimator=otb_ref.otb is not registered" in out.stdout
    assert "entry point otb_ref = otb_ref.integrations.verl_plugin: not loaded" in out.stdout


@pytest.mark.parametrize(
    "policy, loaded", [("none", False), ("auto", True), ("otb_ref, other", True), ("x", False), ("", False)]
)
def test_verls_plugin_policy_is_read_as_verl_reads_it(policy, loaded):
    (ours,) = [p for p in verl_check._entry_points([], policy) if p["name"] == "otb_ref"]
    assert ours["loaded"] is loaded and ours["error"] is None
    report = dict(entry_points=[ours], policy=policy, names=["otb_ref.otb"])
    assert bool(verl_check._plugin_problems(report)) is not loaded


OTB = ["algorithm.adv_estimator=otb_ref.otb", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
REFUSALS = {
    "no_sum_pi_squared": (["algorithm.adv_estimator=otb_ref.otb"], "set actor_rollout_ref.actor.calculate_sum_pi"),
    "verls_otb_no_sum_pi_squared": (["algorithm.adv_estimator=optimal_token_baseline"], "calculate_sum_pi_squared"),
    "exact_energy": (["algorithm.adv_estimator=otb_ref.eob"], "unsupported: verl computes no per-response"),
    "bypass": (OTB + ["algorithm.rollout_correction.bypass_mode=true"], "rollout_correction.bypass_mode=false"),
    "triton": (
        OTB
        + [
            "actor_rollout_ref.model.use_fused_kernels=true",
            "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
        ],
        "use_fused_kernels=false",
    ),
    "automodel": (OTB + ["actor_rollout_ref.actor.strategy=automodel"], "strategy=fsdp"),
    "unknown_option": (OTB + ["+algorithm.otb_ref.zero_tail=true"], "algorithm.otb_ref.zero_tail: unknown option"),
    "unknown_mode": (OTB + ["trainer.v1.trainer_mode=nope"], "trainer.v1.trainer_mode=nope: Unknown trainer"),
    "verls_own_validation": (OTB, "verl's validate_config: .*ppo_micro_batch_size"),
    "bad_override": (OTB + ["algorithm.no_such_key=1"], "do not compose with verl's ppo_trainer config"),
}


def _probe_config(overrides):
    """The probe's steps after ``import verl`` (done here already, with the plugin loaded), in this process."""
    report = dict(problems=[])
    try:
        config = verl_check._compose(overrides)
    except Exception as error:
        return [f"the overrides do not compose with verl's ppo_trainer config: {error}"], None
    description, unknown = verl_check._trainer(config)
    report["problems"] += [unknown] if unknown else []
    report["problems"] += verl_check._validate(config, plugin)
    return report["problems"], description


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_every_refusal_is_a_problem_of_the_check(case):
    overrides, pattern = REFUSALS[case]
    keys = [] if case == "verls_own_validation" else USER_KEYS
    problems, _ = _probe_config(keys + overrides)
    assert any(re.search(pattern, problem, flags=re.S) for problem in problems), problems


@pytest.mark.parametrize(
    "overrides, trainer",
    [
        ([], "V1 (trainer.use_v1=true), mode 'sync': PPOTrainerSync"),
        (["trainer.v1.trainer_mode=colocate_async"], "mode 'colocate_async': PPOTrainerColocateAsync"),
        (["trainer.v1.trainer_mode=separate_async"], "mode 'separate_async': PPOTrainerSeparateAsync"),
        (["trainer.use_v1=false"], "legacy RayPPOTrainer (trainer.use_v1=false"),
    ],
)
def test_the_check_names_the_trainer_the_overrides_select(overrides, trainer):
    problems, description = _probe_config(USER_KEYS + OTB + overrides)
    assert trainer in description
    assert not [p for p in problems if not p.startswith("verl's validate_config")]  # separate_async needs more keys


def test_render_lists_every_problem_and_usage_without_check():
    report = dict(verl="0.9.1", python="py", policy="auto", entry_points=[], names=[], routes={}, problems=["a", "b"])
    assert verl_check.render(report).splitlines()[-2:] == ["problem: a", "problem: b"]
    assert verl_check.main(["--nope"]) == 2
