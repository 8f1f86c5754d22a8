"""Markov-chain measurements of the walk and the pairing residual (spec §2-3), in float64.

References: `tl_connwalk.core.reference` (eigenvectors from ``torch.linalg.eig``, loops over
rows, dense per-edge transports for the pairing residual; compared at ``cancelling_atol``: the
closed form takes the square root of a difference of nearly equal numbers, so it carries half
the working precision).
"""

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.test_isometry import orthogonal, random_problem
from tests.tolerances import assert_close, atol, cancelling_atol
from tl_connwalk.core import isometry as iso
from tl_connwalk.core import markov
from tl_connwalk.core import reference as ref
from tl_connwalk.core.walk import gates as split_gates
from tl_connwalk.core.walk import walk_matrix
from tl_connwalk.errors import ConnWalkError

F64 = torch.float64
PAIRING_ATOL = cancelling_atol(F64)


def random_walk(batch=2, n=5, seed=0, causal=False):
    gen = torch.Generator().manual_seed(seed)
    scores = 2 * torch.randn(batch, n, n, generator=gen, dtype=F64)
    if causal:
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    return scores.softmax(-1)


def unchecked(fn):
    """``fn`` without the jaxtyping/beartype wrapper the test run adds, to reach our own checks."""
    return inspect.unwrap(fn)


# --- (C1), irreducibility, stationary distribution --------------------------------------


def test_stochasticity_residual():
    walk = random_walk()
    walk[1, 2] *= 1.5
    expected = (walk.sum(-1) - 1).abs().amax(-1)
    assert_close(markov.stochasticity_residual(walk), expected)
    assert markov.stochasticity_residual(random_walk())[0] <= atol(F64, walk.shape[-1])
    assert markov.stochasticity_residual(walk.float()).dtype == torch.float32
    assert markov.stochasticity_residual(walk.bfloat16()).dtype == torch.float32


def test_is_irreducible():
    cycle = torch.roll(torch.eye(4, dtype=F64), 1, dims=1)  # periodic but irreducible
    blocks = torch.block_diag(torch.full((2, 2), 0.5), torch.full((2, 2), 0.5)).to(F64)
    walks = torch.stack([random_walk(1, 4)[0], random_walk(1, 4, causal=True)[0], cycle, blocks])
    # the causal walk's only way out of 0 is to 0; the block walk never crosses
    assert markov.is_irreducible(walks).tolist() == [True, False, True, False]
    assert markov.is_irreducible(torch.ones(1, 1, 1)).tolist() == [True]
    chain = torch.zeros(1, 6, 6, dtype=F64)  # a path 0->1->...->5->0: diameter 5
    chain[0, torch.arange(6), (torch.arange(6) + 1) % 6] = 1.0
    assert markov.is_irreducible(chain).tolist() == [True]
    chain[0, 5, 0] = 0.0
    assert markov.is_irreducible(chain).tolist() == [False]


def test_stationary_distribution_matches_eigenvector():
    walk = random_walk(3, 6)
    mu = markov.stationary_distribution(walk)
    assert_close(mu, ref.stationary(walk), dtype=torch.float32)  # eig is less accurate
    assert_close(torch.einsum("bi,bij->bj", mu, walk), mu)
    # rows are normalised first: a scaled walk has the same mu
    assert_close(markov.stationary_distribution(walk * 3.0), mu)
    # periodic: power iteration would oscillate, the solve does not
    cycle = torch.roll(torch.eye(4, dtype=F64), 1, dims=1)[None]
    assert_close(markov.stationary_distribution(cycle), torch.full((1, 4), 0.25, dtype=F64))


