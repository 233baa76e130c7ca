"""tools/mutation_score.py and tools/mutation_tests.py: the docs table is the committed results' table, and the
rules that pick each mutant's tests hold on small sources (issue 29)."""

import ast
import json
from pathlib import Path

import pytest
from load_tool import load_tool

ROOT = Path(__file__).resolve().parents[2]


select = load_tool("mutation_tests")
score = load_tool("mutation_score")

SOURCE = '''\
import functools

LIMIT = 3


@functools.lru_cache(maxsize=2)
def f(x: int, y=LIMIT + 1) -> int:
    """Doc."""
    if x > 0:
        x = x + 1
    return g(
        x,
        y * 2,
    )


class C:
    size = 4

    def method(self):
        return self.size - 1
'''


@pytest.mark.parametrize(
    "line, span",
    [
        (3, None),  # module level: runs at import
        (6, None),  # a decorator
        (7, None),  # a default value in the signature
        (9, (9, 10)),  # an if's condition: the whole if
        (10, (10, 10)),  # a statement in a body
        (13, (11, 14)),  # one line of a multi-line statement
        (18, None),  # class level
        (21, (21, 21)),  # a method's body
    ],
)
def test_statement_span_runs_import_time_code_with_every_test(line, span):
    assert select.statement_span(ast.parse(SOURCE), line, line) == span


def test_changed_lines_finds_the_mutated_line():
    mutated = SOURCE.replace("x = x + 1", "x = x - 1")
    assert select.changed_lines(SOURCE, mutated) == (10, 10)
    with pytest.raises(ValueError, match="unchanged"):
        select.changed_lines(SOURCE, SOURCE)


def test_select_runs_the_tests_that_execute_the_statement_fastest_first():
    test_map = {
        "tests": ["t::a", "t::b", "t::c"],
        "durations": [3.0, 1.0, 2.0],
        "files": {"m.py": {"3": [0, 1, 2], "10": [0, 1], "21": [2]}},
    }
    body = SOURCE.replace("x = x + 1", "x = x * 1")
    assert select.select(test_map, "m.py", SOURCE, body) == ["t::b", "t::a"]
    header = SOURCE.replace("y=LIMIT + 1", "y=LIMIT - 1")
    assert select.select(test_map, "m.py", SOURCE, header) == ["t::b", "t::c", "t::a"]
    uncovered = SOURCE.replace("return g(", "return h(")
    assert select.select(test_map, "m.py", SOURCE, uncovered) == []


