"""The prompts of a run: a ``--data`` JSONL file or a synthetic task, the stream of problems each step takes (a pure
function of seed and position, so a resumed run continues where it stopped), and prompts as left-padded ids."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from otb_train.config import Config, UserError
from otb_train.tasks import CharTokenizer, Problem, synthetic_problem


def load_jsonl(path: str) -> tuple[list[Problem], list[int]]:
    """The rows of a ``--data`` file and their line numbers; malformed rows are a :class:`UserError`."""
    problems, line_numbers = [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number}: malformed JSON ({error.msg})") from None
        if not isinstance(row, dict) or not {"prompt", "answer"} <= set(row):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise UserError(f'{path}:{number}: expected an object with keys "prompt" and "answer", got {keys}')
        if not isinstance(row["prompt"], str) or not isinstance(row["answer"], (str, int, float)):
            raise UserError(f'{path}:{number}: "prompt" must be a string and "answer" a string or number')
        problems.append(Problem(row["prompt"], str(row["answer"])))
        line_numbers.append(number)
    if not problems:
        raise UserError(f"{path}: no rows")
    return problems, line_numbers


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Prompt ids: the chat template with a generation prompt when the tokenizer has one."""
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode(prompt)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def check_prompts(cfg: Config, data: list[Problem], line_numbers: list[int], tokenizer) -> None:
    """Every ``--data`` prompt encodes to at least one token the model knows."""
    for problem, number in zip(data, line_numbers):
        try:
            ids = encode_prompt(tokenizer, problem.prompt)
        except ValueError as error:
            hint = "; pass --model with its own tokenizer" if isinstance(tokenizer, CharTokenizer) else ""
            raise UserError(f"--data {cfg.data}:{number}: the prompt cannot be encoded ({error}){hint}") from None
        if not ids:
            raise UserError(f"--data {cfg.data}:{number}: the prompt encodes to no tokens with this tokenizer")


def left_pad(rows: list[list[int]], pad_id: int, width: int | None = None, device=None):
    """(ids [B, width] int64, mask [B, width] 0/1 int64): each row right-aligned, ``pad_id`` and 0 on its left.
    ``width`` defaults to the longest row."""
    width = max(len(ids) for ids in rows) if width is None else width
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, size: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def problem_at(cfg: Config, data: list[Problem] | None, position: int) -> Problem:
    """Problem number ``position`` of the run's stream (a pure function of seed and position, so a
    resumed run continues where it stopped): synthetic, or the data in a new shuffled order each epoch."""
    if data is None:
        return synthetic_problem(cfg.task, cfg.seed, position, copy_lengths=cfg.copy_lengths)
    epoch, offset = divmod(position, len(data))
    return data[_epoch_order(cfg.seed, epoch, len(data))[offset]]
