"""Isometry and Gram defects (spec §3) against dense per-edge SVDs in float64.

The references materialise every edge's ``d_model x d_model`` transport and call
``torch.linalg.svdvals``; the closed forms must agree to ``cancelling_atol`` (absolute, on
values in [0, 1]: the closed forms and the references take ``sqrt(1 - x)`` with ``x ~ 1`` near
0, which keeps half the digits). The singular-value forms sum centred squares: no cancellation.
"""

import inspect
import math

import pytest
import torch
from einops import einsum
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

from tests.core import problems
from tests.tolerances import assert_close, atol, cancelling_atol
from tl_connwalk.core import checks, markov
from tl_connwalk.core import isometry as iso
from tl_connwalk.core import reference as ref
from tl_connwalk.core._fast import chunks, quartic
from tl_connwalk.core._fast import edges as fast_edges
from tl_connwalk.core.checks import abs_maxes
from tl_connwalk.core.walk import gates as split_gates
from tl_connwalk.core.walk import walk_matrix
from tl_connwalk.errors import ConnWalkError

F64 = torch.float64
CLOSED_FORM_ATOL = cancelling_atol(F64)  # closed form vs per-edge SVD, float64


def random_problem(batch=2, heads=3, pos=5, d_model=12, d_head=3, seed=0, causal=False):
    """Pattern, field and head weights in float64 (non-causal by default, so edges go both ways)."""
    p = problems.random_problem(batch, heads, pos, d_model, d_head, seed=seed, causal=causal)
    return p.pattern, p.field, p.W_V, p.W_O


def assert_defects_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=CLOSED_FORM_ATOL)


def orthogonal(d, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=dtype)).Q


def scaled_orthogonal_heads(heads, d_head, scale=2.5, seed=0):
    """Heads whose summed transport is ``scale * Q_V Q_O``: mutually orthogonal blocks."""
    d_model = heads * d_head
    Q_V, Q_O = orthogonal(d_model, seed), orthogonal(d_model, seed + 1)
    W_V = scale * Q_V.reshape(d_model, heads, d_head).permute(1, 0, 2)
    W_O = Q_O.reshape(heads, d_head, d_model)
    return W_V.contiguous(), W_O.contiguous()


# --- defects from singular values -------------------------------------------------------


def test_defects_from_singular_values_match_spec_formulas():
    sigma = torch.rand(4, 6, 7, dtype=F64, generator=torch.Generator().manual_seed(1))
    for r in (1, 3, 7):
        # the reference's 1 - x loses half the digits near 0: compare at CLOSED_FORM_ATOL
        maps = torch.diag_embed(sigma)  # singular values sigma
        assert_defects_close(iso.isometry_defect(sigma, r), ref.isometry_defect(maps, r))
        assert_defects_close(iso.gram_defect(sigma, r), ref.gram_defect(maps, r))
        top = sigma.sort(descending=True).values[..., :r]
        assert_close(iso.frobenius_scale(sigma, r), (top**2).mean(-1).sqrt())


def test_defects_zero_cases_and_conventions():
    equal = torch.full((3,), 2.0, dtype=F64)
    assert iso.isometry_defect(equal, 3) == 0 and iso.gram_defect(equal, 3) == 0
    # the top r only: trailing small values do not count
    assert iso.isometry_defect(torch.tensor([2.0, 2.0, 0.1], dtype=F64), 2) == 0
    # the zero map is the scaled isometry with scale 0: defect 0, not NaN
    zero = torch.zeros(2, 4)
    assert torch.equal(iso.isometry_defect(zero, 4), torch.zeros(2))
    assert torch.equal(iso.gram_defect(zero, 4), torch.zeros(2))
    assert torch.equal(iso.frobenius_scale(zero, 4), torch.zeros(2))
    # rank-deficient: an honest positive defect
    deficient = torch.tensor([1.0, 0.0], dtype=F64)
    assert_close(iso.isometry_defect(deficient, 2), torch.tensor(math.sqrt(0.5), dtype=F64))
    assert_close(iso.gram_defect(deficient, 2), torch.tensor(math.sqrt(0.5), dtype=F64))


