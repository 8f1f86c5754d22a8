"""Adapters: what differs per TransformerLens model class, behind one small interface.

An adapter knows, for its model class, where the field ``x``, the patterns, the weights and
the biases of a layer come from. Adding a model class is one new module here and one entry in
``ADAPTERS``; the math core never imports this package.
"""

import numbers
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from torch import Tensor, nn
from transformer_lens import ActivationCache

from tl_connwalk.adapters import bridge, hooked_transformer
from tl_connwalk.core.checks import checked_index
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk


@runtime_checkable
class Adapter(Protocol):
    """The interface every model-class adapter module implements."""

    NAME: str

    def supports(self, model: nn.Module) -> bool: ...

    def n_layers(self, model: nn.Module) -> int: ...

    def required_hooks(self, model: nn.Module, layer: int) -> list[str]: ...  # patterns first

    def check_supported(self, model: nn.Module, layer: int) -> None: ...  # ConnWalkError: why

    def pattern_from_cache(
        self, cache: ActivationCache, model: nn.Module, layer: int
    ) -> Tensor: ...

    def walk_from_cache(
        self, cache: ActivationCache, model: nn.Module, layer: int
    ) -> ConnectionWalk: ...


ADAPTERS: tuple[Adapter, ...] = (hooked_transformer, bridge)


def adapter_for(model: object) -> Adapter:
    """The adapter for ``model``'s class, or a ConnWalkError listing the supported classes."""
    for adapter in ADAPTERS:
        if isinstance(model, nn.Module) and adapter.supports(model):
            return adapter
    supported = ", ".join(adapter.NAME for adapter in ADAPTERS)
    raise ConnWalkError(
        f"tl_connwalk does not support {type(model).__module__}.{type(model).__qualname__}; "
        f"supported model classes: {supported}."
    )


def resolve_layer(adapter: Adapter, model: nn.Module, layer: object) -> int:
    """``layer`` as a non-negative index; negative counts from the end, as in Python
    (`tl_connwalk.core.checks.checked_index`: the rule and message of every index)."""
    n_layers = adapter.n_layers(model)
    if n_layers == 0:
        raise ConnWalkError("this model has no attention layer (n_layers = 0): there is no walk.")
    return checked_index(layer, n_layers, "layer", "this model", "attention layers")


def resolve_layers(adapter: Adapter, model: nn.Module, layers: object) -> list[int]:
    """``layers`` (``None``: every layer; one index; or an iterable of indices) as
    non-negative indices in the order given, each by `resolve_layer`.

    >>> resolve_layers(adapter_for(model), model, [-1, 0])
    [1, 0]
    """
    if layers is None:
        return list(range(adapter.n_layers(model)))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (numbers.Integral, Iterable)):
        raise ConnWalkError(
            f"layers must be None (every layer), a layer index or an iterable of them, got "
            f"{type(layers).__name__} {layers!r}."
        )
    chosen = [layers] if not isinstance(layers, Iterable) else list(layers)
    return [resolve_layer(adapter, model, layer) for layer in chosen]
