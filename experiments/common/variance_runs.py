"""The variance / learning-rate runs (variance_lr_pilot, variance_lr, equal_rate, merge_rerun): their task, warm
start and flags, one run, its compact record and the metric read from it.

* Configuration: :data:`TASK`, :data:`WARM_START`, :data:`COMMON` (the flags beside an arm's and the rate),
  :data:`ARMS`, :data:`PRIMARY`, :data:`GROUP_SIZES`, :data:`STEPS`, :data:`AIM_STEPS`, :data:`COLUMNS` (the record's
  per-step columns), :data:`CONTRAST` (the pilot's label threshold).
* One run: :func:`run_name`, :func:`run_flags`, :func:`run_one` (an ``experiments/aimed_train.py`` run),
  :func:`write_run_record`, :func:`ensure_warm_start`.
* Reading records: :func:`load_runs`, :func:`reward_per_token` (the metric M), :func:`final_reward`,
  :func:`contrasts` (the pilot's SNR contrast per N).
* The merge rerun's records (experiments/merge_rerun.py; variance_lr's report reads them): :data:`MERGE`,
  :data:`COMMITS`, :data:`RECORD`, :func:`load`, :func:`compare`, :func:`metrics`, :func:`summary_lines`.

The designs: the docstrings of ``experiments/variance_lr_pilot.py`` and ``experiments/variance_lr.py``.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import ROOT, machine_name, write_json_record
from otb_train.warm_start import main as train_warm_start

LENGTHS = ("16", "24")
TASK = ["--task", "copy_exact", "--copy-lengths", *LENGTHS, "--max-new-tokens", "32"]
QUICK_TASK = ["--task", "copy_exact", "--copy-lengths", "2", "3", "--max-new-tokens", "6"]
WARM_START = ["--task", "copy_exact", "--copy-lengths", *LENGTHS, "--hidden-size", "64", "--target-reward", "0.3"]
PROMPTS_PER_STEP = 8
STEPS = 150
WARMUP = 10
AIM_STEPS = (1, 50, 100, 150)  # steps whose update's aim is measured (experiments/aimed_train.py)
AIM = ["--aim-prompts", "16", "--aim-group", "32"]
# The runs' flags beside the arm's and the learning rate: on-policy (1 epoch x 1 mini-batch), the same 10-step
# linear warmup then a constant rate (--min-lr-ratio 1), no gradient clipping, token-mean loss, PPO clip 0.2.
COMMON = [
    "--prompts-per-step", str(PROMPTS_PER_STEP), "--epochs", "1", "--mini-batches", "1", "--warmup-steps",
    str(WARMUP), "--min-lr-ratio", "1", "--grad-clip", "0", "--micro-batch-size", "128", "--save-every", "0",
    "--keep-checkpoints", "1", "--sample-every", "0", "--device", "cpu",
]  # fmt: skip
ARMS = {  # name -> train.py flags (N is added per run)
    "rloo": ["--estimator", "rloo"],
    "otb_loo": ["--estimator", "otb", "--leave-one-out"],
    # the secondary pair (biased differently: reported apart, never read as evidence about variance)
    "grpo_nostd": ["--estimator", "grpo", "--no-std-normalize"],
    "otb": ["--estimator", "otb"],
}
PRIMARY = ("rloo", "otb_loo")
GROUP_SIZES = (4, 16)
COLUMNS = ["step", "tokens", "generated_tokens", "reward_mean", "grad_norm", "update_norm", "approx_kl", "entropy",
           "response_length_mean", "lr"]  # fmt: skip
CONTRAST = 1.5


def run_name(arm: str, n: int, lr: float, seed: int) -> str:
    return f"{arm}_n{n}_lr{lr:g}_seed{seed}"


def run_flags(task: list[str], arm: str, n: int, lr: float) -> list[str]:
    return [*task, *COMMON, *ARMS[arm], "--group-size", str(n), "--lr", f"{lr:g}"]


def run_one(
    name: str, flags: list[str], seed: int, steps: int, warm: Path, runs: Path, aim_steps, in_process: bool = False
) -> Path:
    """One ``experiments/aimed_train.py`` run (train.py + the aim measurement) from ``warm`` into ``runs/<name>``;
    an unfinished one restarts from scratch. Its log is a file, so the run survives its driver; ``in_process``
    (quick mode) runs it in this process instead, with a tiny reference."""
    out = runs / name
    shutil.rmtree(out, ignore_errors=True)
    aim = ["--aim-steps", *map(str, [s for s in aim_steps if s <= steps]), *AIM]
    command = [sys.executable, str(ROOT / "experiments" / "aimed_train.py"), *aim, "--", "--model", str(warm),
               *flags, "--steps", str(steps), "--seed", str(seed), "--output-dir", str(out)]  # fmt: skip
    runs.mkdir(parents=True, exist_ok=True)
    if in_process:
        aimed_train = runpy.run_path(command[1], run_name="aimed_train")["main"]  # the script itself
        tiny = ["--aim-prompts", "2", "--aim-group", "4"]
        aimed_train([*aim[: aim.index("--aim-prompts")], *tiny, *command[command.index("--") :]])
        return out
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = runs / f"{name}.log"
    with open(log, "w") as stream:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{log.read_text()[-3000:]}")
    return out


def write_run_record(meta: dict, run: Path, seconds: float, records_dir: Path) -> Path:
    """The run's compact record ``<records_dir>/<name>.json`` (per-step columns and the aim lines), written whole
    and then renamed, so a record exists only for a finished run."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    aim_file = run / "aim.jsonl"
    aims = [json.loads(line) for line in aim_file.read_text().splitlines()] if aim_file.exists() else []
    record = {
        **meta, "machine": machine_name(), "wall_seconds": round(seconds), "columns": COLUMNS,
        "steps": [[_short(row.get(key)) for key in COLUMNS] for row in rows],
        "aim": [{k: _short(v) for k, v in line.items()} for line in aims],
    }  # fmt: skip
    return write_json_record(records_dir / f"{meta['name']}.json", record)


