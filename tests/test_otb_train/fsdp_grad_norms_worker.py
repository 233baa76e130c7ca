"""torchrun worker for tests/test_otb_train/test_energies.py: per-row norms on an FSDP2-sharded policy equal the
unsharded ones.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/test_otb_train/fsdp_grad_norms_worker.py OUT.json

Each rank computes ``otb_train.energies.sequence_norms`` on its own rows of one batch, with and without activation
checkpointing, tied and untied embeddings; rank 0 writes the gathered norms, the unsharded reference and
whether any parameter's ``.grad`` was set.
"""

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from otb_train import distributed
from otb_train.config import Config
from otb_train.energies import sequence_norms
from otb_train.model import Policy, build_model_and_tokenizer
from otb_train.rollout import position_ids_from_mask


def batch(vocab: int):
    gen = torch.Generator().manual_seed(0)
    rows, prompt, response = 8, 5, 6
    ids = torch.randint(2, vocab, (rows, prompt + response), generator=gen)
    attention = torch.ones(rows, prompt + response, dtype=torch.bool)
    attention[::2, :2] = False  # left padding on every other row
    mask = torch.ones(rows, response, dtype=torch.bool)
    mask[1::3, 4:] = False  # shorter responses
    attention[:, prompt:] = mask
    return ids, attention, position_ids_from_mask(attention), ids[:, prompt:], mask.double()


def main() -> None:
    env = distributed.init("cpu")
    results = {}
    for tied in (False, True):
        for checkpointing in (False, True):
            cfg = Config(hidden_size=32, num_layers=2)
            lm, _, _, _ = build_model_and_tokenizer(cfg)
            if tied:
                lm.lm_head.weight = lm.model.embed_tokens.weight
                lm.config.tie_word_embeddings = True
            lm = lm.double().eval()
            ids, attention, positions, response, mask = batch(lm.config.vocab_size)
            reference = sequence_norms(Policy(copy.deepcopy(lm), 1.0, None), ids, attention, positions, response, mask)
            layers = [m for m in lm.modules() if type(m).__name__ in lm._no_split_modules]
            policy = distributed.shard(
                Policy(lm, 1.0, None), layers, env, bf16=False, activation_checkpointing=checkpointing
            )
            rows = slice(env.rank * 4, env.rank * 4 + 4)
            mine = sequence_norms(policy, ids[rows], attention[rows], positions[rows], response[rows], mask[rows])
            gathered = [torch.zeros_like(mine) for _ in range(env.world_size)]
            dist.all_gather(gathered, mine)
            grads_set = any(p.grad is not None for p in policy.parameters())
            # an ordinary backward still works afterwards
            log_probs, _ = policy(ids[rows], attention[rows], positions[rows], targets=response[rows])
            (log_probs * mask[rows]).sum().backward()
            results[f"tied={tied},checkpointing={checkpointing}"] = {
                "sharded": torch.cat(gathered).tolist(),
                "reference": reference.tolist(),
                "grads_set": grads_set,
                "backward_after": all(p.grad is not None for p in policy.parameters()),
            }
    if env.is_main:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.barrier()  # rank 0 has written the results
    # No teardown: on a loaded 2-core machine gloo's threads can abort the process at exit or in
    # destroy_process_group ("terminate called without an active exception"), after the work is done.
    os._exit(0)


if __name__ == "__main__":
    main()
