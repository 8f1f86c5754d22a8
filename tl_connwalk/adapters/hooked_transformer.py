"""Adapter for TransformerLens ``HookedTransformer`` and ``HookedEncoder`` (spec §0).

Both classes exist in TransformerLens 3.x and were removed in 4.0; there ``supports`` is
always false. The field ``x_j`` is exactly the vector the value projection reads:

- LayerNorm folded (``LNPre``/``RMSPre``): ``blocks.{l}.ln1.hook_normalized``;
- unfolded ``LN``/``RMS``: that times ``ln1.w`` (plus ``ln1.b``) where the hook sits before
  the affine part (TransformerLens 3.x; 2.x's ``LayerNorm`` hooks after it, and the hook is
  then the field as it is);
- no normalisation, post-norm architectures (OLMo 2/3) and ``HookedEncoder`` (BERT
  normalises after each sublayer): ``blocks.{l}.hook_resid_pre``.

Patterns are ``blocks.{l}.attn.hook_pattern``; weights are read from the model when the walk is
built (grouped-query layers pass their unexpanded ``_W_V``, ``_b_V``: query head ``h`` reads
KV head ``h // (n_heads / n_key_value_heads)``, ``ConnectionWalk.kv_heads``). A user hook
that edits ``hook_v`` is not seen by the field: the walk describes the weights acting on the
layer's input.
"""

import importlib
from typing import TYPE_CHECKING, Any, cast

import torch
import transformer_lens
from torch import Tensor, nn
from transformer_lens import ActivationCache

from tl_connwalk.adapters.checks import batched, check_field, check_pattern
from tl_connwalk.adapters.versions import transformer_lens_version
from tl_connwalk.adapters.weights import inferred_processing
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import ConnectionWalk

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

NAME = "transformer_lens.HookedTransformer and HookedEncoder (TransformerLens 3.x)"


def _optional_class(name: str) -> Any:
    """``transformer_lens.<name>``, or None where this release removed it.

    TransformerLens 4.x raises ImportError (not AttributeError) for its removed classes.
    """
    try:
        return getattr(transformer_lens, name, None)
    except ImportError:
        return None


_HOOKED_TRANSFORMER: Any = _optional_class("HookedTransformer")
_HOOKED_ENCODER: Any = _optional_class("HookedEncoder")
_CLASSES: tuple[type, ...] = tuple(c for c in (_HOOKED_TRANSFORMER, _HOOKED_ENCODER) if c)


def _post_norm_architectures() -> frozenset[str]:
    """Architectures whose ln1 normalises the attention *output* (none before TransformerLens 3)."""
    try:
        architectures = importlib.import_module("transformer_lens.utilities.architectures")
    except ImportError:  # TransformerLens 2.x: no post-norm decoders
        return frozenset()
    return frozenset(getattr(architectures, "POST_NORM_ARCHITECTURES", ()))


#: Architectures whose ln1 normalises the attention *output*; their value input is the residual.
POST_NORM_ARCHITECTURES: frozenset[str] = _post_norm_architectures()


def supports(model: nn.Module) -> bool:
    return isinstance(model, _CLASSES)


def _hooked(model: nn.Module) -> "HookedTransformer":
    """``model`` as the classes this adapter serves share it (``supports`` was checked)."""
    return cast("HookedTransformer", model)


def n_layers(model: nn.Module) -> int:
    return int(_hooked(model).cfg.n_layers)


def _field_hook(model: nn.Module, layer: int) -> str:
    cfg = _hooked(model).cfg
    post_norm = cfg.original_architecture in POST_NORM_ARCHITECTURES
    if cfg.normalization_type is None or post_norm or is_encoder(model):
        return f"blocks.{layer}.hook_resid_pre"
    return f"blocks.{layer}.ln1.hook_normalized"


def is_encoder(model: nn.Module) -> bool:
    """Whether ``model`` is a ``HookedEncoder`` (never on TransformerLens 4.x)."""
    return _HOOKED_ENCODER is not None and isinstance(model, _HOOKED_ENCODER)


def check_supported(model: nn.Module, layer: int) -> None:
    """Every attention layer of these classes has per-head value and output maps: no-op."""


