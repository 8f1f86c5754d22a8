"""Grouped-query attention in the math core (spec §3): the rank of the effective transports is
``min(d_model, H_kv d_head)``, and the random baselines share value heads as the model does.

References: `tl_connwalk.core.reference`, an SVD of every edge's dense transport, and its
random draws, with one Gaussian ``W_V`` per value head.
"""

import functools
import math

import pytest
import torch

from tests.core.problems import F64, random_problem
from tl_connwalk.core import isometry as iso
from tl_connwalk.core import reference as ref
from tl_connwalk.core import value_heads
from tl_connwalk.core._fast import chunks, draws
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk


def defect_tolerance(dtype: torch.dtype, n_heads: int) -> float:
    """Both defects are square roots of a relative spread of singular values; the closed form
    sums ``~H^4`` products whose rounding, relative ``eps`` each, survives the square root."""
    return math.sqrt(n_heads**4 * torch.finfo(dtype).eps)


def grouped_problem(n_heads, n_value, d_model, d_head, *, seed=0, pos=5, batch=2, causal=False):
    """A random problem whose query heads read ``n_value`` shared value heads: ``W_V`` is
    ``[n_value, d_model, d_head]`` (unexpanded), everything else per query head."""
    p = random_problem(batch, n_heads, pos, d_model, d_head, seed=seed, causal=causal)
    gen = torch.Generator().manual_seed(seed + 1000)
    W_V = torch.randn(n_value, d_model, d_head, generator=gen, dtype=F64)
    return p, W_V


# --- the map from query heads to value heads ---


def test_value_head_maps():
    kv = value_heads.grouped_value_heads(9, 3)
    assert kv == tuple(h // 3 for h in range(9))
    assert value_heads.distinct_value_heads(kv, 9) == 3
    assert value_heads.distinct_value_heads(kv, 9, heads=[0, 1, 2]) == 1
    assert value_heads.distinct_value_heads(kv, 9, heads=[2, 3, 8]) == 3
    assert value_heads.distinct_value_heads(None, 9, heads=[2, 3]) == 2
    assert value_heads.transport_rank(576, 64, 3) == 192
    assert value_heads.transport_rank(20, 8, 3) == 20
    assert value_heads.is_shared(kv) and not value_heads.is_shared(tuple(range(9)))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: value_heads.grouped_value_heads(6, 4), "multiple of n_key_value_heads"),
        (lambda: value_heads.grouped_value_heads(6, 0), "positive integer"),
        (lambda: value_heads.check_kv_heads((0, 1), 3), "each of the 3 query heads"),
        (lambda: value_heads.check_kv_heads((0, -1, 1), 3), r"integer in 0\.\.2"),
        (lambda: value_heads.check_kv_heads((0, 3, 1), 3), r"integer in 0\.\.2"),
        (lambda: value_heads.distinct_value_heads(None, 3, heads=[3]), r"in \[0, 3\)"),
    ],
)
def test_bad_maps_are_refused(call, match):
    with pytest.raises(ConnWalkError, match=match):
        call()


def test_walk_expands_value_heads_and_checks_expanded_ones():
    p, W_V = grouped_problem(6, 2, 10, 3)
    b_V = torch.randn(2, 3, dtype=F64)
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, W_V, p.W_O, b_V, p.b_O)
    kv = (0, 0, 0, 1, 1, 1)
    assert walk.kv_heads == kv and walk.n_value_heads == 2
    torch.testing.assert_close(walk.W_V, W_V[list(kv)], rtol=0, atol=0)
    torch.testing.assert_close(walk.b_V, b_V[list(kv)], rtol=0, atol=0)
    # expanded weights with their map: the same walk; a map they do not follow is refused
    again = ConnectionWalk.from_pattern(
        p.pattern, p.field, W_V[list(kv)], p.W_O, b_V[list(kv)], p.b_O, kv_heads=kv
    )
    assert again.kv_heads == kv
    with pytest.raises(ConnWalkError, match="differ"):
        ConnectionWalk.from_pattern(p.pattern, p.field, p.W_V, p.W_O, kv_heads=kv)
    with pytest.raises(ConnWalkError, match="holds 2"):
        ConnectionWalk.from_pattern(p.pattern, p.field, W_V, p.W_O, kv_heads=(0, 0, 1, 1, 2, 2))
    assert "value_heads=2" in repr(walk)


# --- the rank: an SVD of every edge ---


