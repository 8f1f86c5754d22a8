"""The nearest random-walk connection operator ``P*`` and the distance to it (spec §4).

Pure functions on tensors. Given a connection walk ``(W, T)`` (spec §1.2), a measure ``mu`` and a
common scale ``s``, the nearest random-walk connection operator replaces

    the walk        W*_ij = M_ij / sum_k M_ik,   M_ij = (mu_i W_ij + mu_j W_ji) / 2
    the transports  s O*_ij,                     O*_ij = polar((T_ij + T_ji^T) / 2)

so that ``P*`` satisfies (C1)-(C3) up to the scale ``s`` (spec §2), and the distance is

    ||P - P*||_F / ||P||_F,   ||P - P*||_F^2 = sum_ij ||W_ij T_ij - W*_ij s O*_ij||_F^2,
                              ||P||_F^2     = sum_ij W_ij^2 ||T_ij||_F^2.

This is the "exact, small ``n d_model``" path: every edge's ``d_model x d_model`` transport is
materialised and decomposed (one SVD per edge), a chunk of edges at a time, never all
``n^2 d_model^2`` numbers at once. On larger problems it runs on a stated uniform sample of edges.
"""

import dataclasses

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core._fast import chunks
from tl_connwalk.core.checks import check_heads, check_optional_count, working_dtype
from tl_connwalk.core.markov import _check_walk
from tl_connwalk.errors import ConnWalkError

#: The chunks' working-memory budget (reading or setting it here reads or sets the budget every
#: chunked computation uses).
CHUNK_ENTRIES = chunks.CHUNK_ENTRIES
#: Number of ``d_model x max(d_model, H d_head)`` tensors one edge holds at peak in a chunk.
_TENSORS_PER_EDGE = 10


def reversibilised_walk(
    walk: Float[Tensor, "batch query key"], mu: Float[Tensor, "batch query"]
) -> Float[Tensor, "batch query key"]:
    """``W*_ij = M_ij / sum_k M_ik`` with ``M_ij = (mu_i W_ij + mu_j W_ji) / 2`` (spec §4).

    ``M`` is symmetric, so ``W*`` is row-stochastic and reversible with respect to the row sums
    of ``M`` (which is ``mu`` itself when ``W`` is already stochastic and reversible w.r.t.
    ``mu``: then ``W* = W``). A row of ``M`` without mass (``mu_i W_i. = 0`` and no
    ``mu_j W_ji > 0``: nothing leaves or enters ``i``) stays a zero row of ``W*``: the nearest
    operator sends nothing along it, rather than inventing a uniform row. ``mu`` is ``>= 0``
    with any scale. Computed in float64, returned in float32 or wider.

    >>> W = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    >>> reversibilised_walk(W, torch.tensor([[1.0, 2.0]]))  # M = [[0, 1], [1, 1]]
    tensor([[[0.0000, 1.0000],
             [0.5000, 0.5000]]])
    """
    walk64 = _check_walk(walk)
    mu64 = _check_mu(mu, walk64)
    return _reversibilised(walk64, mu64).to(working_dtype(walk, mu))


def polar_factor(
    matrix: Float[Tensor, "*batch d_model d_model"],
) -> Float[Tensor, "*batch d_model d_model"]:
    """The orthogonal polar factor ``U V^T`` of ``B = U S V^T`` (the nearest orthogonal map).

    Unique when ``B`` is invertible (then ``U V^T = B (B^T B)^{-1/2}``). When ``B`` is singular
    any orthogonal completion on its null space is a polar factor; this returns ``U V^T`` from
    the full SVD as ``torch.linalg.svd`` gives it: always orthogonal, never NaN (the zero map
    gets some orthogonal matrix), deterministic for a given backend but arbitrary on the null
    space. Computed in float32 or wider.

    >>> Q = torch.linalg.qr(torch.randn(4, 4)).Q
    >>> torch.allclose(polar_factor(3 * Q), Q, atol=1e-5)
    True
    """
    if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ConnWalkError(f"polar_factor needs square maps, got {tuple(matrix.shape)}.")
    U, _, Vh = torch.linalg.svd(matrix.to(working_dtype(matrix)))
    return U @ Vh


