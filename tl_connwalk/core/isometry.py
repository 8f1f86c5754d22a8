"""How far transports are from scaled isometries (spec §2-3), from weights and gates.

Pure functions on tensors. A map ``T`` of rank ``r`` with top singular values ``sigma_1..r`` has

    isometry defect  delta(T) = sqrt(1 - (sum sigma)^2   / (r sum sigma^2))
    Gram defect      eps(T)   = sqrt(1 - (sum sigma^2)^2 / (r sum sigma^4))

both 0 exactly when ``T`` is a scaled (partial) isometry ``s U V^T`` and both invariant under
``T -> c T`` and under orthogonal maps on either side. ``eps`` needs only Frobenius quantities,
so on the effective transports ``T_ij = H sum_h g^h_ij T^h`` of all edges it has a closed form
through the head Grams ``K2[a,b] = tr(T^a^T T^b)`` and
``K4[a,b,c,e] = tr(T^b^T T^a T^c^T T^e)``, built from ``d_head``-sized factor products
(`gram_matrices`); no ``d_model x d_model`` map is ever formed per edge.

Conventions for the degenerate cases (never NaN): the zero map is the scaled isometry with
scale 0, so ``delta = eps = 0`` and its Frobenius scale is 0. A rank-deficient map (fewer than
``r`` non-zero singular values) is *not* a rank-``r`` partial isometry and gets its honest,
positive defect. Results are float32 or wider (half precision is upcast, float64 stays).
"""

from collections.abc import Sequence

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core import value_heads
from tl_connwalk.core._fast import chunks
from tl_connwalk.core._fast.chunks import (
    CHUNK_ENTRIES,
    DEVICE_BLOCK_ENTRIES,
    DEVICE_CHUNK_ENTRIES,
    DEVICE_MEMORY,
    DEVICE_MEMORY_SHARE,
    DEVICE_WALK_CHUNKS,
    EDGE_BLOCK,
    WALK_CHUNKS,
    query_chunks,
)
from tl_connwalk.core._fast.edges import (
    GramMeans,
    edge_frobenius_scales,
    edge_gram_defects,
    edge_singular_values,
    folded_edge_gram_defects,
    gram_defect_means,
    gram_means,
    stacked_gram_means,
)
from tl_connwalk.core._fast.grams import (
    fold_pairs,
    gram_matrices,
    grams_of_factor_grams,
    head_factor_grams,
    head_gram,
    head_mixed_gram,
    head_norms_sq,
)
from tl_connwalk.core.baselines import (
    RandomBaseline,
    draw_scales,
    gaussian_factors,
    random_baseline,
    random_baselines,
    random_head_factors,
    scale_factors,
)
from tl_connwalk.core.checks import (
    abs_max,
    all_finite,
    cast_heads,
    check_draws,
    check_flag,
    check_heads,
    check_rank,
    check_walk_nonnegative,
    has_negative,
    in_memory_order,
    ratio_defect,
    working_dtype,
)
from tl_connwalk.core.moments import Moments
from tl_connwalk.core.weighted import (
    covered_mass_share,
    heaviest_edges,
    walk_weighted_cv,
    walk_weighted_mean,
)
from tl_connwalk.errors import ConnWalkError

# The Gram tensors, the per-edge closed forms, the walk-weighted summaries, the checks and the
# random baselines have modules of their own; their public names stay importable from here.
__all__ = [
    "CHUNK_ENTRIES",
    "DEVICE_BLOCK_ENTRIES",
    "DEVICE_CHUNK_ENTRIES",
    "DEVICE_MEMORY",
    "DEVICE_MEMORY_SHARE",
    "DEVICE_WALK_CHUNKS",
    "EDGE_BLOCK",
    "WALK_CHUNKS",
    "GramMeans",
    "RandomBaseline",
    "abs_max",
    "all_finite",
    "check_draws",
    "check_flag",
    "check_walk_nonnegative",
    "common_scale",
    "covered_mass_share",
    "draw_scales",
    "edge_frobenius_scales",
    "edge_gram_defects",
    "edge_singular_values",
    "effective_rank",
    "effective_transport_defect",
    "fold_pairs",
    "folded_edge_gram_defects",
    "frobenius_scale",
    "gaussian_factors",
    "gram_defect",
    "gram_defect_means",
    "gram_matrices",
    "gram_means",
    "grams_of_factor_grams",
    "has_negative",
    "head_factor_grams",
    "head_gram",
    "head_mixed_gram",
    "head_norms_sq",
    "head_singular_values",
    "head_transport_defects",
    "heaviest_edges",
    "in_memory_order",
    "isometry_defect",
    "query_chunks",
    "random_baseline",
    "random_baselines",
    "random_head_factors",
    "scale_factors",
    "stacked_gram_means",
    "walk_weighted_cv",
    "walk_weighted_mean",
    "working_dtype",
]


