"""tools/mutation_score.py after issue 42: results record the tests tree, listed equivalents are judged again when
it changes (and leave the list when killed), `--table` refuses stale results, and the table counts kinds of
equivalents and the outcomes apart from kills separately."""

import json
from pathlib import Path

import pytest
from load_tool import load_tool

ROOT = Path(__file__).resolve().parents[2]


load_tool("mutation_tests")
score = load_tool("mutation_score")


def _note(verdict="killed", **fields):
    return json.dumps({"status": 1 if verdict == "killed" else 0, "verdict": verdict, **fields})


def _record(outcome, mutated="m", line=1, note=None, operator="op"):
    return {
        "file": "otb_ref/proxy.py",
        "operator": operator,
        "occurrence": line,
        "original": "a = b",
        "mutated": mutated,
        "outcome": outcome,
        "line": line,
        "note": note if note is not None else _note("survived" if outcome == "survived" else outcome),
    }


def _header(**fields):
    base = {"module": "proxy", "tool": "cosmic-ray 8.7.0", "pending": 0, "date": "2026-11-27", "machine": "m"}
    return {**base, **fields}


def _write(tmp_path, header, records, equivalent=()):
    lines = [json.dumps(r) for r in [header, *records]]
    (tmp_path / "proxy.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "equivalent.json").write_text(json.dumps(list(equivalent)))
    return tmp_path


def test_table_refuses_results_whose_tests_or_code_are_not_heads(tmp_path, monkeypatch, capsys):
    module, tests = score.module_key("proxy"), score.tests_key()
    docs = tmp_path / "mutations.md"
    docs.write_text("before\n<!-- mutation-table -->\nold\n<!-- /mutation-table -->\nafter\n")
    monkeypatch.setattr(score, "RESULTS", tmp_path)
    monkeypatch.setattr(score, "DOCS", docs)
    records = [_record("killed")]
    for stale_header, why in (
        (_header(module_code=module, tests="0123456789"), "tests tree 0123456789"),
        (_header(module_code="0123456789", tests=tests), "code 0123456789"),
        (_header(module_code=module), "tests tree (not recorded)"),
    ):
        _write(tmp_path, stale_header, records)
        with pytest.raises(SystemExit, match="refusing") as refused:
            score.main(["--table"])
        assert why in str(refused.value)
        assert "old" in docs.read_text()  # the docs are left as they were
    _write(tmp_path, _header(module_code=module, tests=tests), records)
    assert score.main(["--table"]) == 0
    assert "| `otb_ref/proxy.py` | 1 | 1 |" in docs.read_text()


def test_listed_equivalents_run_again_when_the_tests_tree_changes():
    """kept(): kills stay while the module is unchanged; survivors, listed equivalents among them, only while the
    library and the tests are; a timeout, a crash, a driver error is always run again."""
    header = _header(module_code="mod", code="lib-tests1", tests="tests1")
    records = [
        _record("killed", "k"),
        _record("survived", "s"),
        _record("timeout", "t", note=_note("timeout")),
        _record("crash", "c", note=_note("crash")),
        _record("driver error", "d", note=_note("driver error")),
        _record("left out", "a", note="left out: in a type annotation"),
    ]
    mutated = lambda kept: sorted(r["mutated"] for r in kept)  # noqa: E731
    assert mutated(score.kept(header, records, "mod", "lib-tests1")) == ["k", "s"]
    assert mutated(score.kept(header, records, "mod", "lib-tests2")) == ["k"]  # new tests: the survivor runs again
    assert mutated(score.kept(header, records, "mod", "lib2-tests1")) == ["k"]  # another module changed
    assert score.kept(header, records, "mod2", "lib-tests1") == []  # this module changed: every mutant runs
    (kill,) = score.kept(header, records, "mod", "lib-tests2")
    assert json.loads(kill["note"])["judged"]["tests"] == "tests1"  # a kept kill names the tests that judged it


def test_a_listed_equivalent_that_a_run_kills_leaves_the_list(tmp_path, monkeypatch):
    for name, value in (("RESULTS", tmp_path), ("EQUIVALENT", tmp_path / "equivalent.json")):
        monkeypatch.setattr(score, name, value)
    monkeypatch.setattr(score, "CHANGES", tmp_path / "changes.jsonl")
    entries = [{**_record("survived", text), "reason": "why"} for text in ("now killed", "still alive", "elsewhere")]
    entries[2]["file"] = "otb_ref/readable.py"  # another module's entry: not this run's to judge
    killed = _record("killed", "now killed", note=_note(by="tests/t.py::test_new", exception="AssertionError"))
    _write(tmp_path, _header(), [killed, _record("survived", "still alive")], entries)
    (gone,) = score.prune_equivalents("proxy")
    assert gone["entry"]["mutated"] == "now killed" and gone["killed"][0]["by"] == "tests/t.py::test_new"
    left = json.loads((tmp_path / "equivalent.json").read_text())
    assert [e["mutated"] for e in left] == ["still alive", "elsewhere"]
    (logged,) = [json.loads(line) for line in (tmp_path / "changes.jsonl").read_text().splitlines()]
    assert logged["change"] == "removed: killed" and logged["entry"]["mutated"] == "now killed"
    assert score.prune_equivalents("proxy") == []
    entries[0]["mutated"] = "killed at one line, pending at another"
    killed["mutated"] = entries[0]["mutated"]
    _write(tmp_path, _header(pending=1), [killed], entries)
    assert score.prune_equivalents("proxy") == []  # a run with mutants pending removes nothing


BITWISE = "core/ReplaceBinaryOperator_Add_BitOr"


@pytest.mark.parametrize(
    "operator, note, outcome",
    [
        ("op", _note("killed", exception="AssertionError"), "killed"),
        ("op", _note("survived"), "survived"),
        ("op", _note("crash", note="the child died of SIGSEGV"), "crash"),
        ("op", _note("timeout"), "timeout"),
        ("op", _note("driver error"), "driver error"),
        ("op", "timeout", "timeout"),  # cosmic-ray's own limit
        ("op", "Traceback (most recent call last): ...", "driver error"),  # the client failed: no answer
        ("op", json.dumps({"status": 1, "tests": 3}), "killed"),  # before issue 42: pytest's exit status
        ("op", json.dumps({"status": 4, "tests": 3}), "driver error"),
        # a bitwise operator: left out only for the error it raises on a float, on the mutated line
        (BITWISE, _note(message="\"bitwise_or_cpu\" not implemented for 'Float'", at_mutation=True), "left out"),
        (BITWISE, _note(message="unsupported operand type(s) for |: 'float' and 'int'", at_mutation=True), "left out"),
        (BITWISE, _note(message="\"bitwise_or_cpu\" not implemented for 'Float'", at_mutation=False), "killed"),
        (BITWISE, _note(message="unsupported operand type(s) for |: 'tuple' and 'int'", at_mutation=True), "killed"),
        (BITWISE, _note(exception="AssertionError", message="assert 3 == 2", at_mutation=False), "killed"),
        (BITWISE, _note("survived"), "survived"),
    ],
)
def test_only_a_tests_exception_is_a_kill(operator, note, outcome):
    assert score.judge(operator, note) == outcome


def test_table_counts_kinds_of_equivalents_and_outcomes_apart(tmp_path):
    records = [_record("killed", "k", line=i) for i in range(1, 7)]
    records += [_record("survived", text) for text in ("eq", "tol", "scope", "alive")]
    records += [_record("timeout", "t", note=_note("timeout")), _record("crash", "c", note=_note("crash"))]
    records += [_record("left out", "x", note="left out: in a type annotation")]
    entries = [
        {**_record("survived", "eq"), "kind": "equivalent", "reason": "r"},
        {**_record("survived", "tol"), "kind": "equivalent within tolerance", "reason": "r"},
        {**_record("survived", "scope"), "kind": "out of scope", "scope": "s", "reason": "r"},
    ]
    text = score.table(_write(tmp_path, _header(tests="t"), records, entries))
    (row,) = [line for line in text.splitlines() if "| `otb" in line]
    # 12 mutants; score 6 / (12 - 1 - 1 - 1 - 2) = 85.7; strict 6 / (12 - 1) = 54.5
    assert row == "| `otb_ref/proxy.py` | 12 | 6 | 1 | 1 | 1 | 1 | 2 | 85.7 | 54.5 |"
    assert "| module | mutants | killed | equivalent | within tolerance | out of scope | survived | apart |" in text
    assert "`proxy` apart: 1 timeout, 1 crash." in text


def test_every_listed_equivalent_has_a_kind_and_out_of_scope_names_a_documented_class():
    path = score.EQUIVALENT
    if not path.exists():
        pytest.skip("no equivalent mutants listed")
    docs = (ROOT / "docs" / "mutations.md").read_text()
    for entry in json.loads(path.read_text()):
        assert entry.get("kind", "equivalent") in score.KINDS, entry
        if entry.get("kind") == "out of scope":
            assert entry.get("scope") and f"**{entry['scope']}**" in docs, entry
