"""Tables over layers: layer drift and the tidy geometry table of a cache (spec §3, 5).

Each function reads one cache and walks its layers with a progress bar; the per-layer work is
`tl_connwalk.walk.residual` and the math core.
"""

import itertools
from collections.abc import Iterable, Mapping, Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import ActivationCache

from tl_connwalk.cache import connection_walks, layers_of, n_layers_of, walk_matrix
from tl_connwalk.core import markov, padding
from tl_connwalk.core.caches import sampled
from tl_connwalk.core.checks import check_draws, check_flag
from tl_connwalk.core.isometry import query_chunks
from tl_connwalk.core.walk import check_heads
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk
from tl_connwalk.walk.residual import LaplacianResidual


def layer_drift(
    cache: ActivationCache,
    *,
    exclude_sink: bool = False,
    attention_mask: Tensor | None = None,
    edges: padding.EdgeMask | None = None,
    heads: Sequence[int] | None = None,
) -> Float[Tensor, "batch transition"]:
    """``(1/n) sum_i TV(W^l_i., W^{l+1}_i.)`` for every pair of consecutive layers (spec §3).

    ``[batch, n_layers - 1]``; column ``l`` compares layer ``l`` with ``l + 1``. With
    ``exclude_sink`` each sequence's first real key is removed and rows renormalised before
    comparing. Reads only the patterns (`tl_connwalk.cache.walk_matrix`) and holds two
    layers' walks (``2 batch n^2`` numbers) at a time.

    A padded batch (``attention_mask`` ``[batch, pos]``, or padding read off the patterns as
    in `tl_connwalk.cache.connection_walk`) compares only the rows and keys of real tokens,
    so each sequence's drift is its drift alone. ``edges`` (an edge mask as in
    `tl_connwalk.walk.residual.laplacian_residual`) compares only those edges, rows renormalised
    over them; ``heads`` compares the walks of those heads alone (the same heads in every
    layer).

    >>> tl_connwalk.layer_drift(cache).shape  # two layers: one transition
    torch.Size([2, 1])
    """
    n_layers = n_layers_of(cache)
    # a generator: pairwise holds two layers' walks at a time, never all of them
    walks = (
        _padded(walk_matrix(cache, layer, heads=heads), layer, attention_mask)
        for layer in range(n_layers)
    )
    drifts = [
        _drift(before, after, exclude_sink, edges) for before, after in itertools.pairwise(walks)
    ]
    if not drifts:
        first = walk_matrix(cache, 0)
        return torch.zeros(first.shape[0], 0, dtype=first.dtype, device=first.device)
    return torch.stack([d.to(drifts[0].device) for d in drifts], dim=-1)


_Padded = tuple[Tensor, Tensor | None, int]


def _padded(walk: Tensor, layer: int, attention_mask: Tensor | None) -> _Padded:
    """A layer's walk with its real positions (`padding.positions_of`) and its index."""
    return walk, padding.positions_of(walk, attention_mask), layer


def _drift(
    before: _Padded, after: _Padded, exclude_sink: bool, edges: padding.EdgeMask | None
) -> Tensor:
    """`markov.layer_drift` of two consecutive layers over the edges both keep."""
    (walk_a, real_a, layer_a), (walk_b, real_b, layer_b) = before, after
    if (real_a is None) != (real_b is None) or (
        real_a is not None and real_b is not None and not torch.equal(real_a, real_b.to(real_a))
    ):
        raise ConnWalkError(
            f"layers {layer_a} and {layer_b} disagree on which positions are padding (read "
            "off their patterns): pass the attention_mask the model ran with."
        )
    mask, drop_sink = padding.scope(real_a, edges, exclude_sink, walk_a.shape, walk_a.device)
    return markov.layer_drift(walk_a, walk_b, exclude_sink=drop_sink, edges=mask)


def _drifts(
    pairs: Sequence[tuple[_Padded, _Padded]],
    exclude_sink: bool,
    edges: padding.EdgeMask | None,
) -> list[Tensor]:
    """`_drift` of several pairs of layers of one cache, their walks side by side along the
    batch axis in one `markov.layer_drift` (operations that do not grow with the number of
    pairs) where every layer has the same padding and device; else pair by pair (which names
    the pair whose layers disagree)."""
    devices = {padded[0].device for pair in pairs for padded in pair}
    if len(pairs) < 2 or len(devices) > 1:  # one pair, or a model split over devices
        return [_drift(before, after, exclude_sink, edges) for before, after in pairs]
    reals = [padded[1] for pair in pairs for padded in pair]
    first, given = reals[0], [real for real in reals if real is not None]
    if first is None:
        same = not given
    else:
        same = len(given) == len(reals) and bool(
            (torch.stack([real.to(first) for real in given]) == first).all()
        )
    if not same:
        return [_drift(before, after, exclude_sink, edges) for before, after in pairs]
    walk_a = torch.cat([before[0] for before, _ in pairs])
    walk_b = torch.cat([after[0].to(walk_a.device) for _, after in pairs])
    shape = pairs[0][0][0].shape
    mask, drop_sink = padding.scope(first, edges, exclude_sink, shape, walk_a.device)
    if mask is not None:
        mask = mask.repeat(len(pairs), 1, 1)
    drift = markov.layer_drift(walk_a, walk_b, exclude_sink=drop_sink, edges=mask)
    return list(drift.view(len(pairs), shape[0]).unbind())


