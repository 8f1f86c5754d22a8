"""The field isometry defect (spec §3) against dense per-edge messages ``x_j T_ij`` in float64."""

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.test_isometry import orthogonal, random_problem
from tests.tolerances import assert_close, atol
from tl_connwalk.core import field_defect as fd
from tl_connwalk.core import reference as ref
from tl_connwalk.core._fast import chunks
from tl_connwalk.core._fast import messages as fast_messages
from tl_connwalk.core.walk import gates as split_gates
from tl_connwalk.core.walk import walk_matrix
from tl_connwalk.errors import ConnWalkError

F64 = torch.float64


@pytest.mark.parametrize("heads", [1, 2, 3, 4])
@pytest.mark.parametrize("exclude_sink", [False, True])
def test_ratios_and_defect_match_the_reference(heads, exclude_sink):
    pattern, field, W_V, W_O = random_problem(heads=heads, causal=True, seed=heads)
    walk, g = walk_matrix(pattern), split_gates(pattern)
    assert_close(fd.message_norm_ratios(field, g, W_V, W_O), ref.message_ratios(field, g, W_V, W_O))
    assert_close(
        fd.field_isometry_defect(field, walk, g, W_V, W_O, exclude_sink=exclude_sink),
        ref.field_defect(field, walk, g, W_V, W_O, exclude_sink=exclude_sink),
    )


@pytest.mark.parametrize(
    ("heads", "d_model", "d_head"), [(1, 6, 2), (3, 12, 3), (4, 8, 4), (5, 7, 2)]
)  # H d_head below, equal to and above d_model
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_message_grams_through_the_output_gram_equal_the_messages(
    heads, d_model, d_head, dtype, monkeypatch
):
    """``G_j[a,b] = v^a_j (W_O^a W_O^b^T) v^b_j^T`` against the messages' own Gram, with keys
    split over several blocks."""
    _, field, W_V, W_O = random_problem(heads=heads, d_model=d_model, d_head=d_head, pos=7)
    field, W_V, W_O = field.to(dtype), W_V.to(dtype), W_O.to(dtype)
    messages = torch.einsum("bjd,hde,hef->bjhf", field, W_V, W_O)
    expected = torch.einsum("bjaf,bjcf->bjac", messages, messages)
    out_rows = fd.output_gram_rows(torch.einsum("apd,bqd->abpq", W_O, W_O))
    assert_close(fd.message_grams(field, W_V, W_O, out_rows=out_rows), expected)
    monkeypatch.setattr(
        fast_messages, "query_chunks", lambda n, per, chunk=None, device=None: _slices(n, 3)
    )
    blocked = fd.message_grams(field, W_V, W_O, out_rows=out_rows)
    assert_close(blocked, expected)
    assert torch.equal(blocked, blocked.mT)  # each head pair computed once


def _slices(n, step):
    return [slice(start, start + step) for start in range(0, n, step)]


def test_message_grams_reject_output_gram_rows_of_other_heads():
    _, field, W_V, W_O = random_problem(heads=3)  # 3 heads of 3, each with 2 partners: 54 numbers
    two_heads = fd.output_gram_rows(torch.einsum("apd,bqd->abpq", W_O[:2], W_O[:2]))
    with pytest.raises(ConnWalkError, match=r"out_rows \(36,\) must be \[54\]"):
        fd.message_grams(field, W_V, W_O, out_rows=two_heads)


def test_message_grams_and_head_ratios():
    pattern, field, W_V, W_O = random_problem(heads=3)
    messages = torch.einsum("bjd,hde,hef->bjhf", field, W_V, W_O)
    assert_close(
        fd.message_grams(field, W_V, W_O), torch.einsum("bjaf,bjcf->bjac", messages, messages)
    )
    head_rho = messages.norm(dim=-1) / field.norm(dim=-1)[..., None]
    assert_close(fd.head_message_norm_ratios(field, W_V, W_O), head_rho)
    walk, g = walk_matrix(pattern), split_gates(pattern)
    expected = ref.head_field_defects(field, ref.walk(pattern), ref.gates(pattern), W_V, W_O)
    assert_close(fd.head_field_isometry_defects(field, walk, g, W_V, W_O), expected)


