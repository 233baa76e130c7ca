"""Optional extras (verl, TRL) in the tests: skipped with a reason where not installed, an error where required.

``.ci/run`` installs the extras and sets ``OTB_REF_REQUIRE_EXTRAS=1``: a broken install then fails the run instead
of skipping it silently.
"""

import importlib
import os

import pytest


def import_or_skip(module: str, reason: str):
    if os.environ.get("OTB_REF_REQUIRE_EXTRAS"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)