def _top_singular_values(
    sigma: Float[Tensor, "*batch singular"], rank: int
) -> Float[Tensor, "*batch rank"]:
    check_rank(rank, sigma.shape[-1], "sigma")
    sigma = sigma.to(working_dtype(sigma))
    if not torch.isfinite(sigma).all() or (sigma < 0).any():
        raise ConnWalkError(
            "singular values must be finite and >= 0; pass torch.linalg.svdvals(T) "
            "(NaN/inf usually means the cache overflowed)."
        )
    return sigma.topk(rank, dim=-1).values


def isometry_defect(sigma: Float[Tensor, "*batch singular"], rank: int) -> Float[Tensor, "*batch"]:
    """``delta = sqrt(1 - (sum sigma_k)^2 / (r sum sigma_k^2))``, top ``r`` values (spec §3).

    The relative Frobenius distance from ``T`` (restricted to its top ``r`` directions) to the
    nearest ``s U V^T``, ``s = mean sigma``. Evaluated as ``sum (sigma - s)^2 / sum sigma^2``,
    which has no cancellation near 0. The zero map gives 0.

    >>> isometry_defect(torch.tensor([2.0, 2.0, 2.0]), rank=3)
    tensor(0.)
    >>> isometry_defect(torch.tensor([1.0, 0.0]), rank=2)  # sqrt(1 - 1/2)
    tensor(0.7071)
    """
    top = _top_singular_values(sigma, rank)
    spread = Moments.of_weighted(top, torch.ones_like(top)).m2  # centred: equal values give 0
    return ratio_defect(spread, reduce(top**2, "... rank -> ...", "sum"))


def gram_defect(sigma: Float[Tensor, "*batch singular"], rank: int) -> Float[Tensor, "*batch"]:
    """``eps = sqrt(1 - (sum sigma_k^2)^2 / (r sum sigma_k^4))``, top ``r`` values (spec §3).

    The relative Frobenius distance from ``T^T T`` to the nearest multiple of a rank-``r``
    projection. Evaluated as ``sum (sigma^2 - mean sigma^2)^2 / sum sigma^4``. Zero map: 0.

    >>> gram_defect(torch.tensor([3.0, 3.0]), rank=2)
    tensor(0.)
    """
    squares = _top_singular_values(sigma, rank) ** 2
    spread = Moments.of_weighted(squares, torch.ones_like(squares)).m2
    return ratio_defect(spread, reduce(squares**2, "... rank -> ...", "sum"))


def frobenius_scale(sigma: Float[Tensor, "*batch singular"], rank: int) -> Float[Tensor, "*batch"]:
    """The Frobenius scale ``s = sqrt(sum sigma_k^2 / r)`` over the top ``r`` values (spec §4).

    >>> frobenius_scale(torch.tensor([3.0, 4.0]), rank=2)  # sqrt(25 / 2)
    tensor(3.5355)
    """
    return (_top_singular_values(sigma, rank) ** 2).mean(-1).sqrt()


def head_singular_values(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "head rank"]:
    """Singular values of each head transport ``T^h = W_V^h W_O^h``, descending.

    ``rank = min(d_model, d_head)``. From the QR factors ``W_V^h = Q R_V`` and
    ``W_O^h^T = Q' R_O``: ``T^h = Q (R_V R_O^T) Q'^T``, so the values are those of the small
    ``rank x rank`` core; no ``d_model x d_model`` SVD.

    >>> head_singular_values(torch.randn(3, 16, 4), torch.randn(3, 4, 16)).shape
    torch.Size([3, 4])
    """
    W_V, W_O = cast_heads(W_V, W_O)
    _, R_V = torch.linalg.qr(W_V, mode="r")
    _, R_O = torch.linalg.qr(rearrange(W_O, "head d_head d_model -> head d_model d_head"), mode="r")
    core = einsum(R_V, R_O, "head r d_head, head s d_head -> head r s")
    return torch.linalg.svdvals(core)