def geometry_table(
    cache: ActivationCache,
    layers: Iterable[int] | None = None,
    *,
    exclude_sink: bool = False,
    baseline_draws: int = 8,
    baseline_edges: int | None = sampled.BASELINE_EDGES,
    seed: int = 0,
    progress: bool = True,
    residuals: Mapping[int, LaplacianResidual] | None = None,
    attention_mask: Tensor | None = None,
    edges: padding.EdgeMask | None = None,
    heads: Sequence[int] | None = None,
) -> pd.DataFrame:
    """One tidy table of a cache's connection-walk geometry, averaged over the batch.

    A row per ``(layer, head)`` with ``head`` a head index or ``"all"`` (the layer's walk);
    columns: ``stochasticity``, ``reversibility``, ``mu_kind``, ``transport_defect`` (eps of
    the effective transports), ``scale``, ``pairing`` (NaN for causal walks: not applicable),
    ``field_defect``, ``head_defect`` (delta of ``T^h``; on ``"all"`` rows the mean over heads),
    ``drift_to_next`` (layer drift to the next layer; needs that layer's hooks too), and for
    each defect its random baseline ``<name>_baseline``, the spread of the random draws
    ``<name>_baseline_std`` and the standard error of the baseline ``<name>_baseline_se``
    (`tl_connwalk.core.baselines.RandomBaseline`: over the draws and, on long walks, the
    sample of edges each draw takes, ``baseline_edges``). Values are batch means (and on
    ``"all"`` rows means over heads), the standard errors too: each at most the standard error
    of the mean it stands beside.
    ``residuals`` (layer -> `LaplacianResidual` of this cache, with the
    same ``exclude_sink``, ``edges`` and ``heads``) reuses residuals already computed instead
    of measuring again.

    ``layers``: the layers measured, in that order (default every layer; negative counts from
    the end).

    ``attention_mask`` ``[batch, pos]`` marks the padding of a padded batch (else it is read
    off the cache, `tl_connwalk.cache.connection_walk`): each sequence counts as if it ran
    alone. ``edges`` (an edge mask, see `tl_connwalk.walk.residual.laplacian_residual`) and
    ``heads`` (the walk of those heads alone, the same heads in every layer; the ``head``
    rows are those heads) scope every walk-weighted column and the drift.

    The layers are measured in groups with their work stacked
    (`ConnectionWalk.laplacian_residuals`: the operations, on a GPU the kernel launches, grow
    little with the number of layers): as many layers at once as hold
    ``tl_connwalk.core.isometry.CHUNK_ENTRIES`` numbers of gates, fields and message Grams on
    the CPU, the GPU's memory over ``DEVICE_MEMORY_SHARE`` on a GPU (at least one), so memory
    holds a group's walks and message Grams, their stacked copies and the next layer's walk.

    >>> table = tl_connwalk.geometry_table(cache, progress=False)
    >>> table[table["head"] == "all"][["layer", "transport_defect", "transport_defect_baseline"]]
       layer  transport_defect  transport_defect_baseline
    ...
    """
    n_layers = n_layers_of(cache)
    chosen = layers_of(cache, layers)
    check_draws(baseline_draws, "baseline_draws")
    check_flag(progress, "progress")
    if residuals is not None and not (
        isinstance(residuals, Mapping)
        and all(isinstance(res, LaplacianResidual) for res in residuals.values())
    ):
        raise ConnWalkError(
            "residuals must map layers to the LaplacianResidual of each (e.g. "
            f"{{0: cache.laplacian_residual(0)}}), got {type(residuals).__name__}."
        )
    rows = []
    walks: dict[int, ConnectionWalk] = {}
    names: dict[int, tuple[int, ...]] = {}  # the heads measured, per layer

    def build(layers: Sequence[int]) -> None:
        # consecutive layers share walks (drift to the next); build each one once, those of a
        # group together (their padding read at once)
        missing = [layer for layer in dict.fromkeys(layers) if layer not in walks]
        built = connection_walks(cache, missing, attention_mask=attention_mask)
        for layer, walk in zip(missing, built, strict=True):
            if heads is not None:
                names[layer] = check_heads(heads, walk.n_heads)
                walk = walk.of_heads(heads)
            walks[layer] = walk

    def walk_of(layer: int) -> ConnectionWalk:
        build([layer])
        return walks[layer]

    def padded_of(layer: int) -> _Padded:
        walk = walk_of(layer)
        return walk.walk, walk.attention_mask, layer

    def given(layer: int) -> LaplacianResidual | None:
        if residuals is None or layer not in residuals:
            return None
        res = residuals[layer]
        if (
            res.exclude_sink != exclude_sink
            or res.edges_masked != (edges is not None)
            or res.heads != names.get(layer)
        ):
            raise ConnWalkError(
                f"residuals[{layer}] has exclude_sink={res.exclude_sink}, "
                f"{'an' if res.edges_masked else 'no'} edge mask and heads={res.heads}, the "
                f"table exclude_sink={exclude_sink}, {'an' if edges is not None else 'no'} "
                f"edge mask and heads={names.get(layer)}: pass residuals measured the same way."
            )
        return res

    bar = tqdm(total=len(chosen), desc="geometry", disable=not progress)
    # the layers measured together (`ConnectionWalk.laplacian_residuals`: their per-edge work
    # stacked): as many as hold the chunk budget in gates, fields and message Grams (the
    # layer's and its draws', and their stacked copies), at least one
    first = walk_of(chosen[0]) if chosen else None
    per_layer, device = 1, None
    if first is not None:
        batch, n_heads, n_query, _ = first.gates.shape
        grams = (2 + baseline_draws) * batch * n_query * n_heads**2
        per_layer = first.gates.numel() + first.field.numel() + grams
        device = first.gates.device
    for group in query_chunks(len(chosen), per_layer, device=device):
        group_layers = chosen[group]
        for layer in [*walks]:  # no longer needed: keep memory at the group and the next layer
            if layer not in group_layers:
                walks.pop(layer)
        build([*group_layers, *[layer + 1 for layer in group_layers if layer + 1 < n_layers]])
        found = {layer: given(layer) for layer in group_layers}
        measure = [layer for layer in group_layers if found[layer] is None]
        measured = ConnectionWalk.laplacian_residuals(
            [walk_of(layer) for layer in measure], exclude_sink=exclude_sink, edges=edges,
            baseline_draws=baseline_draws, baseline_edges=baseline_edges, seed=seed,
        )  # fmt: skip
        results = {layer: res for layer, res in found.items() if res is not None}
        results |= dict(zip(measure, measured, strict=True))
        # the drift to the next layer, for every layer of the group that has one, at once
        drifting = [layer for layer in group_layers if layer + 1 < n_layers]
        drifts = _drifts(
            [(padded_of(layer), padded_of(layer + 1)) for layer in drifting],
            exclude_sink,
            edges,
        )
        drift_of = dict(zip(drifting, drifts, strict=True))
        for layer in group_layers:
            rows += _layer_rows(layer, results[layer], drift_of.get(layer), names.get(layer))
            bar.update()
    bar.close()
    return pd.DataFrame(rows)


