"""The nearest random-walk connection operator (spec §4) against dense references in float64.

`tl_connwalk.core.reference.nearest_operator_distance` sums ``||W_ij T_ij - W*_ij s O*_ij||_F^2``
edge by edge over dense maps; the chunked edge sums must agree to `dense_atol` (float64
rounding times the condition number of the maps whose polar factors enter). The polar factor
itself is checked against ``B (B^T B)^{-1/2}`` (an eigendecomposition, not an SVD). Exactness
tests use generic transports with ``d_model <= H d_head``, whose symmetrisations are invertible,
so the polar factor is unique and the SVD's arbitrary null-space choice never enters.
"""

import inspect
import math

import pytest
import torch
from jaxtyping import TypeCheckError

from tests.core import problems
from tests.tolerances import assert_close, atol, rtol
from tl_connwalk.core import laplacian as lap
from tl_connwalk.core import reference as ref
from tl_connwalk.core._fast import chunks
from tl_connwalk.core.isometry import common_scale
from tl_connwalk.core.markov import stationary_distribution
from tl_connwalk.errors import ConnWalkError

F64 = torch.float64
# half-sample estimates (32 of 64 edges) over 200 seeds vs the exact distance: median relative
# error below 10% (measured 3.8%), 90% of them within 20% (8.7%), their mean within 3% (0.5%)
SAMPLE_MEDIAN_RTOL, SAMPLE_P90_RTOL, SAMPLE_MEAN_RTOL = 0.1, 0.2, 0.03
# the sampled sums are unbiased: their means over 200 seeds within 4 standard errors (0.44
# and 0.84) and 3% (0.6% and 1.5%) of the exact sums
SAMPLE_Z = 4.0


def random_problem(batch=2, heads=2, pos=4, d_model=4, d_head=3, seed=0, causal=False):
    """Walk, gates, head weights and a positive mu of `tests.core.problems.random_problem`."""
    p = problems.random_problem(batch, heads, pos, d_model, d_head, seed=seed, causal=causal)
    return p.walk, p.gates, p.W_V, p.W_O, p.mu


def ref_polar(B):
    """``B (B^T B)^{-1/2}`` through an eigendecomposition (B invertible)."""
    values, vectors = torch.linalg.eigh(B.T @ B)
    return B @ vectors @ torch.diag(values.rsqrt()) @ vectors.T


def dense_atol(gates, W_V, W_O):
    """Tolerance of the chunked distance against the reference: float64 rounding over the
    ``n^2 d^2`` entries of the Frobenius norms, times the largest condition number of the
    symmetrised transports ``(T_ij + T_ji^T) / 2`` (a polar factor's error is its map's
    condition number times the rounding)."""
    heads = W_V.shape[0]
    T = heads * torch.einsum("bhij,hdk,hke->bijde", gates, W_V, W_O)
    cond = torch.linalg.cond((T + T.transpose(1, 2).mT) / 2)
    n, d = T.shape[1], T.shape[-1]
    return atol(F64, n * n * d * d, scale=cond[cond.isfinite()].max().item())


def unchecked(fn):
    """``fn`` without the jaxtyping/beartype wrapper the test run adds, to reach our own checks."""
    return inspect.unwrap(fn)


# --- against the dense reference --------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_distance_matches_dense_block_matrices(causal, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 3 * lap._TENSORS_PER_EDGE * 4 * 6)  # 3 edges/chunk
    walk, gates, W_V, W_O, mu = random_problem(causal=causal, seed=1)
    scale = torch.tensor([0.7, 2.0], dtype=F64)
    result = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, scale)
    expected = ref.nearest_operator_distance(walk, gates, W_V, W_O, mu, scale)
    torch.testing.assert_close(result.distance, expected, rtol=0, atol=dense_atol(gates, W_V, W_O))
    assert result.exact and result.n_edges == result.n_sampled == (16, 16)
    assert result.distance.dtype == F64
    # a plain number is the same scale for every batch element
    same = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, 0.7)
    torch.testing.assert_close(
        same.distance[0], expected[0], rtol=0, atol=dense_atol(gates, W_V, W_O)
    )


