"""otb_ref/estimators.py: the one estimator table, its resolution, and the population cells (THEORY §3)."""

import dataclasses

import pytest

from otb_ref.estimators import ESTIMATORS, Estimator, population_cells, resolve_estimator


def test_table_cells_are_frozen_and_resolution_copies():
    """A cell cannot be changed in place; flags given to resolve_estimator give a copy and leave the table as is."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        ESTIMATORS["otb"].leave_one_out = True
    resolved = resolve_estimator("otb", leave_one_out=True, std_normalize=True)
    assert (resolved.leave_one_out, resolved.std_normalize) == (True, True)
    assert (ESTIMATORS["otb"].leave_one_out, ESTIMATORS["otb"].std_normalize) == (False, False)


def test_population_cells_name_each_cell_once_by_its_first_estimator_with_flags_off():
    """Each (granularity, energy) cell of the table appears once, under the first name in ESTIMATORS that has it,
    with leave_one_out and std_normalize off (population baselines have neither)."""
    cells = population_cells()
    table_cells = {(e.granularity, e.energy) for e in ESTIMATORS.values()}
    assert {(c.granularity, c.energy) for c in cells.values()} == table_cells
    assert len(cells) == len(table_cells)
    names = list(ESTIMATORS)
    for name, cell in cells.items():
        first = next(
            n for n in names if (ESTIMATORS[n].granularity, ESTIMATORS[n].energy) == (cell.granularity, cell.energy)
        )
        assert name == first
        assert cell == Estimator(cell.granularity, cell.energy)
