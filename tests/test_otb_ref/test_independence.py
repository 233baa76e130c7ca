"""The two torch implementations of the estimator family are independent, and the fast one holds no input rules
(issue 40, items 1 and 2). Read from the source (AST), nothing imported.

* ``otb_ref/advantages.py`` (the fast path) imports from otb_ref only the table (``estimators``), the validation
  (``_validation``) and ``proxy.token_energy``; ``otb_ref/readable.py`` (the form to read) only the table and
  ``proxy.token_energy``. ``token_energy`` is exempt on purpose: F6's one definition of the per-token energy
  ``clamp(1 − 2π(y) + Σπ², 0, 2)``, which both must apply alike. Neither reaches the other through what it imports.
* ``advantages.py`` has no ``raise``: every error of ``compute_advantages`` comes from ``_validation`` (or the
  table's ``resolve_estimator``).
* ``advantages.py``, ``readable.py`` and ``train.py`` ask the table (``Estimator.inputs``, ``per_token_energy``,
  ``epsilon_applies``) instead of comparing estimator names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from otb_ref import ESTIMATORS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "otb_ref"
ANY = "*"  # the whole module

ALLOWED = {
    "advantages": {"otb_ref.estimators": ANY, "otb_ref._validation": ANY, "otb_ref.proxy": {"token_energy"}},
    "readable": {"otb_ref.estimators": ANY, "otb_ref.proxy": {"token_energy"}},
    "_validation": {"otb_ref._checks": ANY, "otb_ref.estimators": ANY},
}


def _module_path(module: str) -> Path | None:
    """The file of an otb_ref module (``otb_ref.x`` → otb_ref/x.py or otb_ref/x/__init__.py), else None."""
    parts = module.split(".")
    if parts[0] != "otb_ref":
        return None
    base = ROOT.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def otb_imports(path: Path) -> dict[str, set[str]]:
    """``{otb_ref module: names imported from it}`` of one source file of the repository."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    return imports_of(path.read_text(), package)


def imports_of(source: str, package: str) -> dict[str, set[str]]:
    """``{otb_ref module: names imported from it}`` (``{"*"}`` for the whole module) of a module's ``source`` in
    ``package``. ``from otb_ref import x`` names the module ``otb_ref.x`` where x is one, else the name x of the
    package."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "otb_ref":
                    found.setdefault(alias.name, set()).add(ANY)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from its package up
                parts = package.split(".")
                module = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "otb_ref":
                continue
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                if _module_path(submodule) is not None:
                    found.setdefault(submodule, set()).add(ANY)
                else:
                    found.setdefault(module, set()).add(alias.name)
    return found


def violations(imports: dict[str, set[str]], allowed: dict[str, object]) -> list[str]:
    """The imports that ``allowed`` (module -> ``ANY`` or the names allowed from it) does not allow."""
    bad = []
    for module, names in sorted(imports.items()):
        ok = allowed.get(module)
        if ok is None or (ok != ANY and (ANY in names or not names <= ok)):
            bad.append(f"{module}: {sorted(names)}")
    return bad


def _closure(module: str) -> set[str]:
    """Every otb_ref module whose source ``module`` imports, directly or through others (sub-packages' __init__
    included; not otb_ref/__init__.py, which re-exports the whole library)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or name == "otb_ref" or _module_path(name) is None:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # its packages' __init__ (not otb_ref's)
        todo += list(otb_imports(_module_path(name)))
    return seen


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_imports_from_otb_ref_are_only_the_allowed_ones(name):
    assert not violations(otb_imports(PACKAGE / f"{name}.py"), ALLOWED[name]), f"otb_ref/{name}.py"


def test_neither_implementation_reaches_the_other():
    """Through the modules they import (not counting the package's __init__, which re-exports both), the fast
    path never runs readable's source and readable never runs the fast path's; they share only the table, the
    proxy module (for ``token_energy``) and what those import."""
    own = {"advantages": "otb_ref.readable", "readable": "otb_ref.advantages"}
    reach = {}
    for name, other in own.items():
        reach[name] = set().union(*(_closure(module) for module in otb_imports(PACKAGE / f"{name}.py")))
        assert other not in reach[name], f"otb_ref/{name}.py reaches {other}"
    shared = reach["advantages"] & reach["readable"]
    assert shared <= {"otb_ref.estimators"} | _closure("otb_ref.proxy"), shared
    assert "otb_ref._validation" not in reach["readable"]


def test_the_import_rule_sees_forbidden_imports():
    """The rule can fail: each forbidden form of import is found (absolute, relative, a private name of proxy, the
    package's re-exports), and the allowed ones pass."""
    allowed = ALLOWED["advantages"]
    assert not violations(
        imports_of("from otb_ref.proxy import token_energy\nfrom . import _validation", "otb_ref"), allowed
    )
    for source in (
        "from otb_ref import readable",
        "from . import readable",
        "import otb_ref.readable",
        "from otb_ref.readable import group_baseline",
        "from otb_ref.proxy import _energy_dtype",
        "from otb_ref import proxy",
        "from otb_ref import _checks",
        "from otb_ref import compute_advantages",
    ):
        assert violations(imports_of(source, "otb_ref"), allowed), source


def test_the_fast_path_raises_nothing_itself():
    tree = ast.parse((PACKAGE / "advantages.py").read_text())
    raises = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Raise)]
    assert not raises, f"otb_ref/advantages.py raises at lines {raises}: input rules belong in otb_ref/_validation.py"


@pytest.mark.parametrize("path", ["otb_ref/advantages.py", "otb_ref/readable.py", "otb_ref/_validation.py", "train.py"])
def test_no_estimator_name_is_compared(path):
    """Branches ask the table's cell (granularity, energy, inputs, per_token_energy, epsilon_applies), never a
    name: a new row of the table needs no new branch."""
    tree = ast.parse((ROOT / path).read_text())
    names = set(ESTIMATORS)

    def constants(value):  # a constant, or those of a literal tuple, list or set (``x in ("a", "b")``)
        items = value.elts if isinstance(value, (ast.Tuple, ast.List, ast.Set)) else [value]
        return [item.value for item in items if isinstance(item, ast.Constant)]

    compared = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        for value in [node.left, *node.comparators]
        if set(constants(value)) & names
    ]
    assert not compared, f"{path} compares estimator names at lines {compared}"


@pytest.mark.parametrize("name", ["advantages", "readable"])
def test_the_rule_index_names_definitions_of_the_module(name):
    """Each module's docstring says where each rule is applied; every name it gives exists there (a rename that
    forgets the index fails), and the index names at least the rules of THEORY §3 listed here."""
    path = PACKAGE / f"{name}.py"
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    index = doc.split("Where each rule", 1)[1].split("\n\n", 2)[1]
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    rules = {
        "energy",
        "mask",
        "baseline",
        "leave-one-out",
        "group of one",
        "std",
        "multi-turn",
        "zero tail",
        "precision",
    }
    assert all(any(rule in line for line in index.splitlines()) for rule in rules), index
    for line in index.splitlines():
        where = re.sub(r"\(.*?\)", "", line.split("  ")[-1])  # the names, without remarks in parentheses
        for name in (n.strip() for n in where.split(",")):
            if not name.startswith("otb_ref."):  # another module: the import rules above cover it
                assert name.split(".")[0] in defined, f"{path.name}: {line!r} names {name}, not defined there"
