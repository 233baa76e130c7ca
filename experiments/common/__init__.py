"""The lab's toolkit: what the experiments' drivers share, and nothing experiment-specific.

* Provenance: :func:`read_code_state`, :data:`CODE_AT_START`, :func:`code_text`, :func:`machine_name`,
  :func:`command_line`.
* Reports and records: :func:`write_report`, :func:`write_records`, :func:`write_json_record`, :func:`compact`;
  :func:`load_records` reads the per-run records of the records-based drivers back.
* Records-based drivers (reproduction, stability, stability_long): :func:`driver_parser` (their shared command line),
  :func:`run_missing` (every arm x seed without a record: run train.py, write the record, commit it),
  :func:`run_train`, :func:`write_record`, :data:`RUN_FLAGS`, :data:`RECORD_COLUMNS`, :data:`QUICK_TASK`,
  :func:`ensure_warm_start`; :func:`commit` (``git commit`` exactly some records, for every driver's ``--commit``).
* The shared collapse rule and plots: :func:`collapse`, :func:`new_figure`, :func:`plot_per_step`.

What two or more drivers share beyond these, one module each (each lists its names in its docstring):

* :mod:`common.snapshots`: the policy snapshots at init, warm, mid and late (gradient_variance, proxy_fidelity;
  ``experiments/snapshots.py`` is its command line).
* :mod:`common.gradients`: the batch sampler and the Gram/pair statistics of batch gradients (gradient_variance,
  snr_gap, variance_lr_pilot).
* :mod:`common.variance_runs`: the variance / learning-rate runs: task, flags, arms, one ``aimed_train.py`` run, its
  record and the metric M (variance_lr_pilot, variance_lr, equal_rate, merge_rerun, readings); the merge rerun's
  record comparison (merge_rerun, variance_lr).
* The committed rules that a driver's report and readings both apply: :mod:`common.variance_rule` (variance_lr's
  design, selection and decision rules, what its outputs hang on; also equal_rate), :mod:`common.reproduction_rule`
  (τ, T and the saving), :mod:`common.stability_long_rule` (its arms, spikes and reading).

Nothing here is one driver's own logic. A driver imports this package, the library (:mod:`otb_ref`) and the
trainer's parts (:mod:`otb_train`; the warm start and the synthetic-task sampler are :mod:`otb_train.warm_start`),
never another experiment (``tests/experiments/test_toolkit.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


def read_code_state(root: Path = ROOT) -> dict:
    """The code at ``root`` now: ``{"commit": git rev-parse HEAD, "clean": git status --porcelain printed nothing}``
    (an untracked file counts as dirty); both None, with the reason, where ``root`` is not a git work tree."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    try:
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain")
    except OSError as error:
        return {"commit": None, "clean": None, "error": str(error)}
    if head.returncode != 0 or status.returncode != 0:
        return {"commit": None, "clean": None, "error": (head.stderr or status.stderr).strip()[:200]}
    return {"commit": head.stdout.strip(), "clean": status.stdout.strip() == ""}


def code_text(code: dict) -> str:
    """A code state as a report line: the commit and whether the tree was clean."""
    if code.get("commit") is None:
        return f"unknown ({code.get('error', 'no git')})"
    return f"`{code['commit']}`" + (" (clean tree)" if code["clean"] else " (**uncommitted changes**)")


# Read once, as the process starts (every driver imports this module first): the code its records carry.
CODE_AT_START = read_code_state()


def machine_name() -> str:
    """``"<cpu or GPU name>, <n> cores, torch <version>"``: the line every report names its machine with."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or platform.machine()
        try:
            model = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
            device = model[0].split(":", 1)[1].strip() if model else device
        except OSError:
            pass
    return f"{device}, {os.cpu_count()} cores, torch {torch.__version__}"


def command_line() -> str:
    return "python " + " ".join(
        [
            Path(sys.argv[0]).relative_to(Path.cwd()).as_posix()
            if Path(sys.argv[0]).is_absolute() and Path(sys.argv[0]).is_relative_to(Path.cwd())
            else sys.argv[0],
            *sys.argv[1:],
        ]
    )


def write_report(name: str, title: str, sections: list[str], seconds: float, out_dir: Path = RESULTS) -> Path:
    """``<out_dir>/<name>.md``: the title, the command, the machine and wall time, then the sections."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = [
        f"# {title}",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine_name()}  ",
        f"Code: {code_text(CODE_AT_START)}  ",
        f"Wall time: {seconds:.0f} s",
        "",
    ]
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(header + sections) + "\n")
    return path


