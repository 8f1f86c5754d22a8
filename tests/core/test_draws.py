"""Random-baseline draws shared across layers, and several transport families in one pass.

Reference: `tl_connwalk.core.reference.random_draws` with the same integer seed, which draws
the factors of every layer afresh and measures them by definition (an SVD per edge). The
shared draws rescale Grams computed once, so they agree to rounding: ``cancelling_atol`` of
the dtype on defects in [0, 1] (the closed-form defects are ``sqrt(1 - x)`` with ``x ~ 1`` near
0, which keeps half the digits).
"""

import dataclasses
import functools
import inspect
import json

import pytest
import torch

from tests.core.problems import random_problem
from tests.tolerances import assert_close, atol, cancelling_atol
from tl_connwalk.core import isometry as iso
from tl_connwalk.core import reference as ref
from tl_connwalk.core._fast import chunks, draws, head_grams
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk

ATOL = {dtype: cancelling_atol(dtype) for dtype in (torch.float64, torch.float32)}


def reference_baselines(p, n_draws, seed, exclude_sink=False):
    """The baselines by definition: `tl_connwalk.core.reference.random_draws` (fresh factors
    from the same seed) measured by the reference, ``[draw, ...]`` per measurement."""
    measures = {
        "head_defects": ref.head_defects,
        "transport_defect": lambda values, outputs: ref.effective_defect(
            p.walk, p.gates, values, outputs, exclude_sink=exclude_sink
        ),
        "field_defect": lambda values, outputs: ref.field_defect(
            p.field, p.walk, p.gates, values, outputs, exclude_sink=exclude_sink
        ),
    }
    return {
        name: ref.random_draws(measure, p.W_V, p.W_O, n_draws, seed)
        for name, measure in measures.items()
    }


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
        monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 64)
    draws.raw_draws.cache_clear()
    p = random_problem(heads=3, pos=6, d_model=10, d_head=3, seed=4, causal=True, dtype=dtype)
    res = residual_of(p, baseline_draws=3, seed=11, exclude_sink=exclude_sink)
    expected = reference_baselines(p, 3, 11, exclude_sink)
    for name, drawn in expected.items():
        torch.testing.assert_close(
            res.baseline[name].draws.double(), drawn, atol=ATOL[dtype], rtol=0, msg=name
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
    row_bytes = 3**2 * 3 * (3 // 2 + 1) * 8  # d_head^2 H (H // 2 + 1) float64 numbers per draw
    if not draw_rows:  # one byte short of three draws' rows
        monkeypatch.setattr(draws, "OUT_ROWS_BYTES", 3 * row_bytes - 1)
    draws.raw_draws.cache_clear()
    head_grams.cache_clear()
    p = random_problem(heads=3, pos=6, d_model=10, d_head=3, seed=4, causal=True)
    res = residual_of(p, baseline_draws=3, seed=11)
    for name, base in reference_baselines(p, 3, 11).items():
        torch.testing.assert_close(res.baseline[name].draws, base, atol=ATOL[torch.float64], rtol=0)
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
    assert info.misses == 1 and info.hits >= 1  # (the field draws' route asks for them too)
    for p, res in [(first, res_first), (second, res_second)]:
        base = reference_baselines(p, 2, 0)["transport_defect"]
        torch.testing.assert_close(
            res.baseline["transport_defect"].draws, base, atol=ATOL[torch.float64], rtol=0
        )


def test_a_zero_head_draws_a_zero_head():
    p = random_problem(seed=3)
    W_O = p.W_O.clone()
    W_O[1] = 0.0
    layer = draws.layer_draws(p.W_V, W_O, n_draws=2, seed=0)
    assert (layer.scales[:, 1] == 0).all() and (layer.head_defects[:, 1] == 0).all()
    expected = iso.random_baseline(iso.head_transport_defects, p.W_V, W_O, 2, seed=0)
    torch.testing.assert_close(layer.head_defects, expected.draws, atol=ATOL[torch.float64], rtol=0)
    for (values, outputs), (values_ref, outputs_ref) in zip(
        layer.factors(),
        [iso.random_head_factors(p.W_V, W_O, g) for g in [torch.Generator().manual_seed(0)] * 2],
        strict=True,
    ):
        assert_close(values @ outputs, values_ref @ outputs_ref)


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
        torch.testing.assert_close(means.defect[family], expected, atol=ATOL[torch.float64], rtol=0)
        scales = iso.edge_frobenius_scales(p.gates, K2_f, rank, p.walk)
        expected = iso.walk_weighted_mean(p.walk, scales, **summary)
        assert_close(means.scale[family], expected)


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


# --- the field draws through the keys' Cholesky factor (`draws.key_factor`, `key_draws`) ---
#
# Reference: the explicit Gaussian value factor the route stands for. With ``X = L Q^T``
# (``Q = X^T L^-T``) and ``Q_perp`` completing ``Q``, ``Z = Q Y + Q_perp Y_perp`` is standard
# Gaussian when ``Y``, ``Y_perp`` are; the test draws both again from the route's seeds, builds
# ``Z`` and measures it by definition (`tl_connwalk.core.reference.field_defect` on explicit
# factors scaled to the layer's head norms). Agreement: ATOL in float64.

KEYED = dict(batch=2, heads=3, pos=6, d_model=24, d_head=4, causal=True)


def implied_value_factors(p, n_draws, seed, sequence):
    """Each field draw's explicit ``(W_V', W_O')`` for one sequence: ``Z`` from the route's
    seeds and that sequence's keys, then both factors scaled by ``sqrt(s_h)`` to the layer's
    ``||T^h||_F`` as `random_head_factors` does."""
    keys = p.field[sequence]
    n_keys, d_model = keys.shape
    n_heads, _, d_head = p.W_V.shape
    L = torch.linalg.cholesky(keys @ keys.T)
    Q = torch.linalg.solve_triangular(L, keys, upper=False).T  # X^T L^-T: [d_model, n_keys]
    device = keys.device
    spare = torch.randn(d_model, d_model, dtype=Q.dtype, device=device)
    Q_perp = torch.linalg.qr(torch.cat([Q, spare], 1)).Q[:, n_keys:]  # completes Q
    values = torch.Generator(device).manual_seed(draws._key_seed(seed, n_keys, "values"))
    perp = torch.Generator(device).manual_seed(draws._key_seed(seed, n_keys, "perp"))
    raw = draws.raw_draws(p.W_V.shape, p.W_O.shape, p.W_V.dtype, p.W_V.device, seed, n_draws)
    target = iso.head_norms_sq(p.W_V, p.W_O)
    for _, R_O in raw.factors():
        Y = torch.randn(
            n_keys, n_heads * d_head, dtype=p.W_V.dtype, device=device, generator=values
        )
        Y_perp = torch.cat([
            torch.randn(len(range(d_model - n_keys)[rows]), n_heads * d_head,
                        dtype=p.W_V.dtype, device=device, generator=perp)
            for rows in chunks.query_chunks(d_model - n_keys, n_heads * d_head)
        ])  # fmt: skip
        Z = Q @ Y + Q_perp @ Y_perp
        assert_close(keys @ Z, L @ Y, terms=d_model)  # X Z = L Y
        R_V = Z.view(d_model, n_heads, d_head).permute(1, 0, 2)
        factor = iso.draw_scales(target, iso.head_norms_sq(R_V, R_O)).sqrt()[:, None, None]
        yield R_V * factor, R_O * factor


def field_reference(p, n_draws, seed, exclude_sink=False, sequences=None):
    """``[draw, sequence]``: each sequence measured alone, through its own explicit ``Z``."""
    columns = []
    for b in range(p.field.shape[0]) if sequences is None else sequences:
        one = [t[b : b + 1] for t in (p.field, p.walk, p.gates)]
        columns.append(torch.stack([
            ref.field_defect(*one, V, O_, exclude_sink=exclude_sink)[0]
            for V, O_ in implied_value_factors(p, n_draws, seed, b)
        ]))  # fmt: skip
    return torch.stack(columns, 1)


@pytest.mark.parametrize("exclude_sink", [False, True])
@pytest.mark.parametrize("small_chunks", [False, True])
def test_field_draws_through_the_keys_factor_equal_explicit_gaussian_value_factors(
    exclude_sink, small_chunks, monkeypatch
):
    """The route's field baseline == the slow measurement of the Gaussian ``Z`` it stands
    for; with small chunks ``Y`` is not kept (drawn again) and ``Y_perp`` comes in blocks."""
    if small_chunks:
        monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 40)
    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    p = random_problem(seed=4, **KEYED)
    res = residual_of(p, baseline_draws=3, seed=11, exclude_sink=exclude_sink)
    keyed = draws.key_draws(p.W_V.shape, p.W_O.shape, p.W_V.dtype, p.W_V.device, 11, 3, 6)
    assert draws.key_draws.cache_info().hits == 1  # the residual made it
    assert (keyed.kept is None) == small_chunks
    torch.testing.assert_close(
        res.baseline["field_defect"].draws,
        field_reference(p, 3, 11, exclude_sink),
        atol=ATOL[torch.float64],
        rtol=0,
    )
    # the weight-only baselines keep the raw draws of `isometry.random_baselines`
    for name, base in reference_baselines(p, 3, 11, exclude_sink).items():
        if name != "field_defect":
            torch.testing.assert_close(
                res.baseline[name].draws, base, atol=ATOL[torch.float64], rtol=0
            )


def test_field_draws_through_the_keys_factor_without_kept_output_gram_rows(monkeypatch):
    """Raw draws without output-Gram rows: the route's messages go through ``R_O``."""
    monkeypatch.setattr(draws, "OUT_ROWS_BYTES", 0)
    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    p = random_problem(seed=5, **KEYED)
    raw = draws.raw_draws(p.W_V.shape, p.W_O.shape, p.W_V.dtype, p.W_V.device, 2, 2)
    assert all(draw.out_rows is None for draw in raw.draws)
    res = residual_of(p, baseline_draws=2, seed=2)
    torch.testing.assert_close(
        res.baseline["field_defect"].draws,
        field_reference(p, 2, 2),
        atol=ATOL[torch.float64],
        rtol=0,
    )


def test_the_keys_route_draws_the_same_distribution_as_the_direct_one(monkeypatch):
    """Over 160 draws each, the field baseline's mean through the keys' factor and through
    ``X R_V`` agree within four standard errors, and their spreads within 25%."""
    draws.raw_draws.cache_clear()
    p = random_problem(seed=6, **KEYED)
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, p.W_V, p.W_O)
    keyed = walk.laplacian_residual(baseline_draws=160, seed=1).baseline["field_defect"]
    monkeypatch.setattr(draws, "KEY_ROUTE_SHARE", 0.0)  # the direct route
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, p.W_V, p.W_O)
    direct = walk.laplacian_residual(baseline_draws=160, seed=2).baseline["field_defect"]
    error = ((keyed.std**2 + direct.std**2) / 160).sqrt()
    assert ((keyed.mean - direct.mean).abs() < 4 * error).all()
    assert (keyed.std / direct.std > 0.8).all() and (keyed.std / direct.std < 1.25).all()


