"""The Coq proofs' checks (issue 39), after `make -C proofs/coq`.

1. No gap: no proof file contains Admitted, admit, Axiom, Parameter, Conjecture (comments removed first).
2. Closed: `Print Assumptions` of every main theorem (each `Theorem` and `Corollary` of the files listed in
   _CoqProject) prints "Closed under the global context".
3. Statements: each main theorem's full statement (`Check`) and each definition's body (`Print`) equals the one
   committed in STATEMENTS.txt, so a statement cannot change unseen. `--write` regenerates STATEMENTS.txt (then
   review `git diff` and commit).

Usage: python proofs/coq/check.py [--write]. Exit status 0 when every check passes.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATEMENTS = HERE / "STATEMENTS.txt"
FORBIDDEN = ("Admitted", "admit", "Axiom", "Axioms", "Parameter", "Parameters", "Conjecture")
CLOSED = "Closed under the global context"
COQ_FLAGS = ["-R", ".", "OTB", "-w", "-notation-overridden,-ambiguous-paths"]


def proof_files() -> list[str]:
    """The .v files of _CoqProject, in build order."""
    lines = (HERE / "_CoqProject").read_text().splitlines()
    return [line.strip() for line in lines if line.strip().endswith(".v")]


def strip_comments(text: str) -> str:
    """Coq source without its (possibly nested) comments; string literals are not used in these files."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith("(*", i):
            depth, i = depth + 1, i + 2
        elif depth and text.startswith("*)", i):
            depth, i = depth - 1, i + 2
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def forbidden_in(source: str) -> list[str]:
    """The forbidden words in a Coq source, outside comments, in order."""
    pattern = re.compile(r"\b(" + "|".join(FORBIDDEN) + r")\b")
    return [match.group(1) for match in pattern.finditer(strip_comments(source))]


def forbidden_words(files: list[str]) -> list[str]:
    """'file: word' for each forbidden vernacular or tactic word in the proof files."""
    return [f"{name}: {word}" for name in files for word in forbidden_in((HERE / name).read_text())]


def main_theorems(files: list[str]) -> list[tuple[str, str]]:
    """(module, name) of each Theorem and Corollary, in file order."""
    result = []
    for name in files:
        source = strip_comments((HERE / name).read_text())
        for match in re.finditer(r"^\s*(?:Theorem|Corollary)\s+([A-Za-z0-9_']+)", source, re.MULTILINE):
            result.append((name[: -len(".v")], match.group(1)))
    return result


def definitions(files: list[str]) -> list[tuple[str, str]]:
    """(module, name) of each Definition, in file order: their bodies are part of what the statements mean."""
    result = []
    for name in files:
        source = strip_comments((HERE / name).read_text())
        for match in re.finditer(r"^\s*Definition\s+([A-Za-z0-9_']+)", source, re.MULTILINE):
            result.append((name[: -len(".v")], match.group(1)))
    return result


def query(theorems: list[tuple[str, str]], defs: list[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """name -> (statement printed by Check, output of Print Assumptions) for each theorem and name -> (body printed
    by Print, "") for each definition, from one coqc run."""
    modules = " ".join(dict.fromkeys(["Defs", *(module for module, _ in theorems)]))
    with tempfile.TemporaryDirectory() as tmp:
        lines = [
            "From mathcomp Require Import all_ssreflect all_algebra.",
            f"From OTB Require Import {modules}.",
            "Import GRing.Theory Num.Theory.",
            "Open Scope ring_scope.",
            "Unset Printing Implicit Defensive.",
            "Set Printing Width 116.",
        ]
        for module, name in theorems:
            lines.append(f'Redirect "{tmp}/{name}.stmt" Check {module}.{name}.')
            lines.append(f'Redirect "{tmp}/{name}.asm" Print Assumptions {module}.{name}.')
        for module, name in defs:
            lines.append(f'Redirect "{tmp}/{name}.def" Print {module}.{name}.')
        script = Path(tmp) / "Statements.v"
        script.write_text("\n".join(lines) + "\n")
        run = subprocess.run(["coqc", *COQ_FLAGS, str(script)], cwd=HERE, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"coqc failed (build first: make -C proofs/coq):\n{run.stdout}{run.stderr}")
        printed = {
            name: ((Path(tmp) / f"{name}.stmt.out").read_text(), (Path(tmp) / f"{name}.asm.out").read_text())
            for _, name in theorems
        }
        printed.update({name: ((Path(tmp) / f"{name}.def.out").read_text(), "") for _, name in defs})
        return printed


def render(theorems: list[tuple[str, str]], defs: list[tuple[str, str]], printed: dict[str, tuple[str, str]]) -> str:
    blocks = [f"(* {module}.v *)\n{printed[name][0].strip()}\n" for module, name in theorems]
    blocks.append("(* The definitions that the statements use, as Coq prints them. *)\n")
    blocks += [f"(* {module}.v *)\n{printed[name][0].strip()}\n" for module, name in defs]
    header = (
        "(* Generated by `python proofs/coq/check.py --write`: each main theorem's statement, as Coq prints it. *)\n"
    )
    return header + "\n" + "\n".join(blocks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate STATEMENTS.txt")
    args = parser.parse_args()
    files = proof_files()
    failures = [f"forbidden word: {hit}" for hit in forbidden_words(files)]
    theorems = main_theorems(files)
    defs = definitions(files)
    printed = query(theorems, defs)
    for _, name in theorems:
        if printed[name][1].strip() != CLOSED:
            failures.append(f"{name} is not closed: {printed[name][1].strip()}")
    text = render(theorems, defs, printed)
    if args.write:
        STATEMENTS.write_text(text)
    elif not STATEMENTS.exists() or STATEMENTS.read_text() != text:
        failures.append("STATEMENTS.txt differs from the statements Coq prints (python proofs/coq/check.py --write)")
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{len(theorems)} main theorems, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
