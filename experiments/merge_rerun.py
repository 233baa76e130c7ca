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

from common import commit, machine_name, write_report
from common.variance_runs import COMMITS, RECORD, git, load, summary_lines

ROOT = Path(__file__).resolve().parents[1]

# Run inside the worktree (its own experiments/ and otb_* packages, both on PYTHONPATH): the record's run, its
# compact record.
# The code of those commits: there the pilot and variance_lr held the run machinery now in common/variance_runs.py.
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


def rerun(record: str, revision: str, out_dir: Path) -> Path:
    """The record's run at ``revision`` in a temporary worktree; its compact record ``out_dir/<record>@<sha>.json``."""
    sha = git("rev-parse", revision)
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


def report(committed: dict, reruns: dict[str, dict], out_dir: Path, seconds: float) -> Path:
    lines = [
        f"Record `{RECORD}` of `results/variance_lr/` (made before merge ed1b10c), rerun from its committed flags and "
        "seed at each commit in a temporary worktree (design: the docstring of `experiments/merge_rerun.py`).",
        "",
        *summary_lines(committed, reruns),
    ]
    return write_report("variance_lr_merge", "What merge ed1b10c changed in a variance_lr run", lines, seconds, out_dir)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", action="store_true", help="git commit each rerun's record as it ends")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    started, records_dir = time.perf_counter(), args.out_dir / "variance_lr_merge"
    if not args.report_only:
        for label, revision in COMMITS.items():
            path = rerun(RECORD, revision, records_dir)
            if args.commit:
                commit([path], f"{path.relative_to(ROOT)}: {RECORD} at {label} ({machine_name()})")
    loaded = load(args.out_dir)
    if loaded is None:
        parser.error(f"--report-only: a rerun of {RECORD} is missing in {records_dir}")
    return report(*loaded, args.out_dir, time.perf_counter() - started)


if __name__ == "__main__":
    print(main())
