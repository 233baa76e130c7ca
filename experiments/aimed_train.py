"""train.py with one measurement added: how well each update is aimed, at a few steps.

    python experiments/aimed_train.py --aim-steps 1 50 100 150 -- TRAIN_FLAGS      (train.py's flags after --)

At every step of ``--aim-steps``, before the update, a **reference gradient** is estimated at the current
parameters θ: ``--aim-prompts`` fresh prompts (a stream of their own, never trained on) x ``--aim-group`` responses
each, sampled from the current policy (temperature 1, train.py's sampler with uniforms of their own), with RLOO
advantages (leave-one-out: unbiased, F7) and the token-mean surrogate ``Σ a_t log π(y_t) / #tokens``; its
gradient, the direction of increasing reward, is summed over two halves of the prompts separately. Then train.py's
update runs, and ``aim.jsonl`` in the run's output directory gets one line per such step:

* ``update_norm``: ``‖Δθ‖``, Δθ = θ after − θ before the step's update(s);
* ``cos_update``: cos(Δθ, g_ref), how well the update is aimed (AdamW's direction, not the raw gradient's);
* ``cos_grad``: cos(g, g_ref), g the step's own gradient of the same surrogate with the step's own advantages at θ
  (the estimator's direction before AdamW);
* ``cos_halves``: cos between the two halves' reference gradients, the reference's own noise: with independent
  halves of equal SNR s, its expectation is about s / (1 + s), and a cosine with the full reference is attenuated
  by about sqrt(2 · cos_halves / (1 + cos_halves)) whatever the update.

Nothing of the run itself changes: the reference is computed on an unsharded copy of the policy, its sampling
uses its own uniforms, and train.py's RNG-free sampler, advantages and optimizer never see it.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "train.py"
AIM_SEED_OFFSET = 7_777_777  # the reference's prompt stream and uniforms: far from any run's seed


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: aimed_train.py [--aim-steps K ...] [--aim-prompts P] [--aim-group N] -- TRAIN_FLAGS")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aim-steps", type=int, nargs="*", default=[])
    parser.add_argument("--aim-prompts", type=int, default=16, help="reference prompts (an even number)")
    parser.add_argument("--aim-group", type=int, default=32, help="reference responses per prompt")
    parser.add_argument("--aim-micro", type=int, default=128, help="rows per forward/backward of the reference")
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def _flat(named: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([named[name].detach().reshape(-1).double() for name in names])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else float("nan")


def surrogate_gradient(lm, names, sequences, attention, response_ids, mask, advantages, micro: int) -> torch.Tensor:
    """∇_θ Σ_it a_it log π(y_it) / #tokens (the on-policy token-mean surrogate), flattened over ``names``."""
    from otb_train.model import Policy
    from otb_train.rollout import position_ids_from_mask

    policy, params = Policy(lm, 1.0, None), [dict(lm.named_parameters())[name] for name in names]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    tokens = float(mask.sum())
    for start in range(0, len(sequences), micro):
        rows = slice(start, start + micro)
        log_probs, _ = policy(
            sequences[rows], attention[rows], position_ids_from_mask(attention[rows]), targets=response_ids[rows]
        )
        objective = (advantages[rows] * mask[rows] * log_probs).sum() / tokens
        grads = torch.autograd.grad(objective, params, allow_unused=True)
        total += torch.cat(
            [(g if g is not None else torch.zeros_like(p)).reshape(-1).double() for g, p in zip(grads, params)]
        )
    return total


def reference_halves(lm, names, cfg, step: int, prompts: int, group: int, micro: int) -> list[torch.Tensor]:
    """Two independent halves of the RLOO reference gradient at the current parameters (``prompts // 2`` each)."""
    from otb_ref import compute_advantages
    from otb_train.tasks import synthetic_problem
    from otb_train.warm_start import sample_synthetic

    seed = cfg.seed + AIM_SEED_OFFSET
    halves = []
    for half in range(2):
        problems = [
            synthetic_problem(cfg.task, seed, step * 1000 + half * prompts + i, copy_lengths=cfg.copy_lengths)
            for i in range(prompts // 2)
        ]
        drawn = sample_synthetic(lm, problems, group, cfg.task, seed + half, step, cfg.max_new_tokens)
        out = drawn.rollout
        lengths = out.response_mask.sum(dim=1)
        rewards = torch.zeros(out.response_mask.shape).scatter_(
            1, (lengths - 1)[:, None], torch.tensor(drawn.scores)[:, None]
        )
        index = torch.arange(len(problems)).repeat_interleave(group)
        advantages, _ = compute_advantages("rloo", rewards, out.response_mask, index)
        sequences = torch.cat([drawn.prompt_ids, out.response_ids], dim=1)
        attention = torch.cat([drawn.prompt_mask.bool(), out.response_mask], dim=1)
        mask = out.response_mask.float()
        halves.append(surrogate_gradient(lm, names, sequences, attention, out.response_ids, mask, advantages, micro))
    return halves


def main(argv: list[str] | None = None) -> None:
    args, train_argv = parse_args(sys.argv[1:] if argv is None else argv)
    main_fn = runpy.run_path(str(TRAIN_PY), run_name="train_script")["main"]
    namespace = main_fn.__globals__
    original_update = namespace["update"]
    aim_steps, plain = set(args.aim_steps), {}

    def update(run, batch, step, state):
        if step not in aim_steps:
            return original_update(run, batch, step, state)
        from transformers import AutoModelForCausalLM

        from otb_train import distributed

        if "lm" not in plain:  # an unsharded copy of the policy (the warm start's architecture)
            plain["lm"] = AutoModelForCausalLM.from_pretrained(run.cfg.model, dtype=torch.float32).eval()
        full = distributed.full_model_state_dict(run.policy)
        before = {k.removeprefix("lm."): v.detach().clone() for k, v in full.items()}
        lm = plain["lm"]
        lm.load_state_dict(before)
        names = [name for name, _ in lm.named_parameters()]
        halves = reference_halves(lm, names, run.cfg, step, args.aim_prompts, args.aim_group, args.aim_micro)
        reference = halves[0] + halves[1]
        own = surrogate_gradient(
            lm, names, batch.sequences, batch.attention, batch.response_ids, batch.mask.float(), batch.advantages,
            args.aim_micro,
        )  # fmt: skip
        stats = original_update(run, batch, step, state)
        after = {k.removeprefix("lm."): v for k, v in distributed.full_model_state_dict(run.policy).items()}
        delta = _flat(after, names) - _flat(before, names)
        line = {
            "step": step,
            "update_norm": float(delta.norm()),
            "cos_update": _cos(delta, reference),
            "cos_grad": _cos(own, reference),
            "cos_update_grad": _cos(delta, own),
            "cos_halves": _cos(halves[0], halves[1]),
            "grad_norm": float(own.norm()),
            "reference_norm": float(reference.norm() / 2),
        }
        with open(Path(run.output_dir) / "aim.jsonl", "a") as stream:
            stream.write(json.dumps(line) + "\n")
        return stats

    namespace["update"] = update
    main_fn(train_argv)


if __name__ == "__main__":
    main()