@pytest.mark.parametrize(
    ("n_heads", "n_value", "d_model", "d_head"),
    [
        (6, 2, 20, 3),  # H d_head = 18 != d_model; rank H_kv d_head = 6
        (4, 2, 10, 4),  # H d_head = 16 > d_model = 10 > H_kv d_head = 8
        (6, 3, 8, 4),  # H_kv d_head = 12 > d_model: the rank is d_model's
        (3, 3, 12, 3),  # no sharing: rank H d_head = 9
        (4, 1, 12, 2),  # one value head (Gemma 3, multi-query)
    ],
)
def test_grouped_defects_and_scale_match_an_svd_per_edge(n_heads, n_value, d_model, d_head):
    p, W_V = grouped_problem(n_heads, n_value, d_model, d_head, seed=3)
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, W_V, p.W_O)
    kv = [h // (n_heads // n_value) for h in range(n_heads)]
    rank = min(d_model, n_value * d_head)
    eps = ref.edge_defects(p.gates, W_V[kv], p.W_O, rank)
    delta = ref.edge_defects(p.gates, W_V[kv], p.W_O, rank, "frobenius")
    tol = defect_tolerance(F64, n_heads)
    torch.testing.assert_close(walk.isometry_defects("gram"), eps, atol=tol, rtol=0)
    torch.testing.assert_close(walk.isometry_defects("frobenius"), delta, atol=tol, rtol=0)
    res = walk.laplacian_residual(baseline_draws=2)
    expected = ref.effective_defect(p.walk, p.gates, W_V[kv], p.W_O, kv)
    torch.testing.assert_close(res.transport_defect, expected, atol=tol, rtol=0)
    scale = ref.common_scale(p.walk, p.gates, W_V[kv], p.W_O, kv)
    torch.testing.assert_close(res.scale, scale, rtol=tol, atol=0)
    # the pure functions, given the map
    assert iso.effective_rank(walk.W_V, walk.W_O, walk.kv_heads) == rank
    torch.testing.assert_close(
        iso.effective_transport_defect(p.walk, p.gates, walk.W_V, walk.W_O, kv_heads=kv),
        res.transport_defect, atol=tol, rtol=0,
    )  # fmt: skip
    torch.testing.assert_close(
        iso.common_scale(p.walk, p.gates, walk.W_V, walk.W_O, kv_heads=kv), res.scale
    )


def orthonormal_value_heads(n_value, d_model, d_head, seed=0):
    """``[n_value, d_model, d_head]`` value heads whose columns together are orthonormal."""
    gen = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(d_model, n_value * d_head, generator=gen, dtype=F64)).Q
    return Q.T.reshape(n_value, d_head, d_model).mT


def test_constructed_partial_isometry_has_zero_defects():
    """6 query heads on 2 orthonormal value heads, all attending alike, ``W_O^h = 2
    W_V^{kv(h)T}``: every ``T_ij`` is 6 times a rank-12 projection. Without the map the rank
    would be ``H d_head = 36`` and the defect ``sqrt(1 - 12/36)``."""
    n_heads, n_value, d_model, d_head, pos = 6, 2, 48, 6, 5
    V = orthonormal_value_heads(n_value, d_model, d_head)
    kv = value_heads.grouped_value_heads(n_heads, n_value)
    W_O = 2 * V[list(kv)].mT
    pattern = torch.ones(1, n_heads, pos, pos, dtype=F64).tril()
    pattern = pattern / pattern.sum(-1, keepdim=True)
    field = torch.randn(1, pos, d_model, generator=torch.Generator().manual_seed(1), dtype=F64)
    walk = ConnectionWalk.from_pattern(pattern, field, V, W_O)
    projection = torch.cat(list(V), -1)  # [d_model, 12], orthonormal columns
    torch.testing.assert_close(walk.effective_transport(3, 1).AB[0], 6 * projection @ projection.T)
    tol = defect_tolerance(F64, n_heads)
    on_walk = walk.walk > 0
    for kind in ("gram", "frobenius"):
        assert walk.isometry_defects(kind)[on_walk].abs().max() < tol, kind
    res = walk.laplacian_residual(baseline_draws=2)
    assert res.transport_defect.abs().max() < tol
    torch.testing.assert_close(res.scale, torch.full((1,), 6.0, dtype=F64))
    unmapped = iso.effective_transport_defect(walk.walk, walk.gates, walk.W_V, walk.W_O)
    torch.testing.assert_close(unmapped, torch.full((1,), math.sqrt(2 / 3), dtype=F64))


# --- the random baselines: one Gaussian W_V per value head ---


