"""The exact method: source contributions through the frozen network ``F`` (spec §6).

``F`` is affine in the embeddings, ``F(e) = J e + F(0)``, so ``c_s = F(only e_s) - F(0)
= J_s e_s`` is the gradient of the target with respect to position ``s``'s embeddings, dotted
with them: one forward pass of ``F`` with gradients and one backward sweep give every ``c_s``
at once, whatever the number of sources. ``b = F(0)`` is one more forward pass, with the
embeddings zeroed; ``sum_s c_s + b`` equal to the clean target is checked on every call, so a
nonlinearity ``F`` failed to freeze cannot pass unnoticed.

Memory: the weights are constants of the graph (no activations kept for weight gradients), the
target's logit is read from the unembedding's input at its position alone, and in a
``HookedTransformer`` or ``HookedEncoder`` the backward sweep recomputes one block at a time
from its input (`FrozenNetwork.recomputing_blocks`), so the graph holds one block's
activations; each layer's edge shares are written as soon as its pattern's gradient is made.
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
    constant_weights,
    final_resid_hook,
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
    with constant_weights(frozen.model):
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


def _edge_share(out: Tensor, pattern: Tensor) -> None:
    """``A dy/dA`` of one layer's pattern leaf into ``out``; the leaf's gradient is freed."""
    assert pattern.grad is not None  # called once the gradient is accumulated
    torch.mul(pattern.grad, pattern.detach(), out=out)
    pattern.grad = None


def _check_complete(scores: Tensor, bias: Tensor, clean: Tensor) -> None:
    rtol = COMPLETENESS_RTOL.get(scores.dtype, 5e-2)
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
    model = frozen.model
    leaves = {
        name: value.detach().requires_grad_(True) for name, value in frozen.embeddings.items()
    }
    batch, n_pos = frozen.tokens.shape
    edges = frozen.embeddings[next(iter(leaves))].new_zeros(
        _n_layers(model), batch, int(config(model).n_heads), n_pos, n_pos
    )
    # the layers whose patterns ran before the target (all, but for a target inside the
    # network); each layer's share is made as soon as its gradient is, and the gradient freed
    pattern_leaves = {}
    for layer, name in enumerate(pattern_hooks(model)):
        if name in frozen.frozen:
            leaf = frozen.frozen[name].detach().requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(functools.partial(_edge_share, edges[layer]))
            pattern_leaves[name] = leaf
    with torch.enable_grad():
        with frozen.recomputing_blocks(leaves, pattern_leaves):
            y, cap_gain, _ = evaluate(frozen, target, leaves, {}, overrides=pattern_leaves)
        torch.autograd.backward(y.sum(), inputs=[*leaves.values(), *pattern_leaves.values()])
    scores = torch.zeros_like(frozen.tokens, dtype=y.dtype)
    for leaf in leaves.values():
        if leaf.grad is not None:
            scores = scores + (leaf.grad * leaf.detach()).sum(-1)
    with torch.no_grad():
        zero = {name: torch.zeros_like(value) for name, value in frozen.embeddings.items()}
        bias, _, _ = evaluate(frozen, target, zero, {}, cap_gain)
    _check_complete(scores, bias, clean)
    return Connection(
        scores.detach(),
        bias,
        edges,
        functools.cache(lambda: components(frozen, target, cap_gain)),
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


#: entries of repeated frozen values (patterns, scales, gains, embeddings) one pass of
#: `components` holds: the sources of a sequence run in chunks of at most this size
COMPONENT_CHUNK_ENTRIES = 2**25


def _check_components(model: nn.Module, target: targets.Target) -> None:
    """A ConnWalkError where a target has no direct paths of components to split."""
    if target.kind == "hook":
        raise ConnWalkError(
            f"by_component reads every component's output along the target's gradient at the "
            f"final residual; {target.hook!r} is inside the network. Use scores and "
            "edges(layer)."
        )
    if hasattr(model, "mlm_head") or config(model).original_architecture in POST_NORM_ARCHITECTURES:
        raise ConnWalkError(
            "by_component needs a residual stream its components add into; in a post-norm "
            "model (BERT, OLMo 2) every layer's norm rescales the whole stream, so no "
            "component has a direct path of its own. Use scores and edges(layer)."
        )


def _component_covectors(
    frozen: FrozenNetwork, target: targets.Target, cap_gain: Tensor
) -> tuple[list[str], Float[Tensor, "batch d_model"], list[Float[Tensor, "batch head d_head"]]]:
    """The components' names, ``g`` (the frozen gradient of the target at the final residual,
    at the target position) and per layer ``W_O^h L^T g`` ``[batch, head, d_head]``: what
    each head's ``hook_z`` at the target position is read along (``L`` the frozen linear part
    of a norm after the attention, if any). The embeddings' direct path (``hook_resid_pre`` of
    block 0) and the MLPs' outputs (``hook_mlp_out``) are read along ``g`` itself."""
    model = frozen.model
    rows = torch.arange(target.position.shape[0], device=target.position.device)
    leaves = {
        name: value.detach().clone().requires_grad_(True)
        for name, value in frozen.embeddings.items()
    }
    with torch.enable_grad():
        y, _, resid = evaluate(frozen, target, leaves, {}, cap_gain)
        (g_full,) = torch.autograd.grad(y.sum(), resid)
    g = g_full[rows, target.position].detach()
    names, heads = ["embed"], []
    for layer in range(_n_layers(model)):
        block: Any = model.blocks[layer]  # type: ignore[index]
        scale = frozen.frozen.get(f"blocks.{layer}.ln1_post.hook_scale")
        post = getattr(block, "ln1_post", None)
        g_attn = _post_norm_transpose(
            model, post, None if scale is None else scale[rows, target.position], g
        )
        W_O = block.attn.W_O.detach().to(g)
        heads.append(torch.einsum("hdm,bm->bhd", W_O, g_attn))
        names += [f"L{layer}H{h}" for h in range(W_O.shape[0])]
        if not config(model).attn_only:
            names.append(f"L{layer}MLP")
    return names, g, heads


