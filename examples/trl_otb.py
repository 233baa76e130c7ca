"""OTB inside TRL's GRPOTrainer: ``OTBGRPOTrainer`` on a tiny model (CPU, seconds) or on your checkpoint.

    python examples/trl_otb.py                                   # tiny Qwen2 built here, synthetic prompts, CPU
    python examples/trl_otb.py --estimator grpo                  # TRL's own advantages, through the same class
    python examples/trl_otb.py --model PATH --data FILE.jsonl    # a real checkpoint; FILE has {"prompt", "answer"}

Needs ``pip install -e ".[trl]"``. The reward is 1 when the completion contains the prompt's answer word, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from otb_train.model import load_tokenizer  # the tokenizer-loading rule of train.py

WORDS = [f"w{i}" for i in range(24)]


def tiny_model_and_tokenizer(seed: int = 0, hidden: int = 32, layers: int = 2):
    """A random 2-layer Qwen2 and a whitespace word-level tokenizer over :data:`WORDS` (no download)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *WORDS, "say", "answer"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")  # fmt: skip
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    return Qwen2ForCausalLM(config), tokenizer


def synthetic_dataset(rows: int = 64, seed: int = 0):
    """Prompts ``say wA wB answer`` whose answer word is ``wA``: a task a random policy solves now and then."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [rng.sample(WORDS, 2) for _ in range(rows)]
    return Dataset.from_list([{"prompt": f"say {a} {b} answer", "answer": a} for a, b in pairs])


def contains_answer(completions, answer, **kwargs):
    """TRL reward function: 1.0 when the completion contains the answer word."""
    return [float(word in completion.split()) for completion, word in zip(completions, answer)]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimator", default="otb", help="a name of otb_ref.ESTIMATORS without gradient norms")
    parser.add_argument("--leave-one-out", action="store_true")
    parser.add_argument("--model", help="a local causal-LM checkpoint (default: a tiny Qwen2 built here)")
    parser.add_argument("--data", help="JSONL with 'prompt' and 'answer' (default: synthetic prompts)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--output-dir", default="runs/trl_otb")
    args = parser.parse_args(argv)
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data: no such file: {args.data}")
    if args.steps < 1:
        parser.error("--steps: must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from otb_ref.integrations.trl import OTBGRPOTrainer

    if args.model:
        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), load_tokenizer(args.model)
    else:
        model, tokenizer = tiny_model_and_tokenizer()
    if args.data:
        dataset = Dataset.from_list([json.loads(line) for line in Path(args.data).read_text().splitlines() if line])
    else:
        dataset = synthetic_dataset()
    config = GRPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length, max_steps=args.steps,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = OTBGRPOTrainer(
        model=model, reward_funcs=contains_answer, args=config, train_dataset=dataset, processing_class=tokenizer,
        estimator=args.estimator, leave_one_out=args.leave_one_out or None,
    )  # fmt: skip
    trainer.train()
    for record in trainer.state.log_history:
        if "reward" in record:
            print(json.dumps({key: record[key] for key in ("step", "reward", "grad_norm", "loss") if key in record}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