def test_stationary_distribution_falls_back_to_uniform_and_teleports():
    causal = random_walk(2, 5, causal=True)
    assert_close(markov.stationary_distribution(causal), torch.full((2, 5), 0.2, dtype=F64))
    alpha = 0.7
    teleporting = alpha * causal + (1 - alpha) / 5
    mu = markov.stationary_distribution(causal, teleport=alpha)
    assert_close(mu, ref.stationary(teleporting), dtype=torch.float32)
    assert mu[:, 0].gt(mu[:, 1:].amax(-1)).all()  # the sink holds the most mass
    # rows without mass jump uniformly (dangling positions)
    dangling = causal.clone()
    dangling[:, 3] = 0.0
    fixed = causal.clone()
    fixed[:, 3] = 0.2
    assert_close(
        markov.stationary_distribution(dangling, teleport=alpha),
        markov.stationary_distribution(fixed, teleport=alpha),
    )


# --- (C2) -------------------------------------------------------------------------------


def test_reversibility_residual_and_which_mu():
    walk = torch.cat([random_walk(1, 5), random_walk(1, 5, seed=1, causal=True)])
    result = markov.reversibility_residual(walk)
    assert result.mu_kind == ("stationary", "uniform")
    assert_close(result.mu[1], torch.full((5,), 0.2, dtype=F64))
    assert_close(result.residual, ref.reversibility(walk, result.mu))
    teleport = markov.reversibility_residual(walk, "teleport", alpha=0.5)
    assert teleport.mu_kind == ("teleport", "teleport")
    assert_close(teleport.mu, markov.stationary_distribution(walk, teleport=0.5))
    assert_close(teleport.residual, ref.reversibility(walk, teleport.mu))
    given_mu = torch.rand(2, 5, dtype=F64, generator=torch.Generator().manual_seed(2)) + 0.1
    given_result = markov.reversibility_residual(walk, given_mu)
    assert given_result.mu_kind == ("given", "given")
    assert_close(given_result.residual, ref.reversibility(walk, given_mu))
    # mu's scale does not matter
    assert_close(markov.reversibility_residual(walk, 7 * given_mu).residual, given_result.residual)
    assert markov.reversibility_residual(walk, "uniform").mu_kind == ("uniform", "uniform")
    assert set(result.to_dict()) == {"residual", "mu", "mu_kind"}


def test_reversibility_zero_cases():
    gen = torch.Generator().manual_seed(4)
    S = torch.rand(2, 5, 5, dtype=F64, generator=gen)
    S = S + S.mT
    # a symmetric walk with uniform mu
    uniform = markov.reversibility_residual(S, "uniform")
    zero, n = torch.zeros(2, dtype=F64), S.shape[-1]
    torch.testing.assert_close(uniform.residual, zero, rtol=0, atol=atol(F64, n))
    # a reversible chain W = D^-1 S: its stationary mu ~ D satisfies detailed balance
    chain = S / S.sum(-1, keepdim=True)
    result = markov.reversibility_residual(chain)
    assert result.mu_kind == ("stationary", "stationary")
    assert_close(result.mu, S.sum(-1) / S.sum((1, 2))[:, None])
    torch.testing.assert_close(result.residual, zero, rtol=0, atol=atol(F64, n))
    # the zero walk: 0/0 counts as reversible
    zero = markov.reversibility_residual(torch.zeros(1, 3, 3), "uniform")
    assert torch.equal(zero.residual, torch.zeros(1))
    # the causal walk is far from reversible
    assert markov.reversibility_residual(random_walk(1, causal=True)).residual > 0.3


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: markov.stochasticity_residual(-random_walk()), "negative"),
        (lambda: markov.is_irreducible(random_walk()[:, :3]), "not square"),
        (lambda: markov.stationary_distribution(random_walk(), teleport=1.0), r"\[0, 1\)"),
        # below, the runtime type checker of the tests would answer first: call past it
        (lambda: unchecked(markov.reversibility_residual)(random_walk(), "stationnary"), "one of"),
        (lambda: markov.reversibility_residual(random_walk(), -torch.ones(2, 5)), ">= 0"),
        (lambda: markov.reversibility_residual(random_walk() * float("nan")), "NaN"),
        (lambda: unchecked(markov.layer_drift)(random_walk(2, 5), random_walk(2, 4)), "one shape"),
        (
            lambda: unchecked(markov.layer_drift)(random_walk(), random_walk(), exclude_sink=None),
            "True or",
        ),
    ],
)
def test_bad_input_raises_conn_walk_error(call, match):
    with pytest.raises(ConnWalkError, match=match):
        call()


