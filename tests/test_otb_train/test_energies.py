"""otb_train.energies: the trainer's per-response ||S||² (otb_ref.grad_norms through the policy) equal the exact
per-row gradients, on left-padded rows and on an FSDP2-sharded policy (2 ranks)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from otb_train.config import Config
from otb_train.energies import exact_energies, sequence_norms
from otb_train.model import Policy, build_model_and_tokenizer
from otb_train.rollout import position_ids_from_mask

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_sequence_norms_equal_exact_on_left_padded_rows():
    """sequence_norms (policy forward, positions from the mask) == otb_ref.exact on each unpadded row."""
    lm, _, _, _ = build_model_and_tokenizer(Config(hidden_size=32, num_layers=1))
    lm = lm.double()
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(2, lm.config.vocab_size, (4, 9), generator=gen)
    attention = torch.ones(4, 9, dtype=torch.bool)
    attention[1, :2] = False
    attention[3, :1] = False
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2, 3:] = False
    attention[:, 4:] = mask
    positions = position_ids_from_mask(attention)
    policy = Policy(lm, 1.0, None)
    got = sequence_norms(policy, ids, attention, positions, ids[:, 4:], mask.double())
    expected = exact_energies("eob", lm, ids, attention, mask, 1.0)["grad_norms_sq"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_fsdp2_two_ranks_with_and_without_activation_checkpointing(tmp_path):
    """torchrun, 2 gloo ranks: each rank's rows of a sharded policy give the unsharded norms; no .grad set."""
    out = tmp_path / "fsdp.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).with_name("fsdp_grad_norms_worker.py")),
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 4
    for case, result in results.items():
        torch.testing.assert_close(
            torch.tensor(result["sharded"]), torch.tensor(result["reference"]), rtol=1e-6, atol=0, msg=case
        )
        assert not result["grads_set"] and result["backward_after"], case
