"""The pure kernels against every worked example of docs/merge-methods.md (to 1e-6), and the
properties each method must have (identical experts, lambda 0, disjoint supports, a flat ISO
spectrum, reproducible DARE masks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from merge_helpers import TAUS

from rl360.merge import iso, kth, ulp
from rl360.merge import methods as M

ATOL = 1e-6
W = [1.0, 1.0, 1.0]


@pytest.fixture
def taus() -> list[torch.Tensor]:
    return [torch.tensor(t, dtype=torch.float32) for t in TAUS]


def close(t: torch.Tensor, expected: list) -> None:
    np.testing.assert_allclose(t.double().numpy(), np.array(expected), atol=ATOL, rtol=0)


def test_uniform_soup(taus):
    close(M.soup(taus, W).delta, [0.2, 0.1, 0.033335, -0.1, 0.016667, -0.033333])


def test_task_arithmetic(taus):
    close(M.task_arithmetic(taus, W, 1.0).delta, [0.6, 0.3, 0.100005, -0.3, 0.05, -0.1])
    close(M.task_arithmetic(taus, W, 0.4).delta, [0.24, 0.12, 0.040002, -0.12, 0.02, -0.04])


def test_ties_mergekit_density_and_paper_k20(taus):
    expected = [0.4, 0.3, 0.1, -0.6, 0, 0]
    # mergekit: per-tensor top-k with k = int(0.4 * 6) = 2
    thr = [kth.kth_smallest_abs(t, kth.topk_rank(6, 0.4)) for t in taus]
    close(
        M.ties_consensus([M.trim(t, x) for t, x in zip(taus, thr, strict=True)], W).delta, expected
    )
    # paper: kthvalue(d - int(d K)) with K = 0.2 keeps int(1.2) + 1 = 2 entries
    thr = [kth.kth_smallest_abs(t, kth.paper_rank(6, 0.2)) for t in taus]
    trimmed = [M.trim(t, x) for t, x in zip(taus, thr, strict=True)]
    close(trimmed[0], [0.4, 0, 0, 0.2, 0, 0])
    close(trimmed[1], [0, 0.3, 0, -0.6, 0, 0])
    close(trimmed[2], [0, 0, 0.1, 0.1, 0, 0])
    close(M.ties_consensus(trimmed, W).delta, expected)


def test_kth_matches_torch_kthvalue():
    x = torch.randn(10_000) * torch.logspace(-8, 2, 10_000)
    for k in (1, 17, 5_000, 9_999, 10_000):
        assert kth.kth_smallest_abs(x, k) == float(x.abs().kthvalue(k).values)


KEEPS = [[1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 0, 1], [1, 0, 1, 0, 1, 1]]


def test_dare_fixed_masks_paper_and_mergekit(taus):
    keeps = [torch.tensor(k, dtype=torch.bool) for k in KEEPS]
    paper = [M.dare_drop(t, k, M.dare_paper_factor(0.5)) for t, k in zip(taus, keeps, strict=True)]
    # The spec prints 0.00001 at position 2; tau3's kept 0.1 * 2 adds 0.2 there (its own
    # mergekit row, 0.166673 = 0.1 * 1.666667 + 5e-6 * 1.222221, counts the same entry).
    close(M.linear(paper, W).delta, [0.8, 0.6, 0.20001, -1.2, 0.1, -0.2])
    factors = [M.dare_l1_factor(t, k) for t, k in zip(taus, keeps, strict=True)]
    np.testing.assert_allclose(factors, [1.4, 1.222221, 1.666667], atol=ATOL)
    l1 = [M.dare_drop(t, k, f) for t, k, f in zip(taus, keeps, factors, strict=True)]
    close(M.linear(l1, W).delta, [0.56, 0.366666, 0.166673, -0.733333, 0.083333, -0.14])


def test_ram_and_ram_plus(taus):
    close(M.ram(taus).delta, [0.3, 0.3, 0.1, -0.1, 0.05, -0.1])
    shared, unique = M.ram_counts(M.active_masks(taus, 1e-5))
    assert (shared, unique) == ([2, 2, 1], [1, 1, 2])
    official = M.ram_plus_lambdas(shared, unique, rescale_factor=1.2)
    np.testing.assert_allclose(official, [1.2, 1.2, 1.1])
    close(M.ram(taus, lambdas=official).delta, [0.3, 0.36, 0.11, -0.1, 0.055, -0.12])
    # mergekit ramplus_tl defaults r=0.1, alpha=0.2 -> lambda 1.02; r=0.2, alpha=1 = official
    tl = M.ram_plus_lambdas(shared, unique, rescale_factor=1.1, alpha=0.2)
    close(M.ram(taus, lambdas=tl).delta, [0.3, 0.306, 0.102, -0.1, 0.051, -0.102])
    assert M.ram_plus_lambdas(shared, unique, 1.2, 1.0) == official


def test_ram_plus_no_unique_entries_is_not_an_error():
    assert M.ram_plus_lambdas([3], [0], 1.2) == [pytest.approx(1.2)]


def test_gram_soup(taus):
    g = M.gram_matrix(taus)
    np.testing.assert_allclose(
        g, [[0.21, -0.04, 0.02], [-0.04, 0.49, -0.06], [0.02, -0.06, 0.0225]], atol=ATOL
    )
    c = M.cosines(g)
    np.testing.assert_allclose(
        [c[0, 1], c[0, 2], c[1, 2]], [-0.124696, 0.290957, -0.571424], atol=ATOL
    )
    np.testing.assert_allclose(M.gram_multiplicity(g), [1.290957, 1, 1.290957], atol=ATOL)
    close(M.gram_soup(taus).delta, [0.509848, 0.3, 0.077467, -0.367614, 0.038731, -0.077462])


def test_model_stock(taus):
    assert M.model_stock_t(M.gram_matrix(taus)) == pytest.approx(-0.555100, abs=ATOL)
    close(M.model_stock(taus).delta, [-0.11102, -0.05551, -0.018504, 0.05551, -0.009252, 0.018503])


def test_iso_c_2x3(taus):
    mats = [t.reshape(2, 3) for t in taus]
    s = torch.linalg.svdvals(sum(mats).double())
    np.testing.assert_allclose(s.numpy(), [0.728975, 0.176343], atol=ATOL)
    out = iso.iso_c(mats).delta
    close(out, [[0.335005, 0.303638, 0.021805], [-0.278355, 0.318662, -0.160849]])
    np.testing.assert_allclose(
        torch.linalg.svdvals(out.double()).numpy(), [0.452659] * 2, atol=ATOL
    )
    # on 2x3 Iso-CTS degenerates to Iso-C (k = 2, d = 0)
    assert iso.cts_sizes(2, 3, 3, 0.8) == (2, 0)
    close(iso.iso_cts(mats).delta, out.tolist())


def test_iso_cts_reproducible_6x6():
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((6, 6)) * (rng.random((6, 6)) < 0.3) for _ in range(3)]
    taus = [torch.tensor(m, dtype=torch.float32) for m in mats]
    assert iso.cts_sizes(6, 6, 3, 0.8) == (3, 1)
    s_all = iso.cts_spectrum(taus)
    np.testing.assert_allclose(
        s_all.numpy(), [0.902172, 1.603852, 1.668899, 4.38978, 3.152173, 2.604254], atol=ATOL
    )
    out = iso.iso_cts(taus).delta
    np.testing.assert_allclose(
        torch.linalg.svdvals(out.double()).numpy(), [2.386855] * 6, atol=ATOL
    )
    close(out[0], [0.863793, -0.183092, 0.626354, -1.57439, -0.55593, 1.31808])


# --- ULP-gate (spec section 7) ------------------------------------------------------------
BASE = [0.02, 0.0012, 0.5, -0.3, 1.0, 0.06]
OFFSETS = [[1, 0, 3, 0, 0, -1], [1, 1, 0, -2, 0, 0], [0, 0, 1, 0, -1, 0]]


def ulp_example() -> tuple[torch.Tensor, list[torch.Tensor]]:
    base = torch.tensor(BASE).bfloat16()
    o = ulp.ordinal(base)
    return base, [
        ulp.from_ordinal(o + torch.tensor(k, dtype=o.dtype), torch.bfloat16) for k in OFFSETS
    ]


def moved(base: torch.Tensor, delta: torch.Tensor) -> list[int]:
    return ulp.signed_steps(base, base.float() + delta).tolist()


def test_ordinal_is_monotone_across_signs_and_binades():
    x = torch.tensor([-2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.99609375, 1.0, 3.0]).bfloat16()
    o = ulp.ordinal(x)
    assert o[3] == o[4] == 0
    assert bool((o[1:] >= o[:-1]).all())
    assert int(o[7] - o[6]) == 1  # 1.0 -> 0.99609375 is one step though only ulp(1)/2
    assert torch.equal(ulp.from_ordinal(o, torch.bfloat16).float().abs(), x.float().abs())
    f = torch.tensor([-1.5, 0.0, 2.0**-140, 1.0])
    assert torch.equal(ulp.from_ordinal(ulp.ordinal(f), torch.float32), f)


def test_ulp_gate_example():
    base, experts = ulp_example()
    taus = [e.float() - base.float() for e in experts]
    assert float(taus[1][1]) == pytest.approx(7.63e-6, rel=1e-3)  # below RAM's epsilon
    soup = M.soup(taus, W).delta
    assert moved(base, soup) == [1, 0, 1, -1, 0, 0]
    lost = ulp.absorbed(soup, base.float(), torch.bfloat16)
    assert torch.nonzero(lost).flatten().tolist() == [1, 4, 5]
    assert moved(base, M.ram(taus).delta) == [1, 0, 2, -2, -1, -1]
    for g, expected in ((1, [1, 1, 2, -2, -1, -1]), (2, [0, 0, 3, -2, 0, 0])):
        gates = [ulp.steps(base, e) >= g for e in experts]
        delta = M.ram(taus, masks=gates).delta
        assert moved(base, delta) == expected
    gates = [ulp.steps(base, e) >= 1 for e in experts]
    assert not ulp.absorbed(M.ram(taus, masks=gates).delta, base.float(), torch.bfloat16).any()


def test_snap_moves_absorbed_one_step_toward_the_update():
    base, experts = ulp_example()
    taus = [e.float() - base.float() for e in experts]
    soup = M.soup(taus, W).delta
    lost = ulp.absorbed(soup, base.float(), torch.bfloat16)
    out = ulp.snap((base.float() + soup).bfloat16(), base.float(), soup, lost)
    assert ulp.signed_steps(base, out.float()).tolist() == [1, 1, 1, -1, -1, -1]


# --- properties --------------------------------------------------------------------------
def test_soup_of_identical_experts_is_that_expert():
    tau = torch.randn(64, 16)
    assert torch.allclose(M.soup([tau, tau.clone(), tau.clone()], W).delta, tau, atol=1e-7)


def test_task_arithmetic_lambda_zero_is_the_base(taus):
    assert torch.count_nonzero(M.task_arithmetic(taus, W, 0.0).delta) == 0


def test_ram_on_disjoint_supports_is_the_sum():
    x = torch.randn(3, 1000)
    owner = torch.randint(0, 3, (1000,))
    taus = [torch.where(owner == i, x[i], 0.0) for i in range(3)]
    assert torch.equal(M.ram(taus, epsilon=0.0).delta, sum(taus))
    assert torch.allclose(M.gram_soup(taus).delta, sum(taus))


def test_iso_c_leaves_all_singular_values_equal():
    taus = [torch.randn(24, 40) * (torch.rand(24, 40) < 0.2) for _ in range(4)]
    s = torch.linalg.svdvals(iso.iso_c(taus).delta.double())
    assert float(s.max() - s.min()) < 1e-5 * float(s.max())


def test_dare_masks_are_reproducible_with_a_seed():
    from rl360.merge.recipe import DareLinear
    from rl360.merge.strategies import build_method

    a = build_method(DareLinear(density=0.3, seed=7), W)
    b = build_method(DareLinear(density=0.3, seed=7), W)
    c = build_method(DareLinear(density=0.3, seed=8), W)
    ka, kb, kc = (m.keep("layer.w", 1, 0, 10_000) for m in (a, b, c))
    assert torch.equal(ka, kb) and not torch.equal(ka, kc)
    assert abs(float(ka.float().mean()) - 0.3) < 0.02
    assert not torch.equal(ka, a.keep("layer.w", 2, 0, 10_000))  # experts draw differently
