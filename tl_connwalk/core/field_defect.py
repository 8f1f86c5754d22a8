"""The data-dependent field isometry defect (SPEC section 3).

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

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core.isometry import (
    _check_chunk,
    _edge_chunks,
    _query_chunks,
    check_flag,
    walk_weighted_cv,
    working_dtype,
)
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


def message_grams(
    field: Float[Tensor, "batch key d_model"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
) -> Float[Tensor, "batch key head head"]:
    """The head-message Gram ``G_j[a,b] = (x_j T^a) . (x_j T^b)`` of every key.

    Through the messages ``m^h_j = (x_j W_V^h) W_O^h``, a block of keys at a time (at most
    ``isometry.CHUNK_ENTRIES / 4`` message entries): ``O(batch n H d_head d_model + batch n H^2
    d_model)`` time, working memory one block of ``[key, head, d_model]`` messages; the
    ``d_model x d_model`` maps ``T^h`` and the ``H^2 d_head^2`` output Gram are never formed.

    >>> message_grams(torch.randn(1, 3, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([1, 3, 2, 2])
    """
    field, W_V, W_O = _cast(field, W_V, W_O)
    batch, n_key, d_model = field.shape
    n_heads = W_V.shape[0]
    keys = rearrange(field, "batch key d_model -> (batch key) d_model")
    grams = keys.new_empty(batch * n_key, n_heads, n_heads)  # filled block by block
    # a quarter of the chunk budget: larger blocks only raise the peak (8B shape: 64 MiB more)
    for block in _query_chunks(batch * n_key, 4 * n_heads * d_model):
        messages = keys.new_empty(keys[block].shape[0], n_heads, d_model)
        for h in range(n_heads):  # head by head: no W_V-sized layout copy
            messages[:, h] = (keys[block] @ W_V[h]) @ W_O[h]
        grams[block] = messages @ messages.mT
    return rearrange(grams, "(batch key) a b -> batch key a b", batch=batch)


def _field_norms(field: Tensor) -> Tensor:
    return torch.linalg.vector_norm(field, dim=-1)


def _ratio(norm_sq: Tensor, field_norm: Tensor) -> Tensor:
    """``sqrt(norm_sq) / field_norm`` with 0 where the field is 0."""
    has_field = field_norm > 0
    ratio = norm_sq.clamp_min(0.0).sqrt() / torch.where(has_field, field_norm, 1.0)
    return torch.where(has_field, ratio, 0.0)


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
    if gates.ndim != 4 or gates.shape[1] != W_V.shape[0] or gates.shape[3] != field.shape[1]:
        raise ConnWalkError(
            f"gates {tuple(gates.shape)} must be [batch, head, query, key] with head = "
            f"{W_V.shape[0]} and key = {field.shape[1]} (the field's positions)."
        )
    _check_chunk(query_chunk)
    batch, n_heads, n_query, n_key = gates.shape
    grams = message_grams(field, W_V, W_O) if grams is None else grams.to(gates)
    norm_sq = gates.new_zeros(batch, n_query, n_key)
    for rows, keys in _edge_chunks(n_query, n_key, batch * n_heads * n_key, query_chunk, walk):
        g = gates[:, :, rows, :keys]
        mixed = einsum(g, grams[:, :keys], "batch a query key, batch key a c -> batch c query key")
        norm_sq[:, rows, :keys] = einsum(
            mixed, g, "batch c query key, batch c query key -> batch query key"
        )
    norm_sq.mul_(n_heads**2)
    return _ratio(norm_sq, _field_norms(field)[:, None, :])


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
    rho = message_norm_ratios(
        field, gates, W_V, W_O, query_chunk=query_chunk, walk=walk, grams=grams
    )
    edges = _sent(field, rho.shape)
    return walk_weighted_cv(walk, rho, exclude_sink=exclude_sink, edges=edges)


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
) -> Float[Tensor, "batch head"]:
    """Per head: the CV of ``rho^h_j = ||x_j T^h|| / ||x_j||`` weighted by that head's walk.

    Head ``h`` alone is the connection walk ``(A^h, T^h)`` with ``A^h = H W g^h``, so its edge
    ``(i, j)`` weighs ``A^h_ij`` and carries ``rho^h_j``. Since ``rho^h_j`` depends on the key
    only, the weighted sums run over keys with column weights ``sum_i A^h_ij`` (rows
    renormalised first when keys are dropped): ``O(batch n^2 H)`` time, chunked over queries
    (``query_chunk`` rows; ``None``: ``isometry.CHUNK_ENTRIES`` numbers per chunk).

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
    _check_chunk(query_chunk)
    rho = head_message_norm_ratios(field, W_V, W_O, grams=grams)  # [batch, key, head]
    walk_w, gates_w = walk.to(rho), gates.to(rho)
    if (walk_w < 0).any():
        raise ConnWalkError("walk has negative entries; a walk matrix is >= 0 (SPEC 1).")
    n_heads = gates.shape[1]
    # the value rho^h_j depends on the key only, so every walk-weighted sum over edges is a sum
    # over keys of column weights: no [batch, head, query, key] tensor beyond the gates
    keys = _field_norms(field) > 0  # keys that send a message
    if exclude_sink:
        keys = keys.clone()
        keys[:, 0] = False
    restricted = exclude_sink or not bool(keys.all())
    keys_w = keys.to(rho)
    batch, _, n_query, n_key = gates.shape
    column = torch.zeros(batch, n_heads, n_key, dtype=rho.dtype, device=rho.device)
    for rows in _query_chunks(n_query, 2 * batch * n_heads * n_key, query_chunk):
        pattern = n_heads * walk_w[:, None, rows] * gates_w[:, :, rows]  # A^h on these rows
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
    total = reduce(column, "batch head key -> batch head 1", "sum")
    p = torch.where(total > 0, column / torch.where(total > 0, total, 1.0), 0.0)
    values = rearrange(rho, "batch key head -> batch head key")
    mean = einsum(p, values, "batch head key, batch head key -> batch head")
    var = einsum(p, (values - mean[..., None]) ** 2, "batch head key, batch head key -> batch head")
    safe = torch.where(mean != 0, mean, torch.ones_like(mean))
    return torch.where(mean != 0, var.clamp_min(0.0).sqrt() / safe.abs(), torch.zeros_like(mean))
