"""No module of otb_ref uses another module's private names (issue 40): what one module offers another is public,
named and documented; a private name can change with its module alone.

Private modules of the package (``otb_ref._checks``) may be imported inside it: their public names are the
package's internal interface. Read statically (ast), so a lazy import inside a function counts too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "otb_ref"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_private_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in names if _private(name)}


def _imported_module(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute name of the module ``from X import …`` reads, if it is otb_ref's."""
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return name if name == "otb_ref" or name.startswith("otb_ref.") else None


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``module: line: what`` for every use of another otb_ref module's private name, over ``{module: (source,
    is_package)}``: ``from otb_ref.x import _y`` (``_y`` not a module), and ``name._y`` where ``_y`` is a private
    top-level name of another module and not of this one (``x._y`` after ``from otb_ref import x``, or a module
    object found at run time; not ``self._y`` or ``cls._y``)."""
    trees = {module: ast.parse(source) for module, (source, _) in sources.items()}
    private = {module: _top_level_private_names(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        others = set().union(*(names for other, names in private.items() if other != module)) - private[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _imported_module(node, module, sources[module][1])
                for alias in node.names if source else ():
                    if _private(alias.name) and f"{source}.{alias.name}" not in sources:
                        found.append(f"{module}:{node.lineno}: from {source} import {alias.name}")
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id not in ("self", "cls")  # an object's own attributes
                and node.attr in others
            ):
                found.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found)


def _package_sources() -> dict[str, tuple[str, bool]]:
    return {_module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_of_otb_ref_uses_another_modules_private_names():
    sources = _package_sources()
    assert {"otb_ref.proxy", "otb_ref.grad_norms", "otb_ref._checks", "otb_ref.integrations.verl"} <= set(sources)
    assert violations(sources) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from otb_ref.proxy import _raise_if_nan\n", "otb_ref.grad_norms:1: from otb_ref.proxy import _raise_if_nan"),
        ("from .proxy import _raise_if_nan\n", "otb_ref.grad_norms:1: from otb_ref.proxy import _raise_if_nan"),
        ("from otb_ref import proxy\nproxy._raise_if_nan\n", "otb_ref.grad_norms:2: proxy._raise_if_nan"),
        (
            "def f():\n    from otb_ref import proxy as p\n    return p._raise_if_nan\n",
            "otb_ref.grad_norms:3: p._raise_if_nan",
        ),
    ],
)
def test_the_check_finds_a_private_import_and_a_private_read(source, expected):
    """The checker itself: an import of another module's private name (absolute, relative, in a function) and a
    read of one through the module are found; the package's private module and a module's own names are not."""
    sources = _package_sources()
    assert violations({**sources, "otb_ref.grad_norms": (source, False)}) == [expected]
    allowed = "from otb_ref import _checks\nfrom otb_ref._checks import compute_dtype\n_x = 1\nself._x\n"
    assert violations({**sources, "otb_ref.grad_norms": (allowed, False)}) == []
