"""Verifiable tasks for the RL trainer: built-in synthetic problems and a math-answer verifier.

Pure string functions (no I/O, no randomness outside the explicit seeds):

* :class:`CharTokenizer` — the character-level tokenizer of the built-in tasks.
* :func:`synthetic_problem` — problem ``i`` of a synthetic task, a pure
  function of ``(task, seed, i)``, so any data position can be re-created.
* :func:`extract_answer`, :func:`math_reward` — the verifier used for
  ``--data`` rows and for the ``add`` task: the content of the last
  ``\\boxed{...}``, else the last number in the text, compared after
  normalisation (``"1,000" == "1000"``, ``"2.50" == "2.5"``, ``"$7$" == "7"``).
* :func:`copy_reward` — the graded reward of the ``copy`` task.

Built-in tasks (``SYNTHETIC_TASKS``):

``copy`` (the default) the prompt is ``n`` random digits left-justified in a
         field of fixed width, then ``=`` (``"37  ="``, width 4, n in 1..4);
         the answer is the digits (``"37"``). A correct response is
         ``"37<eos>"``: its length depends on the prompt and the policy must
         stop by itself. Graded reward :func:`copy_reward` (0 without EOS).
         The fixed width puts digit ``j`` of the prompt at the same distance
         from response token ``j`` for every prompt, which a small
         transformer learns quickly. A uniform random policy scores about
         0.02. With ``copy_lengths=(63, 511)`` (``--long-horizon``) correct
         responses are 64–512 tokens long.
``copy_exact`` the ``copy`` prompts with a 0/1 reward: 1 exactly when the
         response is the answer followed by EOS. With long answers
         (``copy_lengths=(64, 80)``) a correct response is 65–81 tokens and
         one wrong digit anywhere scores 0: the sparse, long-horizon outcome
         reward of the paper's setting, for a warm-started model
         (``experiments/warm_start.py``) to improve on.
``add``  ``"a+b="`` with digits ``a, b``; the answer is ``a+b`` in decimal
         (one or two digits). Reward 1 when the last number of the response
         equals the answer (:func:`math_reward`) and the response ended with
         EOS. Harder from scratch: with the trainer's defaults the 2-layer model
         learns the format (a number, then EOS) but not the sums (reward
         about 0.07 after 300 steps).
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

__all__ = [
    "SYNTHETIC_TASKS",
    "CharTokenizer",
    "hugging_face_char_tokenizer",
    "Problem",
    "synthetic_problem",
    "synthetic_reward",
    "extract_answer",
    "normalize_answer",
    "math_reward",
    "copy_reward",
]

SYNTHETIC_TASKS = ("add", "copy", "copy_exact")


class Problem(NamedTuple):
    """One prompt with its reference answer (both plain strings)."""

    prompt: str
    answer: str


class CharTokenizer:
    """Character-level tokenizer of the synthetic tasks: one id per character.

    Ids: ``0`` pad, ``1`` EOS, then ``"0123456789+= "``. ``decode`` drops pad
    and EOS. Mirrors the few attributes of a Hugging Face tokenizer that the
    trainer uses (``pad_token_id``, ``eos_token_id``, ``encode``, ``decode``).
    """

    characters = "0123456789+= "
    pad_token_id = 0
    eos_token_id = 1

    def __init__(self) -> None:
        self._ids = {c: i + 2 for i, c in enumerate(self.characters)}

    def __len__(self) -> int:
        return len(self.characters) + 2

    def encode(self, text: str) -> list[int]:
        """``text -> ids``; raises ``ValueError`` naming an unknown character."""
        try:
            return [self._ids[c] for c in text]
        except KeyError as error:
            raise ValueError(f"text: character {error.args[0]!r} is not in the synthetic vocabulary") from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``ids -> text``; pad and EOS are always skipped (the argument mirrors Hugging Face's)."""
        return "".join(self.characters[i - 2] for i in ids if i >= 2)


def hugging_face_char_tokenizer():
    """The CharTokenizer vocabulary as a Hugging Face fast tokenizer (same ids, no special tokens added)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = CharTokenizer()
    vocab = {"<pad>": chars.pad_token_id, "<eos>": chars.eos_token_id}
    vocab.update({c: i + 2 for i, c in enumerate(chars.characters)})
    backend = Tokenizer(models.WordLevel(vocab))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<eos>")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def synthetic_problem(task: str, seed: int, index: int, copy_lengths: tuple[int, int] = (1, 4)) -> Problem:
    """Problem number ``index`` of ``task``: a pure function of ``(task, seed, index)``.

    Args:
        task: one of ``SYNTHETIC_TASKS``.
        seed: run seed; ``index``: position in the infinite problem stream.
        copy_lengths: inclusive ``(min, max)`` digit count for ``copy``; ``max`` is the field width.
    """
    stream = "copy" if task == "copy_exact" else task  # copy_exact: the copy task's prompts
    rng = random.Random(f"{stream}:{seed}:{index}")  # str seeds hash with sha512: stable across runs
    if task == "add":
        a, b = rng.randrange(10), rng.randrange(10)
        return Problem(f"{a}+{b}=", str(a + b))
    if task in ("copy", "copy_exact"):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(*copy_lengths)))
        return Problem(digits.ljust(copy_lengths[1]) + "=", digits)  # fixed-width field: "37  =" -> "37"
    raise ValueError(f"task: unknown synthetic task {task!r}; choose one of {SYNTHETIC_TASKS}")


_BOXED = "\\boxed"
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or ``None``."""
    start = text.rfind(_BOXED + "{")
    while start != -1:
        depth, i = 0, start + len(_BOXED)
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j]
        start = text.rfind(_BOXED + "{", 0, start)  # unbalanced: try an earlier one
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a response: the last ``\\boxed{...}``, else the last number, else ``None``."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical form for comparison: no spaces, ``$``, thousands commas or trailing period;
    numbers as their shortest exact decimal (``"2.50" -> "2.5"``, ``"-0" -> "0"``)."""
    text = answer.strip().replace("$", "").replace(" ", "").rstrip(".")
    text = re.sub(r"^\\text\{(.*)\}$", r"\1", text)
    plain = text.replace(",", "")
    if re.fullmatch(r"[-+]?(?:\d+\.?\d*|\.\d+)", plain):
        integral, _, fraction = plain.lstrip("+-").partition(".")
        integral, fraction = integral.lstrip("0") or "0", fraction.rstrip("0")
        sign = "-" if plain.startswith("-") and (integral != "0" or fraction) else ""
        return f"{sign}{integral}.{fraction}" if fraction else f"{sign}{integral}"
    return text


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer (:func:`extract_answer`) equals ``answer`` after normalisation, else 0.0."""
    found = extract_answer(response)
    return float(found is not None and normalize_answer(found) == normalize_answer(str(answer)))


def copy_reward(response: str, answer: str) -> float:
    """``#{i : response[i] == answer[i]} / max(len(response), len(answer))``,
    halved when the lengths differ; in ``[0, 1]``.

    The halving makes stopping at the right length pay: without it, "first
    digit, then EOS" is a local optimum that RL from scratch often settles in.
    """
    if not answer and not response:
        return 1.0
    matches = sum(a == b for a, b in zip(response, answer))
    return matches / max(len(response), len(answer)) * (1.0 if len(response) == len(answer) else 0.5)


def synthetic_reward(task: str, response: str, answer: str, finished: bool) -> float:
    """Reward of a synthetic task's response; 0 when the response did not end with EOS."""
    if not finished:
        return 0.0
    if task == "copy_exact":
        return float(response == answer)
    return math_reward(response, answer) if task == "add" else copy_reward(response, answer)
