"""The estimator table (THEORY §3): one table for compute_advantages, otb_ref.readable and otb_ref.exact.

Every estimator is a cell of granularity × energy, plus two flags:

    =========  ============================  ===============================
    energy     granularity "sequence"        granularity "token"
    =========  ============================  ===============================
    uniform    grpo (std), rloo (loo)        token_mean
    length     opo                           token_length
    proxy      sequence_proxy                otb (the paper)
    exact      eob (F3)                      otb_exact
    =========  ============================  ===============================

``leave_one_out`` builds each response's baseline from the others (unbiased, F7); ``std_normalize`` divides by
the group's std of what the baseline centres (``R``, or ``G_t`` pooled within positions; GRPO's scaling; biased,
F7, THEORY §3). Both concern finite groups: at population level (otb_ref.exact) a
cell's baseline is the same with or without them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GRANULARITIES", "ENERGIES", "Estimator", "ESTIMATORS", "resolve_estimator", "population_cells"]

GRANULARITIES = ("sequence", "token")
ENERGIES = ("uniform", "length", "proxy", "exact")


@dataclass(frozen=True)
class Estimator:
    """One cell of the estimator table (THEORY §3) with its flags. Frozen: the one table serves compute_advantages,
    the integrations and the exact module, so no caller can change a cell (:func:`resolve_estimator` copies)."""

    granularity: str
    energy: str
    leave_one_out: bool = False
    std_normalize: bool = False

    # Derived from the cell (properties: the constructor, equality and hash are the four fields').

    @property
    def inputs(self) -> tuple[str, ...]:
        """The energy inputs the cell needs beside rewards and mask: ``old_log_probs`` and ``sum_pi_squared``
        (proxy), ``grad_norms_sq`` (sequence exact: ``‖S‖²``), ``cumulative_energy`` (token exact: ``‖S_t‖²``)."""
        if self.energy == "proxy":
            return ("old_log_probs", "sum_pi_squared")
        if self.energy == "exact":
            return ("grad_norms_sq",) if self.granularity == "sequence" else ("cumulative_energy",)
        return ()

    @property
    def per_token_energy(self) -> bool:
        """Whether the weights are sums of per-token energies ``w_t`` (length, proxy): what rollout IS weights
        scale by ``ρ̄_t²`` (§4). Uniform weights are counts; exact ones are given whole (``‖S‖²``, ``‖S_t‖²``)."""
        return self.energy in ("length", "proxy")

    @property
    def epsilon_applies(self) -> bool:
        """Whether the baseline's ``ε`` applies: weights that are energies (proxy, exact). Counts and sums of
        ``ρ̄²`` (uniform, length) divide exactly (THEORY §3)."""
        return self.energy in ("proxy", "exact")


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("sequence", "uniform", std_normalize=True),
    "rloo": Estimator("sequence", "uniform", leave_one_out=True),
    "opo": Estimator("sequence", "length"),
    "sequence_proxy": Estimator("sequence", "proxy"),
    "eob": Estimator("sequence", "exact"),
    "token_mean": Estimator("token", "uniform"),
    "token_length": Estimator("token", "length"),
    "otb": Estimator("token", "proxy"),
    "otb_exact": Estimator("token", "exact"),
}


def resolve_estimator(
    estimator: str | Estimator, leave_one_out: bool | None = None, std_normalize: bool | None = None
) -> Estimator:
    """The :class:`Estimator` of a name of :data:`ESTIMATORS` (or an Estimator), with the flags given overriding
    its own. Raises ValueError naming ``estimator`` for an unknown name, granularity or energy."""
    if isinstance(estimator, Estimator):
        spec = estimator
        if spec.granularity not in GRANULARITIES:
            raise ValueError(f"estimator: granularity must be one of {GRANULARITIES}, got {spec.granularity!r}")
        if spec.energy not in ENERGIES:
            raise ValueError(f"estimator: energy must be one of {ENERGIES}, got {spec.energy!r}")
    elif isinstance(estimator, str) and estimator in ESTIMATORS:
        spec = ESTIMATORS[estimator]
    else:
        raise ValueError(f"estimator: unknown estimator {estimator!r}; choose one of {sorted(ESTIMATORS)}")
    if leave_one_out is not None:
        spec = replace(spec, leave_one_out=bool(leave_one_out))
    if std_normalize is not None:
        spec = replace(spec, std_normalize=bool(std_normalize))
    return spec


def population_cells() -> dict[str, Estimator]:
    """Each cell of the table once, named by its first estimator in :data:`ESTIMATORS`, flags off: the
    population baselines (``"grpo"`` names the uniform sequence cell, the mean ``E[R]`` that grpo and rloo share)."""
    cells: dict[tuple[str, str], str] = {}
    for name, spec in ESTIMATORS.items():
        cells.setdefault((spec.granularity, spec.energy), name)
    return {name: Estimator(granularity, energy) for (granularity, energy), name in cells.items()}