@dataclasses.dataclass(frozen=True)
class NearestOperatorDistance:
    """``||P - P*||_F / ||P||_F`` per batch element, and how it was evaluated.

    ``exact`` is True when every edge of every batch element was used; otherwise
    ``n_sampled[b] < n_edges[b]`` edges were drawn uniformly without replacement
    (``torch.Generator`` seeded with ``seed``), both sums were scaled by
    ``n_edges[b] / n_sampled[b]`` (unbiased estimates of ``||P - P*||_F^2`` and ``||P||_F^2``),
    and ``distance`` is the square root of their ratio (consistent, not unbiased).
    ``difference_norm`` and ``operator_norm`` are the (estimated) ``||P - P*||_F`` and
    ``||P||_F``.
    """

    distance: Float[Tensor, " batch"]
    difference_norm: Float[Tensor, " batch"]
    operator_norm: Float[Tensor, " batch"]
    exact: bool
    n_edges: tuple[int, ...]
    n_sampled: tuple[int, ...]
    seed: int

    def to_dict(self) -> dict[str, object]:
        return {
            "distance": self.distance.tolist(),
            "difference_norm": self.difference_norm.tolist(),
            "operator_norm": self.operator_norm.tolist(),
            "exact": self.exact,
            "n_edges": list(self.n_edges),
            "n_sampled": list(self.n_sampled),
            "seed": self.seed,
        }