def test_distance_with_stationary_mu_and_common_scale_matches_reference():
    walk, gates, W_V, W_O, _ = random_problem(pos=5, heads=3, d_model=5, d_head=2, seed=2)
    mu = stationary_distribution(walk)
    scale = common_scale(walk, gates, W_V, W_O)
    result = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, scale)
    expected = ref.nearest_operator_distance(walk, gates, W_V, W_O, mu, scale)
    torch.testing.assert_close(result.distance, expected, rtol=0, atol=dense_atol(gates, W_V, W_O))
    # the norms are the two Frobenius norms themselves
    heads_T = torch.einsum("hdk,hke->hde", W_V, W_O)
    T = 3 * torch.einsum("bhij,hde->bijde", gates, heads_T)
    norm = (walk[..., None, None] * T).square().sum((1, 2, 3, 4)).sqrt()
    assert_close(result.operator_norm, norm)
    assert_close(result.difference_norm, result.distance * norm)


def test_empty_rows_stay_empty():
    walk, gates, W_V, W_O, mu = random_problem(batch=1, pos=4)
    walk = walk.clone()
    walk[:, 2, :] = 0.0  # nothing leaves 2 ...
    mu = mu.clone()
    mu[:, 3] = 0.0  # ... and 3 has no measure, so what leaves 3 does not count
    walk[:, :, 2] = 0.0  # nothing enters 2: row 2 of M is empty
    reversed_walk = lap.reversibilised_walk(walk, mu)
    assert torch.equal(reversed_walk[0, 2], torch.zeros(4, dtype=F64))
    assert_close(reversed_walk.sum(-1)[0, [0, 1, 3]], torch.ones(3, dtype=F64))
    assert_close(reversed_walk[0, 3, 3], torch.tensor(0.0, dtype=F64))
    result = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, 1.5)
    expected = ref.nearest_operator_distance(
        walk, gates, W_V, W_O, mu, torch.tensor([1.5], dtype=F64)
    )
    torch.testing.assert_close(result.distance, expected, rtol=0, atol=dense_atol(gates, W_V, W_O))
    # edges: W > 0 or W* > 0; row and column 2 have neither
    assert result.n_edges == (9,)


# --- the zero and the known cases -------------------------------------------------------


def reversible_problem(n=6, d=4, s=1.7, seed=3):
    """A walk reversible w.r.t. a non-uniform mu and one head ``s Q``, ``Q`` a reflection."""
    gen = torch.Generator().manual_seed(seed)
    flow = torch.rand(n, n, generator=gen, dtype=F64)
    flow = flow + flow.T  # M symmetric: W = diag(mu)^-1 M is reversible w.r.t. mu = rowsum(M)
    mu = flow.sum(-1)
    walk = (flow / mu[:, None])[None]
    v = torch.randn(d, 1, generator=gen, dtype=F64)
    reflection = torch.eye(d, dtype=F64) - 2 * v @ v.T / (v.T @ v)
    W_V, W_O = (s * reflection)[None], torch.eye(d, dtype=F64)[None]
    return walk, torch.ones(1, 1, n, n, dtype=F64), W_V, W_O, mu[None]


def test_zero_distance_for_a_scaled_connection_laplacian():
    walk, gates, W_V, W_O, mu = reversible_problem()
    assert_close(lap.reversibilised_walk(walk, mu), walk)
    scale = common_scale(walk, gates, W_V, W_O)
    assert_close(scale, torch.tensor([1.7], dtype=F64))
    result = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, scale)
    zero = torch.zeros(1, dtype=F64)
    tol = dense_atol(gates, W_V, W_O)  # already a scaled connection Laplacian
    torch.testing.assert_close(result.distance, zero, rtol=0, atol=tol)
    # twice the scale: P* = 2P, so ||P - P*|| / ||P|| = 1
    doubled = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, 2 * scale)
    assert_close(doubled.distance, torch.ones(1, dtype=F64))
    # scale 0: P* = 0, distance 1
    zero = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, 0.0)
    assert_close(zero.distance, torch.ones(1, dtype=F64))