def _layer_rows(
    layer: int, res: LaplacianResidual, drift: Tensor | None, heads: Sequence[int] | None
) -> list[dict[str, object]]:
    """The table's rows of one layer: its walk's (``"all"``) and each head's, every value
    read off the device in one transfer."""
    base = res.baseline
    shared = {
        "stochasticity": res.stochasticity,
        "reversibility": res.reversibility,
        "scale": res.scale,
        "pairing": res.pairing,
        "drift_to_next": drift,
    }
    walk_only = {
        "transport_defect": res.transport_defect,
        "transport_defect_baseline": base["transport_defect"].mean,
        "transport_defect_baseline_std": base["transport_defect"].std,
        "transport_defect_baseline_se": base["transport_defect"].se,
        "field_defect": res.field_defect,
        "field_defect_baseline": base["field_defect"].mean,
        "field_defect_baseline_std": base["field_defect"].std,
        "field_defect_baseline_se": base["field_defect"].se,
    }
    heads_base = base["head_defects"]
    per_head = torch.stack([res.head_defects, heads_base.mean, heads_base.std, heads_base.se]).to(
        res.transport_defect
    )
    head_field = res.head_field_defects.mean(0).to(per_head)
    batch_values = {name: v for name, v in (shared | walk_only).items() if v is not None}
    batch_means = torch.stack([v.to(per_head) for v in batch_values.values()]).mean(1)
    over_heads = per_head.mean(1)
    flat = torch.cat([batch_means, over_heads, per_head.flatten(), head_field]).tolist()
    means = dict(zip(batch_values, flat, strict=False))
    n_batch, n_heads = len(batch_values), per_head.shape[1]
    head_names = (
        "head_defect", "head_defect_baseline", "head_defect_baseline_std",
        "head_defect_baseline_se",
    )  # fmt: skip
    walk_heads = dict(zip(head_names, flat[n_batch : n_batch + 4], strict=True))
    columns = flat[n_batch + 4 :]  # the per-head values, then each head's field defect
    by_head = [columns[index::n_heads] for index in range(n_heads)]
    common: dict[str, object] = {
        "layer": layer,
        "stochasticity": means["stochasticity"],
        "reversibility": means["reversibility"],
        "mu_kind": ",".join(sorted(set(res.mu_kind))),
        "scale": means["scale"],
        "pairing": means.get("pairing", float("nan")),
        "drift_to_next": means.get("drift_to_next", float("nan")),
    }
    rows = [common | {"head": "all"} | {name: means[name] for name in walk_only} | walk_heads]
    for head, values in zip(heads or range(n_heads), by_head, strict=True):
        rows.append(
            common | {"head": head} | dict(zip((*head_names, "field_defect"), values, strict=True))
        )
    return rows
