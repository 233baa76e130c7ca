"""Apply one-line mutations of the formulas to a scratch copy and show that the tests catch each one.

    python tools/mutations.py            # every mutation: the test suite below, then the expected fact's tests
    python tools/mutations.py --quick    # only the expected fact's tests (`pytest -m f<k>`)
    python tools/mutations.py --only M7 M11

The working tree (git's tracked files and untracked ones it does not ignore) is copied into a temporary
directory; each mutation replaces one exact substring there (it must occur exactly once, else it is reported
"not applied"), pytest runs in that copy (CI=true, PYTHONPATH = the copy, and the "mutations" hypothesis
profile of tests/conftest.py: CI's derandomised examples, no shrinking), and the file is restored. The
unmutated copy must pass first. Prints a markdown table: mutation -> caught (yes/no) -> first failing test.
Not part of CI; nothing in the repository is modified.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    key: str
    file: str  # relative to the repository root
    old: str  # exact substring, must occur exactly once
    new: str
    description: str
    fact: str  # the pytest marker whose tests are expected to catch it


MUTATIONS = [
    # The three the issue names.
    Mutation(
        "M6",
        "otb_ref/exact/moments.py",
        "variance=second - float(mean @ mean)",
        "variance=second",
        "population variance := second moment E||g||² (drops −||E g||²)",
        "f4",
    ),
    Mutation(
        "M7",
        "otb_ref/readable.py",
        "return w.sum(dim=-1), w.cumsum(dim=-1)",
        "return w.sum(dim=-1), w",
        "OTB weights (population and spec): per-token w_t instead of realized W_t",
        "f5",
    ),
    Mutation(
        "M11",
        "otb_ref/estimators.py",
        '"otb": Estimator("token", "proxy"),',
        '"otb": Estimator("sequence", "exact"),',
        "OTB's cell of the one estimator table replaced by EOB's",
        "f5",
    ),
    # otb_ref/exact: moments, groups, policies.
    Mutation(
        "M6g",
        "otb_ref/exact/groups.py",
        "variance=second_moment - float(mean @ mean)",
        "variance=second_moment",
        "group variance := second moment",
        "f7",
    ),
    Mutation(
        "Mrtg",
        "otb_ref/readable.py",
        "return (rewards * mask).flip(-1).cumsum(-1).flip(-1)",
        "return (rewards * mask).cumsum(-1)",
        "returns-to-go summed forward (reward so far)",
        "f1",
    ),
    Mutation(
        "Mlen",
        "otb_ref/readable.py",
        'if spec.energy == "uniform":',
        'if spec.energy in ("uniform", "length"):',
        "energy length treated as uniform (population and spec): W_t = 1 instead of t, v = 1 instead of |y|",
        "f5",
    ),
    Mutation(
        "Mseq",
        "otb_ref/readable.py",
        "return w.sum(dim=-1), w.cumsum(dim=-1)",
        "return w.amax(dim=-1), w.cumsum(dim=-1)",
        "sequence weight (population and spec): v = max_t w_t instead of Σ_t w_t",
        "f3",
    ),
    Mutation(
        "Mbstar",
        "otb_ref/exact/moments.py",
        "energy = enum.token_energy_exact * enum.mask",
        "energy = enum.energy * enum.mask",
        "B** weighted by proxy energies instead of E[m_t ||s_t||²]",
        "f4",
    ),
    Mutation(
        "Mprefix",
        "otb_ref/exact/policies.py",
        "cumulative = self.gram.cumsum(1).cumsum(2)",
        "cumulative = self.gram.cumsum(1)",
        "exact ||S_t||² summed over one Gram axis only",
        "f5",
    ),
    Mutation(
        "Morder",
        "otb_ref/exact/groups.py",
        "return members, math.factorial(group_size) / repeats",
        "return members, 1.0 / repeats",
        "multisets counted once, not N!/Π m_k! times",
        "f7",
    ),
    # otb_ref/proxy.py: the token energy (F6).
    Mutation(
        "P2pi",
        "otb_ref/proxy.py",
        "pi_y.mul_(-2.0)",
        "pi_y.mul_(-1.0)",
        "token energy 1 − π_y + Σπ² (factor 2 dropped)",
        "f6",
    ),
    Mutation(
        "Psq",
        "otb_ref/proxy.py",
        "sum_pi_squared = (s2 / s1.square()).clamp_(max=1.0)",
        "sum_pi_squared = (s2 / s1).clamp_(max=1.0)",
        "Σπ² normalised by Σe instead of (Σe)²",
        "f6",
    ),
    # otb_ref/advantages.py: baselines, leave-one-out, std, multi-turn, zero tail.
    Mutation(
        "Acum",
        "otb_ref/advantages.py",
        "return out.copy_(block.w).cumsum_(-1).mul_(mask)",
        "return out.copy_(block.w).mul_(mask)",
        "library OTB: per-token w_t instead of realized W_t",
        "f7",
    ),
    Mutation(
        "Ais",
        "otb_ref/advantages.py",
        'w = w * values["rollout_is_weights"].square()',
        'w = w * values["rollout_is_weights"]',
        "IS weights: ρ̄ instead of ρ̄²",
        "f7",
    ),
    Mutation(
        "Aloo_seq",
        "otb_ref/readable.py",
        "return total - y if leave_one_out else total",
        "return total",
        "readable's leave-one-out sums keep the row's own terms (group_baseline: sequence and token cells)",
        "f7",
    ),
    Mutation(
        "Aloo_tok",
        "otb_ref/advantages.py",
        "own = _GroupSums(mask, W * G, W, mask * G) if multi_turn else _GroupSums(m_s, terms[:, 0], W, terms[:, 1])",
        "own = _GroupSums(mask, W * G * 0, W, mask * G) if multi_turn else _GroupSums(m_s, terms[:, 0] * 0, W, "
        "terms[:, 1])",
        "token leave-one-out: own term kept in the numerator",
        "f7",
    ),
    Mutation(
        "Astd",
        "otb_ref/readable.py",
        "dof = (n - 1).clamp(min=0).sum(-1)  # [G]",
        "dof = n.sum(-1)  # [G]",
        "group std with divisor N instead of N − 1",
        "f7",
    ),
    Mutation(
        "Astd_tok",
        "otb_ref/advantages.py",
        "scale = _std_scale(G_s, m_s, groups, epsilon, sums)[:, None] if spec.std_normalize else None",
        "scale = _std_scale(G[:, :1], m_s[:, :1] * 0 + 1, groups, epsilon, _GroupSums(groups.sum(m_s[:, :1] * 0 + 1), "
        "None, None, groups.sum(G[:, :1])))[:, None] if spec.std_normalize else None",
        "token cells scaled by the std of R (issue 22's bug) instead of G_t pooled within positions",
        "f7",
    ),
    Mutation(
        "Astd_zero",
        "otb_ref/advantages.py",
        "return torch.where(spread & (sd > 0), 1.0 / torch.where(sd > 0, sd, 1.0), 1.0)",
        "return torch.where(sd > 0, 1.0 / torch.where(sd > 0, sd, 1.0), 1.0)",
        "zero spread divided by ε (issue 22's bug) instead of left unscaled",
        "f7",
    ),
    Mutation(
        "Aeps",
        "otb_ref/advantages.py",
        "baseline_epsilon = epsilon if spec.epsilon_applies else 0.0",
        "baseline_epsilon = epsilon",
        "ε added to count denominators too",
        "f7",
    ),
    Mutation(
        "Asingle",
        "otb_ref/advantages.py",
        "group_has_baseline = None if every_group else (counts >= 2).to(_GROUP_DTYPE)  # [g]",
        "group_has_baseline = None if every_group else (counts >= 1).to(_GROUP_DTYPE)  # [g]",
        "a group of one gets a baseline",
        "f7",
    ),
    Mutation(
        "Arank",
        "otb_ref/readable.py",
        "rank = mask.long().cumsum(dim=-1) - 1",
        "rank = mask.long().cumsum(dim=-1)",
        "multi-turn slots off by one",
        "f7",
    ),
    Mutation(
        "Atail",
        "otb_ref/advantages.py",
        "baseline = torch.where(token_position < tail_start[:, None], baseline, 0.0)",
        "baseline = torch.where(token_position <= tail_start[:, None], baseline, 0.0)",
        "zero tail starts one position late",
        "f7",
    ),
    Mutation(
        "Aunique",
        "otb_ref/advantages.py",
        "unique_longest = is_longest & (num_longest[group] == 1) & (counts[group] >= 2)",
        "unique_longest = is_longest & (counts[group] >= 2)",
        "zero tail also for tied longest responses",
        "f7",
    ),
    # otb_ref/readable.py: the self-contained OTB function the README points to.
    Mutation(
        "Rotb_W",
        "otb_ref/readable.py",
        "W = w.double().cumsum(dim=-1)  # W_t, carried through holes; from here on fp64",
        "W = w.double()  # W_t, carried through holes; from here on fp64",
        "otb_advantages: per-token w_t instead of realized W_t",
        "f5",
    ),
    Mutation(
        "Rotb_loo",
        "otb_ref/readable.py",
        "members = same - torch.eye(len(ids), dtype=torch.float64, device=m.device) if leave_one_out else same",
        "members = same - 0 * torch.eye(len(ids), dtype=torch.float64, device=m.device) if leave_one_out else same",
        "otb_advantages: leave-one-out keeps row i among its members",
        "f5",
    ),
    # The edge rules of THEORY §3 and F6 (issue 27): ε shared with the members' mean, the mean at a zero
    # denominator, the clamp of w_t, the fp64 precision rule.
    Mutation(
        "Eshare",
        "otb_ref/advantages.py",
        "return sums.weighted.add_(mean.mul_(epsilon)).div_(sums.weight.add_(epsilon))",
        "return sums.weighted.div_(sums.weight.add_(epsilon))",
        "fast baseline (both granularities): verl's Σ a x / (Σ a + ε) (ε not shared with the members' mean)",
        "f7",
    ),
    Mutation(
        "Eshare_r",
        "otb_ref/readable.py",
        "return torch.where(den > 0, (num + epsilon * mean) / torch.where(den > 0, den, 1.0), mean)",
        "return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), mean)",
        "readable group_baseline: ε not shared with the members' mean",
        "f7",
    ),
    Mutation(
        "Eshare_otb",
        "otb_ref/readable.py",
        "baseline = torch.where(den > 0, (num + epsilon * mean) / torch.where(den > 0, den, 1.0), mean)  # B_t",
        "baseline = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), mean)  # B_t",
        "otb_advantages: ε not shared with the members' mean",
        "f5",
    ),
    Mutation(
        "Ezero",
        "otb_ref/advantages.py",
        "return torch.where(sums.weight > 0, sums.weighted.div_(sums.weight), mean)",
        "return torch.where(sums.weight > 0, sums.weighted.div_(sums.weight), 0.0)",
        "fast baseline (both granularities): 0 instead of the members' mean where Σ a + ε = 0",
        "f7",
    ),
    Mutation(
        "Eclamp",
        "otb_ref/proxy.py",
        "return pi_y.mul_(-2.0).add_(1.0).add_(sum_pi_squared.detach().to(dtype)).clamp_(0.0, 2.0)",
        "return pi_y.mul_(-2.0).add_(1.0).add_(sum_pi_squared.detach().to(dtype))",
        "token_energy: w_t not clamped into [0, 2]",
        "f6",
    ),
    Mutation(
        "Eclamp_otb",
        "otb_ref/readable.py",
        "(1 - 2 * old_log_probs.to(dt).exp() + sum_pi_squared.to(dt)).clamp(0.0, 2.0)",
        "(1 - 2 * old_log_probs.to(dt).exp() + sum_pi_squared.to(dt))",
        "otb_advantages: w_t not clamped into [0, 2]",
        "f6",
    ),
    Mutation(
        "Eprec",
        "otb_ref/advantages.py",
        "_GROUP_DTYPE = torch.float64",
        "_GROUP_DTYPE = torch.float32",
        "fast path: group statistics in fp32 instead of fp64",
        "f7",
    ),
    # otb_ref/grad_norms.py: the one-pass ||S||² of the EOB (F3).
    Mutation(
        "Gcross",
        "otb_ref/grad_norms.py",
        "self.terms.append(2 * _cross(call_a, name_a, call_b, name_b))",
        "self.terms.append(_cross(call_a, name_a, call_b, name_b))",
        "tied weights: cross term counted once, not twice",
        "f3",
    ),
]

# The test suite each mutation runs against (paths that exist), minus the slow multi-process/benchmark tests.
SUITE = [
    "tests/test_otb_ref/exact",
    "tests/test_otb_ref/test_advantages.py",
    "tests/test_otb_ref/test_proxy.py",
    "tests/test_otb_ref/test_grad_norms.py",
    "tests/test_otb_ref/test_readable.py",
    "tests/test_otb_ref/test_std_scaling.py",
    "tests/test_otb_ref/test_verl_parity.py",
    "tests/test_otb_ref/test_edge_rules.py",
    "tests/test_conformance.py",
]
DESELECT = "not fsdp and not benchmark_command"


def _scratch_copy() -> Path:
    """The working tree's files (tracked, and untracked ones git does not ignore) in a temporary directory."""
    scratch = Path(tempfile.mkdtemp(prefix="otb_mutations_"))
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, scratch / name)
    return scratch


