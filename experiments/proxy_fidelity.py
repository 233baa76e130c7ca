"""How well does the Logit-Gradient Proxy (THEORY F6) track the exact gradient energy on a small transformer?

    python experiments/proxy_fidelity.py            # copy16 snapshots, results/proxy_fidelity.md + PNGs (minutes)
    python experiments/proxy_fidelity.py --quick    # seconds: the tiny "quick" snapshots, a handful of responses
    python experiments/proxy_fidelity.py --quick --out-dir /tmp/pf   # the report and PNGs elsewhere (the test)

For each policy snapshot of ``experiments/snapshots.py`` (at init, after the supervised warm start, and after
RL: mid, late) the script samples ``groups x group_size`` responses at temperature 1 (the RL sampling rule,
the same prompts and uniforms for every snapshot) and computes, on a float64 copy of the model,

* the proxy: per-token energy ``w_t = 1 - 2 pi(y_t) + sum_v pi_v^2`` and its cumulative sum ``W_t``;
* the exact energy ``||S_t||^2 = ||grad_theta sum_{s<=t} log pi(y_s)||^2`` over every parameter
  (``otb_ref.exact.prefix_grad_norms_sq_fp64`` through ``otb_train.energies.exact_energies``), and ``||S||^2`` at the
  last token.

Reported: Pearson and Spearman correlations of ``W_t`` vs ``||S_t||^2`` pooled over all tokens and within
position; the least-squares scale ``c`` of ``||S_t||^2 ~ c W_t`` (through the origin) and its relative residual;
the same for ``W_T`` vs ``||S||^2`` per response; and, since OTB only uses each response's share of its group's
energy at a position, the same for the group-normalized weights ``W_t / mean_group(W_t)`` vs
``||S_t||^2 / mean_group(||S_t||^2)``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from common import RESULTS, new_figure, snapshots, write_records, write_report
from otb_ref.proxy import token_energy
from otb_train.energies import exact_energies
from otb_train.model import Policy
from otb_train.rollout import position_ids_from_mask
from otb_train.tasks import synthetic_problem
from otb_train.warm_start import sample_synthetic

ROOT = Path(__file__).resolve().parents[1]

TASK = "copy_exact"
SNAPSHOTS = ("init", "warm", "mid", "late")
PROMPT_SEED = 7  # a prompt stream none of the snapshots was trained on (they used seed 0)
MIN_ALIVE = 5  # a position enters the within-position averages when at least this many responses reach it


@dataclass(frozen=True)
class Plan:
    """Which snapshots and how many responses: ``groups`` prompts x ``group_size`` samples each."""

    setting: str
    groups: int
    group_size: int


PLANS = {"full": Plan("copy16", 16, 8), "quick": Plan("quick", 2, 3)}


# ----------------------------------------------------------------------------- sampling and energies


@torch.no_grad()
def sample(lm, setting: snapshots.Setting, plan: Plan) -> dict:
    """``groups x group_size`` temperature-1 responses (rows of a group adjacent), their rewards and layout."""
    problems = [synthetic_problem(TASK, PROMPT_SEED, i, copy_lengths=setting.copy_lengths) for i in range(plan.groups)]
    drawn = sample_synthetic(lm, problems, plan.group_size, TASK, PROMPT_SEED, 0, setting.copy_lengths[1] + 8)
    out = drawn.rollout
    return {
        "sequences": torch.cat([drawn.prompt_ids, out.response_ids], dim=1),
        "attention": torch.cat([drawn.prompt_mask.bool(), out.response_mask], dim=1),
        "response_ids": out.response_ids,
        "mask": out.response_mask,
        "group": torch.arange(plan.groups).repeat_interleave(plan.group_size),
        "reward": sum(drawn.scores) / len(drawn.scores),
    }


def energies(lm, batch: dict) -> dict[str, np.ndarray]:
    """Proxy ``w_t``, ``W_t`` and exact ``||S_t||^2`` ``[B, T]`` (0 off the mask), exact ``||S||^2`` ``[B]``."""
    sequences, attention, mask = batch["sequences"], batch["attention"], batch["mask"]
    lm64 = copy.deepcopy(lm).double().eval()
    with torch.no_grad():
        positions = position_ids_from_mask(attention)
        log_probs, sum_pi_squared = Policy(lm64, 1.0, None)(
            sequences, attention, positions, targets=batch["response_ids"]
        )
    w = token_energy(log_probs, sum_pi_squared) * mask  # [B, T] float64
    exact = exact_energies("otb_exact", lm, sequences, attention, mask, 1.0)["cumulative_energy"]
    sequence = exact_energies("eob", lm, sequences, attention, mask, 1.0)["grad_norms_sq"]
    return {
        "w": w.numpy(),
        "W": w.cumsum(dim=1).mul(mask).numpy(),
        "S_t": exact.double().numpy(),
        "S": sequence.double().numpy(),
        "mask": mask.numpy(),
        "group": batch["group"].numpy(),
    }


# ----------------------------------------------------------------------------- statistics


def ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their ranks), 0-based."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1]
    ends = np.r_[starts[1:], len(x)]
    average = np.repeat((starts + ends - 1) / 2.0, ends - starts)
    out = np.empty(len(x))
    out[order] = average
    return out


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; NaN when either side is constant."""
    dx, dy = x - x.mean(), y - y.mean()
    denominator = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denominator) if denominator > 0 else float("nan")


def fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Correlations of y vs x, the scale ``c`` of ``y ~ c x`` (least squares through 0), ``||y - cx|| / ||y||``,
    and the spread of the ratio ``y / x``: its 95th over its 5th percentile (1 when y is proportional to x)."""
    c = float((x * y).sum() / (x * x).sum())
    positive = x > 0
    low, high = np.percentile(y[positive] / x[positive], [5, 95])
    return {
        "pearson": pearson(x, y),
        "spearman": pearson(ranks(x), ranks(y)),
        "c": c,
        "residual": float(np.linalg.norm(y - c * x) / np.linalg.norm(y)),
        "ratio_spread": float(high / low),
        "points": len(x),
    }


def within_position(W: np.ndarray, S: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Correlations across responses at each position, averaged unweighted over the positions reached by at
    least ``MIN_ALIVE`` responses (positions where either side is constant are left out and counted)."""
    per_position = []
    for t in range(mask.shape[1]):
        alive = mask[:, t]
        if alive.sum() >= MIN_ALIVE:
            x, y = W[alive, t], S[alive, t]
            per_position.append((pearson(x, y), pearson(ranks(x), ranks(y))))
    kept = [p for p in per_position if not np.isnan(p).any()]
    means = np.mean(kept, axis=0) if kept else (float("nan"), float("nan"))
    return {"pearson": float(means[0]), "spearman": float(means[1]), "positions": len(kept)}


