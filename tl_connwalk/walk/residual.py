"""``laplacian_residual``: how far a layer's generator is from a random-walk connection Laplacian.

One record per layer with every condition of spec §2 measured as in section 3, each
defect beside its random baseline (spec §3: a defect means little without one). The record is
frozen and typed, and ``to_dict()`` gives plain floats and lists for JSON.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core import field_defect, isometry, laplacian, markov, padding
from tl_connwalk.core import walk as core_walk
from tl_connwalk.core.caches import (
    HeadGrams,
    LayerDraws,
    head_grams,
    layer_draws,
    stacked_draw_message_grams,
)
from tl_connwalk.core.isometry import RandomBaseline
from tl_connwalk.core.laplacian import NearestOperatorDistance
from tl_connwalk.errors import ConnWalkError

DefectKind = Literal["gram", "frobenius"]


@runtime_checkable
class MeasuredWalk(Protocol):
    """What the measurements read of a walk: `tl_connwalk.walk.ConnectionWalk` is one.

    The tensors and shapes are those of `ConnectionWalk`'s attributes (spec §1.2).
    """

    @property
    def walk(self) -> Float[Tensor, "batch query key"]: ...
    @property
    def gates(self) -> Float[Tensor, "batch head query key"]: ...
    @property
    def field(self) -> Float[Tensor, "batch key d_model"]: ...
    @property
    def W_V(self) -> Float[Tensor, "head d_model d_head"]: ...
    @property
    def W_O(self) -> Float[Tensor, "head d_head d_model"]: ...
    @property
    def kv_heads(self) -> tuple[int, ...] | None: ...
    @property
    def attention_mask(self) -> Bool[Tensor, "batch pos"] | None: ...
    @property
    def layer(self) -> int | None: ...
    @property
    def processing(self) -> Mapping[str, bool]: ...
    @property
    def n_heads(self) -> int: ...
    def of_heads(self, heads: Sequence[int]) -> "MeasuredWalk": ...


class Memo:
    """What the measurements of one walk share between calls, held by the walk's owner.

    `tl_connwalk.walk.ConnectionWalk` keeps one per walk and passes it to
    `laplacian_residual` and `isometry_defects`: calls with other options (``exclude_sink``,
    ``mass_share``, ``mu``, ``exact``) then reuse the unit-scaled weights, their Gram tensors,
    the message Grams and the random draws. An in-place edit of the walk's field or weights
    is noticed (``Tensor._version``) and the terms are made again.
    """

    def __init__(self) -> None:
        self._terms: _LayerTerms | None = None

    def terms(self, walk: MeasuredWalk) -> "_LayerTerms":
        """The walk's `_LayerTerms`, made on first use and again after an in-place edit."""
        if self._terms is None or self._terms.versions != _versions(walk):
            self._terms = _LayerTerms(walk)
        return self._terms

    def clear(self) -> None:
        """Forget the terms (they are made again on the next call)."""
        self._terms = None


def _listed(value: Tensor | None) -> object:
    return None if value is None else value.tolist()


