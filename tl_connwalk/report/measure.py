"""The report's measurements: one forward pass, then every layer's walk, residuals and identity.

Per analysed layer: the identity check ``max|apply() + bias() - attention output| /
max|output|`` (spec §1.2), `laplacian_residual` with the sink kept and
with it excluded (spec §3-4), the baselines the residual does not carry (`uniform_reversibility`
for (C2), `pairing_baseline` for the pairing where it applies) and the walk matrix of the
heatmap layers; over all layers the layer drift (spec §3). `summary_frame` folds the residuals
into one row per layer, the table the terminal, the figures and the HTML page show.
"""

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformer_lens import ActivationCache

from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.analysis import layer_drift
from tl_connwalk.cache import connection_walk, required_hooks
from tl_connwalk.core import markov
from tl_connwalk.core.baselines import RandomBaseline, random_baselines
from tl_connwalk.walk import ConnectionWalk
from tl_connwalk.walk.residual import LaplacianResidual


@dataclasses.dataclass(frozen=True)
class LayerMeasurement:
    """One layer of the report: its processing, identity error, both laplacian residuals and
    the baselines they do not carry.

    ``uniform_reversibility`` ``[batch]``: `uniform_reversibility` of the layer's walk, the
    reversibility baseline. ``pairing_baseline``: `pairing_baseline` with the sink kept
    (``"with_sink"``) and excluded (``"without_sink"``); empty where no walk has an edge
    both ways (causal walks: the pairing does not apply).
    """

    layer: int
    processing: dict[str, bool]
    identity_error: float
    with_sink: LaplacianResidual
    without_sink: LaplacianResidual
    uniform_reversibility: Tensor
    pairing_baseline: dict[str, RandomBaseline]

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "processing": dict(self.processing),
            "identity_error": self.identity_error,
            "laplacian_residual": {
                "with_sink": self.with_sink.to_dict(),
                "without_sink": self.without_sink.to_dict(),
            },
            "reversibility_uniform_walk": self.uniform_reversibility.tolist(),
            "pairing_baseline": {
                name: base.to_dict() for name, base in self.pairing_baseline.items()
            },
        }


@dataclasses.dataclass(frozen=True)
class Measurements:
    """Everything computed from one cache (numpy arrays are batch element 0 or batch means)."""

    layers: list[LayerMeasurement]
    walks: dict[int, np.ndarray]
    drift: dict[str, np.ndarray]


def _has_ln1_post(model: nn.Module) -> bool:
    return bool(getattr(model.cfg, "use_normalization_before_and_after", False))


def output_hook(model: nn.Module, layer: int) -> str | None:
    """The hook holding layer ``layer``'s attention output, ``None`` where none does.

    ``blocks.{l}.attn.o.hook_out`` on the Bridge; ``blocks.{l}.hook_attn_out`` on
    ``HookedTransformer``/``HookedEncoder`` unless the model normalises after attention
    (``ln1_post``), where the output is captured from the attention module instead.
    """
    if is_bridge(model):
        return f"blocks.{layer}.attn.o.hook_out"
    return None if _has_ln1_post(model) else f"blocks.{layer}.hook_attn_out"


@contextlib.contextmanager
def _module_outputs(model: nn.Module, layers: Sequence[int]) -> Iterator[dict[int, Tensor]]:
    # the attention module's own output, before ln1_post (no hook point holds it)
    outputs: dict[int, Tensor] = {}
    handles = []
    if not is_bridge(model) and _has_ln1_post(model):
        for layer in layers:
            attn = model.blocks[layer].attn  # type: ignore[index, union-attr]
            handles.append(
                attn.register_forward_hook(
                    lambda _m, _a, out, layer=layer: outputs.__setitem__(layer, out.detach())
                )
            )
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def run_cache(
    model: nn.Module, tokens: Tensor, layers: Sequence[int]
) -> tuple[ActivationCache, dict[int, Tensor]]:
    """One forward pass keeping only the walks' hooks and the attention outputs of ``layers``."""
    names = list(required_hooks(model))
    names += [hook for layer in layers if (hook := output_hook(model, layer)) is not None]
    with torch.no_grad(), _module_outputs(model, layers) as captured:
        _, cache = model.run_with_cache(tokens, names_filter=names)  # type: ignore[operator]
    outputs = {}
    for layer in layers:
        hook = output_hook(model, layer)
        outputs[layer] = cache[hook] if hook is not None else captured[layer]
    return cache, outputs