def test_the_overflow_check_passes_finite_values_whose_sum_overflows():
    """`_ratio_defect` sums before checking element-wise: finite inputs whose float32 sum is
    Inf still pass, and a single Inf or NaN among them still raises."""
    big = torch.full((4,), 3e38)
    assert torch.equal(checks.ratio_defect(big / 2, big), torch.full((4,), math.sqrt(0.5)))
    for bad in (float("inf"), float("nan")):
        spread = big / 2
        spread[1] = bad
        with pytest.raises(ConnWalkError, match="overflowed"):
            checks.ratio_defect(spread, big)


def test_half_precision_is_computed_in_float32_and_float64_stays():
    sigma = torch.rand(3, 4)
    assert iso.isometry_defect(sigma.to(torch.bfloat16), 4).dtype == torch.float32
    assert iso.gram_defect(sigma.to(torch.float16), 4).dtype == torch.float32
    assert iso.gram_defect(sigma.to(F64), 4).dtype == F64
    _, _, W_V, W_O = random_problem()
    assert iso.head_transport_defects(W_V.half(), W_O.half()).dtype == torch.float32
    K2, K4 = iso.gram_matrices(W_V.bfloat16(), W_O.bfloat16())
    assert K2.dtype == K4.dtype == torch.float32


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: iso.isometry_defect(torch.rand(3), 0), "positive integer"),
        (lambda: iso.gram_defect(torch.rand(3), 4), "only 3 singular values"),
        (lambda: iso.isometry_defect(-torch.rand(3), 2), "finite and >= 0"),
        (lambda: iso.gram_defect(torch.tensor([1.0, float("nan")]), 2), "finite"),
        (lambda: iso.frobenius_scale(torch.rand(3), True), "positive integer"),
        (lambda: iso.random_baseline(iso.head_transport_defects, *random_problem()[2:], 1), ">= 2"),
        (
            lambda: iso.walk_weighted_mean(torch.rand(1, 3, 3) - 1, torch.rand(1, 3, 3)),
            "negative",
        ),
    ],
)
def test_bad_input_raises_conn_walk_error(call, match):
    with pytest.raises(ConnWalkError, match=match):
        call()


@pytest.mark.parametrize(
    "measure",
    [
        lambda walk: iso.walk_weighted_mean(walk, torch.ones_like(walk)),
        lambda walk: iso.walk_weighted_cv(walk, torch.ones_like(walk)),
        lambda walk: markov.stochasticity_residual(walk),
    ],
)
def test_a_negative_walk_entry_is_located_and_explained(measure):
    walk = torch.softmax(torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0)), -1)
    walk[1, 2, 3] = -0.25
    walk[1, 3, 0] = -0.5
    message = (
        r"walk has 2 negative entries, the first at batch 1, query 2, key 3 \(-0.25\); a walk "
        r"matrix is >= 0 \(spec §1\).*hook_pattern.*Pass a walk of attention probabilities"
    )
    with pytest.raises(ConnWalkError, match=message):
        measure(walk)


def test_mismatched_shapes_are_refused():
    pattern, _, W_V, W_O = random_problem(heads=3)
    K2, K4 = iso.gram_matrices(W_V, W_O)
    bad_gates = split_gates(pattern[:, :2])
    # under test the runtime shape checker answers first ...
    with pytest.raises(TypeCheckError):
        iso.edge_gram_defects(bad_gates, K2, K4, rank=9)
    # ... and without it (production) our own checks do
    with pytest.raises(ConnWalkError, match="head=3"):
        inspect.unwrap(iso.edge_gram_defects)(bad_gates, K2, K4, rank=9)
    with pytest.raises(ConnWalkError, match="do not compose"):
        inspect.unwrap(iso.head_singular_values)(W_V, W_O[:, :, :5])
    with pytest.raises(ConnWalkError, match="True or False"):
        inspect.unwrap(iso.walk_weighted_mean)(pattern[:, 0], pattern[:, 0], exclude_sink=1)


# --- head transports and Grams ----------------------------------------------------------


@pytest.mark.parametrize(("d_model", "d_head"), [(12, 3), (5, 7)])
def test_head_transport_defects_match_dense_svd(d_model, d_head):
    _, _, W_V, W_O = random_problem(heads=4, d_model=d_model, d_head=d_head)
    dense = torch.linalg.svdvals(W_V @ W_O)
    r = min(d_model, d_head)
    assert_close(iso.head_singular_values(W_V, W_O), dense[:, :r])
    assert_defects_close(iso.head_transport_defects(W_V, W_O), ref.head_defects(W_V, W_O))


