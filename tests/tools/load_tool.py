"""The project's tools/ scripts (not a package) loaded as modules, for their tests."""

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    """``tools/<name>.py`` imported afresh under its own name (mutation_score imports mutation_tests by name)."""
    sys.modules.pop(name, None)
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
