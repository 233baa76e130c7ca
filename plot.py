"""Plot train.py runs side by side: mean reward vs generated tokens, gradient norm vs step.

    python plot.py runs/otb runs/grpo --out compare.png [--smooth 10]
    python plot.py runs/a runs/b --label "OTB, lr 1e-3" --label "GRPO, lr 1e-3"

Each argument is a run directory (its metrics.jsonl) or a metrics.jsonl file.
Runs are labelled from their config.json (estimator, N, seed, and the flags that
differ between the runs plotted), or by --label, once per run in order. Skipped steps (non-finite loss or
gradient) have no gradient norm and leave a gap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def load_metrics(path: Path) -> list[dict]:
    """The records of one run's metrics.jsonl, in file order."""
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"plot.py: error: {path}: no metrics.jsonl")
    records = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise SystemExit(f"plot.py: error: {file}:{number}: malformed JSON ({error.msg})") from None
    return records


def load_config(path: Path) -> dict:
    """The run's config.json (next to its metrics.jsonl), or {} when there is none."""
    file = (path if path.is_dir() else path.parent) / "config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


_ALWAYS = ("estimator", "group_size", "seed")
_SHORT = {"group_size": "N", "leave_one_out": "loo", "std_normalize": "std"}
_NOT_LABELS = (
    "output_dir",
    "resume",
    "steps",
    "save_every",
    "keep_checkpoints",
    "tensorboard",
    "sample_every",
    "num_samples",
    "device",
    "micro_batch_size",
    "logprob_chunk_size",
    "static_decode",
)


def labels_for(runs: list[Path], configs: list[dict]) -> list[str]:
    """``otb N=8 seed=0`` plus every other flag whose value differs between the runs; the directory name
    when a run has no config.json; a numbered suffix when two labels would still be equal."""
    varying = sorted(
        {
            k
            for c in configs
            for k in c
            if k not in _ALWAYS + _NOT_LABELS and len({json.dumps(d.get(k)) for d in configs}) > 1
        }
    )
    labels = []
    for run, config in zip(runs, configs):
        if not config:
            labels.append((run.parent if run.is_file() else run).resolve().name)
            continue
        parts = [str(config.get("estimator"))] + [
            f"{_SHORT.get(k, k)}={config.get(k)}" for k in _ALWAYS[1:] + tuple(varying)
        ]
        labels.append(" ".join(parts))
    return [
        f"{label} ({labels[:i].count(label) + 1})" if labels.count(label) > 1 else label
        for i, label in enumerate(labels)
    ]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over the last ``window`` finite values (NaN stays NaN)."""
    out, recent = [], []
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(math.nan)
            continue
        recent = (recent + [value])[-window:]
        out.append(sum(recent) / len(recent))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", type=Path, default=Path("runs.png"), help="PNG to write (default: runs.png)")
    parser.add_argument("--label", action="append", default=[], help="legend label of the next run, in order")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window, in steps")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        raise SystemExit("plot.py: error: --smooth must be >= 1")
    if len(args.label) > len(args.runs):
        raise SystemExit(f"plot.py: error: {len(args.label)} --label values for {len(args.runs)} runs")
    labels = labels_for(args.runs, [load_config(run) for run in args.runs])
    labels[: len(args.label)] = args.label

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward_axis, grad_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for run, label in zip(args.runs, labels):
        records = load_metrics(run)
        nan = float("nan")
        reward_axis.plot(
            [r["tokens"] for r in records], smooth([r["reward_mean"] for r in records], args.smooth), label=label
        )
        grad_norms = [r["grad_norm"] if r.get("grad_norm") is not None else nan for r in records]
        grad_axis.plot([r["step"] for r in records], smooth(grad_norms, args.smooth), label=label)
    reward_axis.set(xlabel="generated tokens", ylabel="mean reward", title="reward vs tokens")
    grad_axis.set(xlabel="step", ylabel="gradient norm (before clipping)", title="gradient norm vs step", yscale="log")
    for axis in (reward_axis, grad_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    sys.exit(main())
