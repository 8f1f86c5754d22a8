"""Connection walks from TransformerLens ``ActivationCache`` objects.

Free functions that take the cache first, in the family of ``ActivationCache``'s own analysis
methods; `tl_connwalk.attach` also registers them as cache methods
(``cache.connection_walk(layer)``). Free functions keep working on every cache, including the
plain ``ActivationCache`` objects TransformerLens builds internally (``apply_slice_to_batch_dim``).
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens import ActivationCache

from tl_connwalk.adapters import Adapter, adapter_for, resolve_layer, resolve_layers
from tl_connwalk.adapters.checks import check_layer_devices
from tl_connwalk.core import walk as core_walk
from tl_connwalk.core.isometry import working_dtype
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk
from tl_connwalk.walk.residual import LaplacianResidual


def required_hooks(model: nn.Module, layers: Iterable[int] | int | None = None) -> list[str]:
    """The hook names a cache must hold to build the walks of ``layers`` (default: all).

    Pass them as ``names_filter`` to keep a cache small:

    >>> names = required_hooks(model, [0])
    >>> _, cache = model.run_with_cache(tokens, names_filter=names)
    """
    adapter = adapter_for(model)
    names: list[str] = []
    for layer in resolve_layers(adapter, model, layers):
        names += adapter.required_hooks(model, layer)
    return names


def _model_of(cache: object, model: nn.Module | None) -> nn.Module:
    if not isinstance(cache, ActivationCache):
        raise ConnWalkError(
            f"expected a transformer_lens ActivationCache, got {type(cache).__name__}; "
            "make one with `logits, cache = model.run_with_cache(tokens)`."
        )
    if model is None:
        model = cast(nn.Module | None, cache.model)
    if model is None:
        raise ConnWalkError(
            "this cache does not know its model; pass it: "
            "connection_walk(cache, layer, model=model)."
        )
    return model


def n_layers_of(cache: ActivationCache, model: nn.Module | None = None) -> int:
    """How many attention layers the cache's model has."""
    return n_layers_of_model(_model_of(cache, model))


def layers_of(cache: ActivationCache, layers: object) -> list[int]:
    """``layers`` of the cache's model (``None``: every layer; an index; or an iterable of
    them) as non-negative indices in the order given, negative counting from the end
    (`tl_connwalk.adapters.resolve_layers`)."""
    model = _model_of(cache, None)
    return resolve_layers(adapter_for(model), model, layers)


def n_layers_of_model(model: nn.Module) -> int:
    """How many attention layers ``model`` has (ConnWalkError for unsupported models)."""
    return adapter_for(model).n_layers(model)


def connection_walk(
    cache: ActivationCache,
    layer: int,
    model: nn.Module | None = None,
    *,
    attention_mask: Tensor | None = None,
) -> ConnectionWalk:
    """Layer ``layer``'s attention as a connection walk, for the whole batch (spec §1.2).

    ``walk.apply() + walk.bias()`` equals the layer's attention output (``hook_attn_out``,
    or the attention module's output in models with ``ln1_post``). Results are float32 or
    wider whatever the cache dtype, on the device of the layer's cache entries (in a model
    split over devices, the layer's own device; the layer's weights are copied there if they
    live elsewhere, e.g. after ``cache.to("cpu")``). A ConnWalkError names the tensors when
    the layer's cache entries are on different devices, or its weights are offloaded (``meta``).
    A cache made with ``remove_batch_dim=True`` gives a walk with a batch of one.

    Padded batches: the walk marks its padding (``walk.attention_mask``, see
    `ConnectionWalk.with_padding`) and every measurement of a sequence equals that of the
    sequence run alone. Padding is read off the cache (keys no real query attends to) or
    taken from ``attention_mask``. TransformerLens runs right-padded text batches of a
    ``HookedTransformer`` without a mask (a causal model's real tokens never see the pads,
    but the pads then look like tokens): pass the mask, e.g.
    ``transformer_lens.utils.get_attention_mask(model.tokenizer, tokens, prepend_bos)``,
    to ``run_with_cache`` and here.

    Args:
        cache: from ``model.run_with_cache``; must hold `required_hooks` for the layer.
        layer: attention layer index; negative counts from the end.
        model: the model the cache came from; defaults to ``cache.model``.
        attention_mask: ``[batch, pos]``, 1 on real tokens and 0 on padding: the mask the
            model ran with; checked against the cache. ``None``: padding is detected.

    Examples:
        >>> _, cache = model.run_with_cache(tokens)
        >>> walk = tl_connwalk.connection_walk(cache, 0)
        >>> walk.walk.shape  # [batch, query, key]
        torch.Size([2, 8, 8])
    """
    model, adapter, layer = _checked(cache, layer, model)
    return adapter.walk_from_cache(cache, model, layer).with_padding(attention_mask)


def connection_walks(
    cache: ActivationCache,
    layers: Iterable[int],
    model: nn.Module | None = None,
    *,
    attention_mask: Tensor | None = None,
) -> list[ConnectionWalk]:
    """`connection_walk` of each of ``layers``, the same walks, their padding read (or the
    ``attention_mask`` checked) for all of them at once
    (`tl_connwalk.core.padding.positions_of_walks`): what `geometry_table` builds a group of
    layers with.

    >>> [walk.layer for walk in tl_connwalk.cache.connection_walks(cache, [0, -1])]
    [0, 1]
    """
    built = []
    for layer in layers:
        model, adapter, resolved = _checked(cache, layer, model)
        built.append(adapter.walk_from_cache(cache, model, resolved))
    return ConnectionWalk.with_paddings(built, attention_mask)


