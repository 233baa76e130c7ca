"""Supervised warm start: a small Qwen2 learns a synthetic task by teacher forcing, then is saved as a local
Hugging Face checkpoint (model + tokenizer) that RL starts from with ``train.py --model``.

    python experiments/warm_start.py --out runs/warm_copy64                    # copy_exact, answers of 64-80 digits
    python experiments/warm_start.py --out runs/warm --copy-lengths 8 16 --target-reward 0.3
    python train.py --model runs/warm_copy64 --task copy_exact --copy-lengths 64 80 --max-new-tokens 96 --lr 1e-4

The paper's RL starts from a competent but imperfect pretrained model. Here the stand-in is a model trained
on the task's own (prompt, answer + EOS) pairs until its *sampled* responses (temperature 1, the RL sampling
rule) reach ``--target-reward`` on held-out prompts, checked every ``--eval-every`` steps: stopping at a
stated reward, not at a hand-picked step, makes the starting point a rule. ``warm_start.json`` in the
output directory records the loss curve, every evaluation and the final reward.

The tokenizer is the built-in character vocabulary (``otb_train.tasks.CharTokenizer``: ids 0 pad, 1 EOS, then
``0-9 + = space``) as a ``PreTrainedTokenizerFast``, so ``train.py --model`` encodes prompts to the same ids.

The code is :mod:`otb_train.warm_start` (the drivers that need a warm start call it in-process); this file is its
command line.
"""

from otb_train.warm_start import EVAL_SEED_OFFSET, main, parse_args, sampled_reward, supervised_batch

__all__ = ["EVAL_SEED_OFFSET", "main", "parse_args", "sampled_reward", "supervised_batch"]

if __name__ == "__main__":
    main()
