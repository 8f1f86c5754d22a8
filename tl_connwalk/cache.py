"""Connection walks from TransformerLens ``ActivationCache`` objects.

Free functions that take the cache first, in the family of ``ActivationCache``'s own analysis
methods; `tl_connwalk.attach` also registers them as cache methods
(``cache.connection_walk(layer)``). Free functions keep working on every cache, including the
plain ``ActivationCache`` objects TransformerLens builds internally (``apply_slice_to_batch_dim``).
"""

from collections.abc import Iterable
from typing import Any, cast

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens import ActivationCache

from tl_connwalk.adapters import Adapter, adapter_for, resolve_layer
from tl_connwalk.adapters.checks import check_layer_devices
from tl_connwalk.core import walk as core_walk
from tl_connwalk.core.isometry import working_dtype
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.residual import LaplacianResidual
from tl_connwalk.walk import ConnectionWalk


def required_hooks(model: nn.Module, layers: Iterable[int] | int | None = None) -> list[str]:
    """The hook names a cache must hold to build the walks of ``layers`` (default: all).

    Pass them as ``names_filter`` to keep a cache small:

    >>> names = required_hooks(model, [0])
    >>> _, cache = model.run_with_cache(tokens, names_filter=names)
    """
    adapter = adapter_for(model)
    if layers is None:
        layers = range(adapter.n_layers(model))
    elif isinstance(layers, int):
        layers = [layers]
    names: list[str] = []
    for layer in layers:
        names += adapter.required_hooks(model, resolve_layer(adapter, model, layer))
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


def n_layers_of_model(model: nn.Module) -> int:
    """How many attention layers ``model`` has (ConnWalkError for unsupported models)."""
    return adapter_for(model).n_layers(model)


def connection_walk(
    cache: ActivationCache, layer: int, model: nn.Module | None = None
) -> ConnectionWalk:
    """Layer ``layer``'s attention as a connection walk, for the whole batch (spec §1.2).

    ``walk.apply() + walk.bias()`` equals the layer's attention output (``hook_attn_out``,
    or the attention module's output in models with ``ln1_post``). Results are float32 or
    wider whatever the cache dtype, on the device of the layer's cache entries (in a model
    split over devices, the layer's own device; the layer's weights are copied there if they
    live elsewhere, e.g. after ``cache.to("cpu")``). A ConnWalkError names the tensors when
    the layer's cache entries are on different devices, or its weights are offloaded (``meta``).
    A cache made with ``remove_batch_dim=True`` gives a walk with a batch of one.

    Args:
        cache: from ``model.run_with_cache``; must hold `required_hooks` for the layer.
        layer: attention layer index; negative counts from the end.
        model: the model the cache came from; defaults to ``cache.model``.

    Examples:
        >>> _, cache = model.run_with_cache(tokens)
        >>> walk = tl_connwalk.connection_walk(cache, 0)
        >>> walk.walk.shape  # [batch, query, key]
        torch.Size([2, 8, 8])
    """
    model, adapter, layer = _checked(cache, layer, model)
    return adapter.walk_from_cache(cache, model, layer)


def walk_matrix(
    cache: ActivationCache, layer: int, model: nn.Module | None = None
) -> Float[Tensor, "batch query key"]:
    """Layer ``layer``'s walk ``W = (1/H) sum_h A^h`` alone, from its patterns (spec §1.2).

    ``connection_walk(cache, layer).walk`` without the gates, field and weights: the cache
    needs only ``blocks.{layer}.attn.hook_pattern``, and the working memory is the walk
    itself. Float32 or wider, on the pattern's device; the checks of `connection_walk`.

    >>> tl_connwalk.walk_matrix(cache, 0).shape  # [batch, query, key]
    torch.Size([2, 8, 8])
    """
    model, adapter, layer = _checked(cache, layer, model, patterns_only=True)
    pattern = adapter.pattern_from_cache(cache, model, layer)
    return core_walk.walk_matrix(pattern.to(working_dtype(pattern)))


def _checked(
    cache: object, layer: object, model: nn.Module | None, *, patterns_only: bool = False
) -> tuple[nn.Module, Adapter, int]:
    """The cache's model, its adapter and the resolved layer, once the cache holds the hooks
    the layer's walk is built from (only its patterns with ``patterns_only``) on one device."""
    model = _model_of(cache, model)
    adapter = adapter_for(model)
    layer = resolve_layer(adapter, model, layer)
    if not patterns_only:
        adapter.check_supported(model, layer)
    needed = adapter.required_hooks(model, layer)[: 1 if patterns_only else None]
    cache = cast(ActivationCache, cache)
    missing = [name for name in needed if name not in cache.cache_dict]
    if missing:
        what = "walk matrix" if patterns_only else "connection walk"
        raise ConnWalkError(
            f"the cache lacks {missing}, which the {what} of layer {layer} is built from "
            "(a names_filter left them out?). Re-run with e.g.\n"
            f"    model.run_with_cache(tokens, names_filter={needed!r})\n"
            "or names_filter=tl_connwalk.required_hooks(model) for every layer."
        )
    weights = [] if patterns_only else _attention_weights(model, layer)
    check_layer_devices(layer, {name: cache.cache_dict[name] for name in needed}, weights)
    return model, adapter, layer


def _attention_weights(model: nn.Module, layer: int) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` of layer ``layer``'s attention module, read without materialising."""
    blocks = getattr(model, "blocks", None)
    attention = getattr(blocks[layer], "attn", None) if blocks is not None else None
    if not isinstance(attention, nn.Module):
        return []
    prefix = f"blocks.{layer}.attn."
    return [(prefix + name, param) for name, param in attention.named_parameters()]


def laplacian_residual(
    cache: ActivationCache, layer: int, model: nn.Module | None = None, **options: Any
) -> LaplacianResidual:
    """``connection_walk(cache, layer, model).laplacian_residual(**options)`` (spec §2-4).

    >>> print(cache.laplacian_residual(-1))  # a causal walk: mu falls back to uniform
    LaplacianResidual layer 1 (batch means; mu: uniform)
      stochasticity     0.0000
    ...
    """
    return connection_walk(cache, layer, model).laplacian_residual(**options)
