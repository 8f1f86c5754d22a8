"""What an attribution explains: the scalar ``y`` read from a model (spec §6).

A target is a token's logit, a logit difference between two tokens, a direction ``u`` read
from the final residual stream, ``u . r_final`` (``r_final``: the residual after the last
block, before the final norm, as ``blocks.{L-1}.hook_resid_post`` holds it), or a scalar read
inside the network at a hook point ``h``: ``u . x_h + c``, with ``x_h`` the activation at
``h`` (flattened at the position: ``[d_model]``, ``[d_mlp]``, ``[n_heads * d_head]``), ``u`` a
direction, a one-hot unit (a neuron) or an SAE feature's encoder column, and ``c`` the SAE's
bias term (0 otherwise). Each is read at one position per sequence. A logit soft cap
(``cfg.output_logits_soft_cap``) is a nonlinearity too: the frozen network holds it as the gain
``cap(l*)/l*`` of the clean logit ``l*``.
"""

import dataclasses
import re
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tl_connwalk.attribution import sae
from tl_connwalk.attribution.frozen import constant_weights, final_resid_hook
from tl_connwalk.errors import ConnWalkError

#: what ``attribute(target=...)`` accepts
TargetSpec = (
    int
    | Tensor
    | tuple[int | Tensor, int | Tensor]
    | tuple[str, int | Tensor]
    | tuple[nn.Module, int]
    | None
)

#: hook points whose activation is not ``[batch, pos, ...]`` or is a constant of ``F``
NOT_TARGETS = ("hook_pattern", "hook_attn_scores", "hook_scale")


@dataclasses.dataclass(frozen=True)
class Target:
    """A resolved target: ``kind`` and, per sequence, the tokens or the direction.

    Attributes:
        kind: ``"logit"``, ``"logit_diff"`` (``logit(token) - logit(other)``),
            ``"direction"`` (``direction . r_final``) or ``"hook"`` (``direction . x_hook +
            offset``, inside the network).
        position: ``[batch]`` the position read in each sequence (non-negative).
        token: ``[batch]`` the token whose logit is read (logit kinds).
        other: ``[batch]`` the token subtracted (``"logit_diff"``).
        direction: ``[batch, width]`` (``"direction"``: ``width = d_model``; ``"hook"``: the
            hook's activation at one position, flattened).
        hook: the hook point read (``"hook"``).
        offset: ``[batch]`` the constant added (``"hook"``: an SAE's bias term, else 0).
        label: what is read, for `describe` (``"hook"``).
    """

    kind: Literal["logit", "logit_diff", "direction", "hook"]
    position: Int[Tensor, " batch"]
    token: Int[Tensor, " batch"] | None = None
    other: Int[Tensor, " batch"] | None = None
    direction: Float[Tensor, "batch width"] | None = None
    hook: str | None = None
    offset: Float[Tensor, " batch"] | None = None
    label: str | None = None

    def repeat(self, k: int) -> "Target":
        """The same target for ``k`` copies of the batch (``[k * batch]``, copy-major)."""
        return dataclasses.replace(
            self,
            position=self.position.repeat(k),
            token=None if self.token is None else self.token.repeat(k),
            other=None if self.other is None else self.other.repeat(k),
            direction=None if self.direction is None else self.direction.repeat(k, 1),
            offset=None if self.offset is None else self.offset.repeat(k),
        )

    def take(self, rows: Int[Tensor, " rows"]) -> "Target":
        """The targets of the sequences ``rows`` (``[rows]``, in that order)."""

        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[rows.to(x.device)]

        return dataclasses.replace(
            self,
            position=self.position[rows.to(self.position.device)],
            token=pick(self.token),
            other=pick(self.other),
            direction=pick(self.direction),
            offset=pick(self.offset),
        )

    def describe(self) -> list[str]:
        """One short label per sequence, e.g. ``logit[17] @ 8``."""
        labels = []
        for b, pos in enumerate(self.position.tolist()):
            if self.kind == "hook":
                labels.append(f"{self.label} @ {pos}")
            elif self.kind == "direction":
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


