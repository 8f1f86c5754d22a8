"""Baselines that `tl_connwalk.attribute` computes by name beside the exact method (spec §6).

- ``"grad_x_input"``: the real (unfrozen) gradient of the target with respect to each
  position's embeddings, dotted with them: ``s_s = (dy/de_s) . e_s``.
- ``"rollout"`` (Abnar & Zuidema 2020): ``R = B_{L-1} ... B_0`` with ``B_l = (mean_h A^h_l +
  I) / 2`` (rows still sum to 1); ``s_s = R[position, s]``, a distribution over sources that
  ignores the target and what the values carry.
- ``"knockout"``, ground truth by intervention: ``s_s = y - y_s`` where ``y_s`` is the target
  when no other query, in any layer, may attend to key ``s`` (its pre-softmax score, at
  ``attn.hook_attn_scores``, set to ``-inf``; position ``s`` still attends to itself). One
  forward pass per source, ``chunk`` sources batched in each. `block_keys` blocks any sets of
  keys the same way (deletion and insertion curves block the top-ranked sources, or all the
  others).

The layer-wise baselines (``"attention_norm"``, ``"alti"``, ``"value_zeroing"``) are in
`tl_connwalk.attribution.layerwise` and `tl_connwalk.attribution.mixing`. None is complete:
a baseline's ``bias`` is what it leaves unexplained, ``y - sum_s s_s``.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tl_connwalk.attribution import targets
from tl_connwalk.attribution.frozen import FrozenNetwork, config, final_resid_hook, mask_kwargs
from tl_connwalk.errors import ConnWalkError

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
    hooks.append((targets.read_at(target, frozen.model), lambda x, hook: final.update(r=x)))
    with torch.enable_grad():
        logits = frozen.run_model(hooks)
        y = targets.clean_value(target, logits, final["r"])
        grads = torch.autograd.grad(y.sum(), list(leaves.values()), allow_unused=True)
    scores = torch.zeros_like(frozen.tokens, dtype=y.dtype)
    for grad, leaf in zip(grads, leaves.values(), strict=True):
        if grad is not None:
            scores = scores + (grad * leaf).sum(-1)
    return scores.detach()


def block_keys(
    model: nn.Module,
    tokens: Int[Tensor, "batch pos"],
    keys: Bool[Tensor, "run batch key"],
    read: Callable[[Tensor, Tensor], Tensor],
    extra_hooks: Sequence[tuple[str, Callable[..., Any]]] = (),
    read_hook: str | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> Tensor:
    """What ``read`` sees when, in each run, some keys are blocked for every other query.

    In run ``r`` sequence ``b`` is the clean ``tokens[b]`` with each key ``s`` where
    ``keys[r, b, s]`` kept from every query but itself, in every layer (its pre-softmax score
    at ``attn.hook_attn_scores`` set to ``-inf``). ``chunk`` = `KNOCKOUT_CHUNK` runs go
    through the model per forward pass, as a batch of ``chunk * batch`` rows (run-major);
    ``read(logits, activation)`` turns that pass's outputs into one value (or a row of
    values) per row; ``activation`` is the final residual, or the activation at ``read_hook``
    when given. ``extra_hooks`` run in every pass (e.g. frozen normalisation scales).
    ``attention_mask`` (1 on real tokens) is handed to every pass, repeated per run.

    Returns:
        ``[run, batch, ...]``: what ``read`` gave for each run and sequence.
    """
    batch, n_pos = tokens.shape
    names = [f"blocks.{layer}.attn.hook_attn_scores" for layer in range(config(model).n_layers)]
    final: dict[str, Tensor] = {}
    read_final = (read_hook or final_resid_hook(model), lambda x, hook: final.update(r=x))
    not_self = ~torch.eye(n_pos, dtype=torch.bool, device=keys.device)
    values = []
    for start in range(0, keys.shape[0], KNOCKOUT_CHUNK):
        chunk = keys[start : start + KNOCKOUT_CHUNK]
        k = chunk.shape[0]
        blocked = chunk.reshape(k * batch, 1, 1, n_pos) & not_self  # [row, 1, query, key]

        def block(attn_scores: Tensor, hook: Any, blocked: Tensor = blocked) -> Tensor:
            return attn_scores.masked_fill(blocked, float("-inf"))

        hooks: list[tuple[str, Callable[..., Any]]] = [(name, block) for name in names]
        hooks += [read_final, *extra_hooks]
        with torch.no_grad():
            mask = None if attention_mask is None else attention_mask.repeat(k, 1)
            logits = model.run_with_hooks(  # type: ignore[operator]
                tokens.repeat(k, 1), fwd_hooks=hooks, **mask_kwargs(model, mask)
            )
        value = read(logits, final["r"])
        values.append(value.reshape(k, batch, *value.shape[1:]))
    return torch.cat(values)


def check_blockable(model: nn.Module, pattern_after_z: bool) -> None:
    """A ConnWalkError where a score set to ``-inf`` at ``hook_attn_scores`` cannot reach the
    output: a model that computes attention in its own code and shows the scores and pattern
    after the fact (a BERT ``TransformerBridge``)."""
    if pattern_after_z:
        raise ConnWalkError(
            f"this {type(model).__name__} computes attention in Hugging Face's code and shows "
            "hook_attn_scores after the fact, so a key cannot be blocked through its hooks: "
            "knockout and knockout_estimate do not run on it. Use method='connection', or load "
            "the model as a HookedEncoder."
        )


def knockout(
    frozen: FrozenNetwork, target: targets.Target, clean: Float[Tensor, " batch"]
) -> Float[Tensor, "batch source"]:
    """``y - y_s``: the target's drop when key ``s`` is blocked for every other query."""
    check_blockable(frozen.model, frozen.pattern_after_z)
    batch, n_pos = frozen.tokens.shape
    one_each = torch.eye(n_pos, dtype=torch.bool, device=clean.device)[:, None].expand(
        n_pos, batch, n_pos
    )

    def read(logits: Tensor, activation: Tensor) -> Tensor:
        k = activation.shape[0] // batch
        return targets.clean_value(target.repeat(k), logits, activation)

    knocked = block_keys(
        frozen.model,
        frozen.tokens,
        one_each,
        read,
        read_hook=targets.read_at(target, frozen.model),
        attention_mask=frozen.attention_mask,
    )
    return (clean[None] - knocked).T.to(clean.dtype)