def group_normalized(W: np.ndarray, S: np.ndarray, mask: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(W / mean, S / mean)`` pooled over (group, position, response), the means over the group's responses
    alive at that position; only (group, position) cells with at least two alive responses."""
    xs, ys = [], []
    for g in np.unique(group):
        rows = group == g
        for t in range(mask.shape[1]):
            alive = mask[rows, t]
            if alive.sum() >= 2:
                x, y = W[rows, t][alive], S[rows, t][alive]
                xs.append(x / x.mean())
                ys.append(y / y.mean())
    return np.concatenate(xs), np.concatenate(ys)


def measure(path: Path, setting: snapshots.Setting, plan: Plan) -> dict:
    """Everything the report says about one snapshot, and the arrays behind it."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = sample(lm, setting, plan)
    arrays = energies(lm, batch)
    mask = arrays["mask"]
    last = mask.sum(axis=1) - 1
    rows = np.arange(len(last))
    W, S_t = arrays["W"], arrays["S_t"]
    norm_x, norm_y = group_normalized(W, S_t, mask, arrays["group"])
    return {
        "reward": batch["reward"],
        "responses": len(rows),
        "mean_length": float(mask.sum(axis=1).mean()),
        "token": fit(W[mask], S_t[mask]),
        "position": within_position(W, S_t, mask),
        "sequence": fit(W[rows, last], arrays["S"]),
        "normalized": fit(norm_x, norm_y),
        "uniform_residual": float(np.linalg.norm(norm_y - 1) / np.linalg.norm(norm_y)),
        "last_vs_sequence": float(np.max(np.abs(S_t[rows, last] - arrays["S"]) / arrays["S"])),
        "arrays": {**arrays, "norm_x": norm_x, "norm_y": norm_y, "last": last},
    }


# ----------------------------------------------------------------------------- figures and report


def token_points(record: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = record["arrays"]
    positions = np.broadcast_to(np.arange(a["mask"].shape[1]), a["mask"].shape)
    return a["W"][a["mask"]], a["S_t"][a["mask"]], positions[a["mask"]]


def sequence_points(record: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = record["arrays"]
    return a["W"][np.arange(len(a["last"])), a["last"]], a["S"], a["last"] + 1


def normalized_points(record: dict) -> tuple[np.ndarray, np.ndarray, None]:
    return record["arrays"]["norm_x"], record["arrays"]["norm_y"], None


def scatter(records: dict, points, kind: str, labels: tuple[str, str], path: Path) -> None:
    """One log-log panel per snapshot: y vs x (coloured by response position when given) and the fitted line."""
    figure, axes = new_figure(len(records), width=4.2, height=3.8)
    for ax, (name, record) in zip(axes, records.items()):
        x, y, colour = points(record)
        keep = (x > 0) & (y > 0)
        shown = ax.scatter(x[keep], y[keep], s=6, alpha=0.6, c=None if colour is None else colour[keep])
        c = record[kind]["c"]
        line = np.geomspace(x[keep].min(), x[keep].max(), 50)
        ax.plot(line, c * line, color="black", linewidth=1, label=f"c = {c:.3g}")
        ax.set(xscale="log", yscale="log", xlabel=labels[0], ylabel=labels[1])
        ax.set_title(f"{name}: Spearman {record[kind]['spearman']:.2f}", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
        ax.tick_params(which="minor", labelbottom=False, labelleft=False)
    if colour is not None:
        figure.colorbar(shown, ax=axes[-1], label="response length" if kind == "sequence" else "response position t")
    figure.subplots_adjust(left=0.06, right=0.97, bottom=0.14, top=0.9, wspace=0.35)
    figure.savefig(path, dpi=100)
    figure.clf()


POSITION_COLUMNS = {
    "within-position Pearson": lambda r: f"{r['position']['pearson']:.3f}",
    "within-position Spearman": lambda r: f"{r['position']['spearman']:.3f}",
    "positions averaged": lambda r: str(r["position"]["positions"]),
}

UNIFORM_COLUMN = {"uniform weights: relative residual": lambda r: f"{r['uniform_residual']:.3f}"}


def table(records: dict, kind: str, columns: dict | None = None) -> list[str]:
    """A markdown table of ``records[*][kind]`` (a :func:`fit`), one row per snapshot, plus ``columns``."""
    columns = columns or {}
    names = ["snapshot", "Pearson", "Spearman", "c", "relative residual", "ratio p95/p5", "points", *columns]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for name, record in records.items():
        f = record[kind]
        cells = [name, f"{f['pearson']:.3f}", f"{f['spearman']:.3f}", f"{f['c']:.3g}", f"{f['residual']:.3f}"]
        cells += [f"{f['ratio_spread']:.3g}", str(f["points"])] + [value(record) for value in columns.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def checks(records: dict) -> dict[str, float]:
    """The theorem checks: W_t nondecreasing, w_t in [0, 2], exact energies >= 0, ||S_T||^2 = ||S||^2."""
    arrays = [r["arrays"] for r in records.values()]
    return {
        "W_nondecreasing": all(bool((np.diff(a["W"], axis=1)[a["mask"][:, 1:]] >= 0).all()) for a in arrays),
        "w_min": min(float(a["w"][a["mask"]].min()) for a in arrays),
        "w_max": max(float(a["w"][a["mask"]].max()) for a in arrays),
        "exact_min": min(float(min(a["S_t"][a["mask"]].min(), a["S"].min())) for a in arrays),
        "last_vs_sequence": max(r["last_vs_sequence"] for r in records.values()),
    }


def each(records: dict, kind: str, key: str, style: str = ".2f") -> str:
    """``"init 0.12, warm 0.34, ..."``: one statistic per snapshot."""
    return ", ".join(f"{name} {record[kind][key]:{style}}" for name, record in records.items())


def what_this_shows(records: dict) -> list[str]:
    """Statements read off the tables, snapshot by snapshot; no verdict beyond them."""
    versus = ", ".join(
        f"{name} {r['normalized']['residual']:.2f} vs {r['uniform_residual']:.2f}" for name, r in records.items()
    )
    sentences = [
        f"Pooled over all tokens, the Spearman correlation of `W_t` with `||S_t||²` is "
        f"{each(records, 'token', 'spearman')} (Pearson {each(records, 'token', 'pearson')}); pooled numbers "
        "include the growth of both quantities with `t`.",
        f"Across responses at a fixed position the mean Spearman correlation is "
        f"{each(records, 'position', 'spearman')}.",
        f"The scale `c` of `||S_t||² ≈ c W_t` is {each(records, 'token', 'c', '.3g')}, and the ratio "
        f"`||S_t||² / W_t` spans a factor (95th / 5th percentile) of {each(records, 'token', 'ratio_spread', '.3g')}.",
        f"Per response, `W_T` vs `||S||²` has Spearman {each(records, 'sequence', 'spearman')}.",
        f"The group-normalized weights, the form in which the energies enter OTB's baseline, have Spearman "
        f"{each(records, 'normalized', 'spearman')}; their relative residual against the exact normalized "
        f"weights, next to that of uniform weights (every response of a group weighted equally), is {versus}.",
    ]
    return ["## What this shows", "", " ".join(sentences), ""]


def report(records: dict, plan: Plan, seconds: float, out_dir: Path) -> Path:
    setting = snapshots.SETTINGS[plan.setting]
    check = checks(records)
    low, high = setting.copy_lengths
    sections = [
        f"Snapshots `{plan.setting}` of `experiments/snapshots.py` (task `{TASK}`, answers of {low}-{high} digits, "
        f"at most {high + 8} new tokens, temperature 1). Per snapshot: {plan.groups} prompts (seed {PROMPT_SEED}, "
        f"not a training prompt stream) x {plan.group_size} sampled responses. Proxy and exact energies on a float64 "
        "copy of the model; exact energies over every parameter (`otb_ref.exact`). `c`: least squares through the "
        "origin of exact on proxy; relative residual `||y - c x|| / ||y||`. Within-position: Pearson/Spearman "
        f"across the responses alive at each position, unweighted mean over the positions with at least {MIN_ALIVE} "
        "alive responses (positions where either side is constant are left out).",
        "",
        "## Sampled policy",
        "",
        "| snapshot | mean reward | responses | mean length |",
        "|---|---|---|---|",
        *[f"| {n} | {r['reward']:.3f} | {r['responses']} | {r['mean_length']:.1f} |" for n, r in records.items()],
        "",
        "## Token level: `W_t` vs `||S_t||²`",
        "",
        *table(records, "token", POSITION_COLUMNS),
        "",
        "![token level](proxy_fidelity_tokens.png)",
        "",
        "## Sequence level: `W_T` vs `||S||²`",
        "",
        *table(records, "sequence"),
        "",
        "![sequence level](proxy_fidelity_sequences.png)",
        "",
        "## Group-normalized: `W_t / mean_group W_t` vs `||S_t||² / mean_group ||S_t||²`",
        "",
        "OTB's baseline `Σ_i W_t^i G_t^i / Σ_i W_t^i` is invariant to a global scale of the energies: only each "
        "response's share of its group's energy at a position matters. Means over the group's responses alive at "
        "position `t`, cells with at least two of them, pooled over groups, positions and responses.",
        "",
        *table(records, "normalized", UNIFORM_COLUMN),
        "",
        "![group-normalized](proxy_fidelity_normalized.png)",
        "",
        "## Checks",
        "",
        f"`W_t` nondecreasing in `t`: {check['W_nondecreasing']}; `w_t` in [{check['w_min']:.3g}, "
        f"{check['w_max']:.3g}] (F6: within [0, 2]); smallest exact energy {check['exact_min']:.3g}; "
        f"largest relative gap between `||S_t||²` at the last token and `||S||²` computed separately: "
        f"{check['last_vs_sequence']:.2g} (exact energies stored in float32 by `otb_train.energies.exact_energies`).",
        "",
        *what_this_shows(records),
    ]
    return write_report("proxy_fidelity", "Fidelity of the Logit-Gradient Proxy", sections, seconds, out_dir)


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment; returns ``{snapshot: record}`` (statistics and the arrays behind them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny snapshots and a handful of responses")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the report and PNGs go")
    snapshots.add_snapshots_dir(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    plan = PLANS["quick" if args.quick else "full"]
    paths, setting = snapshots.snapshots(plan.setting, args.snapshots_dir), snapshots.SETTINGS[plan.setting]
    records = {}
    for name in SNAPSHOTS:
        records[name] = measure(paths[name], setting, plan)
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    scatter(records, token_points, "token", ("proxy W_t", "exact ||S_t||²"), args.out_dir / "proxy_fidelity_tokens.png")
    labels = ("proxy W_T", "exact ||S||²")
    scatter(records, sequence_points, "sequence", labels, args.out_dir / "proxy_fidelity_sequences.png")
    labels = ("W_t / group mean", "||S_t||² / group mean")
    scatter(records, normalized_points, "normalized", labels, args.out_dir / "proxy_fidelity_normalized.png")
    write_records("proxy_fidelity", {"snapshots": records}, args.out_dir)
    path = report(records, plan, time.perf_counter() - started, args.out_dir)
    print(f"wrote {path}", file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