def test_zero_walk_is_zero_distance_and_zero_transports_are_infinite():
    walk, gates, W_V, W_O, mu = reversible_problem()
    empty = lap.nearest_connection_operator_distance(
        torch.zeros_like(walk), gates, W_V, W_O, mu, 1.0
    )
    assert empty.distance.tolist() == [0.0] and empty.n_edges == (0,) and empty.exact
    dead = lap.nearest_connection_operator_distance(walk, gates, 0 * W_V, W_O, mu, 1.0)
    assert dead.distance.tolist() == [math.inf]
    assert torch.isfinite(dead.difference_norm).all()
    still = lap.nearest_connection_operator_distance(walk, gates, 0 * W_V, W_O, mu, 0.0)
    assert still.distance.tolist() == [0.0]


def test_polar_factor():
    gen = torch.Generator().manual_seed(4)
    B = torch.randn(3, 5, 5, generator=gen, dtype=F64)
    # the reference goes through B^T B: the rounding times the condition number squared
    tol = atol(F64, 5, scale=torch.linalg.cond(B).max().item() ** 2)
    torch.testing.assert_close(
        lap.polar_factor(B), torch.stack([ref_polar(b) for b in B]), rtol=0, atol=tol
    )
    # singular and zero maps: still orthogonal, never NaN
    singular = torch.stack(
        [B[0] @ torch.diag(torch.tensor([1.0, 1, 0, 0, 0], dtype=F64)), 0 * B[1]]
    )
    orth = lap.polar_factor(singular)
    assert_close(orth @ orth.mT, torch.eye(5, dtype=F64).expand(2, 5, 5))
    assert lap.polar_factor(B.half()).dtype == torch.float32


# --- sampling ---------------------------------------------------------------------------


def test_sample_covering_all_edges_is_exact():
    walk, gates, W_V, W_O, mu = random_problem(pos=5)
    exact = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, 1.0)
    covering = lap.nearest_connection_operator_distance(
        walk, gates, W_V, W_O, mu, 1.0, max_edges=25, seed=7
    )
    assert covering.exact and covering.n_sampled == covering.n_edges == (25, 25)
    torch.testing.assert_close(
        covering.distance, exact.distance, rtol=0, atol=dense_atol(gates, W_V, W_O)
    )


def test_sampled_estimate_is_close_and_its_sums_unbiased():
    walk, gates, W_V, W_O, mu = random_problem(batch=1, pos=8, seed=5)
    scale = common_scale(walk, gates, W_V, W_O)
    exact = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, scale)
    runs = [
        lap.nearest_connection_operator_distance(
            walk, gates, W_V, W_O, mu, scale, max_edges=32, seed=seed
        )
        for seed in range(200)
    ]
    assert all(not r.exact and r.n_edges == (64,) and r.n_sampled == (32,) for r in runs)
    distances = torch.cat([r.distance for r in runs])
    error = (distances / exact.distance - 1).abs()
    assert error.median() < SAMPLE_MEDIAN_RTOL and error.quantile(0.9) < SAMPLE_P90_RTOL
    assert (distances.mean() / exact.distance - 1).abs() < SAMPLE_MEAN_RTOL
    for field in ("difference_norm", "operator_norm"):
        sums = torch.cat([getattr(r, field) ** 2 for r in runs])
        target = getattr(exact, field) ** 2
        assert (sums.mean() - target).abs() < SAMPLE_Z * sums.std() / math.sqrt(len(runs))
        assert (sums.mean() / target - 1).abs() < SAMPLE_MEAN_RTOL
    # a seed is a seed
    again = lap.nearest_connection_operator_distance(
        walk, gates, W_V, W_O, mu, scale, max_edges=32, seed=3
    )
    assert torch.equal(again.distance, runs[3].distance)
    assert again.to_dict() == runs[3].to_dict() != runs[4].to_dict()
    assert again.to_dict()["seed"] == 3 and again.to_dict()["exact"] is False