def compact(value, digits: int = 6):
    """``value`` as JSON values: tensors and arrays become nested lists, floats keep ``digits`` significant digits
    (non-finite floats become null)."""
    if isinstance(value, dict):
        return {str(k): compact(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [compact(v, digits) for v in value]
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return compact(value.tolist(), digits)
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    return value


def write_records(name: str, records: dict, out_dir: Path = RESULTS) -> Path:
    """``<out_dir>/<name>_records.json``: the compact numbers behind a report's tables and figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}_records.json"
    record = {"command": command_line(), "machine": machine_name(), "code": CODE_AT_START, **compact(records)}
    path.write_text(json.dumps(record) + "\n")
    return path


def write_json_record(path: Path, record: dict) -> Path:
    """One run's compact JSON record, written whole to ``<path>.partial`` and then renamed (a run killed mid-write
    leaves no record, so a resumed driver runs it again). It carries the process's code at its start
    (:data:`CODE_AT_START`) under ``"code"`` unless ``record`` has its own."""
    record = {"code": CODE_AT_START, **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    partial.rename(path)
    return path


def new_figure(columns: int = 1, width: float = 5.5, height: float = 4.0):
    """A matplotlib figure with ``columns`` axes side by side (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, columns, figsize=(width * columns, height), squeeze=False)
    return figure, list(axes[0])


def plot_per_step(by_arm: dict[str, dict[int, list[dict]]], arms: list[str], key: str, label: str, path: Path) -> None:
    """Reward (left) and ``key`` (right, labelled ``label``) per step, every seed, one colour per arm."""
    figure, (reward_axis, other_axis) = new_figure(2)
    for arm in [a for a in arms if a in by_arm]:
        color = None
        for rows in by_arm[arm].values():
            steps = [r["step"] for r in rows]
            line = reward_axis.plot(steps, [r["reward_mean"] for r in rows], lw=0.8, color=color,
                                    label=arm if color is None else None)[0]  # fmt: skip
            color = line.get_color()
            other_axis.plot(steps, [r[key] or 0.0 for r in rows], lw=0.8, color=color)
    reward_axis.set(xlabel="step", ylabel="reward of the step's responses", title="every seed")
    other_axis.set(xlabel="step", ylabel=label, title=f"{label}, every seed")
    reward_axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- records-based drivers

QUICK_TASK = ["--task", "copy_exact", "--copy-lengths", "2", "3", "--max-new-tokens", "6"]  # --quick (tests)
# Run bookkeeping every records-based driver passes to train.py: no warmup, logging and saving, CPU.
RUN_FLAGS = [
    "--warmup-steps", "0", "--micro-batch-size", "64", "--save-every", "0", "--keep-checkpoints", "1",
    "--sample-every", "50", "--device", "cpu",
]  # fmt: skip
RECORD_COLUMNS = ["step", "tokens", "generated_tokens", "reward_mean", "grad_norm", "update_norm", "approx_kl",
                  "entropy"]  # fmt: skip
EDGE_STEPS = 5  # the collapse rule's start and end windows


def collapse(rows: list[dict]) -> dict:
    """Start and end reward (first and last EDGE_STEPS steps), whether it collapsed (end below half the start), and
    the first step after which every reward is 0 (None if none). The rule of experiments/stability.py, part (a),
    which stability_long and readings apply too."""
    start = statistics.mean(r["reward_mean"] for r in rows[:EDGE_STEPS])
    end = statistics.mean(r["reward_mean"] for r in rows[-EDGE_STEPS:])
    zero_from = None
    for row in reversed(rows):
        if row["reward_mean"] > 0:
            break
        zero_from = row["step"]
    return {"start": start, "end": end, "collapsed": end < 0.5 * start, "zero_from": zero_from}


def run_train(name: str, seed: int, steps: int, warm: Path, runs: Path, flags: list[str]) -> Path:
    """One train.py run from ``warm`` with ``flags`` into ``runs/<name>_seed<seed>`` (an unfinished one restarts)."""
    out = runs / f"{name}_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, str(ROOT / "train.py"), "--model", str(warm), *flags, "--steps", str(steps),
               "--seed", str(seed), "--output-dir", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = runs / f"{name}_seed{seed}.log"  # a file, not a pipe: the run survives its driver
    runs.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as stream:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{log.read_text()[-3000:]}")
    return out


def write_record(name: str, seed: int, run: Path, flags: list[str], seconds: float, records_dir: Path) -> Path:
    """The run's compact record ``<records_dir>/<name>_seed<seed>.json`` (written whole, then renamed)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    record = {
        "arm": name, "seed": seed, "flags": flags, "machine": machine_name(), "wall_seconds": round(seconds),
        "columns": RECORD_COLUMNS, "steps": [[row.get(key) for key in RECORD_COLUMNS] for row in rows],
    }  # fmt: skip
    return write_json_record(records_dir / f"{name}_seed{seed}.json", record)


def commit(paths: Path | list[Path], message: str) -> None:
    """``git add`` and ``git commit`` exactly ``paths`` (one path or a list; retried while another git process
    holds the index)."""
    names = [str(p) for p in paths] if isinstance(paths, list) else [str(paths)]
    for _ in range(30):
        added = subprocess.run(["git", "add", *names], cwd=ROOT, capture_output=True, text=True)
        done = subprocess.run(["git", "commit", "-m", message, "--", *names], cwd=ROOT, capture_output=True)
        if added.returncode == 0 and done.returncode == 0:
            return
        time.sleep(2)
    print(f"could not commit {names if isinstance(paths, list) else paths}", file=sys.stderr)


def load_records(records_dir: Path) -> dict[str, dict[int, list[dict]]]:
    """arm -> seed -> per-step rows (dicts of the record's columns), from the committed records."""
    by_arm: dict[str, dict[int, list[dict]]] = {}
    for path in sorted(records_dir.glob("*.json")):
        record = json.loads(path.read_text())
        rows = [dict(zip(record["columns"], values)) for values in record["steps"]]
        by_arm.setdefault(record["arm"], {})[record["seed"]] = rows
    return by_arm


def ensure_warm_start(warm: Path, task: list[str], quick: bool) -> Path:
    """The warm start for ``task`` (its --copy-lengths) at ``warm``, trained if missing (tiny with ``quick``)."""
    from otb_train.warm_start import main as warm_start

    if not (warm / "config.json").exists():
        shutil.rmtree(warm, ignore_errors=True)
        lengths = task[task.index("--copy-lengths") + 1 :][:2]
        extra = ["--steps", "10", "--hidden-size", "32"] if quick else []
        warm_start(["--out", str(warm), "--task", "copy_exact", "--copy-lengths", *lengths, *extra])
    return warm


def driver_parser(doc: str, arms: dict, seeds: list[int], runs_dir: Path) -> argparse.ArgumentParser:
    """The command line every records-based driver shares (its description: the first paragraph of ``doc``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny warm start, every arm, 1 seed, 2 steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=seeds)
    parser.add_argument("--arms", nargs="+", default=list(arms), choices=list(arms))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--commit", action="store_true", help="git commit each run's record when it finishes")
    parser.add_argument("--report-only", action="store_true", help="no runs: the report from the records")
    parser.add_argument("--runs-dir", type=Path, default=runs_dir)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser


def run_missing(args, arms: dict, common: list[str], task: list[str], steps: int, warm: Path, records_dir: Path):
    """Every arm x seed of ``args`` without a record in ``records_dir``: run it, write its record (and commit it).
    The warm start ``warm`` is trained first if missing (only when something is to run)."""
    todo = [(a, s) for s in args.seeds for a in args.arms if not (records_dir / f"{a}_seed{s}.json").exists()]
    if not todo:
        return
    ensure_warm_start(warm, task, args.quick)

    def job(arm_seed):
        arm, seed = arm_seed
        flags, start = [*task, *common, *arms[arm]], time.perf_counter()
        run = run_train(arm, seed, steps, warm, args.runs_dir, flags)
        path = write_record(arm, seed, run, flags, time.perf_counter() - start, records_dir)
        if args.commit:
            commit(path, f"results/{records_dir.name}: {arm} seed {seed} ({steps} steps, {machine_name()})")

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(job, todo))