def test_zero_for_scaled_orthogonal_transport():
    pattern, field, *_ = random_problem(heads=1, causal=True)
    Q = orthogonal(12, 3)
    W_V, W_O = 4.0 * Q[None, :, :], orthogonal(12, 4)[None]  # T = 4 Q Q': rho = 4 everywhere
    walk, g = walk_matrix(pattern), split_gates(pattern)
    rho = fd.message_norm_ratios(field, g, W_V, W_O)
    assert_close(rho, torch.full_like(rho, 4.0))
    # the ratios equal 4 to rounding, and the centred spread keeps only that rounding (not its
    # square root, as E[rho^2] - E[rho]^2 would)
    tol = atol(F64, 12)
    defect = fd.field_isometry_defect(field, walk, g, W_V, W_O)
    torch.testing.assert_close(defect, torch.zeros(2, dtype=F64), rtol=0, atol=tol)
    heads = fd.head_field_isometry_defects(field, walk, g, W_V, W_O)
    torch.testing.assert_close(heads, torch.zeros(2, 1, dtype=F64), rtol=0, atol=tol)


@pytest.mark.parametrize("query_chunk", [None, 1, 2])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_exactly_equal_ratios_give_exactly_zero(query_chunk, seed, dtype):
    """Unit fields, gates 1/4 and Grams ``0.09 I``: every edge computes the same ``rho``
    (about 0.6) from the same numbers, so the spread is exactly 0 on any walk and chunking. A
    spread taken as ``E[rho^2] - E[rho]^2`` leaves rounding noise of order ``sqrt(eps)``
    instead (2e-8 in float64 on seeds 1 and 2, 1e-8 in float32 on seeds 1 and 3)."""
    pattern, *_ = random_problem(heads=4, pos=5, causal=True, seed=seed)
    walk, g = walk_matrix(pattern), torch.full_like(pattern, 0.25)
    field = torch.eye(5, 12, dtype=F64).expand(2, 5, 12)  # ||x_j|| = 1
    grams = 0.09 * torch.eye(4, dtype=F64).expand(1, 2, 5, 4, 4)  # rho^2 = 16 g^T G g
    inputs = [t.to(dtype) for t in (field, walk, g, grams)]
    defect = fd.field_isometry_defects(*inputs, query_chunk=query_chunk)
    assert torch.equal(defect, torch.zeros(1, 2, dtype=dtype))


def test_zero_fields_and_zero_maps_are_defined():
    pattern, field, W_V, W_O = random_problem(heads=2, causal=True)
    walk, g = walk_matrix(pattern), split_gates(pattern)
    field[:, 2] = 0.0  # no message from key 2: ratio 0, its edges left out
    rho = fd.message_norm_ratios(field, g, W_V, W_O)
    assert torch.equal(rho[:, :, 2], torch.zeros(2, 5, dtype=F64))
    assert_close(
        fd.field_isometry_defect(field, walk, g, W_V, W_O),
        ref.field_defect(field, walk, g, W_V, W_O),
    )
    assert torch.isfinite(fd.head_field_isometry_defects(field, walk, g, W_V, W_O)).all()
    # the zero map: every ratio 0, defect 0 (0/0)
    zero = fd.field_isometry_defect(field, walk, g, 0 * W_V, W_O)
    assert torch.equal(zero, torch.zeros(2, dtype=F64))
    assert torch.equal(
        fd.head_field_isometry_defects(0 * field, walk, g, W_V, W_O), torch.zeros(2, 2, dtype=F64)
    )


def test_dtypes():
    pattern, field, W_V, W_O = random_problem()
    walk, g = walk_matrix(pattern), split_gates(pattern)
    half = [t.bfloat16() for t in (field, walk, g, W_V, W_O)]
    assert fd.field_isometry_defect(*half).dtype == torch.float32
    assert fd.head_field_isometry_defects(*half).dtype == torch.float32
    assert fd.field_isometry_defect(field, walk, g, W_V, W_O).dtype == F64


