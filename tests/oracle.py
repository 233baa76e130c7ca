"""The tests' independent oracle: ``conformance/ports/numpy_port.py`` (plain NumPy loops over groups, rows and
positions, torch-free, written from THEORY §3) called on torch tensors.

``direct=True``: leave-one-out sums are formed over the others, not as otb_ref's "group total minus own term",
so the oracle shares no rounding rule with the code under test. The conformance vectors' expected values are
otb_ref's own (conformance/generate.py); this oracle is what the tests compare otb_ref against.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

_PATH = Path(__file__).resolve().parents[1] / "conformance" / "ports" / "numpy_port.py"
_spec = importlib.util.spec_from_file_location("numpy_port", _PATH)
numpy_port = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numpy_port)


def oracle_advantages(estimator: str, rewards, mask, index, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of ``numpy_port.compute_advantages`` as torch tensors (its dtype: the compute
    dtype of the inputs, fp64 for fp64 inputs). Tensors are handed over as NumPy arrays, ``None`` as is."""
    as_numpy = lambda x: x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x  # noqa: E731
    arrays = {name: as_numpy(x) for name, x in inputs.items()}
    index = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    adv, ret = numpy_port.compute_advantages(
        estimator, as_numpy(rewards), as_numpy(mask), np.asarray(index), direct=True, **arrays
    )
    return torch.from_numpy(np.ascontiguousarray(adv)), torch.from_numpy(np.ascontiguousarray(ret))
