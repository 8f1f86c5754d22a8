"""The connection-walk hook points of a ``HookedTransformer`` (spec §1.2).

`install` gives every attention layer ``blocks.{l}.attn`` three new ``HookPoint`` s, listed
in ``model.hook_dict`` like TransformerLens's own, so that ``run_with_cache``, ``run_with_hooks``,
``model.hooks(...)`` and ``transformer_lens.patching`` reach them by name:

=============================================  ==============================  ==================
``blocks.{l}.attn.hook_conn_walk``             ``[batch, query, key]``         walk ``W``
``blocks.{l}.attn.hook_conn_gates``            ``[batch, head, query, key]``   gates ``g``
``blocks.{l}.attn.hook_conn_messages``         ``[batch, key, head, d_model]`` ``m^h_j``
=============================================  ==============================  ==================

with ``m^h_j = (x_j W_V^h + b_V^h) W_O^h``, read from the final ``hook_v`` value (grouped-query
models: head ``h`` reads value head ``h // (n_heads // n_key_value_heads)``). A hook that edits
the walk or gates makes the layer use the patterns ``A^h = H W g^h``; one that edits the messages
adds ``sum_h A^h (m'^h - m^h)`` to the attention module's output, so the output becomes
``sum_h A^h m'^h + b_O`` (plus any edit made at ``hook_z`` or ``hook_result``). Unedited, every
output is bit for bit the plain model's, and a point with no hook attached is never computed.

How, without copying TransformerLens's attention forward:

- the existing ``attn.hook_v`` and ``attn.hook_pattern`` instances get a subclass
  (``__class__`` swap) whose ``__call__`` runs the usual HookPoint call, *all* user hooks
  included, and then hands the final value on. Permanent hooks would instead run before hooks
  added later, and die in ``reset_hooks(including_permanent=True)``;
- the message correction is a forward hook on the attention module itself, which
  ``reset_hooks`` never touches. Its output is the attention output *before* ``ln1_post``
  (``use_normalization_before_and_after``), where ``hook_attn_out`` would be too late;
- all state lives on the modules (and is copied by ``copy.deepcopy``); the forward hook is a
  module-level function that finds everything through the module it is called on.

`uninstall` undoes exactly this. Another plugin's subclass on ``hook_v``/``hook_pattern``
is refused with `tl_connwalk.errors.ConnWalkError`, never silently wrapped.

>>> install(hooked_model)  # a HookedTransformer
>>> _, cache = hooked_model.run_with_cache(tokens, names_filter=hook_name(0, "walk"))
>>> cache["blocks.0.attn.hook_conn_walk"].shape  # [batch, query, key]
torch.Size([2, 8, 8])
>>> uninstall(hooked_model)
"""

import importlib
from typing import Any, Literal, cast

import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

try:
    from transformer_lens import HookedRootModule
except ImportError:  # TransformerLens 2.x keeps it in hook_points only
    from transformer_lens.hook_points import HookedRootModule  # type: ignore[no-redef]

from tl_connwalk.core.value_heads import expand_value_heads, grouped_value_heads
from tl_connwalk.core.walk import patterns_from_walk, walk_and_gates
from tl_connwalk.errors import ConnWalkError


def _attention_class() -> type | None:
    """TransformerLens's ``AbstractAttention``; None in 4.x, which removed HookedTransformer."""
    try:
        module = importlib.import_module("transformer_lens.components.abstract_attention")
    except ImportError:
        return None
    return cast(type, module.AbstractAttention)


_ATTENTION = _attention_class()

#: The three new hook points, relative to ``blocks.{l}.attn``.
HOOK_NAMES: tuple[str, str, str] = ("hook_conn_walk", "hook_conn_gates", "hook_conn_messages")

Point = Literal["walk", "gates", "messages"]


def hook_name(layer: int, point: Point) -> str:
    """The full hook name of ``point`` in layer ``layer``, e.g. ``blocks.3.attn.hook_conn_walk``."""
    if point not in ("walk", "gates", "messages"):
        raise ConnWalkError(f"point must be 'walk', 'gates' or 'messages', got {point!r}")
    return f"blocks.{layer}.attn.hook_conn_{point}"


