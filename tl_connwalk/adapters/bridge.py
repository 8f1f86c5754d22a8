"""Adapter for TransformerLens ``TransformerBridge`` (3.x and 4.x, compatibility mode or not).

The Bridge wraps a Hugging Face model. Its attention component's input hook
``blocks.{l}.attn.hook_in`` is exactly the value input in every architecture and both modes
(after ``ln1`` in pre-norm models; the residual stream in post-norm encoders such as BERT),
so it is the field. Patterns are ``blocks.{l}.attn.hook_pattern`` (padding-masked keys carry
zero weight, so an encoder's walk is over its unmasked keys). The Bridge's ``attn.W_V`` /
``b_V`` keep the unexpanded key-value heads of grouped-query models; the walk expands them
and records which value head each query head reads (``ConnectionWalk.kv_heads``).
Missing biases (Llama, Gemma) are zero. The attention's own output is
``blocks.{l}.attn.o.hook_out``; ``blocks.{l}.attn.hook_out`` is the same in most architectures,
but after ``ln1_post`` in Gemma 2/3 and with the residual stream added in BLOOM (whose attention
module adds it).
"""

from typing import cast

import torch
from torch import Tensor, nn
from transformer_lens import ActivationCache

from tl_connwalk.adapters.checks import batched, check_field, check_pattern
from tl_connwalk.adapters.versions import TransformerBridge, is_bridge
from tl_connwalk.adapters.weights import inferred_processing
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk

NAME = "transformer_lens.model_bridge.TransformerBridge"


def supports(model: nn.Module) -> bool:
    return is_bridge(model)


def _bridge(model: nn.Module) -> TransformerBridge:
    return cast(TransformerBridge, model)


def n_layers(model: nn.Module) -> int:
    return int(_bridge(model).cfg.n_layers)


def required_hooks(model: nn.Module, layer: int) -> list[str]:
    """The cache entries one layer's walk is built from."""
    return [f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_in"]


def unsupported(model: nn.Module, layer: int) -> str | None:
    """Why layer ``layer``'s connection walk cannot be built on this Bridge, in the terms of its
    architecture; None when it can.

    The walk's transports and messages need the attention's per-head value and output maps
    ``W_V`` ``[kv_head, d_model, d_head]`` and ``W_O`` ``[head, d_head, d_model]`` (spec §1.2),
    which TransformerLens does not expose on opaque attention components (no output projection
    ``o``, e.g. the pretrain adapter's ``NativeForwardAttentionBridge``) nor on multi-head latent
    attention (``MLAAttentionBridge``: values come from a normalised latent, not a linear map of
    the field).
    """
    attn = _bridge(model).blocks[layer].attn
    if any(param.is_meta for param in attn.parameters()):
        return None  # offloaded weights: `checks.check_layer_devices` says what to do
    where = f"blocks.{layer}.attn ({type(attn).__name__})"
    if not isinstance(attn._modules.get("o"), nn.Module):
        return (
            f"{where} has no output projection `o`: TransformerLens runs this attention as one "
            "opaque module, so its patterns and its value and output maps cannot be reached"
        )
    try:
        W_V, W_O = attn.W_V, attn.W_O
    except Exception as error:  # whatever this architecture's accessors raise
        return f"{where} has no per-head value and output maps W_V, W_O: {str(error).rstrip('.')}"
    shapes_ok = (
        isinstance(W_V, Tensor)
        and isinstance(W_O, Tensor)
        and W_V.ndim == W_O.ndim == 3
        and W_V.shape[1] == W_O.shape[2]
        and W_V.shape[2] == W_O.shape[1]
        and W_O.shape[0] % W_V.shape[0] == 0
    )
    if not shapes_ok:
        return (
            f"{where} shows W_V {tuple(getattr(W_V, 'shape', ()))} and W_O "
            f"{tuple(getattr(W_O, 'shape', ()))}, not [kv_head, d_model, d_head] and "
            "[head, d_head, d_model]"
        )
    return None


def check_supported(model: nn.Module, layer: int) -> None:
    """Raise `ConnWalkError` saying why, when layer ``layer``'s connection walk cannot be built."""
    reason = unsupported(model, layer)
    if reason is not None:
        raise ConnWalkError(
            f"no connection walk for layer {layer}: {reason}. On this architecture only the "
            f"walk and gates are available (tl_connwalk.walk_matrix(cache, {layer}), and the "
            "hook points hook_conn_walk and hook_conn_gates where the attention has patterns)."
        )


def _weights(model: nn.Module, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``W_V, W_O, b_V, b_O`` of one layer (``W_V``, ``b_V`` per key-value head), absent biases
    as zeros."""
    attn = _bridge(model).blocks[layer].attn
    W_O = attn.W_O.detach()
    W_V = attn.W_V.detach()
    _, d_model, d_head = W_V.shape
    b_V = attn.b_V
    b_V = torch.zeros(W_V.shape[0], d_head) if b_V is None else b_V.detach()
    b_O = attn.b_O
    b_O = torch.zeros(d_model) if b_O is None else b_O.detach()
    return W_V, W_O, b_V, b_O


def processing(model: nn.Module, W_O: Tensor, b_V: Tensor) -> dict[str, bool]:
    """The Bridge's mode and the weight processing a layer's ``W_O`` and ``b_V`` (from
    `_weights`: absent biases as zeros) show (spec §2)."""
    bridge = _bridge(model)
    return {
        "compatibility_mode": bool(getattr(bridge, "compatibility_mode", False)),
        "weights_processed": bool(getattr(bridge, "_weights_processed", False)),
        **inferred_processing(W_O, b_V),
    }


def pattern_from_cache(cache: ActivationCache, model: nn.Module, layer: int) -> Tensor:
    """Layer ``layer``'s patterns ``[batch, head, query, key]``, checked (hook: by the caller)."""
    name = required_hooks(model, layer)[0]
    pattern = batched(cache[name], name, cache.has_batch_dim, 4)
    check_pattern(pattern, name, layer, int(_bridge(model).cfg.n_heads))
    return pattern


def walk_from_cache(cache: ActivationCache, model: nn.Module, layer: int) -> ConnectionWalk:
    """Layer ``layer``'s connection walk from a cache of ``model`` (support and hooks checked
    by the caller: `check_supported`, `required_hooks`)."""
    field_name = required_hooks(model, layer)[1]
    pattern = pattern_from_cache(cache, model, layer)
    field = batched(cache[field_name], field_name, cache.has_batch_dim, 3)
    W_V, W_O, b_V, b_O = _weights(model, layer)
    check_field(field, field_name, W_O.shape[2], pattern.shape[-1])
    return ConnectionWalk.from_pattern(
        pattern, field, W_V, W_O, b_V, b_O, layer=layer, processing=processing(model, W_O, b_V)
    )
