"""``attach`` and ``detach``: the one place tl_connwalk touches a model or TransformerLens.

``import tl_connwalk`` changes nothing but the message of one error: looking up a cache method
on an ``ActivationCache`` before any ``attach`` raises `NotAttachedError` (an
``AttributeError``, as before, and a `ConnWalkError`) that says to call ``attach`` first
(`_cache_method_hint`). ``attach(model)`` checks the model is supported, adds
the connection-walk hook points to ``HookedTransformer``/``HookedEncoder`` models
and ``TransformerBridge`` models
(`tl_connwalk.hooks`, `tl_connwalk.hooks.bridge`) and registers the cache methods on
``ActivationCache`` (``cache.connection_walk(layer)``), refusing to overwrite an attribute it
did not create; ``detach(model)`` undoes exactly that. Methods on
the class, not a cache subclass, because TransformerLens builds plain ``ActivationCache``
objects in many places (``apply_slice_to_batch_dim``, ``run_with_cache``) and a subclass would
lose them. Both are idempotent.

A copy of an attached model (``copy.deepcopy``, pickling, ``torch.save``/``torch.load``) is
attached too (`_Attachment`); ``detach`` of one model never touches another, and the cache
methods stay while any attached model or copy is alive. An unfiltered ``run_with_cache`` of an
attached model caches ``hook_conn_walk`` but not the per-head ``hook_conn_gates`` and
``hook_conn_messages``, which are cached when asked for by name or by a filter
(`_Attachment.run_with_cache`).
"""

import inspect
import weakref
from collections.abc import Callable
from typing import Any, cast

from torch import nn
from transformer_lens import ActivationCache

from tl_connwalk.adapters import adapter_for
from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.analysis import geometry_table, layer_drift
from tl_connwalk.cache import connection_walk, laplacian_residual, walk_matrix
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks import bridge as bridge_hooks
from tl_connwalk.hooks import hooked_transformer as hooks

#: The methods ``attach`` registers on ``ActivationCache``, by name.
CACHE_METHODS: dict[str, Callable[..., Any]] = {
    function.__name__: function
    for function in (connection_walk, walk_matrix, laplacian_residual, layer_drift, geometry_table)
}

_MARK = "__tl_connwalk__"
#: Where `attach` leaves its `_Attachment` in the model's ``__dict__``.
_ATTACHMENT = "_tl_connwalk_attachment"
#: The per-head points an unfiltered ``run_with_cache`` leaves out (`_Attachment`).
PER_HEAD_POINTS: tuple[str, str] = ("hook_conn_gates", "hook_conn_messages")
#: Every live attachment, of attached models and of their copies: the cache methods stay while
#: any is alive.
_live: "weakref.WeakSet[_Attachment]" = weakref.WeakSet()


class NotAttachedError(ConnWalkError, AttributeError):
    """A cache method looked up before `attach`: an ``AttributeError`` (``hasattr`` and
    ``getattr(cache, name, default)`` work as always) that says what to do."""


def _cache_method_hint(self: ActivationCache, name: str) -> Any:
    """``ActivationCache.__getattr__``: called only when normal lookup finds nothing, so it
    changes no attribute that exists; for a cache method's name it says to `attach` first, for
    any other name it raises the ``AttributeError`` Python would have."""
    if name in CACHE_METHODS:
        raise NotAttachedError(
            f"ActivationCache has no method {name} until tl_connwalk.attach(model) is called: "
            f"call tl_connwalk.attach(model) first (then every cache has it, this one "
            f"included), or call tl_connwalk.{name}(cache, ...), which needs no attach."
        )
    raise AttributeError(
        f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
    )


def _install_cache_method_hint() -> None:
    """Give ``ActivationCache`` `_cache_method_hint` as its ``__getattr__``, unless it has one
    (TransformerLens 2.x to 4.x have none)."""
    if "__getattr__" not in vars(ActivationCache):
        ActivationCache.__getattr__ = _cache_method_hint  # type: ignore[attr-defined]


_install_cache_method_hint()


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
    """Register the cache methods, leaving any attribute tl_connwalk did not make alone."""
    for name, function in CACHE_METHODS.items():
        existing = getattr(ActivationCache, name, None)
        if existing is None or getattr(existing, _MARK, False):
            setattr(ActivationCache, name, _method(function))


def _unregister_cache_methods() -> None:
    for name in CACHE_METHODS:
        if getattr(ActivationCache.__dict__.get(name), _MARK, False):
            delattr(ActivationCache, name)


def _registry(model: nn.Module) -> dict[str, Any]:
    """The dict ``run_with_cache`` reads the hook points from (a Bridge's hook_dict is a copy)."""
    if is_bridge(model):
        return cast(dict[str, Any], model._hook_registry)
    return cast(dict[str, Any], model.hook_dict)


def _names_filter_given(
    method: Callable[..., Any], model: nn.Module, args: Any, kwargs: Any
) -> bool:
    """Whether a ``run_with_cache(*args, **kwargs)`` call passes a ``names_filter`` (not None)."""
    if kwargs.get("names_filter") is not None:
        return True
    try:  # a Bridge takes names_filter positionally too
        bound = inspect.signature(method).bind_partial(model, *args)
    except (TypeError, ValueError):
        return False  # the call itself will say what is wrong with its arguments
    return bound.arguments.get("names_filter") is not None