def positions(position: int | Tensor, batch: int, n_pos: int) -> Tensor:
    """``position`` checked and made ``[batch]`` non-negative indices into ``n_pos``."""
    given: Tensor | None
    try:
        given = torch.as_tensor(position)
    except (TypeError, ValueError, RuntimeError):  # not numbers: a string, say
        given = None
    if (
        given is None
        or given.is_floating_point()
        or given.dtype == torch.bool
        or given.ndim > 1
        or given.numel() not in (1, batch)
    ):
        raise ConnWalkError(
            f"position must be an int or one per sequence ([{batch}] integers), got {position!r}."
        )
    pos = given.reshape(-1).expand(batch).long()
    if ((pos < -n_pos) | (pos >= n_pos)).any():
        raise ConnWalkError(
            f"position {pos.tolist()} is out of range for {n_pos} positions "
            f"(valid: 0..{n_pos - 1}, or -{n_pos}..-1 counted from the end)."
        )
    return pos % n_pos


def _hook_patterns(names: list[str]) -> str:
    """The hook names, with every block's written once as ``blocks.{l}.NAME``."""
    grouped = dict.fromkeys(re.sub(r"^blocks\.\d+\.", "blocks.{l}.", name) for name in names)
    return ", ".join(name for name in grouped if not name.endswith(NOT_TARGETS))


def hook_of(model: nn.Module, target: TargetSpec) -> str | None:
    """The hook point a target inside the network reads (checked), ``None`` for an output.

    ``(hook name, ...)`` names it; an SAE reads at its own hook (``cfg.metadata.hook_name``).
    """
    if not isinstance(target, tuple) or len(target) != 2:
        return None
    first = target[0]
    if isinstance(first, nn.Module):
        name = sae.encoder(first, target[1]).hook  # type: ignore[arg-type]
    elif isinstance(first, str):
        name = first
    else:
        return None
    hook_dict: Any = model.hook_dict
    if name not in hook_dict:
        n_layers = int(model.cfg.n_layers)  # type: ignore[union-attr,arg-type]
        raise ConnWalkError(
            f"{name!r} is not a hook point of this {type(model).__name__}. Valid names, with "
            f"l in 0..{n_layers - 1}: {_hook_patterns(list(hook_dict))}."
        )
    if name.endswith(NOT_TARGETS):
        raise ConnWalkError(
            f"{name!r} cannot be a target: attention patterns, scores and normalisation scales "
            "are frozen at their clean values in the frozen network (spec §6), so nothing "
            "would flow to them; read a hook after them (e.g. attn.hook_z, hook_attn_out)."
        )
    return name


def _hook_target(
    target: tuple[Any, Any], pos: Tensor, activation: Tensor, tokens_shape: torch.Size
) -> Target:
    """A `Target` of kind ``"hook"`` read from ``activation`` ``[batch, pos, ...]``."""
    batch = pos.shape[0]
    first, which = target
    if isinstance(first, nn.Module):
        read = sae.encoder(first, which)
        name, direction, offset, label = read.hook, read.direction, read.offset, read.label
        if direction.numel() != activation[0, 0].numel():
            raise ConnWalkError(
                f"this SAE reads {direction.numel()} values per position, but {name!r} holds "
                f"{tuple(activation.shape[2:])} per position: is it an SAE of this model?"
            )
    else:
        name, direction, offset = first, which, torch.zeros(())
    if activation.shape[:2] != tokens_shape:
        raise ConnWalkError(
            f"{name!r} holds {tuple(activation.shape)}, not [batch, pos, ...] for the tokens "
            f"{tuple(tokens_shape)}; choose a hook point with one activation per position."
        )
    width = activation[0, 0].numel()
    if isinstance(direction, Tensor) and direction.is_floating_point():
        if direction.numel() not in (width, batch * width):
            raise ConnWalkError(
                f"a direction at {name!r} has {width} entries per position (its activation is "
                f"{tuple(activation.shape[2:])} per position), or {batch} x {width} with one "
                f"per sequence; got {tuple(direction.shape)}."
            )
        u = direction.reshape(-1, width).expand(batch, -1)
        if not isinstance(first, nn.Module):
            label = f"u . {name}"
    else:
        unit = torch.as_tensor(direction)
        if unit.is_floating_point() or unit.numel() != 1 or isinstance(direction, bool):
            raise ConnWalkError(
                f"a target at {name!r} is (name, unit index) or (name, float direction), got "
                f"{type(direction).__name__} {tuple(unit.shape)}."
            )
        if not 0 <= int(unit) < width:
            raise ConnWalkError(
                f"unit {int(unit)} is out of range for {name!r}, which has {width} units per "
                "position (flattened)."
            )
        u = torch.zeros(batch, width, dtype=activation.dtype, device=activation.device)
        u[:, int(unit)] = 1
        label = f"{name}[{int(unit)}]"
    u = u.to(device=activation.device, dtype=activation.dtype)
    c = torch.as_tensor(offset, dtype=activation.dtype).to(activation.device).expand(batch)
    return Target("hook", pos, direction=u, hook=name, offset=c, label=label)


