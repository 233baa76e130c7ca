"""train.py with what its tests observe or inject, kept out of train.py's flags.

    python tests/train_hooks.py [--dump DIR] [--nan-step K] [--stop-after K] -- TRAIN_FLAGS   (or under torchrun)

In process, :func:`run_train` does the same. train.py is run from its file (nothing imports it as a module); the
hooks wrap functions of that run's namespace:

* ``dump``: after each step's advantages, each rank saves its rows (global row ids, advantages, outcome rewards,
  response ids, mask) to ``DIR/step<k>_rank<r>.pt``.
* ``nan_step``: the policy loss is NaN at that step (the update must be skipped).
* ``stop_after``: the run checkpoints and stops after that step, as if preempted.
"""

import argparse
import os
import runpy
import sys
from pathlib import Path

import torch

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"


def run_train(argv: list[str], dump: str | None = None, nan_step: int = 0, stop_after: int = 0) -> None:
    """train.py's ``main(argv)`` with the hooks given (a fresh namespace each call)."""
    main = runpy.run_path(str(TRAIN_PY), run_name="train_script")["main"]
    namespace = main.__globals__  # the functions' own globals: what the loop looks names up in
    step = _note_step(namespace)
    if dump:
        _wrap_after(namespace, "estimate_advantages", lambda run, batch: _dump(Path(dump), run, batch, step["now"]))
    if nan_step:
        _poison_loss_at(namespace, nan_step, step)
    if stop_after:
        finished = namespace["finished"]
        namespace["finished"] = lambda cfg, state: finished(cfg, state) or state["step"] == stop_after
    main(argv)


def _note_step(namespace: dict) -> dict:
    """``{"now": k}``, k the step whose rollout ran last (train.py's phases after rollout take no step)."""
    step, rollout = {"now": 0}, namespace["rollout"]

    def noted(run, k, data_position):
        step["now"] = k
        return rollout(run, k, data_position)

    namespace["rollout"] = noted
    return step


def _wrap_after(namespace: dict, name: str, hook) -> None:
    original = namespace[name]

    def wrapped(*args):
        result = original(*args)
        hook(*args)
        return result

    namespace[name] = wrapped


def _dump(folder: Path, run, batch, step: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "rows": run.global_rows,
        "advantages": batch.advantages.cpu(),
        "rewards": batch.scores.cpu(),
        "response_ids": batch.response_ids.cpu(),
        "mask": batch.mask.cpu(),
    }
    torch.save(rows, folder / f"step{step}_rank{run.env.rank}.pt")


def _poison_loss_at(namespace: dict, nan_step: int, step: dict) -> None:
    accumulate, loss_fn = namespace["accumulate_gradients"], namespace["clipped_policy_loss"]

    def nan_loss(*args, **kwargs):
        loss, stats = loss_fn(*args, **kwargs)
        return loss * float("nan"), stats

    def accumulate_gradients(run, batch, mini):
        namespace["clipped_policy_loss"] = nan_loss if step["now"] == nan_step else loss_fn
        try:
            return accumulate(run, batch, mini)
        finally:
            namespace["clipped_policy_loss"] = loss_fn

    namespace["accumulate_gradients"] = accumulate_gradients


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump")
    parser.add_argument("--nan-step", type=int, default=0)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("train_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    from otb_train.config import UserError

    try:
        run_train(flags, args.dump, args.nan_step, args.stop_after)
    except UserError as error:  # as train.py reports it
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: error: {error}", file=sys.stderr)
        sys.exit(2)