def test_head_transport_defects_zero_for_scaled_partial_isometries_and_zero_heads():
    W_V, W_O = scaled_orthogonal_heads(heads=4, d_head=3)
    W_V[1] *= 7.0  # each head its own scale: still a scaled partial isometry
    W_V[2] = 0.0  # a dead head: 0 by convention
    defects = iso.head_transport_defects(W_V, W_O)
    # centred: the rounding of the singular values, not its square root
    torch.testing.assert_close(defects, torch.zeros(4, dtype=F64), rtol=0, atol=atol(F64))


def test_gram_matrices_match_dense_traces(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 40)  # several blocks of b
    _, _, W_V, W_O = random_problem(heads=3)
    T = W_V @ W_O
    K2, K4 = iso.gram_matrices(W_V, W_O)
    ref2 = einsum(T, T, "a i j, b i j -> a b")
    assert_close(K2, ref2)
    assert_close(iso.head_gram(W_V, W_O), ref2)
    ref4 = torch.zeros(3, 3, 3, 3, dtype=F64)
    for a, b, c, e in torch.cartesian_prod(*[torch.arange(3)] * 4).tolist():
        ref4[a, b, c, e] = torch.trace(T[b].T @ T[a] @ T[c].T @ T[e])
    assert_close(K4, ref4)
    assert_close(iso.head_mixed_gram(W_V, W_O), einsum(T, T, "a i j, b j i -> a b"))


# --- effective transports ---------------------------------------------------------------


