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

from collections.abc import Callable, Iterator

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core._fast.chunks import edge_chunks, query_chunks
from tl_connwalk.core.checks import check_chunk, check_flag, check_walk_nonnegative, working_dtype
from tl_connwalk.core.moments import Moments
from tl_connwalk.core.weighted import edge_weights
from tl_connwalk.errors import ConnWalkError


def _cast(field: Tensor, W_V: Tensor, W_O: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
    if field.ndim != 3 or W_V.ndim != 3 or W_O.ndim != 3:
        raise ConnWalkError(
            f"field must be [batch, key, d_model], W_V [head, d_model, d_head] and W_O "
            f"[head, d_head, d_model]; got {tuple(field.shape)}, {tuple(W_V.shape)}, "
            f"{tuple(W_O.shape)}."
        )
    if field.shape[-1] != W_V.shape[1] or W_V.shape[::2] != W_O.shape[:2]:
        raise ConnWalkError(
            f"field {tuple(field.shape)}, W_V {tuple(W_V.shape)} and W_O {tuple(W_O.shape)} do "
            "not compose: the field's last axis is W_V's d_model, and W_O is [head, d_head, "
            "d_model] with W_V's head and d_head."
        )
    dtype = working_dtype(field, W_V, W_O, *rest)
    return tuple(t.to(device=field.device, dtype=dtype) for t in (field, W_V, W_O, *rest))


def output_gram_rows(
    out_blocks: Float[Tensor, "head head d_head d_head"],
) -> Float[Tensor, " packed"]:
    """The output Gram ``W_O^cat W_O^cat^T`` by its upper block rows, packed (``out_rows`` of
    `message_grams`).

    ``out_blocks[a, b] = W_O^a W_O^b^T`` (`tl_connwalk.core.isometry.head_factor_grams`' second
    result). Row block ``a`` keeps the blocks ``b >= a`` as one ``[d_head, (H - a) d_head]``
    matrix, the rows one after another: ``d_head^2 H (H + 1) / 2`` numbers, about half of the
    symmetric Gram (GPT-2 small: 1.2 MiB in float32 against 2.25 MiB).

    >>> W_O = torch.randn(3, 2, 8)
    >>> output_gram_rows(einsum(W_O, W_O, "a p d, b q d -> a b p q")).shape  # 4 * 3 * 4 / 2
    torch.Size([24])
    """
    n_heads = out_blocks.shape[0]
    return torch.cat([rearrange(out_blocks[a, a:], "b p q -> (p b q)") for a in range(n_heads)])


def output_gram_rows_numel(n_heads: int, d_head: int) -> int:
    """Numbers `output_gram_rows` packs for ``n_heads`` heads of ``d_head``:
    ``d_head^2 H (H + 1) / 2``.

    >>> output_gram_rows_numel(3, 2)
    24
    """
    return d_head * d_head * n_heads * (n_heads + 1) // 2


def _gram_rows(out_rows: Tensor, n_heads: int, d_head: int) -> list[Tensor]:
    """Views of the row blocks packed by `output_gram_rows`, each ``[d_head, (H - a) d_head]``."""
    expected = output_gram_rows_numel(n_heads, d_head)
    if out_rows.shape != (expected,):
        raise ConnWalkError(
            f"out_rows {tuple(out_rows.shape)} must be [{expected}]: the upper block rows of "
            f"W_O^cat W_O^cat^T for {n_heads} heads of {d_head}, packed by output_gram_rows."
        )
    sizes = [d_head * (n_heads - a) * d_head for a in range(n_heads)]
    return [
        part.view(d_head, (n_heads - a) * d_head) for a, part in enumerate(out_rows.split(sizes))
    ]


def message_grams(
    field: Float[Tensor, "batch key d_model"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    out_rows: Float[Tensor, " packed"] | None = None,
) -> Float[Tensor, "batch key head head"]:
    """The head-message Gram ``G_j[a,b] = (x_j T^a) . (x_j T^b)`` of every key.

    Without ``out_rows``, through the messages ``m^h_j = (x_j W_V^h) W_O^h``:
    ``O(batch n H d_head d_model + batch n H^2 d_model)`` time. With ``out_rows``, the upper
    block rows of ``W_O^cat W_O^cat^T`` (blocks ``W_O^a W_O^b^T``, packed by
    `output_gram_rows`; `tl_connwalk.core.head_grams.HeadGrams` keeps them for narrow
    layers), through the values ``v^a_j = x_j W_V^a`` alone::

        G_j[a,b] = v^a_j (W_O^a W_O^b^T) v^b_j^T

    for the pairs ``a <= b``: ``O(batch n H d_head (d_model + H d_head / 2))``, 1.6x faster at
    256 tokens and 2.6x at 1024 for GPT-2 small's heads (one CPU thread). Either way a block of
    keys at a time (at most ``isometry.CHUNK_ENTRIES / 4`` entries of its temporaries); the
    ``d_model x d_model`` maps ``T^h`` are never formed.

    >>> field, W_V, W_O = torch.randn(1, 3, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    >>> G = message_grams(field, W_V, W_O)
    >>> G.shape
    torch.Size([1, 3, 2, 2])
    >>> out_rows = output_gram_rows(einsum(W_O, W_O, "a p d, b q d -> a b p q"))
    >>> torch.allclose(message_grams(field, W_V, W_O, out_rows=out_rows), G, atol=1e-4)
    True
    """
    field, W_V, W_O = _cast(field, W_V, W_O)
    batch = field.shape[0]
    keys = rearrange(field, "batch key d_model -> (batch key) d_model")
    heads = (W_V.shape[0], W_V.shape[2])
    if out_rows is not None:  # W_V^cat in one product (a view for the draws' factors)
        values = rearrange(W_V, "head d_model d_head -> d_model (head d_head)")
        grams = _value_grams(lambda block: keys[block] @ values, keys, heads, None, out_rows)
    else:  # head by head: no W_V-sized layout copy
        grams = _value_grams(
            lambda block: torch.stack([keys[block] @ W_V[h] for h in range(heads[0])], 1),
            keys,
            heads,
            W_O,
            None,
        )
    return rearrange(grams, "(batch key) a b -> batch key a b", batch=batch)


def factored_message_grams(
    factor: Float[Tensor, "row rank"],
    values: Float[Tensor, "rank head_d_head"],
    n_heads: int,
    *,
    W_O: Float[Tensor, "head d_head d_model"] | None = None,
    out_rows: Float[Tensor, " packed"] | None = None,
) -> Float[Tensor, "row head head"]:
    """`message_grams` of rows whose values ``[v^1_j ... v^H_j]`` are ``factor[j] @ values``.

    ``values`` is ``[rank, H d_head]`` (heads side by side); the output side is ``out_rows``
    (as in `message_grams`) or else ``W_O``. A random baseline's values ``X R_V`` are, in
    distribution, ``L Y`` with ``L L^T = X X^T`` and ``Y`` standard Gaussian
    (`tl_connwalk.core.draws.key_factor`): ``O(n^2 H d_head)`` instead of
    ``O(n d_model H d_head)`` for ``n < d_model`` keys.

    >>> L, Y, W_O = torch.randn(3, 3).tril(), torch.randn(3, 8), torch.randn(2, 4, 5)
    >>> factored_message_grams(L, Y, 2, W_O=W_O).shape
    torch.Size([3, 2, 2])
    """
    side = out_rows if W_O is None else W_O
    if side is None or (W_O is not None and out_rows is not None):
        raise ConnWalkError("factored_message_grams needs W_O or out_rows (one of them).")
    dtype = working_dtype(factor, values, side)
    factor, values = (t.to(device=factor.device, dtype=dtype) for t in (factor, values))
    d_head = values.shape[-1] // max(1, n_heads)
    if (
        factor.ndim != 2
        or values.shape != (factor.shape[1], n_heads * d_head)
        or (W_O is not None and W_O.shape[:2] != (n_heads, d_head))
    ):
        raise ConnWalkError(
            f"factor {tuple(factor.shape)} and values {tuple(values.shape)} must be [row, rank] "
            f"and [rank, head d_head] for {n_heads} heads"
            + ("" if W_O is None else f" of W_O {tuple(W_O.shape)} [head, d_head, d_model]")
            + "."
        )
    return _value_grams(
        lambda block: factor[block] @ values,
        factor,
        (n_heads, d_head),
        None if W_O is None else W_O.to(factor),
        out_rows,
    )


def _value_grams(
    values_of: Callable[[slice], Tensor],
    rows_like: Tensor,
    heads: tuple[int, int],
    W_O: Tensor | None,
    out_rows: Tensor | None,
) -> Tensor:
    """``G_j[a,b]`` ``[row, head, head]`` (``rows_like``'s rows, dtype and device) from each
    block's values ``values_of(rows)`` (``[rows, head, d_head]`` or ``[rows, head d_head]``),
    block by block of rows: through ``out_rows`` where given, else through ``W_O``."""
    (n_heads, d_head), n_rows = heads, rows_like.shape[0]
    grams = rows_like.new_empty(n_rows, n_heads, n_heads)  # filled block by block
    if out_rows is None:
        if W_O is None:
            raise ConnWalkError("message Grams need W_O or out_rows (one of them).")
        # a quarter of the chunk budget: larger blocks only raise the peak (8B: 64 MiB more)
        for block in query_chunks(n_rows, 4 * n_heads * W_O.shape[-1]):
            v = values_of(block).view(-1, n_heads, d_head)
            messages = v.new_empty(v.shape[0], n_heads, W_O.shape[-1])
            for h in range(n_heads):
                messages[:, h] = v[:, h] @ W_O[h]
            grams[block] = messages @ messages.mT
        return grams
    gram_rows = _gram_rows(out_rows.to(rows_like), n_heads, d_head)
    # per row: its values, and one head's pair forms (at most H d_head) at a time
    for block in query_chunks(n_rows, 4 * 2 * n_heads * d_head):
        v = values_of(block).view(-1, n_heads, d_head)
        for a, rows in enumerate(gram_rows):
            pair = (v[:, a] @ rows).view(-1, n_heads - a, d_head)
            grams[block, a, a:] = (pair * v[:, a:]).sum(-1)
    upper = torch.ones(n_heads, n_heads, dtype=torch.bool, device=grams.device).triu()
    return torch.where(upper, grams, grams.mT)  # G_j[b,a] = G_j[a,b]


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


def _chunk_norms_sq(
    gates: Tensor, grams: Tensor, query_chunk: int | None, walk: Tensor | None
) -> Iterator[tuple[slice, int, Tensor]]:
    """The forms ``g_ij^T G_j g_ij`` of every family, chunk by chunk of queries
    (``||x_j T_ij||^2 = H^2 g_ij^T G_j g_ij``; with `_ratio_grams`, ``rho_ij^2``).

    ``grams`` ``[family, batch, key, head, head]``. Yields ``(rows, keys, norm_sq)`` with
    ``norm_sq`` ``[family, batch, rows, keys]`` over the chunk's keys (`edge_chunks`: with
    ``walk``, the keys up to the chunk's last edge). Key-major: each key's gates of the chunk
    ``[head, rows]`` meet every family's ``G_j`` in one batched product, so the gates are read
    once for all families (a head-contracting einsum over ``[batch, head, query, key]`` is
    bound by its layout copies: 2.5-4x slower on CPU).
    """
    families, batch, n_key, n_heads, _ = grams.shape
    n_query = gates.shape[2]
    stacked = rearrange(grams, "family batch key a c -> batch key (family a) c")
    per_query = batch * n_key * n_heads * (2 + families)
    for rows, keys in edge_chunks(n_query, n_key, per_query, query_chunk, walk):
        if keys == 0:  # no edge in these rows
            continue
        g = rearrange(gates[:, :, rows, :keys], "batch h query key -> (batch key) h query")
        g = g.contiguous()
        mixed = rearrange(stacked[:, :keys], "batch key fa c -> (batch key) fa c") @ g
        mixed = rearrange(mixed, "bk (family a) query -> bk family a query", family=families)
        norm_sq = mixed.mul_(g[:, None]).sum(2)  # 2x faster than einsum's bmm over (batch key)
        yield (
            rows,
            keys,
            rearrange(norm_sq, "(batch key) family query -> family batch query key", batch=batch),
        )


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
    Chunked over queries (``query_chunk`` rows, ``None``: as many as fit
    ``isometry.CHUNK_ENTRIES`` numbers); the result does not depend on the chunking. With
    ``walk``, each chunk stops at its last edge's key and leaves 0 beyond (the future of a
    causal walk): the same values on every edge, about half the work. ``grams``: the
    `message_grams` of ``field``, ``W_V``, ``W_O`` when already computed.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> message_norm_ratios(torch.randn(1, 3, 8), A / A.sum(1, keepdim=True),
    ...                     torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([1, 3, 3])
    """
    field, W_V, W_O, gates = _cast(field, W_V, W_O, gates)
    _check_gates(gates, W_V.shape[0], field.shape[1])
    check_chunk(query_chunk)
    grams = message_grams(field, W_V, W_O) if grams is None else grams.to(gates)
    batch, _, n_query, n_key = gates.shape
    rho = gates.new_zeros(batch, n_query, n_key)
    scaled = _ratio_grams(grams[None], field)
    for rows, keys, rho_sq in _chunk_norms_sq(gates, scaled, query_chunk, walk):
        rho[:, rows, :keys] = rho_sq[0].clamp_min_(0.0).sqrt_()
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
    field, W_V, W_O = _cast(field, W_V, W_O)
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
    field, W_V, W_O, gates = _cast(field, W_V, W_O, gates)
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
    say): the gates are read once per chunk of queries for every family, and each chunk's
    ``rho`` is summarised by its float64 weighted mean and centred spread
    (`tl_connwalk.core.moments.Moments`, two passes over the chunk), merged chunk by chunk
    with Chan's update: no ``E[rho^2] - E[rho]^2`` cancellation, so equal ratios give 0
    exactly, and no ``[batch, n, n]`` tensor of ratios is kept. The field's norms and ``H^2``
    are folded into the Grams first (`_ratio_grams`). Time ``O(batch n^2 family H^2)``, memory
    the walk's size plus one chunk. ``edges`` ``[batch, query, key]`` keeps only those edges
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
    # the moments run in float64 (chunk by chunk: no float64 copy of the walk)
    weights = weights.to(gates.device)
    empty = gates.new_zeros(grams.shape[:2], dtype=torch.float64)
    moments = Moments(count=empty, mean=empty, m2=empty)
    scaled = _ratio_grams(grams, field)
    for rows, keys, rho_sq in _chunk_norms_sq(gates, scaled, query_chunk, walk):
        weight = weights[:, rows, :keys]
        rho = rho_sq.clamp_min_(0.0).sqrt_()
        rho = torch.where(weight > 0, rho, 0.0)  # no value off the walk, not even a NaN
        moments = moments.merge(
            Moments.of_weighted(
                rearrange(
                    rho.to(torch.float64), "family batch query key -> family batch (query key)"
                ),
                rearrange(weight.to(torch.float64), "batch query key -> batch (query key)"),
            )
        )
    return moments.cv.to(working_dtype(field, gates, grams))


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
    ``(i, j)`` weighs ``A^h_ij`` and carries ``rho^h_j``. Since ``rho^h_j`` depends on the key
    only, the weighted sums run over keys with column weights ``sum_i A^h_ij`` (rows
    renormalised first when keys are dropped): ``O(batch n^2 H)`` time, chunked over queries
    (``query_chunk`` rows; ``None``: ``isometry.CHUNK_ENTRIES`` numbers per chunk). ``edges``
    ``[batch, query, key]`` keeps only those edges of every head's walk, rows renormalised.

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
    for rows in query_chunks(n_query, 2 * batch * n_heads * n_key, query_chunk):
        pattern = n_heads * walk_w[:, None, rows] * gates_w[:, :, rows]  # A^h on these rows
        if edges is not None:
            pattern = pattern * edges[:, None, rows].to(pattern)
        if restricted:
            # rows renormalised over the kept keys; rows without mass there drop out
            row_mass = einsum(
                pattern, keys_w, "batch head query key, batch key -> batch head query"
            )
            has_mass = row_mass > 0
            pattern = (
                pattern
                * torch.where(has_mass, 1.0 / torch.where(has_mass, row_mass, 1.0), 0.0)[..., None]
            )
        column += reduce(pattern, "batch head query key -> batch head key", "sum")
    column = column * keys_w[:, None, :]
    values = rearrange(rho, "batch key head -> batch head key")
    return Moments.of_weighted(values, column).cv