def required_hooks(model: nn.Module, layer: int) -> list[str]:
    """The cache entries one layer's walk is built from."""
    return [f"blocks.{layer}.attn.hook_pattern", _field_hook(model, layer)]


def processing(model: nn.Module, layer: int) -> dict[str, bool]:
    """The weight processing the model had, read off its config and one layer's weights (spec §2).

    TransformerLens does not record it, so ``center_writing_weights`` and
    ``fold_value_biases`` are inferred: every ``W_O`` output centred, every ``b_V`` zero.
    """
    attn = _hooked(model).blocks[layer].attn
    return {
        "fold_ln": str(_hooked(model).cfg.normalization_type).endswith("Pre"),
        **inferred_processing(attn.W_O.detach(), attn.b_V.detach()),
    }


def _value_input(cache: ActivationCache, model: nn.Module, layer: int, n_pos: int) -> Tensor:
    """The field the layer's values read, checked against the model's width and the pattern's
    ``n_pos`` positions before the LayerNorm's weight meets it."""
    name = _field_hook(model, layer)
    cfg = _hooked(model).cfg
    per_head = name.endswith("hook_normalized") and (cfg.use_split_qkv_input or cfg.use_attn_in)
    x = batched(cache[name], name, cache.has_batch_dim, 4 if per_head else 3)
    if per_head:
        # use_split_qkv_input / use_attn_in: one copy of the input per (KV) head
        if not torch.equal(x, x[:, :, :1].expand_as(x)):
            raise ConnWalkError(
                f"layer {layer}: {name} differs between heads (a patched per-head input), so the "
                "heads do not read one common field and there is no single connection walk."
            )
        x = x[:, :, 0]
    check_field(x, name, cfg.d_model, n_pos)
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    ln1 = _hooked(model).blocks[layer].ln1
    weight, bias = getattr(ln1, "w", None), getattr(ln1, "b", None)
    if (
        name.endswith("hook_normalized")
        and isinstance(weight, Tensor)
        and not _normalized_includes_affine(ln1)
    ):
        x = x * weight.detach().to(x)
        if isinstance(bias, Tensor):
            x = x + bias.detach().to(x)
    return x


def _normalized_includes_affine(norm: nn.Module) -> bool:
    """Whether ``norm.hook_normalized`` sees ``norm``'s output, affine part included.

    TransformerLens 2.x's ``LayerNorm`` hooks ``x * w + b``; its ``RMSNorm`` and every 3.x norm
    hook before the affine part. Decided by the class and the version, never by running the
    norm (whose weights may hide the difference: ``w = 1, b = 0`` at initialisation).
    """
    if not transformer_lens_version().startswith("2."):
        return False
    components = importlib.import_module("transformer_lens.components")
    return isinstance(norm, components.LayerNorm)


def pattern_from_cache(cache: ActivationCache, model: nn.Module, layer: int) -> Tensor:
    """Layer ``layer``'s patterns ``[batch, head, query, key]``, checked (hook: by the caller)."""
    name = f"blocks.{layer}.attn.hook_pattern"
    pattern = batched(cache[name], name, cache.has_batch_dim, 4)
    check_pattern(pattern, name, layer, _hooked(model).cfg.n_heads)
    return pattern


def walk_from_cache(cache: ActivationCache, model: nn.Module, layer: int) -> ConnectionWalk:
    """Layer ``layer``'s connection walk from a cache of ``model`` (hooks checked by the caller)."""
    pattern = pattern_from_cache(cache, model, layer)
    field = _value_input(cache, model, layer, pattern.shape[-1])
    attn = _hooked(model).blocks[layer].attn
    # grouped-query attention keeps one value head per key-value head: the walk expands them
    names = ("_W_V", "_b_V") if hasattr(attn, "_W_V") else ("W_V", "b_V")
    W_V, b_V = (getattr(attn, name).detach() for name in names)
    return ConnectionWalk.from_pattern(
        pattern,
        field,
        W_V,
        attn.W_O.detach(),
        b_V,
        attn.b_O.detach(),
        layer=layer,
        processing=processing(model, layer),
    )
