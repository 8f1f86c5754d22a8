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

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core import quartic, value_heads
from tl_connwalk.core.moments import Moments
from tl_connwalk.core.quartic import QuarticRows, head_pairs
from tl_connwalk.errors import ConnWalkError

#: Working-memory budget (entries) of the chunked contractions below.
CHUNK_ENTRIES = 2**24
#: Edges per block of the per-edge Gram work on the CPU: its temporaries stay in cache.
EDGE_BLOCK = 4096
#: Numbers in one block's products on other devices (CUDA), where a block costs kernel
#: launches rather than cache misses (`_edge_block`).
DEVICE_BLOCK_ENTRIES = 2**26


def working_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half precision and integers upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_rank(rank: int, available: int | None = None, what: str = "") -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConnWalkError(f"rank must be a positive integer, got {rank!r}.")
    if available is not None and rank > available:
        raise ConnWalkError(
            f"rank={rank} but {what} has only {available} singular values; pass "
            f"rank <= {available} (a d x d map has at most d)."
        )


def _top_singular_values(
    sigma: Float[Tensor, "*batch singular"], rank: int
) -> Float[Tensor, "*batch rank"]:
    _check_rank(rank, sigma.shape[-1], "sigma")
    sigma = sigma.to(working_dtype(sigma))
    if not torch.isfinite(sigma).all() or (sigma < 0).any():
        raise ConnWalkError(
            "singular values must be finite and >= 0; pass torch.linalg.svdvals(T) "
            "(NaN/inf usually means the cache overflowed)."
        )
    return sigma.topk(rank, dim=-1).values


def _ratio_defect(
    spread: Float[Tensor, "*batch"], size: Float[Tensor, "*batch"]
) -> Float[Tensor, "*batch"]:
    """``sqrt(spread / size)`` with ``0/0 = 0`` (the zero map) and rounding clamped to [0, 1].

    Raises if either is not finite (float overflow: rescale the transports towards norm 1,
    as `tl_connwalk.residual.laplacian_residual` does) rather than let a NaN pass as 0.
    """
    if not all_finite(spread, size):
        raise ConnWalkError(
            "a defect overflowed the working precision (transport norms to the fourth power "
            "left the float range); scale W_V, W_O towards norm 1 or use float64 - every defect "
            "is invariant under that scaling."
        )
    safe = torch.where(size > 0, size, torch.ones_like(size))
    ratio = torch.where(size > 0, spread / safe, torch.zeros_like(size))
    return ratio.clamp(0.0, 1.0).sqrt()


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
    return _ratio_defect(spread, reduce(top**2, "... rank -> ...", "sum"))


def gram_defect(sigma: Float[Tensor, "*batch singular"], rank: int) -> Float[Tensor, "*batch"]:
    """``eps = sqrt(1 - (sum sigma_k^2)^2 / (r sum sigma_k^4))``, top ``r`` values (spec §3).

    The relative Frobenius distance from ``T^T T`` to the nearest multiple of a rank-``r``
    projection. Evaluated as ``sum (sigma^2 - mean sigma^2)^2 / sum sigma^4``. Zero map: 0.

    >>> gram_defect(torch.tensor([3.0, 3.0]), rank=2)
    tensor(0.)
    """
    squares = _top_singular_values(sigma, rank) ** 2
    spread = Moments.of_weighted(squares, torch.ones_like(squares)).m2
    return _ratio_defect(spread, reduce(squares**2, "... rank -> ...", "sum"))


def frobenius_scale(sigma: Float[Tensor, "*batch singular"], rank: int) -> Float[Tensor, "*batch"]:
    """The Frobenius scale ``s = sqrt(sum sigma_k^2 / r)`` over the top ``r`` values (spec §4).

    >>> frobenius_scale(torch.tensor([3.0, 4.0]), rank=2)  # sqrt(25 / 2)
    tensor(3.5355)
    """
    return (_top_singular_values(sigma, rank) ** 2).mean(-1).sqrt()


def _check_heads(W_V: Tensor, W_O: Tensor) -> None:
    if W_V.ndim != 3 or W_O.ndim != 3:
        raise ConnWalkError(
            f"W_V must be [head, d_model, d_head] and W_O [head, d_head, d_model]; got "
            f"W_V {tuple(W_V.shape)}, W_O {tuple(W_O.shape)}."
        )
    if W_V.shape[0] != W_O.shape[0] or W_V.shape[1:] != W_O.shape[:0:-1]:
        raise ConnWalkError(
            f"W_V {tuple(W_V.shape)} and W_O {tuple(W_O.shape)} do not compose: need "
            "W_V [head, d_model, d_head] and W_O [head, d_head, d_model] with the same sizes."
        )


def _cast_heads(W_V: Tensor, W_O: Tensor) -> tuple[Tensor, Tensor]:
    _check_heads(W_V, W_O)
    dtype = working_dtype(W_V, W_O)
    return W_V.to(dtype), W_O.to(device=W_V.device, dtype=dtype)


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
    W_V, W_O = _cast_heads(W_V, W_O)
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
    _check_heads(W_V, W_O)
    n_heads, d_model, d_head = W_V.shape
    distinct = value_heads.distinct_value_heads(kv_heads, n_heads)
    return value_heads.transport_rank(d_model, d_head, distinct)


def _products(left: Tensor, right: Tensor) -> Tensor:
    """``[left[a] @ right[b] for b]`` stacked, ``[H, ., .]``, one small matmul at a time.

    A single einsum over the head axis would first copy a ``d_model x H d_head`` factor into
    matmul layout (as large as ``W_V`` itself); these ``d_head``-sized products never do.
    """
    return torch.stack([left @ right[b] for b in range(right.shape[0])])


