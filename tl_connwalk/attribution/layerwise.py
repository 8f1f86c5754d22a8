"""The layer-wise baselines of `tl_connwalk.attribute`: their matrices ``C_l``, read off a model.

``attention_norm`` and ``alti`` read one cache (patterns, the field each layer's values read,
the residual stream ``blocks.{l}.hook_resid_pre``) and the layers' connection walks;
``value_zeroing`` reruns each layer with one token's value vector zeroed, every source of a
chunk in one batched pass through that layer. The formulas are in `tl_connwalk.attribution.mixing`.
"""

import itertools
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import ActivationCache

from tl_connwalk import cache as walk_cache
from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.attribution import mixing
from tl_connwalk.attribution.frozen import HookFn, config, run_until
from tl_connwalk.core.walk import head_messages
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk

#: positions (sources times sequence length) in one value-zeroing pass through a layer
VALUE_ZEROING_ROWS = 4096


def _resid_pre(layer: int) -> str:
    return f"blocks.{layer}.hook_resid_pre"


def _first(model: nn.Module, layers: int | None) -> range:
    """The layers a layer-wise method computes: the first ``layers`` (``None``: all)."""
    n_layers = int(config(model).n_layers)
    if layers is None:
        return range(n_layers)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= n_layers:
        raise ConnWalkError(
            f"layers must be an int in 1..{n_layers} (how many layers, from the first) or "
            f"None for all, got {layers!r}."
        )
    return range(layers)


def _run(
    model: nn.Module, tokens: Tensor, hooks: list[tuple[str, HookFn]], names: set[str], last: str
) -> ActivationCache:
    """The activations at ``names`` (those the model has) with ``hooks`` on, the forward pass
    stopped once ``last`` ran (the layers above it are not needed)."""
    hook_dict: Any = model.hook_dict
    seen: dict[str, Tensor] = {}
    saves = [
        (name, lambda x, hook, name=name: seen.__setitem__(name, x))
        for name in names | {last}
        if name in hook_dict
    ]
    with torch.no_grad():
        run_until(model, tokens, [*hooks, *saves], last)
    return ActivationCache(seen, model)


def _clean(model: nn.Module, tokens: Tensor, layers: range, extra: list[str]) -> ActivationCache:
    """The clean run's activations the walks of ``layers`` and ``extra`` need, up to the output
    of the last of ``layers``."""
    names = set(walk_cache.required_hooks(model, layers)) | set(extra)
    return _run(model, tokens, [], names, _layer_output(model, layers[-1]))


def _walks(model: nn.Module, cache: ActivationCache, layers: range) -> list[ConnectionWalk]:
    return [walk_cache.connection_walk(cache, layer, model) for layer in layers]


def attention_norm(
    model: nn.Module, tokens: Int[Tensor, "batch pos"], *, layers: int | None = None
) -> Float[Tensor, "layer batch pos pos"]:
    """``C_l``: ``||sum_h A^h_ij f^h(x_j) + [i = j] r_i||``, rows normalised, for the first
    ``layers`` layers (``None``: every layer)."""
    computed = _first(model, layers)
    cache = _clean(model, tokens, computed, [_resid_pre(layer) for layer in computed])
    matrices = []
    for layer, walk in zip(computed, _walks(model, cache, computed), strict=True):
        messages = head_messages(walk.field, walk.W_V, walk.b_V, walk.W_O)
        residual = cache[_resid_pre(layer)].to(walk.field)
        matrices.append(mixing.attention_norm_layer(walk.patterns, messages, residual))
    return mixing.normalised_rows(torch.stack(matrices))


def _is_hooked_encoder(model: nn.Module) -> bool:
    return type(model).__name__ == "HookedEncoder"


def _field_at_zero_residual(
    model: nn.Module, tokens: Tensor, cache: ActivationCache, layers: range
) -> list[Tensor]:
    """Each layer's field when the residual stream entering it is zero: the bias of the
    normalisation before attention (LayerNorm's ``b``; 0 for RMSNorm, folded norms and
    encoders), which is no token's (ALTI). The normalised part of zero is zero whatever the
    scale, so the scales need no freezing."""
    fields = [walk_cache.required_hooks(model, layer)[1] for layer in layers]
    hooks: list[tuple[str, HookFn]] = [
        (_resid_pre(layer), lambda x, hook: torch.zeros_like(x)) for layer in layers
    ]
    seen = _run(model, tokens, hooks, set(fields), fields[-1])
    at_zero = ActivationCache({**{name: cache[name] for name in cache}, **seen}, model)
    return [walk.field for walk in _walks(model, at_zero, layers)]


def alti(
    model: nn.Module, tokens: Int[Tensor, "batch pos"], *, layers: int | None = None
) -> Float[Tensor, "layer batch pos pos"]:
    """``C_l``: ALTI's contributions of each attention sublayer, rows normalised, for the
    first ``layers`` layers (``None``: every layer).

    The sublayer's output ``y_i`` must be ``r_i + attention_i`` (pre-norm decoders), or that
    through a LayerNorm (``HookedEncoder``); other arrangements raise a ConnWalkError.
    """
    computed = _first(model, layers)
    encoder = _is_hooked_encoder(model)
    extra = [_resid_pre(layer) for layer in computed]
    extra += [f"blocks.{layer}.hook_resid_{at}" for layer in computed for at in ("mid", "post")]
    if encoder:
        extra += [f"blocks.{layer}.ln1.hook_scale" for layer in computed]
    cache = _clean(model, tokens, computed, extra)
    bias = _field_at_zero_residual(model, tokens, cache, computed)
    matrices = []
    for layer, walk in zip(computed, _walks(model, cache, computed), strict=True):
        residual = cache[_resid_pre(layer)].to(walk.field)
        _check_sublayer(model, cache, walk, residual, layer)
        field = walk.field - bias[layer].to(walk.field)
        messages = head_messages(field, walk.W_V, torch.zeros_like(walk.b_V), walk.W_O)
        post_norm = None
        if encoder:
            weight = model.blocks[layer].ln1.w.detach().to(field)  # type: ignore[index,union-attr]
            post_norm = (weight, cache[f"blocks.{layer}.ln1.hook_scale"].to(field))
        matrices.append(mixing.alti_layer(walk.patterns, messages, residual, post_norm))
    return mixing.normalised_rows(torch.stack(matrices))