@dataclasses.dataclass(frozen=True, repr=False)
class LaplacianResidual:
    """How far ``L = I - P`` is from a random-walk connection Laplacian, per batch element.

    Attributes (spec §2-4; every ``[batch]`` value is per sequence):
        stochasticity: ``[batch]`` ``max_i |sum_j W_ij - 1|`` (C1).
        reversibility: ``[batch]`` ``||M - M^T||_F / ||M + M^T||_F``, ``M = diag(mu) W`` (C2).
        mu, mu_kind: the measure used, ``[batch, pos]``, and per sequence which one
            (``"stationary"``, ``"uniform"``, ``"given"``, ``"teleport"``).
        transport_defect: ``[batch]`` walk-weighted Gram defect ``eps`` of the effective
            transports, ``r = min(d_model, H_kv d_head)`` with ``H_kv`` the distinct value
            heads (``H`` without grouped-query attention) (C3 up to scale).
        scale: ``[batch]`` the common scale ``s``, walk-weighted ``||T_ij||_F / sqrt(r)``.
        pairing: ``[batch]`` walk-weighted ``||T_ji - T_ij^T||_F / ||T_ij||_F``, or ``None``
            when no sequence has an edge in both directions (a causal walk: not applicable);
            ``pairing_applicable`` says which sequences it applies to.
        head_defects: ``[head]`` isometry defect ``delta`` of each head's OV map, ``r = d_head``.
        field_defect: ``[batch]`` data-dependent defect: walk-weighted coefficient of variation
            of ``||x_j T_ij|| / ||x_j||``.
        head_field_defects: ``[batch, head]`` the same per head with ``T^h``.
        baseline: the same defects for random transports of equal shapes, equal sharing of
            value heads and equal head Frobenius norms (Gaussian factors):
            ``{"head_defects", "transport_defect", "field_defect"}``.
        exclude_sink: whether key 0 was dropped from the walk-weighted summaries.
        nearest_operator: with ``exact=True``, ``||P - P*||_F / ||P||_F`` to the nearest
            random-walk connection operator (spec §4) and how it was evaluated (every edge, or a
            stated sample with its seed); else ``None``.
        mass_share: the requested share of each row's walk mass on whose heaviest edges
            ``transport_defect`` (and its baseline) was computed; ``None``: every edge.
        mass_covered: ``[batch]`` the share of the walk mass those edges actually carry
            (``>= mass_share``; 1 with every edge).
        heads: the head subset measured (the walk of those heads alone), ``None``: every head.
        edges_masked: whether an edge mask restricted the walk-weighted summaries.

    On a padded batch (the walk's ``attention_mask``) every value of a sequence is that of
    the sequence run alone; ``mu`` is 0 on padding.
    """

    stochasticity: Float[Tensor, " batch"]
    reversibility: Float[Tensor, " batch"]
    mu: Float[Tensor, "batch pos"]
    mu_kind: tuple[str, ...]
    transport_defect: Float[Tensor, " batch"]
    scale: Float[Tensor, " batch"]
    pairing: Float[Tensor, " batch"] | None
    pairing_applicable: Bool[Tensor, " batch"]
    head_defects: Float[Tensor, " head"]
    field_defect: Float[Tensor, " batch"]
    head_field_defects: Float[Tensor, "batch head"]
    baseline: Mapping[str, RandomBaseline]
    exclude_sink: bool
    nearest_operator: NearestOperatorDistance | None = None
    layer: int | None = None
    processing: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    mass_share: float | None = None
    mass_covered: Float[Tensor, " batch"] | None = None
    heads: tuple[int, ...] | None = None
    edges_masked: bool = False

    def to_dict(self) -> dict[str, object]:
        """Plain floats and lists, JSON-serialisable."""
        return {
            "layer": self.layer,
            "processing": dict(self.processing),
            "exclude_sink": self.exclude_sink,
            "stochasticity": self.stochasticity.tolist(),
            "reversibility": self.reversibility.tolist(),
            "mu": self.mu.tolist(),
            "mu_kind": list(self.mu_kind),
            "transport_defect": self.transport_defect.tolist(),
            "scale": self.scale.tolist(),
            "pairing": _listed(self.pairing),
            "pairing_applicable": self.pairing_applicable.tolist(),
            "head_defects": self.head_defects.tolist(),
            "field_defect": self.field_defect.tolist(),
            "head_field_defects": self.head_field_defects.tolist(),
            "baseline": {name: base.to_dict() for name, base in self.baseline.items()},
            "nearest_operator": (
                None if self.nearest_operator is None else self.nearest_operator.to_dict()
            ),
            "mass_share": self.mass_share,
            "mass_covered": _listed(self.mass_covered),
            "heads": None if self.heads is None else list(self.heads),
            "edges_masked": self.edges_masked,
        }

    def __repr__(self) -> str:
        def show(name: str, value: Tensor | None, base: str | None = None) -> str:
            text = "n/a (causal)" if value is None else f"{value.float().mean().item():.4f}"
            if base is not None:
                mean, std = self.baseline[base].mean, self.baseline[base].std
                text += f" (random {mean.float().mean():.4f} ± {std.float().mean():.4f})"
            return f"  {name:<17} {text}"

        layer = "" if self.layer is None else f" layer {self.layer}"
        if self.heads is not None:
            layer += f" heads {list(self.heads)}"
        sink = ", sink excluded" if self.exclude_sink else ""
        sink += ", edge mask" if self.edges_masked else ""
        mu = ", ".join(sorted(set(self.mu_kind)))
        lines = [
            f"LaplacianResidual{layer} (batch means{sink}; mu: {mu})",
            show("stochasticity", self.stochasticity),
            show("reversibility", self.reversibility),
            show("transport_defect", self.transport_defect, "transport_defect"),
            show("scale", self.scale),
            show("pairing", self.pairing),
            show("head_defects", self.head_defects, "head_defects"),
            show("field_defect", self.field_defect, "field_defect"),
        ]
        if self.nearest_operator is not None:
            how = "exact" if self.nearest_operator.exact else "sampled edges"
            lines.append(show(f"||P-P*||/||P|| ({how})", self.nearest_operator.distance))
        return "\n".join(lines)


