"""Equal rate, equal step: is leave-one-out OTB's lead over RLOO at equal learning rate one of variance (issue 38)?

    python experiments/equal_rate.py                  # every run not yet recorded (one at a time), then the report
    python experiments/equal_rate.py --secondary      # also the lr 1e-3 cells, after every 3e-4 record
    python experiments/equal_rate.py --report-only    # results/equal_rate.md from the records alone
    python experiments/equal_rate.py --quick          # seconds (the test suite)

Issue 28 (experiments/variance_lr.py) saw leave-one-out OTB's M above RLOO's at every equal learning rate of its
selection, but at equal rate AdamW takes larger steps for OTB-LOO (median ‖Δθ‖ ratio 1.08 at N = 4, 1.09 at N = 16,
lr 3e-4). This driver runs three arms on paired seeds: ``otb_loo`` at lr, ``rloo`` at lr, and ``rloo_matched``,
RLOO at lr x r with r issue 28's update-size ratio at that (N, lr), a control matched in step size. Settings are
issue 28's (its warm start, task, 10-step warmup, no gradient clipping, PPO clip 0.2, 150 steps; no aim steps).

The design, the rule for r, the seeds and the verdict rule are in :data:`RULE` (``results/equal_rate/RULE.md``),
committed before the first record; the driver refuses to run without it, with it changed since that commit, or
with that commit not an ancestor of the code it runs. Its seeds come from that commit's hash. Each record carries
the rule's commit and the code (``git rev-parse HEAD``, clean tree or not) its process started with.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import statistics
import subprocess
import time
from pathlib import Path

from common import CODE_AT_START, code_text, variance_rule, variance_runs, write_report

ROOT = Path(__file__).resolve().parents[1]
RULE = ROOT / "results" / "equal_rate" / "RULE.md"
ISSUE_28 = ROOT / "results" / "variance_lr"
ARMS = ("otb_loo", "rloo", "rloo_matched")
GROUP_SIZES = (4, 16)
PRIMARY_LRS = (3e-4,)
SECONDARY_LRS = (1e-3,)
SEEDS = 10
STEPS = variance_runs.STEPS
ALPHA = 0.05
MATCH_TOLERANCE = 0.05  # a cell's measured step-size ratio otb_loo / rloo_matched outside 1 ± this is labelled
QUICK = {"group_sizes": (2,), "lrs": (1e-3,), "seeds": 2, "steps": 2, "ratio": 1.5}


class RuleError(SystemExit):
    """The rule file is missing, uncommitted, changed since its commit, or its commit is not an ancestor."""


# ----------------------------------------------------------------------------- the rule and what it fixes


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def is_ancestor(root: Path, ancestor: str, commit: str) -> bool:
    return _git(root, "merge-base", "--is-ancestor", ancestor, commit).returncode == 0


def rule_commit(rule: Path = RULE, head: str = "HEAD") -> str:
    """The commit that added ``rule``, after checking that the file exists, is committed, is unchanged since that
    commit (in the tree and in the work tree) and that the commit is an ancestor of ``head``; else
    :class:`RuleError`."""
    if not rule.is_file():
        raise RuleError(f"--rule: {rule} is missing; commit the rule before the first run")
    root = Path(_git(rule.parent, "rev-parse", "--show-toplevel").stdout.strip() or rule.parent)
    relative = rule.resolve().relative_to(root.resolve()).as_posix()
    added = _git(root, "log", "--diff-filter=A", "--format=%H", head, "--", relative).stdout.split()
    if not added:
        raise RuleError(f"--rule: {relative} is not committed in {head}'s history; commit it before the first run")
    commit = added[-1]
    if _git(root, "diff", "--quiet", commit, "--", relative).returncode != 0:
        raise RuleError(f"--rule: {relative} changed since its commit {commit[:12]}; a rule is fixed once committed")
    if not is_ancestor(root, commit, head):
        raise RuleError(f"--rule: its commit {commit[:12]} is not an ancestor of {head}")
    return commit


def seeds_from(commit: str, count: int = SEEDS) -> list[int]:
    """``count`` distinct seeds: 10,000 + the first 8 hex digits of sha256("<commit>/<i>") mod 990,000, for
    i = 0, 1, ... (a repeat is skipped)."""
    out: list[int] = []
    for i in itertools.count():
        seed = 10_000 + int(hashlib.sha256(f"{commit}/{i}".encode()).hexdigest()[:8], 16) % 990_000
        if seed not in out:
            out.append(seed)
        if len(out) == count:
            return out
    raise AssertionError("unreachable")


def update_ratio(records_dir: Path, n: int, lr: float, seeds=variance_rule.SELECTION_SEEDS) -> float:
    """r at (N, lr), issue 28's column "median ‖Δθ‖ ratio otb_loo / rloo": the mean over its selection seeds of
    median ‖Δθ‖ (all 150 steps) of otb_loo over that of rloo, paired by seed; rounded to 3 decimals."""
    by_cell = variance_rule.cells(variance_runs.load_runs(records_dir))
    a, b = by_cell.get(("otb_loo", n, lr), {}), by_cell.get(("rloo", n, lr), {})
    missing = [s for s in seeds if s not in a or s not in b]
    if missing:
        raise ValueError(f"records_dir: issue 28's records at N = {n}, lr {lr:g} lack seeds {missing}")
    ratios = [variance_rule.median_step(a[s]) / variance_rule.median_step(b[s]) for s in seeds]
    return round(statistics.mean(ratios), 3)


def arm_lr(arm: str, lr: float, ratio: float) -> float:
    return round(lr * ratio, 12) if arm == "rloo_matched" else lr


def run_name(arm: str, n: int, lr: float, seed: int) -> str:
    """Named by the cell's rate (the matched arm's own rate is in its record)."""
    return f"{arm}_n{n}_lr{lr:g}_seed{seed}"


# ----------------------------------------------------------------------------- statistics of the rule


def sign_flip_p(diffs: list[float]) -> float:
    """Exact one-sided sign-flip p of mean(d) > 0: the share of the 2^n sign vectors whose mean is at least the
    observed one (a tolerance of 1e-12 counts ties)."""
    if not diffs:
        return math.nan
    observed = sum(diffs)
    hits = sum(
        sum(s * abs(d) for s, d in zip(signs, diffs)) >= observed - 1e-12
        for signs in itertools.product((1, -1), repeat=len(diffs))
    )
    return hits / 2 ** len(diffs)


def holm(p_values: dict) -> dict:
    """Holm's step-down adjustment: key -> adjusted p (monotone, at most 1)."""
    order = sorted(p_values, key=lambda k: p_values[k])
    adjusted, running = {}, 0.0
    for rank, key in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p_values[key]))
        adjusted[key] = running
    return adjusted


