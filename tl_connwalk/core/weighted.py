"""Walk-weighted summaries of per-edge values (spec §3): the mean ``(1/n) sum_ij W_ij v_ij``, the
coefficient of variation, and the heaviest edges that carry a share of each row's mass."""

import torch
from einops import einsum, reduce
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core.checks import check_flag, check_walk_nonnegative, working_dtype
from tl_connwalk.core.moments import Moments
from tl_connwalk.errors import ConnWalkError


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


def edge_weights(walk: Tensor, exclude_sink: bool, edges: Tensor | None) -> tuple[Tensor, Tensor]:
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


def on_edges(weights: Tensor, values: Tensor) -> Tensor:
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
    weights, rows = edge_weights(walk, check_flag(exclude_sink, "exclude_sink"), edges)
    values = on_edges(weights, values)
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
    weights, _ = edge_weights(walk, check_flag(exclude_sink, "exclude_sink"), edges)
    values = on_edges(weights, values)
    return Moments.of_edges(values, weights).cv