def laplacian_residual(
    walk: MeasuredWalk,
    *,
    mu: Float[Tensor, "batch pos"] | markov.MuOption = "stationary",
    alpha: float = 0.85,
    exclude_sink: bool = False,
    edges: padding.EdgeMask | None = None,
    heads: Sequence[int] | None = None,
    baseline_draws: int = 8,
    seed: int = 0,
    exact: bool = False,
    max_edges: int | None = 4096,
    mass_share: float | None = None,
    query_chunk: int | None = None,
    memo: Memo | None = None,
) -> LaplacianResidual:
    """Measure every condition of spec §2 on one layer's walk (`LaplacianResidual`).

    Args:
        walk: the layer's `tl_connwalk.walk.ConnectionWalk` (any `MeasuredWalk`).
        mu: the measure for reversibility: ``"stationary"`` (falls back to uniform where the
            walk is reducible, e.g. causal), ``"uniform"``, ``"teleport"`` (stationary
            distribution of ``alpha W + (1 - alpha) 11^T / n``) or a ``[batch, pos]`` tensor.
        exclude_sink: drop each sequence's first real key (its sink: key 0, or the first
            token after left padding) and renormalise rows in every walk-weighted summary.
        edges: an edge mask for the walk-weighted summaries (``transport_defect``, ``scale``,
            ``pairing``, ``field_defect``, ``head_field_defects``, ``mass_share``): a
            ``[batch, query, key]`` bool tensor, or a function of the query and key token
            positions (``[batch, query, 1]``, ``[batch, 1, key]``, counted from each
            sequence's first real token), e.g. ``lambda q, k: k == q - 1``. Rows are
            renormalised over the kept edges, as with ``exclude_sink``; the Markov conditions
            (``stochasticity``, ``reversibility``, ``mu``) and ``nearest_operator`` stay those
            of the whole walk. A mask of every edge gives the unmasked numbers exactly.
        heads: measure the walk of these heads alone (`ConnectionWalk.of_heads`: their mean
            pattern, gates renormalised among them, ``T'_ij = |S| sum_S g'^h_ij T^h``);
            ``head_defects`` and the baselines are then those of the subset.
        baseline_draws: random transports per baseline (``>= 2``).
        seed: seed of the random baselines and of the edge sample.
        exact: also build the nearest random-walk connection operator ``P*`` (spec §4) and
            report ``||P - P*||_F / ||P||_F``; materialises ``d_model x d_model`` maps edge by
            edge, so on more than ``max_edges`` edges per sequence (``None``: never) it uses a
            uniform sample of that many edges, and the result says so.
        mass_share: compute the effective-transport defect (and its baseline) only on the
            heaviest edges of each query row that carry this share of the row's walk mass
            (`tl_connwalk.core.isometry.heaviest_edges`), averaged with rows
            renormalised over them; ``mass_covered`` reports the share they actually carry.
            ``None`` (default): every edge.
        query_chunk: query rows per chunk of the per-edge work (``None``: as many as fit
            ``_fast.chunks.CHUNK_ENTRIES`` numbers); the results do not depend on it.
        memo: the walk's `Memo` (`ConnectionWalk` passes its own): what another call on
            the same walk can reuse; ``None``: nothing is kept.

    Cost: ``O(H^3 d_head^3)`` for the layer's Gram tensors, once per set of weights (they
    are kept by content, `tl_connwalk.core.caches.head_grams`: another cache of the same model
    costs only a 128-bit XXH3 digest of ``W_V``, ``W_O``); the random draws' Grams are computed
    once per head shape and seed and shared by every layer
    (`tl_connwalk.core.caches.layer_draws`), each layer rescaling them to its head norms;
    ``O(batch n^2 H^4 / 24)`` per-edge work for the layer and each draw in
    one pass over the gates; the field defect's message Grams ``O(batch n H d_head d_model)``
    for the layer and each draw (through the stored output Gram where ``H d_head <= 1024``,
    `field_defect.message_grams`). Memory stays at the size of the pattern plus the ``H^2 d_head^2``
    Grams and one chunk. What depends on the walk's field (message Grams) and the layer's
    draws is kept in ``memo`` (the walk's own, through ``walk.laplacian_residual``), so
    another call on it with other options (e.g. ``exclude_sink``) costs only the rest.

    >>> res = walk.laplacian_residual()
    >>> res.transport_defect.shape, res.baseline["transport_defect"].mean.shape
    (torch.Size([2]), torch.Size([2]))
    """
    return laplacian_residuals(
        [walk], mu=mu, alpha=alpha, exclude_sink=exclude_sink, edges=edges, heads=heads,
        baseline_draws=baseline_draws, seed=seed, exact=exact, max_edges=max_edges,
        mass_share=mass_share, query_chunk=query_chunk, memos=[memo],
    )[0]  # fmt: skip


