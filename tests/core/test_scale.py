"""Geometry at scale: the mass-share restriction and query chunking.

References: `tl_connwalk.core.reference` chooses the kept edges by a per-row loop and takes
their defects from SVDs of the materialised ``d_model x d_model`` transports (float64, closed
form vs SVD to ``cancelling_atol``: the closed form takes ``sqrt(1 - x)`` near 0). Chunked results,
and the listed-edge path, must equal the whole ones to rounding (`squares_close`).
"""

import json

import pytest
import torch

from tests.core.problems import random_problem
from tests.tolerances import assert_close, atol, cancelling_atol, rtol
from tl_connwalk.core import field_defect, markov
from tl_connwalk.core import isometry as iso
from tl_connwalk.core import reference as ref
from tl_connwalk.core._fast import chunks
from tl_connwalk.core.walk import gates, walk_matrix
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk

CLOSED_FORM_ATOL = cancelling_atol(torch.float64)  # closed form vs per-edge SVD, float64


@pytest.mark.parametrize("share", [0.3, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("causal", [False, True])
def test_heaviest_edges_match_a_row_by_row_reference(share, causal):
    problem = random_problem(2, 3, 7, seed=4, causal=causal)
    keep = iso.heaviest_edges(problem.walk, share)
    torch.testing.assert_close(keep, ref.heaviest_edges(problem.walk, share))
    kept_mass = torch.where(keep, problem.walk, 0.0).sum(-1)
    n_keys = problem.walk.shape[-1]
    assert (kept_mass >= share * problem.walk.sum(-1) - atol(torch.float64, n_keys)).all()
    assert torch.equal(iso.heaviest_edges(problem.walk, 1.0), problem.walk > 0)


@pytest.mark.parametrize("share", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("causal", [False, True])
def test_restricted_defect_matches_materialised_kept_edges(share, causal, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 64)  # several chunks of listed edges
    problem = random_problem(2, 3, 6, d_model=8, d_head=2, seed=1, causal=causal)
    walk, gates = problem.walk, problem.gates
    keep = iso.heaviest_edges(walk, share)
    assert keep.sum() < (walk > 0).sum()  # a real restriction
    result = iso.effective_transport_defect(walk, gates, problem.W_V, problem.W_O, edges=keep)
    expected = ref.effective_defect(walk, gates, problem.W_V, problem.W_O, keep=keep)
    torch.testing.assert_close(result, expected, rtol=0, atol=CLOSED_FORM_ATOL)


def test_listed_edges_equal_the_all_edge_path():
    problem = random_problem(2, 4, 6, d_model=10, d_head=2, seed=2)
    K2, K4 = iso.gram_matrices(problem.W_V, problem.W_O)
    every = iso.edge_gram_defects(problem.gates, K2, K4, 8, problem.walk)
    listed = iso.edge_gram_defects(problem.gates, K2, K4, 8, problem.walk, edges=problem.walk > 0)
    squares_close(listed, every)  # same formula, other summation order
    some = problem.walk > problem.walk.median()
    only = iso.edge_gram_defects(problem.gates, K2, K4, 8, problem.walk, edges=some)
    squares_close(only, torch.where(some, every, 0.0))
    second = some.clone()
    second[0] = False  # no edge listed in the first sequence
    only = iso.edge_gram_defects(problem.gates, K2, K4, 8, problem.walk, edges=second)
    squares_close(only, torch.where(second, every, 0.0))


def walk_of(problem):
    return ConnectionWalk.from_pattern(problem.pattern, problem.field, problem.W_V, problem.W_O)


@pytest.mark.parametrize("exclude_sink", [False, True])
def test_laplacian_residual_mass_share(exclude_sink):
    problem = random_problem(2, 3, 6, d_model=8, d_head=2, seed=5)
    walk = walk_of(problem)
    options = dict(exclude_sink=exclude_sink, baseline_draws=2)
    every = walk.laplacian_residual(**options)
    assert every.mass_share is None and every.mass_covered is None
    full = walk.laplacian_residual(mass_share=1.0, **options)
    assert torch.equal(full.transport_defect, every.transport_defect)
    assert torch.equal(full.baseline["transport_defect"].draws,
                       every.baseline["transport_defect"].draws)  # fmt: skip
    torch.testing.assert_close(full.mass_covered, torch.ones(2, dtype=torch.float64))

    part = walk.laplacian_residual(mass_share=0.8, **options)
    considered = problem.walk.clone()
    if exclude_sink:
        considered[:, :, 0] = 0.0
    keep = ref.heaviest_edges(considered, 0.8)
    expected = ref.effective_defect(
        problem.walk, problem.gates, problem.W_V, problem.W_O, keep=keep
    )
    torch.testing.assert_close(part.transport_defect, expected, rtol=0, atol=CLOSED_FORM_ATOL)
    covered = torch.where(keep, considered, 0.0).sum((1, 2)) / considered.sum((1, 2))
    torch.testing.assert_close(part.mass_covered, covered)
    assert (part.mass_covered >= 0.8).all() and (part.mass_covered < 1).all()
    for name in ("field_defect", "reversibility", "head_defects"):  # untouched
        assert torch.equal(getattr(part, name), getattr(every, name))
    # the scale is over every edge either way (summed in another order with a mass share)
    assert_close(part.scale, every.scale)
    data = json.loads(json.dumps(part.to_dict()))
    assert data["mass_share"] == 0.8 and len(data["mass_covered"]) == 2


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5, float("nan")])
def test_bad_mass_share_is_refused(share):
    with pytest.raises(ConnWalkError, match="mass_share"):
        iso.heaviest_edges(torch.full((1, 2, 2), 0.5), share)


# --- chunking over queries ----------------------------------------------------------------


def squares_close(part, whole):
    """``part^2`` and ``whole^2`` equal up to ``rtol(dtype)`` times the largest.

    The same formula per entry, summed in another order (BLAS blocks a matmul differently for
    a slice than for the whole), so the last bits differ. Every value compared is a square root
    (of a norm, or of ``1 - x`` for the defects, which cancels near 0): its square is compared,
    where the rounding is relative.
    """
    part_sq, whole_sq = part.square(), whole.square()
    r = rtol(whole.dtype)
    scale = max(whole_sq.abs().max().item(), 1e-30)
    torch.testing.assert_close(part_sq, whole_sq, rtol=r, atol=r * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunked_per_edge_measurements_equal_unchunked(dtype, chunk):
    problem = random_problem(2, 4, 7, d_model=10, d_head=2, seed=6, dtype=dtype)
    W, g, X, W_V, W_O = problem.walk, problem.gates, problem.field, problem.W_V, problem.W_O
    K2, K4 = iso.gram_matrices(W_V, W_O)
    KM = iso.head_mixed_gram(W_V, W_O)
    pairs = [
        (
            iso.edge_gram_defects(g, K2, K4, 8, W, query_chunk=chunk),
            iso.edge_gram_defects(g, K2, K4, 8, W),
        ),
        (
            iso.edge_frobenius_scales(g, K2, 8, W, query_chunk=chunk),
            iso.edge_frobenius_scales(g, K2, 8, W),
        ),
        (
            field_defect.message_norm_ratios(X, g, W_V, W_O, query_chunk=chunk),
            field_defect.message_norm_ratios(X, g, W_V, W_O),
        ),
        (
            markov.edge_pairing_residuals(g, K2, KM, query_chunk=chunk),
            markov.edge_pairing_residuals(g, K2, KM),
        ),
    ]
    for chunked, whole in pairs:
        assert chunked.shape == whole.shape == W.shape
        squares_close(chunked, whole)


@pytest.mark.parametrize("chunk", [1, 3, None])
def test_per_edge_work_stops_at_each_chunks_last_edge(chunk):
    """Given the walk, keys past a chunk's last edge are skipped: same values on every edge.

    A causal walk (its future is no edge) with the last key of batch element 0 masked (trailing
    padding), against the same functions without the walk, restricted to the edges.
    """
    problem = random_problem(2, 4, 7, d_model=10, d_head=2, seed=8, causal=True)
    pattern = problem.pattern.clone()
    pattern[0, :, :, -1] = 0.0
    W, g = walk_matrix(pattern), gates(pattern)
    X, W_V, W_O = problem.field, problem.W_V, problem.W_O
    K2, K4 = iso.gram_matrices(W_V, W_O)
    edges = W > 0
    pairs = [
        (
            iso.edge_gram_defects(g, K2, K4, 8, W, query_chunk=chunk),
            iso.edge_gram_defects(g, K2, K4, 8, query_chunk=chunk),
        ),
        (
            iso.edge_frobenius_scales(g, K2, 8, W, query_chunk=chunk),
            iso.edge_frobenius_scales(g, K2, 8, query_chunk=chunk),
        ),
        (
            field_defect.message_norm_ratios(X, g, W_V, W_O, query_chunk=chunk, walk=W),
            field_defect.message_norm_ratios(X, g, W_V, W_O, query_chunk=chunk),
        ),
    ]
    for trimmed, full in pairs:
        squares_close(trimmed[edges], full[edges])
        if chunk == 1:  # one row per chunk: exactly the future of each row is skipped
            future = torch.ones_like(edges).triu(1)
            assert (trimmed[future] == 0).all() and not (full[future] == 0).all()


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_laplacian_residual_equals_unchunked(chunk, dtype):
    problem = random_problem(2, 3, 6, d_model=8, d_head=2, seed=7, dtype=dtype)
    walk = walk_of(problem)
    whole = walk.laplacian_residual(baseline_draws=2, exact=True)
    chunked = walk.laplacian_residual(baseline_draws=2, exact=True, query_chunk=chunk)
    for name in ("transport_defect", "scale", "pairing", "field_defect", "head_field_defects"):
        squares_close(getattr(chunked, name), getattr(whole, name))
    for name in ("transport_defect", "field_defect"):
        squares_close(chunked.baseline[name].draws, whole.baseline[name].draws)
    squares_close(chunked.nearest_operator.distance, whole.nearest_operator.distance)


@pytest.mark.parametrize("chunk", [0, -3])
def test_bad_query_chunk_is_refused(chunk):
    problem = random_problem(1, 2, 3, d_model=4, d_head=2)
    K2 = iso.head_gram(problem.W_V, problem.W_O)
    with pytest.raises(ConnWalkError, match="query_chunk"):
        iso.edge_frobenius_scales(problem.gates, K2, 4, query_chunk=chunk)


@pytest.mark.parametrize("exclude_sink", [False, True])
@pytest.mark.parametrize("silent_key", [None, 2])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_head_field_defects_from_column_weights(exclude_sink, silent_key, chunk):
    problem = random_problem(2, 3, 6, d_model=8, d_head=2, seed=8, causal=True)
    field = problem.field.clone()
    if silent_key is not None:
        field[:, silent_key] = 0.0
    result = field_defect.head_field_isometry_defects(
        field, problem.walk, problem.gates, problem.W_V, problem.W_O,
        exclude_sink=exclude_sink, query_chunk=chunk,
    )  # fmt: skip
    expected = ref.head_field_defects(
        field, problem.walk, problem.gates, problem.W_V, problem.W_O, exclude_sink=exclude_sink
    )
    assert_close(result, expected)