def nearest_connection_operator_distance(
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    mu: Float[Tensor, "batch query"],
    scale: Float[Tensor, " batch"] | float,
    *,
    max_edges: int | None = None,
    seed: int = 0,
) -> NearestOperatorDistance:
    """``||P - P*||_F / ||P||_F`` to the nearest random-walk connection operator (spec §4).

    ``P`` is the connection walk with ``W_ij`` and ``T_ij = H sum_h g^h_ij W_V^h W_O^h``;
    ``P*`` has the walk `reversibilised_walk` ``W*`` (of ``mu``, e.g. the ``mu`` of
    `reversibility_residual`) and the transports
    ``s O*_ij``, ``O*_ij`` = `polar_factor` of ``(T_ij + T_ji^T) / 2`` (``s`` e.g.
    `common_scale`, one per batch element)::

        ||P - P*||_F^2 = sum_ij ||W_ij T_ij - W*_ij s O*_ij||_F^2
        ||P||_F^2      = sum_ij W_ij^2 ||T_ij||_F^2

    over the edges ``W_ij > 0`` or ``W*_ij > 0`` (a causal walk's reverse edges count: ``P*``
    has them). ``T_ij`` on a pair with ``W_ij = 0`` is whatever the gates give there
    (`gates` puts uniform gates, ``T_ij = sum_h T^h``).

    Conventions: ``0/0`` (``P = P* = 0``) is 0; ``||P||_F = 0 < ||P - P*||_F`` is ``inf``.
    Where ``(T_ij + T_ji^T) / 2`` is singular its polar factor is not unique (see
    `polar_factor`); the distance depends on that choice only through
    ``<U_0^T A_ij V_0, .>``, ``A_ij = (T_ij - T_ji^T) / 2`` restricted to the null spaces, so not
    at all for paired transports (``T_ji = T_ij^T``) or invertible symmetrisations (e.g.
    generic ``T_ij`` with ``d_model <= H d_head``).

    Cost: one ``d_model x d_model`` SVD per edge, ``O(batch n^2 d_model^3)`` time; memory chunked to
    ``CHUNK_ENTRIES`` numbers (on a GPU a share of its memory). With ``max_edges`` set and a
    batch element having more edges, a uniform sample of ``max_edges`` of them is used instead
    (``exact`` False; see `NearestOperatorDistance`).

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> W, g = A.mean(1), A / A.sum(1, keepdim=True)
    >>> nearest_connection_operator_distance(W, g, torch.randn(2, 6, 3), torch.randn(2, 3, 6),
    ...                                      torch.full((1, 4), 0.25), 1.0).distance.shape
    torch.Size([1])
    """
    walk64 = _check_walk(walk)
    check_heads(W_V, W_O)
    n_heads = W_V.shape[0]
    if (
        gates.ndim != 4
        or gates.shape[1] != n_heads
        or gates.shape[:1] + gates.shape[2:] != walk64.shape
    ):
        raise ConnWalkError(
            f"gates {tuple(gates.shape)} must be [batch, head, query, key] with head={n_heads} "
            f"(from W_V) and the walk's batch, query, key {tuple(walk64.shape)}."
        )
    if not torch.isfinite(gates).all():
        raise ConnWalkError("gates have NaN or inf entries; use walk.gates() (uniform on 0/0).")
    mu64 = _check_mu(mu, walk64)
    scale64 = _check_scale(scale, walk64)
    check_optional_count(max_edges, "max_edges", "all edges", "integer")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConnWalkError(f"seed must be an integer, got {seed!r}.")

    scale_tensors = (scale,) if isinstance(scale, Tensor) else ()
    dtype = working_dtype(walk, gates, W_V, W_O, mu, *scale_tensors)
    device = walk64.device
    reversed64 = _reversibilised(walk64, mu64)
    edges, weights, n_edges, n_sampled = _select_edges(
        (walk64 > 0) | (reversed64 > 0), max_edges, seed
    )

    gates_w = gates.to(device=device, dtype=dtype)
    left = rearrange(
        W_V.to(device=device, dtype=dtype), "head d_model d_head -> d_model head d_head"
    )
    right = rearrange(
        W_O.to(device=device, dtype=dtype), "head d_head d_model -> (head d_head) d_model"
    )
    walk_w, reversed_w, scale_w = (t.to(dtype) for t in (walk64, reversed64, scale64))

    batch = walk64.shape[0]
    d_model, inner = W_V.shape[1], n_heads * W_V.shape[2]
    per_edge = _TENSORS_PER_EDGE * d_model * max(d_model, inner)
    step = max(1, chunks.chunk_entries(device) // per_edge)
    diff_sq = torch.zeros(batch, dtype=torch.float64, device=device)
    norm_sq = torch.zeros(batch, dtype=torch.float64, device=device)
    for start in range(0, edges.shape[0], step):
        b, i, j = edges[start : start + step].unbind(-1)
        forward = _edge_transports(gates_w[b, :, i, j], left, right)
        backward = _edge_transports(gates_w[b, :, j, i], left, right)
        nearest = polar_factor((forward + rearrange(backward, "e a c -> e c a")) / 2)
        w, w_star = walk_w[b, i, j], reversed_w[b, i, j] * scale_w[b]
        gap = einsum(w, forward, "e, e a c -> e a c") - einsum(w_star, nearest, "e, e a c -> e a c")
        weight = weights[start : start + step]
        diff_sq.index_add_(0, b, weight * reduce(gap**2, "e a c -> e", "sum").to(torch.float64))
        norm_sq.index_add_(
            0, b, weight * (w**2 * reduce(forward**2, "e a c -> e", "sum")).to(torch.float64)
        )

    safe = torch.where(norm_sq > 0, norm_sq, 1.0)
    ratio = torch.where(norm_sq > 0, diff_sq / safe, torch.where(diff_sq > 0, torch.inf, 0.0))
    return NearestOperatorDistance(
        distance=ratio.sqrt().to(dtype),
        difference_norm=diff_sq.sqrt().to(dtype),
        operator_norm=norm_sq.sqrt().to(dtype),
        exact=n_sampled == n_edges,
        n_edges=n_edges,
        n_sampled=n_sampled,
        seed=seed,
    )


def _check_mu(mu: Tensor, walk64: Tensor) -> Tensor:
    """``mu`` in float64 on the walk's device, after the checks of a measure."""
    if not isinstance(mu, Tensor) or mu.shape != walk64.shape[:2]:
        shape = tuple(mu.shape) if isinstance(mu, Tensor) else type(mu).__name__
        raise ConnWalkError(
            f"mu {shape} must be a [batch, query] = {tuple(walk64.shape[:2])} tensor (e.g. the "
            "mu of reversibility_residual)."
        )
    mu64 = mu.to(device=walk64.device, dtype=torch.float64)
    if not torch.isfinite(mu64).all() or (mu64 < 0).any() or (mu64.sum(-1) <= 0).any():
        raise ConnWalkError("mu must be finite, >= 0 and have positive mass in every row.")
    return mu64


def _check_scale(scale: Tensor | float, walk64: Tensor) -> Tensor:
    """The common scale as a float64 ``[batch]`` tensor on the walk's device."""
    batch = walk64.shape[0]
    if isinstance(scale, bool) or not isinstance(scale, (Tensor, int, float)):
        raise ConnWalkError(f"scale must be a [batch] tensor or a number, got {scale!r}.")
    if isinstance(scale, Tensor):
        if scale.shape != (batch,):
            raise ConnWalkError(
                f"scale {tuple(scale.shape)} must be [batch] = ({batch},): one common scale per "
                "batch element (e.g. common_scale)."
            )
        scale64 = scale.to(device=walk64.device, dtype=torch.float64)
    else:
        scale64 = torch.full((batch,), float(scale), dtype=torch.float64, device=walk64.device)
    if not torch.isfinite(scale64).all() or (scale64 < 0).any():
        raise ConnWalkError("scale must be finite and >= 0 (a common scale s of s O, spec §2).")
    return scale64


def _reversibilised(walk64: Tensor, mu64: Tensor) -> Tensor:
    flow = einsum(mu64, walk64, "batch query, batch query key -> batch query key")
    sym = (flow + rearrange(flow, "batch query key -> batch key query")) / 2
    mass = reduce(sym, "batch query key -> batch query 1", "sum")
    return torch.where(mass > 0, sym / torch.where(mass > 0, mass, 1.0), 0.0)


def _select_edges(
    present: Tensor, max_edges: int | None, seed: int
) -> tuple[Tensor, Tensor, tuple[int, ...], tuple[int, ...]]:
    """Edge triples ``(b, i, j)``, their weights (``n_edges / n_sampled``) and the counts.

    Sampling without replacement per batch element, in batch order, from one CPU generator so
    the draw does not depend on the device.
    """
    edges = present.nonzero()
    counts = [int(c) for c in reduce(present.long(), "batch query key -> batch", "sum").tolist()]
    if max_edges is None or max(counts, default=0) <= max_edges:
        weights = torch.ones(edges.shape[0], dtype=torch.float64, device=present.device)
        return edges, weights, tuple(counts), tuple(counts)
    generator = torch.Generator().manual_seed(seed)
    kept, weights_list, sampled = [], [], []
    offset = 0
    for count in counts:
        block = edges[offset : offset + count]
        offset += count
        if count > max_edges:
            pick = torch.randperm(count, generator=generator)[:max_edges].sort().values
            block = block[pick.to(block.device)]
        kept.append(block)
        sampled.append(block.shape[0])
        weights_list.append(
            torch.full(
                (block.shape[0],),
                count / max(block.shape[0], 1),
                dtype=torch.float64,
                device=present.device,
            )
        )
    return torch.cat(kept), torch.cat(weights_list), tuple(counts), tuple(sampled)


def _edge_transports(edge_gates: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """Dense ``T_e = W_V^cat diag(H g_e (x) 1) W_O^cat`` for a chunk of edges, ``[e, d, d]``."""
    n_heads = edge_gates.shape[1]
    scaled = einsum(
        left, n_heads * edge_gates, "d_model head d_head, e head -> e d_model head d_head"
    )
    return rearrange(scaled, "e d_model head d_head -> e d_model (head d_head)") @ right


chunks.forward_budgets(__name__)
