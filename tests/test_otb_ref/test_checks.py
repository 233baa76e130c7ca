"""otb_ref/_checks.py: each check's documented rule, message and boundary (the validation rules of PORTING.md)."""

import numpy as np
import pytest
import torch

from otb_ref import _checks


def _partition(group: torch.Tensor) -> list[list[int]]:
    """Rows grouped by group number, as sets of row indices (numbering is not part of the contract)."""
    rows: dict[int, list[int]] = {}
    for row, g in enumerate(group.tolist()):
        rows.setdefault(g, []).append(row)
    return sorted(rows.values())


@pytest.mark.parametrize(
    "index",
    [
        torch.tensor([7, 3, 7, 9]),
        [7, 3, 7, 9],
        ("b", "a", "b", "c"),
        np.array([7, 3, 7, 9]),
        np.array(["b", "a", "b", "c"]),
        np.array([1, "a", 1, ("t", 2)], dtype=object),  # mixed ids: an object array is read as a list
    ],
)
def test_group_ids_give_equal_ids_one_group(index):
    group, num_groups = _checks.group_ids(index, 4, torch.device("cpu"))
    assert group.dtype == torch.long and num_groups == 3
    assert _partition(group) == [[0, 2], [1], [3]]


@pytest.mark.parametrize("index", [torch.tensor([1, 2]), [1, 2], np.array([1, 2]), np.array([1, 2, 3, 4])])
def test_group_ids_length_must_be_the_batch_size(index):
    with pytest.raises(ValueError, match=rf"^index: length {len(index)} != batch size 3"):
        _checks.group_ids(index, 3, torch.device("cpu"))


def test_group_ids_of_a_long_list_equal_to_the_batch():
    """Lengths are compared by value (a batch of 300 rows, beyond Python's small-int cache)."""
    group, num_groups = _checks.group_ids(list(range(150)) * 2, 300, torch.device("cpu"))
    assert num_groups == 150 and bool((group[:150] == group[150:]).all())


@pytest.mark.parametrize("index", [torch.tensor([], dtype=torch.long), [], np.array([], dtype=np.int64)])
def test_group_ids_of_an_empty_batch(index):
    group, num_groups = _checks.group_ids(index, 0, torch.device("cpu"))
    assert group.shape == (0,) and num_groups == 0


@pytest.mark.parametrize(
    "index, problem",
    [
        (np.array([1.0, 2.0]), "expected integer or string ids"),
        (np.array([[1, 2]]), "expected a 1-D array"),
        ([1.0, 2.0], "got a float"),
        (torch.tensor([1.0, 2.0]), "expected integer ids"),
        ({1: 2}, "expected a 1-D integer tensor"),
    ],
)
def test_group_ids_refuse_unreliable_keys(index, problem):
    with pytest.raises(ValueError, match=f"^index: .*{problem}"):
        _checks.group_ids(index, 2, torch.device("cpu"))


def test_messages_name_the_first_offending_entry():
    """Row-major first: the value and index a user sees are those of the first bad entry."""
    value = torch.tensor([[0.0, float("nan")], [float("inf"), 0.0]])
    with pytest.raises(ValueError, match=r"^x: non-finite value nan at index \(0, 1\)"):
        _checks.require_finite("x", value)
    with pytest.raises(ValueError, match=r"^mask: must contain only 0 and 1, found 2\.0"):
        _checks.binary_mask("mask", torch.tensor([[1.0, 2.0], [3.0, 0.0]]))
    with pytest.raises(ValueError, match=r"^w: value -1\.0 at index \(0, 1\) is outside \[0\.0, 1\.0\]"):
        _checks.require_in_range("w", torch.tensor([[0.5, -1.0], [-2.0, 0.5]]), 0.0, 1.0)


def test_range_bounds_are_inclusive_unless_said_otherwise():
    """``low <= value <= high`` by default; ``low < value`` with low_inclusive=False, shown as '(low, high]'."""
    _checks.require_in_range("w", torch.tensor([0.0, 1.0]), 0.0, 1.0)
    with pytest.raises(ValueError, match=r"^w: value 0\.0 at index \(0,\) is outside \(0\.0, 1\.0\] \(why\)"):
        _checks.require_in_range("w", torch.tensor([0.0, 1.0]), 0.0, 1.0, low_inclusive=False, rule="why")
    with pytest.raises(ValueError, match=r"is outside \[0\.0, 1\.0\]$"):
        _checks.require_in_range("w", torch.tensor([1.5]), 0.0, 1.0)


@pytest.mark.parametrize("check", [_checks.positive_scalar, _checks.nonnegative_scalar])
@pytest.mark.parametrize("value", [None, "two", [1.0]])
def test_scalars_that_are_not_numbers_are_named(check, value):
    with pytest.raises(ValueError, match="^epsilon: expected a"):
        check("epsilon", value)


@pytest.mark.parametrize(
    "index, problem",
    [
        (torch.tensor(3), "expected a 1-D tensor"),
        (torch.tensor([[1, 2, 3]]), "expected a 1-D tensor"),
        (torch.tensor([1, 2, 3, 4]), "length 4 != batch size 3"),
        (np.array(3), "expected a 1-D array"),
    ],
)
def test_group_ids_refuse_wrong_shapes(index, problem):
    with pytest.raises(ValueError, match=f"^index: {problem}"):
        _checks.group_ids(index, 3, torch.device("cpu"))


def test_group_ids_of_a_long_numpy_index_equal_to_the_batch():
    group, num_groups = _checks.group_ids(np.arange(300) % 150, 300, torch.device("cpu"))
    assert num_groups == 150 and bool((group[:150] == group[150:]).all())


def test_binary_mask_refuses_negative_entries():
    with pytest.raises(ValueError, match=r"^mask: must contain only 0 and 1, found -1\.0"):
        _checks.binary_mask("mask", torch.tensor([1.0, -1.0, 0.0]))


def test_exclusive_lower_bound_refuses_the_bound_and_below_and_accepts_above():
    values = torch.tensor([0.5, 1.0])
    _checks.require_in_range("eps", values, 0.0, 1.0, low_inclusive=False)
    for bad in (0.0, -0.5):
        with pytest.raises(ValueError, match=rf"^eps: value {bad} at index \(1,\) is outside \(0\.0, 1\.0\]"):
            _checks.require_in_range("eps", torch.tensor([0.5, bad]), 0.0, 1.0, low_inclusive=False)


def test_lm_batch_masks_accept_an_empty_sequence():
    """L = 0: no column 0 to check; both masks come back as empty bool tensors."""
    ids = torch.zeros(2, 0, dtype=torch.long)
    mask, attention = _checks.lm_batch_masks(ids, torch.zeros(2, 0), torch.ones(2, 0))
    assert mask.shape == attention.shape == (2, 0) and mask.dtype == attention.dtype == torch.bool


def test_token_ids_lie_in_zero_to_vocab():
    """``[0, V)``: 0 and V − 1 pass, −1 and V are refused with the argument's name and what the ids index; no ids
    at all pass."""
    _checks.require_token_ids("targets", torch.tensor([[0, 4], [2, 0]]), 5, "the rows of weight")
    _checks.require_token_ids("targets", torch.zeros(0, 3, dtype=torch.long), 5, "the rows of weight")
    for bad in (-1, 5, 9):
        with pytest.raises(ValueError, match=r"^targets: token ids must lie in \[0, 5\) \(the rows of weight\)$"):
            _checks.require_token_ids("targets", torch.tensor([0, bad, 4]), 5, "the rows of weight")
