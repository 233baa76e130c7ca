"""What merge ed1b10c changed in issue 28's runs (issue 38, item 2): one pre-merge record rerun at both commits.

    python experiments/merge_rerun.py --commit      # both reruns (resumable), their records, the report
    python experiments/merge_rerun.py --report-only

Merge ed1b10c landed in the variance_lr experiment's branch between its 22nd and 23rd record: before it the runs
executed the branch's code at ed1b10c^2 (the commit of the 22nd record), after it the merge's code, which among
other changes forms OTB's G_t and W_t in fp64 instead of the compute dtype. This reruns one record that was made
before the merge (:data:`RECORD`, with its own committed flags and seed, from the committed warm start) at each
commit, in a temporary git worktree outside the repository (one thread, one run after the other, each run's code
being that worktree's), and compares both reruns step by step with each other and with the committed record:
the first step at which a logged column differs, the largest difference per column, and the run's metric M (mean
reward per generated token) and final reward. Records: ``results/variance_lr_merge/<record>@<commit>.json``, in the
compact format of ``results/variance_lr/``; report ``results/variance_lr_merge.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine_name, write_report

ROOT = Path(__file__).resolve().parents[1]

MERGE = "ed1b10c5bc34db8a41d5ec066e8f1c438df93a96"
COMMITS = {"pre-merge (ed1b10c^2)": MERGE + "^2", "merge (ed1b10c)": MERGE}
RECORD = "otb_loo_n4_lr0.001_seed0"  # made at 14:58, before the merge (15:21); OTB's energies are what changed

# Run inside the worktree (its own experiments/ and otb_* packages, both on PYTHONPATH): the record's run, its
# compact record.
_RUN = """
import json, sys, time
from pathlib import Path
import variance_lr as vlr, variance_lr_pilot as pilot
committed, runs, out = map(Path, sys.argv[1:4])
keys = ("name", "arm", "group_size", "lr", "seed", "flags")
meta = {k: x for k, x in json.loads(committed.read_text()).items() if k in keys}
begun, warm = time.perf_counter(), Path("results/variance_lr_warm_start").resolve()
run = pilot.run_one(meta["name"], meta["flags"], meta["seed"], vlr.STEPS, warm, runs, vlr.AIM_STEPS)
print(pilot.write_run_record(meta, run, time.perf_counter() - begun, out))
"""


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def rerun(record: str, commit: str, out_dir: Path) -> Path:
    """The record's run at ``commit`` in a temporary worktree; its compact record ``out_dir/<record>@<sha>.json``."""
    sha = git("rev-parse", commit)
    path = out_dir / f"{record}@{sha[:7]}.json"
    if path.exists():
        return path
    work = Path(tempfile.mkdtemp(prefix=f"merge_rerun_{sha[:7]}_"))
    try:
        git("worktree", "add", "--detach", str(work / "tree"), sha)
        tree, staging = work / "tree", work / "records"
        code = {"commit": sha, "clean": not git("status", "--porcelain", cwd=tree)}  # at the run's start
        path_entries = os.pathsep.join([str(tree / "experiments"), str(tree)])  # the tree's drivers and packages
        env = {**os.environ, "PYTHONPATH": path_entries, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        command = [sys.executable, "-c", _RUN, str(ROOT / "results" / "variance_lr" / f"{record}.json"),
                   str(work / "runs"), str(staging)]  # fmt: skip
        subprocess.run(command, cwd=tree, env=env, check=True)
        saved = json.loads((staging / f"{record}.json").read_text())
        saved["code"] = code
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, separators=(",", ":")) + "\n")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(work / "tree")], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return path


