"""The random baselines of the walk-weighted defects on a sample of edges (spec §3, "random
baseline").

A draw's transport defect ``(1/n) sum_ij w_ij eps'_ij`` and field defect (the weighted
coefficient of variation of ``rho'_ij``) are summaries of per-edge values under the
summary's own weights ``w`` (`tl_connwalk.core.weighted.edge_weights`). On a long walk each
draw takes them on ``m`` edges drawn with probability ``w_ij / sum w`` (a row in proportion
to its mass, then a key in proportion to its weight in that row), independently for each
draw and sequence:

- transport: ``(sum w / n)`` times the sample mean of ``eps'``: unbiased;
- field: the sample's coefficient of variation (spread with ``m - 1``): biased by
  ``O(1 / m)``.

Beside each estimate, its variance over the sample: ``(sum w / n)^2 s^2 / m`` for the
transport defect, ``mean(psi^2) / m`` for the field defect with ``psi`` its influence
(delta method: ``psi_e = ((rho_e - a)^2 - v) / (2 a sqrt(v)) - sqrt(v) (rho_e - a) / a^2``,
``a`` and ``v`` the sample's mean and variance). The draws are independent, each with its
own sample, so the spread of their estimates over draws holds both the draws' and the
samples' variance (`tl_connwalk.core.baselines.RandomBaseline`).

Only the sampled keys need a draw's message Grams: through the keys' route of
`tl_connwalk.core._fast.draws` restricted to the distinct sampled keys of each sequence
(padded to ``min(m, n)`` distinct keys, so one set of key draws serves every layer), which
is exact in distribution for those keys. The cost per draw no longer grows with ``n^2`` but
with ``m`` (and ``m^2`` for the keys' factor).
"""

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor

from tl_connwalk.core import field_defect, isometry
from tl_connwalk.core._fast import draws as draws_module
from tl_connwalk.core._fast import messages, quartic
from tl_connwalk.core.checks import ratio_defect
from tl_connwalk.errors import ConnWalkError

#: Edges each draw samples per sequence by default (``baseline_edges`` of
#: `tl_connwalk.walk.residual.laplacian_residual`).
BASELINE_EDGES = 64
#: A walk is sampled only when it has more than this many times ``m`` query-key pairs:
#: shorter walks take every edge (the sample would not be much smaller).
SAMPLE_FACTOR = 64


def check_baseline_edges(baseline_edges: object) -> int | None:
    """``baseline_edges`` if it is ``None`` or an integer ``>= 2``, else a ConnWalkError."""
    if baseline_edges is None:
        return None
    if (
        isinstance(baseline_edges, bool)
        or not isinstance(baseline_edges, int)
        or baseline_edges < 2
    ):
        raise ConnWalkError(
            "baseline_edges must be an integer >= 2 (the edges each baseline draw samples per "
            f"sequence) or None (every edge), got {baseline_edges!r}."
        )
    return baseline_edges


def samples(n_query: int, n_key: int, baseline_edges: int | None) -> bool:
    """Whether a walk of ``n_query x n_key`` takes its baselines on a sample of edges."""
    return baseline_edges is not None and n_query * n_key > SAMPLE_FACTOR * baseline_edges


class Estimates(NamedTuple):
    """Each draw's estimate per sequence and its variance over the draw's sample."""

    value: Float[Tensor, "draw batch"]
    variance: Float[Tensor, "draw batch"]


