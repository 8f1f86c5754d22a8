"""The stacked per-edge work of `tl_connwalk.walk.residual.laplacian_residuals`.

`_Parts`: what the work needs of one walk. `_grouped`: the walks that stack (equal
`_Parts.key`), measured group by group. `_stacked_means`: one group's transport defects in one
pass over their stacked gates, field defects, pairing residuals and Markov conditions with the
walks side by side.
`_Means`: one walk's results, which `tl_connwalk.walk.residual` finishes into its
`LaplacianResidual`.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core import field_defect, isometry, markov, padding, weighted
from tl_connwalk.core.caches import sampled
from tl_connwalk.walk._layer_terms import MeasuredWalk, Memo


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
        baseline_edges: int | None = None,
    ) -> None:
        self.walk, self.memo = walk, memo
        self.n_draws, self.seed = n_draws, seed
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
        self.rand = self.terms.layer_draws(n_draws, seed)
        #: the draws' defects on a sample of edges (`sampled`), or with the layer's on all
        n_query, n_key = W.shape[-2:]
        # a padded batch takes every edge: its sequences' baselines are then those they have
        # alone (their samples would not be)
        sampling = walk.attention_mask is None and sampled.samples(n_query, n_key, baseline_edges)
        self.sample = baseline_edges if sampling else None
        if self.sample is not None:
            self.K2, self.pair_gram = grams.K2[None], grams.pair_gram[None]
            self.message_grams = self.terms.message_grams[None]
            return
        # the layer and its random draws (shared by every layer of this shape) as one family
        # each, by their head Grams and by their message Grams
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
            self.sample,
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
    pairing: markov.PairingResidual
    pairs_anywhere: bool  # whether any sequence has a pairing (an edge both ways)
    # the draws' transport and field defects on their samples of edges (`sampled`), if any
    estimates: tuple[sampled.Estimates, sampled.Estimates] | None = None


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
    """The transport defects and pairing residuals of stackable walks (the families') in one
    pass over their stacked gates; the field defects (of the families, and per head), the
    Markov conditions with the walks side by side as one batch of sequences."""
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
    pairing = markov.pairing_residuals(
        W, g, [(p.terms.W_V, p.terms.W_O) for p in parts], exclude_sink=first.drop_sink,
        query_chunk=query_chunk, edges=scoped,
    )  # fmt: skip
    anywhere = torch.stack([p.applicable.any() for p in pairing]).tolist()
    batch = first.W.shape[0]
    estimates: Sequence[tuple[sampled.Estimates, sampled.Estimates] | None] = [None] * count
    if first.sample is not None:
        estimates = _sampled_baselines(parts, walks, gates, X, edges)
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
            pairing[k],
            anywhere[k],
            estimates[k],
        )
        for k in range(count)
    ]


def _sampled_baselines(
    parts: list[_Parts],
    walks: Float[Tensor, "seq query key"],
    gates: Float[Tensor, "seq head query key"],
    field: Float[Tensor, "seq key d_model"],
    scoped: Tensor | None,
) -> list[tuple[sampled.Estimates, sampled.Estimates]]:
    """The draws' transport and field defects of stackable walks on samples of edges
    (`tl_connwalk.core._fast.sampled`), the walks side by side as one batch of sequences
    (``walks``, ``gates``, ``field`` and the ``scoped`` edges of `_stacked_means`): each walk's
    edges drawn from its own summary weights with the same uniform numbers whatever the group
    (a walk's estimates are the same alone or in a group), the rest in one pass for all."""
    first, count = parts[0], len(parts)
    n_draws, m = first.n_draws, first.sample
    assert m is not None
    batch = first.W.shape[0]
    # every walk's own numbers: one seed for all (the call's), so one draw of them, repeated
    generator = torch.Generator(device=walks.device).manual_seed(sampled.edge_seed(first.seed))
    uniform = sampled.uniforms(generator, batch, n_draws, m, walks.device).repeat(1, count, 1)
    kept = _stacked_masks([p.scoped if p.kept is None else p.kept for p in parts])
    weights_t, rows_t = weighted.edge_weights(
        walks, first.drop_sink, None if kept is None else kept.flatten(0, 1)
    )
    sent = field_defect._sent(field, walks.shape)
    if scoped is not None:
        sent = scoped if sent is None else sent & scoped
    weights_f, _ = weighted.edge_weights(walks, first.drop_sink, sent)
    rows_f, keys_f = sampled.sample_edges(weights_f, uniform[2:], n_draws)
    grams = sampled.sampled_message_grams(
        [part.rand for part in parts], field.unflatten(0, (count, batch)), keys_f
    )
    field_est = sampled.field_estimates(weights_f, gates, grams, rows_f, keys_f)

    def per_sequence(tensors: list[Tensor]) -> Tensor:
        """``[draw, ...]`` of each walk as ``[draw, (stack batch), ...]``."""
        return torch.stack(tensors, 1).repeat_interleave(batch, dim=1)

    transport_est = sampled.transport_estimates(
        weights_t, rows_t, gates, per_sequence([p.rand.K2 for p in parts]),
        per_sequence([p.rand.pair_gram for p in parts]), first.terms.rank,
        *sampled.sample_edges(weights_t, uniform[:2], n_draws),
    )  # fmt: skip

    def of_walk(est: sampled.Estimates, k: int) -> sampled.Estimates:
        return sampled.Estimates(*(t.unflatten(1, (count, batch))[:, k] for t in est))

    return [(of_walk(transport_est, k), of_walk(field_est, k)) for k in range(count)]
