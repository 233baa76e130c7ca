"""Which cases' advantages an earlier commit's ``otb_ref`` computes differently from this tree's, and by how much.

    python conformance/compare_commits.py --base 5342d51     # before v in fp64 (issue 43)

Runs ``otb_ref.compute_advantages`` of both trees (the base's extracted with ``git archive``, each in a process of
its own) on every case of ``conformance/vectors.json`` and prints one JSON line per estimator and dtype with the
cases whose advantages differ: how many, which, the largest absolute difference, the largest in units in the
last place of the output, and the largest over the case's ``atol``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

import check  # beside this file: the script's folder is on sys.path
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def outputs(path: str) -> None:
    """Worker: every case's advantages from the ``otb_ref`` on ``sys.path``, saved to ``path`` (``.npz``)."""
    import torch

    import otb_ref

    torch.set_num_threads(1)
    document = check.load_vectors(check.DEFAULT_VECTORS)
    results = {}
    for case in document["cases"]:
        args, kwargs = check.arguments(case, document["inputs"][case["input"]])
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in kwargs.items() if isinstance(v, np.ndarray)}
        kwargs.update(tensors)
        rewards, mask = (torch.from_numpy(np.ascontiguousarray(x)) for x in args[1:3])
        advantages, _ = otb_ref.compute_advantages(args[0], rewards, mask, list(args[3].tolist()), **kwargs)
        results[case["id"]] = advantages.numpy()
    np.savez(path, **{str(i): results[case_id] for i, case_id in enumerate(results)}, ids=np.array(list(results)))


def run(tree: Path, path: Path) -> dict[str, np.ndarray]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, __file__, "--worker", str(path)], env=env, check=True, cwd=tempfile.gettempdir())
    saved = np.load(path)
    return {case_id: saved[str(i)] for i, case_id in enumerate(saved["ids"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=False, help="the earlier commit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return outputs(args.worker)
    if not args.base:
        parser.error("--base: required")
    with tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.base, "otb_ref"], capture_output=True, check=True
        )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(folder, filter="data")
        base, head = run(Path(folder), Path(folder) / "base.npz"), run(ROOT, Path(folder) / "head.npz")
    document = check.load_vectors(check.DEFAULT_VECTORS)
    moved = defaultdict(list)
    for case in document["cases"]:
        old, new = base[case["id"]], head[case["id"]]
        if not np.array_equal(old, new, equal_nan=True):
            diff = np.abs(old.astype(np.float64) - new)
            ulps = diff / np.spacing(np.maximum(np.abs(old), np.abs(new)).astype(new.dtype)).astype(np.float64)
            moved[(case["estimator"], str(new.dtype))].append(
                (case["id"], diff.max(), ulps.max(), diff.max() / case["atol"])
            )
    print(json.dumps(dict(base=args.base, cases=len(document["cases"]), moved=sum(map(len, moved.values())))))
    for (estimator, dtype), rows in sorted(moved.items()):
        record = dict(estimator=estimator, dtype=dtype, cases_moved=len(rows), ids=[row[0] for row in rows])
        record.update(
            max_abs=max(r[1] for r in rows), max_ulps=max(r[2] for r in rows), max_over_atol=max(r[3] for r in rows)
        )
        print(json.dumps(record))


if __name__ == "__main__":
    main()
