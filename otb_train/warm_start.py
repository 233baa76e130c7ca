"""The supervised warm start of the experiments (``experiments/warm_start.py`` is its command line), and the
sampler they share: train.py's sampling rule on a built-in synthetic task.

* :func:`sample_synthetic` — ``group_size`` temperature-1 responses per problem with the uniforms of
  ``(seed, step)``, decoded and scored by the task's reward.
* :func:`main` — a small Qwen2 learns a synthetic task by teacher forcing until its sampled reward reaches
  ``--target-reward``, then is saved as a local Hugging Face checkpoint (model + tokenizer) with
  ``warm_start.json``; the flags are ``experiments/warm_start.py``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from otb_train.config import parse_config
from otb_train.data import left_pad
from otb_train.model import Policy, build_model_and_tokenizer
from otb_train.rollout import generate, sampling_uniforms
from otb_train.tasks import CharTokenizer, hugging_face_char_tokenizer, synthetic_problem, synthetic_reward

DESCRIPTION = (  # the first paragraph of experiments/warm_start.py, its --help
    "Supervised warm start: a small Qwen2 learns a synthetic task by teacher forcing, then is saved as a local\n"
    "Hugging Face checkpoint (model + tokenizer) that RL starts from with ``train.py --model``."
)
EVAL_SEED_OFFSET = 10_000  # held-out prompts: another seed of the same stream


class SyntheticSample(NamedTuple):
    """``group_size`` responses per problem, prompt-major (rows ``p * group_size + i``)."""

    prompt_ids: torch.Tensor  # [B, P] left-padded with the pad id 0
    prompt_mask: torch.Tensor  # [B, P] 0/1
    rollout: object  # otb_train.rollout.Rollout: response_ids, response_mask, finished
    texts: list[str]  # B decoded responses
    scores: list[float]  # B task rewards (0 without EOS)


@torch.no_grad()
def sample_synthetic(lm, problems, group_size: int, task: str, seed: int, step: int, max_new_tokens: int):
    """train.py's sampler on a built-in task: character tokenizer, temperature 1, the uniforms of ``(seed, step)``,
    the task's reward. Returns a :class:`SyntheticSample`."""
    tokenizer = CharTokenizer()
    rows = [tokenizer.encode(problem.prompt) for problem in problems for _ in range(group_size)]
    prompt_ids, prompt_mask = left_pad(rows, tokenizer.pad_token_id)
    out = generate(
        Policy(lm, temperature=1.0, chunk_size=None),
        prompt_ids,
        prompt_mask,
        sampling_uniforms(seed, step, len(rows), max_new_tokens),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens,
    )
    lengths = out.response_mask.sum(dim=1)
    texts = [tokenizer.decode(row[: int(n)].tolist()) for row, n in zip(out.response_ids, lengths)]
    answers = [problem.answer for problem in problems for _ in range(group_size)]
    scores = [synthetic_reward(task, *row) for row in zip(texts, answers, out.finished.tolist())]
    return SyntheticSample(prompt_ids, prompt_mask, out, texts, scores)


def supervised_batch(task: str, seed: int, start: int, size: int, copy_lengths, tokenizer: CharTokenizer):
    """(ids [B, L], loss mask [B, L-1]): prompt + answer + EOS, right-padded; the loss covers answer and EOS."""
    rows, masks = [], []
    for i in range(start, start + size):
        problem = synthetic_problem(task, seed, i, copy_lengths=copy_lengths)
        prompt, response = tokenizer.encode(problem.prompt), tokenizer.encode(problem.answer) + [tokenizer.eos_token_id]
        rows.append(prompt + response)
        masks.append([0] * (len(prompt) - 1) + [1] * len(response))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (width - 1 - len(m)) for m in masks], dtype=torch.bool)
    return ids, mask


@torch.no_grad()
def sampled_reward(lm, task: str, seed: int, copy_lengths, num_prompts: int, max_new_tokens: int) -> float:
    """Mean task reward of one temperature-1 sample per held-out prompt (the RL sampling rule)."""
    held_out = seed + EVAL_SEED_OFFSET
    problems = [synthetic_problem(task, held_out, i, copy_lengths=copy_lengths) for i in range(num_prompts)]
    scores = sample_synthetic(lm, problems, 1, task, held_out, 0, max_new_tokens).scores
    return sum(scores) / len(scores)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--out", type=Path, required=True, help="directory to write the checkpoint to")
    parser.add_argument("--task", default="copy_exact", choices=("copy", "copy_exact"))
    parser.add_argument("--copy-lengths", type=int, nargs=2, default=(64, 80), metavar=("MIN", "MAX"))
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000, help="at most this many supervised steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--target-reward", type=float, default=0.3, help="stop once the sampled reward reaches this")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out}: not empty")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = parse_config(
        [
            "--hidden-size",
            str(args.hidden_size),
            "--num-layers",
            str(args.num_layers),
            "--seed",
            str(args.seed),
            "--copy-lengths",
            *map(str, args.copy_lengths),
        ]
    )
    lm, tokenizer, _, _ = build_model_and_tokenizer(cfg)  # the built-in recipe, random init from --seed
    optimizer = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=0.0)
    lengths, max_new = tuple(args.copy_lengths), args.copy_lengths[1] + 8
    log, evals, started, step = [], [], time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        lm.train()
        ids, mask = supervised_batch(
            args.task, args.seed, (step - 1) * args.batch_size, args.batch_size, lengths, tokenizer
        )
        logits = lm(input_ids=ids).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        log.append(float(loss.detach()))
        if step % args.eval_every == 0 or step == args.steps:
            lm.eval()
            reward = sampled_reward(lm, args.task, args.seed, lengths, args.eval_prompts, max_new)
            evals.append({"step": step, "loss": log[-1], "sampled_reward": reward})
            print(f"step {step}: loss {log[-1]:.4f}, sampled reward {reward:.3f}", file=sys.stderr)
            if reward >= args.target_reward:
                break
    lm.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(args.out)
    hugging_face_char_tokenizer().save_pretrained(args.out)
    record = {
        "command": "python experiments/warm_start.py " + " ".join(sys.argv[1:] if argv is None else argv),
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps_run": step,
        "final_sampled_reward": evals[-1]["sampled_reward"] if evals else None,
        "evaluations": evals,
        "loss": log,
        "seconds": time.perf_counter() - started,
        "torch": torch.__version__,
    }
    (args.out / "warm_start.json").write_text(json.dumps(record, indent=1))
    print(
        f"warm start: {step} steps, sampled reward {record['final_sampled_reward']}, saved to {args.out}",
        file=sys.stderr,
    )
    return record
