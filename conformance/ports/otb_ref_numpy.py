"""``otb_ref.compute_advantages`` called with NumPy arrays: the library itself as a port the checker can load.

python conformance/check.py conformance/ports/otb_ref_numpy.py:compute_advantages
"""

from __future__ import annotations

import numpy as np
import torch

import otb_ref


def compute_advantages(estimator, token_level_rewards, response_mask, index, **inputs_and_options):
    """NumPy in, NumPy out: ``[B, T]`` and ``[B]`` arrays become tensors of the same dtype; ``index`` stays as given."""
    as_tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x  # noqa: E731
    arguments = {name: as_tensor(value) for name, value in inputs_and_options.items()}
    advantages, returns = otb_ref.compute_advantages(
        estimator,
        as_tensor(token_level_rewards),
        as_tensor(response_mask),
        list(np.asarray(index).tolist()),
        **arguments,
    )
    return advantages.numpy(), returns.numpy()