def _short(value):
    return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def load_runs(records_dir: Path) -> list[dict]:
    """Every run record of ``records_dir``, its per-step rows as dicts under ``rows``."""
    out = []
    for path in sorted(records_dir.glob("*.json")):
        record = json.loads(path.read_text())
        if "columns" not in record:
            continue
        record["rows"] = [dict(zip(record["columns"], values)) for values in record["steps"]]
        out.append(record)
    return out


def reward_per_token(rows: list[dict]) -> float:
    """The metric: mean reward per generated token over the run, Σ reward_mean·tokens / Σ tokens (the area under
    reward vs generated tokens, divided by the tokens). A diverged step (reward None) counts as 0."""
    total = sum(r["generated_tokens"] for r in rows)
    return sum((r["reward_mean"] or 0.0) * r["generated_tokens"] for r in rows) / total


def final_reward(rows: list[dict]) -> float:
    """Mean reward over the last 10% of the steps (at least one)."""
    tail = rows[-max(1, len(rows) // 10) :]
    return statistics.mean((r["reward_mean"] or 0.0) for r in tail)


def ensure_warm_start(warm: Path, quick: bool) -> Path:
    """The warm start at ``warm``: trained by its stopping rule if missing (a tiny one with ``quick``)."""
    if not (warm / "config.json").exists():
        shutil.rmtree(warm, ignore_errors=True)
        flags = [*WARM_START]
        if quick:
            flags = ["--task", "copy_exact", "--copy-lengths", "2", "3", "--hidden-size", "32", "--steps", "10",
                     "--eval-prompts", "16"]  # fmt: skip
        train_warm_start(["--out", str(warm), *flags])
    return warm


def contrasts(snr_records: list[dict]) -> dict[int, float]:
    """N -> the contrast SNR(otb_loo) / SNR(rloo), as the ratio of the seeds' mean SNRs."""
    out = {}
    for k, n in enumerate(GROUP_SIZES):
        loo = statistics.mean(r["snr"][r["estimators"].index("otb_loo")][k] for r in snr_records)
        rloo = statistics.mean(r["snr"][r["estimators"].index("rloo")][k] for r in snr_records)
        out[n] = loo / rloo if rloo > 0 else math.inf
    return out


# -------------------------------------------------------------------- the merge rerun's records

MERGE = "ed1b10c5bc34db8a41d5ec066e8f1c438df93a96"
COMMITS = {"pre-merge (ed1b10c^2)": MERGE + "^2", "merge (ed1b10c)": MERGE}
RECORD = "otb_loo_n4_lr0.001_seed0"  # made at 14:58, before the merge (15:21); OTB's energies are what changed


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


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
    reward (mean of the last 15 steps), as the variance_lr family computes them."""
    rows = [dict(zip(record["columns"], row)) for row in record["steps"]]
    return {"M": reward_per_token(rows), "final": final_reward(rows)}


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
