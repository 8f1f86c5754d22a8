"""Property tests of the geometry: head permutations and mu-self-adjointness.

Relabelling the heads (permuting ``W_V``, ``W_O``, ``b_V`` and the gates' head axis together)
is the same attention layer, so every measurement must be unchanged, and per-head ones permuted
along. A reversible walk with paired transports ``T_ji = T_ij^T`` gives a ``P`` that is
self-adjoint in ``<u, v>_mu = sum_i mu_i u_i . v_i``.
"""

import torch
from einops import einsum
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.problems import random_problem, symmetric_problem
from tests.tolerances import atol, cancelling_atol, rtol
from tl_connwalk.core import markov
from tl_connwalk.core.generator import ConnectionGenerator
from tl_connwalk.walk import ConnectionWalk

F64 = torch.float64


def close(actual, expected, cancels=False, size=None):
    """Equal to float64 rounding (the heads summed in another order): ``|actual - expected| <=
    r (max|expected| + |expected|) + floor``, ``r = rtol(float64)``. The floor is ``atol`` for
    values that are 0 up to rounding (a stochasticity: ulps of a sum of ones), and
    ``cancelling_atol`` for square roots of cancelling differences (defects near 0). ``size``:
    the scale of the summed terms where a sum cancels (its rounding follows its terms, not its
    value), else ``max|expected|``."""
    r = rtol(F64)
    floor = cancelling_atol(F64) if cancels else atol(F64)
    scale = max(expected.abs().max().item() if size is None else size, 1e-30)
    torch.testing.assert_close(actual, expected, rtol=r, atol=r * scale + floor)


def walk_of(problem, order=None):
    order = torch.arange(problem.W_V.shape[0]) if order is None else order
    return ConnectionWalk.from_pattern(
        problem.pattern[:, order],
        problem.field,
        problem.W_V[order],
        problem.W_O[order],
        problem.b_V[order],
        problem.b_O,
    )


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    heads=st.integers(2, 4),
    causal=st.booleans(),
    exclude_sink=st.booleans(),
    mu=st.sampled_from(["stationary", "uniform", "teleport"]),
)
def test_every_measurement_is_invariant_under_a_permutation_of_heads(
    seed, heads, causal, exclude_sink, mu
):
    problem = random_problem(2, heads, 4, d_model=5, d_head=2, seed=seed, causal=causal)
    order = torch.randperm(heads, generator=torch.Generator().manual_seed(seed))
    plain, permuted = walk_of(problem), walk_of(problem, order)
    options = dict(exclude_sink=exclude_sink, mu=mu, baseline_draws=2, exact=True, seed=seed)
    a = plain.laplacian_residual(**options)
    b = permuted.laplacian_residual(**options)
    for name in ("stochasticity", "reversibility", "mu", "scale", "field_defect"):
        close(getattr(b, name), getattr(a, name))
    close(b.transport_defect, a.transport_defect, cancels=True)
    assert a.mu_kind == b.mu_kind
    torch.testing.assert_close(b.pairing_applicable, a.pairing_applicable)
    if a.pairing is None:
        assert b.pairing is None
    else:
        close(b.pairing, a.pairing, cancels=True)
    close(b.head_defects, a.head_defects[order])
    close(b.head_field_defects, a.head_field_defects[:, order])
    # polar factors of random maps: their condition number times the rounding
    close(b.nearest_operator.distance, a.nearest_operator.distance, cancels=True)
    for kind in ("gram", "frobenius"):
        close(permuted.isometry_defects(kind), plain.isometry_defects(kind), cancels=True)
    # the layer itself is unchanged: output and bias
    close(permuted.apply() + permuted.bias(), plain.apply() + plain.bias())


def mu_inner(mu, u, v):
    """``<u, v>_mu = sum_i mu_i u_i . v_i`` per batch element."""
    return einsum(mu, u, v, "batch pos, batch pos d, batch pos d -> batch")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), heads=st.integers(1, 4), pos=st.integers(2, 6))
def test_paired_reversible_walk_gives_a_mu_self_adjoint_operator(seed, heads, pos):
    problem = symmetric_problem(2, heads, pos, d_model=5, d_head=2, seed=seed)
    walk = walk_of(problem)
    # the construction is what it claims: reversible w.r.t. mu, paired transports
    rev = markov.reversibility_residual(walk.walk, problem.mu)
    assert rev.residual.abs().max() <= atol(F64, pos)
    res = walk.laplacian_residual(mu=problem.mu, baseline_draws=2)
    assert res.pairing.abs().max() <= cancelling_atol(F64)  # sqrt of a cancelling difference

    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.randn(problem.field.shape, generator=gen, dtype=torch.float64)
    v = torch.randn(problem.field.shape, generator=gen, dtype=torch.float64)
    Pu, Pv = walk.apply(u), walk.apply(v)
    lhs, rhs = mu_inner(problem.mu, u, Pv), mu_inner(problem.mu, Pu, v)
    # the inner products cancel: their rounding is that of the terms' magnitudes
    terms = torch.stack(
        [mu_inner(problem.mu, u.abs(), Pv.abs()), mu_inner(problem.mu, Pu.abs(), v.abs())]
    )
    close(lhs, rhs, size=terms.max().item())

    # the same through the dense generator, vec(v) @ G = vec(L v): <u, P v>_mu =
    # vec(v) (I - G) D vec(u)^T with D = diag(mu (x) 1_d), so G D must be symmetric
    dense = ConnectionGenerator(walk.patterns, walk.W_V, walk.W_O).to_dense()
    weights = problem.mu.repeat_interleave(problem.field.shape[-1], dim=-1)
    weighted = dense * weights[:, None, :]
    close(weighted, weighted.mT)


def test_self_adjointness_fails_without_pairing():
    """The property test can fail: asymmetric head maps break it."""
    problem = symmetric_problem(1, 2, 4, d_model=5, d_head=2, seed=3)
    W_O = torch.randn(
        problem.W_O.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    walk = ConnectionWalk.from_pattern(problem.pattern, problem.field, problem.W_V, W_O)
    dense = ConnectionGenerator(walk.patterns, walk.W_V, walk.W_O).to_dense()
    weighted = dense * problem.mu.repeat_interleave(5, dim=-1)[:, None, :]
    # beyond what `close` lets through, even for a cancelling difference
    assert (weighted - weighted.mT).abs().max() > cancelling_atol(F64) * weighted.abs().max()
