"""Baselines that `tl_connwalk.attribute` computes by name beside the exact method (spec §6).

- ``"grad_x_input"``: the real (unfrozen) gradient of the target with respect to each
  position's embeddings, dotted with them: ``s_s = (dy/de_s) . e_s``.
- ``"rollout"`` (Abnar & Zuidema 2020): ``R = B_{L-1} ... B_0`` with ``B_l = (mean_h A^h_l +
  I) / 2`` (rows still sum to 1); ``s_s = R[position, s]``, a distribution over sources that
  ignores the target and what the values carry.
- ``"knockout"``, ground truth by intervention: ``s_s = y - y_s`` where ``y_s`` is the target
  when no other query, in any layer, may attend to key ``s`` (its pre-softmax score, at
  ``attn.hook_attn_scores``, set to ``-inf``; position ``s`` still attends to itself). One
  forward pass per source, ``chunk`` sources batched in each.

Neither is complete: their ``bias`` is what they leave unexplained, ``y - sum_s s_s``.
"""

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.attribution import targets
from tl_connwalk.attribution.frozen import FrozenNetwork, config, final_resid_hook

#: sources knocked out per forward pass
KNOCKOUT_CHUNK = 16


def rollout(
    patterns: Float[Tensor, "layer batch head query key"],
) -> Float[Tensor, "batch query key"]:
    """Attention rollout: the product of ``(mean_h A^h + I) / 2`` over layers, last on the left.

    >>> A = torch.tensor([[1.0, 0.0], [0.5, 0.5]])[None, None, None].expand(2, 1, 1, 2, 2)
    >>> rollout(A)[0]
    tensor([[1.0000, 0.0000],
            [0.4375, 0.5625]])
    """
    eye = torch.eye(patterns.shape[-1], dtype=patterns.dtype, device=patterns.device)
    result = eye.expand(patterns.shape[1], -1, -1)
    for layer in patterns:
        result = ((layer.mean(1) + eye) / 2) @ result
    return result


def grad_x_input(frozen: FrozenNetwork, target: targets.Target) -> Float[Tensor, "batch source"]:
    """``(dy/de_s) . e_s`` summed over a position's embeddings, with the real gradient."""
    leaves = {
        name: value.detach().clone().requires_grad_(True)
        for name, value in frozen.embeddings.items()
    }
    final: dict[str, Tensor] = {}
    hooks: list[tuple[str, Callable[..., Any]]] = [
        (name, lambda x, hook, leaf=leaf: leaf) for name, leaf in leaves.items()
    ]
    hooks.append((final_resid_hook(frozen.model), lambda x, hook: final.update(r=x)))
    with torch.enable_grad():
        logits = frozen.run_model(hooks)
        y = targets.clean_value(target, logits, final["r"])
        grads = torch.autograd.grad(y.sum(), list(leaves.values()), allow_unused=True)
    scores = torch.zeros_like(frozen.tokens, dtype=y.dtype)
    for grad, leaf in zip(grads, leaves.values(), strict=True):
        if grad is not None:
            scores = scores + (grad * leaf).sum(-1)
    return scores.detach()


def knockout(
    frozen: FrozenNetwork, target: targets.Target, clean: Float[Tensor, " batch"]
) -> Float[Tensor, "batch source"]:
    """``y - y_s``: the target's drop when key ``s`` is blocked for every other query."""
    model = frozen.model
    batch, n_pos = frozen.tokens.shape
    names = [f"blocks.{layer}.attn.hook_attn_scores" for layer in range(config(model).n_layers)]
    scores = torch.zeros(batch, n_pos, dtype=clean.dtype, device=clean.device)
    final: dict[str, Tensor] = {}
    read_final = (final_resid_hook(model), lambda x, hook: final.update(r=x))
    for start in range(0, n_pos, KNOCKOUT_CHUNK):
        sources = torch.arange(start, min(start + KNOCKOUT_CHUNK, n_pos))
        k = len(sources)
        blocked = torch.zeros(k, 1, n_pos, n_pos, dtype=torch.bool, device=clean.device)
        blocked[torch.arange(k), 0, :, sources] = True
        blocked[torch.arange(k), 0, sources, sources] = False

        def block(attn_scores: Tensor, hook: Any, blocked: Tensor = blocked) -> Tensor:
            mask = blocked.repeat_interleave(batch, 0)
            return attn_scores.masked_fill(mask, float("-inf"))

        hooks: list[tuple[str, Callable[..., Any]]] = [(name, block) for name in names]
        hooks.append(read_final)
        with torch.no_grad():
            logits = frozen.run_model(hooks, repeat=k)
        repeated = targets.Target(
            target.kind,
            target.position.repeat(k),
            None if target.token is None else target.token.repeat(k),
            None if target.other is None else target.other.repeat(k),
            None if target.direction is None else target.direction.repeat(k, 1),
        )
        knocked = targets.clean_value(repeated, logits, final["r"]).reshape(k, batch)
        scores[:, sources] = (clean[None] - knocked).T.to(scores)
    return scores