class _Attachment:
    """What `attach` leaves in the model's ``__dict__``: the mark of an attached model, and its
    ``run_with_cache``.

    Copies of the model copy it (``copy.deepcopy``, ``pickle``, ``torch.save``/``torch.load``),
    and the copy's attachment registers the cache methods again (`_reattached`): a copy of an
    attached model is attached, and stays so when the original is detached. It holds its model
    weakly, so that an attached model is freed as soon as it is dropped.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        _live.add(self)

    def __reduce__(self) -> tuple[Any, ...]:
        model = self._model()
        return (_reattached, (model, None if model is None else _registry(model)))

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``run_with_cache``; unfiltered, without the per-head points.

        With no ``names_filter`` (cache everything) the cache holds every hook point it held
        before `attach`, plus ``hook_conn_walk``; ``hook_conn_gates`` (``[batch, head, query,
        key]``, as large as the patterns) and ``hook_conn_messages`` (``[batch, key, head,
        d_model]``, ``d_model / d_head`` times ``hook_z``) are cached only when asked for by
        name or by a filter: ``names_filter=lambda name: True`` caches every point. Hooks on
        them (``run_with_hooks``, ``model.hooks``, patching) work as always.
        """
        model = self._model()
        if model is None:
            raise ConnWalkError("this model no longer exists")
        method: Callable[..., Any] = type(model).run_with_cache  # type: ignore[attr-defined]
        if _names_filter_given(method, model, args, kwargs):
            return method(model, *args, **kwargs)
        registry = _registry(model)
        entries = list(registry.items())
        for name, _ in entries:
            if name.endswith(PER_HEAD_POINTS):
                del registry[name]
        try:
            return method(model, *args, **kwargs)
        finally:  # the same entries in the same order
            registry.clear()
            registry.update(entries)


def _reattached(model: nn.Module | None, registry: dict[str, Any] | None) -> _Attachment | None:
    """The attachment of a copy (deep copy or unpickled) of an attached model."""
    if model is None:
        return None
    if registry is not None and is_bridge(model):
        bridge_hooks.restore_key_names(registry)
    _register_cache_methods()
    return _Attachment(model)


def _hooks_module(model: nn.Module) -> Any:
    """`tl_connwalk.hooks.bridge` for a ``TransformerBridge``, else
    `tl_connwalk.hooks.hooked_transformer`."""
    return bridge_hooks if is_bridge(model) else hooks


def is_attached(model: nn.Module) -> bool:
    """Whether ``attach(model)`` is in effect (also on a copy of an attached model)."""
    if not isinstance(model, nn.Module):
        raise ConnWalkError(
            f"is_attached takes a model (a torch.nn.Module), got {type(model).__name__}."
        )
    return isinstance(vars(model).get(_ATTACHMENT), _Attachment)


def attach(model: nn.Module) -> nn.Module:
    """Enable tl_connwalk on ``model``: cache methods and the conn hook points.

    ``cache.connection_walk(layer)``, ``cache.walk_matrix(layer)``,
    ``cache.laplacian_residual(layer)``, ``cache.layer_drift()``, ``cache.geometry_table()`` on
    its caches, and on
    ``HookedTransformer``/``HookedEncoder``/``TransformerBridge`` the hook points
    ``blocks.{l}.attn.hook_conn_walk``, ``hook_conn_gates`` and ``hook_conn_messages``
    (`tl_connwalk.hooks`, `tl_connwalk.hooks.bridge`). Idempotent;
    changes no parameter, buffer, output or config. Returns ``model``.

    An unfiltered ``model.run_with_cache(tokens)`` then caches ``hook_conn_walk`` (``1 / H`` of
    the patterns' memory) but not ``hook_conn_gates`` and ``hook_conn_messages``, whose
    ``[batch, head, query, key]`` and ``[batch, key, head, d_model]`` tensors would add half
    again to the cache: name them, or pass ``names_filter=lambda name: True``, to cache them.
    Copies of the model (``copy.deepcopy``, ``torch.save``/``torch.load``) are attached too.

    >>> model = tl_connwalk.attach(model)
    >>> _, cache = model.run_with_cache(tokens)
    >>> cache.connection_walk(0)
    ConnectionWalk(...)
    """
    adapter_for(model)  # refuse unsupported models before touching anything
    _check_cache_methods()
    _hooks_module(model).install(model)
    _register_cache_methods()
    if not is_attached(model):
        attachment = _Attachment(model)
        model.__dict__[_ATTACHMENT] = attachment
        model.__dict__["run_with_cache"] = attachment.run_with_cache
    return model


def detach(model: nn.Module) -> nn.Module:
    """Undo `attach` exactly; the cache methods go when no attached model (or copy of one) is
    left. Never changes another model, a copy included."""
    _hooks_module(model).uninstall(model)
    attachment = model.__dict__.pop(_ATTACHMENT, None)
    if isinstance(attachment, _Attachment):
        _live.discard(attachment)
        model.__dict__.pop("run_with_cache", None)
    if not _live:
        _unregister_cache_methods()
    return model
