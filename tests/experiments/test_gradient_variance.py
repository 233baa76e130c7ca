"""experiments/gradient_variance.py: the per-batch gradients against autograd, the statistics' identities, and the
quick run's report structure and invariants, never the verdict."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import gradient_variance as gv

from common import gradients
from otb_ref import compute_advantages
from otb_train.config import Config
from otb_train.energies import exact_energies
from otb_train.model import Policy, build_model_and_tokenizer
from otb_train.rollout import position_ids_from_mask
from otb_train.tasks import synthetic_problem

SIZES = (2, 4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster than two (and the experiment itself runs on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(one_thread):
    """A 1-layer random-init Qwen2 and 2 prompts x 4 sampled responses, with random rewards on the last token."""
    torch.manual_seed(0)
    lm, *_ = build_model_and_tokenizer(Config(hidden_size=32, num_layers=1))
    lm.config._attn_implementation = "eager"
    lm.eval()
    problems = [synthetic_problem("copy", 0, i, copy_lengths=(2, 3)) for i in range(2)]
    sample = gv.sample_batch(lm, problems, max(SIZES), 1, 5, 0, "copy")
    lengths = sample.mask.sum(dim=1)
    scores = torch.rand(len(lengths), generator=torch.Generator().manual_seed(1))
    sample.rewards = torch.zeros(sample.mask.shape).scatter_(1, (lengths - 1)[:, None], scores[:, None])
    return lm, sample


def direct_gradients(lm, sample, n: int) -> dict[str, torch.Tensor]:
    """Autograd of the token-mean surrogate over the first n responses of every group, for every estimator, with
    the library's advantages on the whole batch at once (exact energies: otb_ref.exact via exact_energies)."""
    rows = torch.cat([torch.arange(s, s + n) for s in range(0, len(sample.mask), sample.group_size)])
    sequences, mask, rewards = sample.sequences[rows], sample.mask[rows], sample.rewards[rows]
    attention = torch.cat([torch.ones(len(rows), sample.num_prompt, dtype=torch.bool), mask], dim=1)
    targets = sequences[:, sample.num_prompt :]
    log_probs, _ = Policy(lm, 1.0, None)(sequences, attention, position_ids_from_mask(attention), targets=targets)
    out = {}
    for name, (estimator, flags) in gv.ESTIMATORS.items():
        if estimator is None:
            advantages = rewards.sum(dim=1, keepdim=True) * mask
        else:
            extra = {"old_log_probs": sample.old_log_probs[rows], "sum_pi_squared": sample.sum_pi_squared[rows]}
            if estimator in ("eob", "otb_exact"):
                extra = exact_energies(estimator, lm, sequences, attention, mask, 1.0)
            advantages = compute_advantages(estimator, rewards, mask, rows // sample.group_size, **extra, **flags)[0]
        surrogate = (advantages * log_probs * mask).sum() / mask.sum()
        grads = torch.autograd.grad(surrogate, list(lm.parameters()), retain_graph=True)
        out[name] = torch.cat([g.flatten() for g in grads])
    return out


def test_batch_gradients_equal_autograd_of_the_surrogate(tiny):
    """Σ over rows of a_it J_it / #tokens (per-token Jacobians, group by group) is the surrogate's gradient."""
    lm, sample = tiny
    grads, facts = gv.batch_gradients(lm, sample, SIZES, chunk=3)
    assert grads.shape == (len(gv.ESTIMATORS), len(SIZES), sum(p.numel() for p in lm.parameters()))
    for k, n in enumerate(SIZES):
        for e, (name, direct) in enumerate(direct_gradients(lm, sample, n).items()):
            assert torch.allclose(grads[e, k], direct, rtol=1e-4, atol=1e-5 * direct.norm()), (name, n)
    assert facts["tokens"][-1] == sample.mask.sum()


def test_prefix_energies_equal_otb_ref_exact(tiny):
    """||S_t||² from the Jacobian chunks equals otb_ref.exact.prefix_grad_norms_sq_fp64 (float64, row by row)."""
    lm, sample = tiny
    rows = slice(0, sample.group_size)
    mask = sample.mask[rows].float()
    jacobians = gv.token_jacobians(lm, sample.sequences[rows], mask, sample.num_prompt, chunk=3)
    attention = torch.ones_like(sample.sequences[rows], dtype=torch.bool)
    attention[:, sample.num_prompt :] = sample.mask[rows]
    exact = exact_energies("otb_exact", lm, sample.sequences[rows], attention, sample.mask[rows], 1.0)
    assert torch.allclose(gv.prefix_energies(jacobians, mask), exact["cumulative_energy"], rtol=1e-4, atol=1e-6)


def test_equal_rewards_give_zero_gradient_for_group_baselines(tiny):
    """All rewards of every group equal: GRPO and RLOO give exactly 0, include-self weighted means ~0, REINFORCE not."""
    lm, sample = tiny
    lengths = sample.mask.sum(dim=1)
    equal = torch.zeros(sample.mask.shape).scatter_(1, (lengths - 1)[:, None], 1.0)
    grads, _ = gv.batch_gradients(lm, gv.Sample(**{**sample.__dict__, "rewards": equal}), SIZES)
    names = list(gv.ESTIMATORS)
    scale = grads[names.index("reinforce")].norm(dim=-1)
    assert (scale > 0).all()
    for name in ("grpo", "grpo_nostd", "rloo"):
        assert (grads[names.index(name)] == 0).all(), name
    for name in ("opo", "otb", "otb_exact", "eob"):  # include-self weighted means: ε in the denominator
        assert (grads[names.index(name)].norm(dim=-1) <= 1e-6 * scale).all(), name
    # otb_loo is not 0: past the other responses' ends nobody is left to average, its baseline is 0 there.


def test_pair_statistics_identities():
    """The pair U-statistic is ||ḡ||² − tr Ĉov/R, the noise is tr Ĉov, and SNR >= −1/R always."""
    generator = torch.Generator().manual_seed(0)
    r = 6
    g = torch.randn(r, 50, dtype=torch.float64, generator=generator) + 0.3
    signal, power = gradients.pair_means((g @ g.T)[None], torch.ones(1, r, dtype=torch.float64))
    mean = g.mean(dim=0)
    trace_cov = ((g - mean) ** 2).sum() / (r - 1)
    assert torch.allclose(signal[0, 0], mean.square().sum() - trace_cov / r)
    assert torch.allclose(power[0, 0] - signal[0, 0], trace_cov)
    weights = torch.ones(1, r, dtype=torch.float64)
    for _ in range(20):  # worst case: gradients that cancel
        g = torch.randn(r, 5, dtype=torch.float64, generator=generator)
        g = g - g.mean(dim=0)
        signal, power = gradients.pair_means((g @ g.T)[None], weights)
        assert signal[0, 0] / (power[0, 0] - signal[0, 0]) >= -1 / r - 1e-12


def _directional(grads: torch.Tensor) -> dict:
    """gv.statistics of grads [R, E, 1, P] with estimator 0 the reference, on the sample itself."""
    own, cross = gv.gram_matrices(grads, (0, 0))
    stats = gv.statistics(own, cross, (0, 0), torch.ones(1, len(grads), dtype=torch.float64))
    return {k: v[0] for k, v in stats.items()}


def test_directional_snr_charges_direction_only_and_mse_is_unbiased():
    """SNR∥ equals SNR for a positive multiple of the reference (a shrunk estimator keeps it); a mean turned away
    from ∇J keeps a high SNR but loses SNR∥; the MSE is E‖g‖² − 2⟨E g, ∇J⟩ + ‖∇J‖² from the pair statistics."""
    generator = torch.Generator().manual_seed(0)
    r, p = 12, 40
    truth = torch.zeros(p, dtype=torch.float64)
    truth[0] = 1.0
    ref = truth + 0.5 * torch.randn(r, p, dtype=torch.float64, generator=generator)
    turned = ref + 3.0 * torch.eye(p, dtype=torch.float64)[1]  # mean (1, 3, 0, ...): same noise, a large side
    grads = torch.stack([ref, 0.3 * ref, turned], dim=1)[:, :, None]  # [R, E, 1, P]
    stats = _directional(grads)
    assert stats["snr_par"][1, 0] == pytest.approx(float(stats["snr"][1, 0]))
    assert stats["snr_par"][0, 0] == pytest.approx(float(stats["snr"][0, 0]))
    assert stats["snr"][2, 0] > 5 * stats["snr"][0, 0] and stats["snr_par"][2, 0] < stats["snr"][0, 0]
    assert stats["cosine"][2, 0] == pytest.approx(1 / math.sqrt(10), abs=0.15)
    off = ~torch.eye(r, dtype=torch.bool)
    for e in range(3):
        g = grads[:, e, 0]
        power = (g * g).sum(dim=1).mean()
        inner = (g @ ref.T)[off].mean()
        ref_signal = (ref @ ref.T)[off].mean()
        assert stats["mse"][e, 0] == pytest.approx(float(power - 2 * inner + ref_signal))
        assert stats["mse_rel"][e, 0] == pytest.approx(float((power - 2 * inner + ref_signal) / ref_signal))
    assert stats["mse"][0, 0] == pytest.approx(0.25 * p, rel=0.2)  # the reference's own noise, tr Cov
    assert stats["ref_noise"] == pytest.approx(float(stats["noise"][0, 0] / r / stats["signal"][0, 0]))


def test_crossing():
    """Linear in log2 N between grid points; the smallest N when already there; inf when never."""
    snr = torch.tensor([[1.0, 2.0, 4.0], [5.0, 6.0, 7.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    out = gv.crossing(snr, torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64), (2, 4, 8))
    assert out[0] == pytest.approx(2**2.5) and out[1] == 2 and math.isinf(out[2])


def test_quick_run_writes_the_report(tmp_path, snapshots_dir):
    results = gv.main(["--quick", "--out-dir", str(tmp_path), "--snapshots-dir", str(snapshots_dir)])

    report = (tmp_path / "gradient_variance.md").read_text()
    for kind in ("n", "tokens"):
        assert (tmp_path / f"gradient_variance_snr_{kind}.png").stat().st_size > 0
        assert f"gradient_variance_snr_{kind}.png" in report
    assert f"**R = {gv.QUICK.replicates}**" in report
    assert list(results) == list(gv.QUICK.snapshots)
    saved = json.loads((tmp_path / "gradient_variance_records.json").read_text())  # the numbers behind the figures
    assert list(saved["snapshots"]) == list(results) and saved["estimators"] == list(gv.ESTIMATORS)
    for name, result in results.items():
        snr = saved["snapshots"][name]["statistics"]["snr"]
        torch.testing.assert_close(
            torch.tensor(snr["point"], dtype=torch.float64), result["point"]["snr"].double(), rtol=1e-5, atol=0
        )
    shape = (len(gv.ESTIMATORS), len(gv.QUICK.group_sizes))
    for name in gv.ESTIMATORS:  # a row in the 2 headline tables (SNR, SNR∥), and in the 6 tables of every snapshot
        assert sum(line.startswith(f"| {name} |") for line in report.splitlines()) == 2 + 6 * len(results)
    assert "directional SNR∥" in report and "Noise of g_ref's estimate" in report
    for result in results.values():
        point = result["point"]
        assert point["snr"].shape == shape and result["boot"]["snr"].shape == (gv.QUICK.bootstrap, *shape)
        assert (point["noise"] >= -1e-12 * point["noise"].abs().max()).all()
        defined = point["noise"] > 0
        assert torch.isfinite(point["snr"][defined]).all()
        assert (point["snr"][defined] >= -1 / gv.QUICK.replicates - 1e-9).all()
        cosine = torch.cat([point["cosine"].flatten(), result["boot"]["cosine"].flatten()])
        assert ((cosine >= -1) & (cosine <= 1) | cosine.isnan()).all()
        assert (point["bias"] >= 0).all() or point["bias"].isnan().any()
        reference = (list(gv.ESTIMATORS).index(gv.REFERENCE[0]), len(gv.QUICK.group_sizes) - 1)
        assert point["scale"][reference] == pytest.approx(1.0) or math.isnan(point["scale"][reference])
        assert len(result["tokens"]) == shape[1] and all(t > 0 for t in result["tokens"])


def test_results_md_quotes_the_committed_records():
    """RESULTS.md's N* on SNR∥ and ∇J's noise, parsed and recomputed from results/gradient_variance_records.json."""
    text = " ".join((ROOT / "docs" / "RESULTS.md").read_text().split())
    records = json.loads((ROOT / "results" / "gradient_variance_records.json").read_text())
    otb, otb_loo = records["estimators"].index("otb"), records["estimators"].index("otb_loo")
    stats = {name: snap["statistics"] for name, snap in records["snapshots"].items()}
    warm = stats["warm"]["n_star_par"]
    point, low, high = (warm[k][otb] for k in ("point", "low_90%", "high_90%"))
    assert f"N = 32 SNR∥ at N = {point:.3g} [{low:.3g}, {high:.3g}] after the warm start" in text
    assert all(stats[s]["n_star_par"]["point"][otb] <= 2 for s in ("mid", "late"))
    loo = [stats[s]["n_star_par"]["point"][otb_loo] for s in stats]
    assert f"leave-one-out OTB at {min(loo):.3g}–{max(loo):.3g}" in text
    noise = ", ".join(f"{stats[s]['ref_noise']['point']:.2g} ({s})" for s in ("warm", "mid", "late"))
    assert f"tr Cov / R / ‖∇J‖², is {noise}." in text
