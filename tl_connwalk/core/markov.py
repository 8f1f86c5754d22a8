"""The walk as a Markov chain: conditions (C1)-(C2), layer drift and pairing (spec §2-3).

Pure functions on tensors. A walk ``W`` is ``[batch, query, key]``, row ``i`` the distribution
of the step out of position ``i``. The measurements:

    stochasticity   max_i |sum_j W_ij - 1|                                     (C1)
    reversibility   ||M - M^T||_F / ||M + M^T||_F,  M = diag(mu) W              (C2)
    layer drift     (1/n) sum_i TV(W^l_i., W^l+1_i.)
    pairing         ||T_ji - T_ij^T||_F / ||T_ij||_F over edges in both directions (C3)

Spectral work (stationary distributions) runs in float64; results come back in float32 or
wider, like the rest of the core.
"""

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core._fast.chunks import query_chunks
from tl_connwalk.core._fast.grams import head_gram, head_mixed_gram
from tl_connwalk.core.checks import (
    all_finite,
    check_chunk,
    check_flag,
    check_gates,
    check_heads,
    check_walk_nonnegative,
    working_dtype,
)
from tl_connwalk.core.padding import first_real, real_edges
from tl_connwalk.core.weighted import walk_weighted_mean
from tl_connwalk.errors import ConnWalkError

MuKind = Literal["stationary", "uniform", "given", "teleport"]
MuOption = Literal["stationary", "uniform", "teleport"]


def _check_walk(walk: Tensor, name: str = "walk", square: bool = True) -> Tensor:
    """``walk`` in float64 after the checks every function here needs."""
    if walk.ndim != 3:
        raise ConnWalkError(f"{name} must be [batch, query, key], got {tuple(walk.shape)}.")
    if square and walk.shape[1] != walk.shape[2]:
        raise ConnWalkError(
            f"{name} {tuple(walk.shape)} is not square: a Markov chain needs query == key "
            "(pass self-attention patterns, not cross-attention)."
        )
    walk64 = walk.to(torch.float64)
    if not all_finite(walk64):
        raise ConnWalkError(f"{name} has NaN or inf entries (a fully masked row?).")
    check_walk_nonnegative(walk64, name)
    return walk64


def stochasticity_residual(
    walk: Float[Tensor, "batch query key"],
    *,
    positions: Bool[Tensor, "batch query"] | None = None,
) -> Float[Tensor, " batch"]:
    """``max_i |sum_j W_ij - 1|`` (spec §3): zero exactly under (C1).

    ``positions`` ``[batch, query]`` (True: a real token, False: padding) restricts the rows
    to the real queries.

    >>> stochasticity_residual(torch.softmax(torch.randn(2, 4, 4), -1)) < 1e-6  # rounding only
    tensor([True, True])
    """
    walk64 = _check_walk(walk, square=False)
    residual = (reduce(walk64, "batch query key -> batch query", "sum") - 1).abs()
    if positions is not None:
        residual = torch.where(positions.to(residual.device), residual, 0.0)
    return reduce(residual, "batch query -> batch", "max").to(working_dtype(walk))


def is_irreducible(walk: Float[Tensor, "batch query key"]) -> Bool[Tensor, " batch"]:
    """Whether the graph ``W_ij > 0`` is strongly connected (every position reaches every other).

    Breadth-first reachability from position 0 forwards and backwards, ``O(diameter n^2)``.
    A causal walk is reducible (nothing leaves position 0) unless ``n = 1``.

    >>> is_irreducible(torch.full((1, 3, 3), 1 / 3)), is_irreducible(torch.eye(3)[None])
    (tensor([True]), tensor([False]))
    """
    return _is_irreducible(_check_walk(walk))


