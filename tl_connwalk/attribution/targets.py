"""What an attribution explains: the scalar ``y`` read from a model's output (spec §6).

A target is a token's logit, a logit difference between two tokens, or a direction ``u`` read
from the final residual stream, ``u . r_final`` (``r_final``: the residual after the last
block, before the final norm, as ``blocks.{L-1}.hook_resid_post`` holds it), at one position
per sequence. A logit soft cap (``cfg.output_logits_soft_cap``) is a nonlinearity too: the
frozen network holds it as the gain ``cap(l*)/l*`` of the clean logit ``l*``.
"""

import dataclasses
from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from tl_connwalk.errors import ConnWalkError

#: what ``attribute(target=...)`` accepts
TargetSpec = int | Tensor | tuple[int | Tensor, int | Tensor] | None


@dataclasses.dataclass(frozen=True)
class Target:
    """A resolved target: ``kind`` and, per sequence, the tokens or the direction.

    Attributes:
        kind: ``"logit"``, ``"logit_diff"`` (``logit(token) - logit(other)``) or
            ``"direction"`` (``direction . r_final``).
        position: ``[batch]`` the position read in each sequence (non-negative).
        token: ``[batch]`` the token whose logit is read (logit kinds).
        other: ``[batch]`` the token subtracted (``"logit_diff"``).
        direction: ``[batch, d_model]`` (``"direction"``).
    """

    kind: Literal["logit", "logit_diff", "direction"]
    position: Int[Tensor, " batch"]
    token: Int[Tensor, " batch"] | None = None
    other: Int[Tensor, " batch"] | None = None
    direction: Float[Tensor, "batch d_model"] | None = None

    def describe(self) -> list[str]:
        """One short label per sequence, e.g. ``logit[17] @ 8``."""
        labels = []
        for b, pos in enumerate(self.position.tolist()):
            if self.kind == "direction":
                labels.append(f"direction @ {pos}")
            elif self.kind == "logit":
                labels.append(f"logit[{self.token[b]}] @ {pos}")  # type: ignore[index]
            else:
                labels.append(
                    f"logit[{self.token[b]}] - logit[{self.other[b]}] @ {pos}"  # type: ignore[index]
                )
        return labels


def _ids(value: int | Tensor, batch: int, d_vocab: int, what: str) -> Tensor:
    ids = torch.as_tensor(value)
    if ids.is_floating_point() or ids.ndim > 1 or ids.numel() not in (1, batch):
        raise ConnWalkError(
            f"{what} must be a token id or one id per sequence ([{batch}] integers), got "
            f"{tuple(ids.shape)} {ids.dtype}."
        )
    ids = ids.reshape(-1).expand(batch).long()
    if ((ids < 0) | (ids >= d_vocab)).any():
        raise ConnWalkError(f"{what} {ids.tolist()} is out of the vocabulary (0..{d_vocab - 1}).")
    return ids


def _positions(position: int | Tensor, batch: int, n_pos: int) -> Tensor:
    pos = torch.as_tensor(position)
    if pos.is_floating_point() or pos.ndim > 1 or pos.numel() not in (1, batch):
        raise ConnWalkError(
            f"position must be an int or one per sequence ([{batch}] integers), got {position!r}."
        )
    pos = pos.reshape(-1).expand(batch).long()
    if ((pos < -n_pos) | (pos >= n_pos)).any():
        raise ConnWalkError(
            f"position {pos.tolist()} is out of range for {n_pos} positions "
            f"(valid: 0..{n_pos - 1}, or -{n_pos}..-1 counted from the end)."
        )
    return pos % n_pos


def resolve(
    target: TargetSpec, position: int | Tensor, logits: Float[Tensor, "batch pos d_vocab"]
) -> Target:
    """``target`` and ``position`` checked against the clean logits, as a `Target`."""
    batch, n_pos, d_vocab = logits.shape
    pos = _positions(position, batch, n_pos).to(logits.device)
    if target is None:
        top = logits[torch.arange(batch, device=logits.device), pos].argmax(-1)
        return Target("logit", pos, token=top)
    if isinstance(target, tuple):
        if len(target) != 2:
            raise ConnWalkError(
                f"a logit difference is (token, other token), got a tuple of {len(target)}."
            )
        token, other = (_ids(t, batch, d_vocab, "target").to(pos.device) for t in target)
        return Target("logit_diff", pos, token=token, other=other)
    if isinstance(target, Tensor) and target.is_floating_point():
        if target.ndim not in (1, 2) or (target.ndim == 2 and target.shape[0] not in (1, batch)):
            raise ConnWalkError(
                f"a direction target is [d_model] or [batch, d_model], got {tuple(target.shape)}."
            )
        direction = target.reshape(-1, target.shape[-1]).expand(batch, -1)
        return Target("direction", pos, direction=direction.to(logits.device))
    if isinstance(target, int | Tensor) and not isinstance(target, bool):
        return Target("logit", pos, token=_ids(target, batch, d_vocab, "target").to(pos.device))
    raise ConnWalkError(
        "target must be None (the top token), a token id, (token, other token) for a logit "
        f"difference, or a float direction [d_model]; got {type(target).__name__}."
    )


def read(
    target: Target,
    unembed: nn.Module,
    unembed_input: Float[Tensor, "batch pos d_model"] | None,
    final_resid: Float[Tensor, "batch pos d_model"],
    soft_cap: float,
    cap_gain: Float[Tensor, "batch 2"] | None = None,
) -> tuple[Float[Tensor, " batch"], Float[Tensor, "batch 2"]]:
    """``y`` per sequence, and the soft-cap gains ``cap(l)/l`` of the logits it read.

    ``cap_gain``: frozen gains to use (from the clean run) instead of this run's own.
    """
    rows = torch.arange(target.position.shape[0], device=final_resid.device)
    if target.kind == "direction":
        resid = final_resid[rows, target.position]
        y = (resid * target.direction.to(resid)).sum(-1)  # type: ignore[union-attr]
        return y, torch.ones(len(rows), 2, dtype=y.dtype, device=y.device)
    if unembed_input is None:
        raise ConnWalkError("the model's unembedding did not run; no logit can be read.")
    logits = unembed(unembed_input[rows, target.position][:, None])[:, 0]
    assert target.token is not None  # a logit kind
    ids = torch.stack([target.token, target.token if target.other is None else target.other], 1)
    picked = logits.gather(1, ids.to(logits.device))
    if cap_gain is None:
        cap_gain = torch.ones_like(picked)
        if soft_cap > 0:
            capped = soft_cap * torch.tanh(picked / soft_cap)
            cap_gain = torch.where(picked == 0, cap_gain, capped / picked).detach()
    picked = picked * cap_gain
    y = picked[:, 0] - picked[:, 1] if target.kind == "logit_diff" else picked[:, 0]
    return y, cap_gain


def clean_value(
    target: Target,
    logits: Float[Tensor, "batch pos d_vocab"],
    final_resid: Float[Tensor, "batch pos d_model"],
) -> Float[Tensor, " batch"]:
    """``y`` read off the clean run's own outputs (the model's logits, the cached residual)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    if target.kind == "direction":
        resid = final_resid[rows, target.position]
        return (resid * target.direction.to(resid)).sum(-1)  # type: ignore[union-attr]
    at = logits[rows, target.position]
    y = at[rows, target.token]
    return y - at[rows, target.other] if target.kind == "logit_diff" else y
