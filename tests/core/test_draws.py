"""Random-baseline draws shared across layers, and several transport families in one pass.

Reference: `isometry.random_baselines` with the same integer seed, which draws the factors of
every layer afresh and evaluates each measurement on them (the public per-measure path). The
shared draws rescale Grams computed once, so they agree to rounding: 1e-10 absolute in
float64 on defects in [0, 1], 1e-5 in float32.
"""

import functools
import inspect
import json

import pytest
import torch

from tests.core.problems import random_problem
from tl_connwalk.core import draws, field_defect, head_grams
from tl_connwalk.core import isometry as iso
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk

ATOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def reference_baselines(p, n_draws, seed, exclude_sink=False):
    """The baselines measured the slow way: fresh factors, each public measurement on them."""
    measures = {
        "head_defects": iso.head_transport_defects,
        "transport_defect": lambda values, outputs: iso.effective_transport_defect(
            p.walk, p.gates, values, outputs, exclude_sink=exclude_sink
        ),
        "field_defect": lambda values, outputs: field_defect.field_isometry_defect(
            p.field, p.walk, p.gates, values, outputs, exclude_sink=exclude_sink
        ),
    }
    return iso.random_baselines(measures, p.W_V, p.W_O, n_draws, seed=seed)


def residual_of(p, **options):
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, p.W_V, p.W_O)
    return walk.laplacian_residual(**options)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("exclude_sink", [False, True])
@pytest.mark.parametrize("keep_factors", [True, False])
def test_shared_draws_equal_fresh_draws_per_measurement(
    dtype, exclude_sink, keep_factors, monkeypatch
):
    if not keep_factors:  # too large to keep: the factors are drawn again from the seed
        monkeypatch.setattr(iso, "CHUNK_ENTRIES", 64)
    draws.raw_draws.cache_clear()
    p = random_problem(heads=3, pos=6, d_model=10, d_head=3, seed=4, causal=True, dtype=dtype)
    res = residual_of(p, baseline_draws=3, seed=11, exclude_sink=exclude_sink)
    expected = reference_baselines(p, 3, 11, exclude_sink)
    for name, base in expected.items():
        torch.testing.assert_close(
            res.baseline[name].draws, base.draws, atol=ATOL[dtype], rtol=0, msg=name
        )
    assert (draws.raw_draws.cache_info().currsize == 1) and (
        draws.raw_draws.cache_info().misses == 1
    )
    assert (draws.raw_draws(p.W_V.shape, p.W_O.shape, dtype, p.W_V.device, 11, 3).kept is None) != (
        keep_factors
    )