class _ConnLayer:
    """One attention layer's new hook points, and the final ``v`` and pattern of this forward.

    Shared by the swapped ``hook_v``/``hook_pattern`` and read by the attention forward hook; the
    tensors are dropped as soon as the attention output is corrected.
    """

    def __init__(self, walk: HookPoint, gates: HookPoint, messages: HookPoint) -> None:
        self.walk = walk
        self.gates = gates
        self.messages = messages
        self.value: Tensor | None = None
        self.pattern: Tensor | None = None


def _hooked(point: HookPoint) -> bool:
    return bool(point.fwd_hooks or point.bwd_hooks)


def _snapshot(tensor: Tensor) -> int | Tensor:
    """What `_edited` needs to see a hook write into ``tensor``: its version counter, or a copy
    of its values for an inference tensor (made under ``torch.inference_mode()``, which keeps
    no version counter)."""
    return tensor.clone() if tensor.is_inference() else tensor._version


def _edited(before: Tensor, after: Tensor, snapshot: int | Tensor, name: str | None) -> bool:
    """Whether a hook changed ``before``: returned other values, or wrote into it in place.

    ``snapshot`` is `_snapshot` (before) taken before the hook ran.
    """
    if after.shape != before.shape:
        raise ConnWalkError(
            f"a hook on {name} returned shape {tuple(after.shape)}; it must keep the shape "
            f"{tuple(before.shape)}"
        )
    if isinstance(snapshot, Tensor):  # inference tensors: compare the values themselves
        return not torch.equal(after, snapshot)
    # `_version` catches in-place edits; a returned tensor (e.g. the alias a backward hook
    # makes) counts as an edit only if its values differ.
    return before._version != snapshot or (after is not before and not torch.equal(after, before))


class _ValueHookPoint(HookPoint):
    """``attn.hook_v`` after `install`: hands its final value to the messages point."""

    _conn: _ConnLayer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value = super().__call__(*args, **kwargs)
        if _hooked(self._conn.messages):
            self._conn.value = value
        return value


class _PatternHookPoint(HookPoint):
    """``attn.hook_pattern`` after `install`: routes its final value through W and g."""

    _conn: _ConnLayer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pattern = super().__call__(*args, **kwargs)
        conn = self._conn
        if _hooked(conn.walk) or _hooked(conn.gates):
            pattern = _through_walk(pattern, conn.walk, conn.gates)
        if _hooked(conn.messages):
            conn.pattern = pattern
        return pattern


