"""train.py's first CPU steps, pinned: a hash of each run's logged metrics without its timings.

    python tools/pin_train.py                  # this tree: otb, grpo, rloo, 3 steps each
    python tools/pin_train.py --tree DIR       # another checkout (e.g. `git worktree add DIR COMMIT`)

A change that moves no number (a reshaping) leaves every hash as it was; compare the lines of two trees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TIMING = ("second", "time", "per_s", "/s", "tokens_per", "date", "wall", "mfu")


def pin(tree: Path, estimator: str, steps: int) -> str:
    """sha256 (16 hex digits) of the metrics of ``steps`` steps of ``train.py --estimator estimator`` in ``tree``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
        command = [sys.executable, "train.py", "--estimator", estimator, "--steps", str(steps)]
        subprocess.run(
            [*command, "--output-dir", str(out), "--save-every", "0"],
            cwd=tree,
            env=env,
            check=True,
            capture_output=True,
        )
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: v for k, v in row.items() if not any(t in k for t in TIMING)} for row in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="checkout to run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--estimators", nargs="+", default=["otb", "grpo", "rloo"])
    args = parser.parse_args(argv)
    for estimator in args.estimators:
        print(estimator, args.steps, pin(Path(args.tree).resolve(), estimator, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
