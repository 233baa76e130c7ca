"""``python -m otb_ref.integrations.verl --check [hydra overrides…]``: will this verl run get otb_ref (and Σπ²)?

The check starts a fresh interpreter, as ``python -m verl.trainer.main_ppo`` would be, and there: imports verl
(which loads the ``verl.plugins`` entry points and hides a load error at DEBUG level; the check records it),
composes verl's ``ppo_trainer`` config with the overrides, and runs the ``validate_config`` that ``main_ppo`` runs.
It reports each ``verl.plugins`` entry point and its load error, ``VERL_USE_EXTERNAL_PLUGINS``, the registered
``otb_ref.*`` names, the trainer and mode the overrides select, whether otb_ref's V1 and fused-kernel routes are
installed, and every problem; the exit status is 1 when there is one. Run it in the environment the trainer runs
in: verl's Ray workers import the plugin in their own environment.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

__all__ = ["main", "probe", "render"]

ENTRY_GROUP = "verl.plugins"
POLICY = "VERL_USE_EXTERNAL_PLUGINS"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _entry_points(records: list[str], policy: str) -> list[dict]:
    """Each ``verl.plugins`` entry point, whether verl's policy loads it, and the load error verl logged."""
    from importlib.metadata import entry_points

    allowed = None if policy == "auto" else {name.strip() for name in policy.split(",") if name.strip()}
    points = []
    for point in entry_points(group=ENTRY_GROUP):
        skipped = policy == "none" or (allowed is not None and point.name not in allowed)
        prefix = f"Failed to load plugin '{point.name}': "
        error = next((message.removeprefix(prefix) for message in records if message.startswith(prefix)), None)
        points.append(dict(name=point.name, value=point.value, loaded=not skipped and error is None, error=error))
    return points


def _compose(overrides: list[str]):
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(verl.__path__[0], "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _trainer(config: Any) -> tuple[str, str | None]:
    """(the trainer the config selects, the error of an unknown V1 mode)."""
    if not config.trainer.get("use_v1", True):
        return "legacy RayPPOTrainer (trainer.use_v1=false; deprecated by verl)", None
    from verl.trainer.ppo.v1 import get_trainer_cls

    mode = str(config.trainer.v1.trainer_mode)
    try:
        name = get_trainer_cls(mode).__name__
    except ValueError as error:
        return f"V1, mode {mode!r}: unknown", f"trainer.v1.trainer_mode={mode}: {error}"
    return f"V1 (trainer.use_v1=true), mode {mode!r}: {name}", None


def _validate(config: Any, plugin: Any) -> list[str]:
    """otb_ref's problems, one per line, then verl's own validate_config (what main_ppo runs before training)."""
    import verl.utils.config as config_module
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    try:
        problems = [f"set {line}" for line in plugin.config_problems(config)] if plugin is not None else []
    except ValueError as error:  # a wrong otb_ref name or option
        problems = [str(error)]
    validate = config_module.validate_config
    validate = getattr(validate, "__wrapped__", validate) if problems else validate  # ours are listed above
    try:
        validate(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except Exception as error:  # verl raises assertions, ValueErrors and Hydra errors alike
        problems.append(f"verl's validate_config: {type(error).__name__}: {error}")
    return problems


def probe(overrides: list[str]) -> dict:
    """The report, in this interpreter (which must not have imported verl yet for the plugin facts to hold)."""
    records = _Records()
    verl_logger = logging.getLogger("verl")
    verl_logger.addHandler(records)
    verl_logger.setLevel(logging.DEBUG)
    policy = os.environ.get(POLICY, "auto").strip().lower()
    report: dict[str, Any] = dict(verl="not installed", policy=policy, python=sys.executable, entry_points=[])
    report.update(names=[], routes={}, problems=[])
    try:
        import verl
    except ImportError as error:
        report["problems"].append(f"verl does not import here ({error}): pip install -e '.[verl]'")
        return report
    finally:
        verl_logger.removeHandler(records)
    report["verl"] = getattr(verl, "__version__", "unknown")
    report["entry_points"] = _entry_points(records.messages, policy)
    plugin = sys.modules.get("otb_ref.integrations.verl")
    from verl.trainer.ppo import core_algos

    report["names"] = sorted(name for name in core_algos.ADV_ESTIMATOR_REGISTRY if name.startswith("otb_ref."))
    routes = plugin.installed_routes() if plugin else {}
    report["routes"] = {key: bool(routes.get(key)) for key in ("compute_advantage", "fused_kernels", "v1_trainer")}
    report["problems"] = _plugin_problems(report)
    try:
        config = _compose(overrides)
    except Exception as error:  # Hydra's override and composition errors
        report["problems"].append(f"the overrides do not compose with verl's ppo_trainer config: {error}")
        return report
    report["estimator"] = estimator = str(config.algorithm.adv_estimator)
    if estimator.startswith("otb_ref.") and estimator not in report["names"]:
        report["problems"].append(f"algorithm.adv_estimator={estimator} is not registered (otb_ref did not load)")
    report["trainer"], unknown_mode = _trainer(config)
    if unknown_mode is not None:
        report["problems"].append(unknown_mode)
    report["problems"].extend(_validate(config, plugin))
    return report


def _plugin_problems(report: dict) -> list[str]:
    ours = [point for point in report["entry_points"] if point["value"] == "otb_ref.integrations.verl_plugin"]
    if not ours:
        return ["otb_ref's entry point is not installed: pip install -e '.[verl]' (or pip install otb_ref) here"]
    problems = []
    for point in report["entry_points"]:
        if point["error"] is not None:
            problems.append(f"the verl plugin {point['name']!r} ({point['value']}) fails to load: {point['error']}")
    if not ours[0]["loaded"] and ours[0]["error"] is None:
        problems.append(f"{POLICY}={report['policy']} keeps verl from loading otb_ref: unset it, or list otb_ref in it")
    if ours[0]["loaded"] and not report["names"]:
        problems.append("otb_ref loaded but registered no estimator names")
    return problems


def render(report: dict) -> str:
    lines = [f"verl {report['verl']} in {report['python']} (a fresh interpreter, as main_ppo's)", ""]
    lines.append(f"{POLICY}={report['policy']}")
    for point in report["entry_points"]:
        state = "loaded" if point["loaded"] else f"load error: {point['error']}" if point["error"] else "not loaded"
        lines.append(f"verl.plugins entry point {point['name']} = {point['value']}: {state}")
    names = report["names"]
    lines.append(f"otb_ref names registered: {len(names)}" + (f" ({names[0]} … {names[-1]})" if names else ""))
    routes = report["routes"]
    lines.append(
        "otb_ref routes for Σπ²: "
        + ", ".join(f"{name} {'installed' if on else 'not installed'}" for name, on in routes.items())
    )
    if "estimator" in report:
        lines.append(f"algorithm.adv_estimator={report['estimator']}")
        lines.append(f"trainer: {report['trainer']}")
    lines.append("")
    problems = report["problems"]
    lines.extend([f"problem: {problem}" for problem in problems] or ["no problems: this configuration can run"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        print(json.dumps(probe(json.loads(argv[1]))))
        return 0
    if argv[:1] != ["--check"]:
        print("usage: python -m otb_ref.integrations.verl --check [hydra overrides …]", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "otb_ref.integrations.verl_check", "--probe", json.dumps(argv[1:])]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        print(f"the check's interpreter failed (status {out.returncode}):\n{out.stderr[-4000:]}", file=sys.stderr)
        return 1
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(render(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
