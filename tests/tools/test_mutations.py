"""tools/mutations.py's one-line mutations still apply to today's code: each old text occurs exactly once in its
file, and the mutated file is valid Python that differs from the original. A refactor that moves a formula's line
fails here until the mutation follows it (otherwise the tool would report it "not applied" and docs/mutations.md's
table would describe code that no longer exists)."""

import ast
from pathlib import Path

import pytest
from load_tool import load_tool

ROOT = Path(__file__).resolve().parents[2]
mutations = load_tool("mutations")


def test_keys_are_unique():
    keys = [mutation.key for mutation in mutations.MUTATIONS]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda mutation: mutation.key)
def test_mutation_applies_to_today_s_code(mutation):
    source = (ROOT / mutation.file).read_text()
    assert source.count(mutation.old) == 1, f"{mutation.key}: its old text occurs {source.count(mutation.old)} times"
    mutated = source.replace(mutation.old, mutation.new)
    assert mutated != source
    ast.parse(mutated)  # a SyntaxError here: the mutation would be "not applied (does not compile)"
    assert mutation.fact in {f"f{k}" for k in range(1, 8)} | {"e1", "e2"}


def test_unknown_only_key_is_a_usage_error(capsys):
    """``--only NOPE`` used to run nothing and report "0 of 0 mutations caught" (exit 0): now exit 2, naming it."""
    with pytest.raises(SystemExit) as exit_:
        mutations.main(["--only", "M7", "NOPE"])
    assert exit_.value.code == 2 and "'NOPE'" in capsys.readouterr().err