def identity_error(rebuilt: Tensor, reference: Tensor) -> float:
    """``max|rebuilt - reference| / max|reference|`` in float64 (0 for a zero output)."""
    rebuilt, reference = rebuilt.double(), reference.double()
    scale = reference.abs().max().item()
    error = (rebuilt - reference).abs().max().item()
    return error / scale if scale > 0 else error


def uniform_reversibility(walk: ConnectionWalk) -> Tensor:
    """``[batch]``: the reversibility residual (C2) of the uniform walk on ``walk``'s edges.

    Each query's mass spread evenly over its keys, ``U_ij = [W_ij > 0] / #{k: W_ik > 0}``
    between real positions, measured as the report measures ``W`` (``mu`` its stationary
    distribution, or uniform where it has none, spec §3). The transports do not enter (C2),
    so random transports give no baseline for it; this one says how far from detailed balance
    the edges alone put a walk: a causal walk's edges keep it far, a walk on every pair of
    positions is reversible (0).

    >>> uniform_reversibility(walk).shape
    torch.Size([2])
    """
    edges = walk.edges().to(walk.walk.dtype)
    uniform = edges / edges.sum(-1, keepdim=True).clamp_min(1.0)
    return markov.reversibility_residual(uniform, positions=walk.attention_mask).residual


def pairing_baseline(
    walk: ConnectionWalk, *, exclude_sink: bool, draws: int, seed: int
) -> RandomBaseline:
    """The pairing residual (C3) of ``walk``'s walk and gates with random transports.

    The random factors of `tl_connwalk.core.baselines.random_baselines` (same shapes,
    value-head sharing and head norms; ``draws`` of them from ``seed``), on the walk's own
    edges and ``exclude_sink`` (spec §3): what the pairing is when nothing pairs the
    transports.
    """
    bases = random_baselines(
        {
            "pairing": lambda W_V, W_O: (
                markov.pairing_residual(
                    walk.walk, walk.gates, W_V, W_O, exclude_sink=exclude_sink, edges=walk.edges()
                ).residual
            )
        },
        walk.W_V,
        walk.W_O,
        draws,
        seed=seed,
        kv_heads=walk.kv_heads,
    )
    return bases["pairing"]


def measure(
    cache: ActivationCache,
    outputs: dict[int, Tensor],
    layers: Sequence[int],
    heatmap_layers: Sequence[int],
    *,
    baseline_draws: int,
    seed: int,
    progress: bool = True,
    attention_mask: Tensor | None = None,
) -> Measurements:
    """Identity errors, both laplacian residuals and heatmap walks for ``layers``.

    ``attention_mask`` ``[batch, pos]``: the padding of a padded batch (else read off the
    cache, `tl_connwalk.cache.connection_walk`); each sequence is measured as if alone.
    """
    records: list[LayerMeasurement] = []
    walks: dict[int, np.ndarray] = {}
    for layer in tqdm(layers, desc="residuals", disable=not progress):
        walk = connection_walk(cache, layer, attention_mask=attention_mask)
        options = {"baseline_draws": baseline_draws, "seed": seed}
        with_sink = walk.laplacian_residual(exclude_sink=False, **options)
        pairing = {}
        if with_sink.pairing is not None:  # some sequence has an edge both ways
            pairing = {
                name: pairing_baseline(walk, exclude_sink=exclude, draws=baseline_draws, seed=seed)
                for name, exclude in (("with_sink", False), ("without_sink", True))
            }
        records.append(
            LayerMeasurement(
                layer=layer,
                processing=dict(walk.processing),
                identity_error=identity_error(walk.apply() + walk.bias(), outputs[layer]),
                with_sink=with_sink,
                without_sink=walk.laplacian_residual(exclude_sink=True, **options),
                uniform_reversibility=uniform_reversibility(walk),
                pairing_baseline=pairing,
            )
        )
        if layer in heatmap_layers:
            walks[layer] = walk.walk[0].float().cpu().numpy()
    drift = {
        name: layer_drift(cache, exclude_sink=exclude, attention_mask=attention_mask)
        .mean(0)
        .cpu()
        .numpy()
        for name, exclude in (("with_sink", False), ("without_sink", True))
    }
    return Measurements(records, walks, drift)