# --- layer drift ------------------------------------------------------------------------


def test_layer_drift_against_rows():
    a, b = random_walk(2, 5, seed=1, causal=True), random_walk(2, 5, seed=2, causal=True)
    expected = ref.layer_drift(a, b)
    assert_close(markov.layer_drift(a, b), expected)
    assert_close(markov.layer_drift(b, a), expected)
    assert torch.equal(markov.layer_drift(a, a), torch.zeros(2, dtype=F64))
    assert torch.equal(markov.layer_drift(a, a, exclude_sink=True), torch.zeros(2, dtype=F64))
    # sink removed: query 0 keeps nothing and drops out; other rows renormalised
    assert_close(
        markov.layer_drift(a, b, exclude_sink=True), ref.layer_drift(a, b, exclude_sink=True)
    )
    # everything on the sink: nothing to compare, 0
    only_sink = torch.zeros(1, 3, 3)
    only_sink[:, :, 0] = 1
    assert torch.equal(
        markov.layer_drift(only_sink, random_walk(1, 3).float(), exclude_sink=True), torch.zeros(1)
    )


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), causal=st.booleans(), exclude_sink=st.booleans())
def test_layer_drift_is_a_bounded_symmetric_distance(seed, causal, exclude_sink):
    a, b = random_walk(2, 5, seed, causal), random_walk(2, 5, seed + 1, causal)
    ab = markov.layer_drift(a, b, exclude_sink=exclude_sink)
    assert ((ab >= 0) & (ab <= 1)).all()
    assert_close(markov.layer_drift(b, a, exclude_sink=exclude_sink), ab)


# --- pairing ----------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [1, 2, 3, 4])
def test_pairing_residual_matches_dense_transports(heads):
    pattern, _, W_V, W_O = random_problem(heads=heads, seed=10 + heads)
    pattern[0, :, 1, 3] = 0.0  # one edge missing in one direction: left out
    walk, g = walk_matrix(pattern), split_gates(pattern)
    per_edge = ref.edge_pairing(g, W_V, W_O)
    expected, _ = ref.pairing(walk, g, W_V, W_O)
    closed = markov.edge_pairing_residuals(
        g, iso.head_gram(W_V, W_O), iso.head_mixed_gram(W_V, W_O)
    )
    torch.testing.assert_close(closed, per_edge, rtol=0, atol=PAIRING_ATOL)
    result = markov.pairing_residual(walk, g, W_V, W_O)
    assert result.applicable.tolist() == [True, True]
    torch.testing.assert_close(result.residual, expected, rtol=0, atol=PAIRING_ATOL)
    expected_sink, _ = ref.pairing(walk, g, W_V, W_O, exclude_sink=True)
    sink = markov.pairing_residual(walk, g, W_V, W_O, exclude_sink=True)
    torch.testing.assert_close(sink.residual, expected_sink, rtol=0, atol=PAIRING_ATOL)


