"""The per-edge Gram defects and scales of the effective transports ``T_ij = H sum_h g^h_ij T^h``
in closed form (spec §3), chunked over queries and blocks of edges, several transport
families (a layer and its random draws) in one pass over the gates."""

from typing import NamedTuple

import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core._fast import quartic
from tl_connwalk.core._fast.chunks import edge_block, edge_chunks, query_chunks
from tl_connwalk.core._fast.grams import fold_pairs
from tl_connwalk.core._fast.quartic import QuarticRows
from tl_connwalk.core.checks import (
    cast_gates,
    check_chunk,
    check_edges,
    check_flag,
    check_gates,
    check_heads,
    check_rank,
    ratio_defect,
    working_dtype,
)
from tl_connwalk.core.weighted import edge_weights
from tl_connwalk.errors import ConnWalkError


def edge_frobenius_sq(
    gates: Tensor, K2: Tensor, query_chunk: int | None = None, walk: Tensor | None = None
) -> Tensor:
    """``sum sigma^2(T_ij) = ||T_ij||_F^2 = H^2 g_ij^T K2 g_ij``, ``[batch, query, key]``.

    Chunked over queries: one chunk of ``[batch, head, rows, key]`` at a time beside the gates.
    With ``walk``, keys past each chunk's last edge are skipped (`edge_chunks`).
    """
    batch, n_heads, n_query, n_key = gates.shape
    out = gates.new_zeros(batch, n_query, n_key)
    for rows, keys in edge_chunks(
        n_query, n_key, batch * n_heads * n_key, query_chunk, walk, gates.device
    ):
        g = gates[:, :, rows, :keys]
        mixed = einsum(g, K2, "batch a query key, a b -> batch b query key")
        out[:, rows, :keys] = einsum(
            mixed, g, "batch b query key, batch b query key -> batch query key"
        )
    return out.mul_(n_heads**2)


def _family_gram_defects(g: Tensor, rows: QuarticRows, rank: int) -> tuple[Tensor, Tensor]:
    """``eps`` and ``sum sigma^2`` of the edges with gates ``g`` ``[head, edge]``, per family:
    two ``[family, edge]`` (stacked `QuarticRows`: ``[stack, head, edge]`` to two ``[stack,
    family, edge]``).

    The families (`tl_connwalk.core._fast.quartic.quartic_rows`: a layer and its random draws, say)
    share the gates, so each block of edges (`edge_block`) is read once and multiplied by
    every family's Grams at once::

        sum sigma^2 = H^2 g^T K2[f] g,    sum sigma^4 = H^4 u^T fold(K4[f]) u,  u_{ac} = g^a g^c

    the quartic monomial by monomial (`tl_connwalk.core._fast.quartic.forms`). Blocks keep the
    temporaries in cache: the work is bound by memory traffic as much as by flops.
    """
    n_heads = g.shape[-2]
    g = _without_subnormal_products(g)
    sigma4, sigma2 = quartic.forms(g, rows, edge_block(g.device, rows))
    sigma2 *= n_heads**2
    sigma4 *= n_heads**4
    return ratio_defect(rank * sigma4 - sigma2**2, rank * sigma4), sigma2


def _without_subnormal_products(g: Tensor) -> Tensor:
    """The gates ``g`` with those below ``t = tiny^(1/4)`` of their dtype set to 0 (3.3e-10
    in float32, 1.2e-77 in float64).

    Their products in the quartic forms (four gates and a coefficient) would be subnormal
    numbers, which x86 CPUs multiply and add up to a hundred times slower: heads that
    leave one another gates of 1e-20 on most edges made the forms 4x slower on one CPU
    core. The gates of an edge sum to 1, so dropping them moves ``g^T K2 g`` by at most
    ``2 H t max|K2|`` (for 128 heads ``8.4e-8 max|K2|``, below a float32 rounding) and
    the quartic form likewise.

    >>> _without_subnormal_products(torch.tensor([0.5, 1e-12, 0.5]))
    tensor([0.5000, 0.0000, 0.5000])
    """
    return g.masked_fill(g < torch.finfo(g.dtype).tiny ** 0.25, 0.0)


def _runs(b: Tensor, batch: int) -> list[int]:
    """How many of the listed edges belong to each batch element (``b`` ascending, as
    ``nonzero`` lists them, so each element's edges are one run)."""
    return torch.bincount(b, minlength=batch).tolist()