def _is_irreducible(walk64: Tensor, real: Tensor | None = None) -> Tensor:
    """`is_irreducible` of a checked float64 walk; with ``real`` ``[batch, pos]``, of the walk
    among the real positions (the walk is zero off them). Backwards only where some sequence
    reaches every position forwards (a causal walk's forward search ends at once)."""
    edges = (walk64 > 0).to(torch.float64)
    batch, n_pos, _ = edges.shape
    start = torch.zeros(batch, n_pos, dtype=torch.float64, device=edges.device)
    if real is None:
        start[:, 0] = 1.0
    else:
        start[torch.arange(batch, device=edges.device), first_real(real)] = 1.0

    def everywhere(reached: Tensor) -> Tensor:
        if real is not None:  # padding is never reached, and need not be
            reached = reached + ~real
        return (reached > 0).all(-1)

    forwards = everywhere(_reached(start, edges))
    if not bool(forwards.any()):
        return forwards
    return forwards & everywhere(_reached(start, edges.mT))


def _reached(start: Tensor, edges: Tensor) -> Tensor:
    """The positions reachable from ``start`` ``[batch, pos]`` (> 0) along ``edges`` ``[batch,
    from, to]`` (> 0), breadth first until nothing new is reached: ``[batch, pos]``."""
    reached = start
    for _ in range(edges.shape[-1]):
        step = torch.bmm(reached[:, None], edges)[:, 0]
        new = ((reached + step) > 0).to(reached)
        if torch.equal(new, reached):
            break
        reached = new
    return reached


def _uniform(walk64: Tensor, real: Tensor | None) -> Tensor:
    """``[batch, pos]``: ``1/n``, or ``1/n_real`` on the real positions and 0 on padding."""
    if real is None:
        return torch.full(walk64.shape[:2], 1.0 / walk64.shape[-1], dtype=walk64.dtype,
                          device=walk64.device)  # fmt: skip
    real = real.to(walk64)
    return real / reduce(real, "batch pos -> batch 1", "sum")


def _row_normalised(walk64: Tensor, real: Tensor | None = None) -> Tensor:
    """Rows scaled to sum 1; rows without mass become uniform (dangling positions), over the
    real positions where ``real`` is given (padding rows stay 0)."""
    mass = reduce(walk64, "batch query key -> batch query 1", "sum")
    if real is None:
        uniform = torch.full_like(walk64, 1.0 / walk64.shape[-1])
    else:
        uniform = real_edges(real).to(walk64) * _uniform(walk64, real)[:, None, :]
    return torch.where(mass > 0, walk64 / torch.where(mass > 0, mass, 1.0), uniform)


def _solve_stationary(chain: Tensor, real: Tensor | None = None) -> Tensor:
    """``mu^T P = mu^T, sum mu = 1`` for irreducible row-stochastic ``P`` (float64), by one solve.

    ``P^T - I`` has rank ``n - 1`` and the all-ones row is independent of its rows, so
    replacing the last equation by normalisation gives a nonsingular system. A solve (not
    power iteration) also handles periodic chains. With ``real`` ``[batch, pos]``, of the
    chain among the real positions: padding gets the equation ``mu_j = 0`` and the last real
    position's equation becomes the normalisation.
    """
    batch, n_pos = chain.shape[:2]
    eye = torch.eye(n_pos, dtype=chain.dtype, device=chain.device)
    system = rearrange(chain, "batch i j -> batch j i") - eye
    rhs = torch.zeros(chain.shape[:2], dtype=chain.dtype, device=chain.device)
    if real is None:
        system[:, -1, :] = 1.0
        rhs[:, -1] = 1.0
    else:
        system = torch.where(real[:, :, None], system, eye)
        last = n_pos - 1 - first_real(real.flip(-1))
        rows = torch.arange(batch, device=chain.device)
        system[rows, last, :] = real.to(system)
        rhs[rows, last] = 1.0
    mu = torch.linalg.solve(system, rhs).clamp_min(0.0)
    return mu / reduce(mu, "batch pos -> batch 1", "sum")


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha < 1.0:
        raise ConnWalkError(
            f"teleport alpha must be a number in [0, 1) (the weight kept on W), got {alpha!r}."
        )
    return float(alpha)


