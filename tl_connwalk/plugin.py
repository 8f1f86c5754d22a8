"""``attach`` and ``detach``: the one place tl_connwalk touches a model or TransformerLens.

``import tl_connwalk`` changes nothing. ``attach(model)`` checks the model is supported, adds
the connection-walk hook points to ``HookedTransformer``/``HookedEncoder`` models
and ``TransformerBridge`` models
(`tl_connwalk.hooks`, `tl_connwalk.bridge_hooks`) and registers the cache methods on
``ActivationCache`` (``cache.connection_walk(layer)``), refusing to overwrite an attribute it
did not create; ``detach(model)`` undoes exactly that. Methods on
the class, not a cache subclass, because TransformerLens builds plain ``ActivationCache``
objects in many places (``apply_slice_to_batch_dim``, ``run_with_cache``) and a subclass would
lose them. Both are idempotent.
"""

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from transformer_lens import ActivationCache

from tl_connwalk import bridge_hooks, hooks
from tl_connwalk.adapters import adapter_for
from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.analysis import geometry_table, layer_drift
from tl_connwalk.cache import connection_walk, laplacian_residual, walk_matrix
from tl_connwalk.errors import ConnWalkError

#: The methods ``attach`` registers on ``ActivationCache``, by name.
CACHE_METHODS: dict[str, Callable[..., Any]] = {
    function.__name__: function
    for function in (connection_walk, walk_matrix, laplacian_residual, layer_drift, geometry_table)
}

_MARK = "__tl_connwalk__"
_attached: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _method(function: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: ActivationCache, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs)

    method.__name__ = function.__name__
    method.__qualname__ = f"ActivationCache.{function.__name__}"
    method.__doc__ = function.__doc__
    setattr(method, _MARK, True)
    return method


def _check_cache_methods() -> None:
    for name in CACHE_METHODS:
        existing = getattr(ActivationCache, name, None)
        if existing is not None and not getattr(existing, _MARK, False):
            raise ConnWalkError(
                f"ActivationCache.{name} already exists and was not made by tl_connwalk (another "
                f"plugin, or a newer TransformerLens?); refusing to overwrite it. Call "
                f"tl_connwalk.{name}(cache, ...) instead."
            )


def _register_cache_methods() -> None:
    for name, function in CACHE_METHODS.items():
        setattr(ActivationCache, name, _method(function))


def _unregister_cache_methods() -> None:
    for name in CACHE_METHODS:
        if getattr(ActivationCache.__dict__.get(name), _MARK, False):
            delattr(ActivationCache, name)


def _hooks_module(model: nn.Module) -> Any:
    """`tl_connwalk.bridge_hooks` for a ``TransformerBridge``, else `tl_connwalk.hooks`."""
    return bridge_hooks if is_bridge(model) else hooks


def is_attached(model: nn.Module) -> bool:
    """Whether ``attach(model)`` is in effect."""
    return model in _attached


def attach(model: nn.Module) -> nn.Module:
    """Enable tl_connwalk on ``model``: cache methods and the conn hook points.

    ``cache.connection_walk(layer)``, ``cache.walk_matrix(layer)``,
    ``cache.laplacian_residual(layer)``, ``cache.layer_drift()``, ``cache.geometry_table()`` on
    its caches, and on
    ``HookedTransformer``/``HookedEncoder``/``TransformerBridge`` the hook points
    ``blocks.{l}.attn.hook_conn_walk``, ``hook_conn_gates`` and ``hook_conn_messages``
    (`tl_connwalk.hooks`, `tl_connwalk.bridge_hooks`). Idempotent;
    changes no parameter, buffer, output or config. Returns ``model``.

    >>> model = tl_connwalk.attach(model)
    >>> _, cache = model.run_with_cache(tokens)
    >>> cache.connection_walk(0)
    ConnectionWalk(...)
    """
    adapter_for(model)  # refuse unsupported models before touching anything
    _check_cache_methods()
    _hooks_module(model).install(model)
    _register_cache_methods()
    _attached.add(model)
    return model


def detach(model: nn.Module) -> nn.Module:
    """Undo `attach` exactly; the cache methods go with the last attached model."""
    _hooks_module(model).uninstall(model)
    _attached.discard(model)
    if not _attached:
        _unregister_cache_methods()
    return model
