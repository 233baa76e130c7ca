"""The lab's layers (issue 40, item 4): every experiment imports ``common`` (the toolkit, a package), the library
and ``otb_train``, the standard library and third-party packages, never another experiment; ``common`` imports no
experiment either. What two drivers share lives in ``common`` (its docstring lists where)."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
ALLOWED_FIRST_PARTY = {"common", "otb_ref", "otb_train"}


def _imported(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, at any depth (function bodies included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _first_party() -> set[str]:
    """Every name a module of this repository could be imported by: the experiments (scripts on ``sys.path[0]``),
    the root's scripts and folders of Python code (``train``, ``plot``, ``benchmarks``, ``tests``, ...)."""
    names = {path.stem for path in EXPERIMENTS.glob("*.py")} | {path.stem for path in ROOT.glob("*.py")}
    names |= {path.name for path in ROOT.iterdir() if path.is_dir() and any(path.rglob("*.py"))}
    return names


def test_drivers_import_only_the_toolkit_the_library_and_the_trainer():
    modules = sorted(EXPERIMENTS.glob("*.py")) + sorted((EXPERIMENTS / "common").glob("*.py"))
    drivers = {path.stem for path in EXPERIMENTS.glob("*.py")}
    assert {"reproduction", "readings", "variance_lr", "snapshots", "warm_start", "exact_table"} <= drivers
    assert "common" not in drivers and (EXPERIMENTS / "common" / "__init__.py").exists()
    assert len(modules) > len(drivers) + 1  # the toolkit's own modules are checked too
    forbidden = _first_party() - ALLOWED_FIRST_PARTY
    assert drivers <= forbidden and {"train", "plot", "benchmarks", "tests"} <= forbidden
    found = {str(path.relative_to(ROOT)): sorted(_imported(path) & forbidden) for path in modules}
    assert not {name: other for name, other in found.items() if other}, "an experiment imports another"
    unknown = {
        str(path.relative_to(ROOT)): sorted(_imported(path) - ALLOWED_FIRST_PARTY - set(sys.stdlib_module_names))
        for path in modules
    }
    third_party = {"torch", "transformers", "matplotlib", "numpy"}
    assert {name: other for name, other in unknown.items() if set(other) - third_party} == {}


def test_the_toolkit_finds_the_repository():
    """``common`` is a package one folder below experiments/: its ROOT is the repository's, as the drivers' are."""
    sys.path.insert(0, str(EXPERIMENTS))
    import common
    from common import snapshots, variance_runs

    assert common.ROOT == ROOT and common.RESULTS == ROOT / "results"
    assert snapshots.SNAPSHOT_ROOT == ROOT / "runs" / "snapshots"
    assert (ROOT / "experiments" / "aimed_train.py").exists() and variance_runs.ROOT == ROOT


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
    sys.path.insert(0, str(EXPERIMENTS))
    import reproduction
    import stability

    assert stability.TASK == reproduction.TASK


def test_readings_reads_stability_s_arms_in_their_order():
    """readings.py names stability.py's arms itself (it imports no experiment): the two must not drift."""
    sys.path.insert(0, str(EXPERIMENTS))
    import readings
    import stability

    assert readings.STABILITY_ARMS == tuple(stability.ARMS)


def _shadowed_imports(tree: ast.Module) -> list[str]:
    """Names imported at module level that a function parameter or a for-loop target rebinds inside a function."""
    imported = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        arguments = function.args
        names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
        for loop in (n for n in ast.walk(function) if isinstance(n, ast.For)):
            names += [t.id for t in ast.walk(loop.target) if isinstance(t, ast.Name)]
        found += [f"{function.name}: {name}" for name in names if name in imported]
    return found


def test_no_function_rebinds_an_imported_name():
    """A parameter or loop variable named like an imported function hides it (``commit: bool`` then ``commit([...])``
    calls the bool): no driver does that."""
    sample = ast.parse("from common import commit\ndef f(commit=False):\n    for commit in []: pass\n")
    assert _shadowed_imports(sample) == ["f: commit", "f: commit"]
    for path in sorted(EXPERIMENTS.glob("*.py")) + sorted((EXPERIMENTS / "common").glob("*.py")):
        assert _shadowed_imports(ast.parse(path.read_text(encoding="utf-8"))) == [], path.name
