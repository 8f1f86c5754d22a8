"""The connection-walk decomposition (spec §1) against `tl_connwalk.core.reference` (per edge,
float64) and multi-head attention written the usual way."""

import torch
from einops import einsum
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core import problems
from tests.tolerances import assert_close
from tl_connwalk.core import reference as ref
from tl_connwalk.core import walk as core


def random_problem(batch=2, heads=3, pos=5, d_model=7, d_head=2, seed=0, causal=True):
    """Causal by default, unit-temperature scores (the shared helper of tests/core/problems.py)."""
    p = problems.random_problem(
        batch, heads, pos, d_model, d_head, seed=seed, causal=causal, temperature=1.0
    )
    return p.pattern, p.field, p.W_V, p.W_O, p.b_V, p.b_O


def test_walk_and_gates_definitions():
    pattern, *_ = random_problem()
    W, g = core.walk_matrix(pattern), core.gates(pattern)
    assert_close(W, pattern.mean(1))
    assert_close(W.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    assert (g >= 0).all()
    assert_close(g.sum(1), torch.ones(2, 5, 5, dtype=torch.float64))
    # causal non-edges get uniform gates
    assert_close(g[:, :, 0, 1], torch.full((2, 3), 1 / 3, dtype=torch.float64))


def test_gates_with_autograd_are_the_same_values_and_differentiable():
    pattern, *_ = random_problem()
    plain = core.gates(pattern)  # the no-autograd path (where ..., out=)
    tracked = pattern.clone().requires_grad_()
    g = core.gates(tracked)  # the autograd path (masked_fill_)
    assert torch.equal(g.detach(), plain)
    (g[:, 0] ** 2).sum().backward()
    assert tracked.grad is not None and torch.isfinite(tracked.grad).all()
    assert tracked.grad.abs().sum() > 0


def test_propagate_equals_per_edge_sum_and_attention():
    pattern, field, W_V, W_O, b_V, b_O = random_problem()
    assert_close(core.propagate(pattern, field, W_V, W_O), ref.apply(pattern, field, W_V, W_O))
    # and P X + c is multi-head attention written the usual way
    values = einsum(field, W_V, "b k d, h d e -> b k h e") + b_V
    z = einsum(pattern, values, "b h q k, b k h e -> b q h e")
    attention = einsum(z, W_O, "b q h e, h e d -> b q d") + b_O
    assert_close(
        core.propagate(pattern, field, W_V, W_O) + core.attention_bias(pattern, b_V, W_O, b_O),
        attention,
    )


def test_edge_transport_matches_hand_built():
    pattern, _, W_V, W_O, *_ = random_problem()
    T = ref.effective_transports(ref.gates(pattern), W_V, W_O)
    lazy = core.EffectiveTransport(core.gates(pattern), W_V, W_O)
    for i, j in [(0, 0), (3, 1), (4, 4), (1, 3)]:
        assert_close(lazy[i, j].AB, T[:, i, j])
        assert lazy[i, j].mdim == 3 * 2


def test_single_head_is_constant_transport():
    pattern, _, W_V, W_O, *_ = random_problem(heads=1)
    g = core.gates(pattern)
    assert_close(g, torch.ones_like(g))
    lazy = core.EffectiveTransport(g, W_V, W_O)
    for i, j in [(0, 0), (4, 2), (2, 4)]:
        assert_close(lazy[i, j].AB, (W_V[0] @ W_O[0]).expand(2, 7, 7))


def test_uniform_gates_reduce_to_single_head_with_summed_transport():
    pattern, field, W_V, W_O, *_ = random_problem()
    W = core.walk_matrix(pattern)
    uniform = torch.full_like(pattern, 1 / 3)
    summed = einsum(W_V, W_O, "h d e, h e f -> d f")
    expected = einsum(W, field @ summed, "b i j, b j f -> b i f")
    assert_close(core.propagate(core.patterns_from_walk(W, uniform), field, W_V, W_O), expected)


def test_head_messages_rebuild_attention():
    pattern, field, W_V, W_O, b_V, b_O = random_problem()
    messages = core.head_messages(field, W_V, b_V, W_O)
    out = einsum(pattern, messages, "b h q k, b k h d -> b q d") + b_O
    expected = core.propagate(pattern, field, W_V, W_O) + core.attention_bias(
        pattern, b_V, W_O, b_O
    )
    assert_close(out, expected)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 4),
    pos=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    causal=st.booleans(),
    dead_head=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_walk_gate_split_is_exact(batch, heads, pos, seed, causal, dead_head, dtype):
    pattern, field, W_V, W_O, *_ = random_problem(batch, heads, pos, 5, 2, seed, causal)
    if dead_head:
        pattern[:, 0] = 0.0  # an all-zero head (masked out): gates must stay defined
    pattern, field, W_V, W_O = (t.to(dtype) for t in (pattern, field, W_V, W_O))
    W, g = core.walk_matrix(pattern), core.gates(pattern)
    assert torch.isfinite(g).all()
    assert_close(g.sum(1), torch.ones_like(W))
    assert_close(core.patterns_from_walk(W, g), pattern)
    by_edges = ref.apply(pattern, field, W_V, W_O)
    assert_close(core.propagate(pattern, field, W_V, W_O), by_edges.to(dtype))


def test_gates_of_subnormal_patterns_are_finite_and_sum_to_one():
    """At long contexts a softmax leaves patterns as small as float32's subnormals: a gate is
    ``A^h / s`` there too (finite, summing to 1 over heads), against the float64 definition."""
    tiny = torch.finfo(torch.float32).smallest_normal
    pattern = torch.softmax(torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(0)), -1)
    pattern[0, :, 3, 0] = torch.tensor([tiny / 2**20, 0.0, tiny / 2**22])  # subnormal column
    walk, gates = core.walk_and_gates(pattern)
    assert torch.isfinite(gates).all()
    assert_close(gates.sum(1), torch.ones(1, 4, 4))
    assert_close(gates, ref.gates(pattern.double()).float())
    assert_close(walk, ref.walk(pattern.double()).float())
