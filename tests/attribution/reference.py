"""The frozen network of spec §6 run the slow way, through TransformerLens hooks, per source.

Independent of ``tl_connwalk.attribution``: the clean cache gives the patterns, the
normalisation scales and the MLP gains (``act(z)/z`` recomputed with the model's own ``act_fn``,
or the gate pinned in gated MLPs); the embeddings are replaced by those of one source
position (or none), and the target is read off the model's logits.
"""

from typing import Any

import torch
from torch import Tensor

EMBEDDINGS = ("hook_embed", "hook_pos_embed", "embed.hook_embed", "embed.hook_pos_embed",
              "embed.hook_token_type_embed")  # fmt: skip


def clean_cache(model: Any, tokens: Tensor) -> Any:
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    return cache


def frozen_hooks(model: Any, cache: Any, keep: int | str | None) -> list[tuple[str, Any]]:
    """Hooks making ``model`` the frozen network fed only source ``keep``'s embeddings (none:
    ``keep=None``; all of them: ``keep="all"``)."""
    hooks: list[tuple[str, Any]] = []
    live: dict[str, Tensor] = {}

    def const(value: Tensor) -> Any:
        return lambda x, hook: value.clone()

    for name in cache:
        if name.endswith(("attn.hook_pattern", "hook_scale")):
            hooks.append((name, const(cache[name])))
    for layer in range(model.cfg.n_layers):
        pre, post = f"blocks.{layer}.mlp.hook_pre", f"blocks.{layer}.mlp.hook_post"
        if pre not in cache:
            continue
        if f"blocks.{layer}.mlp.hook_pre_linear" in cache:
            hooks.append((pre, const(cache[pre])))
            continue
        z = cache[pre]
        mlp = model.blocks[layer].mlp
        act = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.original_component.act  # a Bridge
        gain = torch.where(z == 0, 0.0, act(z) / z)
        hooks.append((pre, lambda x, hook, pre=pre: live.__setitem__(pre, x)))
        hooks.append((post, lambda x, hook, pre=pre, gain=gain: gain * live[pre]))
    for name in EMBEDDINGS:
        if name in cache and keep != "all":
            value = torch.zeros_like(cache[name])
            if keep is not None:
                value[:, keep] = cache[name][:, keep]
            hooks.append((name, const(value)))
    return hooks


def frozen_logits(model: Any, tokens: Tensor, cache: Any, keep: int | None) -> Tensor:
    with torch.no_grad():
        if not hasattr(model, "mlm_head"):
            return model.run_with_hooks(tokens, fwd_hooks=frozen_hooks(model, cache, keep))
        # a BERT MLM head: dense -> act -> LayerNorm, its activation frozen as a gain too
        seen = []
        act = model.mlm_head.act_fn
        handle = act.register_forward_hook(lambda module, args, out: seen.append(args[0]))
        model(tokens)
        handle.remove()
        gain = torch.nn.functional.gelu(seen[0]) / seen[0]
        handle = act.register_forward_hook(lambda module, args, out: gain * args[0])
        try:
            return model.run_with_hooks(tokens, fwd_hooks=frozen_hooks(model, cache, keep))
        finally:
            handle.remove()


def source_contributions(model: Any, tokens: Tensor, token: Tensor, position: int) -> Tensor:
    """``c_s = F(only e_s) - F(no embeddings)`` for a logit target, ``[batch, source]``."""
    cache = clean_cache(model, tokens)
    rows = torch.arange(tokens.shape[0])

    def target(keep: int | None) -> Tensor:
        return frozen_logits(model, tokens, cache, keep)[rows, position, token]

    bias = target(None)
    return torch.stack([target(s) - bias for s in range(tokens.shape[1])], -1)


def frozen_activation(
    model: Any, tokens: Tensor, cache: Any, keep: int | None, hook: str
) -> Tensor:
    """The activation at ``hook`` in the frozen network fed only source ``keep``'s embeddings;
    the whole network runs (layers after the hook too)."""
    seen: dict[str, Tensor] = {}
    hooks = [*frozen_hooks(model, cache, keep), (hook, lambda x, hook: seen.update(x=x.clone()))]
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=hooks)
    return seen["x"]


def hook_contributions(model: Any, tokens: Tensor, hook: str, read: Any) -> Tensor:
    """``c_s = F(only e_s) - F(no embeddings)`` for ``y = read(x)``, ``x`` the activation at
    ``hook`` ``[batch, pos, ...]``, ``read`` giving ``[batch]``: ``[batch, source]``."""
    cache = clean_cache(model, tokens)

    def target(keep: int | None) -> Tensor:
        return read(frozen_activation(model, tokens, cache, keep, hook))

    bias = target(None)
    return torch.stack([target(s) - bias for s in range(tokens.shape[1])], -1)