def test_sampling_only_where_needed_per_batch_element():
    walk, gates, W_V, W_O, mu = random_problem(batch=2, pos=4)
    walk = walk.clone()
    walk[1, :, 2:] = 0.0  # batch element 1: edges only among keys 0, 1 (and their reverses)
    result = lap.nearest_connection_operator_distance(
        walk, gates, W_V, W_O, mu, 1.0, max_edges=12, seed=0
    )
    assert result.n_edges == (16, 12) and result.n_sampled == (12, 12) and not result.exact
    exact = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, 1.0)
    assert torch.equal(result.distance[1], exact.distance[1])


# --- dtypes and bad input ---------------------------------------------------------------


def test_results_are_float32_or_wider():
    walk, gates, W_V, W_O, mu = random_problem()
    half = lap.nearest_connection_operator_distance(
        walk.half(), gates.half(), W_V.half(), W_O.half(), mu.half(), 1.0
    )
    assert half.distance.dtype == torch.float32
    single = lap.nearest_connection_operator_distance(
        walk.float(), gates.float(), W_V.float(), W_O.float(), mu.float(), 1.0
    )
    assert single.distance.dtype == torch.float32
    exact = lap.nearest_connection_operator_distance(walk, gates, W_V, W_O, mu, 1.0)
    torch.testing.assert_close(
        single.distance.double(), exact.distance, rtol=rtol(torch.float32), atol=0
    )
    assert lap.reversibilised_walk(walk.half(), mu.half()).dtype == torch.float32


def test_mismatched_shapes_are_refused():
    walk, gates, W_V, W_O, mu = random_problem(heads=2)
    fn = lap.nearest_connection_operator_distance
    # under test the runtime shape checker answers first ...
    with pytest.raises(TypeCheckError):
        fn(walk, gates, W_V, W_O, mu[:, :3], 1.0)
    # ... and without it (production) our own checks do
    with pytest.raises(ConnWalkError, match="mu"):
        unchecked(fn)(walk, gates, W_V, W_O, mu[:, :3], 1.0)
    with pytest.raises(ConnWalkError, match="head=2"):
        unchecked(fn)(walk, gates[:, :1], W_V, W_O, mu, 1.0)
    with pytest.raises(ConnWalkError, match="do not compose"):
        unchecked(fn)(walk, gates, W_V, W_O[:, :2], mu, 1.0)
    with pytest.raises(ConnWalkError, match="scale"):
        unchecked(fn)(walk, gates, W_V, W_O, mu, torch.ones(3, dtype=F64))
    with pytest.raises(ConnWalkError, match="not square"):
        unchecked(fn)(walk[:, :3], gates[:, :, :3], W_V, W_O, mu[:, :3], 1.0)
    with pytest.raises(ConnWalkError, match="square maps"):
        unchecked(lap.polar_factor)(torch.ones(2, 3))
    with pytest.raises(ConnWalkError, match="mu"):
        unchecked(lap.reversibilised_walk)(walk, mu[0])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"mu": "neg"}, ">= 0"),
        ({"mu": "zero"}, "positive mass"),
        ({"scale": -1.0}, "scale must be finite"),
        ({"scale": math.nan}, "scale must be finite"),
        ({"max_edges": 0}, "positive integer"),
        ({"max_edges": True}, "positive integer"),
        ({"seed": 1.5}, "seed"),
        ({"walk": "neg"}, "negative"),
        ({"gates": "nan"}, "NaN"),
    ],
)
def test_bad_values_raise_conn_walk_error(change, match):
    walk, gates, W_V, W_O, mu = random_problem()
    args = {"walk": walk, "gates": gates, "mu": mu, "scale": 1.0}
    options: dict[str, object] = {}
    for key, value in change.items():
        if value == "neg":
            args[key] = -args[key]
        elif value == "zero":
            args[key] = torch.zeros_like(args[key])
        elif value == "nan":
            args[key] = torch.full_like(args[key], math.nan)
        elif key in args:
            args[key] = value
        else:
            options[key] = value
    with pytest.raises(ConnWalkError, match=match):
        unchecked(lap.nearest_connection_operator_distance)(
            args["walk"], args["gates"], W_V, W_O, args["mu"], args["scale"], **options
        )