def laplacian_residuals(
    walks: Sequence[MeasuredWalk],
    *,
    mu: Float[Tensor, "batch pos"] | markov.MuOption = "stationary",
    alpha: float = 0.85,
    exclude_sink: bool = False,
    edges: padding.EdgeMask | None = None,
    heads: Sequence[int] | None = None,
    baseline_draws: int = 8,
    seed: int = 0,
    exact: bool = False,
    max_edges: int | None = 4096,
    mass_share: float | None = None,
    query_chunk: int | None = None,
    memos: Sequence[Memo | None] | None = None,
) -> list[LaplacianResidual]:
    """`laplacian_residual` of several walks (the layers of a cache, say), with the same
    options, each walk's result as it alone gives up to rounding.

    The per-edge work of walks of one shape runs stacked: the transport defects of every walk
    and its draws in one pass over the stacked gates (`isometry.stacked_gram_means`), the field
    defects with the walks side by side as one batch. So the number of tensor operations (on
    a GPU, kernel launches) grows little with the number of walks; memory holds one stacked
    copy of the walks' patterns and gates: pass as many walks as that allows
    (`tl_connwalk.analysis.geometry_table` passes the layers whose gates fit
    ``_fast.chunks.CHUNK_ENTRIES`` numbers). ``memos``: each walk's `Memo` (``None``: a
    fresh one).
    """
    if baseline_draws < 2:
        raise ConnWalkError(
            f"baseline_draws must be >= 2 (a spread needs two), got {baseline_draws}."
        )
    isometry.check_flag(exclude_sink, "exclude_sink")
    if memos is not None and len(memos) != len(walks):
        raise ConnWalkError(f"memos must give one Memo per walk: {len(memos)} for {len(walks)}.")
    if not walks:
        return []
    chosen = None
    for walk in walks:
        chosen = None if heads is None else core_walk.check_heads(heads, walk.n_heads)
    resolved = [
        _of_heads(walk, chosen, memo)
        for walk, memo in zip(walks, memos or [None] * len(walks), strict=True)
    ]
    _LayerTerms.stack_message_grams(
        [memo.terms(walk) for walk, memo in resolved], baseline_draws, seed
    )
    parts = [
        _Parts(walk, memo, exclude_sink, edges, mass_share, baseline_draws, seed)
        for walk, memo in resolved
    ]
    measured = _grouped(parts, lambda group: _stacked_means(group, mu, alpha, query_chunk))
    return [
        _finished(
            part,
            means,
            exclude_sink=exclude_sink,
            edges=edges,
            chosen=chosen,
            exact=exact,
            max_edges=max_edges,
            mass_share=mass_share,
            seed=seed,
            query_chunk=query_chunk,
        )
        for part, means in zip(parts, measured, strict=True)
    ]


