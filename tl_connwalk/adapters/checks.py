"""Checks every adapter runs on what it reads from a cache, with errors that name the fix."""

import torch
from torch import Tensor

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
    finite = torch.isfinite(pattern)
    if not finite.all():
        heads = (~finite).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        raise ConnWalkError(
            f"layer {layer}: {name} holds NaN or Inf in heads {heads}; the walk is undefined "
            "there. "
            "Check the model's weights and dtype (float16 overflow?) or a hook that edited it."
        )


def check_field(field: Tensor, name: str, d_model: int, n_pos: int) -> None:
    """The field has the model's width and the pattern's positions."""
    if field.shape[-1] != d_model or field.shape[1] != n_pos:
        raise ConnWalkError(
            f"{name} has shape {tuple(field.shape)} [batch, pos, d_model] but the model has "
            f"d_model={d_model} and the pattern {n_pos} positions: was this cache made by "
            "another model? Pass the model that made it: "
            "connection_walk(cache, layer, model=model)."
        )
