"""Input checks shared by the public functions.

Every check raises ``ValueError`` whose message starts with the argument's
name and says what is wrong. No check modifies its input.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The one precision rule of otb_ref: float64 if any input is float64, else float32 (never lower).

    bf16, fp16 and fp32 inputs are computed in fp32; fp64 stays fp64; ``None`` entries are skipped. The fast
    path's inputs (``advantages``, ``diagnostics``), the token energies and the LM heads' logits (``proxy``,
    ``grad_norms``) and the per-row norms' accumulators (``grad_norms``) take their dtype here; ``readable`` states
    the same rule for itself.
    """
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def require_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def require_shape(name: str, value: torch.Tensor, shape: tuple[int, ...], like: str) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)} does not match {like} {tuple(shape)}")


def require_device(name: str, value: torch.Tensor, device: torch.device, like: str) -> None:
    if value.device != device:
        raise ValueError(f"{name}: on device {value.device}, but {like} is on {device}")


def require_token_ids(name: str, ids: torch.Tensor, vocab: int, rows_of: str) -> None:
    """Every entry of the integer tensor ``ids`` lies in ``[0, vocab)``; ``rows_of`` names what the ids index (one
    host read)."""
    if ids.numel():
        low, high = torch.stack(torch.aminmax(ids)).tolist()
        if low < 0 or high >= vocab:
            raise ValueError(f"{name}: token ids must lie in [0, {vocab}) ({rows_of})")


def binary_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as bool after checking that every entry is 0 or 1."""
    require_tensor(name, mask)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{name}: expected 0/1 entries, got complex dtype {mask.dtype}")
    is_binary = (mask == 0) | (mask == 1)
    if not bool(is_binary.all()):
        bad = mask[~is_binary].flatten()[0].item()
        raise ValueError(f"{name}: must contain only 0 and 1, found {bad!r}")
    return mask != 0


def require_finite(name: str, value: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """All entries finite (only those where ``where`` is True, if given)."""
    bad = ~torch.isfinite(value)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: non-finite value {value[position].item()!r} at index {position}")


def require_in_range(
    name: str,
    value: torch.Tensor,
    low: float,
    high: float,
    where: torch.Tensor | None = None,
    low_inclusive: bool = True,
    rule: str | None = None,
) -> None:
    """``low <= value <= high`` (or ``low < value`` when not ``low_inclusive``)."""
    too_low = value < low if low_inclusive else value <= low
    bad = too_low | (value > high)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        position = tuple(int(i) for i in bad.nonzero()[0])
        interval = f"{'[' if low_inclusive else '('}{low}, {high}]"
        raise ValueError(
            f"{name}: value {value[position].item()!r} at index {position} is outside "
            f"{interval}{'' if rule is None else ' (' + rule + ')'}"
        )


def positive_scalar(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a positive number, got {value!r}") from None
    if not (np.isfinite(number) and number > 0):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return number


def nonnegative_scalar(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a non-negative number, got {value!r}") from None
    if not (np.isfinite(number) and number >= 0):
        raise ValueError(f"{name}: expected a non-negative finite number, got {value!r}")
    return number


def group_ids(index: Any, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map prompt ids to dense group numbers.

    ``index`` is a 1-D integer tensor, a numpy array, or a list/tuple of
    hashable ids (strings included). Returns ``(group [B] int64, num_groups)``;
    rows with equal ids get equal group numbers.
    """
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index: expected a 1-D tensor, got shape {tuple(index.shape)}")
        if index.is_floating_point() or index.is_complex():
            raise ValueError(f"index: expected integer ids, got dtype {index.dtype}")
        if index.shape[0] != batch_size:
            raise ValueError(f"index: length {index.shape[0]} != batch size {batch_size}")
        ids, group = torch.unique(index.to(device), return_inverse=True)  # one sync on GPUs (the output's size)
        return group.long(), ids.numel()
    if isinstance(index, (list, tuple)):
        if len(index) != batch_size:
            raise ValueError(f"index: length {len(index)} != batch size {batch_size}")
        if any(isinstance(key, float) for key in index):
            raise ValueError("index: expected integer or string ids, got a float (floats make unreliable group keys)")
        first_seen: dict[Any, int] = {}
        try:
            numbers = [first_seen.setdefault(key, len(first_seen)) for key in index]
        except TypeError as error:
            raise ValueError(f"index: ids must be hashable ({error})") from None
        return torch.tensor(numbers, dtype=torch.long, device=device), len(first_seen)
    if isinstance(index, np.ndarray):
        if index.ndim != 1:
            raise ValueError(f"index: expected a 1-D array, got shape {index.shape}")
        if index.shape[0] != batch_size:
            raise ValueError(f"index: length {index.shape[0]} != batch size {batch_size}")
        if index.dtype.kind == "f":
            raise ValueError(f"index: expected integer or string ids, got dtype {index.dtype}")
        if index.dtype.kind == "O":
            return group_ids(index.tolist(), batch_size, device)
        _, inverse = np.unique(index, return_inverse=True)
        num_groups = int(inverse.max()) + 1 if batch_size else 0
        return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device), num_groups
    raise ValueError(
        f"index: expected a 1-D integer tensor, a numpy array or a list of ids, got {type(index).__name__}"
    )


def lm_batch_masks(
    input_ids: torch.Tensor, response_mask: Any, attention_mask: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(response mask, attention mask or None)`` as bool ``[B, L]`` for a causal-LM batch ``input_ids [B, L]``.

    Both masks must match ``input_ids`` in shape and device and be 0/1; the response mask's column 0 must be 0
    (token 0 has no position that predicts it).
    """
    require_tensor("response_mask", response_mask)
    if tuple(response_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"response_mask: shape {tuple(response_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    require_device("response_mask", response_mask, input_ids.device, "input_ids")
    mask = binary_mask("response_mask", response_mask)  # [B, L] bool
    if mask.shape[1] and bool(mask[:, 0].any()):
        raise ValueError("response_mask: column 0 must be 0 (token 0 has no position that predicts it)")
    if attention_mask is None:
        return mask, None
    require_tensor("attention_mask", attention_mask)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask: shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    require_device("attention_mask", attention_mask, input_ids.device, "input_ids")
    return mask, binary_mask("attention_mask", attention_mask)  # [B, L] bool