def _env(scratch: Path) -> dict:
    # The "mutations" hypothesis profile (tests/conftest.py) draws CI's examples and skips shrinking.
    return dict(
        os.environ, CI="true", HYPOTHESIS_PROFILE="mutations", PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1"
    )


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)


def _pytest(scratch: Path, args: list[str], timeout: int, first_only: bool = True) -> tuple[str, list[str], str, float]:
    """Run pytest in the copy: ``(status, failing tests, "failed/run" counts, seconds)``.

    status: "pass", "fail", "timeout" or "empty" (nothing collected). ``first_only`` stops at the first failure.
    """
    shutil.rmtree(scratch / ".hypothesis", ignore_errors=True)  # no replay of a previous mutant's examples
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if first_only else []), *args]
    start = time.perf_counter()
    try:
        result = subprocess.run(
            command, cwd=scratch, env=_env(scratch), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", [], "", time.perf_counter() - start
    seconds = time.perf_counter() - start
    failing = list(dict.fromkeys(name for _, name in _FAILED.findall(result.stdout)))
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (failed|passed|errors?)\b", result.stdout)}
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    tally = f"{bad}/{bad + counts.get('passed', 0)}"
    if result.returncode == 0:
        return "pass", [], tally, seconds
    if result.returncode == 5:
        return "empty", [], tally, seconds
    return "fail", failing or [f"(pytest exit {result.returncode})"], tally, seconds


def _suite_args(scratch: Path, marker: str | None = None) -> list[str]:
    """The suite's paths that exist, the deselection, and ``-m marker`` if given."""
    paths = [p for p in SUITE if (scratch / p).exists()]
    return paths + ["-k", DESELECT] + (["-m", marker] if marker else [])


def _verdict(status: str) -> str:
    return {"fail": "yes", "pass": "**no**"}.get(status, status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="run only the expected fact's tests (pytest -m f<k>)")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="run these mutations only")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per pytest run")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.only or ()) - {m.key for m in MUTATIONS}):
        parser.error(f"--only: unknown mutation(s) {unknown}; choose from {[m.key for m in MUTATIONS]}")
    mutations = [m for m in MUTATIONS if not args.only or m.key in args.only]
    scratch = _scratch_copy()
    suite_paths = " ".join(_suite_args(scratch)[:-2])
    started = time.perf_counter()
    try:
        where = subprocess.run(
            [sys.executable, "-c", "import otb_ref; print(otb_ref.__file__)"],
            cwd=scratch,
            env=_env(scratch),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not where.startswith(str(scratch)):
            print(f"otb_ref imports from {where}, not from the scratch copy {scratch}", file=sys.stderr)
            return 2
        facts = sorted({m.fact for m in mutations})
        checks = [("-m " + " or ".join(facts), _suite_args(scratch, " or ".join(facts)))]
        if not args.quick:
            checks.append(("suite", _suite_args(scratch)))
        for label, pytest_args in checks:  # the unmutated copy must pass
            status, failing, _, seconds = _pytest(scratch, pytest_args, args.timeout)
            print(f"unmutated copy, {label}: {status} ({seconds:.0f} s) {failing}", file=sys.stderr)
            if status != "pass":
                return 2
        rows = []
        for mutation in mutations:
            path = scratch / mutation.file
            original = path.read_text(encoding="utf-8")
            count = original.count(mutation.old)
            if count != 1:
                rows.append((mutation, f"not applied (old text found {count} times)", "", "", ""))
                continue
            path.write_text(original.replace(mutation.old, mutation.new), encoding="utf-8")
            try:
                try:
                    compile(path.read_text(encoding="utf-8"), str(path), "exec")
                except SyntaxError:
                    rows.append((mutation, "not applied (does not compile)", "", "", ""))
                    continue
                # The fact's tests, all of them (no -x): how many of them fail.
                status, failing, tally, seconds = _pytest(
                    scratch, _suite_args(scratch, mutation.fact), args.timeout, first_only=False
                )
                fact_cell = _verdict(status) + (f", {tally} tests fail" if status == "fail" else "")
                fact_failing = failing[0] if failing else ""
                if args.quick:
                    suite_cell, suite_failing = "–", ""
                else:  # the whole suite, stopping at the first failure
                    status, failing, _, seconds = _pytest(scratch, _suite_args(scratch), args.timeout)
                    suite_cell, suite_failing = _verdict(status), failing[0] if failing else ""
                rows.append((mutation, suite_cell, suite_failing, fact_cell, fact_failing))
                print(
                    f"{mutation.key}: suite {suite_cell} {suite_failing}; -m {mutation.fact} {fact_cell} "
                    f"{fact_failing}",
                    file=sys.stderr,
                )
            finally:
                path.write_text(original, encoding="utf-8")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(
        f"Command: `python tools/mutations.py{' --quick' if args.quick else ''}"
        f"{' --only ' + ' '.join(args.only) if args.only else ''}`, {datetime.date.today().isoformat()}, "
        f"{time.perf_counter() - started:.0f} s. Suite: `pytest -x {suite_paths} "
        f"-k '{DESELECT}'` (CI=true); fact tests: the same paths with `-m <fact>`, without -x.\n"
    )
    print(
        "| key | file | mutation (one line) | expected fact | caught by the suite | first failing test "
        "| caught by `-m fact` | first failing fact test |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mutation, suite_cell, suite_failing, fact_cell, fact_failing in rows:
        cells = [
            mutation.key,
            f"`{mutation.file}`",
            f"{mutation.description}: `{mutation.old}` → `{mutation.new}`",
            mutation.fact.upper(),
            suite_cell,
            f"`{suite_failing}`" if suite_failing else "",
            fact_cell,
            f"`{fact_failing}`" if fact_failing else "",
        ]
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    missed = [m.key for m, suite_cell, _, fact_cell, _ in rows if "yes" not in suite_cell + fact_cell]
    summary = f"; NOT caught (or not applied): {missed}" if missed else "."
    print(f"\n{len(rows) - len(missed)} of {len(rows)} mutations caught{summary}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
