"""One rank of test_trl.py's two-process run (torchrun --nproc_per_node 2): OTBGRPOTrainer with 2 completions per
process and 4 per prompt, so every prompt group spans both processes. Each rank saves its rollouts to OUT."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2])]  # test_trl and tests/optional.py
import test_trl  # noqa: E402

from otb_ref.integrations.trl import OTBGRPOTrainer  # noqa: E402


def main(out: Path, leave_one_out: bool) -> None:
    trainer = test_trl._trainer(
        OTBGRPOTrainer, out / "run", {"leave_one_out": leave_one_out}, per_device_train_batch_size=2, max_steps=2
    )
    records = test_trl._recording(trainer)
    trainer.train()
    rank = dist.get_rank()
    saved = [
        {
            "advantages": r["output"]["advantages"],
            "mask": r["output"]["completion_mask"],
            "log_probs": r["log_probs"],
            "sum_sq": r["sum_sq"],
            "rewards": r["rewards"],
        }
        for r in records
    ]
    torch.save(saved, out / f"rank{rank}.pt")
    dist.barrier()  # both files are written
    # No teardown: on a loaded 2-core machine gloo's threads abort the process at interpreter exit or in
    # destroy_process_group ("terminate called without an active exception"), after the work is done.
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "loo")
