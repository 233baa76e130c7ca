"""A port whose one bug is ``G`` in fp32 written in torch: ``flip(cumsum(flip(r)))`` on fp32 tensors, everything
else as the contract says (``conformance/ports/vector_port.py``). Needs torch.

    python conformance/check.py conformance/ports/bugs/torch_returns_fp32.py:compute_advantages

On CPU torch accumulates an fp32 ``cumsum`` in double and rounds each ``G_t`` to fp32 once, so this port passes
where the ``G_t`` are small beside the advantages; the cases with dense cancelling fp32 rewards (``|G_t|`` far
above ``|A|``, the long-T input among them) fail it. On CUDA the sum is fp32 throughout, and fails more.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch


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


def _returns_fp32(rewards: np.ndarray) -> np.ndarray:
    r = torch.from_numpy(np.ascontiguousarray(rewards, np.float32) if rewards.dtype == np.float32 else rewards)
    return r.flip(-1).cumsum(-1).flip(-1).numpy()


def compute_advantages(*args, **kwargs):
    return vector_port.compute_advantages(*args, returns_fn=_returns_fp32, **kwargs)
