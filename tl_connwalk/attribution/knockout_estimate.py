"""``method="knockout_estimate"``: knockout and edge blocking predicted from one backward pass
(spec §7).

One forward pass of the real model (nothing frozen) records every head's pattern ``A`` and
values ``v``, and one backward pass gives the target's gradient ``g`` at every head output
``hook_z`` (through a zero probe added there).
`tl_connwalk.attribution.blocking.edge_effects` turns them into the predicted effect of
blocking each edge, ``k^{l,h}_ij = - g_i . dz_ij`` with the exact, renormalised change ``dz`` of
the head's output; summed over layers, heads and queries, the predicted knockout of each source,
``k_j``. On a ``HookedTransformer`` or ``HookedEncoder`` the backward pass recomputes one block
at a time (`frozen.recomputing_blocks`), so the graph holds one block's activations, and each
layer's edges are made as its gradient arrives.

Beyond first order, the sources in ``exact`` (per sequence: a few positions, knocked out for
real) get knockout's own value; what that adds to their first-order sum is the ``remainder``,
kept beside the edges so that an edge keeps meaning "what blocking this edge would do".
Knockout runs are made once per distinct sequence of the batch and read for every target on it;
in a causal ``HookedTransformer`` without padding each recomputes only the positions after the
blocked key, from the clean run's keys and values (`kv_prefix`).
"""

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from torch.nn import functional as F