class _Parts:
    """What the stacked per-edge work needs of one walk: its walk and gates, the edges its
    summaries keep, and its families (the layer, then its draws) as head Grams and as
    message Grams."""

    def __init__(
        self,
        walk: MeasuredWalk,
        memo: Memo,
        exclude_sink: bool,
        edges: padding.EdgeMask | None,
        mass_share: float | None,
        n_draws: int,
        seed: int,
    ) -> None:
        self.walk, self.memo = walk, memo
        W = self.walk.walk
        self.W, self.g = W, self.walk.gates
        self.scoped, self.drop_sink = padding.scope(
            self.walk.attention_mask, edges, exclude_sink, W.shape, W.device
        )
        self.terms = self.memo.terms(self.walk)
        self.kept, self.covered = None, None
        if mass_share is not None:
            considered = W
            if self.scoped is not None:
                considered = torch.where(self.scoped, W, 0.0)
            elif self.drop_sink:
                considered = W.clone()
                considered[:, :, 0] = 0.0
            selected = isometry.heaviest_edges(considered, mass_share)
            self.covered = isometry.covered_mass_share(considered, selected)
            # share 1 keeps every edge: the all-edge path itself, not a gathered copy of it
            self.kept = None if mass_share >= 1.0 else selected
        grams = self.terms.heads
        # the layer and its random draws (shared by every layer of this shape) as one family
        # each, by their head Grams and by their message Grams
        self.rand = self.terms.layer_draws(n_draws, seed)
        self.K2 = torch.cat([grams.K2[None], self.rand.K2])
        self.pair_gram = torch.cat([grams.pair_gram[None], self.rand.pair_gram])
        self.message_grams = torch.cat(
            [self.terms.message_grams[None], self.terms.draw_message_grams(n_draws, seed)]
        )

    def key(self) -> tuple[object, ...]:
        """Walks with equal keys stack: the same shapes, dtypes, device, rank and masking."""
        X = self.terms.field
        return (
            self.g.shape, self.g.dtype, X.shape, X.dtype, self.message_grams.dtype,
            self.K2.shape, self.K2.dtype, self.g.device, self.terms.rank, self.drop_sink,
            self.scoped is None, self.kept is None, self.walk.attention_mask is None,
        )  # fmt: skip