def _component_reads(
    frozen: FrozenNetwork,
    position: Tensor,
    g: Float[Tensor, "batch d_model"],
    heads: list[Tensor],
    inputs: Tensor,
) -> Float[Tensor, "input batch component"]:
    """Every component's output at the target position, read along its covector, in ``F``
    fed the embeddings of source ``s`` alone for each ``s`` in ``inputs`` (``pos``: none)."""
    model = frozen.model
    n_batch, n_pos = frozen.tokens.shape
    copies = len(inputs)
    alone = torch.arange(n_pos, device=inputs.device)[None] == inputs[:, None]  # [input, pos]
    embeddings = {
        name: (value[None] * alone[:, None, :, None].to(value)).flatten(0, 1)
        for name, value in frozen.embeddings.items()
    }
    rows = torch.arange(copies * n_batch, device=position.device)
    at = position.repeat(copies)
    seen: dict[str, Tensor] = {}

    def read(key: str) -> Callable[[Tensor], None]:
        return lambda x: seen.__setitem__(key, x[rows, at])

    taps = {"blocks.0.hook_resid_pre": read("embed")}
    for layer in range(_n_layers(model)):
        taps[f"blocks.{layer}.attn.hook_z"] = read(f"z{layer}")
        if not config(model).attn_only:
            taps[f"blocks.{layer}.hook_mlp_out"] = read(f"mlp{layer}")
    # the components' outputs are all in once the last block's residual is: stop there
    network = dataclasses.replace(frozen.repeated(copies), stop_at=final_resid_hook(model))
    with torch.no_grad():
        network.run(embeddings, taps)
    g = g.repeat(copies, 1)
    reads = [(seen["embed"] * g).sum(-1)[:, None]]
    for layer, g_z in enumerate(heads):
        reads.append((seen[f"z{layer}"] * g_z.repeat(copies, 1, 1)).sum(-1))
        if not config(model).attn_only:
            if f"mlp{layer}" not in seen:
                raise ConnWalkError(
                    f"blocks.{layer}.hook_mlp_out did not fire in {type(model).__name__}'s "
                    "forward pass; by_component reads each MLP's output there."
                )
            reads.append((seen[f"mlp{layer}"] * g).sum(-1)[:, None])
    return torch.cat(reads, -1).unflatten(0, (copies, n_batch))


def components(
    frozen: FrozenNetwork, target: targets.Target, cap_gain: Tensor
) -> tuple[list[str], Float[Tensor, "batch component source"]]:
    """Each component's direct path into the target, split by source (spec §6).

    ``F`` is affine, so the part of component ``k``'s output ``o_k`` at the target position that
    source ``s`` sent is ``o_k(only e_s) - o_k(no embeddings)``; read along ``g``, the frozen
    gradient of the target at the final residual, it is entry ``[b, k, s]``. Every component
    is read in the same passes: ``F`` runs once per source with that source's embeddings
    alone, and once with none, the inputs stacked on the batch.

    Cost: ``(pos + 1) * batch`` forward passes of ``F`` up to the last block's residual (no
    unembedding), in chunks whose repeated frozen values (patterns, scales, MLP gains) hold at
    most `COMPONENT_CHUNK_ENTRIES` entries (one input at least), plus one forward and backward
    pass for ``g``; independent of the number of components.
    """
    _check_components(frozen.model, target)
    names, g, heads = _component_covectors(frozen, target, cap_gain)
    n_pos = frozen.tokens.shape[1]
    values = [*frozen.frozen.values(), *frozen.head_gains.values(), *frozen.embeddings.values()]
    values += [value for _, value in frozen.gains.values()]
    per_input = sum(value.numel() for value in values)
    chunk = max(1, COMPONENT_CHUNK_ENTRIES // per_input)
    inputs = torch.arange(n_pos + 1, device=g.device)  # source s alone; n_pos: no embeddings
    reads = torch.cat(
        [_component_reads(frozen, target.position, g, heads, part) for part in inputs.split(chunk)]
    )  # [input, batch, component]
    return names, (reads[:-1] - reads[-1]).permute(1, 2, 0)