def test_random_factors_share_value_heads_and_keep_the_norms():
    p, W_V = grouped_problem(6, 2, 10, 3)
    kv = value_heads.grouped_value_heads(6, 2)
    expanded = W_V[list(kv)]
    rand_V, rand_O = iso.random_head_factors(expanded, p.W_O, torch.Generator().manual_seed(2), kv)
    for h in range(6):
        torch.testing.assert_close(rand_V[h], rand_V[3 * (h // 3)], rtol=0, atol=0)
    assert not torch.equal(rand_V[0], rand_V[3])
    torch.testing.assert_close(
        iso.head_norms_sq(rand_V, rand_O), iso.head_norms_sq(expanded, p.W_O)
    )
    # a map without sharing draws the numbers of no map at all (same seed, same draws)
    plain = iso.random_head_factors(p.W_V, p.W_O, torch.Generator().manual_seed(2))
    mapped = iso.random_head_factors(
        p.W_V, p.W_O, torch.Generator().manual_seed(2), tuple(range(6))
    )
    for a, b in zip(plain, mapped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


#: The grouped problem of the baseline test: 4 query heads on 2 value heads, d_model 12.
GROUPED = dict(n_heads=4, n_value=2, d_model=12, d_head=2, seed=7, pos=6, batch=1)


@functools.cache
def own_baseline(shared: bool = True) -> dict[str, torch.Tensor]:
    """Walk-weighted ``eps`` and field CV of 256 `tl_connwalk.core.reference.random_draws`
    (seed 11) on the `GROUPED` problem: Gaussian ``R_V`` per value head, or per query head
    without ``shared``; one SVD per edge. ``[draw, batch]`` each, drawn once for every route."""
    p, W_V = grouped_problem(**GROUPED)
    kv = list(value_heads.grouped_value_heads(GROUPED["n_heads"], GROUPED["n_value"]))
    kv_heads = kv if shared else None

    def measure(V, W_o):
        return torch.stack([
            ref.effective_defect(p.walk, p.gates, V, W_o, kv_heads),
            ref.field_defect(p.field, p.walk, p.gates, V, W_o),
        ])  # fmt: skip

    drawn = ref.random_draws(measure, W_V[kv], p.W_O, 256, 11, kv_heads)
    return {"transport_defect": drawn[:, 0], "field_defect": drawn[:, 1]}


def z_scores(a, b):
    """How many standard errors apart the means and the standard deviations of two samples of
    draws ``[draw, batch]`` are (the standard error of a standard deviation: ``std /
    sqrt(2 (n - 1))``)."""
    n_a, n_b = a.shape[0], b.shape[0]
    mean_se = (a.var(0) / n_a + b.var(0) / n_b).sqrt()
    std_se = (a.var(0) / (2 * (n_a - 1)) + b.var(0) / (2 * (n_b - 1))).sqrt()
    return (a.mean(0) - b.mean(0)).abs() / mean_se, (a.std(0) - b.std(0)).abs() / std_se


@pytest.mark.parametrize("route", ["keys", "keys, drawn again", "direct"])
def test_grouped_baselines_match_draws_with_shared_value_heads(route, monkeypatch):
    """The baselines' mean and spread over draws agree with draws made here, within 4
    standard errors; draws with a ``W_V`` per query head (the model's sharing ignored, and
    the rank ``H d_head`` that goes with them) are many standard errors away."""
    if route == "direct":  # the field draws through R_V itself, not the keys' factor
        monkeypatch.setattr(draws, "KEY_ROUTE_SHARE", 0.0)
    if route == "keys, drawn again":  # factors and values too large to keep: drawn again
        monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 64)
    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    p, W_V = grouped_problem(**GROUPED)
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, W_V, p.W_O)
    res = walk.laplacian_residual(baseline_draws=64, seed=3)
    own = own_baseline()
    for name in ("transport_defect", "field_defect"):
        mean_z, std_z = z_scores(res.baseline[name].draws, own[name])
        assert (mean_z < 4).all() and (std_z < 4).all(), (name, mean_z, std_z)
    unshared = own_baseline(shared=False)
    mean_z, _ = z_scores(res.baseline["transport_defect"].draws, unshared["transport_defect"])
    assert (mean_z > 8).all(), mean_z


def test_grouped_draws_equal_fresh_draws_per_measurement():
    """The draws shared by every layer (`tl_connwalk.core._fast.draws`) are those of
    `isometry.random_baselines` with the same seed and map, measurement by measurement."""
    draws.raw_draws.cache_clear()
    p, W_V = grouped_problem(6, 2, 10, 3, seed=5, causal=True)
    kv = value_heads.grouped_value_heads(6, 2)
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, W_V, p.W_O)
    res = walk.laplacian_residual(baseline_draws=3, seed=11)
    rank = iso.effective_rank(walk.W_V, walk.W_O, kv)
    measures = {
        "head_defects": iso.head_transport_defects,
        "transport_defect": lambda values, outputs: iso.effective_transport_defect(
            p.walk, p.gates, values, outputs, kv_heads=kv
        ),
    }
    expected = iso.random_baselines(measures, walk.W_V, walk.W_O, 3, seed=11, kv_heads=kv)
    for name, base in expected.items():
        torch.testing.assert_close(res.baseline[name].draws, base.draws, msg=name)
    layer = draws.layer_draws(walk.W_V, walk.W_O, 3, 11, kv_heads=kv)
    fresh = torch.Generator().manual_seed(11)
    for factors in layer.factors():
        for got, want in zip(
            factors, iso.random_head_factors(walk.W_V, walk.W_O, fresh, kv), strict=True
        ):
            torch.testing.assert_close(got, want)
    assert rank == 6
