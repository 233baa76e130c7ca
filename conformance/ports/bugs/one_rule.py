"""Ports that break exactly one rule of the porting contract each: ``conformance/ports/vector_port.py`` with one
plausible misreading of docs/PORTING.md. The conformance vectors tag a case with a rule when that rule's port
fails it, and tests/test_conformance.py checks that every rule has a port here that fails some case.

    python conformance/check.py conformance/ports/bugs/one_rule.py:clamp          # any name of RULES

    python conformance/check.py conformance/ports/bugs/one_rule.py:torch_returns_fp32   # needs torch

``torch_returns_fp32`` is a second port for ``precision_G``: ``G`` by torch's fp32 ``flip(cumsum(flip(r)))``,
everything else as the contract says. On CPU torch accumulates an fp32 ``cumsum`` in double and rounds each ``G_t``
to fp32 once, so it passes where the ``G_t`` are small beside the advantages; the cases with dense cancelling fp32
rewards (``|G_t|`` far above ``|A|``, the long-T input among them) fail it. On CUDA the sum is fp32 throughout.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path


def _port_beside(name: str):
    """``conformance/ports/<name>.py``, loaded by its path (a port is a file, not a package; :mod:`check` loads this
    one the same way), or the module of that name already loaded."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


vector_port = _port_beside("vector_port")

RULES = {  # rule: (PORTING checklist item, what the port does instead)
    "clamp": (1, "w_t = (1 − 2π) + Σπ² unclamped"),
    "is_squared": (1, "per-token energy times ρ̄_t, not ρ̄_t²"),
    "is_after_clamp": (1, "clamp(w_t ρ̄_t²) instead of clamp(w_t) ρ̄_t²"),
    "precision_G": (2, "G_t accumulated in the compute dtype, from the end, one token at a time"),
    "returns": (2, "sequence estimators return G_t, not R m_t"),
    "epsilon": (3, "verl's Σ a G / (Σ a + ε) (0 where the denominator is 0): no ε Ḡ in the numerator"),
    "epsilon_counts": (3, "the baseline's ε also for counts (uniform, length)"),
    "epsilon_is_lengths": (3, "the baseline's ε for ρ̄²-weighted lengths (length energy with IS weights)"),
    "group_of_one": (3, "a group of one response gets its own (include-self) baseline"),
    "loo_alone": (3, "a leave-one-out row with no other member alive at its coordinate gets B = its own G"),
    "zero_tail_start": (3, "the zero tail starts after the second-longest length (>), not at it (≥)"),
    "std_epsilon": (4, "std scaling divides by σ + 0 for counts (ε = 0 read from item 3)"),
    "std_pooled": (4, "σ of every alive G_t of the group together, not pooled within positions"),
    "std_unbiased": (4, "σ with n, not n − 1 (population std)"),
    "zero_spread": (4, "std scaling also divides groups whose centred values are all equal"),
    "precision_W": (5, "W_t accumulated in the compute dtype, one token at a time"),
    "precision_v": (5, "v accumulated in the compute dtype, one token at a time"),
    "precision_sigma": (5, "σ's means, squared deviations and sums in the compute dtype"),
    "precision_G_minus_B": (5, "G and B rounded to the compute dtype and subtracted there"),
    "precision_group_sums": (
        5,
        "group sums (Σ a G, Σ a, Σ G, n), leave-one-out differences and B in the compute dtype",
    ),
    "mask_dtype": (5, "the mask's dtype counts toward the compute dtype (an fp64 mask makes fp32 inputs fp64)"),
    "output_dtype": (5, "advantages and returns left in fp64, not rounded to the compute dtype"),
    "groups": (6, "a group is a run of equal neighbouring ids, not every row with that id"),
    "empty_responses": (6, "empty responses take no part in their group without multi_turn too"),
    "multi_turn_ranks": (3, "multi_turn aligns by absolute position, not by generated-token rank"),
    "off_mask": (7, "inputs multiplied by the mask (x · 0 = NaN for NaN and ±Inf) instead of replaced"),
    "defaults": (9, "an omitted leave_one_out or std_normalize is off (the estimator's own flags ignored)"),
    "default_epsilon": (9, "an omitted epsilon is 0, not 1e-8"),
}


# Rules the vectors cannot check, each with its port (which passes every case) and the reason.
UNCHECKED = {
    "w_dtype": (
        5,
        "w_t evaluated in fp64 from fp32 inputs",
        "it moves w_t by π(y)'s fp32 rounding (half an ulp at most), less than fp32 exps differ among themselves: "
        "NumPy 2.4.6's fp32 exp is up to 2.2 ulps off and differs from the correctly rounded value in 42-52% of "
        "draws (AMD EPYC; python conformance/exp_ulps.py, conformance/records/exp_ulps.jsonl), so no well-posed "
        "case tells fp64 w from another fp32 exp",
    ),
}


def port(rule: str):
    """The port that breaks ``rule``: called like ``compute_advantages``."""
    if rule not in RULES and rule not in UNCHECKED:
        raise ValueError(f"rule: one of {sorted(RULES) + sorted(UNCHECKED)}, got {rule!r}")
    return functools.partial(vector_port.compute_advantages, bug=rule)


for _rule in [*RULES, *UNCHECKED]:  # one module-level function per rule, for ``check.py one_rule.py:RULE``
    globals()[_rule] = port(_rule)


def _returns_fp32(rewards):
    """``G`` [B, T] by torch: fp32 rewards summed from the end by an fp32 ``cumsum`` (fp64 rewards as they are)."""
    import numpy as np
    import torch  # only this port needs it: the others, and check.py, run without torch

    r = torch.from_numpy(np.ascontiguousarray(rewards, np.float32) if rewards.dtype == np.float32 else rewards)
    return r.flip(-1).cumsum(-1).flip(-1).numpy()


def torch_returns_fp32(*args, **kwargs):
    """The port whose one bug is ``G`` in fp32 written in torch (see the module's docstring)."""
    return vector_port.compute_advantages(*args, returns_fn=_returns_fp32, **kwargs)