@pytest.mark.parametrize("case", ["more keys than d_model", "too many keys", "direct"])
def test_the_field_draws_multiply_the_values_where_the_keys_route_does_not_apply(case, monkeypatch):
    """More keys than ``d_model`` (``X X^T`` singular: no sequence factors), more keys than
    pay off, or the route switched off: the field baseline is `isometry.random_baselines`'
    own."""
    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    p = random_problem(seed=7, **{**KEYED, "pos": 30 if case == "more keys than d_model" else 6})
    if case == "more keys than d_model":  # 30 keys in 24 dimensions, the route paid for
        monkeypatch.setattr(draws, "KEY_ROUTE_SHARE", 10.0)
    elif case == "too many keys":  # 6 (24 + 2 12) / (2 24 12) = 0.5
        monkeypatch.setattr(draws, "KEY_ROUTE_SHARE", 0.45)
    else:
        monkeypatch.setattr(draws, "KEY_ROUTE_SHARE", 0.0)
    keys = draws.key_factor(p.field, 2, 12)
    assert keys is None or not keys[1].any()
    res = residual_of(p, baseline_draws=2, seed=3)
    expected = reference_baselines(p, 2, 3)["field_defect"]
    torch.testing.assert_close(
        res.baseline["field_defect"].draws, expected, atol=ATOL[torch.float64], rtol=0
    )
    assert draws.key_draws.cache_info().currsize == 0