def mcnemar_p(a: list[bool], b: list[bool]) -> float:
    """Exact two-sided McNemar p on paired booleans (collapsed or not): a binomial(½) test of the discordant
    pairs."""
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    total = only_a + only_b
    if total == 0:
        return 1.0
    tail = sum(math.comb(total, k) for k in range(min(only_a, only_b) + 1)) / 2**total
    return min(1.0, 2 * tail)


# ----------------------------------------------------------------------------- reading the records


def admissible(record: dict, commit: str | None, root: Path = ROOT) -> str:
    """The empty string if ``record`` counts for the rule's ``commit``, else why not: another rule, a dirty tree,
    or code that does not descend from the rule's commit (``commit`` None: quick mode, every record counts)."""
    if commit is None:
        return ""
    code = record.get("code") or {}
    if record.get("rule_commit") != commit:
        return f"rule commit {str(record.get('rule_commit'))[:12]}"
    if not code.get("clean"):
        return "uncommitted changes at its start"
    if not code.get("commit") or not is_ancestor(root, commit, code["commit"]):
        return f"code {str(code.get('commit'))[:12]} does not descend from the rule"
    return ""


def cell(by_cell: dict, n: int, lr: float, seeds: list[int]) -> dict:
    """One (N, lr) cell: per arm and seed M, final reward, collapsed, median ‖Δθ‖; the paired contrasts over the
    seeds every arm has; the rule's p values (one-sided, each direction) on d = otb_loo − rloo_matched."""
    runs = {arm: {s: r for s, r in by_cell.get((arm, n, lr), {}).items() if s in seeds} for arm in ARMS}
    both = [s for s in seeds if all(s in runs[arm] for arm in ARMS)]
    per = {
        key: {arm: {s: fn(runs[arm][s]) for s in both} for arm in ARMS}
        for key, fn in (
            ("M", lambda r: variance_runs.reward_per_token(r["rows"])),
            ("final", lambda r: variance_runs.final_reward(r["rows"])),
            ("collapsed", variance_rule.collapsed),
            ("step", variance_rule.median_step),
        )
    }
    m = per["M"]
    contrasts = {
        "otb_loo − rloo_matched": variance_rule.paired(m["otb_loo"], m["rloo_matched"]),
        "otb_loo − rloo": variance_rule.paired(m["otb_loo"], m["rloo"]),
        "rloo_matched − rloo": variance_rule.paired(m["rloo_matched"], m["rloo"]),
    }
    diffs = contrasts["otb_loo − rloo_matched"]["diffs"]
    steps = per["step"]

    def step_ratio(other: str) -> float:
        return statistics.mean(steps["otb_loo"][s] / steps[other][s] for s in both) if both else math.nan

    return {
        "n": n, "lr": lr, "seeds": both, "needed": len(seeds), "complete": len(both) == len(seeds),
        "per": per, "contrasts": contrasts,
        "p_otb": sign_flip_p(diffs), "p_rloo": sign_flip_p([-d for d in diffs]),
        "p_equal_rate": sign_flip_p(contrasts["otb_loo − rloo"]["diffs"]),
        "step_ratio": step_ratio("rloo_matched"), "step_ratio_unmatched": step_ratio("rloo"),
        "collapse_p": mcnemar_p([per["collapsed"]["otb_loo"][s] for s in both],
                                [per["collapsed"]["rloo_matched"][s] for s in both]),
    }  # fmt: skip


