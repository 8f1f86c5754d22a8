"""Adapters: what differs per TransformerLens model class, behind one small interface.

An adapter knows, for its model class, where the field ``x``, the patterns, the weights and
the biases of a layer come from. Adding a model class is one new module here and one entry in
``ADAPTERS``; the math core never imports this package.
"""

from typing import Protocol, runtime_checkable

from torch import Tensor, nn
from transformer_lens import ActivationCache

from tl_connwalk.adapters import bridge, hooked_transformer
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
    """``layer`` as a non-negative index; negative counts from the end, as in Python."""
    n_layers = adapter.n_layers(model)
    if n_layers == 0:
        raise ConnWalkError("this model has no attention layer (n_layers = 0): there is no walk.")
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ConnWalkError(f"layer must be an int, got {type(layer).__name__} {layer!r}.")
    if not -n_layers <= layer < n_layers:
        raise ConnWalkError(
            f"layer {layer} is out of range: this model has {n_layers} attention layers "
            f"(valid: 0..{n_layers - 1}, or -{n_layers}..-1 counted from the end)."
        )
    return layer % n_layers