@pytest.mark.parametrize("draw_rows", [True, False])
def test_wide_heads_draws_keep_their_output_gram_rows_within_a_budget(draw_rows, monkeypatch):
    """Heads wider than `head_grams.OUT_GRAM_WIDTH`: the layer measures its message Grams
    through the messages, each raw draw through its own kept output-Gram rows (shared by
    every layer) while they fit ``OUT_ROWS_BYTES``, else through its messages; the baselines
    equal the slow reference either way."""
    monkeypatch.setattr(head_grams, "OUT_GRAM_WIDTH", 8)  # H d_head = 9 is wider
    row_bytes = 3**2 * (3 * 4 // 2) * 8  # d_head^2 H (H + 1) / 2 float64 numbers per draw
    if not draw_rows:  # one byte short of three draws' rows
        monkeypatch.setattr(draws, "OUT_ROWS_BYTES", 3 * row_bytes - 1)
    draws.raw_draws.cache_clear()
    head_grams.cache_clear()
    p = random_problem(heads=3, pos=6, d_model=10, d_head=3, seed=4, causal=True)
    res = residual_of(p, baseline_draws=3, seed=11)
    for name, base in reference_baselines(p, 3, 11).items():
        torch.testing.assert_close(res.baseline[name].draws, base.draws, atol=1e-10, rtol=0)
    assert head_grams.head_grams(p.W_V, p.W_O).out_rows is None
    raw = draws.raw_draws(p.W_V.shape, p.W_O.shape, p.W_V.dtype, p.W_V.device, 11, 3)
    assert all((draw.out_rows is not None) == draw_rows for draw in raw.draws)
    if draw_rows:
        assert all(draw.out_rows.nbytes == row_bytes for draw in raw.draws)
    head_grams.cache_clear()


def test_kept_draws_are_the_seeded_factors_laid_out_for_the_message_grams():
    """The kept ``R_V`` equal a fresh draw of the seed, over ``[d_model, head d_head]`` storage:
    `field_defect.message_grams` reshapes it to ``W_V^cat`` without a copy."""
    draws.raw_draws.cache_clear()
    p = random_problem(heads=3, pos=6, d_model=10, d_head=3, seed=4)
    raw = draws.raw_draws(p.W_V.shape, p.W_O.shape, p.W_V.dtype, p.W_V.device, 5, 2)
    generator = torch.Generator().manual_seed(5)
    assert raw.kept is not None
    for R_V, R_O in raw.kept:
        fresh_V, fresh_O = iso.gaussian_factors(
            p.W_V.shape, p.W_O.shape, p.W_V.dtype, p.W_V.device, generator
        )
        assert torch.equal(R_V, fresh_V) and torch.equal(R_O, fresh_O)
        values = R_V.permute(1, 0, 2).reshape(R_V.shape[1], -1)
        assert values.is_contiguous() and values.data_ptr() == R_V.data_ptr()


def test_layers_of_one_shape_share_one_set_of_draws():
    """Two layers with other weights (same shapes): one raw draw set, each its own baseline."""
    draws.raw_draws.cache_clear()
    first = random_problem(seed=1)
    second = random_problem(seed=2)
    res_first = residual_of(first, baseline_draws=2)
    res_second = residual_of(second, baseline_draws=2)
    info = draws.raw_draws.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    for p, res in [(first, res_first), (second, res_second)]:
        base = reference_baselines(p, 2, 0)["transport_defect"]
        torch.testing.assert_close(
            res.baseline["transport_defect"].draws, base.draws, atol=1e-10, rtol=0
        )


def test_a_zero_head_draws_a_zero_head():
    p = random_problem(seed=3)
    W_O = p.W_O.clone()
    W_O[1] = 0.0
    layer = draws.layer_draws(p.W_V, W_O, n_draws=2, seed=0)
    assert (layer.scales[:, 1] == 0).all() and (layer.head_defects[:, 1] == 0).all()
    expected = iso.random_baseline(iso.head_transport_defects, p.W_V, W_O, 2, seed=0)
    torch.testing.assert_close(layer.head_defects, expected.draws, atol=1e-10, rtol=0)
    for (values, outputs), (values_ref, outputs_ref) in zip(
        layer.factors(),
        [iso.random_head_factors(p.W_V, W_O, g) for g in [torch.Generator().manual_seed(0)] * 2],
        strict=True,
    ):
        torch.testing.assert_close(values @ outputs, values_ref @ outputs_ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("exclude_sink", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 4])
@pytest.mark.parametrize("listed", [False, True])
def test_family_means_equal_one_family_at_a_time(exclude_sink, chunk, listed):
    """gram_means of three families == walk_weighted_mean of each family's edge defects and
    Frobenius scales; gram_defect_means is its defect."""
    p = random_problem(batch=2, heads=3, pos=7, seed=5, causal=True)
    problems = [p, random_problem(seed=6), random_problem(seed=7)]
    grams = [iso.gram_matrices(q.W_V, q.W_O) for q in problems]
    K2 = torch.stack([K2 for K2, _ in grams])
    pairs = torch.stack([iso.fold_pairs(K4) for _, K4 in grams])
    edges = iso.heaviest_edges(p.walk, 0.7) if listed else None
    rank = iso.effective_rank(p.W_V, p.W_O)
    options = dict(exclude_sink=exclude_sink, edges=edges, query_chunk=chunk)
    means = iso.gram_means(p.walk, p.gates, K2, pairs, rank, **options)
    assert torch.equal(iso.gram_defect_means(p.walk, p.gates, K2, pairs, rank, **options),
                       means.defect)  # fmt: skip
    summary = dict(exclude_sink=exclude_sink, edges=edges)
    for family, (K2_f, K4_f) in enumerate(grams):
        eps = iso.edge_gram_defects(p.gates, K2_f, K4_f, rank, p.walk)
        expected = iso.walk_weighted_mean(p.walk, eps, **summary)
        torch.testing.assert_close(means.defect[family], expected, atol=1e-12, rtol=0)
        scales = iso.edge_frobenius_scales(p.gates, K2_f, rank, p.walk)
        expected = iso.walk_weighted_mean(p.walk, scales, **summary)
        torch.testing.assert_close(means.scale[family], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bad", ["overflow", "nan"])
def test_a_family_that_leaves_the_float_range_raises_instead_of_a_silent_zero(bad):
    """float32 Grams whose fourth powers overflow (or a NaN): one check of the whole result."""
    p = random_problem(batch=2, heads=3, pos=7, seed=5, causal=True, dtype=torch.float32)
    K2, K4 = iso.gram_matrices(p.W_V, p.W_O)
    pairs = iso.fold_pairs(K4)
    scale = 1e30 if bad == "overflow" else float("nan")
    K2_bad, pairs_bad = K2 * scale, pairs * scale**2
    if bad == "nan":  # one entry only: every other edge of that family stays finite
        K2_bad, pairs_bad = K2.clone(), pairs.clone()
        pairs_bad[0, 0] = float("nan")
    for K2_f, pairs_f in [(K2_bad, pairs_bad), (K2, pairs)]:  # the healthy family still works
        run = functools.partial(
            iso.gram_defect_means, p.walk, p.gates, torch.stack([K2, K2_f]),
            torch.stack([pairs, pairs_f]), iso.effective_rank(p.W_V, p.W_O),
        )  # fmt: skip
        if K2_f is K2:
            assert torch.isfinite(run()).all()
        else:
            with pytest.raises(ConnWalkError, match="overflowed the working precision"):
                run()


def test_family_shapes_are_checked():
    p = random_problem()
    K2, K4 = iso.gram_matrices(p.W_V, p.W_O)
    with pytest.raises(ConnWalkError, match="same families"):
        inspect.unwrap(iso.gram_means)(
            p.walk, p.gates, K2[None], iso.fold_pairs(K4)[None].expand(2, -1, -1), 3
        )


@pytest.mark.parametrize("n_draws", [1, 2.5, True])
def test_bad_draw_counts_are_refused(n_draws):
    p = random_problem()
    with pytest.raises(ConnWalkError, match="n_draws"):
        inspect.unwrap(draws.layer_draws)(p.W_V, p.W_O, n_draws, seed=0)


def test_a_walk_measures_its_weights_once_and_again_after_an_edit(monkeypatch):
    """Both sink settings and another walk of the same weights share the layer's Grams; an
    in-place edit of W_V renews them."""
    p = random_problem(seed=8, causal=True)
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, p.W_V.clone(), p.W_O)
    draws.layer_draws(p.W_V, p.W_O, 2, 0)  # the shared raw draws, drawn before counting
    head_grams.cache_clear()
    calls = []
    factor_grams = iso.head_factor_grams
    monkeypatch.setattr(iso, "head_factor_grams", lambda *a: calls.append(1) or factor_grams(*a))
    with_sink = walk.laplacian_residual(baseline_draws=2)
    without_sink = walk.laplacian_residual(baseline_draws=2, exclude_sink=True)
    assert len(calls) == 1
    fresh = ConnectionWalk.from_pattern(p.pattern, p.field, p.W_V, p.W_O)
    for res, exclude_sink in [(with_sink, False), (without_sink, True)]:
        expected = fresh.laplacian_residual(baseline_draws=2, exclude_sink=exclude_sink)
        assert json.dumps(res.to_dict()) == json.dumps(expected.to_dict())
    assert len(calls) == 1  # the fresh walk's weights are equal: found in the store
    walk.W_V.mul_(2.0).add_(1.0)  # no longer the model's weights: measured again
    edited = walk.laplacian_residual(baseline_draws=2)
    assert len(calls) == 2
    changed = ConnectionWalk.from_pattern(p.pattern, p.field, 2 * p.W_V + 1, p.W_O)
    torch.testing.assert_close(
        edited.transport_defect, changed.laplacian_residual(baseline_draws=2).transport_defect
    )