def verdict(primary: list[dict], alpha: float = ALPHA) -> str:
    """The rule's output on the 3e-4 cells (RULE.md): Holm across them in each direction."""
    if not primary or not all(c["complete"] for c in primary):
        done = sum(len(c["seeds"]) for c in primary)
        needed = sum(c["needed"] for c in primary)
        return f"Rule output: **not decided yet** ({done} complete seed triples of {needed})."
    p_otb = holm({(c["n"], c["lr"]): c["p_otb"] for c in primary})
    p_rloo = holm({(c["n"], c["lr"]): c["p_rloo"] for c in primary})
    if all(p <= alpha for p in p_otb.values()):
        word = "variance reduction helps at equal step size"
    elif all(p <= alpha for p in p_rloo.values()):
        word = "step-matched RLOO better"
    else:
        word = "not shown at equal step size"
    parts = []
    for c in primary:
        key, d = (c["n"], c["lr"]), c["contrasts"]["otb_loo − rloo_matched"]
        label = "" if abs(c["step_ratio"] - 1) <= MATCH_TOLERANCE else " (step sizes not matched within 5%)"
        parts.append(
            f"N = {c['n']}, lr {c['lr']:g}: d(M) = otb_loo − rloo_matched = {variance_rule.interval_text(d)}, "
            f"sign-flip p = {c['p_otb']:.4f} (Holm {p_otb[key]:.4f}), reverse p = {c['p_rloo']:.4f} "
            f"(Holm {p_rloo[key]:.4f}); step-size ratio otb_loo / rloo_matched {c['step_ratio']:.3f}{label}"
        )
    return f"Rule output: **{word}**; " + "; ".join(parts) + "."