def resolve(
    target: TargetSpec,
    position: int | Tensor,
    logits: Float[Tensor, "batch pos d_vocab"] | None,
    activation: Tensor,
) -> Target:
    """``target`` and ``position`` checked against the clean run, as a `Target`.

    ``logits``: the clean logits (``None`` where the run stopped at the target's hook);
    ``activation``: what the target reads, ``r_final`` or the activation at its hook.
    """
    batch, n_pos = activation.shape[:2]
    pos = positions(position, batch, n_pos).to(activation.device)
    if isinstance(target, tuple) and len(target) == 2 and isinstance(target[0], str | nn.Module):
        return _hook_target(target, pos, activation, activation.shape[:2])
    if logits is None:
        raise ConnWalkError("the clean run stopped before the logits; no logit can be read.")
    d_vocab = logits.shape[-1]
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
        if target.shape[-1] != activation.shape[-1]:
            raise ConnWalkError(
                f"a direction target has one entry per dimension of the final residual, "
                f"d_model = {activation.shape[-1]}; got {tuple(target.shape)}."
            )
        direction = target.reshape(-1, target.shape[-1]).expand(batch, -1)
        return Target("direction", pos, direction=direction.to(logits.device))
    if isinstance(target, int | Tensor) and not isinstance(target, bool):
        return Target("logit", pos, token=_ids(target, batch, d_vocab, "target").to(pos.device))
    raise ConnWalkError(
        "target must be None (the top token), a token id, (token, other token) for a logit "
        "difference, a float direction [d_model], (hook name, direction or unit) or (SAE, "
        f"feature); got {type(target).__name__}."
    )


def read_at(target: Target, model: nn.Module) -> str:
    """The hook point whose activation ``target`` reads (its own, or ``r_final``'s)."""
    return target.hook or final_resid_hook(model)


def _along(target: Target, activation: Tensor) -> Float[Tensor, " batch"]:
    """``direction . x + offset`` at the target's positions (``x`` flattened per position)."""
    rows = torch.arange(target.position.shape[0], device=activation.device)
    at = activation[rows, target.position].reshape(len(rows), -1)
    y = (at * target.direction.to(at)).sum(-1)  # type: ignore[union-attr]
    return y if target.offset is None else y + target.offset.to(y)


def read(
    target: Target,
    unembed: nn.Module,
    unembed_input: Float[Tensor, "batch pos d_model"] | None,
    activation: Tensor,
    soft_cap: float,
    cap_gain: Float[Tensor, "batch 2"] | None = None,
) -> tuple[Float[Tensor, " batch"], Float[Tensor, "batch 2"]]:
    """``y`` per sequence, and the soft-cap gains ``cap(l)/l`` of the logits it read.

    ``activation``: what a direction or hook target reads (`read_at`). ``cap_gain``: frozen
    gains to use (from the clean run) instead of this run's own.
    """
    if target.kind in ("direction", "hook"):
        y = _along(target, activation)
        return y, torch.ones(len(y), 2, dtype=y.dtype, device=y.device)
    rows = torch.arange(target.position.shape[0], device=activation.device)
    if unembed_input is None:
        raise ConnWalkError("the model's unembedding did not run; no logit can be read.")
    # recomputed in a backward pass, so that a graph through it keeps no copy of ``W_U``
    logits = checkpoint(
        unembed,
        unembed_input[rows, target.position][:, None],
        use_reentrant=False,
        context_fn=lambda: (constant_weights(unembed), constant_weights(unembed)),
    )[:, 0]
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
    target: Target, logits: Float[Tensor, "batch pos d_vocab"] | None, activation: Tensor
) -> Float[Tensor, " batch"]:
    """``y`` read off the clean run's own outputs (the model's logits, or the cached
    activation at `read_at`: the final residual, or the target's hook)."""
    if target.kind in ("direction", "hook"):
        return _along(target, activation)
    assert logits is not None  # `resolve` refuses logit targets without logits
    rows = torch.arange(logits.shape[0], device=logits.device)
    at = logits[rows, target.position]
    y = at[rows, target.token]
    return y - at[rows, target.other] if target.kind == "logit_diff" else y
