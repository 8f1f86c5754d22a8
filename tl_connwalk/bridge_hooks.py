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
from transformer_lens.model_bridge import TransformerBridge

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks import (
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
    if value is None or value.shape[1] != pattern.shape[-1]:
        raise ConnWalkError(
            f"{conn.messages.name} needs the final hook_v value of every key position; it is "
            "not available with a KV cache (generation) - run the full sequence instead"
        )
    return _correction(conn, value, pattern, _W_O(conn), output)


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
    """The attention component's output projection ``attn.o``."""
    return cast(nn.Module, attn.o)


def _bridge(model: nn.Module) -> TransformerBridge:
    if not isinstance(model, TransformerBridge):
        raise ConnWalkError(f"expected a TransformerBridge, got {type(model).__name__}")
    return model


def _installed(name: str, attn: nn.Module) -> bool:
    swapped = (_BridgeValueHookPoint, _BridgePatternHookPoint)
    return _carries_points(name, attn, swapped, _projection(attn), _on_output)


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"blocks.{i}.attn", block.attn) for i, block in enumerate(_bridge(model).blocks)]


def install(model: nn.Module) -> None:
    """Add the three conn hook points to every attention layer of a Bridge. Idempotent."""
    bridge = _bridge(model)
    todo = [(name, attn) for name, attn in _layers(bridge) if not _installed(name, attn)]
    for name, attn in todo:
        conn = _BridgeConn(attn)
        for point_name, point in zip(
            HOOK_NAMES, (conn.walk, conn.gates, conn.messages), strict=True
        ):
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
            del attn._modules[point_name]
            cast(dict[str, HookPoint], attn._hook_registry).pop(point_name, None)
            bridge._hook_registry.pop(f"{name}.{point_name}", None)