def head_transport_defects(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, " head"]:
    """The head transport defects ``delta(T^h)`` with ``r = d_head`` (spec §3), ``[head]``.

    A head's OV map can at best be a scaled *partial* isometry of rank ``d_head``
    (``min(d_model, d_head)`` if ``d_model`` is smaller). A zero head gives 0.

    >>> Q = torch.linalg.qr(torch.randn(8, 8)).Q
    >>> head_transport_defects(2 * Q[None, :, :4], Q.T[None, :4])
    tensor([0.])
    """
    sigma = head_singular_values(W_V, W_O)
    return isometry_defect(sigma, sigma.shape[-1])


def effective_rank(
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    kv_heads: Sequence[int] | None = None,
) -> int:
    """``r = min(d_model, H_kv d_head)``: the rank an effective transport ``T_ij`` can have
    (spec §3).

    ``H_kv`` is the number of distinct value heads: ``H`` without grouped-query attention
    (``kv_heads=None``); with it, ``kv_heads`` gives the value head each query head reads
    (`tl_connwalk.core.value_heads`; ``W_V`` holds the heads expanded), and every ``T_ij``
    factors through those ``H_kv d_head`` value coordinates.

    >>> effective_rank(torch.randn(12, 768, 64), torch.randn(12, 64, 768))
    768
    >>> from tl_connwalk.core.value_heads import grouped_value_heads
    >>> effective_rank(torch.randn(9, 576, 64), torch.randn(9, 64, 576),
    ...                grouped_value_heads(9, 3))  # SmolLM2-135M
    192
    """
    check_heads(W_V, W_O)
    n_heads, d_model, d_head = W_V.shape
    distinct = value_heads.distinct_value_heads(kv_heads, n_heads)
    return value_heads.transport_rank(d_model, d_head, distinct)


def effective_transport_defect(
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    exclude_sink: bool = False,
    edges: Bool[Tensor, "batch query key"] | None = None,
    query_chunk: int | None = None,
    kv_heads: Sequence[int] | None = None,
) -> Float[Tensor, " batch"]:
    """``(1/n) sum_ij W_ij eps(T_ij)`` with ``r = min(d_model, H_kv d_head)`` (spec §3).

    With ``edges`` (e.g. `heaviest_edges` of a mass share) ``eps`` is computed on those
    edges only and the mean is `walk_weighted_mean` restricted to them (rows
    renormalised over the kept edges). ``query_chunk``: see `edge_gram_defects`.
    ``kv_heads``: the value head each query head reads, for grouped-query weights
    (`effective_rank`).

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> effective_transport_defect(A.mean(1), A / A.sum(1, keepdim=True),
    ...                            torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([1])
    """
    K2, K4 = gram_matrices(W_V, W_O)
    rank = effective_rank(W_V, W_O, kv_heads)
    means = gram_defect_means(
        walk, gates, K2[None], fold_pairs(K4)[None], rank,
        exclude_sink=exclude_sink, edges=edges, query_chunk=query_chunk,
    )  # fmt: skip
    return means[0]


def common_scale(
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    exclude_sink: bool = False,
    query_chunk: int | None = None,
    kv_heads: Sequence[int] | None = None,
) -> Float[Tensor, " batch"]:
    """The common scale ``s``: walk-weighted mean of ``||T_ij||_F / sqrt(r)`` (spec §4), with
    the ``r`` of `effective_rank` (``kv_heads`` for grouped-query weights).

    >>> Q = torch.linalg.qr(torch.randn(4, 4)).Q
    >>> common_scale(torch.full((1, 3, 3), 1 / 3), torch.ones(1, 1, 3, 3), 2 * Q[None],
    ...              Q.T[None])
    tensor([2.])
    """
    K2 = head_gram(W_V, W_O)
    scale = edge_frobenius_scales(
        gates, K2, effective_rank(W_V, W_O, kv_heads), walk, query_chunk=query_chunk
    )
    return walk_weighted_mean(walk, scale, exclude_sink=exclude_sink)


# Reading or setting ``CHUNK_ENTRIES``, ``DEVICE_CHUNK_ENTRIES``, ``DEVICE_BLOCK_ENTRIES``,
# ``DEVICE_MEMORY``, ``DEVICE_MEMORY_SHARE``, ``EDGE_BLOCK``, ``WALK_CHUNKS`` or
# ``DEVICE_WALK_CHUNKS`` here reads or sets the budget every chunked computation uses.
chunks.forward_budgets(__name__)