@pytest.mark.parametrize("heads", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_edge_gram_defects_match_per_edge_svd(heads, causal, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 200)  # chunk the queries
    pattern, _, W_V, W_O = random_problem(heads=heads, causal=causal, seed=heads)
    walk, g = walk_matrix(pattern), split_gates(pattern)
    r = iso.effective_rank(W_V, W_O)
    assert r == min(12, 3 * heads)
    sigma = torch.linalg.svdvals(ref.effective_transports(g, W_V, W_O))
    K2, K4 = iso.gram_matrices(W_V, W_O)
    expected = torch.where(walk > 0, ref.edge_defects(g, W_V, W_O, r), 0.0)
    eps = iso.edge_gram_defects(g, K2, K4, r, walk)
    torch.testing.assert_close(eps, expected, rtol=0, atol=CLOSED_FORM_ATOL)
    assert ((eps == 0) | (walk > 0)).all()  # 0 off the walk
    assert torch.equal(iso.folded_edge_gram_defects(g, K2, iso.fold_pairs(K4), r, walk), eps)
    scales = iso.edge_frobenius_scales(g, K2, r)
    assert_close(scales, ((sigma**2).sum(-1) / r).sqrt())
    # delta "where affordable": per-edge SVD of the small cores
    sv = iso.edge_singular_values(g, W_V, W_O)
    assert_close(sv, sigma[..., :r])
    torch.testing.assert_close(
        iso.isometry_defect(sv, r),
        ref.edge_defects(g, W_V, W_O, r, "frobenius"),
        rtol=0,
        atol=CLOSED_FORM_ATOL,
    )


def test_gates_too_small_for_normal_products_leave_the_float32_defects_as_they_are():
    """Heads that leave one another gates of 1e-20 to 1e-40 (a head per edge takes nearly all
    the mass): their products in the quartic forms would be subnormal; the forms drop them,
    and the float32 defects stay within float32's tolerance of the float64 reference."""
    pattern, _, W_V, W_O = random_problem(heads=4, causal=True, seed=11)
    # each edge's mass mostly on one head: the others get 10^-20 to 10^-40 of it, or 0.3
    gen = torch.Generator().manual_seed(11)
    leader = torch.randint(0, 4, pattern.shape[:1] + pattern.shape[2:], generator=gen)
    tiny = 10.0 ** -torch.randint(20, 41, pattern.shape, generator=gen).to(pattern)
    tiny = torch.where(
        torch.rand(pattern.shape, generator=gen, dtype=pattern.dtype) < 0.5, tiny, 0.3
    )
    share = torch.where(torch.arange(4)[:, None, None] == leader[:, None], 1.0, tiny)
    peaked = pattern * share  # rows no longer sum to 1 per head: renormalise them
    peaked = peaked / peaked.sum(-1, keepdim=True)
    walk, g = walk_matrix(peaked), split_gates(peaked)
    assert ((g > 0) & (g < torch.finfo(torch.float32).tiny ** 0.25)).any()
    r = iso.effective_rank(W_V, W_O)
    expected = torch.where(walk > 0, ref.edge_defects(g, W_V, W_O, r), 0.0)
    K2, K4 = (t.float() for t in iso.gram_matrices(W_V, W_O))
    got = iso.edge_gram_defects(g.float(), K2, K4, r, walk.float())
    gap = (got.double() - expected).abs().max().item()
    assert gap <= cancelling_atol(torch.float32), gap
    # the forms themselves: as the gates' own, to float32's rounding of their sums
    rows = quartic.quartic_rows(K2[None], iso.fold_pairs(K4)[None])
    listed = g.float()[0].flatten(1)  # [head, edge]
    kept = quartic.forms(listed, rows, listed.shape[1])
    _, s2 = fast_edges._family_gram_defects(listed, rows, r)
    assert_close(s2 / 4**2, kept[1], torch.float32)


def test_edge_blocks_split_the_edges_without_changing_them(monkeypatch):
    pattern, _, W_V, W_O = random_problem(heads=4, causal=True, seed=7)
    K2, K4 = iso.gram_matrices(W_V, W_O)
    rows = quartic.quartic_rows(torch.stack([K2, 2 * K2]), torch.stack([iso.fold_pairs(K4)] * 2))
    listed = split_gates(pattern)[0].flatten(1)  # [head, edge]
    whole = fast_edges._family_gram_defects(listed, rows, rank=8)
    monkeypatch.setattr(chunks, "EDGE_BLOCK", 4)  # several blocks, the last one partial
    assert listed.shape[1] % 4 != 0
    blocked = fast_edges._family_gram_defects(listed, rows, rank=8)
    for got, expected in zip(blocked, whole, strict=True):
        assert_close(got, expected)
    # accelerators: blocks as wide as the device's budget of products allows (at least one
    # edge), whatever EDGE_BLOCK is; a GPU of DEVICE_MEMORY here
    monkeypatch.setattr(chunks, "_memory_of", lambda device: None)
    cuda = torch.device("cuda")
    assert chunks.edge_block(torch.device("cpu"), rows) == 4
    width = chunks.edge_block(cuda, rows)
    budget = chunks.DEVICE_MEMORY // chunks.DEVICE_MEMORY_SHARE
    assert width == budget // (rows.outputs * rows.families) > 4
    assert rows.outputs * rows.families * width <= budget
    monkeypatch.setattr(chunks, "DEVICE_BLOCK_ENTRIES", 3 * rows.outputs * rows.families)
    assert chunks.edge_block(cuda, rows) == 3
    monkeypatch.setattr(chunks, "DEVICE_BLOCK_ENTRIES", 1)
    assert chunks.edge_block(cuda, rows) == 1


def test_edge_gram_defects_zero_for_scaled_orthogonal_transport():
    W_V, W_O = scaled_orthogonal_heads(heads=3, d_head=4, scale=0.3)
    pattern, *_ = random_problem(heads=3, causal=True)
    uniform = torch.full_like(pattern, 1 / 3)  # T_ij = 0.3 Q_V Q_O on every edge
    walk = walk_matrix(pattern)
    eps = iso.edge_gram_defects(uniform, *iso.gram_matrices(W_V, W_O), rank=12, walk=walk)
    torch.testing.assert_close(eps, torch.zeros_like(eps), rtol=0, atol=CLOSED_FORM_ATOL)
    scale = iso.common_scale(walk, uniform, W_V, W_O)
    assert_close(scale, torch.full((2,), 0.3, dtype=F64))
    defect = iso.effective_transport_defect(walk, uniform, W_V, W_O)
    torch.testing.assert_close(defect, torch.zeros(2, dtype=F64), rtol=0, atol=CLOSED_FORM_ATOL)
    # all-zero maps: 0, not NaN
    zero = iso.edge_gram_defects(uniform, *iso.gram_matrices(0 * W_V, W_O), rank=12)
    assert torch.equal(zero, torch.zeros_like(zero))


# --- walk-weighted summaries ------------------------------------------------------------


def test_walk_weighted_mean_and_cv():
    gen = torch.Generator().manual_seed(3)
    walk = torch.rand(2, 4, 4, generator=gen, dtype=F64)
    values = torch.rand(2, 4, 4, generator=gen, dtype=F64)
    assert_close(iso.walk_weighted_mean(walk, values), (walk * values).sum((1, 2)) / 4)
    p = walk / walk.sum((1, 2), keepdim=True)
    mean = (p * values).sum((1, 2))
    std = (p * (values - mean[:, None, None]) ** 2).sum((1, 2)).sqrt()
    assert_close(iso.walk_weighted_cv(walk, values), std / mean)
    # a restriction renormalises rows and averages over the rows that keep mass
    edges = torch.zeros(2, 4, 4, dtype=torch.bool)
    edges[:, 1, 2] = edges[:, 1, 3] = edges[:, 3, 0] = True
    row1 = (walk[:, 1, 2] * values[:, 1, 2] + walk[:, 1, 3] * values[:, 1, 3]) / (
        walk[:, 1, 2] + walk[:, 1, 3]
    )
    expected = (row1 + values[:, 3, 0]) / 2
    assert_close(iso.walk_weighted_mean(walk, values, edges=edges), expected)
    # values off the walk never count, not even NaN
    holes = walk.clone()
    holes[:, 0, 1] = 0.0
    poisoned = values.clone()
    poisoned[:, 0, 1] = float("nan")
    assert_close(iso.walk_weighted_mean(holes, poisoned), (holes * values).sum((1, 2)) / 4)
    assert torch.isfinite(iso.walk_weighted_cv(holes, poisoned)).all()
    # nothing left: 0
    only_sink = torch.zeros(2, 4, 4, dtype=F64)
    only_sink[:, :, 0] = 1.0
    assert torch.equal(iso.walk_weighted_mean(only_sink, values, exclude_sink=True), torch.zeros(2))
    assert torch.equal(iso.walk_weighted_cv(only_sink, values, exclude_sink=True), torch.zeros(2))
    assert torch.equal(iso.walk_weighted_cv(walk, 0 * values), torch.zeros(2, dtype=F64))


# --- random baseline --------------------------------------------------------------------


def test_random_baseline_matches_norms_and_is_reproducible():
    _, _, W_V, W_O = random_problem(heads=4)
    W_V[3] = 0.0
    rand_V, rand_O = iso.random_head_factors(W_V, W_O, torch.Generator().manual_seed(5))
    assert rand_V.shape == W_V.shape and rand_O.shape == W_O.shape
    assert_close(iso.head_gram(rand_V, rand_O).diagonal(), iso.head_gram(W_V, W_O).diagonal())
    first = iso.random_baseline(iso.head_transport_defects, W_V, W_O, 5, seed=7)
    again = iso.random_baseline(iso.head_transport_defects, W_V, W_O, 5, seed=7)
    assert torch.equal(first.draws, again.draws) and first.n_draws == 5
    assert first.mean.shape == first.std.shape == (4,)
    assert_close(first.std, first.draws.std(0))
    assert (first.draws[:, :3] > 0).all() and (first.draws[:, 3] == 0).all()
    other = iso.random_baseline(
        iso.head_transport_defects, W_V, W_O, 5, seed=torch.Generator().manual_seed(8)
    )
    assert not torch.equal(first.draws, other.draws)
    assert set(first.to_dict()) == {"mean", "std", "se", "n_draws", "sampled_edges"}


def test_random_baseline_for_the_effective_defect():
    pattern, _, W_V, W_O = random_problem(causal=True)
    walk, g = walk_matrix(pattern), split_gates(pattern)
    base = iso.random_baseline(
        lambda V, O: iso.effective_transport_defect(walk, g, V, O),  # noqa: E741
        W_V,
        W_O,
        n_draws=3,
    )
    assert base.draws.shape == (3, 2) and torch.isfinite(base.draws).all()


# --- invariances ------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    scale=st.floats(1e-3, 1e3),
    causal=st.booleans(),
)
def test_defects_invariant_under_scaling_rotations_and_gauge(heads, seed, scale, causal):
    pattern, _, W_V, W_O = random_problem(
        heads=heads, pos=4, d_model=6, d_head=2, seed=seed, causal=causal
    )
    g, r = split_gates(pattern), min(6, 2 * heads)
    U, V = orthogonal(6, seed), orthogonal(6, seed + 1)
    gauge = torch.randn(heads, 2, 2, dtype=F64, generator=torch.Generator().manual_seed(seed))
    gauge = gauge + 3 * torch.eye(2, dtype=F64)  # invertible
    variants = [
        (scale * W_V, W_O),  # T -> c T
        (U @ W_V, W_O @ V),  # T -> U T V
        (W_V @ gauge, torch.linalg.solve(gauge, W_O)),  # same T^h, other factors
    ]
    base_eps = iso.edge_gram_defects(g, *iso.gram_matrices(W_V, W_O), r)
    base_delta = iso.head_transport_defects(W_V, W_O)
    # sums over the 6 x 6 entries of the head maps' products and over head quadruples (K4);
    # the gauge's solve loses its condition number's worth of digits in each head map, and a
    # K4 entry is a product of four of them
    terms = 6 * 6 * heads**4
    conditioned = atol(F64, terms, scale=4 * torch.linalg.cond(gauge).max().item())
    for V_, O_ in variants:
        eps = iso.edge_gram_defects(g, *iso.gram_matrices(V_, O_), r)
        # eps = sqrt(1 - x) cancels near 0: compare eps^2 = 1 - x, whose rounding is linear
        torch.testing.assert_close(eps.square(), base_eps.square(), rtol=0, atol=conditioned)
        torch.testing.assert_close(
            iso.head_transport_defects(V_, O_), base_delta, rtol=0, atol=conditioned
        )