def stationary_distribution(
    walk: Float[Tensor, "batch query key"],
    *,
    teleport: float | None = None,
    positions: Bool[Tensor, "batch query"] | None = None,
) -> Float[Tensor, "batch query"]:
    """The stationary distribution ``mu`` (``mu^T W = mu^T``, ``sum mu = 1``) of the walk.

    Rows are first normalised to sum 1 (float rounding in patterns is ignored). Where the walk
    is reducible (`is_irreducible` is False) there is no unique positive ``mu`` and the
    result is uniform, ``1/n``. With ``teleport=alpha`` it is instead the stationary
    distribution of ``alpha W + (1 - alpha) 11^T / n`` (PageRank; rows of ``W`` without mass
    jump uniformly), which always exists and is positive. Solved in float64. ``positions``
    ``[batch, query]`` (True: a real token) restricts the chain to the real positions, ``n``
    to their number; padding gets ``mu = 0``.

    >>> W = torch.tensor([[[0.5, 0.5], [0.25, 0.75]]])
    >>> stationary_distribution(W)
    tensor([[0.3333, 0.6667]])
    """
    walk64, real = _on_positions(_check_walk(walk), positions)
    if teleport is not None:
        chain = _row_normalised(walk64, real)
        alpha = _check_alpha(teleport)
        if real is None:
            mu = _solve_stationary(alpha * chain + (1.0 - alpha) / chain.shape[-1])
        else:
            jump = real_edges(real).to(chain) * _uniform(walk64, real)[:, None, :]
            mu = _solve_stationary(alpha * chain + (1.0 - alpha) * jump, real)
        return mu.to(working_dtype(walk))
    return _stationary_or_uniform(walk64, real)[0].to(working_dtype(walk))


