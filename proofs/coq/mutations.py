"""Mutation check of the Coq proofs (issue 39): each listed change to a statement or a definition makes it false,
so the build must break, in a proof (a mutated definition must still type-check). Run after `make -C proofs/coq`;
each mutant is built in a copy of proofs/coq.

Usage: python proofs/coq/mutations.py. Exit status 0 when the unmutated copy builds and every mutant breaks it.
"""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 600

# (file, text, replacement, what the change means). Each text occurs exactly once in its file.
MUTATIONS = [
    (
        "F6.v",
        "proxy_energy p y = 1 - 2 * p y + \\sum_v p v ^+ 2.",
        "proxy_energy p y = 1 - p y + \\sum_v p v ^+ 2.",
        "F6 identity: 2 pi_y -> pi_y",
    ),
    (
        "F6.v",
        "0 <= 1 - 2 * p y + \\sum_v p v ^+ 2 <= 2.",
        "0 <= 1 - 2 * p y + \\sum_v p v ^+ 2 <= 1.",
        "F6 bound: the constant 2 -> 1",
    ),
    (
        "F3.v",
        "  forall (Rw : Omega -> R) (b : R), 0 < Er Pr (fun w => sqnorm (S w)) ->\n",
        "  forall (Rw : Omega -> R) (b : R),\n",
        "F3 uniqueness: the hypothesis E||S||^2 > 0 dropped",
    ),
    (
        "Defs.v",
        "forall x h, alive h -> \\sum_v pi x h v *: score x h v = 0.",
        "forall x h, alive h -> \\sum_v pi x h v *: score x h v = \\sum_v pi x h v *: score x h v.",
        "setting: the per-prefix zero-mean score hypothesis dropped (made trivially true)",
    ),
    (
        "F2.v",
        "\\sum_(j < L | (j <= t)%N) Er Pr (fun w => mask j w * sqnorm (s_tok j w)).",
        "\\sum_(j < L | (j <= t)%N) Er Pr (fun w => mask t w * sqnorm (s_tok t w)).",
        "F2 energy: the summation index j swapped for t",
    ),
    (
        "Defs.v",
        "Definition hist (t : nat) (w : Omega) : seq (option V) := take t w.2.",
        "Definition hist (t : nat) (w : Omega) : seq (option V) := take t.+1 w.2.",
        "setting: the prefix h_t also reads y_t (a baseline that sees its own token)",
    ),
    (
        "Defs.v",
        "Definition energy_at (t : nat) : R := Er Pr (fun w => mask t w * sqnorm (s_tok t w)).",
        "Definition energy_at (t : nat) : R := Er Pr (fun w => mask t w * sqnorm (S w)).",
        "F4: B**'s denominator E[m_t ||s_t||^2] -> E[m_t ||S||^2]",
    ),
    (
        "Defs.v",
        "  (\\sum_(j < N | j != i) f (Y j)) / (N - 1)%:R.",
        "  (\\sum_(j < N | j != i) f (Y j)) / N%:R.",
        "F7: the leave-one-out plain mean's divisor N - 1 -> N",
    ),
    (
        "Defs.v",
        "  else (\\sum_(j < N | j != i) mask t (Y j) * W t (Y j) * G t (Y j) + eps * loo_mean G t i Y) / den.",
        "  else (\\sum_(j < N) mask t (Y j) * W t (Y j) * G t (Y j) + eps * loo_mean G t i Y) / den.",
        "F7: the leave-one-out weighted mean includes member i itself",
    ),
]


def build(directory: Path) -> tuple[bool, str]:
    """(whether `make` succeeded, where coqc stopped: 'file, line N')."""
    try:
        result = subprocess.run(["make"], cwd=directory, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {TIMEOUT_S} s"
    where = re.findall(r'File "\./([^"]+)", line (\d+)', result.stdout + result.stderr)
    return result.returncode == 0, ", ".join(f"{name} line {line}" for name, line in where[-1:])


def main() -> int:
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        shutil.copytree(HERE, base, ignore=shutil.ignore_patterns("__pycache__"))
        if not build(base)[0]:
            print("the unmutated proofs do not build", file=sys.stderr)
            return 1
        for index, (name, text, replacement, what) in enumerate(MUTATIONS):
            copy = Path(tmp) / f"mutant{index}"
            shutil.copytree(base, copy)  # keeps the built files: make rebuilds the mutated file and what needs it
            source = (copy / name).read_text()
            if source.count(text) != 1:
                failures.append(f"{name}: the text to mutate occurs {source.count(text)} times: {text!r}")
                continue
            (copy / name).write_text(source.replace(text, replacement))
            built, where = build(copy)
            broke = not built
            if broke and where.startswith("Defs.v"):  # a definition that no longer type-checks proves nothing
                failures.append(f"{name}: {what}: the mutant itself does not type-check ({where})")
            print(f"{f'broke the build ({where})' if broke else 'SURVIVED'}: {name}: {what}")
            if not broke:
                failures.append(f"{name}: {what}: the proofs still build")
            shutil.rmtree(copy)
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{len(MUTATIONS)} mutants, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