@settings(max_examples=25, deadline=None)
@given(
    sigma=st.lists(st.floats(0, 1e3), min_size=1, max_size=6),
    scale=st.floats(1e-3, 1e3),
    data=st.data(),
)
def test_singular_value_defects_are_scale_and_order_invariant(sigma, scale, data):
    values = torch.tensor(sigma, dtype=F64)
    r = data.draw(st.integers(1, len(sigma)))
    perm = torch.tensor(data.draw(st.permutations(range(len(sigma)))))
    for fn in (iso.isometry_defect, iso.gram_defect):
        base = fn(values, r)
        assert torch.isfinite(base) and 0 <= base <= 1
        tol = atol(F64, len(sigma))  # centred sums of len(sigma) terms
        torch.testing.assert_close(fn(scale * values, r), base, rtol=0, atol=tol)
        torch.testing.assert_close(fn(values[perm], r), base, rtol=0, atol=tol)


# --- helpers ---------------------------------------------------------------------------


def test_abs_maxes_are_each_abs_max_read_at_once():
    tensors = [torch.randn(3, 4, dtype=F64).T, torch.zeros(0), -torch.rand(5), torch.ones(2, 2)]
    tensors[3][0, 1] = float("nan")
    peaks = abs_maxes(tensors)
    assert (
        peaks[:3]
        == [iso.abs_max(t) for t in tensors[:3]]
        == [float(tensors[0].abs().max()), 0.0, float(tensors[2].abs().max())]
    )
    assert math.isnan(peaks[3])
    assert abs_maxes([]) == []


def test_abs_max_reads_any_layout_in_memory_order():
    base = torch.randn(4, 6, 5, dtype=F64)
    layouts = {
        "contiguous": base,
        "permuted": base.permute(2, 0, 1),  # a transposed view, like a Bridge's W_V
        "strided": base[:, ::2],  # not a permutation of contiguous memory: read as it is
    }
    for name, tensor in layouts.items():
        ordered = iso.in_memory_order(tensor)
        assert ordered.is_contiguous() == (name != "strided"), name
        assert torch.equal(ordered.flatten().sort().values, tensor.flatten().sort().values)
        assert iso.abs_max(tensor) == float(tensor.abs().max()), name
    assert iso.abs_max(-base) == float(base.abs().max())
    assert iso.abs_max(torch.empty(0, 3)) == 0.0
    with_nan = base.permute(2, 0, 1).clone()
    with_nan[1, 2, 3] = float("nan")
    assert math.isnan(iso.abs_max(with_nan))
    assert iso.abs_max(torch.tensor([float("-inf"), 1.0])) == math.inf
