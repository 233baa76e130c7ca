"""The lab's layers (issue 40, item 4): a driver imports ``common`` (the toolkit), the library and ``otb_train``;
``common`` imports no experiment. The drivers that still read another experiment's code are listed by name, with
what they read, so that a new cross-import fails here and a removed one must be struck from the list."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
# driver -> the other experiments it still imports (each a reading or building on that experiment's own analysis).
STILL_IMPORTS = {
    "equal_rate": {"variance_lr", "variance_lr_pilot"},  # the grid's cells and the pilot's runs
    "gradient_variance": {"snapshots"},  # the policy snapshots it measures
    "merge_rerun": {"variance_lr_pilot"},  # the pilot's run and record format
    "proxy_fidelity": {"snapshots"},
    "readings": {"reproduction", "stability", "stability_long", "variance_lr", "variance_lr_pilot"},  # their analyses
    "snr_gap": {"gradient_variance", "variance_lr_pilot"},  # their gradient sampler and SNR statistics
    "variance_lr": {"merge_rerun", "variance_lr_pilot"},  # the pilot's arms and runs
    "variance_lr_pilot": {"aimed_train", "gradient_variance"},  # its runs are aimed_train runs
}


def _imported(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, at any depth (function bodies included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_drivers_import_only_the_toolkit_the_library_and_the_trainer():
    drivers = {path.stem: path for path in EXPERIMENTS.glob("*.py")}
    assert {"common", "reproduction", "stability", "stability_long", "warm_start", "exact_table"} <= set(drivers)
    found = {name: (_imported(path) & set(drivers)) - {"common"} for name, path in drivers.items()}
    assert not found["common"], f"experiments/common.py imports experiments: {found['common']}"
    assert {name: other for name, other in found.items() if other} == STILL_IMPORTS


def test_the_library_holds_no_table_printer():
    """The exact table is a measurement: ``python -m experiments.exact_table``, not a module of ``otb_ref``."""
    assert not (ROOT / "otb_ref" / "exact" / "__main__.py").exists()
    assert "common" not in _imported(EXPERIMENTS / "exact_table.py")  # `python -m` from the root: no script folder


def test_no_sys_path_edits_outside_tests():
    """Scripts find their siblings as scripts do (their folder is ``sys.path[0]``), ports are loaded by their paths
    (``conformance/check.py``'s ``load_module``), packages by installation or ``PYTHONPATH``."""
    edits = ("sys.path.insert(", "sys.path.append(", "sys.path[:0]", "sys.path.extend(")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("otb_ref", "otb_train", "experiments", "benchmarks", "conformance", "tools", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(edit in line for edit in edits)
    ]
    found += [name for name in ("train.py", "plot.py") if any(e in (ROOT / name).read_text() for e in edits)]
    assert not found, f"sys.path edited outside tests/: {found}"


def test_stability_runs_the_reproductions_task():
    """stability.py states the reproduction's task itself (it imports no experiment): the two must not drift."""
    import sys

    sys.path.insert(0, str(EXPERIMENTS))
    import reproduction
    import stability

    assert stability.TASK == reproduction.TASK