def _grouped(
    parts: list[_Parts], measure: Callable[[list["_Parts"]], list["_Means"]]
) -> list["_Means"]:
    """``measure`` of each group of parts with equal `_Parts.key`, results in ``parts``'
    order."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for index, part in enumerate(parts):
        groups.setdefault(part.key(), []).append(index)
    results: dict[int, _Means] = {}
    for indices in groups.values():
        results.update(zip(indices, measure([parts[i] for i in indices]), strict=True))
    return [results[index] for index in range(len(parts))]


class _Means(NamedTuple):
    """One walk's stacked results: per family (the layer, then its draws) and sequence, and
    its Markov conditions."""

    transport: Float[Tensor, "family batch"]
    scale: Float[Tensor, "family batch"]
    fields: Float[Tensor, "family batch"]
    reversibility: markov.ReversibilityResidual
    stochasticity: Float[Tensor, " batch"]
    head_fields: Float[Tensor, "batch head"]


def _stacked(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.stack``, without a copy for one tensor."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(list(tensors))


def _stacked_masks(masks: Sequence[Tensor | None]) -> Tensor | None:
    """`_stacked` edge masks; ``None`` where the walks have none (a group's walks have a mask
    each or none: `_Parts.key`)."""
    present = [mask for mask in masks if mask is not None]
    return _stacked(present) if present else None


def _stacked_means(
    parts: list[_Parts],
    mu: Float[Tensor, "batch pos"] | markov.MuOption,
    alpha: float,
    query_chunk: int | None,
) -> list[_Means]:
    """The transport defects of stackable walks' families in one pass over their stacked
    gates; the field defects (of the families, and per head), the Markov conditions with the
    walks side by side as one batch of sequences."""
    first, count = parts[0], len(parts)
    W, g = _stacked([p.W for p in parts]), _stacked([p.g for p in parts])
    masks = _stacked_masks([p.scoped if p.kept is None else p.kept for p in parts])
    means = isometry.stacked_gram_means(
        W, g, _stacked([p.K2 for p in parts]), _stacked([p.pair_gram for p in parts]),
        first.terms.rank, exclude_sink=first.drop_sink, edges=masks, query_chunk=query_chunk,
    )  # fmt: skip
    # the walks side by side: [stack batch ...] as [(stack batch) ...]
    scoped = _stacked_masks([p.scoped for p in parts])
    edges = None if scoped is None else scoped.flatten(0, 1)
    X = _stacked([p.terms.field for p in parts]).flatten(0, 1)
    walks, gates = W.flatten(0, 1), g.flatten(0, 1)
    fields = field_defect.field_isometry_defects(
        X, walks, gates, torch.cat([p.message_grams for p in parts], dim=1),
        exclude_sink=first.drop_sink, query_chunk=query_chunk, edges=edges,
    ).unflatten(1, (count, -1))  # fmt: skip
    # given the message Grams, the weights only fix the shapes and the dtype (the group's)
    heads = field_defect.head_field_isometry_defects(
        X, walks, gates, first.terms.W_V, first.terms.W_O, exclude_sink=first.drop_sink,
        query_chunk=query_chunk, grams=torch.cat([p.terms.message_grams for p in parts]),
        edges=edges,
    ).unflatten(0, (count, -1))  # fmt: skip
    positions = _stacked_masks([p.walk.attention_mask for p in parts])
    positions = None if positions is None else positions.flatten(0, 1)
    given = mu.repeat(count, 1) if isinstance(mu, Tensor) else mu
    reversibility = markov.reversibility_residual(walks, given, alpha=alpha, positions=positions)
    stochasticity = markov.stochasticity_residual(walks, positions=positions).view(count, -1)
    batch = first.W.shape[0]
    return [
        _Means(
            means.defect[k],
            means.scale[k],
            fields[:, k],
            markov.ReversibilityResidual(
                reversibility.residual[k * batch : (k + 1) * batch],
                reversibility.mu[k * batch : (k + 1) * batch],
                reversibility.mu_kind[k * batch : (k + 1) * batch],
            ),
            stochasticity[k],
            heads[k],
        )
        for k in range(count)
    ]


def _finished(
    part: _Parts,
    means: _Means,
    *,
    exclude_sink: bool,
    edges: padding.EdgeMask | None,
    chosen: tuple[int, ...] | None,
    exact: bool,
    max_edges: int | None,
    mass_share: float | None,
    seed: int,
    query_chunk: int | None,
) -> LaplacianResidual:
    """One walk's `LaplacianResidual` from its stacked results and the rest of its work."""
    walk, terms, W, g = part.walk, part.terms, part.W, part.g
    positions, scoped, drop_sink = walk.attention_mask, part.scoped, part.drop_sink
    W_V, W_O = terms.W_V, terms.W_O
    reversibility = means.reversibility
    pairing = markov.pairing_residual(
        W, g, W_V, W_O, exclude_sink=drop_sink, query_chunk=query_chunk, edges=scoped
    )
    grams = terms.heads
    transport = means.transport
    unit_scale = means.scale[0]
    if part.kept is not None:  # the scale is over every edge, whatever the mass share
        unit_scale = isometry.walk_weighted_mean(
            W,
            isometry.edge_frobenius_scales(g, grams.K2, terms.rank, W, query_chunk=query_chunk),
            exclude_sink=drop_sink,
            edges=scoped,
        )
    fields = means.fields
    baseline = {
        "head_defects": part.rand.head_defects,
        "transport_defect": transport[1:],
        "field_defect": fields[1:],
    }
    nearest = None
    if exact:
        real_walk = W if positions is None else torch.where(padding.real_edges(positions), W, 0.0)
        nearest = laplacian.nearest_connection_operator_distance(
            real_walk, g, W_V, W_O, reversibility.mu, unit_scale, max_edges=max_edges, seed=seed
        )
    scale = unit_scale / terms.factor
    return LaplacianResidual(
        stochasticity=means.stochasticity,
        reversibility=reversibility.residual,
        mu=reversibility.mu,
        mu_kind=reversibility.mu_kind,
        transport_defect=transport[0],
        scale=scale,
        pairing=pairing.residual if bool(pairing.applicable.any()) else None,
        pairing_applicable=pairing.applicable,
        head_defects=grams.head_defects,
        field_defect=fields[0],
        head_field_defects=means.head_fields,
        baseline={
            name: RandomBaseline(values.to(isometry.working_dtype(values)))
            for name, values in baseline.items()
        },
        exclude_sink=exclude_sink,
        nearest_operator=nearest,
        layer=walk.layer,
        processing=walk.processing,
        mass_share=mass_share,
        mass_covered=part.covered,
        heads=chosen,
        edges_masked=edges is not None,
    )


