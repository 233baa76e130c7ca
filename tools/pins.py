"""Pins of the advantage code's behaviour, bit for bit: a refactoring of otb_ref.advantages, otb_ref.readable or the
validation must leave every hash printed here unchanged.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/pins.py            # print the hashes (-v: the messages too)
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/pins.py --check    # exit 1 unless they equal tools/pins.txt

tools/pins.txt holds the hashes recorded at main's eeb8f34 (before issue 40's items 1-2), on the 2-core CPU box
with torch 2.13.0 CPU; "several blocks" (and "all") re-recorded after fe7e35a, whose sequence blocks hold 2^19
elements: that batch (176,000 elements) is now one sequence block, its group sums taken in another order, so
sequence estimators' fp64 outputs moved by rounding (at most 4.3e-16 relative, on ~5% of entries; every fp32
output and every token estimator's output bit for bit as before).

Hashes (sha256 of the outputs' dtypes, shapes and bytes, in a fixed order) of:

* ``compute_advantages``: every estimator × leave_one_out × std_normalize × (token level) multi_turn ×
  handle_zero_tail × (length and proxy energies) IS weights × fp32/fp64, on seeded batches with holes, empty
  rows, groups of one and NaN off the mask; the same on a batch of several CPU blocks (groups as runs of rows and
  interleaved); the two verl interfaces;
* ``readable.advantages`` on the same cases, and ``readable.otb_advantages``;
* the messages of a set of bad inputs (one line each), which must all raise ValueError.

Prints one line per part and the hash of all parts. Machine-independent on one torch build and CPU family
(torch's vectorised CPU kernels may round differently across instruction sets).
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from pathlib import Path

import torch

from otb_ref import ESTIMATORS, compute_advantages, readable
from otb_ref.advantages import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)

PINS = Path(__file__).with_name("pins.txt")


def _batch(seed: int, batch_size: int, length: int, group_size: int, interleave: bool, dtype: torch.dtype) -> dict:
    """Seeded inputs: groups of ``group_size`` (the last one smaller), holes, an empty row, NaN off the mask."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch_size, length, generator=gen) < 0.8).double()
    lengths = torch.randint(0, length + 1, (batch_size,), generator=gen)
    mask = mask * (torch.arange(length)[None, :] < lengths[:, None])
    mask[0] = 0.0  # an empty response
    index = [i // group_size for i in range(batch_size)]
    if interleave:
        index = [i % max(1, batch_size // group_size) for i in range(batch_size)]
    rewards = torch.randn(batch_size, length, generator=gen, dtype=torch.float64)
    logits = torch.randn(batch_size, length, 7, generator=gen, dtype=torch.float64) * 2.0
    log_pi = logits.log_softmax(-1)
    old_log_probs = log_pi[..., 0]
    sum_pi_squared = log_pi.exp().square().sum(-1)
    cumulative_energy = torch.rand(batch_size, length, generator=gen, dtype=torch.float64).cumsum(-1)
    grad_norms_sq = torch.rand(batch_size, generator=gen, dtype=torch.float64) * 3.0
    rollout_is_weights = torch.rand(batch_size, length, generator=gen, dtype=torch.float64) * 2.0
    off = mask == 0
    for x in (rewards, old_log_probs, sum_pi_squared, cumulative_energy, rollout_is_weights):
        x[off & (torch.rand(batch_size, length, generator=gen) < 0.3)] = float("nan")  # ignored off the mask
    values = dict(
        token_level_rewards=rewards,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        cumulative_energy=cumulative_energy,
        grad_norms_sq=grad_norms_sq,
        rollout_is_weights=rollout_is_weights,
    )
    return dict(mask=mask, index=index, **{name: x.to(dtype) for name, x in values.items()})


def _inputs(name: str, batch: dict, with_is: bool) -> dict:
    spec = ESTIMATORS[name]
    named = {}
    if spec.energy == "proxy":
        named.update(old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"])
    if spec.energy == "exact":
        key = "grad_norms_sq" if spec.granularity == "sequence" else "cumulative_energy"
        named[key] = batch[key]
    if with_is:
        named["rollout_is_weights"] = batch["rollout_is_weights"]
    return named


def _cases():
    """``(name, flags)`` of every estimator × option."""
    for name, spec in ESTIMATORS.items():
        token = spec.granularity == "token"
        for loo, std, multi, tail, with_is in itertools.product(*[(False, True)] * 5):
            if (multi or tail) and not token:
                continue
            if with_is and spec.energy not in ("length", "proxy"):
                continue
            flags = dict(leave_one_out=loo, std_normalize=std)
            if token:
                flags.update(multi_turn=multi, handle_zero_tail=tail)
            yield name, flags, with_is


class _Hash:
    def __init__(self):
        self.sha = hashlib.sha256()
        self.count = 0

    def tensor(self, x: torch.Tensor) -> None:
        self.sha.update(f"{x.dtype}{tuple(x.shape)}".encode())
        self.sha.update(x.detach().contiguous().numpy().tobytes())
        self.count += 1

    def text(self, s: str) -> None:
        self.sha.update(s.encode() + b"\n")
        self.count += 1


def _run(function, name, batch, flags, with_is, out: _Hash) -> None:
    adv, ret = function(
        name,
        batch["token_level_rewards"],
        batch["mask"],
        batch["index"],
        **_inputs(name, batch, with_is),
        **flags,
    )
    out.tensor(adv)
    out.tensor(ret)


def _small_batches():
    for dtype in (torch.float32, torch.float64):
        yield _batch(1, 11, 7, 3, False, dtype)
        yield _batch(2, 12, 6, 4, True, dtype)


def pin_fast() -> _Hash:
    out = _Hash()
    for batch in _small_batches():
        for name, flags, with_is in _cases():
            _run(compute_advantages, name, batch, flags, with_is, out)
    return out


def pin_fast_blocks() -> _Hash:
    """Batches of several CPU blocks (2^17 elements a block): runs of rows, and interleaved groups."""
    out = _Hash()
    for dtype, interleave in itertools.product((torch.float32, torch.float64), (False, True)):
        batch = _batch(3, 1100, 160, 5, interleave, dtype)
        for name, spec in ESTIMATORS.items():
            flags = [dict(), dict(leave_one_out=True, std_normalize=True)]
            if spec.granularity == "token":
                flags.append(dict(multi_turn=True, handle_zero_tail=True, leave_one_out=True))
            for flag in flags:
                _run(compute_advantages, name, batch, flag, spec.energy in ("length", "proxy"), out)
    return out


def pin_verl() -> _Hash:
    out = _Hash()
    for batch in _small_batches():
        args = (batch["token_level_rewards"], batch["mask"], batch["index"], batch["old_log_probs"])
        for function in (compute_optimal_token_baseline_advantage, compute_multi_turn_optimal_token_baseline_advantage):
            for rho in (None, batch["rollout_is_weights"]):
                for tensor in function(*args, batch["sum_pi_squared"], rollout_is_weights=rho):
                    out.tensor(tensor)
    return out


def pin_readable() -> _Hash:
    out = _Hash()
    for batch in _small_batches():
        for name, flags, with_is in _cases():
            _run(readable.advantages, name, batch, flags, with_is, out)
        for loo in (False, True):
            out.tensor(
                readable.otb_advantages(
                    batch["token_level_rewards"],
                    batch["mask"],
                    batch["index"],
                    batch["old_log_probs"],
                    batch["sum_pi_squared"],
                    leave_one_out=loo,
                )
            )
    return out


def _bad_inputs():
    """``(what, estimator, overrides of the good call)``: each must raise ValueError."""
    b = _batch(4, 6, 5, 3, False, torch.float64)
    r, m = b["token_level_rewards"], b["mask"]
    lp, s = b["old_log_probs"], b["sum_pi_squared"]
    on = (m != 0).nonzero()[0].tolist()  # a position on the mask

    def at(x, value):
        y = x.clone()
        y[tuple(on)] = value
        return y

    big = _batch(5, 1100, 160, 5, False, torch.float64)
    big_on = (big["mask"][900] != 0).nonzero()[0].item()
    big_bad = big["old_log_probs"].clone()
    big_bad[900, big_on] = 0.5
    yield "unknown estimator", "nope", {}
    yield "rewards not a tensor", "grpo", dict(token_level_rewards=r.tolist())
    yield "rewards 3-D", "grpo", dict(token_level_rewards=r[None])
    yield "rewards complex", "grpo", dict(token_level_rewards=r.to(torch.complex128))
    yield "mask not a tensor", "grpo", dict(mask=m.tolist())
    yield "mask shape", "grpo", dict(mask=m[:, :-1])
    yield "mask complex", "grpo", dict(mask=m.to(torch.complex128))
    yield "mask not binary", "grpo", dict(mask=at(m, 0.5))
    yield "mask int 2", "grpo", dict(mask=at(m.long(), 2))
    yield "reward NaN on the mask", "grpo", dict(token_level_rewards=at(r, float("nan")))
    yield (
        "reward inf on the mask",
        "otb",
        dict(token_level_rewards=at(r, float("inf")), old_log_probs=lp, sum_pi_squared=s),
    )
    yield "missing old_log_probs", "otb", dict(sum_pi_squared=s)
    yield "missing sum_pi_squared", "sequence_proxy", dict(old_log_probs=lp)
    yield "missing grad_norms_sq", "eob", {}
    yield "missing cumulative_energy", "otb_exact", {}
    yield "log-prob above 0", "otb", dict(old_log_probs=at(lp, 0.1), sum_pi_squared=s)
    yield "log-prob NaN", "otb", dict(old_log_probs=at(lp, float("nan")), sum_pi_squared=s)
    yield "Σπ² above 1", "otb", dict(old_log_probs=lp, sum_pi_squared=at(s, 1.5))
    yield "Σπ² zero", "otb", dict(old_log_probs=lp, sum_pi_squared=at(s, 0.0))
    yield "old_log_probs int", "otb", dict(old_log_probs=lp.long(), sum_pi_squared=s)
    yield "old_log_probs shape", "otb", dict(old_log_probs=lp[:-1], sum_pi_squared=s)
    yield "cumulative_energy negative", "otb_exact", dict(cumulative_energy=at(b["cumulative_energy"], -1.0))
    yield "grad_norms_sq negative", "eob", dict(grad_norms_sq=torch.tensor([1.0, -1, 1, 1, 1, 1]).double())
    yield "grad_norms_sq NaN", "eob", dict(grad_norms_sq=torch.tensor([1.0, float("nan"), 1, 1, 1, 1]).double())
    yield "grad_norms_sq shape", "eob", dict(grad_norms_sq=torch.ones(5).double())
    yield "grad_norms_sq int", "eob", dict(grad_norms_sq=torch.ones(6, dtype=torch.long))
    yield "IS weights negative", "otb", dict(old_log_probs=lp, sum_pi_squared=s, rollout_is_weights=at(m, -1.0))
    yield "IS weights huge", "opo", dict(rollout_is_weights=at(m, 1e200))
    yield "IS weights with uniform", "grpo", dict(rollout_is_weights=m)
    yield "IS weights with exact", "otb_exact", dict(cumulative_energy=b["cumulative_energy"], rollout_is_weights=m)
    yield "multi_turn on sequence", "grpo", dict(multi_turn=True)
    yield "handle_zero_tail on sequence", "opo", dict(handle_zero_tail=True)
    yield "index length", "grpo", dict(index=[0, 1])
    yield "index floats", "grpo", dict(index=[0.0] * 6)
    yield "index 2-D tensor", "grpo", dict(index=torch.zeros(6, 1, dtype=torch.long))
    yield "index float tensor", "grpo", dict(index=torch.zeros(6))
    yield "index unhashable", "grpo", dict(index=[[0]] * 6)
    yield "index a set", "grpo", dict(index={0, 1})
    yield "epsilon negative", "otb", dict(old_log_probs=lp, sum_pi_squared=s, epsilon=-1.0)
    yield "epsilon text", "otb", dict(old_log_probs=lp, sum_pi_squared=s, epsilon="x")
    yield (
        "log-prob above 0 in a later block",
        "otb",
        dict(
            token_level_rewards=big["token_level_rewards"],
            mask=big["mask"],
            index=big["index"],
            old_log_probs=big_bad,
            sum_pi_squared=big["sum_pi_squared"],
        ),
    )


def pin_errors() -> tuple[_Hash, list[str]]:
    out, lines = _Hash(), []
    good = _batch(4, 6, 5, 3, False, torch.float64)
    for what, name, overrides in _bad_inputs():
        call = dict(token_level_rewards=good["token_level_rewards"], mask=good["mask"], index=good["index"])
        call.update(overrides)
        rewards, mask, index = call.pop("token_level_rewards"), call.pop("mask"), call.pop("index")
        try:
            compute_advantages(name, rewards, mask, index, **call)
        except ValueError as error:
            message = str(error)
        else:
            message = "NO ERROR"
        lines.append(f"{what}: {message}")
        out.text(lines[-1])
    return out, lines


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    parts = {
        "compute_advantages": pin_fast(),
        "compute_advantages, several blocks": pin_fast_blocks(),
        "verl interfaces": pin_verl(),
        "readable": pin_readable(),
    }
    errors, lines = pin_errors()
    parts["error messages"] = errors
    total = hashlib.sha256()
    for what, h in parts.items():
        digest = h.sha.hexdigest()
        total.update(digest.encode())
        print(f"{digest[:16]}  {h.count:5d} items  {what}")
    print(f"{total.hexdigest()[:16]}  all")
    if "-v" in argv:
        print("\n".join(lines))
    if any(line.endswith("NO ERROR") for line in lines):
        return 1
    if "--check" in argv:
        want = [line.split()[0] for line in PINS.read_text().splitlines() if line.strip()]
        got = [h.sha.hexdigest()[:16] for h in parts.values()] + [total.hexdigest()[:16]]
        print("pins hold" if got == want else f"PINS DIFFER from {PINS.name}")
        return int(got != want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