def test_stacked_pairing_residuals_are_each_walks():
    """Three walks (two bidirectional, one causal) with their own heads, in one pass: each
    equals `pairing_residual` of that walk alone, with and without an edge mask."""
    problems = [random_problem(heads=3, seed=s, causal=s == 2) for s in range(3)]
    walks = torch.stack([walk_matrix(p[0]) for p in problems])
    gates = torch.stack([split_gates(p[0]) for p in problems])
    heads = [(p[2], p[3]) for p in problems]
    edges = torch.rand(walks.shape, generator=torch.Generator().manual_seed(3)) > 0.3
    for mask in (None, edges):
        stacked = markov.pairing_residuals(walks, gates, heads, edges=mask)
        for k, result in enumerate(stacked):
            alone = markov.pairing_residual(
                walks[k], gates[k], *heads[k], edges=None if mask is None else mask[k]
            )
            assert torch.equal(result.applicable, alone.applicable)
            torch.testing.assert_close(result.residual, alone.residual, rtol=0, atol=PAIRING_ATOL)
    assert stacked[2].applicable.tolist() == [False, False]
    with pytest.raises(ConnWalkError, match="per walk: 2 for 3 walks"):
        markov.pairing_residuals(walks, gates, heads[:2])


def test_pairing_zero_for_transpose_paired_transports():
    _, _, W_V, _ = random_problem(heads=3)
    W_O = W_V.mT.contiguous()  # T^h symmetric
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(2, 3, 5, 5, generator=gen, dtype=F64)
    pattern = scores + scores.mT  # symmetric gates: g_ji = g_ij
    walk, g = walk_matrix(pattern), split_gates(pattern)
    result = markov.pairing_residual(walk, g, W_V, W_O)
    zero = torch.zeros(2, dtype=F64)
    torch.testing.assert_close(result.residual, zero, rtol=0, atol=PAIRING_ATOL)
    assert result.values() == pytest.approx([0.0, 0.0], abs=PAIRING_ATOL)


def test_pairing_not_applicable_for_causal_walks_and_zero_maps():
    pattern, _, W_V, W_O = random_problem(causal=True)
    mixed = torch.cat([pattern[:1], random_problem(causal=False)[0][1:]])
    walk, g = walk_matrix(mixed), split_gates(mixed)
    result = markov.pairing_residual(walk, g, W_V, W_O)
    assert result.applicable.tolist() == [False, True]
    assert result.residual[0] == 0 and result.values()[0] is None
    assert result.to_dict()["residual"][0] is None
    # T_ij = 0 (a dead head carries the edge): normalised by ||T_ji|| instead, so 1
    W_V_dead = W_V.clone()
    W_V_dead[0] = 0.0
    g = torch.zeros(1, 3, 2, 2, dtype=F64)
    g[0, 0, 0, 1] = 1.0  # edge (0, 1) only through the dead head
    g[0, 1, 1, 0] = 1.0
    g[0, 1, 0, 0] = g[0, 1, 1, 1] = 1.0
    closed = markov.edge_pairing_residuals(
        g, iso.head_gram(W_V_dead, W_O), iso.head_mixed_gram(W_V_dead, W_O)
    )
    assert_close(closed[0, 0, 1], torch.tensor(1.0, dtype=F64))
    zero = markov.edge_pairing_residuals(
        g, iso.head_gram(0 * W_V, W_O), iso.head_mixed_gram(0 * W_V, W_O)
    )
    assert torch.equal(zero, torch.zeros_like(zero))


@settings(max_examples=25, deadline=None)
@given(heads=st.integers(1, 4), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_pairing_invariant_under_scaling_and_conjugation(heads, seed, scale):
    pattern, _, W_V, W_O = random_problem(heads=heads, pos=4, d_model=6, d_head=2, seed=seed)
    walk, g = walk_matrix(pattern), split_gates(pattern)
    base = markov.pairing_residual(walk, g, W_V, W_O).residual
    scaled = markov.pairing_residual(walk, g, scale * W_V, W_O).residual
    Q = orthogonal(6, seed)
    conjugated = markov.pairing_residual(walk, g, Q.T @ W_V, W_O @ Q).residual  # Q^T T Q
    tol = cancelling_atol(F64, 6 * 6)  # head Grams: traces over 6 x 6 maps
    torch.testing.assert_close(scaled, base, rtol=0, atol=tol)
    torch.testing.assert_close(conjugated, base, rtol=0, atol=tol)