def test_bad_input_raises_conn_walk_error():
    pattern, field, W_V, W_O = random_problem()
    walk, g = walk_matrix(pattern), split_gates(pattern)
    with pytest.raises(ConnWalkError, match="do not compose"):
        inspect.unwrap(fd.message_grams)(field[..., :5], W_V, W_O)
    with pytest.raises(ConnWalkError, match="head = 3"):
        inspect.unwrap(fd.message_norm_ratios)(field, g[:, :2], W_V, W_O)
    with pytest.raises(ConnWalkError, match="disagree"):
        inspect.unwrap(fd.head_field_isometry_defects)(field, walk[:, :4], g, W_V, W_O)
    with pytest.raises(ConnWalkError, match="negative"):
        fd.field_isometry_defect(field, -walk, g, W_V, W_O)


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    field_scale=st.floats(1e-3, 1e3),
    map_scale=st.floats(1e-3, 1e3),
    exclude_sink=st.booleans(),
)
def test_invariant_under_scaling_and_output_rotation(
    heads, seed, field_scale, map_scale, exclude_sink
):
    pattern, field, W_V, W_O = random_problem(
        heads=heads, pos=4, d_model=6, d_head=2, seed=seed, causal=True
    )
    walk, g = walk_matrix(pattern), split_gates(pattern)

    def both(x, value_w, out_w):
        return (
            fd.field_isometry_defect(x, walk, g, value_w, out_w, exclude_sink=exclude_sink),
            fd.head_field_isometry_defects(x, walk, g, value_w, out_w, exclude_sink=exclude_sink),
        )

    base = both(field, W_V, W_O)
    for variant in (
        both(field_scale * field, W_V, W_O),
        both(field, map_scale * W_V, W_O),
        both(field, W_V, W_O @ orthogonal(6, seed)),
    ):
        for got, expected in zip(variant, base, strict=True):
            assert_close(got, expected)


@pytest.mark.parametrize("exclude_sink", [False, True])
@pytest.mark.parametrize("query_chunk", [None, 1, 2, 5])
@pytest.mark.parametrize("spans", ["chunk budget", "one chunk each"])
def test_families_in_one_pass_equal_each_family_alone(
    exclude_sink, query_chunk, spans, monkeypatch
):
    """Layer-like families (other weights, one walk) in one pass, vs the dense reference each;
    one key without field (no message: left out), one padded query row (no mass) and one
    padded in every sequence (no chunk there). The
    ratios are summarised span by span: every chunk in one span, or each chunk alone."""
    if spans == "one chunk each":
        monkeypatch.setattr(fd, "_SPAN_COPIES", chunks.CHUNK_ENTRIES)
    pattern, field, W_V, W_O = random_problem(heads=3, causal=True, seed=12)
    field = field.clone()
    field[1, 2] = 0.0
    pattern = pattern.clone()
    pattern[0, :, 3] = 0.0  # a masked query row of sequence 0
    pattern[:, :, 1] = 0.0  # masked in every sequence: no chunk of its own, a gap in a span
    walk, g = walk_matrix(pattern), split_gates(pattern)
    weights = [(W_V, W_O), (2 * W_V.flip(0), W_O), (W_V, -W_O.roll(1, dims=2))]
    grams = torch.stack([fd.message_grams(field, v, o) for v, o in weights])
    together = fd.field_isometry_defects(
        field, walk, g, grams, exclude_sink=exclude_sink, query_chunk=query_chunk
    )
    for family, (v, o) in enumerate(weights):
        expected = ref.field_defect(field, walk, g, v, o, exclude_sink=exclude_sink)
        assert_close(together[family], expected)
        alone = fd.field_isometry_defect(field, walk, g, v, o, exclude_sink=exclude_sink)
        assert_close(together[family], alone)


def test_families_need_grams_over_the_fields_keys():
    pattern, field, W_V, W_O = random_problem(heads=2)
    grams = fd.message_grams(field, W_V, W_O)
    with pytest.raises(ConnWalkError, match=r"\[family, batch, key, head, head\]"):
        inspect.unwrap(fd.field_isometry_defects)(
            field, walk_matrix(pattern), split_gates(pattern), grams
        )


@pytest.mark.parametrize("through", ["out_rows", "W_O"])
def test_factored_message_grams_equal_the_message_grams_of_the_product(through):
    """``factor @ values`` as the keys' values: the Grams of `message_grams` with ``X = factor``
    and ``W_V^cat = values``, through the output Gram's rows or through ``W_O``."""
    W_O = random_problem(heads=3, d_model=12, d_head=4, pos=7)[3]
    factor = torch.randn(12, 12, dtype=F64)  # rank = d_model: message_grams' shapes
    values = torch.randn(12, 12, dtype=F64)
    expected = fd.message_grams(factor[None], values.view(12, 3, 4).permute(1, 0, 2), W_O)[0]
    side = (
        {"out_rows": fd.output_gram_rows(torch.einsum("apd,bqd->abpq", W_O, W_O))}
        if through == "out_rows"
        else {"W_O": W_O}
    )
    assert_close(fd.factored_message_grams(factor, values, 3, **side), expected)


