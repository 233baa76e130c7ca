"""train.py on a CPU: the numbers docs/TRAINING.md quotes, each from runs of train.py itself; JSON lines.

    python benchmarks/train_cpu.py                         # every case (~15 min on 2 cores; wants a quiet machine)
    python benchmarks/train_cpu.py --cases default add     # some cases
    python benchmarks/train_cpu.py --quick                 # one small 2-step run per case (the test)

Cases (each a ``python train.py`` subprocess in a temporary --output-dir; its metrics.jsonl is read back):

* ``default``: ``train.py --seed S`` for each of ``--seeds`` (the defaults: 300 steps × 32 prompts × 8 responses,
  ``otb``): reward over the first and the last 10 steps, the first step with reward ≥ 0.7, response lengths and
  the cut fraction, the wall time of the process, and per-step medians of throughput and phase times;
* ``add``: ``--task add --seed 0``, the same summary;
* ``long_horizon_start``: ``--long-horizon --steps 1 --prompts-per-step 8`` for seeds 0–2: what the random-init
  model generates on the long task (64 responses: mean and longest length, reward) before any update;
* ``estimator_cost``: ``--estimator E --steps 20`` for otb, grpo, eob, otb_exact: medians over steps 6–20 of the
  advantage phase (``time/advantages``: for eob and otb_exact it includes the exact energies) and of the step;
* ``threads``: ``--steps 20`` with ``OMP_NUM_THREADS`` 1 and 2: the median step over steps 6–20;
* ``tests``: the wall time of the trainer's test files that TRAINING.md names.

Every record carries the machine and its CPU model, the commit, the load average before and after (it also
counts the previous run of this command) and ``cpu_per_wall``, the CPU seconds the run's processes got per second
of wall time (two threads on two idle cores: up to 2; another process on the cores lowers it). Timings need a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import emit, machine, provenance

ROOT = Path(__file__).resolve().parents[1]
TRAINER_TESTS = [
    "tests/test_train.py",
    "tests/test_otb_train/test_rollout.py",
    "tests/test_otb_train/test_losses.py",
    "tests/test_otb_train/test_tasks.py",
]
CASES = ("default", "add", "long_horizon_start", "estimator_cost", "threads", "tests")
COST_ESTIMATORS = ("otb", "grpo", "eob", "otb_exact")


def run_timed(command: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``command`` (exit status checked): the process, and its timing fields (``wall_s``, ``cpu_per_wall``: CPU
    seconds per wall second, ``load_before``: the 1-minute load average when it started)."""
    load_before = os.getloadavg()[0]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stderr or done.stdout)[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return done, {"wall_s": wall, "cpu_per_wall": cpu / wall, "load_before": load_before}


def run_train(flags: list[str], env: dict | None = None) -> tuple[list[dict], dict]:
    """``python train.py FLAGS`` in a fresh --output-dir: its metrics (one dict per step) and timing fields."""
    with tempfile.TemporaryDirectory() as out:
        _, timing = run_timed([sys.executable, str(ROOT / "train.py"), *flags, "--output-dir", out], env)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return rows, timing


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def learning_summary(rows: list[dict]) -> dict:
    """Reward and length over the first and the last 10 steps, the first step with reward ≥ 0.7, medians of
    throughput and phase times over every step."""
    first, last = rows[:10], rows[-10:]
    reached = next((r["step"] for r in rows if r["reward_mean"] >= 0.7), None)
    summary = {
        "steps": len(rows),
        "reward_first10": _mean(first, "reward_mean"),
        "reward_last10": _mean(last, "reward_mean"),
        "first_step_reward_ge_0.7": reached,
        "response_length_first10": _mean(first, "response_length_mean"),
        "response_length_last10": _mean(last, "response_length_mean"),
        "truncated_fraction_first10": _mean(first, "truncated_fraction"),
    }
    for key in ("throughput/generation_tokens_per_s", "throughput/update_tokens_per_s", "time/step", "time/rollout",
                "time/logprobs", "time/advantages", "time/update"):  # fmt: skip
        summary[f"median_{key}"] = _median(rows, key)
    return summary


def cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo), or None where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def measured(case: str, flags: list[str], summary: dict, timing: dict, env: dict | None) -> dict:
    return {
        "case": case,
        "flags": flags,
        "env": env or {},
        **summary,
        **timing,
        "load_after": os.getloadavg()[0],
        "machine": machine(),
        "cpu_model": cpu_model(),
        **provenance(),
    }


def runs(case: str, quick: bool, seeds: list[int]) -> list[tuple[list[str], dict | None]]:
    """The (flags, env) of each train.py run of ``case``; ``quick``: 2 steps, one run per case, small batches."""
    if quick:
        small = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "2"]
        one = {"default": [], "add": ["--task", "add"], "long_horizon_start": ["--long-horizon"],
               "estimator_cost": ["--estimator", "eob"], "threads": []}  # fmt: skip
        return [([*one[case], *small], {"OMP_NUM_THREADS": "1"} if case == "threads" else None)]
    if case == "default":
        return [(["--seed", str(seed)], None) for seed in seeds]
    if case == "add":
        return [(["--task", "add", "--seed", "0"], None)]
    if case == "long_horizon_start":
        start = ["--long-horizon", "--steps", "1", "--prompts-per-step", "8"]  # 64 responses of the random init
        return [([*start, "--seed", str(seed)], None) for seed in (0, 1, 2)]
    if case == "estimator_cost":
        return [(["--estimator", estimator, "--steps", "20"], None) for estimator in COST_ESTIMATORS]
    if case == "threads":
        return [(["--steps", "20"], {"OMP_NUM_THREADS": str(threads)}) for threads in (1, 2)]
    raise ValueError(case)


def run_case(case: str, quick: bool, seeds: list[int], out) -> None:
    if case == "tests":
        done, timing = run_timed([sys.executable, "-m", "pytest", "-q", *TRAINER_TESTS])  # exits if one fails
        summary = {"summary": done.stdout.strip().splitlines()[-1]}
        emit(measured(case, TRAINER_TESTS, summary, timing, None), out)
        return
    for flags, env in runs(case, quick, seeds):
        rows, timing = run_train(flags, env)
        if case in ("default", "add"):
            summary = learning_summary(rows)
        elif case == "long_horizon_start":
            step = rows[0]
            summary = {key: step[key] for key in ("response_length_mean", "response_length_max", "reward_mean")}
        else:  # steps 6–20 (every step with --quick): the first steps warm up
            settled = rows[5:] or rows
            summary = {"median_time/advantages": _median(settled, "time/advantages"),
                       "median_time/step": _median(settled, "time/step"), "steps_in_median": len(settled)}  # fmt: skip
        emit(measured(case, flags, summary, timing, env), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds of the default case")
    parser.add_argument("--quick", action="store_true", help="one small 2-step run per case (no trainer tests)")
    parser.add_argument("--out", type=Path, help="also append the records to this JSON-lines file")
    args = parser.parse_args(argv)
    out = open(args.out, "a") if args.out else None
    try:
        for case in args.cases:
            if not (args.quick and case == "tests"):
                run_case(case, args.quick, args.seeds, out)
    finally:
        if out:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