def _listed_gates(gates: Tensor, runs: list[int], i: Tensor, j: Tensor) -> Tensor:
    """The gates ``[stack, batch, head, query, key]`` of the listed edges as ``[stack, head,
    edge]``.

    ``runs`` (`_runs`) splits the edges ``(i, j)`` by batch element. One ``index_select`` of
    each element's ``[stack, head, query key]`` rows: 5x faster than indexing ``[b, :, i, j]``
    and transposing.
    """
    stack, n_heads, n_key = gates.shape[0], gates.shape[2], gates.shape[4]
    parts = [
        gates[:, k].reshape(stack, n_heads, -1).index_select(2, flat)
        for k, flat in enumerate((i * n_key + j).split(runs))
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _heads_by_edge(gates: Tensor) -> Tensor:
    """A chunk of gates ``[batch, head, query, key]`` as one ``[head, edge]`` block."""
    return rearrange(gates, "batch head query key -> head (batch query key)").contiguous()


def _zero_off_walk(values: Tensor, walk: Tensor | None) -> Tensor:
    if walk is None:
        return values
    if walk.shape != values.shape:
        raise ConnWalkError(
            f"walk {tuple(walk.shape)} must be [batch, query, key] like the gates' "
            f"{tuple(values.shape)}."
        )
    return torch.where(walk.to(values.device) > 0, values, torch.zeros_like(values))


def edge_gram_defects(
    gates: Float[Tensor, "batch head query key"],
    K2: Float[Tensor, "head head"],
    K4: Float[Tensor, "head head head head"],
    rank: int,
    walk: Float[Tensor, "batch query key"] | None = None,
    *,
    edges: Bool[Tensor, "batch query key"] | None = None,
    query_chunk: int | None = None,
) -> Float[Tensor, "batch query key"]:
    """The effective transport defect ``eps(T_ij)`` on every edge, in closed form (spec §3).

    ``sum sigma^2 = H^2 g^T K2 g`` and ``sum sigma^4 = H^4 sum g^a g^b g^c g^e K4[a,b,c,e]``, so
    ``eps_ij = sqrt(1 - (sum sigma^2)^2 / (r sum sigma^4))`` with no per-edge map. It equals the
    top-``r`` definition when ``r >= rank(T_ij)``, e.g. ``r = min(d_model, H_kv d_head)``
    (`effective_rank`, ``H_kv`` the distinct value heads). Costs ``O(batch n^2 H^4 / 24)``
    time, memory chunked over queries. Where ``walk`` is given, non-edges (``W_ij = 0``) get
    0; zero maps get 0.

    ``edges`` (e.g. `heaviest_edges`) restricts the work to those pairs, gathered into a
    list (``O(n_kept H^4 / 24)``); every other pair gets 0. ``query_chunk`` sets the number of
    query rows per chunk of the all-edge path (``None``: as many as fit the chunk budget,
    `chunks.chunk_entries`); the result does not depend on it.

    In the working dtype the closed form loses half the digits near 0 (it subtracts two
    nearly equal numbers): defects below ``~sqrt(machine eps)`` read as noise in float32.

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> from tl_connwalk.core._fast.grams import gram_matrices
    >>> K2, K4 = gram_matrices(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> edge_gram_defects(A / A.sum(1, keepdim=True), K2, K4, rank=8).shape
    torch.Size([1, 4, 4])
    """
    pair_gram = fold_pairs(K4.to(working_dtype(gates, K2, K4)))
    return _edge_gram_defects(gates, K2, pair_gram, rank, walk, edges, query_chunk)


def folded_edge_gram_defects(
    gates: Float[Tensor, "batch head query key"],
    K2: Float[Tensor, "head head"],
    pair_gram: Float[Tensor, "pair pair"],
    rank: int,
    walk: Float[Tensor, "batch query key"] | None = None,
    *,
    edges: Bool[Tensor, "batch query key"] | None = None,
    query_chunk: int | None = None,
) -> Float[Tensor, "batch query key"]:
    """`edge_gram_defects` from the folded ``pair_gram = fold_pairs(K4)`` (the form
    `tl_connwalk.core._fast.head_grams.HeadGrams` keeps) instead of ``K4``; the same values.

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> from tl_connwalk.core._fast.grams import gram_matrices
    >>> K2, K4 = gram_matrices(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> folded_edge_gram_defects(A / A.sum(1, keepdim=True), K2, fold_pairs(K4), rank=8).shape
    torch.Size([1, 4, 4])
    """
    return _edge_gram_defects(gates, K2, pair_gram, rank, walk, edges, query_chunk)


def _edge_gram_defects(
    gates: Tensor,
    K2: Tensor,
    pair_gram: Tensor,
    rank: int,
    walk: Tensor | None,
    edges: Tensor | None,
    query_chunk: int | None,
) -> Tensor:
    """`edge_gram_defects` from the folded ``K4``: the checks, the cast and the work."""
    check_gates(gates, K2.shape[0])
    check_rank(rank)
    check_chunk(query_chunk)
    gates, K2, pair_gram = cast_gates(gates, K2, pair_gram)
    families = quartic.quartic_rows(K2[None], pair_gram[None])
    if edges is not None:
        check_edges(edges, gates)
        b, i, j = edges.to(gates.device).nonzero(as_tuple=True)
        eps = torch.zeros(edges.shape, dtype=gates.dtype, device=gates.device)
        listed = _listed_gates(gates[None], _runs(b, gates.shape[0]), i, j)[0]
        eps[b, i, j] = _family_gram_defects(listed, families, rank)[0][0]
        return _zero_off_walk(eps, walk)
    batch, n_heads, n_query, n_key = gates.shape
    eps = gates.new_zeros(batch, n_query, n_key)  # filled chunk by chunk (see `query_chunks`)
    per_query = batch * n_key * (n_heads + 1)
    for rows, keys in edge_chunks(n_query, n_key, per_query, query_chunk, walk, gates.device):
        if keys == 0:  # no edge in these rows
            continue
        chunk, _ = _family_gram_defects(_heads_by_edge(gates[:, :, rows, :keys]), families, rank)
        eps[:, rows, :keys] = chunk.view(batch, -1, keys)
    return _zero_off_walk(eps, walk)


class GramMeans(NamedTuple):
    """Walk-weighted means per transport family and batch element (`gram_means`)."""

    defect: Float[Tensor, "family batch"]
    """``(1/n) sum_ij W_ij eps(T_ij)``: `effective_transport_defect`."""
    scale: Float[Tensor, "family batch"]
    """``(1/n) sum_ij W_ij ||T_ij||_F / sqrt(r)``: the Frobenius common scale (`common_scale`)."""


def gram_defect_means(
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    K2: Float[Tensor, "family head head"],
    pair_gram: Float[Tensor, "family pair pair"],
    rank: int,
    *,
    exclude_sink: bool = False,
    edges: Bool[Tensor, "batch query key"] | None = None,
    query_chunk: int | None = None,
) -> Float[Tensor, "family batch"]:
    """`effective_transport_defect` of several transport families on one walk, in one pass:
    `gram_means`' ``defect``.

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> from tl_connwalk.core._fast.grams import gram_matrices
    >>> K2, K4 = gram_matrices(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> gram_defect_means(A.mean(1), A / A.sum(1, keepdim=True), K2[None],
    ...                   fold_pairs(K4)[None], rank=8).shape
    torch.Size([1, 1])
    """
    return gram_means(
        walk, gates, K2, pair_gram, rank,
        exclude_sink=exclude_sink, edges=edges, query_chunk=query_chunk,
    ).defect  # fmt: skip


def gram_means(
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    K2: Float[Tensor, "family head head"],
    pair_gram: Float[Tensor, "family pair pair"],
    rank: int,
    *,
    exclude_sink: bool = False,
    edges: Bool[Tensor, "batch query key"] | None = None,
    query_chunk: int | None = None,
) -> GramMeans:
    """`effective_transport_defect` and the Frobenius common scale of several transport
    families on one walk, in one pass.

    Family ``f`` has head Grams ``K2[f]`` and ``pair_gram[f] = fold_pairs(K4[f])``, e.g. a
    layer and its random baseline draws, which share the walk and the gates: the gates are
    read once and each chunk's ``eps`` and ``||T_ij||_F / sqrt(r)`` of every family are folded
    into walk-weighted means at once (`walk_weighted_mean`, same ``exclude_sink`` and
    ``edges``), so no ``[batch, n, n]`` value is kept per family. Time ``O(batch n^2 family H^4
    / 24)``, memory the walk's size plus one chunk (``query_chunk`` rows, ``None``: the chunk
    budget, `chunks.chunk_entries`).

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> from tl_connwalk.core._fast.grams import gram_matrices
    >>> K2, K4 = gram_matrices(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> means = gram_means(A.mean(1), A / A.sum(1, keepdim=True), K2[None],
    ...                    fold_pairs(K4)[None], rank=8)
    >>> means.defect.shape, means.scale.shape
    (torch.Size([1, 1]), torch.Size([1, 1]))
    """
    if K2.ndim != 3 or pair_gram.ndim != 3 or K2.shape[0] != pair_gram.shape[0]:
        raise ConnWalkError(
            f"K2 {tuple(K2.shape)} and pair_gram {tuple(pair_gram.shape)} must be "
            "[family, head, head] and [family, pair, pair] with the same families."
        )
    check_gates(gates, K2.shape[1])
    means = stacked_gram_means(
        walk[None], gates[None], K2[None], pair_gram[None], rank, exclude_sink=exclude_sink,
        edges=None if edges is None else edges[None], query_chunk=query_chunk,
    )  # fmt: skip
    return GramMeans(defect=means.defect[0], scale=means.scale[0])


def stacked_gram_means(
    walk: Float[Tensor, "stack batch query key"],
    gates: Float[Tensor, "stack batch head query key"],
    K2: Float[Tensor, "stack family head head"],
    pair_gram: Float[Tensor, "stack family pair pair"],
    rank: int,
    *,
    exclude_sink: bool = False,
    edges: Bool[Tensor, "stack batch query key"] | None = None,
    query_chunk: int | None = None,
) -> GramMeans:
    """`gram_means` of several stacked walks at once (the layers of a model, say), each with
    its own gates and families: ``defect`` and ``scale`` ``[stack, family, batch]``.

    The edges of each chunk of rows that carry weight in any of the walks are listed once and
    every walk's gates of them go through one batched product per range of the quartic forms
    (`tl_connwalk.core._fast.quartic.forms`): the number of operations does not grow with the
    number of walks. An edge listed for another walk adds 0 (its weight there is 0). Memory:
    the stacked inputs plus one chunk (``query_chunk`` rows of every walk; ``None``: the
    chunk budget, `chunks.chunk_entries`).

    >>> A = torch.softmax(torch.randn(3, 1, 2, 4, 4), -1)
    >>> from tl_connwalk.core._fast.grams import gram_matrices
    >>> K2, K4 = gram_matrices(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> means = stacked_gram_means(A.mean(2), A / A.sum(2, keepdim=True),
    ...                            K2.expand(3, 1, 2, 2), fold_pairs(K4).expand(3, 1, 3, 3), 8)
    >>> means.defect.shape
    torch.Size([3, 1, 1])
    """
    if (
        K2.ndim != 4
        or pair_gram.ndim != 4
        or K2.shape[:2] != pair_gram.shape[:2]
        or gates.ndim != 5
        or walk.ndim != 4
        or gates.shape[0] != K2.shape[0]
        or walk.shape[0] != K2.shape[0]
    ):
        raise ConnWalkError(
            f"K2 {tuple(K2.shape)}, pair_gram {tuple(pair_gram.shape)}, gates "
            f"{tuple(gates.shape)} and walk {tuple(walk.shape)} must be [stack, family, head, "
            "head], [stack, family, pair, pair], [stack, batch, head, query, key] and [stack, "
            "batch, query key] with the same stack and families."
        )
    stack = K2.shape[0]
    check_gates(gates[0], K2.shape[2])
    check_rank(rank)
    check_chunk(query_chunk)
    gates, K2, pair_gram = cast_gates(gates, K2, pair_gram)
    if edges is not None:
        check_edges(edges.flatten(0, 1), gates.flatten(0, 1))
    weights, rows_with_mass = edge_weights(
        walk.flatten(0, 1), check_flag(exclude_sink, "exclude_sink"),
        None if edges is None else edges.flatten(0, 1),
    )  # fmt: skip
    weights = weights.to(device=gates.device, dtype=gates.dtype).view(walk.shape)
    stacked = quartic.quartic_rows(K2, pair_gram)
    families = K2.shape[1]
    _, batch, n_heads, n_query, n_key = gates.shape
    totals = gates.new_zeros(2, stack, families, batch)  # eps, then the scale

    def scale_of(frobenius_sq: Tensor) -> Tensor:
        return (frobenius_sq.clamp_min(0.0) / rank).sqrt()

    # the edges of each chunk of rows that carry weight, listed: no work on the future of a
    # causal walk, on a dropped sink or on edges left out (1.1x faster than whole rows)
    per_query = stack * batch * n_key * (n_heads + 3 * families + 6)
    for rows in query_chunks(n_query, per_query, query_chunk, gates.device):
        weight = weights[:, :, rows]
        b, i, j = (weight > 0).any(0).nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        runs = _runs(b, batch)
        listed = _listed_gates(gates[:, :, :, rows], runs, i, j)
        eps, frobenius_sq = _family_gram_defects(listed, stacked, rank)
        values = torch.stack([eps, scale_of(frobenius_sq)])
        # each batch element's run of edges summed (index_add_ would scatter edge by edge:
        # 0.76 ms a layer at 256 tokens against 0.1)
        weighted = weight[:, b, i, j][:, None] * values
        for k, part in enumerate(weighted.split(runs, dim=-1)):
            totals[..., k] += part.sum(-1)
    rows_with_mass = rows_with_mass.to(totals).view(stack, 1, batch)
    means = torch.where(rows_with_mass > 0, totals / rows_with_mass.clamp_min(1.0), 0.0)
    return GramMeans(defect=means[0], scale=means[1])


def edge_frobenius_scales(
    gates: Float[Tensor, "batch head query key"],
    K2: Float[Tensor, "head head"],
    rank: int,
    walk: Float[Tensor, "batch query key"] | None = None,
    *,
    query_chunk: int | None = None,
) -> Float[Tensor, "batch query key"]:
    """Each edge's Frobenius scale ``s_ij = sqrt(sum sigma^2(T_ij) / r) = ||T_ij||_F / sqrt(r)``.

    ``||T_ij||_F^2 = H^2 g_ij^T K2 g_ij`` (spec §3-4). 0 on non-edges when ``walk`` is given.
    ``query_chunk`` as in `edge_gram_defects`.

    >>> from tl_connwalk.core._fast.grams import head_gram
    >>> K2 = head_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> edge_frobenius_scales(torch.full((1, 2, 3, 3), 0.5), K2, rank=8).shape
    torch.Size([1, 3, 3])
    """
    check_gates(gates, K2.shape[0])
    check_rank(rank)
    check_chunk(query_chunk)
    gates, K2 = cast_gates(gates, K2)
    scale = (edge_frobenius_sq(gates, K2, query_chunk, walk).clamp_min(0.0) / rank).sqrt()
    return _zero_off_walk(scale, walk)


def edge_singular_values(
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
) -> Float[Tensor, "batch query key rank"]:
    """Singular values of every effective transport ``T_ij``, ``rank = min(d_model, H d_head)``.

    With grouped-query weights (heads expanded) only the top ``min(d_model, H_kv d_head)``
    can be non-zero (`effective_rank`); the rest are 0 up to rounding.

    ``T_ij = W_V^cat diag(H g_ij (x) 1) W_O^cat``; one QR of each concatenated factor reduces
    every edge to a ``rank x rank`` core. Costs ``O(batch n^2 rank^3)``: for ``delta`` on
    small problems or a sample of edges ("where affordable", spec §3); ``eps`` on all edges is
    `edge_gram_defects`.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> edge_singular_values(A / A.sum(1, keepdim=True), torch.randn(2, 8, 2),
    ...                      torch.randn(2, 2, 8)).shape
    torch.Size([1, 3, 3, 4])
    """
    check_heads(W_V, W_O)
    check_gates(gates, W_V.shape[0])
    gates, W_V, W_O = cast_gates(gates, W_V, W_O)
    n_heads = W_V.shape[0]
    _, R_V = torch.linalg.qr(rearrange(W_V, "head d_model d_head -> d_model (head d_head)"))
    _, R_O = torch.linalg.qr(rearrange(W_O, "head d_head d_model -> d_model (head d_head)"))
    R_V = rearrange(R_V, "r (head d_head) -> r head d_head", head=n_heads)
    R_O = rearrange(R_O, "s (head d_head) -> s head d_head", head=n_heads)
    batch, _, n_query, n_key = gates.shape
    out = gates.new_empty(batch, n_query, n_key, min(R_V.shape[0], R_O.shape[0]))
    per_query = batch * n_key * R_V.shape[0] * R_O.shape[0]
    for rows in query_chunks(n_query, per_query, device=gates.device):
        core = einsum(
            R_V,
            n_heads * gates[:, :, rows],
            R_O,
            "r head d_head, batch head query key, s head d_head -> batch query key r s",
        )
        out[:, rows] = torch.linalg.svdvals(core)
    return out