def walk_matrix(
    cache: ActivationCache,
    layer: int,
    model: nn.Module | None = None,
    *,
    heads: Sequence[int] | None = None,
) -> Float[Tensor, "batch query key"]:
    """Layer ``layer``'s walk ``W = (1/H) sum_h A^h`` alone, from its patterns (spec §1.2).

    ``connection_walk(cache, layer).walk`` without the gates, field and weights: the cache
    needs only ``blocks.{layer}.attn.hook_pattern``, and the working memory is the walk
    itself. Float32 or wider, on the pattern's device; the checks of `connection_walk`.
    ``heads``: the walk of those heads alone, ``(1/|S|) sum_{h in S} A^h``.

    >>> tl_connwalk.walk_matrix(cache, 0).shape  # [batch, query, key]
    torch.Size([2, 8, 8])
    """
    model, adapter, layer = _checked(cache, layer, model, patterns_only=True)
    pattern = adapter.pattern_from_cache(cache, model, layer)
    if heads is not None:
        chosen = core_walk.check_heads(heads, pattern.shape[1])
        pattern = pattern[:, torch.tensor(chosen, device=pattern.device)]
    return core_walk.walk_matrix(pattern.to(working_dtype(pattern)))


def _checked(
    cache: object, layer: object, model: nn.Module | None, *, patterns_only: bool = False
) -> tuple[nn.Module, Adapter, int]:
    """The cache's model, its adapter and the resolved layer, once the cache holds the hooks
    the layer's walk is built from (only its patterns with ``patterns_only``) on one device."""
    model = _model_of(cache, model)
    adapter = adapter_for(model)
    cache = cast(ActivationCache, cache)
    _check_made_by(cache, model, None)
    layer = resolve_layer(adapter, model, layer)
    if not patterns_only:
        adapter.check_supported(model, layer)
    needed = adapter.required_hooks(model, layer)[: 1 if patterns_only else None]
    missing = [name for name in needed if name not in cache.cache_dict]
    if missing:
        _check_made_by(cache, model, missing)
        what = "walk matrix" if patterns_only else "connection walk"
        raise ConnWalkError(
            f"the cache lacks {missing}, which the {what} of layer {layer} is built from "
            "(a names_filter left them out, or the cache is another model's?). Re-run with e.g.\n"
            f"    model.run_with_cache(tokens, names_filter={needed!r})\n"
            "or names_filter=tl_connwalk.required_hooks(model) for every layer."
        )
    weights = [] if patterns_only else _attention_weights(model, layer)
    check_layer_devices(layer, {name: cache.cache_dict[name] for name in needed}, weights)
    return model, adapter, layer


def _describe(model: nn.Module) -> str:
    """``model``'s class and the sizes that fix its cache's hook names and shapes."""
    cfg = getattr(model, "cfg", None)
    sizes = ", ".join(f"{key}={getattr(cfg, key, '?')}" for key in _SIZES)
    return f"{type(model).__name__} ({sizes})"


_SIZES = ("n_layers", "d_model", "n_heads", "d_head")
_OTHER_MODEL_FIX = (
    "Pass the model that made the cache, connection_walk(cache, layer, model=that_model), or "
    "make a cache with this one: `_, cache = model.run_with_cache(tokens)`."
)


def _check_made_by(cache: ActivationCache, model: nn.Module, missing: list[str] | None) -> None:
    """A ConnWalkError when ``cache`` cannot come from ``model``: its own model
    (``cache.model``) has another class or other sizes, or hooks the walk needs are
    ``missing`` and the cache was made by another model object or holds hook names that
    ``model`` does not have. Else a missing hook was left out by a ``names_filter``."""
    made_by = getattr(cache, "model", None)
    if isinstance(made_by, nn.Module) and made_by is not model:
        theirs, ours = _describe(made_by), _describe(model)
        if theirs != ours or missing:
            passed = f"the {ours} passed" if theirs != ours else "the one passed (same sizes)"
            lacks = "" if not missing else f" It lacks {missing}, which the model passed reads."
            raise ConnWalkError(
                f"this cache was made by another model, a {theirs}, not {passed}.{lacks} "
                f"{_OTHER_MODEL_FIX}"
            )
    if missing is None:  # before hook_dict: a bridge builds it anew on every read
        return
    hook_dict = getattr(model, "hook_dict", None)
    if not isinstance(hook_dict, Mapping):
        return
    foreign = [name for name in cache.cache_dict if name not in hook_dict]
    if foreign:
        shown = ", ".join(foreign[:3]) + ("" if len(foreign) <= 3 else ", ...")
        raise ConnWalkError(
            f"this cache was made by another model: it lacks {missing}, which this "
            f"{_describe(model)} needs, and holds {len(foreign)} hooks that this model does not "
            f"have ({shown}). {_OTHER_MODEL_FIX}"
        )


def _attention_weights(model: nn.Module, layer: int) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` of layer ``layer``'s attention module, read without materialising."""
    blocks = getattr(model, "blocks", None)
    attention = getattr(blocks[layer], "attn", None) if blocks is not None else None
    if not isinstance(attention, nn.Module):
        return []
    prefix = f"blocks.{layer}.attn."
    return [(prefix + name, param) for name, param in attention.named_parameters()]


def laplacian_residual(
    cache: ActivationCache,
    layer: int,
    model: nn.Module | None = None,
    *,
    attention_mask: Tensor | None = None,
    **options: Any,
) -> LaplacianResidual:
    """``connection_walk(cache, layer, model, attention_mask=...).laplacian_residual(**options)``
    (spec §2-4).

    >>> print(cache.laplacian_residual(-1))  # a causal walk: mu falls back to uniform
    LaplacianResidual layer 1 (batch means; mu: uniform)
      stochasticity     0.0000
    ...
    """
    walk = connection_walk(cache, layer, model, attention_mask=attention_mask)
    return walk.laplacian_residual(**options)
