"""The data-dependent field isometry defect (spec §3).

Weight-only defects ask whether a transport scales *every* direction alike; this one asks it
only of the messages actually sent. For the edge ``j -> i`` carrying ``x_j``,

    rho_ij = ||x_j T_ij|| / ||x_j||,    T_ij = H sum_h g^h_ij T^h,

and the defect is the walk-weighted coefficient of variation of ``rho`` over edges: 0 when the
transports scale every message they carry by one common factor. Per head, the same with
``T^h`` on head ``h``'s own walk ``A^h``.

Nothing of size ``d_model x d_model`` is formed: ``x_j T_ij = H sum_h g^h_ij m^h_j`` with the
head messages ``m^h_j = x_j T^h``, so ``||x_j T_ij||^2 = H^2 g_ij^T G_j g_ij`` with the message
Gram ``G_j[a,b] = m^a_j . m^b_j``, itself built from ``d_head``-wide values.

Convention: a key with ``x_j = 0`` sends no message and has no ratio (0/0): its ``rho`` is
reported as 0 and its edges are left out of the defects (rows renormalised over the rest).
"""

from collections.abc import Sequence

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core._fast.chunks import chunk_entries, edge_chunks, query_chunks
from tl_connwalk.core._fast.messages import (
    cast_operands,
    factored_message_grams,
    message_grams,
    output_gram_rows,
    output_gram_rows_numel,
    stacked_message_grams,
)
from tl_connwalk.core.checks import check_chunk, check_flag, check_walk_nonnegative, working_dtype
from tl_connwalk.core.moments import Moments
from tl_connwalk.core.weighted import edge_weights
from tl_connwalk.errors import ConnWalkError

# The message Grams have a module of their own; their public names stay importable from here.
__all__ = [
    "factored_message_grams",
    "field_isometry_defect",
    "field_isometry_defects",
    "head_field_isometry_defects",
    "head_message_norm_ratios",
    "message_grams",
    "message_norm_ratios",
    "output_gram_rows",
    "output_gram_rows_numel",
    "stacked_message_grams",
]


def _field_norms(field: Tensor) -> Tensor:
    return torch.linalg.vector_norm(field, dim=-1)


def _ratio(norm_sq: Tensor, field_norm: Tensor) -> Tensor:
    """``sqrt(norm_sq) / field_norm`` with 0 where the field is 0."""
    has_field = field_norm > 0
    ratio = norm_sq.clamp_min(0.0).sqrt() / torch.where(has_field, field_norm, 1.0)
    return torch.where(has_field, ratio, 0.0)


def _ratio_grams(grams: Tensor, field: Tensor) -> Tensor:
    """``H^2 G_j / ||x_j||^2`` (0 where ``x_j = 0``), ``grams`` ``[..., batch, key, head,
    head]``: then ``rho_ij^2 = g_ij^T (H^2 G_j / ||x_j||^2) g_ij``, the field's norms and
    ``H^2`` folded into the few Grams instead of applied to every edge."""
    n_heads = grams.shape[-1]
    norms_sq = _field_norms(field).square()
    has_field = norms_sq > 0
    scale = torch.where(has_field, n_heads**2 / torch.where(has_field, norms_sq, 1.0), 0.0)
    return grams * scale[..., None, None].to(grams)


def _check_gates(gates: Tensor, n_heads: int, n_key: int) -> None:
    if gates.ndim != 4 or gates.shape[1] != n_heads or gates.shape[3] != n_key:
        raise ConnWalkError(
            f"gates {tuple(gates.shape)} must be [batch, head, query, key] with head = "
            f"{n_heads} and key = {n_key} (the field's positions)."
        )


