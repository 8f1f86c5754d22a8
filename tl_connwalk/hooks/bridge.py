"""The connection-walk hook points on a ``TransformerBridge`` (3.x and 4.x, either mode).

The same three points as `tl_connwalk.hooks` (``blocks.{l}.attn.hook_conn_walk``,
``hook_conn_gates``, ``hook_conn_messages``), by the same mechanism, placed where the Bridge
computes attention:

- ``attn.hook_v`` (the same HookPoint as ``attn.v.hook_out``, in both modes) and
  ``attn.hook_pattern`` get a subclass (``__class__`` swap) that runs every user hook and then
  hands the final value on; an edited walk ``W'`` or gates ``g'`` make the layer use the
  patterns ``A^h = H W' g'^h``;
- the message correction ``sum_h A^h (m'^h - m^h)`` is a forward hook on the output projection
  ``attn.o``: it lands on ``attn.o.hook_out``'s final value (after user hooks there, as on
  ``HookedTransformer`` after ``hook_z``), before Gemma's ``ln1_post``, which ``attn.hook_out``
  already includes;
- the points are registered on the component (its ``_hook_registry``) and in the Bridge's
  private ``_hook_registry``, which ``bridge.hook_dict`` copies; ``enable_compatibility_mode()``
  rescans and finds them under the same names. ``run_with_cache(pos_slice=...)`` slices the
  query axis of the walk and gates and the key axis of the messages, in 3.x and 4.x;
- with no hook on a point, nothing is computed: each swapped call only checks for hooks.

Where the Bridge fires ``hook_pattern`` only *after* the attention output (BERT's
``AttentionBridge`` reads the weights Hugging Face returns), the points can be read and cached,
but an edit cannot reach the forward pass: it raises `ConnWalkError`.
"""

from typing import Any, cast

import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from tl_connwalk.adapters.bridge import unsupported
from tl_connwalk.adapters.versions import TransformerBridge, is_bridge
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks.hooked_transformer import (
    HOOK_NAMES,
    _carries_points,
    _ConnLayer,
    _correction,
    _edited,
    _hooked,
    _KeyAxisName,
    _messages,
    _MessagesHookPoint,
    _remove_forward_hook,
    _snapshot,
    _through_walk,
)

_CONN = "_tl_connwalk_conn"


class _BridgeConn(_ConnLayer):
    """One layer's points, its attention component, and whether its output is already made."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__(HookPoint(), HookPoint(), _MessagesHookPoint())
        self.attn = attn
        self.output_done = False


def _late_edit(conn: _BridgeConn, what: str) -> ConnWalkError:
    return ConnWalkError(
        f"{str(conn.walk.name).rsplit('.', 1)[0]}: a hook edited {what}, but on this "
        f"architecture TransformerLens's Bridge fires {type(conn.attn).__name__}.hook_pattern "
        "after the attention output is computed, so the edit cannot change the forward pass. "
        "Read these points with run_with_cache only, or edit attn.hook_z / attn.o.hook_out."
    )


class _BridgeValueHookPoint(HookPoint):
    """``attn.hook_v`` after `install`: keeps its final value for the messages point."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value = super().__call__(*args, **kwargs)
        conn: _BridgeConn = self.__dict__[_CONN]
        conn.output_done = False
        if _hooked(conn.messages):
            # the Bridge shows hooks [batch, pos, head, d_head] but may carry [batch, pos, -1]
            conn.value = value if value.ndim == 4 else value.unflatten(-1, (-1, _d_head(conn)))
        return value