def isometry_defects(
    walk: MeasuredWalk,
    kind: DefectKind = "gram",
    *,
    edges: padding.EdgeMask | None = None,
    heads: Sequence[int] | None = None,
    memo: Memo | None = None,
) -> Float[Tensor, "batch query key"]:
    """Per-edge defect of the effective transports, 0 where ``W_ij = 0`` (spec §3).

    Also 0 on padding (the walk's ``attention_mask``) and off ``edges`` (an edge mask as in
    `laplacian_residual`); ``heads``: of the walk of those heads alone
    (`ConnectionWalk.of_heads`); ``memo`` as in `laplacian_residual`.

    ``kind="gram"``: ``eps(T_ij)`` in closed form on every edge (``O(batch n^2 H^4)``).
    ``kind="frobenius"``: ``delta(T_ij)`` (the relative Frobenius distance to the nearest
    scaled isometry) from each edge's singular values (``O(batch n^2 r^3)``, small problems).
    Both with ``r = min(d_model, H_kv d_head)``, ``H_kv`` the distinct value heads
    (`tl_connwalk.core.isometry.effective_rank`).
    """
    if kind not in ("gram", "frobenius"):
        raise ConnWalkError(f'kind must be "gram" or "frobenius", got {kind!r}.')
    walk, memo = _of_heads(walk, heads, memo)
    terms = memo.terms(walk)
    W = walk.walk
    scoped, _ = padding.scope(walk.attention_mask, edges, False, W.shape, W.device)
    if scoped is not None:
        W = torch.where(scoped, W, 0.0)
    if kind == "gram":
        grams = terms.heads
        return isometry.folded_edge_gram_defects(
            walk.gates, grams.K2, grams.pair_gram, terms.rank, W
        )
    sigma = isometry.edge_singular_values(walk.gates, terms.W_V, terms.W_O)
    delta = isometry.isometry_defect(sigma, terms.rank)
    return torch.where(W > 0, delta, torch.zeros_like(delta))


def _of_heads(
    walk: MeasuredWalk, heads: Sequence[int] | None, memo: Memo | None
) -> tuple[MeasuredWalk, Memo]:
    """The walk of ``heads`` alone and the memo that goes with it: the given one for the walk
    itself, a fresh one for a walk of fewer heads (other weights)."""
    if heads is not None:
        subset = walk.of_heads(heads)
        if subset is not walk:
            return subset, Memo()
    return walk, Memo() if memo is None else memo