def head_norms_sq(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, " head"]:
    """``||T^h||_F^2 = tr(GV[h,h] GO[h,h])``, the diagonal of `head_gram` alone."""
    return einsum(W_V.mT @ W_V, W_O @ W_O.mT, "head p q, head q p -> head")


def head_factor_grams(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> tuple[Float[Tensor, "head head d_head d_head"], Float[Tensor, "head head d_head d_head"]]:
    """``GV[a,b] = W_V^a^T W_V^b`` and ``GO[a,b] = W_O^a W_O^b^T``, both ``[H, H, d_h, d_h]``.

    A row ``a`` at a time, each one matrix product with the concatenated factor (``d_h x
    d_model`` by ``d_model x H d_h``), for ``b >= a`` only (``GV[b,a] = GV[a,b]^T``): one
    ``W_V``-sized layout copy, no full ``H d_h``-square temporary beside the two results.

    >>> [g.shape for g in head_factor_grams(torch.randn(3, 8, 2), torch.randn(3, 2, 8))]
    [torch.Size([3, 3, 2, 2]), torch.Size([3, 3, 2, 2])]
    """
    W_V, W_O = _cast_heads(W_V, W_O)
    n_heads, _, d_head = W_V.shape
    values = rearrange(W_V, "head d_model d_head -> d_model (head d_head)")
    gram_v = W_V.new_empty(n_heads, n_heads, d_head, d_head)
    for a in range(n_heads):
        upper = W_V[a].mT @ values[:, a * d_head :]
        gram_v[a, a:] = rearrange(upper, "p (b q) -> b p q", b=n_heads - a)
        gram_v[a + 1 :, a] = gram_v[a, a + 1 :].mT
    del values  # before GO: the copy and both Grams are never held at once
    outputs = rearrange(W_O, "head d_head d_model -> (head d_head) d_model")  # a view
    gram_o = torch.empty_like(gram_v)
    for a in range(n_heads):
        upper = W_O[a] @ outputs[a * d_head :].mT
        gram_o[a, a:] = rearrange(upper, "p (b q) -> b p q", b=n_heads - a)
        gram_o[a + 1 :, a] = gram_o[a, a + 1 :].mT
    return gram_v, gram_o


def head_gram(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "head head"]:
    """``K2[a,b] = tr(T^a^T T^b) = <T^a, T^b>_F`` (spec §3), from ``d_head x d_head`` products.

    ``tr(W_O^a^T W_V^a^T W_V^b W_O^b) = tr(GV[a,b] GO[b,a])``; the diagonal is ``||T^h||_F^2``.
    One row ``a`` at a time: working memory ``O(H d_head^2)``, never the ``H^2 d_head^2`` Grams.

    >>> head_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([2, 2])
    """
    W_V, W_O = _cast_heads(W_V, W_O)
    rows = []
    for a in range(W_V.shape[0]):
        gram_v = _products(W_V[a].mT, W_V)  # GV[a, b]: [b, p, q]
        gram_o = _products(W_O[a], W_O.mT).mT  # GO[b, a] = GO[a, b]^T: [b, q, p]
        rows.append(einsum(gram_v, gram_o, "b p q, b q p -> b"))
    return torch.stack(rows)


def head_mixed_gram(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "head head"]:
    """``KM[a,b] = tr(T^a T^b) = <T^a^T, T^b>_F``, the Gram that pairs a map with a transpose.

    ``tr(W_V^a W_O^a W_V^b W_O^b) = tr(C[a,b] C[b,a])`` with ``C[a,b] = W_O^a W_V^b``
    (``d_head x d_head``). Used by the pairing residual (spec §3). A row ``a`` at a time (each
    ``C`` computed twice): working memory ``O(H d_head^2)``, not the ``H^2 d_head^2`` of ``C``.

    >>> head_mixed_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([2, 2])
    """
    W_V, W_O = _cast_heads(W_V, W_O)
    rows = []
    for a in range(W_V.shape[0]):
        cross_row = _products(W_O[a], W_V)  # C[a, b]: [b, p, q]
        cross_col = torch.stack([W_O[b] @ W_V[a] for b in range(W_O.shape[0])])  # C[b, a]
        rows.append(einsum(cross_row, cross_col, "b p q, b q p -> b"))
    return torch.stack(rows)


def gram_matrices(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> tuple[Float[Tensor, "head head"], Float[Tensor, "head head head head"]]:
    """The head Grams ``K2[a,b] = tr(T^a^T T^b)`` and ``K4[a,b,c,e] = tr(T^b^T T^a T^c^T T^e)``.

    With ``GV[a,b] = W_V^a^T W_V^b`` and ``GO[a,b] = W_O^a W_O^b^T`` (``d_head x d_head``,
    a row of blocks per matrix product)::

        K2[a,b]     = tr(GV[a,b] GO[b,a])
        K4[a,b,c,e] = tr(GV[b,a] GO[a,c] GV[c,e] GO[e,b])

    ``K4`` is built through the ``H^3`` products ``X[b,a,c] = GV[b,a] GO[a,c]`` (``a >= b``
    only, since ``K4[a,b,c,e] = K4[b,a,e,c]``) and ``Y[b,c,e] = GV[c,e] GO[e,b]``, one ``b``
    and a block of ``c`` at a time (batched
    ``d_head x d_head`` matmuls, blocks of at most ``CHUNK_ENTRIES / 4`` numbers): working
    memory the two Grams (``2 H^2 d_head^2`` numbers) plus one block (never ``H^4 d^2``), time
    ``O(H^3 d_head^3 + H^4 d_head^2)``. ``K4`` itself has ``H^4`` entries (1M for ``H = 32``).

    >>> K2, K4 = gram_matrices(torch.randn(3, 8, 2), torch.randn(3, 2, 8))
    >>> K2.shape, K4.shape
    (torch.Size([3, 3]), torch.Size([3, 3, 3, 3]))
    """
    W_V, W_O = _cast_heads(W_V, W_O)
    return grams_of_factor_grams(*head_factor_grams(W_V, W_O))


def grams_of_factor_grams(
    gram_v: Float[Tensor, "head head d_head d_head"],
    gram_o: Float[Tensor, "head head d_head d_head"],
) -> tuple[Float[Tensor, "head head"], Float[Tensor, "head head head head"]]:
    """`gram_matrices` from ``GV[a,b] = W_V^a^T W_V^b`` and ``GO[a,b] = W_O^a W_O^b^T``
    (`head_factor_grams`), for callers that keep ``GO`` as well.

    >>> W_V, W_O = torch.randn(3, 8, 2), torch.randn(3, 2, 8)
    >>> K2, K4 = grams_of_factor_grams(*head_factor_grams(W_V, W_O))
    >>> torch.allclose(K4, gram_matrices(W_V, W_O)[1])
    True
    """
    n_heads, _, d_head, _ = gram_v.shape
    K2 = einsum(gram_v, gram_o, "a b p q, a b p q -> a b")  # GO[b,a] = GO[a,b]^T
    K4 = gram_v.new_empty(n_heads, n_heads, n_heads, n_heads)
    step = max(1, CHUNK_ENTRIES // (8 * n_heads * d_head * d_head))
    for b in range(n_heads):
        for start in range(0, n_heads, step):
            cs = slice(start, start + step)
            # only a >= b: the rest is K4[a,b,c,e] = K4[b,a,e,c] (<P_ac, P_be> with P = T T^T)
            X = gram_v[b][b:, None] @ gram_o[b:, cs]  # [a, c, p, s] = GV[b,a] GO[a,c]
            Y_t = gram_o[b][:, None] @ gram_v[:, cs]  # [e, c, p, s] = (GV[c,e] GO[e,b])^T
            X = rearrange(X, "a c p s -> c a (p s)")
            Y_t = rearrange(Y_t, "e c p s -> c (p s) e")
            K4[b:, b, cs, :] = rearrange(X @ Y_t, "c a e -> a c e")
    below = torch.ones(n_heads, n_heads, dtype=torch.bool, device=K4.device).triu(1)  # a < b
    return K2, torch.where(below[:, :, None, None], K4.permute(1, 0, 3, 2), K4)


def _check_gates(gates: Tensor, n_heads: int) -> None:
    if gates.ndim != 4 or gates.shape[1] != n_heads:
        raise ConnWalkError(
            f"gates must be [batch, head, query, key] with head={n_heads} (the size of K2); "
            f"got {tuple(gates.shape)}."
        )


def _check_chunk(query_chunk: int | None) -> None:
    if query_chunk is None:
        return
    if isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
        raise ConnWalkError(
            f"query_chunk must be None (automatic, CHUNK_ENTRIES numbers per chunk) or a "
            f"positive number of query rows, got {query_chunk!r}."
        )


def _query_chunks(n_query: int, per_query: int, query_chunk: int | None = None) -> list[slice]:
    """Slices of query rows: ``query_chunk`` rows each, or as many as fit ``CHUNK_ENTRIES``.

    Callers write each chunk's result into an output allocated before the loop: results kept
    as a list of small tensors between the large temporaries fragment the C heap, which then
    cannot reuse or return them (at 8192 tokens and 12 heads the process grows by gigabytes).
    """
    step = max(1, CHUNK_ENTRIES // max(1, per_query)) if query_chunk is None else query_chunk
    return [slice(start, start + step) for start in range(0, n_query, step)]


def _edge_chunks(
    n_query: int, n_key: int, per_query: int, query_chunk: int | None, walk: Tensor | None
) -> list[tuple[slice, int]]:
    """`_query_chunks`, each with 1 + the last key that is an edge of any of its rows.

    Keys past it are no edge of the chunk (the future of a causal walk, trailing padding), so
    per-edge work stops there and the values there are left 0, as on every non-edge. With a
    walk, automatic chunks are at most an eighth of the rows (at least 16), so that a causal
    walk skips most of its future. Without a walk every key counts.
    """
    if walk is None:
        return [(rows, n_key) for rows in _query_chunks(n_query, per_query, query_chunk)]
    if query_chunk is None:
        query_chunk = min(max(1, CHUNK_ENTRIES // max(1, per_query)), max(16, -(-n_query // 8)))
    present = reduce(walk > 0, "batch query key -> query key", "max")
    positions = torch.arange(1, n_key + 1, device=walk.device)
    last = reduce(present * positions, "query key -> query", "max").tolist()
    return [(rows, max(last[rows], default=0)) for rows in _query_chunks(n_query, 1, query_chunk)]


def _edge_frobenius_sq(
    gates: Tensor, K2: Tensor, query_chunk: int | None = None, walk: Tensor | None = None
) -> Tensor:
    """``sum sigma^2(T_ij) = ||T_ij||_F^2 = H^2 g_ij^T K2 g_ij``, ``[batch, query, key]``.

    Chunked over queries: one chunk of ``[batch, head, rows, key]`` at a time beside the gates.
    With ``walk``, keys past each chunk's last edge are skipped (`_edge_chunks`).
    """
    batch, n_heads, n_query, n_key = gates.shape
    out = gates.new_zeros(batch, n_query, n_key)
    for rows, keys in _edge_chunks(n_query, n_key, batch * n_heads * n_key, query_chunk, walk):
        g = gates[:, :, rows, :keys]
        mixed = einsum(g, K2, "batch a query key, a b -> batch b query key")
        out[:, rows, :keys] = einsum(
            mixed, g, "batch b query key, batch b query key -> batch query key"
        )
    return out.mul_(n_heads**2)


def fold_pairs(K4: Float[Tensor, "head head head head"]) -> Float[Tensor, "pair pair"]:
    """``K4`` folded onto unordered head pairs: ``S^T K4 S`` over `head_pairs` (``a <= c``).

    ``K4`` is the Gram matrix of the pair maps ``T^a T^c^T`` (symmetric in ``(a c) <-> (b e)``)
    and ``g^a g^c`` is symmetric in ``a, c``: folding each unordered pair into one coordinate
    cuts the per-edge work of ``sum g^a g^b g^c g^e K4[a,b,c,e]`` from ``H^4`` to ``~H^4 / 4``:
    ``sum sigma^4(T_ij) = H^4 u^T F u`` with ``u_{ac} = g^a g^c`` (evaluated through its
    ``~H^4 / 24`` distinct monomials, `tl_connwalk.core.quartic`).

    >>> fold_pairs(torch.ones(2, 2, 2, 2))
    tensor([[1., 2., 1.],
            [2., 4., 2.],
            [1., 2., 1.]])
    """
    n_heads = K4.shape[0]
    first, second = head_pairs(n_heads, K4.device)
    fold = torch.zeros(n_heads, n_heads, first.numel(), dtype=K4.dtype, device=K4.device)
    pair = torch.arange(first.numel(), device=K4.device)
    fold[first, second, pair] = 1.0
    fold[second, first, pair] = 1.0
    fold = rearrange(fold, "a c pair -> (a c) pair")
    return fold.T @ rearrange(K4, "a b c e -> (a c) (b e)") @ fold


def _edge_block(device: torch.device, rows: QuarticRows) -> int:
    """Edges per block of `_family_gram_defects`: ``EDGE_BLOCK`` on the CPU; elsewhere as many
    as fill ``DEVICE_BLOCK_ENTRIES`` numbers of products (``QuarticRows.outputs`` per family and
    edge), at least ``EDGE_BLOCK``.
    """
    if device.type == "cpu":
        return EDGE_BLOCK
    return max(EDGE_BLOCK, DEVICE_BLOCK_ENTRIES // (rows.outputs * rows.families))


def _family_gram_defects(g: Tensor, rows: QuarticRows, rank: int) -> tuple[Tensor, Tensor]:
    """``eps`` and ``sum sigma^2`` of the edges with gates ``g`` ``[head, edge]``, per family:
    two ``[family, edge]``.

    The families (`tl_connwalk.core.quartic.quartic_rows`: a layer and its random draws, say)
    share the gates, so each block of edges (`_edge_block`) is read once and multiplied by
    every family's Grams at once::

        sum sigma^2 = H^2 g^T K2[f] g,    sum sigma^4 = H^4 u^T fold(K4[f]) u,  u_{ac} = g^a g^c

    the quartic monomial by monomial (`tl_connwalk.core.quartic.forms`). Blocks keep the
    temporaries in cache: the work is bound by memory traffic as much as by flops.
    """
    n_heads = g.shape[0]
    sigma4, sigma2 = quartic.forms(g, rows, _edge_block(g.device, rows))
    sigma2 *= n_heads**2
    sigma4 *= n_heads**4
    return _ratio_defect(rank * sigma4 - sigma2**2, rank * sigma4), sigma2


def _runs(b: Tensor, batch: int) -> list[int]:
    """How many of the listed edges belong to each batch element (``b`` ascending, as
    ``nonzero`` lists them, so each element's edges are one run)."""
    return torch.bincount(b, minlength=batch).tolist()


def _listed_gates(gates: Tensor, runs: list[int], i: Tensor, j: Tensor) -> Tensor:
    """The gates ``[batch, head, query, key]`` of the listed edges as ``[head, edge]``.

    ``runs`` (`_runs`) splits the edges ``(i, j)`` by batch element. One ``index_select`` of
    each element's ``[head, query key]`` rows: 5x faster than indexing ``[b, :, i, j]`` and
    transposing.
    """
    n_heads, n_key = gates.shape[1], gates.shape[3]
    parts = [
        gates[k].reshape(n_heads, -1).index_select(1, flat)
        for k, flat in enumerate((i * n_key + j).split(runs))
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _heads_by_edge(gates: Tensor) -> Tensor:
    """A chunk of gates ``[batch, head, query, key]`` as one ``[head, edge]`` block."""
    return rearrange(gates, "batch head query key -> head (batch query key)").contiguous()


def heaviest_edges(
    walk: Float[Tensor, "batch query key"], mass_share: float
) -> Bool[Tensor, "batch query key"]:
    """Per query row, the fewest heaviest edges whose walk mass reaches ``mass_share`` of the row.

    Edge ``(i, j)`` is kept when the mass of the edges heavier than it in row ``i`` (ties
    broken by a stable sort) is still below ``mass_share * sum_j W_ij``: every row keeps at
    least that share (the first edge that reaches it is kept). ``mass_share = 1`` keeps every
    edge ``W_ij > 0`` exactly. Costs one sort of the walk.

    >>> heaviest_edges(torch.tensor([[[0.5, 0.3, 0.2]]]), 0.7)
    tensor([[[ True,  True, False]]])
    """
    if (
        isinstance(mass_share, bool)
        or not isinstance(mass_share, (int, float))
        or not 0.0 < mass_share <= 1.0
    ):
        raise ConnWalkError(
            f"mass_share must be a number in (0, 1] (the share of each row's walk mass whose "
            f"edges are measured), got {mass_share!r}."
        )
    if walk.ndim != 3:
        raise ConnWalkError(f"walk must be [batch, query, key], got {tuple(walk.shape)}.")
    present = walk > 0
    if mass_share >= 1.0:
        return present
    weights = walk.to(working_dtype(walk))
    ordered, order = weights.sort(dim=-1, descending=True, stable=True)
    before = ordered.cumsum(-1) - ordered
    row_mass = reduce(ordered, "batch query key -> batch query 1", "sum")
    keep_ordered = (before < mass_share * row_mass) & (ordered > 0)
    keep = torch.zeros_like(keep_ordered).scatter_(-1, order, keep_ordered)
    return keep & present


def covered_mass_share(
    walk: Float[Tensor, "batch query key"],
    edges: Bool[Tensor, "batch query key"],
    *,
    exclude_sink: bool = False,
) -> Float[Tensor, " batch"]:
    """``sum_{kept} W_ij / sum_ij W_ij`` per batch element (key 0 left out with ``exclude_sink``).

    1 where the walk has no mass.

    >>> W = torch.tensor([[[0.5, 0.3, 0.2]]])
    >>> covered_mass_share(W, heaviest_edges(W, 0.7))
    tensor([0.8000])
    """
    weights = walk.to(working_dtype(walk))
    if exclude_sink:
        weights = weights.clone()
        weights[:, :, 0] = 0.0
    total = reduce(weights, "batch query key -> batch", "sum")
    kept = reduce(
        torch.where(edges.to(weights.device), weights, 0.0), "batch query key -> batch", "sum"
    )
    return torch.where(total > 0, kept / torch.where(total > 0, total, 1.0), 1.0)


def _cast_gates(gates: Tensor, *grams: Tensor) -> tuple[Tensor, ...]:
    dtype = working_dtype(gates, *grams)
    return tuple(t.to(device=gates.device, dtype=dtype) for t in (gates, *grams))


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
    query rows per chunk of the all-edge path (``None``: as many as fit ``CHUNK_ENTRIES``
    numbers); the result does not depend on it.

    In the working dtype the closed form loses half the digits near 0 (it subtracts two
    nearly equal numbers): defects below ``~sqrt(machine eps)`` read as noise in float32.

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
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
    `tl_connwalk.core.head_grams.HeadGrams` keeps) instead of ``K4``; the same values.

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
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
    _check_gates(gates, K2.shape[0])
    _check_rank(rank)
    _check_chunk(query_chunk)
    gates, K2, pair_gram = _cast_gates(gates, K2, pair_gram)
    families = quartic.quartic_rows(K2[None], pair_gram[None])
    if edges is not None:
        _check_edges(edges, gates)
        b, i, j = edges.to(gates.device).nonzero(as_tuple=True)
        eps = torch.zeros(edges.shape, dtype=gates.dtype, device=gates.device)
        listed = _listed_gates(gates, _runs(b, gates.shape[0]), i, j)
        eps[b, i, j] = _family_gram_defects(listed, families, rank)[0][0]
        return _zero_off_walk(eps, walk)
    batch, n_heads, n_query, n_key = gates.shape
    eps = gates.new_zeros(batch, n_query, n_key)  # filled chunk by chunk (see `_query_chunks`)
    per_query = batch * n_key * (n_heads + 1)
    for rows, keys in _edge_chunks(n_query, n_key, per_query, query_chunk, walk):
        if keys == 0:  # no edge in these rows
            continue
        chunk, _ = _family_gram_defects(_heads_by_edge(gates[:, :, rows, :keys]), families, rank)
        eps[:, rows, :keys] = chunk.view(batch, -1, keys)
    return _zero_off_walk(eps, walk)


def _check_edges(edges: Tensor, gates: Tensor) -> None:
    if edges.shape != gates.shape[:1] + gates.shape[2:]:
        raise ConnWalkError(
            f"edges {tuple(edges.shape)} must be [batch, query, key] like the gates' "
            f"{tuple(gates.shape[:1] + gates.shape[2:])}."
        )


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
    / 24)``, memory the walk's size plus one chunk (``query_chunk`` rows, ``None``:
    ``CHUNK_ENTRIES`` numbers).

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
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
    _check_gates(gates, K2.shape[1])
    _check_rank(rank)
    _check_chunk(query_chunk)
    gates, K2, pair_gram = _cast_gates(gates, K2, pair_gram)
    weights, rows_with_mass = _edge_weights(walk, check_flag(exclude_sink, "exclude_sink"), edges)
    weights = weights.to(device=gates.device, dtype=gates.dtype)
    stacked = quartic.quartic_rows(K2, pair_gram)
    families = K2.shape[0]
    batch, n_heads, n_query, n_key = gates.shape
    totals = gates.new_zeros(2, families, batch)  # eps, then the scale

    def scale_of(frobenius_sq: Tensor) -> Tensor:
        return (frobenius_sq.clamp_min(0.0) / rank).sqrt()

    if edges is not None:
        _check_edges(edges, gates)
    # the edges of each chunk of rows that carry weight, listed: no work on the future of a
    # causal walk, on a dropped sink or on edges left out (1.1x faster than whole rows)
    per_query = batch * n_key * (n_heads + 3 * families + 6)
    for rows in _query_chunks(n_query, per_query, query_chunk):
        weight = weights[:, rows]
        b, i, j = (weight > 0).nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        runs = _runs(b, batch)
        listed = _listed_gates(gates[:, :, rows], runs, i, j)
        eps, frobenius_sq = _family_gram_defects(listed, stacked, rank)
        values = torch.stack([eps, scale_of(frobenius_sq)])
        # each batch element's run of edges summed (index_add_ would scatter edge by edge:
        # 0.76 ms a layer at 256 tokens against 0.1)
        for k, part in enumerate((weight[b, i, j] * values).split(runs, dim=-1)):
            totals[:, :, k] += part.sum(-1)
    rows_with_mass = rows_with_mass.to(totals)
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

    >>> K2 = head_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> edge_frobenius_scales(torch.full((1, 2, 3, 3), 0.5), K2, rank=8).shape
    torch.Size([1, 3, 3])
    """
    _check_gates(gates, K2.shape[0])
    _check_rank(rank)
    _check_chunk(query_chunk)
    gates, K2 = _cast_gates(gates, K2)
    scale = (_edge_frobenius_sq(gates, K2, query_chunk, walk).clamp_min(0.0) / rank).sqrt()
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
    _check_heads(W_V, W_O)
    _check_gates(gates, W_V.shape[0])
    gates, W_V, W_O = _cast_gates(gates, W_V, W_O)
    n_heads = W_V.shape[0]
    _, R_V = torch.linalg.qr(rearrange(W_V, "head d_model d_head -> d_model (head d_head)"))
    _, R_O = torch.linalg.qr(rearrange(W_O, "head d_head d_model -> d_model (head d_head)"))
    R_V = rearrange(R_V, "r (head d_head) -> r head d_head", head=n_heads)
    R_O = rearrange(R_O, "s (head d_head) -> s head d_head", head=n_heads)
    batch, _, n_query, n_key = gates.shape
    out = gates.new_empty(batch, n_query, n_key, min(R_V.shape[0], R_O.shape[0]))
    for rows in _query_chunks(n_query, batch * n_key * R_V.shape[0] * R_O.shape[0]):
        core = einsum(
            R_V,
            n_heads * gates[:, :, rows],
            R_O,
            "r head d_head, batch head query key, s head d_head -> batch query key r s",
        )
        out[:, rows] = torch.linalg.svdvals(core)
    return out


def all_finite(*tensors: Tensor) -> bool:
    """Whether every entry of every tensor is finite: their sums first (a NaN or Inf anywhere
    makes a sum one; 4x cheaper), element by element only when a sum is not (finite numbers
    whose sum overflowed).

    >>> all_finite(torch.full((2,), 3e38)), all_finite(torch.tensor([1.0, float("nan")]))
    (True, False)
    """
    if all(bool(torch.isfinite(t.sum())) for t in tensors):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def has_negative(tensor: Tensor) -> bool:
    """Whether any entry is ``< 0`` (NaN is not): one reduction, 6x faster than ``(t < 0).any()``.

    >>> has_negative(torch.tensor([0.0, 2.0])), has_negative(torch.tensor([1.0, -0.5]))
    (False, True)
    """
    return tensor.numel() > 0 and bool(tensor.amin() < 0)


def check_walk_nonnegative(walk: Float[Tensor, "batch query key"], name: str = "walk") -> None:
    """A ConnWalkError unless every entry of ``walk`` is ``>= 0``, naming where it is not.

    The message counts the negative entries and names the first one (batch, query, key and
    value), so the row at fault can be found.

    >>> check_walk_nonnegative(torch.tensor([[[1.0, 0.0], [0.5, -0.5]]]))
    Traceback (most recent call last):
    ...
    tl_connwalk.errors.ConnWalkError: walk has 1 negative entry, the first at batch 0, query 1, ...
    """
    if not has_negative(walk):
        return
    negative = walk < 0
    count, first = int(negative.sum()), negative.nonzero()[0].tolist()
    where = ", ".join(
        f"{axis} {i}" for axis, i in zip(("batch", "query", "key"), first, strict=True)
    )
    raise ConnWalkError(
        f"{name} has {count} negative entr{'y' if count == 1 else 'ies'}, the first at {where} "
        f"({walk[tuple(first)].item():.3g}); a walk matrix is >= 0 (spec §1): the head mean of "
        "softmax attention patterns. Was a pattern edited (a hook on hook_pattern) or the walk "
        "made by hand? Pass a walk of attention probabilities."
    )


def in_memory_order(tensor: Tensor) -> Tensor:
    """``tensor`` with its axes permuted into the order of its strides when that makes it
    contiguous (else as it is): for reductions whose result does not depend on the order,
    which run several times faster over contiguous memory (a Bridge's ``W_V`` is a transposed
    view: ``abs().max()`` 2.2 ms as laid out, 0.2 ms in memory order, GPT-2 small).

    >>> in_memory_order(torch.ones(3, 4).T).is_contiguous()
    True
    """
    order = sorted(range(tensor.ndim), key=lambda axis: -tensor.stride()[axis])
    permuted = tensor.permute(order)
    return permuted if permuted.is_contiguous() else tensor


def abs_max(tensor: Tensor) -> float:
    """``max |t|`` as a float (0 for no entries; NaN if any entry is NaN), one pass over the
    tensor in memory order (`in_memory_order`) without an ``abs`` copy.

    >>> abs_max(torch.tensor([[-3.0, 2.0]]).T)
    3.0
    """
    if tensor.numel() == 0:
        return 0.0
    low, high = torch.aminmax(in_memory_order(tensor.detach()))
    return float(torch.maximum(-low, high))


def check_flag(value: object, name: str) -> bool:
    """``value`` if it is a bool, else a ConnWalkError naming the option ``name``."""
    if not isinstance(value, bool):
        raise ConnWalkError(f"{name} must be True or False, got {value!r}.")
    return value


def _edge_weights(walk: Tensor, exclude_sink: bool, edges: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-edge weights and the per-batch normaliser of the walk-weighted summaries.

    Plain: ``(W, n)``, ``n`` the number of rows with mass (a masked row does not dilute the
    mean). Restricted (``exclude_sink`` drops key 0, ``edges`` keeps a subset):
    rows renormalised over the kept edges and averaged over the rows that keep any mass.
    """
    if walk.ndim != 3:
        raise ConnWalkError(f"walk must be [batch, query, key], got {tuple(walk.shape)}.")
    weights = walk.to(working_dtype(walk))
    check_walk_nonnegative(weights)
    if not exclude_sink and edges is None:
        has_mass = reduce(weights, "batch query key -> batch query", "sum") > 0
        return weights, reduce(has_mass.to(weights.dtype), "batch query -> batch", "sum")
    keep = torch.ones_like(weights, dtype=torch.bool)
    if edges is not None:
        if edges.shape != walk.shape:
            raise ConnWalkError(
                f"edges {tuple(edges.shape)} must have the walk's shape {tuple(walk.shape)}."
            )
        keep = keep & edges.to(device=weights.device, dtype=torch.bool)
    if exclude_sink:
        keep[:, :, 0] = False
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    row_mass = reduce(weights, "batch query key -> batch query 1", "sum")
    has_mass = row_mass > 0
    weights = torch.where(has_mass, weights / torch.where(has_mass, row_mass, 1.0), 0.0)
    rows = reduce(has_mass.to(weights.dtype), "batch query 1 -> batch", "sum")
    return weights, rows


def _on_edges(weights: Tensor, values: Tensor) -> Tensor:
    """``values`` where the weight is positive, else 0: values off the walk never count.

    Not even a NaN, e.g. from gates left undefined (0/0) on non-edges.
    """
    values = values.to(weights)
    return torch.where(weights > 0, values, torch.zeros_like(values))


def walk_weighted_mean(
    walk: Float[Tensor, "batch query key"],
    values: Float[Tensor, "batch query key"],
    *,
    exclude_sink: bool = False,
    edges: Bool[Tensor, "batch query key"] | None = None,
) -> Float[Tensor, " batch"]:
    """The walk-weighted summary ``(1/n) sum_ij W_ij v_ij`` of per-edge values (spec §3).

    ``n`` counts the rows with mass (a fully masked row, e.g. a padding query, is left out).
    ``exclude_sink=True`` drops key 0 (the attention sink) and renormalises every row over the
    keys left; ``edges`` restricts to a subset of edges the same way. Then the mean runs over
    the rows that keep any mass (``n`` becomes their number); with no such row it is 0.
    Values where the weight is 0 are ignored, whatever they are.

    >>> W = torch.softmax(torch.randn(1, 4, 4), -1)
    >>> walk_weighted_mean(W, torch.ones(1, 4, 4))
    tensor([1.0000])
    """
    weights, rows = _edge_weights(walk, check_flag(exclude_sink, "exclude_sink"), edges)
    values = _on_edges(weights, values)
    total = einsum(weights, values, "batch query key, batch query key -> batch")
    return torch.where(rows > 0, total / rows.clamp_min(1.0), torch.zeros_like(total))


def walk_weighted_cv(
    walk: Float[Tensor, "batch query key"],
    values: Float[Tensor, "batch query key"],
    *,
    exclude_sink: bool = False,
    edges: Bool[Tensor, "batch query key"] | None = None,
) -> Float[Tensor, " batch"]:
    """Walk-weighted coefficient of variation ``sqrt(sum p (v - m)^2) / m``, ``m = sum p v``.

    ``p_ij`` are the weights of `walk_weighted_mean` normalised to sum 1 (``W_ij / n`` for
    a row-stochastic walk). ``0/0`` (all values 0, or no mass) is 0.

    >>> walk_weighted_cv(torch.full((1, 2, 2), 0.5), torch.full((1, 2, 2), 2.0))
    tensor([0.])
    """
    weights, _ = _edge_weights(walk, check_flag(exclude_sink, "exclude_sink"), edges)
    values = _on_edges(weights, values)
    edge_axis = "batch query key -> batch (query key)"
    return Moments.of_weighted(rearrange(values, edge_axis), rearrange(weights, edge_axis)).cv


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


def random_head_factors(
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    generator: torch.Generator,
    kv_heads: Sequence[int] | None = None,
) -> tuple[Float[Tensor, "head d_model d_head"], Float[Tensor, "head d_head d_model"]]:
    """Gaussian factors of the same shapes whose head transports have the same ``||T^h||_F``.

    ``kv_heads`` (grouped-query weights, `tl_connwalk.core.value_heads`): one random ``W_V``
    per value head, read by every query head that reads it, as in the model (spec §3).
    Each random head's scale ``s_h`` (`draw_scales`) is split evenly between its two factors;
    where value heads are shared, it goes on ``W_O^h`` alone (so they stay shared). Either
    way ``T'^h = s_h R_V^{kv(h)} R_O^h``; a zero head stays 0.

    >>> V, O = random_head_factors(torch.randn(2, 8, 4), torch.randn(2, 4, 8),
    ...                            torch.Generator().manual_seed(0))
    >>> V.shape, O.shape
    (torch.Size([2, 8, 4]), torch.Size([2, 4, 8]))
    """
    W_V, W_O = _cast_heads(W_V, W_O)
    if generator.device.type != W_V.device.type:
        raise ConnWalkError(
            f"the generator is on {generator.device} but the weights are on {W_V.device}; "
            "pass torch.Generator(device=W_V.device) or an integer seed."
        )
    kv_heads = value_heads.check_kv_heads(kv_heads, W_V.shape[0])
    rand_V, rand_O = gaussian_factors(
        W_V.shape, W_O.shape, W_V.dtype, W_V.device, generator, kv_heads
    )
    scales = draw_scales(head_norms_sq(W_V, W_O), head_norms_sq(rand_V, rand_O))
    return scale_factors(rand_V, rand_O, scales, kv_heads)


def scale_factors(
    R_V: Float[Tensor, "head d_model d_head"],
    R_O: Float[Tensor, "head d_head d_model"],
    scales: Float[Tensor, " head"],
    kv_heads: Sequence[int] | None = None,
) -> tuple[Float[Tensor, "head d_model d_head"], Float[Tensor, "head d_head d_model"]]:
    """Factors of ``s_h R_V^h R_O^h``, in place: ``sqrt(s_h)`` on each, or ``s_h`` on ``R_O^h``
    alone where query heads share value heads (`random_head_factors`)."""
    if value_heads.is_shared(kv_heads):
        return R_V, R_O.mul_(scales.to(R_O)[:, None, None])
    factor = scales.to(R_O).sqrt()[:, None, None]
    return R_V.mul_(factor), R_O.mul_(factor)


def gaussian_factors(
    v_shape: torch.Size,
    o_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    kv_heads: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Standard Gaussian ``R_V``, ``R_O`` of the given shapes: the raw draw of
    `random_head_factors`, drawn in that order from ``generator``.

    With ``kv_heads`` (`tl_connwalk.core.value_heads`), one ``R_V`` per value head is drawn
    (``[H_kv, d_model, d_head]``) and query head ``h`` gets ``R_V^{kv(h)}``: ``R_V`` still has
    ``v_shape``, with the model's sharing. Without sharing, the same numbers as no
    ``kv_heads``.
    """
    if kv_heads is None:
        rand_V = torch.randn(v_shape, dtype=dtype, device=device, generator=generator)
    else:
        n_value = value_heads.n_value_heads(kv_heads, v_shape[0])
        drawn = torch.randn(
            (n_value, *v_shape[1:]), dtype=dtype, device=device, generator=generator
        )
        rand_V = drawn[torch.tensor(kv_heads, device=device)]
    return rand_V, torch.randn(o_shape, dtype=dtype, device=device, generator=generator)


def draw_scales(target_sq: Float[Tensor, " head"], drawn_sq: Float[Tensor, " head"]) -> Tensor:
    """``s_h = ||T^h||_F / ||R^h||_F`` from the squared norms: ``s_h R^h`` has ``T^h``'s norm.

    0 where the draw ``R^h`` is 0. `random_head_factors` puts ``s_h`` on the factors
    (`scale_factors`).
    """
    target, drawn = target_sq.clamp_min(0.0).sqrt(), drawn_sq.clamp_min(0.0).sqrt()
    return torch.where(drawn > 0, target / torch.where(drawn > 0, drawn, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class RandomBaseline:
    """A measurement repeated on random transports (spec §3): every draw, their mean and spread.

    ``std`` is the sample standard deviation over draws (``n_draws >= 2``).
    """

    draws: Float[Tensor, "draw ..."]

    @property
    def mean(self) -> Tensor:
        return self.draws.mean(0)

    @property
    def std(self) -> Tensor:
        return self.draws.std(0)

    @property
    def n_draws(self) -> int:
        return self.draws.shape[0]

    def to_dict(self) -> dict[str, object]:
        return {"mean": self.mean.tolist(), "std": self.std.tolist(), "n_draws": self.n_draws}


def random_baseline(
    measure: Callable[[Tensor, Tensor], Tensor],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    n_draws: int = 16,
    *,
    seed: int | torch.Generator = 0,
    kv_heads: Sequence[int] | None = None,
) -> RandomBaseline:
    """``measure(W_V', W_O')`` on ``n_draws`` random factor pairs (`random_head_factors`).

    Same shapes, same sharing of value heads (``kv_heads``, for grouped-query weights) and
    same head Frobenius norms, Gaussian factors (spec §3). Only ``W_V`` and ``W_O`` are drawn:
    a measure keeps the model's walk and gates, so its queries and keys (shared or not) stay
    the model's. ``seed`` is an integer (a fresh generator on the weights' device) or a
    ``torch.Generator``.

    >>> base = random_baseline(head_transport_defects, torch.randn(2, 16, 4),
    ...                        torch.randn(2, 4, 16), n_draws=4)
    >>> base.mean.shape, base.std.shape
    (torch.Size([2]), torch.Size([2]))
    """
    return random_baselines({"measure": measure}, W_V, W_O, n_draws, seed=seed, kv_heads=kv_heads)[
        "measure"
    ]


def check_draws(n_draws: object) -> None:
    """A ConnWalkError unless ``n_draws`` is an integer ``>= 2`` (a spread needs two draws)."""
    if isinstance(n_draws, bool) or not isinstance(n_draws, int) or n_draws < 2:
        raise ConnWalkError(f"n_draws must be an integer >= 2 (for a spread), got {n_draws!r}.")


def random_baselines(
    measures: Mapping[str, Callable[[Tensor, Tensor], Tensor]],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    n_draws: int = 16,
    *,
    seed: int | torch.Generator = 0,
    kv_heads: Sequence[int] | None = None,
) -> dict[str, RandomBaseline]:
    """`random_baseline` of several measurements on the same ``n_draws`` random factor pairs.

    Each draw is made once and every measurement evaluated on it: the same baselines as one
    `random_baseline` call per measurement with the same integer ``seed``, for the cost of one
    set of draws.

    >>> bases = random_baselines({"head": head_transport_defects}, torch.randn(2, 16, 4),
    ...                          torch.randn(2, 4, 16), n_draws=4)
    >>> bases["head"].mean.shape
    torch.Size([2])
    """
    check_draws(n_draws)
    if isinstance(seed, torch.Generator):
        generator = seed
    elif isinstance(seed, int):
        generator = torch.Generator(device=W_V.device).manual_seed(seed)
    else:
        raise ConnWalkError(f"seed must be an int or a torch.Generator, got {seed!r}.")
    draws: dict[str, list[Tensor]] = {name: [] for name in measures}
    for _ in range(n_draws):
        factors = random_head_factors(W_V, W_O, generator, kv_heads)
        for name, measure in measures.items():
            draws[name].append(measure(*factors))
    baselines = {}
    for name, values in draws.items():
        stacked = torch.stack(values)
        baselines[name] = RandomBaseline(stacked.to(working_dtype(stacked)))
    return baselines
