"""Host synchronisations of compute_advantages, counted on CPU.

On a GPU every read of a device value by the host (``.item()``, ``bool()``,
``float()``, ``.tolist()``, ``nonzero``, ``unique``, boolean indexing) waits
for all queued work. The value checks are folded into one such read per row
block (accelerators use one block). On CPU nothing waits, but the same
operations run, so they can be counted: aten's scalar reads and
data-dependent-shape ops through a dispatch mode, ``Tensor.tolist`` by
wrapping it (it reads memory without dispatching).
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import otb_ref.advantages
from otb_ref import compute_advantages

# aten ops that read device data on the host (a sync on CUDA).
_SYNCING = {"_local_scalar_dense", "nonzero", "_unique2", "unique_consecutive", "unique_dim", "masked_select"}


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNCING or (
            name == "index"
            and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []))
        ):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _count(monkeypatch, fn) -> collections.Counter:
    counter = _CountSyncs()
    original = torch.Tensor.tolist

    def counting_tolist(self):
        counter.ops["tolist"] += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    with counter:
        fn()
    monkeypatch.setattr(torch.Tensor, "tolist", original)
    return counter.ops


def _batch(garbage_off_mask: bool = False):
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(12)[None, :] < torch.randint(1, 13, (8,), generator=g)[:, None]).float()
    rewards = torch.randn(8, 12, generator=g)
    log_probs = -torch.rand(8, 12, generator=g) - 0.01
    sum_pi_squared = torch.rand(8, 12, generator=g) * 0.5 + 0.25
    if garbage_off_mask:
        log_probs = log_probs.masked_fill(mask == 0, float("nan"))
    return rewards, mask, log_probs, sum_pi_squared


@pytest.mark.parametrize("estimator", ["otb", "grpo", "token_length", "sequence_proxy"])
def test_value_checks_take_one_host_read(monkeypatch, estimator):
    """Clean inputs: one read for every value check; a tensor index adds one (``unique``'s output size)."""
    rewards, mask, log_probs, sum_pi_squared = _batch()
    index = torch.arange(8) // 4
    run = lambda ids: compute_advantages(  # noqa: E731
        estimator,
        rewards,
        mask,
        ids,
        old_log_probs=log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=torch.ones(8, 12) if estimator == "token_length" else None,
    )
    as_list = index.tolist()
    assert _count(monkeypatch, lambda: run(as_list)) == {"tolist": 1}
    assert _count(monkeypatch, lambda: run(index)) == {"tolist": 1, "_unique2": 1}


def test_exact_energies_take_one_more_read_for_grad_norms(monkeypatch):
    rewards, mask, _, _ = _batch()
    index = [0] * 4 + [1] * 4
    ops = _count(monkeypatch, lambda: compute_advantages("eob", rewards, mask, index, grad_norms_sq=torch.ones(8)))
    assert ops == {"tolist": 2}
    ops = _count(
        monkeypatch, lambda: compute_advantages("otb_exact", rewards, mask, index, cumulative_energy=torch.ones(8, 12))
    )
    assert ops == {"tolist": 1}


@pytest.mark.parametrize(
    "estimator, name, garbage",
    [
        ("otb", "old_log_probs", float("nan")),
        ("otb", "token_level_rewards", float("inf")),
        ("otb", "sum_pi_squared", 0.0),
        ("otb", "rollout_is_weights", -1.0),
        ("token_length", "rollout_is_weights", float("nan")),
        ("otb_exact", "cumulative_energy", -1.0),
    ],
)
def test_garbage_off_the_mask_takes_a_second_read(monkeypatch, estimator, name, garbage):
    """Any value where the mask is 0 is legal; telling it apart costs one more read (still no per-value syncs): the
    second round's fill off the mask lies inside each input's range."""
    rewards, mask, log_probs, sum_pi_squared = _batch()
    inputs = dict(token_level_rewards=rewards, old_log_probs=log_probs, sum_pi_squared=sum_pi_squared)
    inputs |= dict(rollout_is_weights=torch.ones(8, 12), cumulative_energy=torch.ones(8, 12))
    inputs[name] = inputs[name].masked_fill(mask == 0, garbage)
    del inputs["cumulative_energy" if estimator != "otb_exact" else "rollout_is_weights"]
    if estimator == "otb_exact":
        del inputs["old_log_probs"], inputs["sum_pi_squared"]
    rewards = inputs.pop("token_level_rewards")
    ops = _count(monkeypatch, lambda: compute_advantages(estimator, rewards, mask, [0] * 8, **inputs))
    assert ops == {"tolist": 2}


def test_row_blocks_read_once_per_block(monkeypatch):
    """The CPU path reads per block of whole groups (data in cache), plus one read of the block plan; a group larger
    than a block is one block; accelerators have one block and no plan."""
    rewards, mask, log_probs, sum_pi_squared = _batch()
    monkeypatch.setattr(otb_ref.advantages, "_CPU_BLOCK_ELEMENTS", 12 * 2)  # 2 rows per block
    for index, blocks in [([0, 0, 1, 1, 2, 2, 3, 3], 4), ([0, 1, 0, 1, 2, 3, 2, 3], 4), ([0] * 8, 1)]:
        ops = _count(
            monkeypatch,
            lambda index=index: compute_advantages(
                "otb", rewards, mask, index, old_log_probs=log_probs, sum_pi_squared=sum_pi_squared
            ),
        )
        assert ops == {"tolist": blocks + 1}, index
