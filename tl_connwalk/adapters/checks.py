"""Checks every adapter runs on what it reads from a cache, with errors that name the fix.

Devices: a layer's walk is built and measured on the device of that layer's cached tensors,
which in a model split over devices (``n_devices``, ``device_map``) is the device of the
layer's block. The layer's weights are small (``O(H d_model d_head)``) and are copied there
when they live elsewhere (e.g. a cache moved with ``cache.to("cpu")``). What cannot be
right is a layer whose cached tensors disagree among themselves, or data on one side and
the ``meta`` device (no values: accelerate offload, ``init_empty_weights``) on the other.
"""

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from tl_connwalk.core.isometry import all_finite, has_negative
from tl_connwalk.errors import ConnWalkError


def batched(tensor: Tensor, name: str, has_batch_dim: bool, expected_ndim: int) -> Tensor:
    """``tensor`` with a batch axis, checked to have ``expected_ndim`` axes then."""
    if not has_batch_dim:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim != expected_ndim:
        raise ConnWalkError(
            f"{name} has shape {tuple(tensor.shape)} once batched, expected {expected_ndim} axes; "
            f"the cache says has_batch_dim={has_batch_dim} — does that match its tensors? "
            "Caches from run_with_cache(..., remove_batch_dim=True) hold one sequence."
        )
    return tensor


def check_pattern(pattern: Tensor, name: str, layer: int, n_heads: int) -> None:
    """The pattern belongs to a model with ``n_heads`` heads and holds only finite numbers."""
    if pattern.shape[1] != n_heads or pattern.shape[2] != pattern.shape[3]:
        raise ConnWalkError(
            f"{name} has shape {tuple(pattern.shape)} [batch, head, query, key] but the model has "
            f"{n_heads} heads: was this cache made by another model? Pass the model that made it: "
            "connection_walk(cache, layer, model=model)."
        )
    if pattern.is_meta:  # no values to check (a meta stand-in for a device)
        return
    if not all_finite(pattern):
        heads = _heads_where(~torch.isfinite(pattern))
        raise ConnWalkError(
            f"layer {layer}: {name} holds NaN or Inf in heads {heads}; the walk is undefined "
            "there. Check the model's weights and dtype (float16 overflow?) or a hook that "
            "edited it."
        )
    if has_negative(pattern):
        negative = pattern < 0
        b, h, i, j = negative.nonzero()[0].tolist()
        raise ConnWalkError(
            f"layer {layer}: {name} has negative entries in heads {_heads_where(negative)}, the "
            f"first at batch {b}, head {h}, query {i}, key {j} ({pattern[b, h, i, j].item():.3g})"
            "; attention patterns are probabilities >= 0 and the walk is their head mean "
            "(spec §1). Was the pattern edited by a hook? Run the cache without that hook."
        )


def _heads_where(flags: Tensor) -> list[int]:
    """The heads (axis 1 of ``[batch, head, query, key]``) with any flagged entry."""
    return flags.flatten(2).any(-1).any(0).nonzero().flatten().tolist()


def check_field(field: Tensor, name: str, d_model: int, n_pos: int) -> None:
    """The field has the model's width and the pattern's positions."""
    if field.shape[-1] != d_model or field.shape[1] != n_pos:
        raise ConnWalkError(
            f"{name} has shape {tuple(field.shape)} [batch, pos, d_model] but the model has "
            f"d_model={d_model} and the pattern {n_pos} positions: was this cache made by "
            "another model? Pass the model that made it: "
            "connection_walk(cache, layer, model=model)."
        )


def _where(tensors: Mapping[str, Tensor]) -> str:
    return ", ".join(f"{name} on {tensor.device}" for name, tensor in tensors.items())


def check_layer_devices(
    layer: int, cached: Mapping[str, Tensor], weights: Iterable[tuple[str, Tensor]]
) -> torch.device:
    """The device layer ``layer``'s walk is computed on: that of its ``cached`` tensors.

    ``cached``: the layer's cache entries by hook name; ``weights``: (name, tensor) of the
    layer's attention parameters. ConnWalkError, naming where each tensor is and the fix, when
    the cached tensors are on different devices, or when one side is on ``meta`` (no values)
    and the other is not.
    """
    devices = {tensor.device for tensor in cached.values()}
    if len(devices) > 1:
        raise ConnWalkError(
            f"layer {layer}: its cached tensors are on different devices ({_where(cached)}); "
            "a layer's walk is computed where its cache entries are, so they must share one. "
            "Was part of the cache moved? Move all of it, `cache = cache.to(device)`, or re-run "
            "`model.run_with_cache(tokens, names_filter=...)`."
        )
    (device,) = devices
    params = dict(weights)
    meta = {name: tensor for name, tensor in params.items() if tensor.is_meta}
    if meta and device.type != "meta":
        raise ConnWalkError(
            f"layer {layer}: its attention weights are on the meta device, without values "
            f"({_where(meta)}), while its cache is on {device}: the model was loaded with "
            "offloaded or empty weights (accelerate `device_map` with 'cpu'/'disk' offload, "
            "`init_empty_weights`). Load it with every layer on a real device (a `device_map` "
            "over GPUs only, or `n_devices`), then run the cache again."
        )
    real = {name: tensor for name, tensor in params.items() if not tensor.is_meta}
    if device.type == "meta" and real:
        raise ConnWalkError(
            f"layer {layer}: its cache entries are meta tensors without values "
            f"({_where(cached)}) but its weights hold data ({_where(real)}): make the cache with "
            "this model, `model.run_with_cache(tokens)`, on real devices."
        )
    return device