@pytest.mark.parametrize("exclude_sink", [False, True])
def test_a_sequence_that_does_not_factor_goes_direct_and_the_others_do_not(exclude_sink):
    """A zero key in sequence 0 (its factorisation fails): that sequence's field baseline is
    `isometry.random_baselines`' own, sequence 1's the route's."""
    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    p = random_problem(seed=9, **KEYED)
    field = p.field.clone()
    field[0, 2] = 0.0
    p = dataclasses.replace(p, field=field)
    assert draws.key_factor(p.field, 3, 12)[1].tolist() == [False, True]
    res = residual_of(p, baseline_draws=3, seed=5, exclude_sink=exclude_sink)
    direct = reference_baselines(p, 3, 5, exclude_sink)["field_defect"]
    keyed = field_reference(p, 3, 5, exclude_sink, sequences=[1])
    expected = torch.stack([direct[:, 0], keyed[:, 0]], 1)
    torch.testing.assert_close(
        res.baseline["field_defect"].draws, expected, atol=ATOL[torch.float64], rtol=0
    )


def test_each_sequences_field_baseline_is_the_same_alone_or_in_a_batch():
    draws.raw_draws.cache_clear()
    p = random_problem(seed=10, **{**KEYED, "batch": 3})
    together = residual_of(p, baseline_draws=2, seed=1).baseline["field_defect"].draws
    for b in range(3):
        alone = dataclasses.replace(p, **{f.name: getattr(p, f.name)[b : b + 1]
                                         for f in dataclasses.fields(p) if f.name in
                                         ("pattern", "field", "mu")})  # fmt: skip
        draws_alone = residual_of(alone, baseline_draws=2, seed=1).baseline["field_defect"].draws
        torch.testing.assert_close(
            draws_alone[:, 0], together[:, b], atol=atol(torch.float64), rtol=0
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_key_factor_is_the_cholesky_factor_of_each_sequences_keys_gram(dtype):
    field = torch.randn(2, 5, 32, dtype=torch.float64)
    L, factored = draws.key_factor(field.to(dtype), n_draws=2, width=32)
    assert factored.tolist() == [True, True]
    assert L.shape == (2, 5, 5) and L.dtype == dtype and torch.equal(L, L.tril())
    assert_close(L.double() @ L.double().mT, field @ field.mT, dtype, terms=field.shape[-1])
    # the cost rule: 5 (32 + 2 w) <= 0.8 (2 32 w) holds from a width of w = 4 on
    assert draws.key_factor(field, n_draws=2, width=3) is None
    assert draws.key_factor(field, n_draws=2, width=4) is not None


def test_layers_of_one_length_share_one_set_of_field_draws():
    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    for seed in (1, 2):
        residual_of(random_problem(seed=seed, **KEYED), baseline_draws=2)
    info = draws.key_draws.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_key_draws_refuse_more_keys_than_d_model():
    with pytest.raises(ConnWalkError, match="at most d_model = 4 keys, got 5"):
        draws.key_draws(torch.Size([1, 4, 2]), torch.Size([1, 2, 4]), torch.float64,
                        torch.device("cpu"), 0, 2, 5)  # fmt: skip


def test_stacked_layer_draws_are_each_layers_draws():
    """Several layers' draws scaled at once equal each layer's `layer_draws`, bit for bit,
    grouped-query sharing included."""
    layers = [random_problem(heads=4, d_model=10, d_head=3, seed=s) for s in range(3)]
    kv_heads = (0, 0, 1, 1)
    norms_sq = torch.stack([iso.head_norms_sq(p.W_V, p.W_O) for p in layers])
    stacked = draws.stacked_layer_draws(
        layers[0].W_V, layers[0].W_O, norms_sq, 3, 5, kv_heads=kv_heads
    )
    for p, made in zip(layers, stacked, strict=True):
        alone = draws.layer_draws(p.W_V, p.W_O, 3, 5, kv_heads=kv_heads)
        assert made.raw is alone.raw
        for name in ("norms_sq", "scales", "K2", "pair_gram", "head_defects"):
            assert torch.equal(getattr(made, name), getattr(alone, name)), name


def test_stacked_layer_draws_need_norms_per_layer_and_head():
    p = random_problem(heads=3, d_model=10, d_head=3, seed=1)
    with pytest.raises(ConnWalkError, match=r"norms_sq \(3,\) must be \[layer, head\] with head=3"):
        draws.stacked_layer_draws(p.W_V, p.W_O, torch.ones(3), 3, 5)
