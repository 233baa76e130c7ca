"""The committed mutation results describe HEAD (issue 40, item 5): each scored module's results were made from its
code at HEAD, none leaves a survivor unjudged, and every file of the library is scored or excluded by name with a
reason (tools/mutation_score.py: ``MODULES``, ``NOT_SCORED``). A commit that changes a scored module fails here until
``python tools/mutation_score.py --modules <it> --commit`` has run again (docs/mutations.md)."""

import subprocess
from pathlib import Path

import pytest
from load_tool import load_tool

ROOT = Path(__file__).resolve().parents[2]


def _is_checkout() -> bool:
    try:
        found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD:otb_ref"], capture_output=True)
    except FileNotFoundError:
        return False
    return found.returncode == 0


pytestmark = pytest.mark.skipif(not _is_checkout(), reason="needs the git checkout (results are keyed by git trees)")


load_tool("mutation_tests")
score = load_tool("mutation_score")


def _covered(path: str, places) -> bool:
    return any(path == place or path.startswith(place + "/") for place in places)


def test_every_library_file_is_scored_or_excluded_by_name():
    scored = [path for path, _ in score.MODULES.values()]
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "otb_ref").rglob("*.py"))
    assert files
    assert [f for f in files if not _covered(f, [*scored, *score.NOT_SCORED])] == []
    assert [f for f in files if _covered(f, scored) and _covered(f, score.NOT_SCORED)] == []  # not both
    assert all(reason.strip() for reason in score.NOT_SCORED.values())
    assert all((ROOT / place).exists() for place in [*scored, *score.NOT_SCORED])  # no stale names


def test_committed_results_were_made_from_heads_code():
    results = score.load_results()
    assert sorted(results) == sorted(score.MODULES)
    made_from = {name: header.get("module_code") for name, (header, _) in results.items()}
    assert made_from == {name: score.module_key(name) for name in score.MODULES}


def test_committed_results_leave_no_survivor_unjudged():
    listed = score.load_equivalent()
    survivors = {name: score.counts(records, listed)["survived"] for name, (_, records) in score.load_results().items()}
    assert survivors == dict.fromkeys(score.MODULES, 0)
