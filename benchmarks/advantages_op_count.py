"""How many torch operations one ``compute_advantages`` call makes, and how many of them pass over a whole block.

    python benchmarks/advantages_op_count.py                 # this tree and 78958c0, otb, B = 2048, T = 4096, N = 8

Counts every ATen operation a call dispatches (a ``TorchDispatchMode``), in a fresh process per tree; an operation
"passes over a block" when one of its tensor arguments has as many elements as the block (b × T, b > 1 rows). A
count, not a timing: it does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from advantages_vs_commit import ROOT, base_tree  # beside this file (a script's folder is on its path)

from harness import machine, provenance  # beside this file


def count(batch: int, length: int, group: int, estimator: str) -> dict:
    """In a process whose ``otb_ref`` is one tree's: operations of one call (after a warm-up call)."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import otb_ref
    from harness import otb_inputs  # beside this file

    rewards, mask, index, log_probs, sum_pi_squared = otb_inputs(batch, length, group, torch.device("cpu"))

    def call():
        otb_ref.compute_advantages(
            estimator, rewards, mask, index, old_log_probs=log_probs, sum_pi_squared=sum_pi_squared
        )

    sizes: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            numels = [a.numel() for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            sizes[max(numels, default=0)] += 1
            return func(*args, **(kwargs or {}))

    call()
    with Count():
        call()
    total = sum(sizes.values())
    # the block: the largest operand size below the whole batch that many operations share (or the batch itself)
    whole = batch * length
    blocks = [n for n in sizes if length < n < whole and n % length == 0]
    block = max(blocks, key=lambda n: sizes[n]) if blocks else whole
    return dict(
        otb_ref=otb_ref.__file__,
        operations=total,
        block_elements=block,
        block_passes=sizes[block],
        blocks=whole // block,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="78958c0", help="the commit to compare with (default: %(default)s)")
    parser.add_argument("--estimator", default="otb")
    parser.add_argument("--shape", default="2048,4096,8", help="B,T,N (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batch, length, group = map(int, args.shape.split(","))
    if args.worker:
        print(json.dumps(count(batch, length, group, args.estimator)))
        return 0
    head = provenance()
    with tempfile.TemporaryDirectory() as folder:
        trees = {"base": base_tree(args.base, Path(folder)), "head": ROOT}
        for name, tree in trees.items():
            env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
            out = subprocess.run(
                [sys.executable, __file__, "--worker", f"--shape={args.shape}", f"--estimator={args.estimator}"],
                capture_output=True,
                text=True,
                check=True,
                env=env,
                cwd=folder,
            )
            record = dict(
                tree=name,
                commit=args.base if name == "base" else head["commit"],
                shape=[batch, length, group],
                estimator=args.estimator,
                **json.loads(out.stdout.splitlines()[-1]),
            )
            record["per_block"] = round(record["operations"] / record["blocks"], 1)
            record.update(
                machine=machine(), torch=torch.__version__, **{k: head[k] for k in ("date", "clean", "command")}
            )
            print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