def _norm_chunks(
    gates: Tensor, families: int, query_chunk: int | None, walk: Tensor | None
) -> list[tuple[slice, int]]:
    """The chunks of query rows of `_norms_sq` that hold an edge (`edge_chunks`: with
    ``walk``, each with the keys up to its last edge), sized for its products."""
    batch, n_heads, n_query, n_key = gates.shape
    per_query = batch * n_key * n_heads * (2 + families)
    chunks = edge_chunks(n_query, n_key, per_query, query_chunk, walk, gates.device)
    return [(rows, keys) for rows, keys in chunks if keys]


def _key_major(grams: Tensor) -> Tensor:
    """``[family, batch, key, head, head]`` Grams as `_norms_sq` reads them: ``[key, batch,
    (family head), head]``, so that the first keys of every sequence are one slice."""
    return rearrange(grams, "family batch key a c -> key batch (family a) c").contiguous()


def _norms_sq(gates: Tensor, grams: Tensor, rows: slice, keys: int) -> Tensor:
    """The forms ``g_ij^T G_j g_ij`` of every family on a chunk of query rows and its first
    ``keys`` keys (``||x_j T_ij||^2 = H^2 g_ij^T G_j g_ij``; with `_ratio_grams`,
    ``rho_ij^2``): ``[family, batch, rows, keys]``, with ``grams`` from `_key_major`.

    Key-major: each key's gates of the chunk ``[head, rows]`` meet every family's ``G_j`` in
    one batched product, so the gates are read once for all families (a head-contracting
    einsum over ``[batch, head, query, key]`` is bound by its layout copies: 2.5-4x slower on
    CPU).
    """
    batch, n_heads = gates.shape[:2]
    g = rearrange(gates[:, :, rows, :keys], "batch h query key -> (key batch) h query")
    mixed = torch.bmm(grams[:keys].flatten(0, 1), g)  # [(key batch), (family a), query]
    mixed = mixed.view(g.shape[0], -1, n_heads, g.shape[-1])
    norm_sq = mixed.mul_(g[:, None]).sum(2)  # 2x faster than einsum's bmm over (key batch)
    return rearrange(norm_sq, "(key batch) family query -> family batch query key", batch=batch)


def message_norm_ratios(
    field: Float[Tensor, "batch key d_model"],
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    query_chunk: int | None = None,
    walk: Float[Tensor, "batch query key"] | None = None,
    grams: Float[Tensor, "batch key head head"] | None = None,
) -> Float[Tensor, "batch query key"]:
    """``rho_ij = ||x_j T_ij|| / ||x_j||`` on every pair, ``||x_j T_ij||^2 = H^2 g_ij^T G_j g_ij``.

    0 where ``x_j = 0``. Every ``(i, j)`` gets a value; weight by the walk to keep edges.
    Chunked over queries (``query_chunk`` rows, ``None``: as many as fit the chunk budget,
    ``CHUNK_ENTRIES`` numbers on the CPU, a share of its memory on a GPU); the result does
    not depend on the chunking. With ``walk``, each chunk stops at its last edge's key and
    leaves 0 beyond (the future of a causal walk): the same values on every edge, about half
    the work. ``grams``: the `message_grams` of ``field``, ``W_V``, ``W_O`` when already
    computed.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> message_norm_ratios(torch.randn(1, 3, 8), A / A.sum(1, keepdim=True),
    ...                     torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([1, 3, 3])
    """
    field, W_V, W_O, gates = cast_operands(field, W_V, W_O, gates)
    _check_gates(gates, W_V.shape[0], field.shape[1])
    check_chunk(query_chunk)
    grams = message_grams(field, W_V, W_O) if grams is None else grams.to(gates)
    batch, _, n_query, n_key = gates.shape
    rho = gates.new_zeros(batch, n_query, n_key)
    scaled = _key_major(_ratio_grams(grams[None], field))
    for rows, keys in _norm_chunks(gates, 1, query_chunk, walk):
        rho[:, rows, :keys] = _norms_sq(gates, scaled, rows, keys)[0].clamp_min_(0.0).sqrt_()
    return rho


