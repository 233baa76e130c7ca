"""Test configuration: hypothesis profiles, import path, deprecations as errors, fact markers, and a clean checkout.

Profiles: ``ci`` (default under CI=true: few examples, derandomised so CI is
reproducible), ``dev`` (default locally), ``thorough`` (HYPOTHESIS_PROFILE=thorough),
``mutations`` (tools/mutations.py: ci's examples without shrinking).
"""

import logging
import os
import re
import sys
import warnings
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/strategies.py, tests/oracle.py

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=60, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
# tools/mutations.py: CI's examples, no shrinking (a mutant fails many tests; only whether they fail matters).
settings.register_profile(
    "mutations", max_examples=25, derandomize=True, phases=[Phase.explicit, Phase.generate], **_common
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


import pytest  # noqa: E402


class _LoggedDeprecation(logging.Handler):
    """transformers logs some deprecations instead of warning them (5.24: "`past_key_values`/`cache_params` are
    deprecated"): each becomes a DeprecationWarning where it is logged, which pyproject's filterwarnings makes an
    error."""

    def emit(self, record: logging.LogRecord) -> None:
        if "deprecat" in record.getMessage().lower():
            warnings.warn(f"{record.name} logged: {record.getMessage()}", DeprecationWarning, stacklevel=2)


logging.getLogger("transformers").addHandler(_LoggedDeprecation())

import otb_ref.advantages  # noqa: E402


@pytest.fixture(params=["one_block", "row_blocks"])
def row_blocking(request):
    """Run a test with all rows in one block and with a one-element budget (the CPU path: one group per block)."""
    saved = otb_ref.advantages._CPU_BLOCK_ELEMENTS
    otb_ref.advantages._CPU_BLOCK_ELEMENTS = saved if request.param == "one_block" else 1
    yield request.param
    otb_ref.advantages._CPU_BLOCK_ELEMENTS = saved


# Fact markers (registered in pyproject.toml), so that `pytest -m f6` selects every test of F6:
# * a test named test_f<k>_... (k = 1..7, THEORY §2) gets marker f<k>; test_e1_/test_e2_ (proofs/F5's side results
#   E1, E2) get e1/e2 and f5;
# * a test cited for fact F<k> gets f<k> whatever its name: in the "Checked by" list of proofs/F<k>_*.md, or in
#   the F<k> row of docs/THEORY.md §7 (where `::name` repeats the file of the id before it); e.g.
#   tests/test_otb_ref/test_proxy.py::test_logit_gradient_identity gets f6. A citation marked E1/E2 (a list item
#   starting with "E1:", or followed by "(E1)") also gets e1/e2.
_FACT_PREFIX = re.compile(r"^test_(f[1-7]|e[12])_")
_CITATION = re.compile(r"`((?:tests/[\w/]+\.py)?::test_\w+)`(?:\s*\((E[12])\))?")


def _citations(line: str, fact: str, cited: dict[str, set[str]]) -> None:
    """Add the test ids cited on one line to ``cited`` under ``fact`` (and E1/E2 where marked)."""
    item = re.match(r"\*\s*(E[12])\b", line.strip())
    path = ""
    for test, side in _CITATION.findall(line):
        if test.startswith("::"):
            test = path + test
        path = test.split("::")[0]
        marks = cited.setdefault(test, set())
        marks.add(fact)
        for mark in (side, item.group(1) if item else ""):
            if mark:
                marks.add(mark.lower())


def _cited_facts(root: Path) -> dict[str, set[str]]:
    """``{"tests/x.py::test_y": {"f6", ...}}`` from proofs/ and docs/THEORY.md (empty where they are absent)."""
    cited: dict[str, set[str]] = {}
    for proof in sorted((root / "proofs").glob("F[1-7]_*.md")):
        text = proof.read_text(encoding="utf-8")
        section = text[text.find("## Checked by") :] if "## Checked by" in text else ""
        for line in section.splitlines():
            _citations(line, proof.name[:2].lower(), cited)
    theory = root / "docs" / "THEORY.md"
    if theory.exists():
        for line in theory.read_text(encoding="utf-8").splitlines():
            row = re.match(r"\|\s*F([1-7])\b", line)
            if row:
                _citations(line.split("|")[-2], f"f{row.group(1)}", cited)  # the tests column
    return cited


def pytest_collection_modifyitems(config, items):
    cited = _cited_facts(Path(str(config.rootpath)))
    for item in items:
        facts = set()
        match = _FACT_PREFIX.match(getattr(item, "originalname", None) or item.name)
        if match is not None:
            facts.add(match.group(1))
            if match.group(1).startswith("e"):
                facts.add("f5")
        facts |= cited.get(item.nodeid.split("[")[0], set())
        for fact in sorted(facts):
            item.add_marker(getattr(pytest.mark, fact))


# A clean checkout: the tests write under pytest's tmp paths only. A session that leaves a new file in the checkout
# (runs/ included) fails and names it; pytest's, hypothesis's and Python's own caches do not count, nor do git's
# files and virtual environments.
_CACHES = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}
_CHECKOUT_BEFORE = pytest.StashKey[set]()


def _checkout_files(root: Path) -> set[str]:
    """Every file and folder under ``root`` (relative paths), less caches and virtual environments."""
    found = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if d not in _CACHES and not d.endswith(".egg-info") and not (Path(folder, d) / "pyvenv.cfg").exists()
        ]
        found.update(os.path.relpath(os.path.join(folder, name), root) for name in dirs + files)
    return found


def pytest_sessionstart(session):
    session.stash[_CHECKOUT_BEFORE] = _checkout_files(session.config.rootpath)


def pytest_sessionfinish(session, exitstatus):
    new = sorted(_checkout_files(session.config.rootpath) - session.stash.get(_CHECKOUT_BEFORE, set()))
    if new:
        shown = ", ".join(new[:10]) + (f" and {len(new) - 10} more" if len(new) > 10 else "")
        sys.stderr.write(f"\nFAILED: the tests left new files in the checkout (write under tmp_path): {shown}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
