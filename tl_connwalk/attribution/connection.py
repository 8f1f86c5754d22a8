"""The exact method: source contributions through the frozen network ``F`` (spec §6).

``F`` is affine in the embeddings, ``F(e) = J e + F(0)``, so ``c_s = F(only e_s) - F(0)
= J_s e_s`` is the gradient of the target with respect to position ``s``'s embeddings, dotted
with them: one forward pass of ``F`` with gradients and one backward sweep give every ``c_s``
at once, whatever the number of sources. ``b = F(0)`` is one more forward pass, with the
embeddings zeroed; ``sum_s c_s + b`` equal to the clean target is checked on every call, so a
nonlinearity ``F`` failed to freeze cannot pass unnoticed.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tl_connwalk.adapters.hooked_transformer import POST_NORM_ARCHITECTURES
from tl_connwalk.attribution import targets
from tl_connwalk.attribution.frozen import (
    FrozenNetwork,
    config,
    pattern_hooks,
)
from tl_connwalk.errors import ConnWalkError

#: relative tolerance of the completeness check, by dtype (sums over the whole network)
COMPLETENESS_RTOL = {torch.float64: 1e-9, torch.float32: 1e-3}


@dataclasses.dataclass(frozen=True)
class Connection:
    """What the exact method returns (per sequence; ``edges`` per layer first)."""

    scores: Float[Tensor, "batch source"]
    bias: Float[Tensor, " batch"]
    edges: Float[Tensor, "layer batch head query key"]
    components: Callable[[], tuple[list[str], Tensor]]


def _soft_cap(model: nn.Module) -> float:
    return float(getattr(config(model), "output_logits_soft_cap", 0.0) or 0.0)


def _n_layers(model: nn.Module) -> int:
    return int(config(model).n_layers)


def evaluate(
    frozen: FrozenNetwork,
    target: targets.Target,
    embeddings: dict[str, Tensor],
    taps: dict[str, Callable[[Tensor], None]],
    cap_gain: Tensor | None = None,
    overrides: dict[str, Tensor] | None = None,
) -> tuple[Float[Tensor, " batch"], Tensor, Float[Tensor, "batch pos ..."]]:
    """``F`` at ``embeddings``, read at the target: ``y`` ``[batch]``, its soft-cap gains and
    the activation it read (the final residual ``r_final``, or the target's hook)."""
    final: dict[str, Tensor] = {}
    name = targets.read_at(target, frozen.model)
    taps = {**taps, name: lambda x: final.__setitem__("resid", x)}
    with frozen.unembedding_input() as seen:
        frozen.run(embeddings, taps, overrides)
    y, gain = targets.read(
        target,
        frozen.model.unembed,  # type: ignore[arg-type]
        seen[-1] if seen else None,
        final["resid"],
        _soft_cap(frozen.model),
        cap_gain,
    )
    return y, gain, final["resid"]


def _check_complete(y: Tensor, scores: Tensor, bias: Tensor, clean: Tensor) -> None:
    rtol = COMPLETENESS_RTOL.get(y.dtype, 5e-2)
    scale = scores.abs().sum(-1) + bias.abs() + clean.abs()
    gap = (scores.sum(-1) + bias - clean).abs()
    if (gap > rtol * scale).any():
        worst = int((gap / scale).argmax())
        raise ConnWalkError(
            f"the frozen network is not affine in the embeddings for sequence {worst}: sources "
            f"plus bias give {float(scores[worst].sum() + bias[worst]):.6g}, the model "
            f"{float(clean[worst]):.6g}. The model has a nonlinearity attribution does not "
            "freeze (spec §6 freezes patterns, normalisation scales and MLP activations)."
        )


def connection(
    frozen: FrozenNetwork, target: targets.Target, clean: Float[Tensor, " batch"]
) -> Connection:
    """The exact attribution of ``target`` through ``frozen`` (``clean``: the model's value).

    The edges come from the same sweep: ``y`` is linear in each layer's frozen pattern, so
    ``A^h_ij dy/dA^h_ij = g_i . A^h_ij (v^h_j W_O^h)`` (spec §6).
    """
    leaves = {
        name: value.detach().clone().requires_grad_(True)
        for name, value in frozen.embeddings.items()
    }
    # the layers whose patterns ran before the target (all, but for a target inside the network)
    patterns = {
        name: frozen.frozen[name] for name in pattern_hooks(frozen.model) if name in frozen.frozen
    }
    pattern_leaves = {
        name: value.detach().clone().requires_grad_(True) for name, value in patterns.items()
    }
    with torch.enable_grad():
        y, cap_gain, _ = evaluate(frozen, target, leaves, {}, overrides=pattern_leaves)
        grads = torch.autograd.grad(
            y.sum(), [*leaves.values(), *pattern_leaves.values()], allow_unused=True
        )
    scores = torch.zeros_like(frozen.tokens, dtype=y.dtype)
    for grad, value in zip(grads, leaves.values(), strict=False):
        if grad is not None:
            scores = scores + (grad * value).sum(-1)
    with torch.no_grad():
        zero = {name: torch.zeros_like(value) for name, value in frozen.embeddings.items()}
        bias, _, _ = evaluate(frozen, target, zero, {}, cap_gain)
    _check_complete(y.detach(), scores, bias, clean)
    batch, n_pos = frozen.tokens.shape
    none = scores.new_zeros(batch, int(config(frozen.model).n_heads), n_pos, n_pos)
    shares = {
        name: none if grad is None else pattern * grad
        for (name, pattern), grad in zip(patterns.items(), grads[len(leaves) :], strict=True)
    }
    edges = torch.stack([shares.get(name, none) for name in pattern_hooks(frozen.model)])
    return Connection(
        scores.detach(),
        bias,
        edges,
        lambda: components(frozen, target, cap_gain),
    )


def _post_norm_transpose(
    model: nn.Module, module: nn.Module | None, scale: Tensor | None, g: Tensor
) -> Tensor:
    """``L^T g`` for the frozen linear part ``L`` of a post-sublayer norm (identity if none).

    ``L(x) = P(x) w / scale`` with ``P`` the centring (LayerNorm) or the identity (RMSNorm).
    """
    if module is None or scale is None:
        return g
    weight = getattr(module, "w", None)
    if weight is not None and getattr(model.cfg, "rmsnorm_uses_offset", False):
        weight = 1 + weight
    out = g if weight is None else g * weight.detach().to(g)
    out = out / scale.to(g)
    rms = getattr(module, "uses_rms_norm", None)
    if rms is None:
        rms = "RMS" in type(module).__name__
    return out if rms else out - out.mean(-1, keepdim=True)


def components(
    frozen: FrozenNetwork, target: targets.Target, cap_gain: Tensor
) -> tuple[list[str], Float[Tensor, "batch component source"]]:
    """Each component's direct path into the target, split by source (spec §6).

    Component outputs at the target position are read along ``g``, the frozen gradient of the
    target at the final residual; every component's read-out is then one output of ``F``,
    and the backward sweeps for all of them run at once (batched gradients).
    """
    model = frozen.model
    n_layers = _n_layers(model)
    cfg = config(model)
    if target.kind == "hook":
        raise ConnWalkError(
            f"by_component reads every component's output along the target's gradient at the "
            f"final residual; {target.hook!r} is inside the network. Use scores and "
            "edges(layer)."
        )
    if hasattr(model, "mlm_head") or cfg.original_architecture in POST_NORM_ARCHITECTURES:
        raise ConnWalkError(
            "by_component needs a residual stream its components add into; in a post-norm "
            "model (BERT, OLMo 2) every layer's norm rescales the whole stream, so no "
            "component has a direct path of its own. Use scores and edges(layer)."
        )
    rows = torch.arange(target.position.shape[0], device=target.position.device)
    leaves = {
        name: value.detach().clone().requires_grad_(True)
        for name, value in frozen.embeddings.items()
    }
    seen: dict[str, Tensor] = {}
    taps: dict[str, Callable[[Tensor], None]] = {
        "blocks.0.hook_resid_pre": lambda x: seen.__setitem__("embed", x)
    }
    for layer in range(n_layers):
        taps[f"blocks.{layer}.attn.hook_z"] = functools.partial(seen.__setitem__, f"z{layer}")
        if not cfg.attn_only:
            taps[f"blocks.{layer}.hook_mlp_out"] = functools.partial(
                seen.__setitem__, f"mlp{layer}"
            )
    with torch.enable_grad():
        y, _, resid = evaluate(frozen, target, leaves, taps, cap_gain)
        (g_full,) = torch.autograd.grad(y.sum(), resid, retain_graph=True)
        g = g_full[rows, target.position].detach()
        names, reads = ["embed"], [(seen["embed"][rows, target.position] * g).sum(-1)]
        for layer in range(n_layers):
            block: Any = model.blocks[layer]  # type: ignore[index]
            scale = frozen.frozen.get(f"blocks.{layer}.ln1_post.hook_scale")
            post = getattr(block, "ln1_post", None)
            g_attn = _post_norm_transpose(
                model, post, None if scale is None else scale[rows, target.position], g
            )
            W_O = block.attn.W_O.detach().to(g)
            g_z = torch.einsum("hdm,bm->bhd", W_O, g_attn)
            z = seen[f"z{layer}"][rows, target.position]
            reads.append((z * g_z).sum(-1).T)
            names += [f"L{layer}H{h}" for h in range(W_O.shape[0])]
            if not cfg.attn_only:
                reads.append((seen[f"mlp{layer}"][rows, target.position] * g).sum(-1)[None])
                names.append(f"L{layer}MLP")
        outputs = torch.cat([r.reshape(-1, len(rows)) for r in reads])  # [component, batch]
        eye = torch.eye(outputs.shape[0], dtype=outputs.dtype, device=outputs.device)
        grads = torch.autograd.grad(
            outputs,
            list(leaves.values()),
            grad_outputs=eye[:, :, None].expand(-1, -1, len(rows)),
            is_grads_batched=True,
            allow_unused=True,
        )
    parts = sum(
        (grad * value).sum(-1)
        for grad, value in zip(grads, leaves.values(), strict=True)
        if grad is not None
    )
    return names, torch.as_tensor(parts).transpose(0, 1).detach()
