"""``laplacian_residual``: how far a layer's generator is from a random-walk connection Laplacian.

One record per layer with every condition of spec §2 measured as in section 3, each
defect beside its random baseline (spec §3: a defect means little without one). The record is
frozen and typed, and ``to_dict()`` gives plain floats and lists for JSON.

The walks' per-edge work, stacked, is in `tl_connwalk.walk._stacked`; what a walk's
measurements keep between calls (`Memo`, re-exported here with `MeasuredWalk`) in
`tl_connwalk.walk._layer_terms`.
"""

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core import isometry, laplacian, markov, padding
from tl_connwalk.core import walk as core_walk
from tl_connwalk.core.caches import sampled
from tl_connwalk.core.isometry import RandomBaseline
from tl_connwalk.core.laplacian import NearestOperatorDistance
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk._layer_terms import MeasuredWalk as MeasuredWalk
from tl_connwalk.walk._layer_terms import Memo as Memo
from tl_connwalk.walk._layer_terms import _LayerTerms
from tl_connwalk.walk._stacked import _grouped, _Means, _Parts, _stacked_means

DefectKind = Literal["gram", "frobenius"]


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
    baseline_edges: int | None = sampled.BASELINE_EDGES,
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
        baseline_edges: on a walk of more than ``64 baseline_edges`` query-key pairs, each
            draw takes its transport and field defects on this many edges per sequence,
            drawn in proportion to the summary's weights (spec §3, "random baseline"; each
            draw its own sample); the baselines then carry the sampling error in their
            standard error (`RandomBaseline.se`). ``None``, and a padded batch (whose
            sequences keep the baselines they have alone): every edge.
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
            the chunk budget, ``CHUNK_ENTRIES`` numbers on the CPU and on a GPU its memory
            over ``DEVICE_MEMORY_SHARE``, `tl_connwalk.core.isometry`); the results do
            not depend on it.
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
        baseline_draws=baseline_draws, baseline_edges=baseline_edges, seed=seed, exact=exact,
        max_edges=max_edges,
        mass_share=mass_share, query_chunk=query_chunk, memos=[memo],
    )[0]  # fmt: skip


def check_options(options: Mapping[str, object]) -> None:
    """A ConnWalkError naming any of ``options`` that `laplacian_residual` does not take
    (``walk.laplacian_residual(**options)`` passes them on)."""
    taken = [
        name
        for name, parameter in inspect.signature(laplacian_residual).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "memo"
    ]
    unknown = sorted(set(options) - set(taken))
    if unknown:
        raise ConnWalkError(
            f"laplacian_residual takes no option {', '.join(map(repr, unknown))}; its options "
            f"are {', '.join(taken)}."
        )


def check_walks(walks: object) -> None:
    """A ConnWalkError unless ``walks`` is a sequence of walks (`MeasuredWalk`)."""
    if not isinstance(walks, Sequence) or not all(isinstance(w, MeasuredWalk) for w in walks):
        raise ConnWalkError(
            "walks must be a sequence of ConnectionWalk (e.g. [cache.connection_walk(0), "
            f"cache.connection_walk(1)]), got {type(walks).__name__}."
        )


def laplacian_residuals(
    walks: Sequence[MeasuredWalk],
    *,
    mu: Float[Tensor, "batch pos"] | markov.MuOption = "stationary",
    alpha: float = 0.85,
    exclude_sink: bool = False,
    edges: padding.EdgeMask | None = None,
    heads: Sequence[int] | None = None,
    baseline_draws: int = 8,
    baseline_edges: int | None = sampled.BASELINE_EDGES,
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
    (`tl_connwalk.analysis.geometry_table` passes the layers whose gates fit the chunk
    budget). ``memos``: each walk's `Memo` (``None``: a
    fresh one).
    """
    isometry.check_draws(baseline_draws, "baseline_draws")
    sampled.check_baseline_edges(baseline_edges)
    isometry.check_flag(exclude_sink, "exclude_sink")
    isometry.check_flag(exact, "exact")
    check_walks(walks)
    if memos is not None and len(memos) != len(walks):
        raise ConnWalkError(f"memos must give one Memo per walk: {len(memos)} for {len(walks)}.")
    if not walks:
        return []
    chosen = None
    if heads is not None:  # valid for every walk (the same sorted heads for each)
        for walk in walks:
            chosen = core_walk.check_heads(heads, walk.n_heads)
    resolved = [
        _of_heads(walk, chosen, memo)
        for walk, memo in zip(walks, memos or [None] * len(walks), strict=True)
    ]
    _LayerTerms.stack_message_grams(
        Memo.terms_of([walk for walk, _ in resolved], [memo for _, memo in resolved]),
        baseline_draws,
        seed,
        baseline_edges,
    )
    parts = [
        _Parts(walk, memo, exclude_sink, edges, mass_share, baseline_draws, seed, baseline_edges)
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
    pairing = means.pairing
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
    head_base = part.rand.head_defects
    baseline = {"head_defects": RandomBaseline(head_base.to(isometry.working_dtype(head_base)))}
    if means.estimates is None:
        baseline |= {
            name: RandomBaseline(values.to(isometry.working_dtype(values)))
            for name, values in (("transport_defect", transport[1:]), ("field_defect", fields[1:]))
        }
    else:
        dtype = isometry.working_dtype(transport)
        baseline |= {
            name: RandomBaseline(est.value.to(dtype), est.variance.to(dtype), part.sample)
            for name, est in zip(("transport_defect", "field_defect"), means.estimates, strict=True)
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
        pairing=pairing.residual if means.pairs_anywhere else None,
        pairing_applicable=pairing.applicable,
        head_defects=grams.head_defects,
        field_defect=fields[0],
        head_field_defects=means.head_fields,
        baseline=baseline,
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