def _on_positions(walk64: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The checked walk zeroed off the edges between real positions, and those positions."""
    if positions is None:
        return walk64, None
    if positions.shape != walk64.shape[:2]:
        raise ConnWalkError(
            f"positions {tuple(positions.shape)} must be [batch, pos] = "
            f"{tuple(walk64.shape[:2])}, the walk's."
        )
    real = positions.to(device=walk64.device, dtype=torch.bool)
    return torch.where(real_edges(real), walk64, 0.0), real


def _stationary_or_uniform(walk64: Tensor, real: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """float64 ``mu`` (stationary where irreducible, else uniform) and the irreducible flags,
    of a checked float64 walk (among the ``real`` positions where given)."""
    irreducible = _is_irreducible(walk64, real)
    mu = _uniform(walk64, real).clone()
    if irreducible.any():
        sub = None if real is None else real[irreducible]
        mu[irreducible] = _solve_stationary(_row_normalised(walk64[irreducible], sub), sub)
    return mu, irreducible


@dataclasses.dataclass(frozen=True)
class ReversibilityResidual:
    """The reversibility residual per batch element and the measure ``mu`` it was taken with.

    ``mu_kind[b]`` is ``"stationary"`` (irreducible walk), ``"uniform"`` (asked for, or the
    fallback for a reducible walk such as a causal one), ``"given"`` or ``"teleport"``.
    """

    residual: Float[Tensor, " batch"]
    mu: Float[Tensor, "batch pos"]
    mu_kind: tuple[MuKind, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "residual": self.residual.tolist(),
            "mu": self.mu.tolist(),
            "mu_kind": list(self.mu_kind),
        }


def reversibility_residual(
    walk: Float[Tensor, "batch query key"],
    mu: Float[Tensor, "batch query"] | MuOption = "stationary",
    *,
    alpha: float = 0.85,
    positions: Bool[Tensor, "batch query"] | None = None,
) -> ReversibilityResidual:
    """``||M - M^T||_F / ||M + M^T||_F`` with ``M = diag(mu) W`` (spec §3): zero under (C2).

    ``mu``: ``"stationary"`` (default; the stationary distribution where the walk is
    irreducible, else uniform, and the result says which), ``"uniform"``, ``"teleport"`` (the
    stationary distribution of ``alpha W + (1 - alpha) 11^T / n``) or a ``[batch, query]``
    tensor of your own (``>= 0``, any scale). ``W`` itself is used as given. A zero ``M``
    (0/0) counts as reversible: residual 0. ``positions`` ``[batch, query]`` (True: a real
    token, False: padding) restricts everything to the walk among the real positions, as if
    the padding were not there (``mu`` is 0 on padding).

    >>> S = torch.rand(1, 4, 4); S = S + S.mT
    >>> reversibility_residual(S / S.sum(-1, keepdim=True)).residual < 1e-6  # reversible
    tensor([True])
    """
    alpha = _check_alpha(alpha)  # used by mu="teleport" alone, but wrong whatever mu is
    walk64, real = _on_positions(_check_walk(walk), positions)
    batch = walk64.shape[0]
    kinds: list[MuKind]
    if isinstance(mu, Tensor):
        if mu.shape != walk64.shape[:2]:
            raise ConnWalkError(
                f"mu {tuple(mu.shape)} must be [batch, query] = {tuple(walk64.shape[:2])}."
            )
        mu64 = mu.to(device=walk64.device, dtype=torch.float64)
        if real is not None:
            mu64 = torch.where(real, mu64, 0.0)
        if not torch.isfinite(mu64).all() or (mu64 < 0).any() or (mu64.sum(-1) <= 0).any():
            raise ConnWalkError("mu must be finite, >= 0 and have positive mass in every row.")
        kinds = ["given"] * batch
    elif mu == "stationary":
        mu64, irreducible = _stationary_or_uniform(walk64, real)
        kinds = ["stationary" if flag else "uniform" for flag in irreducible.tolist()]
    elif mu == "uniform":
        mu64 = _uniform(walk64, real)
        kinds = ["uniform"] * batch
    elif mu == "teleport":
        mu64 = stationary_distribution(walk, teleport=alpha, positions=real).to(torch.float64)
        kinds = ["teleport"] * batch
    else:
        raise ConnWalkError(f"mu must be a tensor or one of {get_args(MuOption)}, got {mu!r}.")
    flow = einsum(mu64, walk64, "batch query, batch query key -> batch query key")
    flow_t = rearrange(flow, "batch query key -> batch key query")
    diff = torch.linalg.matrix_norm(flow - flow_t)
    total = torch.linalg.matrix_norm(flow + flow_t)
    residual = torch.where(total > 0, diff / torch.where(total > 0, total, 1.0), 0.0)
    dtype = working_dtype(walk)
    return ReversibilityResidual(residual.to(dtype), mu64.to(dtype), tuple(kinds))


def layer_drift(
    walk_a: Float[Tensor, "batch query key"],
    walk_b: Float[Tensor, "batch query key"],
    *,
    exclude_sink: bool = False,
    edges: Bool[Tensor, "batch query key"] | None = None,
) -> Float[Tensor, " batch"]:
    """``(1/n) sum_i TV(W^a_i., W^b_i.)``, ``TV`` half the L1 distance of two rows (spec §3).

    The mean is over the rows with mass in either walk (a fully masked row, e.g. padding, is
    not a row of the walk; none left: 0).
    ``exclude_sink=True`` drops key 0 and renormalises both walks' rows; rows left without
    mass in either walk are left out of the mean (``n`` counts the others; none left: 0).

    >>> W = torch.softmax(torch.randn(1, 4, 4), -1)
    >>> layer_drift(W, W)
    tensor([0.])
    """
    check_flag(exclude_sink, "exclude_sink")
    a64 = _check_walk(walk_a, "walk_a", square=False)
    b64 = _check_walk(walk_b, "walk_b", square=False)
    if a64.shape != b64.shape:
        raise ConnWalkError(
            f"layer_drift compares walks of one shape; got {tuple(a64.shape)} and "
            f"{tuple(b64.shape)} (same batch and positions at both layers)."
        )
    dtype = working_dtype(walk_a, walk_b)
    if not exclude_sink and edges is None:
        b64 = b64.to(a64.device)
        tv = 0.5 * reduce((a64 - b64).abs(), "batch query key -> batch query", "sum")
        rows = ((a64.sum(-1) > 0) | (b64.sum(-1) > 0)).to(tv.dtype).sum(-1)
        return torch.where(rows > 0, tv.sum(-1) / rows.clamp_min(1.0), 0.0).to(dtype)
    if edges is None:
        a64, b64 = a64[:, :, 1:], b64[:, :, 1:].to(a64.device)
    else:
        if edges.shape != a64.shape:
            raise ConnWalkError(
                f"edges {tuple(edges.shape)} must have the walks' shape {tuple(a64.shape)}."
            )
        keep = edges.to(a64.device)
        if exclude_sink:
            keep = keep.clone()
            keep[:, :, 0] = False
        a64, b64 = torch.where(keep, a64, 0.0), torch.where(keep, b64.to(a64.device), 0.0)
    mass_a = reduce(a64, "batch query key -> batch query 1", "sum")
    mass_b = reduce(b64, "batch query key -> batch query 1", "sum")
    kept = (mass_a > 0) & (mass_b > 0)
    a64 = a64 / torch.where(kept, mass_a, 1.0)
    b64 = b64 / torch.where(kept, mass_b, 1.0)
    tv = 0.5 * (a64 - b64).abs().sum(-1, keepdim=True)
    tv = torch.where(kept, tv, 0.0)
    rows = reduce(kept.to(tv.dtype), "batch query 1 -> batch", "sum")
    total = reduce(tv, "batch query 1 -> batch", "sum")
    return torch.where(rows > 0, total / rows.clamp_min(1.0), 0.0).to(dtype)


def edge_pairing_residuals(
    gates: Float[Tensor, "batch head query key"],
    K2: Float[Tensor, "head head"],
    KM: Float[Tensor, "head head"],
    *,
    query_chunk: int | None = None,
) -> Float[Tensor, "batch query key"]:
    """``||T_ji - T_ij^T||_F / ||T_ij||_F`` on every pair ``(i, j)``, without forming ``T_ij``.

    ``||T_ji - T_ij^T||^2 = ||T_ji||^2 + ||T_ij||^2 - 2 tr(T_ij T_ji)`` with
    ``||T_ij||^2 = H^2 g_ij^T K2 g_ij`` and ``tr(T_ij T_ji) = H^2 g_ij^T KM g_ji``
    (``K2`` from `tl_connwalk.core.isometry.head_gram`, ``KM`` from
    `tl_connwalk.core.isometry.head_mixed_gram`). Where ``T_ij = 0`` the residual is
    normalised by ``||T_ji||_F`` instead (so it is 1), and where both are 0 it is 0. Loses half
    the working precision near 0 (a difference of nearly equal numbers). Chunked over queries
    (``query_chunk`` rows; ``None``: as many as fit the chunk budget, ``CHUNK_ENTRIES`` numbers
    on the CPU, a share of its memory on a GPU), with
    the same result whatever the chunking.

    >>> K2 = head_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> KM = head_mixed_gram(torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> edge_pairing_residuals(torch.full((1, 2, 3, 3), 0.5), K2, KM).shape
    torch.Size([1, 3, 3])
    """
    n_heads = K2.shape[0]
    if gates.ndim != 4 or gates.shape[1] != n_heads or gates.shape[2] != gates.shape[3]:
        raise ConnWalkError(
            f"gates must be [batch, head, query, key] with head={n_heads} and query == key; "
            f"got {tuple(gates.shape)}."
        )
    check_chunk(query_chunk)
    return _stacked_edge_pairing(gates[None], K2[None], KM[None], query_chunk)[0]


def _stacked_edge_pairing(
    gates: Float[Tensor, "stack batch head query key"],
    K2: Float[Tensor, "stack head head"],
    KM: Float[Tensor, "stack head head"],
    query_chunk: int | None,
) -> Float[Tensor, "stack batch query key"]:
    """`edge_pairing_residuals` of stacked walks, each with its own ``K2`` and ``KM``, in one
    pass: the same operations for any number of walks."""
    dtype = working_dtype(gates, K2, KM)
    gates, K2, KM = (t.to(device=gates.device, dtype=dtype) for t in (gates, K2, KM))
    stack, batch, n_heads, n_query, n_key = gates.shape
    norm_sq = gates.new_empty(stack, batch, n_query, n_key)
    cross = gates.new_empty(stack, batch, n_query, n_key)
    per_query = stack * batch * n_heads * n_key
    for rows in query_chunks(n_query, per_query, query_chunk, gates.device):
        g = gates[..., rows, :]
        reverse = rearrange(gates[..., rows], "s batch head key query -> s batch head query key")
        mixed = einsum(g, K2, "s batch a query key, s a b -> s batch b query key")
        norm_sq[..., rows, :] = einsum(
            mixed, g, "s batch b query key, s batch b query key -> s batch query key"
        )
        mixed = einsum(g, KM, "s batch a query key, s a b -> s batch b query key")
        cross[..., rows, :] = einsum(
            mixed, reverse, "s batch b query key, s batch b query key -> s batch query key"
        )
    norm_sq.mul_(n_heads**2)
    cross.mul_(n_heads**2)
    norm_sq_reverse = norm_sq.mT
    gap = (norm_sq + norm_sq_reverse - 2 * cross).clamp_min(0.0)
    denom = torch.where(norm_sq > 0, norm_sq, norm_sq_reverse)
    return torch.where(denom > 0, gap / torch.where(denom > 0, denom, 1.0), 0.0).sqrt()


@dataclasses.dataclass(frozen=True)
class PairingResidual:
    """The walk-weighted pairing residual, and whether it applies, per batch element.

    ``applicable[b]`` is False for a causal walk (no off-diagonal pair of positions with edges
    both ways); there ``residual[b]`` is 0 and means nothing: read `values` instead.
    """

    residual: Float[Tensor, " batch"]
    applicable: Bool[Tensor, " batch"]

    def values(self) -> list[float | None]:
        """The residuals, ``None`` where the pairing is not applicable."""
        return [
            value if ok else None
            for value, ok in zip(self.residual.tolist(), self.applicable.tolist(), strict=True)
        ]

    def to_dict(self) -> dict[str, object]:
        return {"residual": self.values(), "applicable": self.applicable.tolist()}


def pairing_residual(
    walk: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    exclude_sink: bool = False,
    query_chunk: int | None = None,
    edges: Bool[Tensor, "batch query key"] | None = None,
) -> PairingResidual:
    """The pairing residual ``||T_ji - T_ij^T||_F / ||T_ij||_F``, walk-weighted (spec §3).

    Averaged over the edges present in both directions (``W_ij > 0`` and ``W_ji > 0``,
    diagonal included: ``T_ii`` must be symmetric) with the restricted weights of
    `tl_connwalk.core.isometry.walk_weighted_mean` (rows renormalised over those edges;
    ``exclude_sink`` also drops key 0, ``edges`` keeps only those edges). Not applicable
    (``applicable`` False) where no off-diagonal pair has edges both ways: a causal walk.
    Costs ``O(batch n^2 H^2)``.

    >>> A = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    >>> pairing_residual(A.mean(1), A / A.sum(1, keepdim=True), torch.randn(2, 8, 4),
    ...                  torch.randn(2, 4, 8)).applicable
    tensor([True])
    """
    if walk.ndim != 3:
        raise ConnWalkError(f"walk must be [batch, query, key], got {tuple(walk.shape)}.")
    if gates.ndim != 4 or gates.shape[:1] + gates.shape[2:] != walk.shape:
        raise ConnWalkError(
            f"gates {tuple(gates.shape)} and walk {tuple(walk.shape)} disagree: need "
            "gates [batch, head, query, key] and walk [batch, query, key]."
        )
    return pairing_residuals(
        walk[None], gates[None], [(W_V, W_O)], exclude_sink=exclude_sink,
        query_chunk=query_chunk, edges=None if edges is None else edges[None],
    )[0]  # fmt: skip


def pairing_residuals(
    walk: Float[Tensor, "stack batch query key"],
    gates: Float[Tensor, "stack batch head query key"],
    heads: Sequence[tuple[Tensor, Tensor]],
    *,
    exclude_sink: bool = False,
    query_chunk: int | None = None,
    edges: Bool[Tensor, "stack batch query key"] | None = None,
) -> list[PairingResidual]:
    """`pairing_residual` of each of stacked walks of one shape (the layers of a model, say),
    each with its own head weights ``heads[s] = (W_V, W_O)``.

    The checks, the test of applicability (one synchronisation) and the per-edge residuals
    run once on the stack, not once per walk; the head Grams are made only where some walk
    has a pair of edges both ways.

    >>> A = torch.softmax(torch.randn(3, 1, 2, 4, 4), -1)
    >>> heads = [(torch.randn(2, 8, 4), torch.randn(2, 4, 8))] * 3
    >>> [p.residual.shape for p in pairing_residuals(A.mean(2), A / A.sum(2, keepdim=True), heads)]
    [torch.Size([1]), torch.Size([1]), torch.Size([1])]
    """
    if walk.ndim != 4 or gates.ndim != 5 or gates.shape[:2] + gates.shape[3:] != walk.shape:
        raise ConnWalkError(
            f"gates {tuple(gates.shape)} and walk {tuple(walk.shape)} disagree: need "
            "gates [stack, batch, head, query, key] and walk [stack, batch, query, key]."
        )
    if len(heads) != walk.shape[0]:
        raise ConnWalkError(
            f"heads must give (W_V, W_O) per walk: {len(heads)} for {walk.shape[0]} walks."
        )
    stack, batch = walk.shape[:2]
    walk64 = _check_walk(walk.flatten(0, 1))
    present = walk64 > 0
    both = present & rearrange(present, "batch query key -> batch key query")
    if edges is not None:  # the pair must exist both ways in the walk, the edge in the mask
        both = both & edges.flatten(0, 1).to(both.device)
    off_diagonal = ~torch.eye(walk64.shape[-1], dtype=torch.bool, device=walk64.device)
    applicable = rearrange(both & off_diagonal, "batch query key -> batch (query key)").any(-1)
    for W_V, W_O in heads:
        check_heads(W_V, W_O)
        if W_V.shape[0] != gates.shape[2]:
            check_gates(gates[0], W_V.shape[0])
    check_chunk(query_chunk)
    applicable = applicable.view(stack, batch)
    if not bool(applicable.any()):  # causal: nothing to measure, so no Gram work either
        zeros = torch.zeros(applicable.shape, dtype=working_dtype(walk), device=walk.device)
        return [PairingResidual(*pair) for pair in zip(zeros, applicable, strict=True)]
    K2, KM = (
        torch.stack([gram(W_V, W_O).to(gates.device) for W_V, W_O in heads])
        for gram in (head_gram, head_mixed_gram)
    )
    residual = _stacked_edge_pairing(gates, K2, KM, query_chunk)
    mean = walk_weighted_mean(
        walk.flatten(0, 1), residual.flatten(0, 1), exclude_sink=exclude_sink, edges=both
    ).view(stack, batch)
    residuals = torch.where(applicable, mean, torch.zeros_like(mean))
    return [PairingResidual(*pair) for pair in zip(residuals, applicable, strict=True)]
