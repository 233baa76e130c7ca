"""``compute_advantages`` on this tree against an earlier commit, interleaved, on a quiet CPU machine.

    python benchmarks/advantages_vs_commit.py                       # against 78958c0 (before v in fp64), 2 threads
    python benchmarks/advantages_vs_commit.py --quick --allow-load  # tiny shapes, any load (a smoke test)

Each round runs the two trees one after the other (their order alternating: ABBA...) in fresh processes, each of
which builds the inputs (``harness.otb_inputs``: fp32, outcome rewards, random lengths, groups of N), calls once to
warm up, then times ``--repeats`` calls and reports their median; no result is reused across calls, and every call
validates its inputs (``compute_advantages`` always does). A record per round holds both medians, their ratio and
the 1-minute load average before each; the summary holds the median of the per-round ratios and their range, per
shape and estimator. The shapes are the issue's: B = 2048, T = 4096, N = 8 and B = 16384, T = 512, N = 4.
Refuses to run (exit 2) when the 1-minute load average is 1.0 or more, unless ``--allow-load``: on a loaded
machine the same comparison swings by 2-4x.

``--head-group-dtype float32`` is a diagnosis, not a measurement of otb_ref: this tree's fast path runs with its group
arithmetic (``_GROUP_DTYPE``: W, G, v, the sums, σ, G − B) in fp32, against the precision rule, to separate what the
fp64 rule costs from what the code's structure costs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(2048, 4096, 8), (16384, 512, 4)]
SHAPES_QUICK = [(64, 128, 8), (256, 32, 4)]
ESTIMATORS = ("otb", "sequence_proxy")


def worker(batch: int, length: int, group: int, estimator: str, repeats: int, threads: int) -> dict:
    """In a fresh process whose ``otb_ref`` is one tree's: median seconds of ``repeats`` calls after a warm-up."""
    import torch

    import otb_ref  # the tree's: PYTHONPATH (run_worker)
    from harness import otb_inputs  # beside this file

    torch.set_num_threads(threads)
    if os.environ.get("OTB_BENCH_GROUP_DTYPE"):  # --head-group-dtype (a diagnosis; this tree's process only)
        import otb_ref.advantages as fast

        fast._GROUP_DTYPE = getattr(torch, os.environ["OTB_BENCH_GROUP_DTYPE"])
    rewards, mask, index, log_probs, sum_pi_squared = otb_inputs(batch, length, group, torch.device("cpu"))

    def call():
        return otb_ref.compute_advantages(
            estimator, rewards, mask, index, old_log_probs=log_probs, sum_pi_squared=sum_pi_squared
        )

    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return dict(median_seconds=statistics.median(seconds), seconds=seconds, otb_ref=otb_ref.__file__)


def base_tree(commit: str, folder: Path) -> Path:
    """``otb_ref/`` of ``commit`` extracted under ``folder`` (``git archive``)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "otb_ref"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def run_worker(
    tree: Path, shape: tuple[int, int, int], estimator: str, repeats: int, threads: int, extra_env: dict[str, str]
) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra_env)
    args = [sys.executable, __file__, "--worker", *map(str, shape), estimator, str(repeats), str(threads)]
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args, base: Path, shape, estimator: str, out) -> dict:
    """``--rounds`` alternations of the two trees on one shape and estimator; one record per round."""
    trees = {"base": base, "head": ROOT}
    ratios = []
    for round_ in range(args.rounds):
        record = dict(shape=list(shape), estimator=estimator, round=round_)
        for name in ("base", "head") if round_ % 2 == 0 else ("head", "base"):
            record[f"{name}_load_1min"] = os.getloadavg()[0]
            env = dict(args.worker_env)
            if name == "head" and args.head_group_dtype:
                env["OTB_BENCH_GROUP_DTYPE"] = args.head_group_dtype
            result = run_worker(trees[name], shape, estimator, args.repeats, args.threads, env)
            record[f"{name}_seconds"] = result["median_seconds"]
            record[f"{name}_otb_ref"] = result["otb_ref"]  # which tree the process imported
        record["head_over_base"] = record["head_seconds"] / record["base_seconds"]
        ratios.append(record["head_over_base"])
        emit(record, out)
    return dict(
        shape=list(shape),
        estimator=estimator,
        summary=True,
        median_head_over_base=statistics.median(ratios),
        range_head_over_base=[min(ratios), max(ratios)],
    )


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="78958c0", help="the commit to compare with (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6, help="alternations, >= 5 (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per process (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--estimator", action="append", choices=ESTIMATORS, help="default: both")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test, not a measurement)")
    parser.add_argument("--allow-load", action="store_true", help="run although the machine is loaded")
    parser.add_argument("--out", help="also append the JSON records to this file")
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in both trees' processes (a diagnosis: e.g. MALLOC_TRIM_THRESHOLD_, OMP_WAIT_POLICY)",
    )
    parser.add_argument(
        "--head-group-dtype",
        choices=["float32"],
        help="a diagnosis: this tree's group arithmetic in this dtype, against the precision rule (see above)",
    )
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.worker_env):
        parser.error("--worker-env: expected NAME=VALUE")
    args.worker_env = dict(item.split("=", 1) for item in args.worker_env)
    if args.worker:
        batch, length, group, estimator, repeats, threads = args.worker
        print(json.dumps(worker(int(batch), int(length), int(group), estimator, int(repeats), int(threads))))
        return 0
    if args.rounds < 5 and not args.quick:
        parser.error("--rounds: at least 5 alternations")
    load = os.getloadavg()[0]
    if load >= 1.0 and not args.allow_load:
        print(f"1-minute load average {load:.2f} >= 1.0: not a quiet machine; not timing (--allow-load to force)")
        return 2
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (closed below)
    from harness import provenance

    header = dict(provenance(), base=args.base, threads=args.threads, cpu=_cpu(), load_1min=load)
    if args.worker_env:
        header["worker_env"] = args.worker_env
    if args.head_group_dtype:
        header["head_group_dtype"] = args.head_group_dtype  # a diagnosis: not otb_ref's precision rule
    emit(header, out)
    with tempfile.TemporaryDirectory() as folder:
        base = base_tree(args.base, Path(folder))
        for shape in SHAPES_QUICK if args.quick else SHAPES:
            for estimator in args.estimator or ESTIMATORS:
                emit(compare(args, base, shape, estimator, out), out)
    if out is not None:
        out.close()
    return 0


def _cpu() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores visible"


if __name__ == "__main__":
    sys.exit(main())