def test_annotation_spans_cover_every_annotation(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(SOURCE + "\nz: float | None = None\n")
    texts = set()
    lines = path.read_text().splitlines()
    for (row, col), (end_row, end_col) in score.annotation_spans(path):
        assert row == end_row
        texts.add(lines[row - 1][col:end_col])
    assert texts == {"int", "float | None"}


def _results(tmp_path, records, equivalent=()):
    header = {"module": "proxy", "tool": "cosmic-ray 8.7.0", "pending": 0, "date": "2026-11-25", "machine": "m"}
    (tmp_path / "proxy.jsonl").write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")
    (tmp_path / "equivalent.json").write_text(json.dumps(list(equivalent)))
    return tmp_path


def _record(outcome, mutated, line=1):
    return {
        "file": "otb_ref/proxy.py",
        "operator": "op",
        "original": "a = b",
        "mutated": mutated,
        "outcome": outcome,
        "line": line,
    }


def test_table_score_is_killed_over_mutants_less_equivalent(tmp_path):
    records = [_record("killed", "k")] * 6 + [_record("survived", "s1"), _record("survived", "s2")]
    records += [_record("left out", "x")]
    same = {**_record("survived", "s1"), "reason": "why"}
    (row,) = [line for line in score.table(_results(tmp_path, records, [same])).splitlines() if "| `otb" in line]
    assert row == "| `otb_ref/proxy.py` | 8 | 6 | 1 | 0 | 0 | 1 | 0 | 85.7 | 85.7 |"


def test_an_equivalent_with_a_line_covers_that_line_only(tmp_path):
    """The same mutation text on two lines: an entry that names a line makes only that one equivalent."""
    records = [_record("survived", "s", line=3), _record("survived", "s", line=9)]
    same = {**_record("survived", "s"), "line": 9, "reason": "why"}
    (row,) = [line for line in score.table(_results(tmp_path, records, [same])).splitlines() if "| `otb" in line]
    assert row == "| `otb_ref/proxy.py` | 2 | 0 | 1 | 0 | 0 | 1 | 0 | 0.0 | 0.0 |"


def test_docs_show_the_committed_results_table():
    if not score.load_results():
        pytest.skip("no results/mutation_score yet")
    assert score.table() in (ROOT / "docs" / "mutations.md").read_text()


def test_every_listed_equivalent_is_a_surviving_mutant_with_a_reason():
    path = score.EQUIVALENT
    if not path.exists():
        pytest.skip("no equivalent mutants listed")
    results = score.load_results()
    survivors = [r for _, records in results.values() for r in records if r["outcome"] == "survived"]
    # A module whose run is under way (mutants pending) has not judged its listed equivalents yet: each is checked
    # once its module's results are complete (tools/mutation_score.py prunes the killed ones then).
    running = {path for name, (path, _) in score.MODULES.items() if name in results and results[name][0]["pending"]}
    for entry in json.loads(path.read_text()):
        assert entry["reason"].strip(), entry
        if any(entry["file"] == p or entry["file"].startswith(p + "/") for p in running):
            continue
        listed = {(*score.equivalent_key(entry), entry.get("line"))}
        assert any(score.is_equivalent(r, listed) for r in survivors), f"stale entry (no such survivor): {entry}"


def test_a_statement_run_at_import_runs_every_test_of_the_module():
    test_map = {
        "tests": ["t::a", "t::b", "t::c"],
        "durations": [3.0, 1.0, 2.0],
        "files": {"m.py": {"3": [-1, 0], "10": [select.IMPORT], "21": [2]}},
    }
    body = SOURCE.replace("x = x + 1", "x = x * 1")
    assert select.select(test_map, "m.py", SOURCE, body) == ["t::c", "t::a"]


@pytest.mark.parametrize(
    "operator, occurrence, valid",
    [
        ("core/ReplaceBinaryOperator_Mul_Sub", 0, False),  # def f(a, -, b)
        ("core/ReplaceBinaryOperator_Mul_Div", 0, True),  # def f(a, /, b): positional-only, still Python
        ("core/ReplaceBinaryOperator_Mul_Sub", 1, True),  # a - b
        ("core/ReplaceBinaryOperator_Pow_Mul", 0, False),  # {*d, ...}
        ("core/ReplaceBinaryOperator_Pow_Mul", 1, True),  # 2 * 3
        ("core/ReplaceUnaryOperator_Invert_Not", 0, False),  # a & not b
        ("core/ReplaceUnaryOperator_Invert_USub", 0, True),  # a & -b
    ],
)
def test_mutants_that_are_not_python_are_recognised(operator, occurrence, valid):
    pytest.importorskip("cosmic_ray")
    from types import SimpleNamespace

    source = "def f(a, *, b):\n    return a * b & ~b\n\n\ndef g(d):\n    return {**d, 'x': 2 ** 3}\n"
    mutation = SimpleNamespace(operator_name=operator, operator_args={}, occurrence=occurrence)
    assert score.is_valid_python(source, mutation) is valid


def test_a_removed_decorator_is_one_key_whatever_prefix_cosmic_ray_writes():
    base = {"file": "otb_ref/proxy.py", "operator": "core/RemoveDecorator", "mutated": ""}
    keys = {score.equivalent_key({**base, "original": text}) for text in (" / @staticmethod", "/ @staticmethod")}
    assert keys == {("otb_ref/proxy.py", "core/RemoveDecorator", "@staticmethod", "")}
    assert score.equivalent_key({**base, "original": "a / b"})[2] == "a / b"


def test_the_newest_session_with_shards_gives_the_keys(tmp_path):
    """--collect and a new start read the newest session that has shard files (a session without shards has no
    results yet), whatever order the names sort in."""
    import os

    for stem, age in (("exact-aaa-111", 30), ("exact-bbb-222", 20), ("exact-ccc-333", 10)):
        for suffix in (".sqlite", ".0of2.sqlite") if stem != "exact-ccc-333" else (".sqlite",):
            path = tmp_path / f"{stem}{suffix}"
            path.write_text("")
            os.utime(path, (1e9 - age, 1e9 - age))
    stems = {"exact-aaa-111", "exact-bbb-222", "exact-ccc-333"}
    assert score.newest_sharded_session(stems, tmp_path) == ("bbb", "222")
    assert score.newest_sharded_session({"exact-ccc-333"}, tmp_path) is None


def test_a_record_of_older_code_names_no_line_head_lacks():
    """Merging a session of older code: a mutant whose line HEAD's file no longer has (shorter file, or the file
    removed) gets an empty "original" instead of stopping the driver; a line HEAD has is read from HEAD."""
    from types import SimpleNamespace

    def record(file, line):
        mutation = SimpleNamespace(
            module_path=file,
            start_pos=(line, 0),
            operator_name="core/NumberReplacer",
            occurrence=0,
            definition_name=None,
        )
        result = SimpleNamespace(diff=None, worker_outcome="normal", output="")
        return score._record(mutation, result, "HEAD", {})

    assert record("otb_ref/estimators.py", 10**6)["original"] == ""
    assert record("otb_ref/no_such_module.py", 3)["original"] == ""
    first = (ROOT / "otb_ref/estimators.py").read_text().splitlines()[0].strip()
    assert record("otb_ref/estimators.py", 1)["original"] == first
