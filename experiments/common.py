"""What every experiment shares: the machine's name, the report file, plots, and sampling a synthetic task."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
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
    from otb_train.data import left_pad
    from otb_train.model import Policy
    from otb_train.rollout import generate, sampling_uniforms
    from otb_train.tasks import CharTokenizer, synthetic_reward

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