class _KeyAxisName(str):
    """A hook name that TransformerLens's ``run_with_cache(pos_slice=...)`` slices at axis -3.

    TransformerLens picks the position axis of a cached tensor from the *name*: -3 for names
    ending in ``hook_q/k/v/z/result``, else -2, which for ``[batch, key, head, d_model]`` would be
    the head axis. The messages are laid out like ``hook_result``, so this name also claims that
    ending. Deep-copies as itself; pickles as a plain ``str``, so that a pickled cache loads
    without tl_connwalk (`tl_connwalk.hooks.bridge.restore_key_names` renames a Bridge's points).
    """

    def endswith(self, suffix: Any, *args: Any) -> bool:
        suffixes = suffix if isinstance(suffix, tuple) else (suffix,)
        return str.endswith(self, suffix, *args) or (not args and "hook_result" in suffixes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (str(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> "_KeyAxisName":
        return self


class _MessagesHookPoint(HookPoint):
    """``attn.hook_conn_messages``: a HookPoint whose name slices the key axis (see above)."""

    @property
    def name(self) -> str | None:
        name = self.__dict__["_conn_name"]
        return None if name is None else _KeyAxisName(name)

    @name.setter
    def name(self, value: str | None) -> None:
        self.__dict__["_conn_name"] = None if value is None else str(value)


def _through_walk(
    pattern: Float[Tensor, "batch head query key"], walk_point: HookPoint, gates_point: HookPoint
) -> Float[Tensor, "batch head query key"]:
    """Run ``W`` and ``g`` through their hook points; the patterns ``H W' g'`` if either changed.

    Unchanged, the pattern itself comes back (bit for bit); when a backward hook made aliases
    of ``W`` or ``g``, it comes back as ``A + (H W' g' - H W g)``, the same values, with the
    gradient passing through the new points.
    """
    walk, gate = walk_and_gates(pattern)  # one sum over heads for both
    walk_before, gate_before = _snapshot(walk), _snapshot(gate)
    new_walk, new_gate = walk_point(walk), gates_point(gate)
    walk_edited = _edited(walk, new_walk, walk_before, walk_point.name)
    if walk_edited or _edited(gate, new_gate, gate_before, gates_point.name):
        return patterns_from_walk(new_walk, new_gate)
    if new_walk is walk and new_gate is gate:
        return pattern
    return pattern + (patterns_from_walk(new_walk, new_gate) - patterns_from_walk(walk, gate))


def _messages(
    value: Float[Tensor, "batch key kv_head d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "batch key head d_model"]:
    """``m^h_j = v^h_j W_O^h`` from the final value ``v = x W_V + b_V`` (the second half of
    `tl_connwalk.core.walk.head_messages`, which starts from the field ``x``)."""
    n_heads, n_value = W_O.shape[0], value.shape[2]
    if n_value != n_heads:  # grouped-query: head h reads value head h // (H / H_kv)
        value = expand_value_heads(value, grouped_value_heads(n_heads, n_value), dim=2)
    return einsum(
        value.to(W_O.dtype),
        W_O,
        "batch key head d_head, head d_head d_model -> batch key head d_model",
    )


def _apply_message_edits(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
    """Forward hook on the attention module: add ``sum_h A^h (m'^h - m^h)`` to its output."""
    conn: _ConnLayer = module.hook_v.__dict__["_conn"]
    if not _hooked(conn.messages):
        return None
    value, pattern = conn.value, conn.pattern
    conn.value = conn.pattern = None
    if value is None or pattern is None or value.shape[1] != pattern.shape[-1]:
        raise ConnWalkError(
            f"{conn.messages.name} needs the final hook_v value of every key position; it is "
            "not available with past_kv_cache (generation) - run the full sequence instead"
        )
    W_O = cast(Tensor, module.W_O)
    clip = getattr(module.cfg, "clip_qkv", None)
    if clip is not None:  # the attention forward clamps v after hook_v
        value = value.clamp(-clip, clip)
    return _correction(conn, value, pattern, W_O, output)


def _correction(
    conn: _ConnLayer, value: Tensor, pattern: Tensor, W_O: Tensor, output: Tensor
) -> Tensor | None:
    """Run the messages through their point; ``output + sum_h A^h (m'^h - m^h)`` if edited.

    A difference, not ``sum_h A^h m'^h + b_O`` remade from the messages: only the difference
    composes with edits made between ``hook_v`` and the output (``hook_z``, ``hook_result``),
    which the messages do not see. The price: zeroing every message leaves float rounding
    where zeroing ``hook_z`` leaves exact zeros, which Gemma's ``ln1_post`` amplifies (~1e-4
    at the logits).
    """
    messages = _messages(value, W_O)
    before = _snapshot(messages)
    new_messages = conn.messages(messages)
    edited = _edited(messages, new_messages, before, conn.messages.name)
    if not edited and not conn.messages.bwd_hooks:
        return None
    if isinstance(before, Tensor):  # an inference tensor: its values before the hooks
        messages = before
    elif messages._version != before:  # edited in place: recompute the unedited messages
        messages = _messages(value, W_O)
    correction = einsum(
        pattern.to(new_messages.dtype),
        new_messages - messages,
        "batch head query key, batch key head d_model -> batch query d_model",
    )
    return output + correction.to(output.dtype)


def _attention_layers(model: nn.Module) -> tuple[HookedRootModule, dict[str, nn.Module]]:
    if not isinstance(model, HookedRootModule):
        raise ConnWalkError(
            f"tl_connwalk hook points need a HookedTransformer-style model (a HookedRootModule); "
            f"got {type(model).__name__}"
        )
    if _ATTENTION is None:
        raise ConnWalkError("this TransformerLens has no HookedTransformer attention to hook")
    layers = {n: m for n, m in model.mod_dict.items() if isinstance(m, _ATTENTION)}
    if not layers:
        raise ConnWalkError(f"{type(model).__name__} has no attention layers to hook")
    return model, layers


def _carries_points(
    name: str, attn: nn.Module, swapped: tuple[type, type], holder: nn.Module, hook: object
) -> bool:
    """Whether ``attn`` carries our points: ``hook_v``/``hook_pattern`` of the ``swapped``
    classes and ``hook`` among ``holder``'s forward hooks. Refuses states that neither we nor
    TransformerLens made (one plugin's points, another's HookPoint subclass, a lost hook)."""
    value_type, pattern_type = type(attn.hook_v), type(attn.hook_pattern)
    if (value_type, pattern_type) == swapped:
        if hook not in holder._forward_hooks.values():
            raise ConnWalkError(
                f"{name}: its hook points are tl_connwalk's but its forward hook was removed; "
                "rebuild the model or copy it from before the damage"
            )
        return True
    for point, kind in (("hook_v", value_type), ("hook_pattern", pattern_type)):
        if kind is not HookPoint:
            raise ConnWalkError(
                f"{name}.{point} is a {kind.__module__}.{kind.__qualname__}, not a plain "
                "HookPoint: another plugin wraps it. tl_connwalk will not wrap it again; "
                "remove that plugin first (or attach tl_connwalk before it)."
            )
    for point_name in HOOK_NAMES:
        if point_name in attn._modules or point_name in vars(attn):
            raise ConnWalkError(f"{name} already has an attribute {point_name} not made by us")
    return False


def _remove_forward_hook(module: nn.Module, hook: object) -> None:
    """Remove ``hook`` from ``module``'s forward hooks, with PyTorch's bookkeeping of it."""
    for key, registered in list(module._forward_hooks.items()):
        if registered is hook:
            del module._forward_hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)


def _installed(name: str, attn: nn.Module) -> bool:
    return _carries_points(
        name, attn, (_ValueHookPoint, _PatternHookPoint), attn, _apply_message_edits
    )


def install(model: nn.Module) -> None:
    """Add ``hook_conn_walk``, ``hook_conn_gates``, ``hook_conn_messages`` to every attention layer.

    Idempotent. Changes no parameter, buffer or output: until a hook edits one of the new points
    the model computes exactly what it did before. Raises `ConnWalkError` (and changes
    nothing) on a model that is not a ``HookedRootModule``, or whose ``hook_v``/``hook_pattern``
    another plugin already replaced.

    >>> install(hooked_model)
    >>> drop_head_1 = lambda m, hook: m.index_fill(2, torch.tensor([1]), 0.0)
    >>> fwd_hooks = [(hook_name(0, "messages"), drop_head_1)]
    >>> logits = hooked_model.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
    >>> zero_z = [("blocks.0.attn.hook_z", drop_head_1)]  # the same ablation on hook_z
    >>> expected = hooked_model.run_with_hooks(tokens, fwd_hooks=zero_z)
    >>> torch.allclose(logits, expected, atol=1e-5)
    True
    >>> uninstall(hooked_model)
    """
    root, layers = _attention_layers(model)
    todo = [(name, attn) for name, attn in layers.items() if not _installed(name, attn)]
    for name, attn in todo:
        conn = _ConnLayer(HookPoint(), HookPoint(), _MessagesHookPoint())
        for point_name, point in zip(
            HOOK_NAMES, (conn.walk, conn.gates, conn.messages), strict=True
        ):
            full_name = f"{name}.{point_name}"
            point.train(attn.training)  # a model in eval mode stays all in eval mode
            setattr(attn, point_name, point)
            point.name = full_name
            root.hook_dict[full_name] = point
            root.mod_dict[full_name] = point
        attn.hook_v.__class__ = _ValueHookPoint
        attn.hook_pattern.__class__ = _PatternHookPoint
        for swapped in (attn.hook_v, attn.hook_pattern):
            swapped.__dict__["_conn"] = conn
        attn.register_forward_hook(_apply_message_edits)


def uninstall(model: nn.Module) -> None:
    """Undo `install` exactly: classes, submodules, ``hook_dict``/``mod_dict``, forward hook.

    Hooks attached to the new points go with them. A no-op on a model without the points.
    """
    root, layers = _attention_layers(model)
    done = [(name, attn) for name, attn in layers.items() if _installed(name, attn)]
    for name, attn in done:
        _remove_forward_hook(attn, _apply_message_edits)
        for point in (attn.hook_v, attn.hook_pattern):
            point.__class__ = HookPoint
            del point.__dict__["_conn"]
        for point_name in HOOK_NAMES:
            delattr(attn, point_name)
            root.hook_dict.pop(f"{name}.{point_name}", None)
            root.mod_dict.pop(f"{name}.{point_name}", None)