class _BridgePatternHookPoint(HookPoint):
    """``attn.hook_pattern`` after `install`: routes its final value through W and g."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pattern = super().__call__(*args, **kwargs)
        conn: _BridgeConn = self.__dict__[_CONN]
        late = conn.output_done
        conn.output_done = False
        if _hooked(conn.walk) or _hooked(conn.gates):
            routed = _through_walk(pattern, conn.walk, conn.gates)
            if late and routed is not pattern and not torch.equal(routed, pattern):
                raise _late_edit(conn, "the walk or gates")
            pattern = routed
        if _hooked(conn.messages):
            if late:  # the output is made: messages can only be read
                value, conn.value = conn.value, None
                if value is not None:
                    messages = _messages(value, _W_O(conn))
                    before = _snapshot(messages)
                    if _edited(messages, conn.messages(messages), before, conn.messages.name):
                        raise _late_edit(conn, "the messages")
            else:
                conn.pattern = pattern
        return pattern


def _W_O(conn: _BridgeConn) -> Tensor:
    """``W_O`` as ``[head, d_head, d_model]``."""
    return cast(Tensor, conn.attn.W_O)


def _d_head(conn: _BridgeConn) -> int:
    return int(_W_O(conn).shape[1])


def _apply_message_edits(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
    """Forward hook on ``attn.o``: add ``sum_h A^h (m'^h - m^h)`` to the projection's output."""
    conn: _BridgeConn = module.__dict__[_CONN]
    if not _hooked(conn.messages):
        return None
    if conn.pattern is None:  # hook_pattern comes after the output (BERT): read it there
        conn.output_done = True
        return None
    value, pattern = conn.value, conn.pattern
    conn.value = conn.pattern = None
    W_O = _W_O(conn)
    if value is not None and (value.shape[-1] != W_O.shape[1] or W_O.shape[0] % value.shape[2]):
        raise ConnWalkError(
            f"{conn.messages.name}: {type(conn.attn).__name__}.hook_v carries shape "
            f"{tuple(value.shape)}, not [batch, pos, kv_head, d_head] with d_head {W_O.shape[1]} "
            f"and kv_head dividing {W_O.shape[0]} heads, so the messages cannot be built on "
            "this architecture; cache hook_conn_walk and hook_conn_gates only"
        )
    if value is None or value.shape[1] != pattern.shape[-1]:
        raise ConnWalkError(
            f"{conn.messages.name} needs the final hook_v value of every key position; it is "
            "not available with a KV cache (generation) - run the full sequence instead"
        )
    return _correction(conn, value, pattern, W_O, output)


def _mark_output(module: nn.Module, args: Any, output: Tensor) -> None:
    """Forward hook on ``attn.o`` when no messages hook is on: note the output is made."""
    conn: _BridgeConn = module.__dict__[_CONN]
    if conn.pattern is None and (_hooked(conn.walk) or _hooked(conn.gates)):
        conn.output_done = True


def _on_output(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
    if _hooked(module.__dict__[_CONN].messages):
        return _apply_message_edits(module, args, output)
    _mark_output(module, args, output)
    return None


def _projection(attn: nn.Module) -> nn.Module:
    """The attention component's output projection ``attn.o`` (checked by `_check_components`)."""
    return cast(nn.Module, attn._modules["o"])


def _check_components(layers: list[tuple[str, nn.Module]]) -> None:
    """Refuse, before anything changes, attention components the points cannot be placed on."""
    for name, attn in layers:
        missing = [
            what
            for what, ok in (
                ("hook_v", isinstance(getattr(attn, "hook_v", None), HookPoint)),
                ("hook_pattern", isinstance(getattr(attn, "hook_pattern", None), HookPoint)),
                ("output projection o", isinstance(attn._modules.get("o"), nn.Module)),
            )
            if not ok
        ]
        if missing:
            raise ConnWalkError(
                f"{name} is a {type(attn).__name__} with no {' and no '.join(missing)}: "
                "TransformerLens runs this attention as one opaque module, so tl_connwalk has "
                "nowhere to place its hook points. Supported: attention components with hook_v "
                "[batch, pos, kv_head, d_head], hook_pattern [batch, head, query, key] and an "
                "output projection o (TransformerLens's AttentionBridge and its subclasses such as "
                "JointQKVAttentionBridge and PositionEmbeddingsAttentionBridge)."
            )


def _bridge(model: nn.Module) -> TransformerBridge:
    if not is_bridge(model):
        raise ConnWalkError(f"expected a TransformerBridge, got {type(model).__name__}")
    return cast(TransformerBridge, model)


def _installed(name: str, attn: nn.Module) -> bool:
    swapped = (_BridgeValueHookPoint, _BridgePatternHookPoint)
    return _carries_points(name, attn, swapped, _projection(attn), _on_output)


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    bridge = _bridge(model)
    blocks = getattr(bridge, "blocks", None)
    attns = [getattr(block, "attn", None) for block in blocks or ()]
    if not attns or not all(isinstance(attn, nn.Module) for attn in attns):
        stacks = [name for name in ("encoder_blocks", "decoder_blocks") if hasattr(bridge, name)]
        kind = (
            f"an encoder-decoder model (layers {' and '.join(stacks)}, with cross-attention)"
            if stacks
            else "a model"
        )
        raise ConnWalkError(
            f"this {type(bridge).__name__} is {kind} without attention layers blocks.{{l}}.attn "
            "to hook: tl_connwalk supports decoder-only and encoder-only models, whose "
            "self-attention layers are blocks.{l}.attn."
        )
    return [(f"blocks.{i}.attn", cast(nn.Module, attn)) for i, attn in enumerate(attns)]


def install(model: nn.Module) -> None:
    """Add the three conn hook points to every attention layer of a Bridge. Idempotent.

    Where the attention has no per-head value and output maps (multi-head latent attention,
    `tl_connwalk.adapters.bridge.unsupported`), ``hook_conn_messages`` is absent and
    ``hook_conn_walk``, ``hook_conn_gates`` work from the patterns. Raises `ConnWalkError`, and
    changes nothing, on attention components without ``hook_v``, ``hook_pattern`` or an output
    projection ``o`` (opaque attention such as the pretrain adapter's).
    """
    bridge = _bridge(model)
    layers = _layers(bridge)
    _check_components(layers)
    todo = [
        (layer, name, attn)
        for layer, (name, attn) in enumerate(layers)
        if not _installed(name, attn)
    ]
    for layer, name, attn in todo:
        conn = _BridgeConn(attn)
        points = [conn.walk, conn.gates, conn.messages]
        if unsupported(bridge, layer) is not None:
            points.pop()  # no value and output maps: the messages point is absent
        for point_name, point in zip(HOOK_NAMES, points, strict=False):
            point.train(attn.training)  # a model in eval mode stays all in eval mode
            setattr(attn, point_name, point)  # also enters the component's _hook_registry
            point.name = f"{name}.{point_name}"
            # pos_slice: TL 3.x reads the position axis off the registry key (the messages'
            # key claims the hook_result ending: axis -3), 4.x off ``pos_dim`` (else axis 1)
            point.__dict__["pos_dim"] = 1 if point is conn.messages else -2
            key = _KeyAxisName(point.name) if point is conn.messages else str(point.name)
            bridge._hook_registry[key] = point
        attn.hook_v.__class__ = _BridgeValueHookPoint
        attn.hook_pattern.__class__ = _BridgePatternHookPoint
        for holder in (attn.hook_v, attn.hook_pattern, _projection(attn)):
            holder.__dict__[_CONN] = conn
        _projection(attn).register_forward_hook(_on_output)


def restore_key_names(registry: dict[str, Any]) -> None:
    """Give the messages points of an unpickled Bridge's hook registry their `_KeyAxisName` keys.

    TransformerLens 3.x reads the position axis of ``run_with_cache(pos_slice=...)`` off the
    key, and `_KeyAxisName` pickles as a plain ``str``. The entries keep their order.
    """
    entries = list(registry.items())
    registry.clear()
    registry.update(
        (_KeyAxisName(name) if name.endswith(HOOK_NAMES[2]) else name, point)
        for name, point in entries
    )


def uninstall(model: nn.Module) -> None:
    """Undo `install` exactly; hooks attached to the new points go with them."""
    bridge = _bridge(model)
    done = [(name, attn) for name, attn in _layers(bridge) if _installed(name, attn)]
    for name, attn in done:
        o = _projection(attn)
        _remove_forward_hook(o, _on_output)
        for point in (attn.hook_v, attn.hook_pattern):
            point.__class__ = HookPoint
        for holder in (attn.hook_v, attn.hook_pattern, o):
            del holder.__dict__[_CONN]
        for point_name in HOOK_NAMES:
            attn._modules.pop(point_name, None)
            cast(dict[str, HookPoint], attn._hook_registry).pop(point_name, None)
            bridge._hook_registry.pop(f"{name}.{point_name}", None)
