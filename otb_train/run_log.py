"""The run's files besides checkpoints: ``config.json`` and ``config_history.jsonl`` (what ran, start by start),
``metrics.jsonl`` (one record per step) and ``samples.jsonl`` (sampled responses), written by rank 0 only, the
metrics optionally mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from otb_train.config import config_changes
from otb_train.distributed import Dist


class JsonlLog:
    """An append-only JSONL file of records that carry a ``step`` (a no-op off rank 0): ``metrics.jsonl`` by
    default, ``samples.jsonl`` for responses; ``tensorboard`` mirrors numeric fields to TensorBoard.

    ``resume_step``: keep only lines with ``step <= resume_step`` (lines logged after the checkpoint that is being
    resumed are dropped); ``None`` starts a new file.
    """

    def __init__(
        self,
        output_dir: Path,
        env: Dist,
        resume_step: int | None,
        tensorboard: bool = False,
        name: str = "metrics.jsonl",
    ) -> None:
        self.path = Path(output_dir) / name
        self.enabled = env.is_main
        self.writer = None
        if not self.enabled:
            return
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step
            ]
        self.path.write_text("".join(line + "\n" for line in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # NaN/inf (a skipped step's loss) become null: metrics.jsonl stays strict JSON.
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()


def record_configuration(output_dir: Path, first: dict | None, config: dict, from_step: int) -> None:
    """``config.json`` at a run's first start (``first`` is None), and a line of ``config_history.jsonl`` at every
    start: when, from which step, which flags changed since the first start, and the whole configuration."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if first is None:
        (output_dir / "config.json").write_text(json.dumps(config, indent=1))
    changed = {k: v for k, v in config_changes(first or config, config).items() if k != "resume"}
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from_step": from_step, "changed": changed, "config": config}
    with open(output_dir / "config_history.jsonl", "a") as file:
        file.write(json.dumps(line) + "\n")