def head_message_norm_ratios(
    field: Float[Tensor, "batch key d_model"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    grams: Float[Tensor, "batch key head head"] | None = None,
) -> Float[Tensor, "batch key head"]:
    """``rho^h_j = ||x_j T^h|| / ||x_j||``: the same for every query, so indexed by key only.

    0 where ``x_j = 0``. ``grams``: the `message_grams` of these inputs when already computed.

    >>> head_message_norm_ratios(torch.randn(1, 3, 8), torch.randn(2, 8, 4),
    ...                          torch.randn(2, 4, 8)).shape
    torch.Size([1, 3, 2])
    """
    field, W_V, W_O = cast_operands(field, W_V, W_O)
    if grams is None:
        grams = message_grams(field, W_V, W_O)
    norm_sq = grams.to(field).diagonal(dim1=-2, dim2=-1)
    return _ratio(norm_sq, _field_norms(field)[:, :, None])


def _sent(field: Tensor, shape: torch.Size) -> Tensor | None:
    """The edges whose key carries a non-zero field, or None when that is every edge."""
    has_field = _field_norms(field) > 0
    if has_field.all():
        return None
    return has_field[:, None, :].expand(shape)


def field_isometry_defect(
    field: Float[Tensor, "batch key d_model"],
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    exclude_sink: bool = False,
    query_chunk: int | None = None,
    grams: Float[Tensor, "batch key head head"] | None = None,
) -> Float[Tensor, " batch"]:
    """The field isometry defect: the walk-weighted coefficient of variation of ``rho_ij``.

    ``CV = sqrt(sum p (rho - m)^2) / m``, ``m = sum p rho``, ``p_ij ~ W_ij`` as in
    `tl_connwalk.core.isometry.walk_weighted_cv` (``exclude_sink`` drops key 0 and
    renormalises rows). Invariant under ``x -> c x`` and ``T -> c T``. ``O(batch n^2 H^2)``
    beside the `message_grams` (pass them as ``grams`` when already computed).

    >>> A = torch.softmax(torch.randn(1, 1, 3, 3), -1)
    >>> Q = torch.linalg.qr(torch.randn(8, 8)).Q
    >>> field_isometry_defect(torch.randn(1, 3, 8), A.mean(1), torch.ones_like(A),
    ...                       3 * Q[None], Q.T[None])
    tensor([0.])
    """
    field, W_V, W_O, gates = cast_operands(field, W_V, W_O, gates)
    _check_gates(gates, W_V.shape[0], field.shape[1])
    grams = message_grams(field, W_V, W_O) if grams is None else grams
    return field_isometry_defects(
        field, walk, gates, grams[None], exclude_sink=exclude_sink, query_chunk=query_chunk
    )[0]


def field_isometry_defects(
    field: Float[Tensor, "batch key d_model"],
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    grams: Float[Tensor, "family batch key head head"],
    *,
    exclude_sink: bool = False,
    query_chunk: int | None = None,
    edges: Bool[Tensor, "batch query key"] | None = None,
) -> Float[Tensor, "family batch"]:
    """`field_isometry_defect` of several transport families on one walk, in one pass.

    Family ``f`` is given by its `message_grams` ``grams[f]`` (a layer and its random draws,
    say): the gates are read once per chunk of queries for every family, and the ``rho`` of
    each span of chunks (`_spans`: as many as the chunk budget holds) is summarised by its
    float64 weighted mean and centred spread (`tl_connwalk.core.moments.Moments`, two passes
    over the span), all spans merged at the end (`Moments.merged`): no ``E[rho^2] - E[rho]^2``
    cancellation, so equal ratios give 0 exactly, and no ``[batch, n, n]`` tensor of ratios is
    kept beyond one span. The field's norms and ``H^2`` are folded into the Grams first
    (`_ratio_grams`). Time ``O(batch n^2 family H^2)``, memory the walk's size plus one chunk
    and one span. ``edges`` ``[batch, query, key]`` keeps only those edges
    (rows renormalised over them, as ``exclude_sink``), e.g. `tl_connwalk.core.padding.scope`'s.

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> grams = message_grams(torch.randn(1, 4, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> field_isometry_defects(torch.randn(1, 4, 8), A.mean(1), A / A.sum(1, keepdim=True),
    ...                        torch.stack([grams, 2 * grams])).shape
    torch.Size([2, 1])
    """
    dtype = working_dtype(field, gates, grams)
    field, gates, grams = (t.to(device=field.device, dtype=dtype) for t in (field, gates, grams))
    if grams.ndim != 5 or grams.shape[1:3] != field.shape[:2]:
        raise ConnWalkError(
            f"grams {tuple(grams.shape)} must be [family, batch, key, head, head] over the "
            f"field's {tuple(field.shape[:2])} [batch, key]."
        )
    _check_gates(gates, grams.shape[-1], field.shape[1])
    check_chunk(query_chunk)
    check_flag(exclude_sink, "exclude_sink")
    kept = _sent(field, walk.shape)
    if edges is not None:
        kept = edges if kept is None else kept & edges.to(kept.device)
    weights, _ = edge_weights(walk, exclude_sink, kept)
    # the moments run in float64 (span by span: no float64 copy of the walk)
    weights = weights.to(gates.device)
    empty = gates.new_zeros(grams.shape[:2], dtype=torch.float64)
    parts = [Moments(count=empty, mean=empty, m2=empty)]  # each span's, merged at the end
    scaled = _key_major(_ratio_grams(grams, field))
    chunks = _norm_chunks(gates, grams.shape[0], query_chunk, walk)
    for span, keys, spanned in _spans(chunks, grams.shape[0] * field.shape[0], gates.device):
        # the span's ratios, 0 off its chunks' keys and rows (no edge there)
        rho = gates.new_zeros(grams.shape[0], field.shape[0], span.stop - span.start, keys)
        for rows, width in spanned:
            rho_sq = _norms_sq(gates, scaled, rows, width)
            within = slice(rows.start - span.start, rows.stop - span.start)
            rho[:, :, within, :width] = rho_sq.clamp_min_(0.0).sqrt_()
        weight = weights[:, span, :keys]
        rho = torch.where(weight > 0, rho, 0.0)  # no value off the walk, not even a NaN
        parts.append(Moments.of_edges(rho.to(torch.float64), weight.to(torch.float64)))
    return Moments.merged(parts).cv.to(working_dtype(field, gates, grams))


#: Numbers held per ratio of a span (`_spans`): the float32 ratios, their float64 copy and
#: the float64 temporaries of its summary, counted in float32 entries.
_SPAN_COPIES = 8


def _spans(
    chunks: Sequence[tuple[slice, int]], per_row_key: int, device: torch.device
) -> list[tuple[slice, int, list[tuple[slice, int]]]]:
    """Consecutive chunks summarised together, as ``(rows, keys, chunks)``: as many as keep
    ``_SPAN_COPIES`` numbers per ratio (``per_row_key`` ratios per row and key) within the
    chunk budget of ``device`` (at least one chunk), over their rows and widest keys.

    A span's ratios ``[family, batch, rows, keys]`` are a small share of a chunk's products
    (those hold ``head x (2 + family)`` numbers per edge), so one summary
    (`Moments.of_edges`) covers several chunks.

    >>> [(rows, keys, len(spanned)) for rows, keys, spanned in _spans(
    ...     [(slice(0, 2), 2), (slice(2, 4), 4), (slice(6, 8), 8)], 1, torch.device("cpu"))]
    [(slice(0, 8, None), 8, 3)]
    """
    spans: list[tuple[slice, int, list[tuple[slice, int]]]] = []
    budget = chunk_entries(device)
    for rows, keys in chunks:
        if spans:
            span, width, spanned = spans[-1]
            wider = max(width, keys)
            if (rows.stop - span.start) * wider * per_row_key * _SPAN_COPIES <= budget:
                spans[-1] = (slice(span.start, rows.stop), wider, [*spanned, (rows, keys)])
                continue
        spans.append((rows, keys, [(rows, keys)]))
    return spans


def head_field_isometry_defects(
    field: Float[Tensor, "batch key d_model"],
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    exclude_sink: bool = False,
    query_chunk: int | None = None,
    grams: Float[Tensor, "batch key head head"] | None = None,
    edges: Bool[Tensor, "batch query key"] | None = None,
) -> Float[Tensor, "batch head"]:
    """Per head: the CV of ``rho^h_j = ||x_j T^h|| / ||x_j||`` weighted by that head's walk.

    Head ``h`` alone is the connection walk ``(A^h, T^h)`` with ``A^h = H W g^h``, so its edge
    ``(i, j)`` weighs ``A^h_ij`` and carries ``rho^h_j``. Since ``rho^h_j`` depends on the key only,
    the weighted sums run over keys with column weights ``sum_i A^h_ij`` (rows renormalised first
    when keys are dropped): ``O(batch n^2 H)`` time, chunked over queries (``query_chunk`` rows;
    ``None``: the chunk budget, ``CHUNK_ENTRIES`` numbers on the CPU). ``edges`` ``[batch, query,
    key]`` keeps only those edges of every head's walk, rows renormalised.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> head_field_isometry_defects(torch.randn(1, 3, 8), A.mean(1), A / A.sum(1, keepdim=True),
    ...                             torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([1, 2])
    """
    if walk.ndim != 3 or gates.ndim != 4 or gates.shape[:1] + gates.shape[2:] != walk.shape:
        raise ConnWalkError(
            f"gates {tuple(gates.shape)} and walk {tuple(walk.shape)} disagree: need gates "
            "[batch, head, query, key] and walk [batch, query, key]."
        )
    check_flag(exclude_sink, "exclude_sink")
    check_chunk(query_chunk)
    rho = head_message_norm_ratios(field, W_V, W_O, grams=grams)  # [batch, key, head]
    walk_w, gates_w = walk.to(rho), gates.to(rho)
    check_walk_nonnegative(walk_w)
    n_heads = gates.shape[1]
    # the value rho^h_j depends on the key only, so every walk-weighted sum over edges is a sum
    # over keys of column weights: no [batch, head, query, key] tensor beyond the gates
    keys = _field_norms(field) > 0  # keys that send a message
    if exclude_sink:
        keys = keys.clone()
        keys[:, 0] = False
    restricted = exclude_sink or not bool(keys.all()) or edges is not None
    keys_w = keys.to(rho)
    batch, _, n_query, n_key = gates.shape
    column = torch.zeros(batch, n_heads, n_key, dtype=rho.dtype, device=rho.device)
    for rows in query_chunks(n_query, 2 * batch * n_heads * n_key, query_chunk, rho.device):
        pattern = n_heads * walk_w[:, None, rows] * gates_w[:, :, rows]  # A^h on these rows
        if edges is not None:
            pattern = pattern * edges[:, None, rows].to(pattern)
        if restricted:
            # rows renormalised over the kept keys; rows without mass there drop out
            row_mass = einsum(
                pattern, keys_w, "batch head query key, batch key -> batch head query"
            )
            # a division, not a product with 1 / mass: a subnormal mass has no float32 inverse
            has_mass = (row_mass > 0)[..., None]
            divisor = torch.where(has_mass, row_mass[..., None], 1.0)
            pattern = torch.where(has_mass, pattern / divisor, 0.0)
        column += reduce(pattern, "batch head query key -> batch head key", "sum")
    column = column * keys_w[:, None, :]
    values = rearrange(rho, "batch key head -> batch head key")
    return Moments.of_weighted(values, column).cv