def _mean(value: Tensor | None) -> float:
    return math.nan if value is None else float(value.float().mean())


def _defects(res: LaplacianResidual, name: str, value: Tensor, suffix: str) -> dict[str, float]:
    base = res.baseline[name]
    column = {"head_defects": "head_defect"}.get(name, name) + suffix
    return {
        column: _mean(value),
        f"{column}_baseline": _mean(base.mean),
        f"{column}_baseline_std": _mean(base.std),
        f"{column}_baseline_se": _mean(base.se),
    }


def summary_frame(measurements: Measurements) -> pd.DataFrame:
    """One row per analysed layer (batch means); ``*_nosink`` columns exclude key 0.

    Columns: ``layer``, ``identity_error``, ``stochasticity``, ``reversibility`` with
    ``reversibility_baseline`` (`uniform_reversibility`), ``mu``, ``pairing`` (NaN: not
    applicable) with ``pairing_baseline`` and ``pairing_baseline_std`` (`pairing_baseline`),
    ``head_defect`` (mean over heads; ``_min``, ``_max``), ``transport_defect``,
    ``field_defect``, ``scale``, ``drift_to_next``, each defect with ``_baseline``,
    ``_baseline_std`` (random transports: their mean and spread) and ``_baseline_se`` (its
    standard error, `RandomBaseline.se`; batch means, as every column), and the walk-weighted
    ones again as ``*_nosink``.
    """
    n_transitions = len(measurements.drift["with_sink"])
    rows = []
    for record in measurements.layers:
        r0, r1 = record.with_sink, record.without_sink
        has_next = record.layer < n_transitions
        row: dict[str, Any] = {
            "layer": record.layer,
            "identity_error": record.identity_error,
            "stochasticity": _mean(r0.stochasticity),
            "reversibility": _mean(r0.reversibility),
            "reversibility_baseline": _mean(record.uniform_reversibility),
            "mu": ",".join(sorted(set(r0.mu_kind))),
            "pairing": _mean(r0.pairing),
            "pairing_nosink": _mean(r1.pairing),
            "head_defect_min": float(r0.head_defects.min()),
            "head_defect_max": float(r0.head_defects.max()),
            "scale": _mean(r0.scale),
            "scale_nosink": _mean(r1.scale),
            "drift_to_next": (
                float(measurements.drift["with_sink"][record.layer]) if has_next else math.nan
            ),
            "drift_to_next_nosink": (
                float(measurements.drift["without_sink"][record.layer]) if has_next else math.nan
            ),
        }
        for name, suffix in (("with_sink", ""), ("without_sink", "_nosink")):
            base = record.pairing_baseline.get(name)
            row[f"pairing{suffix}_baseline"] = _mean(None if base is None else base.mean)
            row[f"pairing{suffix}_baseline_std"] = _mean(None if base is None else base.std)
            row[f"pairing{suffix}_baseline_se"] = _mean(None if base is None else base.se)
        row |= _defects(r0, "head_defects", r0.head_defects, "")
        for res, suffix in ((r0, ""), (r1, "_nosink")):
            row |= _defects(res, "transport_defect", res.transport_defect, suffix)
            row |= _defects(res, "field_defect", res.field_defect, suffix)
        rows.append(row)
    return pd.DataFrame(rows)


def head_frame(measurements: Measurements) -> pd.DataFrame:
    """One row per ``(layer, head)``: ``head_defect`` and its random baseline's mean, spread
    (``_std``) and standard error (``_se``)."""
    rows = []
    for record in measurements.layers:
        base = record.with_sink.baseline["head_defects"]
        for head, value in enumerate(record.with_sink.head_defects.tolist()):
            rows.append(
                {
                    "layer": record.layer,
                    "head": head,
                    "head_defect": value,
                    "head_defect_baseline": float(base.mean[head]),
                    "head_defect_baseline_std": float(base.std[head]),
                    "head_defect_baseline_se": float(base.se[head]),
                }
            )
    return pd.DataFrame(rows)
