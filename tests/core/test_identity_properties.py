"""Hypothesis: the core identities of spec §1.2 over random shapes, dtypes, masks and seeds.

Shapes: batch 1-3, query heads 1-6 with grouped key/value heads (``n_kv`` divides ``H``;
``W_V^h`` is the value head that ``h`` reads), positions 1-7, ``d_model`` 1-10, ``d_head`` 1-4.
Masks: causal, padding (some keys unavailable, rows left without keys become zero rows as in
TransformerLens), random sparsity. Dtypes: float32 and float64 computed as such; bfloat16 and
float16 inputs are computed in float32 and compared, with float32's tolerance
(`tests.tolerances.rtol`), against a float64 reference of the rounded inputs.
The reference is a plain einsum attention ``sum_h A^h (x W_V^h + b_V^h) W_O^h + b_O``.
"""

import torch
from einops import einsum, repeat
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tolerances import HALF, atol, rtol
from tl_connwalk import ConnectionWalk
from tl_connwalk.core import walk as core

MASKS = ("none", "causal", "padding", "sparse")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@st.composite
def operands(draw):
    batch = draw(st.integers(1, 3))
    n_kv = draw(st.integers(1, 3))
    n_heads = n_kv * draw(st.integers(1, 2))
    n = draw(st.integers(1, 7))
    d_model, d_head = draw(st.integers(1, 10)), draw(st.integers(1, 4))
    mask_kind = draw(st.sampled_from(MASKS))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scores = 2 * torch.randn(batch, n_heads, n, n, generator=g)
    allowed = torch.ones(batch, 1, n, n, dtype=torch.bool)
    if mask_kind == "causal":
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    elif mask_kind == "padding":
        allowed = allowed & ((torch.rand(batch, 1, 1, n, generator=g) > 0.4) | (n == 1))
    elif mask_kind == "sparse":
        allowed = allowed & (torch.rand(batch, n_heads, n, n, generator=g) > 0.5)
    pattern = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1)
    pattern = torch.where(torch.isnan(pattern), 0.0, pattern)  # fully masked rows: zero rows
    field = torch.randn(batch, n, d_model, generator=g)
    W_V_kv = torch.randn(n_kv, d_model, d_head, generator=g)
    b_V_kv = torch.randn(n_kv, d_head, generator=g)
    W_O = torch.randn(n_heads, d_head, d_model, generator=g)
    b_O = torch.randn(d_model, generator=g)
    # grouped-query attention: query head h reads value head h // (H / n_kv)
    group = n_heads // n_kv
    W_V = repeat(W_V_kv, "kv d_model d_head -> (kv group) d_model d_head", group=group)
    b_V = repeat(b_V_kv, "kv d_head -> (kv group) d_head", group=group)
    tensors = [t.to(dtype) for t in (pattern, field, W_V, W_O, b_V, b_O)]
    return tensors, W_V_kv.to(dtype), b_V_kv.to(dtype), group


def tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    """Relative to the reference's size; half precision inputs are computed in float32."""
    r = rtol(torch.float32 if dtype in HALF else dtype)
    return dict(rtol=r, atol=r * max(expected.abs().max().item(), 1e-30))


SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(operands())
def test_apply_plus_bias_is_the_attention_output(case):
    (pattern, field, W_V, W_O, b_V, b_O), W_V_kv, b_V_kv, group = case
    dtype = field.dtype
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O, b_V, b_O)
    assert walk.walk.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # reference in float64 from the (rounded) inputs, value heads indexed by group
    A, x, V, bv, Wo, bo = (t.double() for t in (pattern, field, W_V_kv, b_V_kv, W_O, b_O))
    values = einsum(x, V, "b k d, kv d e -> b k kv e") + bv
    values = repeat(values, "b k kv e -> b k (kv group) e", group=group)
    expected = einsum(A, values, Wo, "b h q k, b k h e, h e d -> b q d") + bo
    actual = (walk.apply() + walk.bias()).double()
    # rounding is relative to the size of the terms summed, not to that of the output (the
    # heads' messages can cancel): the same sums over absolute values
    sized = einsum(x.abs(), V.abs(), "b k d, kv d e -> b k kv e") + bv.abs()
    sized = repeat(sized, "b k kv e -> b k (kv group) e", group=group)
    sizes = einsum(A, sized, Wo.abs(), "b h q k, b k h e, h e d -> b q d") + bo.abs()
    torch.testing.assert_close(actual, expected, **tolerance(dtype, sizes))


@SETTINGS
@given(operands())
def test_walk_rows_sum_to_one_where_they_have_mass(case):
    (pattern, field, W_V, W_O, b_V, b_O), *_ = case
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O, b_V, b_O)
    head_mass = pattern.double().sum(-1)  # [batch, head, query]
    rows = walk.walk.double().sum(-1)
    torch.testing.assert_close(rows, head_mass.mean(1), **tolerance(field.dtype, rows))
    full = (head_mass > 0).all(1)  # every head's row is a softmax row (rounded to its dtype)
    n_keys = pattern.shape[-1]
    rounded = field.dtype if field.dtype in HALF else torch.float32  # the softmax's dtype
    torch.testing.assert_close(
        rows[full], torch.ones_like(rows[full]), rtol=0, atol=atol(rounded, n_keys)
    )
    assert (rows[~(head_mass > 0).any(1)] == 0).all()
    gates = walk.gates.double()
    assert (gates >= 0).all()
    torch.testing.assert_close(
        gates.sum(1),
        torch.ones_like(gates[:, 0]),
        rtol=0,
        atol=atol(walk.gates.dtype, pattern.shape[1]),
    )


@SETTINGS
@given(operands())
def test_patterns_are_H_W_g(case):
    (pattern, field, W_V, W_O, b_V, b_O), *_ = case
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O, b_V, b_O)
    n_heads = pattern.shape[1]
    rebuilt = n_heads * walk.walk[:, None] * walk.gates
    expected = pattern.double()
    torch.testing.assert_close(rebuilt.double(), expected, **tolerance(walk.walk.dtype, expected))
    torch.testing.assert_close(walk.patterns, rebuilt)
    torch.testing.assert_close(core.patterns_from_walk(walk.walk, walk.gates), rebuilt)


@SETTINGS
@given(operands(), st.integers(0, 2**16))
def test_dense_generator_agrees_with_matvec(case, seed):
    (pattern, field, W_V, W_O, b_V, b_O), *_ = case
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O, b_V, b_O)
    L = walk.generator()
    dtype = walk.walk.dtype
    probe = torch.randn(field.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    dense = L.to_dense()
    via_dense = einsum(probe.flatten(1), dense, "b i, b i o -> b o").reshape(probe.shape)
    expected = L.matvec(probe)
    # L X = X - P X cancels where P X is close to X (one token, say): rounding is relative to
    # the size of X and P X, not to that of their difference
    sizes = torch.stack([probe.abs().max(), walk.apply(probe).abs().max()])
    torch.testing.assert_close(via_dense, expected, **tolerance(dtype, sizes))
    # and L X = X - (apply X), the propagation the identity uses
    torch.testing.assert_close(expected, probe - walk.apply(probe), **tolerance(dtype, sizes))