# ----------------------------------------------------------------------------- report


def cell_lines(c: dict, ratio: float) -> list[str]:
    lines = [
        f"### N = {c['n']}, lr {c['lr']:g} (r = {ratio:.3f}; {len(c['seeds'])} complete seed triples)",
        "",
        "| arm | rate | M (mean ± sd) | final reward | collapsed | median ‖Δθ‖ |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        per = {key: list(c["per"][key][arm].values()) for key in c["per"]}
        lines.append(
            f"| {arm} | {arm_lr(arm, c['lr'], ratio):g} | {variance_rule.mean_sd(per['M'])} | "
            f"{variance_rule.mean_sd(per['final'], 3)} | {sum(per['collapsed'])}/{len(per['collapsed'])} | "
            f"{variance_rule.mean_sd(per['step'], 4)} |"
        )
    lines += [
        "",
        "| paired contrast of M | mean [95% t interval] | one-sided sign-flip p (mean > 0) |",
        "|---|---|---|",
    ]
    for name, d in c["contrasts"].items():
        lines.append(f"| {name} | {variance_rule.interval_text(d)} | {sign_flip_p(d['diffs']):.4f} |")
    lines += [
        "",
        f"Step-size ratio (mean over seeds of median ‖Δθ‖ ratios): otb_loo / rloo_matched {c['step_ratio']:.3f}, "
        f"otb_loo / rloo {c['step_ratio_unmatched']:.3f}. Collapses (issue 28's definition), otb_loo vs "
        f"rloo_matched: exact McNemar p = {c['collapse_p']:.3f}.",
        "",
    ]
    return lines


def report(args, commit: str | None, seeds: list[int], ratios: dict, lrs, group_sizes, seconds: float) -> Path:
    records_dir = args.out_dir / "equal_rate"
    runs = variance_runs.load_runs(records_dir) if records_dir.exists() else []
    excluded = {r["name"]: why for r in runs if (why := admissible(r, commit))}
    by_cell = variance_rule.cells([r for r in runs if r["name"] not in excluded])
    primary = [cell(by_cell, n, lr, seeds) for lr in lrs[0] for n in group_sizes]
    secondary = [cell(by_cell, n, lr, seeds) for lr in lrs[1] for n in group_sizes]
    sections = [
        f"Records: {len(runs) - len(excluded)} counted ({len(excluded)} not counted) in `{records_dir.name}/`. "
        f"Rule: `results/equal_rate/RULE.md`, commit `{commit}`; seeds {seeds}; {args.steps} steps per run; "
        "r per cell: " + ", ".join(f"N = {n}, lr {lr:g}: {r:.3f}" for (n, lr), r in ratios.items()) + ".",
        "",
        verdict(primary),
        "",
        "## Primary cells (lr " + ", ".join(f"{lr:g}" for lr in lrs[0]) + ")",
        "",
    ]
    for c in primary:
        sections += cell_lines(c, ratios[(c["n"], c["lr"])])
    if any(c["seeds"] for c in secondary):
        p = holm({(c["n"], c["lr"]): c["p_otb"] for c in secondary if c["complete"]})
        sections += [
            "## Secondary cells (lr " + ", ".join(f"{lr:g}" for lr in lrs[1]) + "; reported, never the verdict)",
            "",
            "Holm-adjusted p of otb_loo > rloo_matched among the complete secondary cells: "
            + (", ".join(f"N = {n}: {v:.4f}" for (n, _), v in p.items()) or "none complete")
            + ".",
            "",
        ]
        for c in secondary:
            sections += cell_lines(c, ratios[(c["n"], c["lr"])])
    if excluded:
        sections += ["## Records not counted", "", *(f"- `{name}`: {why}" for name, why in excluded.items()), ""]
    codes = sorted({code_text(r.get("code") or {}) for r in runs})
    sections += [f"Code of the runs' processes: {', '.join(codes) or '—'}.", ""]
    sections += ["Design and rule (committed before the first record): `results/equal_rate/RULE.md`."]
    title = "Equal rate, equal step: leave-one-out OTB vs RLOO and step-matched RLOO"
    return write_report("equal_rate", title, sections, seconds, args.out_dir)


# ----------------------------------------------------------------------------- running


def plan(args, commit: str | None, seeds: list[int], ratios: dict, lrs, group_sizes) -> list[tuple]:
    """The runs not yet recorded, seed-major (every arm and N of a seed before the next seed), the primary rates
    first; the secondary ones only with ``--secondary`` and only once every primary record exists."""
    records_dir = args.out_dir / "equal_rate"

    def items(rates):
        return [(arm, n, lr, s) for lr in rates for s in seeds for n in group_sizes for arm in ARMS]

    def missing(todo):
        return [i for i in todo if not (records_dir / f"{run_name(*i)}.json").exists()]

    todo = missing(items(lrs[0]))
    if not todo and args.secondary:
        todo = missing(items(lrs[1]))
    return todo


def run(args, item: tuple, commit: str | None, ratio: float) -> Path:
    arm, n, lr, seed = item
    name, rate, begun = run_name(*item), arm_lr(arm, lr, ratio), time.perf_counter()
    flags = variance_runs.run_flags(args.task, "rloo" if arm == "rloo_matched" else arm, n, rate)
    out = variance_runs.run_one(name, flags, seed, args.steps, args.warm, args.runs_dir, (), in_process=args.quick)
    meta = {"name": name, "arm": arm, "group_size": n, "lr": lr, "arm_lr": rate, "ratio": ratio, "seed": seed,
            "flags": flags, "rule_commit": commit, "code": CODE_AT_START}  # fmt: skip
    path = variance_runs.write_run_record(meta, out, time.perf_counter() - begun, args.out_dir / "equal_rate")
    print(f"{time.strftime('%H:%M:%S')} {name}: {round(time.perf_counter() - begun)} s", flush=True)
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny warm start, N = 2, 2 steps, 2 seeds, in process")
    parser.add_argument("--secondary", action="store_true", help="also the lr 1e-3 cells, after the primary ones")
    parser.add_argument("--report-only", action="store_true", help="no runs: the report from the records")
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many runs (timing)")
    parser.add_argument("--rule", type=Path, default=RULE, help="the committed rule file")
    parser.add_argument("--issue-28", type=Path, default=ISSUE_28, help="issue 28's records (for r)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "equal_rate")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.quick:
        commit, seeds, group_sizes = None, seeds_from("quick", QUICK["seeds"]), QUICK["group_sizes"]
        lrs = (QUICK["lrs"], ())
        ratios = {(n, lr): QUICK["ratio"] for n in group_sizes for lr in QUICK["lrs"]}
        args.task, args.steps = ["--task", "copy", *variance_runs.QUICK_TASK[2:]], QUICK["steps"]
        args.warm = args.runs_dir / "warm_start"
    else:
        commit = rule_commit(args.rule)
        seeds, group_sizes, lrs = seeds_from(commit), GROUP_SIZES, (PRIMARY_LRS, SECONDARY_LRS)
        ratios = {(n, lr): update_ratio(args.issue_28, n, lr) for lr in (*lrs[0], *lrs[1]) for n in group_sizes}
        args.task, args.steps, args.warm = variance_runs.TASK, STEPS, ROOT / "results" / "variance_lr_warm_start"
    if not args.report_only:
        todo = plan(args, commit, seeds, ratios, lrs, group_sizes)[: args.max_runs]
        if todo:
            variance_runs.ensure_warm_start(args.warm, args.quick)
        for item in todo:
            run(args, item, commit, ratios[(item[1], item[2])])
    return report(args, commit, seeds, ratios, lrs, group_sizes, time.perf_counter() - started)


if __name__ == "__main__":
    print(main())