from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.attribution import baselines, blocking, kv_prefix, targets
from tl_connwalk.attribution.frozen import (
    HookFn,
    config,
    constant_weights,
    mask_kwargs,
    recomputing_blocks,
    run_until,
)
from tl_connwalk.errors import ConnWalkError


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the method returns.

    Attributes:
        target: the resolved target.
        clean: ``[batch]`` the target in the clean run.
        edges: ``[layer, batch, head, query, key]`` the first-order effect of blocking each edge
            (0 in layers after a target read inside the network).
        first_order: ``[batch, source]`` the edges summed over layers, heads and queries.
        remainder: ``[batch, source]`` knockout minus ``first_order`` where a source was knocked
            out for real (``exact``), else 0.
        exact: ``[batch, source]`` the sources knocked out for real.
        measurable: ``[batch, source]`` the sources whose knockout can change the target.
    """

    target: targets.Target
    clean: Float[Tensor, " batch"]
    edges: Float[Tensor, "layer batch head query key"]
    first_order: Float[Tensor, "batch source"]
    remainder: Float[Tensor, "batch source"]
    exact: Bool[Tensor, "batch source"]
    measurable: Bool[Tensor, "batch source"]


@dataclasses.dataclass
class _Run:
    """What the real forward pass recorded, per layer that ran."""

    probe: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    v: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    pattern: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    read: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    order: list[str] = dataclasses.field(default_factory=list)  # "{layer}.{kind}" as fired


def _keep(
    into: dict[int, Tensor], order: list[str], kind: str, layer: int, x: Tensor, hook: Any
) -> None:
    into[layer] = x.detach()
    order.append(f"{layer}.{kind}")


def _probe(run: "_Run", layer: int, x: Tensor, hook: Any) -> Tensor:
    """``hook_z`` plus a zero leaf (``run.probe``): the target's gradient with respect to the
    leaf is its gradient at ``hook_z``, on every model class (a Bridge hands the hook a view of
    what it goes on with, and goes on with what the hook returns)."""
    run.order.append(f"{layer}.z")
    if layer not in run.probe:  # a block recomputed in the backward pass adds the same leaf
        run.probe[layer] = torch.zeros_like(x, requires_grad=True)
    return x + run.probe[layer]


def _recording_hooks(model: nn.Module, run: _Run, read_hook: str) -> list[tuple[str, HookFn]]:
    hooks: list[tuple[str, HookFn]] = []
    for layer in range(int(config(model).n_layers)):
        prefix = f"blocks.{layer}.attn."
        hooks += [
            (prefix + "hook_z", functools.partial(_probe, run, layer)),
            (prefix + "hook_v", functools.partial(_keep, run.v, run.order, "v", layer)),
            (
                prefix + "hook_pattern",
                functools.partial(_keep, run.pattern, run.order, "pattern", layer),
            ),
        ]
    hooks.append((read_hook, lambda x, hook: run.read.__setitem__("activation", x)))
    return [(name, hook) for name, hook in hooks if name in model.hook_dict]  # type: ignore[operator]


def _per_head(x: Tensor, n_heads: int, d_head: int) -> Float[Tensor, "batch pos head d_head"]:
    """``hook_z``/``hook_v`` as ``[batch, pos, head, d_head]``, grouped-query values repeated to
    one per query head (TransformerLens's ``kv(h) = h // (H / H_kv)``)."""
    x = x.reshape(*x.shape[:2], -1, d_head)
    return x.repeat_interleave(n_heads // x.shape[2], dim=2)


@contextlib.contextmanager
def _unembedding_at(
    model: nn.Module, positions: Tensor | None, per_row: bool = False
) -> Iterator[Tensor | None]:
    """Inside, the model's unembedding reads only the positions ``positions`` ``[batch]`` hold,
    so the logits of no other position are made; yields each sequence's index into those logits
    ``[batch]`` (``None`` for ``positions=None``: every position as usual). ``per_row``: row
    ``b`` of the unembedding's input is row ``b`` of the batch, read at ``positions[b]`` alone
    (index 0); else every row reads every distinct position, in order."""
    if positions is None:
        yield None
        return
    kept = positions.unique()
    rows = torch.arange(len(positions), device=positions.device)
    unembed: nn.Module = model.unembed  # type: ignore[assignment]

    def only(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if per_row:
            return (x[rows.to(x.device), positions.to(x.device)][:, None], *args[1:])
        return (x[:, kept.to(x.device)], *args[1:])

    handle = unembed.register_forward_pre_hook(only)
    # TransformerLens 3's Unembed copies W_U on every call (``W_U.T.contiguous()``): the same
    # product here reads it in place
    override = (
        not is_bridge(model) and hasattr(unembed, "hook_out") and "forward" not in vars(unembed)
    )
    if override:
        unembed.forward = functools.partial(_unembed_in_place, unembed)
    try:
        yield torch.zeros_like(positions) if per_row else torch.searchsorted(kept, positions)
    finally:
        handle.remove()
        if override:
            del unembed.forward


def _unembed_in_place(unembed: Any, residual: Tensor) -> Tensor:
    """TransformerLens's ``Unembed.forward``, ``x W_U + b_U`` through its ``hook_in`` and
    ``hook_out``, without a copy of ``W_U``."""
    return unembed.hook_out(F.linear(unembed.hook_in(residual), unembed.W_U.T, unembed.b_U))


def _first_order(
    model: nn.Module,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Tensor | None,
    target: targets.TargetSpec,
    position: int | Tensor,
    record: bool = False,
) -> tuple[targets.Target, Tensor, Tensor, kv_prefix.PrefixCache | None]:
    """The real forward and backward pass: the resolved target, its clean value, the edges and,
    with ``record``, every layer's keys and values (`kv_prefix.recorder`)."""
    n_layers, n_heads = int(config(model).n_layers), int(config(model).n_heads)
    stop_at = targets.hook_of(model, target)
    run = _Run()
    read_hook = stop_at or f"blocks.{n_layers - 1}.hook_resid_post"
    hooks = _recording_hooks(model, run, read_hook)
    batch, n_pos = tokens.shape
    pos = targets.positions(position, batch, n_pos).to(tokens.device)
    reads_logits = stop_at is None and not (
        isinstance(target, Tensor) and target.is_floating_point()
    )
    # a target inside the network stops the pass: the whole (shorter) graph is kept
    recompute = (
        recomputing_blocks(model, lambda: hooks) if stop_at is None else contextlib.nullcontext()
    )
    kwargs: dict[str, Any] = mask_kwargs(model, attention_mask)
    recorded = kv_prefix.recorder(model, batch, tokens.device) if record else None
    if recorded is not None:  # the model's keys and values as it would cache them
        kwargs = {"past_kv_cache": recorded, "attention_mask": torch.ones_like(tokens)}
    with (
        torch.enable_grad(),
        constant_weights(model),
        _unembedding_at(model, pos if reads_logits else None, per_row=True) as at,
        recompute,
    ):
        logits = run_until(model, tokens, hooks, stop_at, **kwargs)
        if "activation" not in run.read:
            raise ConnWalkError(
                f"the hook point {read_hook!r} does not fire in {type(model).__name__}'s forward "
                "pass (some hook points only run when a config option enables them)."
            )
        activation = run.read["activation"]
        target_ = targets.resolve(
            target,
            pos if at is None else at,
            None if logits is None else logits.detach(),
            activation.detach(),
        )
        y = targets.clean_value(target_, logits, activation)
        layers = sorted(run.probe)
        z_0, pattern_0 = "0.z", "0.pattern"
        if z_0 in run.order and pattern_0 in run.order:
            baselines.check_blockable(model, run.order.index(pattern_0) > run.order.index(z_0))
        if not all(layer in run.v and layer in run.pattern for layer in layers):
            raise ConnWalkError(
                f"{type(model).__name__} fires hook_z without hook_v or hook_pattern in some "
                "layer; knockout_estimate reads all three (spec §7)."
            )
        # each layer's edges are made as its gradient arrives (its block recomputed first, on a
        # HookedTransformer or HookedEncoder) and written into their place (0 in the layers
        # after a target read inside the network), and its pattern and values let go
        edges = y.new_zeros(n_layers, batch, n_heads, n_pos, n_pos)
        d_head = int(config(model).d_head)

        def blocked(layer: int, grad: Tensor) -> None:
            edges[layer] = blocking.edge_effects(
                run.pattern.pop(layer),
                _per_head(grad, n_heads, d_head),
                _per_head(run.v.pop(layer), n_heads, d_head),
            )

        for layer in layers:
            run.probe[layer].register_hook(functools.partial(blocked, layer))
        probes = [run.probe[layer] for layer in layers]
        if probes and y.requires_grad:  # else read before any attention: no block changes it
            torch.autograd.backward(y.sum(), inputs=probes)
    target_ = dataclasses.replace(target_, position=pos)
    return target_, y.detach(), edges, recorded


def knock_out(
    model: nn.Module,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Tensor | None,
    target: targets.Target,
    clean: Float[Tensor, " batch"],
    sources: Bool[Tensor, "batch source"],
    recorded: kv_prefix.PrefixCache | None = None,
) -> Float[Tensor, "batch source"]:
    """Knockout (`baselines.knockout`) of the ``sources`` of each target, NaN elsewhere.

    Runs are made per distinct sequence (tokens and padding), not per target: a sequence's runs
    knock out the union of its targets' sources one at a time, and every target on the sequence
    is read from each. Run ``r`` blocks the ``r``-th wanted source of every distinct sequence at
    once (`baselines.block_keys` batches the runs). With the clean run's keys and values
    (``recorded``, a causal ``HookedTransformer``), `_knock_out_after_prefix` instead.
    """
    if recorded is not None:
        return _knock_out_after_prefix(model, tokens, target, clean, sources, recorded)
    key = tokens if attention_mask is None else torch.cat([tokens, attention_mask], -1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    n_pos = tokens.shape[1]
    wanted = torch.zeros(len(distinct), n_pos, dtype=torch.bool, device=tokens.device)
    wanted.index_put_((inverse,), sources.to(tokens.device), accumulate=True)
    out = torch.full(sources.shape, torch.nan, dtype=clean.dtype, device=clean.device)
    n_runs = int(wanted.sum(-1).max())
    if n_runs == 0:
        return out
    # the r-th wanted source of each sequence: wanted sources first, in order
    order = wanted.long().argsort(dim=-1, descending=True, stable=True)[:, :n_runs]  # [seq, run]
    real = torch.gather(wanted, 1, order)  # [seq, run]: whether run r blocks anything there
    keys = torch.zeros(n_runs, len(distinct), n_pos, dtype=torch.bool, device=tokens.device)
    keys.scatter_(2, order.T[..., None], real.T[..., None])
    batch = len(tokens)

    def read(logits: Tensor, activation: Tensor) -> Tensor:
        # every target of the batch read off each row (those of the row's sequence kept below)
        return torch.stack(
            [
                targets.clean_value(
                    target,
                    logits[row].expand(batch, *logits.shape[1:]),
                    activation[row].expand(batch, *activation.shape[1:]),
                )
                for row in range(len(activation))
            ]
        )

    logits_read = target.kind in ("logit", "logit_diff")
    with _unembedding_at(model, target.position if logits_read else None) as at:
        if at is not None:  # the logits of the target positions alone
            target = dataclasses.replace(target, position=at)
        values = baselines.block_keys(
            model,
            distinct[:, :n_pos],
            keys,
            read,
            read_hook=targets.read_at(target, model),
            attention_mask=None if attention_mask is None else distinct[:, n_pos:],
        )  # [run, seq, batch]
    rows = torch.arange(batch, device=tokens.device)
    for r in range(n_runs):
        source = order[inverse, r]  # [batch]: what run r blocked in each target's sequence
        done = real[inverse, r] & sources[rows, source]
        knocked = clean - values[r, inverse, rows].to(clean)
        out[rows[done], source[done]] = knocked[done]
    return out


def _knock_out_after_prefix(
    model: nn.Module,
    tokens: Int[Tensor, "batch pos"],
    target: targets.Target,
    clean: Float[Tensor, " batch"],
    sources: Bool[Tensor, "batch source"],
    recorded: kv_prefix.PrefixCache,
) -> Float[Tensor, "batch source"]:
    """`knock_out` in a causal model, each run recomputing only what the block changes.

    Blocking key ``j`` changes no position up to ``j``: one run per blocked key ``j`` takes the
    clean keys and values of positions ``0..j`` (``recorded``, `kv_prefix.prefix`) and computes
    positions ``j + 1`` to the last target position that wants ``j``, for each distinct
    sequence whose targets want it, with the score of key ``j`` at ``-inf`` for every query in
    every layer. The nearest source of a target at ``p`` (``j = p - 1``) costs one position.
    """
    out = torch.full(sources.shape, torch.nan, dtype=clean.dtype, device=clean.device)
    distinct, inverse = torch.unique(tokens, dim=0, return_inverse=True)
    first = torch.full((len(distinct),), len(tokens), dtype=torch.long, device=tokens.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(tokens), device=tokens.device), "amin")
    n_layers = int(config(model).n_layers)
    names = [f"blocks.{layer}.attn.hook_attn_scores" for layer in range(n_layers)]
    read_hook = targets.read_at(target, model)
    logits_read = target.kind in ("logit", "logit_diff")
    stop_at = None if logits_read else read_hook  # a direction or hook target: no logits
    wanted_rows, wanted_keys = sources.nonzero(as_tuple=True)
    read: dict[str, Tensor] = {}
    hooks: list[tuple[str, HookFn]] = [(read_hook, lambda x, hook: read.update(activation=x))]
    for j in wanted_keys.unique().tolist():
        rows = wanted_rows[wanted_keys == j]  # the targets that want key j blocked
        sequences = inverse[rows].unique()  # sorted: row r of the run is sequences[r]
        run_row = torch.searchsorted(sequences, inverse[rows])
        position = target.position[rows].to(tokens.device) - (j + 1)  # in the run's positions
        end = int(position.max()) + j + 2

        def block(scores: Tensor, hook: Any, j: int = j) -> Tensor:
            return scores.index_fill(-1, torch.tensor([j], device=scores.device), float("-inf"))

        suffix = tokens[first[sequences], j + 1 : end]
        with (
            torch.no_grad(),
            _unembedding_at(model, position if logits_read else None) as at,
        ):
            logits = run_until(
                model,
                suffix,
                [*hooks, *((name, block) for name in names)],
                stop_at,
                past_kv_cache=kv_prefix.prefix(recorded, first[sequences], j + 1),
                attention_mask=torch.ones_like(suffix),
            )
        # each target's own position of its sequence's run, as a sequence of one position
        wanted = dataclasses.replace(target.take(rows), position=torch.zeros_like(position))
        value = targets.clean_value(
            wanted,
            None if logits is None or at is None else logits[run_row, at][:, None],
            read["activation"][run_row, position][:, None],
        )
        out[rows, j] = clean[rows] - value.to(clean)
    return out


#: sources per target knocked out for real by default (`exact_sources`)
DEFAULT_EXACT = 2


def largest(
    scores: Float[Tensor, "batch source"], measurable: Bool[Tensor, "batch source"], k: int
) -> Bool[Tensor, "batch source"]:
    """The ``k`` measurable sources of each target with the largest ``|scores|`` (fewer where
    fewer are measurable)."""
    k = min(k, scores.shape[1])
    magnitude = scores.abs().masked_fill(~measurable, -1)
    top = magnitude.topk(k, -1).indices
    chosen = torch.zeros_like(measurable).scatter_(1, top, True)
    return chosen & measurable


def exact_sources(
    measurable: Bool[Tensor, "batch source"], position: Int[Tensor, " batch"], n: int
) -> Bool[Tensor, "batch source"]:
    """The ``n`` sources of each target knocked out for real, where the first-order
    prediction is poorest: its first measurable position (in a decoder the attention sink,
    where ``A`` is near 1 and a block moves the most weight), then the measurable positions
    nearest the target (in a decoder those just before it: blocking them compounds along the
    target's own row in every layer), the earlier first on a tie."""
    if n == 0:
        return torch.zeros_like(measurable)
    first = measurable.long().argmax(-1)
    rows = torch.arange(len(first), device=first.device)
    sink = torch.zeros_like(measurable)
    sink[rows, first] = measurable[rows, first]
    others = measurable & ~sink
    source = torch.arange(measurable.shape[1], device=measurable.device)
    distance = (source[None] - position.to(source.device)[:, None]).abs() * 2 + (
        source > position[:, None]
    )
    distance = distance.masked_fill(~others, measurable.shape[1] * 4)
    k = min(n - 1, measurable.shape[1])
    nearest = torch.zeros_like(others).scatter_(
        1, distance.topk(k, -1, largest=False).indices, True
    )
    return sink | (nearest & others)


def estimate(
    model: nn.Module,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Tensor | None,
    target: targets.TargetSpec,
    position: int | Tensor,
    exact: int = DEFAULT_EXACT,
) -> Estimate:
    """The predicted knockout of every source and blocking of every edge (spec §7), with
    ``exact`` sources per target knocked out for real (`exact_sources`; 0: first order alone).
    """
    # in a causal HookedTransformer without padding, a knockout run recomputes only the
    # positions after the blocked key, from the clean run's keys and values
    record = exact > 0 and kv_prefix.supports(model) and attention_mask is None
    target_, clean, edges, recorded = _first_order(
        model, tokens, attention_mask, target, position, record
    )
    first_order = edges.sum((0, 2, 3))
    if attention_mask is not None:
        first_order = first_order * attention_mask.to(first_order)
    measurable = _measurable(tokens, attention_mask, target_.position, _is_causal(model))
    chosen = exact_sources(measurable, target_.position, exact)
    remainder = torch.zeros_like(first_order)
    if chosen.any():
        knocked = knock_out(model, tokens, attention_mask, target_, clean, chosen, recorded)
        remainder = torch.where(chosen, knocked - first_order, 0)
    return Estimate(target_, clean, edges, first_order, remainder, chosen, measurable)


def _is_causal(model: nn.Module) -> bool:
    return getattr(config(model), "attention_dir", "causal") == "causal"


def _measurable(
    tokens: Tensor, attention_mask: Tensor | None, position: Tensor, causal: bool
) -> Bool[Tensor, "batch source"]:
    """The sources whose knockout can change the target: real tokens other than the target's
    position, and in a causal model only those before it."""
    n_pos = tokens.shape[1]
    source = torch.arange(n_pos, device=tokens.device)[None]
    at = position.to(tokens.device)[:, None]
    ok = source < at if causal else source != at
    if attention_mask is not None:
        ok = ok & (attention_mask != 0)
    return ok