def edge_seed(seed: int) -> int:
    """The generator seed of the edge samples of baseline seed ``seed``."""
    digest = hashlib.blake2b(f"{seed}/baseline edges".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def uniforms(
    generator: torch.Generator, batch: int, n_draws: int, n_edges: int, device: torch.device
) -> Float[Tensor, "four batch sample"]:
    """The uniform numbers of `sample_edges` for two samples (the transport defect's, the
    field defect's) of ``n_edges`` edges per draw and sequence, from ``generator``."""
    return torch.rand(
        4, batch, n_draws * n_edges, dtype=torch.float64, device=device, generator=generator
    )


def sample_edges(
    weights: Float[Tensor, "batch query key"],
    uniform: Float[Tensor, "two batch sample"],
    n_draws: int,
) -> tuple[Int[Tensor, "draw batch edge"], Int[Tensor, "draw batch edge"]]:
    """``n_draws`` samples of edges per sequence, drawn with replacement with probability
    ``w_ij / sum w``: a row in proportion to its mass, then a key in proportion to its weight,
    each by inverting the cumulative weights at ``uniform[0]`` and ``uniform[1]`` (`uniforms`).
    A sequence without mass gets arbitrary edges (its estimates are 0)."""
    batch, n_query, n_key = weights.shape
    cumulative = weights.double().cumsum(-1)  # [batch, query, key]
    row_cumulative = cumulative[..., -1].cumsum(-1)  # [batch, query]
    at = uniform[0] * row_cumulative[:, -1:]
    rows = torch.searchsorted(row_cumulative, at, right=True).clamp_max(n_query - 1)
    seqs = torch.arange(batch, device=weights.device)[:, None]
    in_row = cumulative[seqs, rows]  # [batch, (draw edge), key]
    at = uniform[1] * in_row[..., -1]
    keys = torch.searchsorted(in_row, at[..., None], right=True)[..., 0].clamp_max(n_key - 1)
    shape = (batch, n_draws, -1)
    return rows.view(shape).transpose(0, 1), keys.view(shape).transpose(0, 1)


def _gates_at(gates: Tensor, rows: Tensor, keys: Tensor) -> Float[Tensor, "draw batch edge head"]:
    seqs = torch.arange(gates.shape[0], device=gates.device)[None, :, None]
    return gates[seqs, :, rows, keys].double()


def _scaled_mean(values: Tensor, factor: Tensor) -> Estimates:
    """``factor`` times the sample mean of ``values`` ``[draw, batch, edge]``, with its
    variance over the sample."""
    m = values.shape[-1]
    value = factor * values.mean(-1)
    variance = factor**2 * values.var(-1) / m
    return Estimates(value, variance)


def transport_estimates(
    weights: Float[Tensor, "batch query key"],
    rows_count: Float[Tensor, " batch"],
    gates: Float[Tensor, "batch head query key"],
    K2: Float[Tensor, "draw batch head head"],
    pair_gram: Float[Tensor, "draw batch pair pair"],
    rank: int,
    rows: Int[Tensor, "draw batch edge"],
    keys: Int[Tensor, "draw batch edge"],
) -> Estimates:
    """Each draw's walk-weighted ``eps`` on its sampled edges (`sample_edges` of
    ``weights``, `tl_connwalk.core.weighted.edge_weights` with ``n = rows_count``):
    ``sum sigma^2 = H^2 g^T K2 g``, ``sum sigma^4 = H^4 u^T fold(K4) u`` (spec §3) per edge,
    with each sequence's draws' ``K2`` and folded ``K4``."""
    n_heads = gates.shape[1]
    g = _gates_at(gates, rows, keys)
    first, second = quartic.head_pairs(n_heads, gates.device)
    u = g[..., first] * g[..., second]
    sigma2 = n_heads**2 * einsum(g, K2.double(), g, "d b e a, d b a c, d b e c -> d b e")
    sigma4 = n_heads**4 * einsum(u, pair_gram.double(), u, "d b e p, d b p q, d b e q -> d b e")
    eps = ratio_defect(rank * sigma4 - sigma2**2, rank * sigma4)
    total = weights.double().flatten(1).sum(-1)
    factor = torch.where(rows_count > 0, total / rows_count.double().clamp_min(1.0), 0.0)
    return _scaled_mean(eps, factor[None])


def field_estimates(
    weights: Float[Tensor, "batch query key"],
    gates: Float[Tensor, "batch head query key"],
    ratio_grams: Float[Tensor, "draw batch edge head head"],
    rows: Int[Tensor, "draw batch edge"],
    keys: Int[Tensor, "draw batch edge"],
) -> Estimates:
    """Each draw's weighted coefficient of variation of ``rho`` on its sampled edges, from
    the Grams ``H^2 G_j / ||x_j||^2`` of each edge's key (``rho^2 = g^T (H^2 G_j /
    ||x_j||^2) g``); 0 for a sequence without mass or a zero mean."""
    g = _gates_at(gates, rows, keys)
    rho = einsum(g, ratio_grams.double(), g, "d b e a, d b e a c, d b e c -> d b e")
    rho = rho.clamp_min(0.0).sqrt()
    m = rho.shape[-1]
    mean = rho.mean(-1)
    var = rho.var(-1)
    spread = var.sqrt()
    ok = (mean > 0) & (spread > 0)
    safe_mean, safe_spread = torch.where(ok, mean, 1.0), torch.where(ok, spread, 1.0)
    centred = rho - mean[..., None]
    influence = (centred**2 - var[..., None]) / (2 * safe_mean * safe_spread)[..., None]
    influence = influence - (safe_spread / safe_mean**2)[..., None] * centred
    value = torch.where(mean > 0, spread / safe_mean, 0.0)
    variance = torch.where(ok, influence.square().mean(-1) / m, 0.0)
    has_mass = weights.flatten(1).sum(-1) > 0
    return Estimates(
        torch.where(has_mass[None], value, 0.0), torch.where(has_mass[None], variance, 0.0)
    )


def _distinct_keys(keys: Tensor, n_key: int, width: int) -> tuple[Tensor, Tensor]:
    """Per sequence ``[seq, edge]`` keys: ``width`` distinct keys holding every sampled one
    (the sampled first, then unsampled ones) and where each edge's key lies among them."""
    present = torch.zeros(keys.shape[0], n_key, dtype=torch.bool, device=keys.device)
    present.scatter_(1, keys, True)
    order = torch.argsort((~present).to(torch.int8), dim=1, stable=True)[:, :width]
    where = torch.zeros(keys.shape[0], n_key, dtype=torch.long, device=keys.device)
    where.scatter_(1, order, torch.arange(width, device=keys.device).expand_as(order))
    return order, where.gather(1, keys)


def sampled_message_grams(
    layers: Sequence[draws_module.LayerDraws],
    field: Float[Tensor, "stack batch key d_model"],
    keys: Int[Tensor, "draw seq edge"],
) -> Float[Tensor, "draw seq edge head head"]:
    """Draw ``d``'s ratio Grams ``H^2 G'_j / ||x_j||^2`` at each key ``keys[d, s]`` of
    sequence ``s`` (the layers' sequences one after another, ``seq = stack batch``; the
    layers' heads of one shape, one raw draw set).

    The distinct sampled keys of every draw and sequence (`_distinct_keys`, ``min(m, n)`` of
    them) go through the keys' route (`draws.key_factor`, `draws.key_draws` of that many
    keys: exact in distribution for those keys), all draws in one batched product where the
    draws keep their output-Gram rows, or through the draw's ``R_V`` where the factorisation
    fails; each sequence is then scaled to its layer's head norms.
    """
    raw = layers[0].raw
    if len(layers) != field.shape[0] or any(layer.raw is not raw for layer in layers):
        raise ConnWalkError(
            "sampled draws need one field per layer and the same raw draws (heads of one shape)."
        )
    n_draws, n_heads = raw.grams.norms_sq.shape
    stack, batch, n_key, d_model = field.shape
    n_seq, width = stack * batch, min(keys.shape[-1], n_key)
    owner = torch.arange(stack, device=field.device).repeat_interleave(batch)
    norms_sq = torch.stack([layer.norms_sq for layer in layers])[owner]  # [seq, head]
    scales = torch.stack([layer.scales for layer in layers])[owner]  # [seq, draw, head]
    order, where = _distinct_keys(keys.flatten(0, 1), n_key, width)  # [(draw seq), ...]
    flat = field.flatten(0, 1).repeat(n_draws, 1, 1)
    X = flat[torch.arange(flat.shape[0], device=field.device)[:, None], order]
    grams = X.new_zeros(n_draws, n_seq, width, n_heads, n_heads)
    route = draws_module.key_factor(X, 1, raw.v_shape[0] * raw.v_shape[2])
    direct = torch.ones(n_draws, n_seq, dtype=torch.bool, device=X.device)
    if route is not None and bool(route[1].any()):
        factor, factored = route
        factored = factored.view(n_draws, n_seq)
        factor = torch.where(factored.flatten()[:, None, None], factor, 0.0)
        keyed = draws_module.key_draws(
            raw.v_shape, raw.o_shape, raw.dtype, raw.device, raw.seed, n_draws, width,
            *draws_module._sharing(raw.kv_heads),
        )  # fmt: skip
        values = torch.stack(list(keyed.values()))  # [draw, width, H d_head]
        part = _keyed_grams(factor.view(n_draws, n_seq, width, width), values, raw)
        scale = isometry.draw_scales(norms_sq[None], keyed.norms_sq[:, None])  # [draw, seq, h]
        grams = part * _outer(scale)[:, :, None].to(part)
        direct = ~factored
    if bool(direct.any()):
        X = X.view(n_draws, n_seq, width, d_model)
        out_rows = raw.grams.out_rows
        for d, (R_V, R_O) in enumerate(raw.factors()):
            if bool(direct[d].any()):
                rows = None if out_rows is None else out_rows[d]
                part = field_defect.message_grams(X[d, direct[d]], R_V, R_O, out_rows=rows)
                grams[d, direct[d]] = part * _outer(scales[direct[d], d])[:, None].to(part)
            del R_V, R_O
    grams = field_defect._ratio_grams(grams, X.view(n_draws, n_seq, width, d_model))
    grams = grams.flatten(0, 1)
    picked = grams[torch.arange(grams.shape[0], device=grams.device)[:, None], where]
    return picked.view(n_draws, n_seq, -1, n_heads, n_heads)


def _keyed_grams(
    factor: Float[Tensor, "draw seq key key"],
    values: Float[Tensor, "draw key head_d_head"],
    raw: draws_module.RawDraws,
) -> Float[Tensor, "draw seq key head head"]:
    """The raw message Grams of the values ``factor[d, s] @ values[d]``: every draw at once
    through the draws' output-Gram rows where they keep them, else one draw at a time
    through its ``R_O``."""
    n_draws, n_seq, _, rank = factor.shape
    n_heads = raw.v_shape[0]
    d_head = values.shape[-1] // n_heads
    out_rows = raw.grams.out_rows
    if out_rows is None:
        return torch.stack(
            [
                messages.stacked_factored_grams(factor[d], values[d][None], n_heads, W_O=R_O)[0]
                for d, (_, R_O) in enumerate(raw.factors())
            ]
        )

    def head_values(block: slice) -> Tensor:
        """``[draw, head, (seq rows), d_head]``: each draw's values of its sequences' rows."""
        rows = factor[:, :, block].reshape(n_draws, -1, rank)
        v = torch.bmm(rows, values).view(n_draws, rows.shape[1], n_heads, d_head)
        return v.transpose(1, 2).contiguous()

    return messages._paired_grams(
        head_values, factor[0, 0], (n_draws, n_seq), (n_heads, d_head), out_rows
    )


def _outer(scale: Tensor) -> Tensor:
    return scale[..., :, None] * scale[..., None, :]