@pytest.mark.parametrize("through", ["out_rows", "W_O"])
def test_message_grams_in_blocks_of_keys_equal_them_in_one_block(through, monkeypatch):
    """Blocks of 2 keys (of 7: a shorter last block, whose views are made again) give the
    Grams of one block, for one field, several stacked fields and factored values."""
    _, field, W_V, W_O = random_problem(heads=3, d_model=12, d_head=4, pos=7, batch=2)
    out_rows = fd.output_gram_rows(torch.einsum("apd,bqd->abpq", W_O, W_O))
    side = {"out_rows": out_rows} if through == "out_rows" else {}
    drawn = {"out_rows": out_rows.expand(3, -1)} if through == "out_rows" else {"W_O": W_O}
    fields = torch.stack([field, 2 * field.flip(1)])  # two stacked problems
    factor, values = torch.randn(2, 7, 7, dtype=F64).tril(), torch.randn(3, 7, 12, dtype=F64)

    def all_grams() -> list[torch.Tensor]:
        grams = [
            fd.message_grams(field, W_V, W_O, **side),
            fast_messages.stacked_factored_grams(factor, values, 3, **drawn),
        ]
        if through == "out_rows":  # stacked fields go through their output-Gram rows
            W_V_cat = W_V.permute(1, 0, 2).flatten(1).expand(2, -1, -1)
            grams.append(fd.stacked_message_grams(fields, W_V_cat, 3, out_rows.expand(2, -1)))
        return grams

    whole = all_grams()
    monkeypatch.setattr(fast_messages, "query_chunks", _pairs_of_rows(chunks.query_chunks))
    for got, want in zip(all_grams(), whole, strict=True):
        assert_close(got, want)


def test_stacked_message_grams_in_blocks_follow_output_rows_that_ask_for_gradients(monkeypatch):
    """Output-Gram rows that ask for gradients (the fields and values do not): blocks of 2 keys
    give the gradient of one block (no kept buffer in autograd's graph)."""
    _, field, W_V, W_O = random_problem(heads=3, d_model=12, d_head=4, pos=7, batch=1)
    fields = torch.stack([field, 2 * field.flip(1)])
    W_V_cat = W_V.permute(1, 0, 2).flatten(1).expand(2, -1, -1)
    out_rows = fd.output_gram_rows(torch.einsum("apd,bqd->abpq", W_O, W_O)).expand(2, -1)

    def gradient() -> torch.Tensor:
        rows = out_rows.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(
            fd.stacked_message_grams(fields, W_V_cat, 3, rows).square().sum(), rows
        )
        return grad

    whole = gradient()
    monkeypatch.setattr(fast_messages, "query_chunks", _pairs_of_rows(chunks.query_chunks))
    assert_close(gradient(), whole)


def _pairs_of_rows(query_chunks):
    """`chunks.query_chunks` with 2 rows per chunk, whatever the budget."""

    def two_at_a_time(n_query, per_query, query_chunk=None, device=None):
        return query_chunks(n_query, per_query, 2 if query_chunk is None else query_chunk, device)

    return two_at_a_time


def test_factored_message_grams_check_their_inputs():
    W_O = torch.randn(2, 4, 6, dtype=F64)
    with pytest.raises(ConnWalkError, match="needs W_O or out_rows"):
        inspect.unwrap(fd.factored_message_grams)(torch.eye(3), torch.randn(3, 8), 2)
    with pytest.raises(ConnWalkError, match=r"values \(3, 6\) must be"):
        inspect.unwrap(fd.factored_message_grams)(torch.eye(3), torch.randn(3, 6), 2, W_O=W_O)


def test_message_grams_through_output_gram_rows_keep_the_autograd_graph():
    """Weights that ask for gradients: the Grams carry them (no product into a kept buffer)."""
    _, field, W_V, W_O = random_problem(heads=3)
    W_V = W_V.clone().requires_grad_(True)
    out_rows = fd.output_gram_rows(torch.einsum("apd,bqd->abpq", W_O, W_O))
    grams = fd.message_grams(field, W_V, W_O, out_rows=out_rows)
    (grad,) = torch.autograd.grad(grams.sum(), W_V)
    messages = torch.einsum("bjd,hde,hef->bjhf", field, W_V, W_O)
    (expected,) = torch.autograd.grad(
        torch.einsum("bjaf,bjcf->bjac", messages, messages).sum(), W_V
    )
    assert_close(grad, expected)