def _check_sublayer(
    model: nn.Module, cache: ActivationCache, walk: ConnectionWalk, residual: Tensor, layer: int
) -> None:
    """A ConnWalkError unless ``hook_resid_mid = r + attention`` (``hook_resid_post`` in
    attention-only models): the sublayer ALTI decomposes."""
    names = [f"blocks.{layer}.hook_resid_{where}" for where in ("mid", "post")]
    name = names[0] if names[0] in cache else names[1]
    if name in cache:
        mid = cache[name].to(residual)
        expected = residual + walk.apply() + walk.bias()
        tolerance = 1e-3 * float(mid.abs().max())  # a structural check, not a rounding one
        if torch.allclose(mid, expected, rtol=0, atol=tolerance):
            return
    raise ConnWalkError(
        f"layer {layer}: method='alti' decomposes an attention sublayer whose output is the "
        "residual plus the attention output (pre-norm decoders) or that through a LayerNorm "
        "(HookedEncoder); this model adds a norm after attention, runs attention and MLP in "
        "parallel or normalises after the sublayer. Use method='attention_norm', "
        "'value_zeroing' or 'connection'."
    )


def _layer_output(model: nn.Module, layer: int) -> str:
    """The hook holding what layer ``layer`` passes on (after BERT's final LayerNorm)."""
    name = f"blocks.{layer}.hook_normalized_resid_post"
    hook_dict: Any = model.hook_dict
    return name if name in hook_dict and not is_bridge(model) else f"blocks.{layer}.hook_resid_post"


def value_zeroing(
    model: nn.Module, tokens: Int[Tensor, "batch pos"], *, layers: int | None = None
) -> Float[Tensor, "layer batch pos pos"]:
    """``C_l[b, i, j] = 1 - cos(y_i^{-j}, y_i)``, rows normalised, for the first ``layers``
    layers (``None``: every layer); the layers above them never run.

    ``y_i`` is layer ``l``'s output at query ``i`` (its residual stream after the block) and
    ``y_i^{-j}`` the same with token ``j``'s value vector (``attn.hook_v``, every head, value
    bias included) zeroed for every query, the layer's input kept. Per sequence and layer, the
    layers below run once and layer ``l`` once for a chunk of sources (its input copied per
    source), stopping there.
    """
    batch, n_pos = tokens.shape
    computed = _first(model, layers)
    outputs = [_layer_output(model, layer) for layer in computed]
    cache = _clean(model, tokens, computed, outputs)
    chunk = max(1, VALUE_ZEROING_ROWS // n_pos)
    shape = (len(computed), batch, n_pos, n_pos)
    matrices = torch.zeros(shape, dtype=torch.float64, device=tokens.device)
    for layer, b, start in itertools.product(computed, range(batch), range(0, n_pos, chunk)):
        sources = torch.arange(start, min(start + chunk, n_pos), device=tokens.device)
        changed = _zeroed_run(model, tokens[b : b + 1], layer, sources, outputs[layer])
        clean = cache[outputs[layer]][b]
        distance = mixing.cosine_distance(changed.double(), clean[None].double())
        matrices[layer, b, :, start : start + len(sources)] = distance.T
    return mixing.normalised_rows(matrices)


def _zeroed_run(
    model: nn.Module, tokens: Int[Tensor, "1 pos"], layer: int, sources: Tensor, output: str
) -> Float[Tensor, "source pos d_model"]:
    """Layer ``layer``'s output with ``sources[k]``'s value vectors zeroed in copy ``k`` of the
    layer's input (the layers below run once, for the one sequence)."""
    k, n_pos = len(sources), tokens.shape[1]
    seen: dict[str, Tensor] = {}

    def copy(resid: Tensor, hook: Any) -> Tensor:
        return resid.repeat(k, 1, 1)

    def zero(v: Tensor, hook: Any) -> Tensor:
        if v.shape[:2] != (k, n_pos):
            raise ConnWalkError(
                f"blocks.{layer}.attn.hook_v has shape {tuple(v.shape)}; value zeroing expects "
                f"[batch, pos, head, d_head] with batch={k}, pos={n_pos}."
            )
        v = v.clone()
        v[torch.arange(k, device=v.device), sources] = 0
        return v

    hooks: list[tuple[str, HookFn]] = [
        (_resid_pre(layer), copy),
        (f"blocks.{layer}.attn.hook_v", zero),
        (output, lambda y, hook: seen.__setitem__("y", y)),
    ]
    with torch.no_grad():
        run_until(model, tokens, hooks, output)
    if "y" not in seen:
        raise ConnWalkError(f"{output} did not run; value zeroing reads each layer's output there.")
    return seen["y"]