class _LayerTerms:
    """What the measurements need of a walk's weights and field alone, each computed on first
    use and kept in the walk's `Memo`: calls with other options (``exclude_sink``,
    ``mass_share``, ``mu``, ``exact``; the report measures every layer with and without the
    sink) share them.

    ``field``, ``W_V``, ``W_O`` are unit-scaled (`_unit_scaled`; ``factor`` undoes it for the
    common scale); ``heads`` are their `HeadGrams` (from the store shared by every walk,
    `tl_connwalk.core.caches.head_grams`); ``layer_draws`` and ``draw_message_grams`` are
    memoised per ``(n_draws, seed)``.
    """

    def __init__(self, walk: MeasuredWalk) -> None:
        self.versions = _versions(walk)
        (self.field, _), (self.W_V, v_factor), (self.W_O, o_factor) = map(
            _unit_scaled, (walk.field, walk.W_V, walk.W_O)
        )
        self.factor = v_factor * o_factor
        self.kv_heads = walk.kv_heads
        self.positions = walk.attention_mask
        self.rank = isometry.effective_rank(self.W_V, self.W_O, walk.kv_heads)
        self._draws: dict[tuple[int, int], LayerDraws] = {}
        self._draw_grams: dict[tuple[int, int], Tensor] = {}
        self._message_grams: Tensor | None = None

    @functools.cached_property
    def heads(self) -> HeadGrams:
        """``K2``, folded ``K4``, head norms and defects: computed once per set of weights."""
        return head_grams(self.W_V, self.W_O)

    @property
    def message_grams(self) -> Tensor:
        """`field_defect.message_grams` of the field (made on first use)."""
        if self._message_grams is None:
            self._message_grams = field_defect.message_grams(
                self.field, self.W_V, self.W_O, out_rows=self.heads.out_rows
            )
        return self._message_grams

    @staticmethod
    def stack_message_grams(terms: Sequence["_LayerTerms"], n_draws: int, seed: int) -> None:
        """Make the message Grams of each walk's field and of its ``(n_draws, seed)`` draws
        that ``terms`` lack, stacked over the walks of one head shape, dtype and field shape
        whose output-Gram rows are kept (`field_defect.stacked_message_grams`,
        `tl_connwalk.core.caches.stacked_draw_message_grams`): one batched product per block
        of keys and head for all of them. Padded walks and wide heads are left to
        `message_grams` and `draw_message_grams`, one walk at a time.
        """
        groups: dict[tuple[object, ...], list[_LayerTerms]] = {}
        for term in terms:
            if term.positions is None and term.heads.out_rows is not None:
                shapes = (
                    term.field.shape, term.field.dtype, term.W_V.shape, term.W_O.shape,
                    term.W_V.dtype, term.W_V.device, term.kv_heads,
                )  # fmt: skip
                groups.setdefault(shapes, []).append(term)
        for group in groups.values():
            if len(group) < 2:
                continue
            own = [term for term in group if term._message_grams is None]
            if own:
                out_rows = [term.heads.out_rows for term in own]
                grams = field_defect.stacked_message_grams(
                    torch.stack([term.field for term in own]),
                    torch.stack([term.W_V.permute(1, 0, 2) for term in own]).flatten(2),
                    own[0].W_V.shape[0],
                    torch.stack([rows for rows in out_rows if rows is not None]),
                )
                for term, gram in zip(own, grams, strict=True):
                    term._message_grams = gram
            key = (n_draws, seed)
            drawn = [term for term in group if key not in term._draw_grams]
            if drawn:
                grams = stacked_draw_message_grams(
                    [term.layer_draws(n_draws, seed) for term in drawn],
                    torch.stack([term.field for term in drawn]),
                )
                for term, gram in zip(drawn, grams, strict=True):
                    term._draw_grams[key] = gram

    def layer_draws(self, n_draws: int, seed: int) -> LayerDraws:
        """`tl_connwalk.core.caches.layer_draws` of the (unit-scaled) weights."""
        key = (n_draws, seed)
        if key not in self._draws:
            self._draws[key] = layer_draws(
                self.W_V, self.W_O, n_draws, seed, norms_sq=self.heads.norms_sq,
                kv_heads=self.kv_heads,
            )  # fmt: skip
        return self._draws[key]

    def draw_message_grams(self, n_draws: int, seed: int) -> Float[Tensor, "draw batch key a b"]:
        """`LayerDraws.message_grams` of the field.

        In a padded batch each sequence's real keys are drawn for as a sequence of their
        length (the field draws depend on it), one call per length: a sequence's field
        baseline is then the one it has alone. Padding keys get zero Grams (no edge reads
        them).
        """
        key = (n_draws, seed)
        if key not in self._draw_grams:
            rand = self.layer_draws(n_draws, seed)
            positions = self.positions
            if positions is None:
                self._draw_grams[key] = rand.message_grams(self.field)
            else:
                self._draw_grams[key] = self._per_length(rand, positions)
        return self._draw_grams[key]

    def _per_length(self, rand: LayerDraws, positions: Tensor) -> Tensor:
        n_draws, n_heads = rand.scales.shape
        grams = self.field.new_zeros(n_draws, *self.field.shape[:2], n_heads, n_heads)
        lengths = positions.sum(-1)
        for length in lengths.unique().tolist():
            seqs = (lengths == length).nonzero().flatten()
            keys = positions[seqs].nonzero()[:, 1].view(len(seqs), int(length))
            rows = seqs[:, None].expand_as(keys)
            grams[:, rows, keys] = rand.message_grams(self.field[rows, keys])
        return grams


def _versions(walk: MeasuredWalk) -> tuple[int, ...]:
    """In-place edits of a walk's field or weights bump these (``Tensor._version``; -1 for an
    inference tensor, which keeps no counter and cannot be edited outside inference mode)."""
    return tuple(-1 if t.is_inference() else t._version for t in (walk.field, walk.W_V, walk.W_O))


def _unit_scaled(tensor: Tensor) -> tuple[Tensor, float]:
    """``(c t, c)`` with ``c`` the power of two that brings ``max |t|`` nearest to 1.

    Every defect is invariant under scaling the field and the transports (spec §3), but the
    closed forms raise transport norms to the fourth power, which leaves float32's range for
    ``||T||_F`` beyond about 1e9 or below 1e-9. A power of two rescales without rounding
    error (the defects agree with the unscaled ones to the last bit or so); inputs whose
    ``max |t|`` lies in ``[2^-8, 2^8]`` are used as they are, without a copy.
    """
    peak = isometry.abs_max(tensor)
    if not math.isfinite(peak):
        raise ConnWalkError(
            f"a {tuple(tensor.shape)} input of the measurement has non-finite entries (NaN or "
            "Inf); check the model's weights and the cached activations."
        )
    if peak == 0.0 or 2.0**-8 <= peak <= 2.0**8:
        return tensor, 1.0
    factor = 2.0 ** -round(math.log2(peak))
    return tensor * factor, factor
