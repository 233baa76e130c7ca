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


def test_an_estimator_built_from_runtime_strings_is_the_tables():
    """Cells compare by value: an Estimator whose strings were built at run time (e.g. read from a config file, so
    not the same string objects as the table's) computes what the named estimator computes."""
    import torch

    from otb_ref import compute_advantages

    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(3, 2)
    energies = torch.tensor([[0.5, 1.5], [1.0, 1.2], [0.2, 0.9]], dtype=torch.float64)
    cases = [
        ("".join(["to", "ken"]), "otb_exact", dict(cumulative_energy=energies)),
        ("".join(["se", "quence"]), "eob", dict(grad_norms_sq=energies[:, -1])),
    ]
    for granularity, name, inputs in cases:
        spec = Estimator(granularity, "".join(["ex", "act"]))
        built, _ = compute_advantages(spec, rewards, mask, [0, 0, 0], epsilon=0.0, **inputs)
        named, _ = compute_advantages(name, rewards, mask, [0, 0, 0], epsilon=0.0, **inputs)
        torch.testing.assert_close(built, named, rtol=0, atol=0, msg=name)


def test_every_cell_built_from_runtime_strings_computes_the_named_estimator():
    """As above, for every estimator of the table, with every input given (each reads what its energy needs)."""
    import torch

    from otb_ref import compute_advantages

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    inputs = dict(
        old_log_probs=-torch.rand(6, 4, generator=g, dtype=torch.float64) * 2,
        sum_pi_squared=torch.rand(6, 4, generator=g, dtype=torch.float64) * 0.5 + 0.3,
        cumulative_energy=torch.rand(6, 4, generator=g, dtype=torch.float64).cumsum(-1),
        grad_norms_sq=torch.rand(6, generator=g, dtype=torch.float64) + 0.5,
    )
    for name, cell in ESTIMATORS.items():
        fresh = {field: "".join(list(getattr(cell, field))) for field in ("granularity", "energy")}  # equal, new
        built = dataclasses.replace(cell, **fresh)
        assert built == cell and built.energy is not cell.energy
        is_weights = (
            dict(rollout_is_weights=inputs["old_log_probs"].exp() + 0.5) if cell.energy in ("length", "proxy") else {}
        )
        for extra in [{}, is_weights]:
            got, _ = compute_advantages(built, rewards, mask, [0, 0, 0, 1, 1, 1], **inputs, **extra)
            want, _ = compute_advantages(name, rewards, mask, [0, 0, 0, 1, 1, 1], **inputs, **extra)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        if cell.granularity == "sequence":
            with pytest.raises(ValueError, match="^handle_zero_tail: applies to token-level"):
                compute_advantages(built, rewards, mask, [0, 0, 0, 1, 1, 1], **inputs, handle_zero_tail=True)


def test_derived_properties_of_each_cell():
    """inputs, per_token_energy and epsilon_applies, written out for every row of the table (THEORY §3): the
    energy inputs each cell reads, where IS weights scale per-token energies (§4), where ε applies."""
    want = {
        "grpo": ((), False, False),
        "rloo": ((), False, False),
        "opo": ((), True, False),
        "sequence_proxy": (("old_log_probs", "sum_pi_squared"), True, True),
        "eob": (("grad_norms_sq",), False, True),
        "token_mean": ((), False, False),
        "token_length": ((), True, False),
        "otb": (("old_log_probs", "sum_pi_squared"), True, True),
        "otb_exact": (("cumulative_energy",), False, True),
    }
    assert set(want) == set(ESTIMATORS)
    for name, spec in ESTIMATORS.items():
        assert (spec.inputs, spec.per_token_energy, spec.epsilon_applies) == want[name], name
        flagged = resolve_estimator(name, leave_one_out=True, std_normalize=True)
        assert (flagged.inputs, flagged.per_token_energy, flagged.epsilon_applies) == want[name], name


def test_derived_properties_leave_constructor_equality_and_hash_as_the_four_fields():
    assert [f.name for f in dataclasses.fields(Estimator)] == [
        "granularity",
        "energy",
        "leave_one_out",
        "std_normalize",
    ]
    built = Estimator("token", "proxy")
    assert built == ESTIMATORS["otb"] and hash(built) == hash(ESTIMATORS["otb"])
    assert repr(built) == "Estimator(granularity='token', energy='proxy', leave_one_out=False, std_normalize=False)"
    assert len({*ESTIMATORS.values(), built}) == len(ESTIMATORS)  # grpo and rloo differ by their flags only