def compare(a: dict, b: dict) -> dict:
    """Step by step: the first step at which any logged column differs, each column's largest difference, and
    each aim measurement's (experiments/aimed_train.py's cosines and norms) largest difference."""
    columns, first, largest, aim = a["columns"], None, {}, {}
    for row_a, row_b in zip(a["steps"], b["steps"]):
        for key, x, y in zip(columns, row_a, row_b):
            if x != y and first is None:
                first = row_a[0]
            if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                largest[key] = max(largest.get(key, 0.0), abs(x - y))
    for line_a, line_b in zip(a.get("aim", []), b.get("aim", [])):
        for key in line_a.keys() & line_b.keys() - {"step"}:
            aim[key] = max(aim.get(key, 0.0), abs(line_a[key] - line_b[key]))
    return {"first_step": first, "largest": largest, "aim": aim, "steps": (len(a["steps"]), len(b["steps"]))}


def metrics(record: dict) -> dict:
    """M = reward per generated token (the area under reward vs generated tokens over the tokens) and the final
    reward (mean of the last 15 steps), as experiments/variance_lr_pilot.py computes them."""
    import variance_lr_pilot as pilot

    rows = [dict(zip(record["columns"], row)) for row in record["steps"]]
    return {"M": pilot.reward_per_token(rows), "final": pilot.final_reward(rows)}


def summary_lines(committed: dict, reruns: dict[str, dict]) -> list[str]:
    """The table of M and final reward per run and the step-by-step differences of every pair of runs."""
    runs = {"committed record": committed, **reruns}
    lines = [
        "| run | code | M (reward per generated token) | final reward | steps | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for label, record in runs.items():
        m, code = metrics(record), record.get("code", {}).get("commit")
        code = f"`{code[:10]}`" if code else "not recorded (issue 28's run)"
        steps, seconds = len(record["steps"]), record["wall_seconds"]
        lines.append(f"| {label} | {code} | {m['M']:.4f} | {m['final']:.4f} | {steps} | {seconds} |")
    lines += ["", "Step by step (logged columns and aim measurements, as rounded in the compact records):", ""]
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            c = compare(runs[a], runs[b])
            largest = ", ".join(f"{k} {v:.2g}" for k, v in c["largest"].items() if v and k != "step") or "none"
            aim = ", ".join(f"{k} {v:.2g}" for k, v in sorted(c["aim"].items()) if v) or "none"
            first = "never (identical at every step)" if c["first_step"] is None else f"step {c['first_step']}"
            lines.append(
                f"* {a} vs {b}: first difference at {first}; largest difference per column: {largest}; "
                f"per aim measurement: {aim}."
            )
    return lines


def report(committed: dict, reruns: dict[str, dict], out_dir: Path, seconds: float) -> Path:
    lines = [
        f"Record `{RECORD}` of `results/variance_lr/` (made before merge ed1b10c), rerun from its committed flags and "
        "seed at each commit in a temporary worktree (design: the docstring of `experiments/merge_rerun.py`).",
        "",
        *summary_lines(committed, reruns),
    ]
    return write_report("variance_lr_merge", "What merge ed1b10c changed in a variance_lr run", lines, seconds, out_dir)


def load(out_dir: Path) -> tuple[dict, dict[str, dict]] | None:
    """The committed record and its reruns from ``out_dir``'s records, or None while a rerun is missing."""
    paths = {
        label: out_dir / "variance_lr_merge" / f"{RECORD}@{git('rev-parse', c)[:7]}.json"
        for label, c in COMMITS.items()
    }
    if not all(p.exists() for p in paths.values()):
        return None
    committed = json.loads((out_dir / "variance_lr" / f"{RECORD}.json").read_text())
    return committed, {label: json.loads(p.read_text()) for label, p in paths.items()}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", action="store_true", help="git commit each rerun's record as it ends")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    started, records_dir = time.perf_counter(), args.out_dir / "variance_lr_merge"
    if not args.report_only:
        for label, commit in COMMITS.items():
            path = rerun(RECORD, commit, records_dir)
            if args.commit:
                commit([path], f"{path.relative_to(ROOT)}: {RECORD} at {label} ({machine_name()})")
    loaded = load(args.out_dir)
    if loaded is None:
        parser.error(f"--report-only: a rerun of {RECORD} is missing in {records_dir}")
    return report(*loaded, args.out_dir, time.perf_counter() - started)


if __name__ == "__main__":
    print(main())
