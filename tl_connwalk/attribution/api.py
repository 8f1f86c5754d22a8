"""`attribute`: one call for every attribution method, one `Attribution` record back."""

import functools
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from tl_connwalk.adapters import adapter_for
from tl_connwalk.attribution import baselines, targets
from tl_connwalk.attribution.connection import connection
from tl_connwalk.attribution.frozen import FrozenNetwork, pattern_hooks
from tl_connwalk.attribution.record import Attribution
from tl_connwalk.attribution.routes import route_table
from tl_connwalk.errors import ConnWalkError

Method = Literal["connection", "grad_x_input", "knockout", "rollout"]


def _tokens(model: nn.Module, input: str | list[str] | Tensor) -> Tensor:
    if isinstance(input, Tensor):
        if input.is_floating_point() or input.ndim not in (1, 2):
            raise ConnWalkError(
                f"input must be tokens [batch, pos] (integers) or text; got {input.dtype} "
                f"{tuple(input.shape)}."
            )
        return input if input.ndim == 2 else input[None]
    if isinstance(input, str):
        input = [input]
    if isinstance(input, list) and all(isinstance(text, str) for text in input):
        lengths = {len(model.to_tokens(text)[0]) for text in input}  # type: ignore[operator]
        if len(lengths) > 1:
            raise ConnWalkError(
                "these texts tokenise to different lengths; pass them one at a time, or pass "
                "tokens with a position per sequence."
            )
        tokens: Tensor = model.to_tokens(input)  # type: ignore[operator]
        return tokens
    raise ConnWalkError(
        f"input must be tokens [batch, pos] or text (a string or a list of strings), got "
        f"{type(input).__name__}."
    )


def attribute(
    model: nn.Module,
    input: str | list[str] | Tensor,
    *,
    target: targets.TargetSpec = None,
    position: int | Tensor = -1,
    method: Method = "connection",
) -> Attribution:
    """Split a target output over the source tokens that made it (spec §6).

    ``method="connection"`` is exact for the frozen network ``F``: attention patterns,
    normalisation scales (``hook_scale``) and MLP activations (as per-neuron gains) fixed at
    the clean run. ``F`` is affine in the input embeddings ``e_s`` (token plus positional
    embedding of position ``s``), and ``scores[b, s] = F(only e_s) - F(no embeddings)``,
    ``bias[b] = F(no embeddings)``, ``scores.sum(-1) + bias == target_value`` (the model's
    own output). It costs one clean run, one forward and backward pass of ``F`` and one
    forward pass for the bias, however many sources there are.

    Args:
        model: a TransformerLens ``HookedTransformer``, ``HookedEncoder`` (a masked position's
            logit) or decoder ``TransformerBridge``.
        input: tokens ``[batch, pos]`` (or ``[pos]``), a text, or texts of one length.
        target: ``None``: the top predicted token's logit; a token id (or ``[batch]`` ids):
            its logit; ``(token, other)``: ``logit(token) - logit(other)``; a float
            ``[d_model]`` (or ``[batch, d_model]``) direction ``u``: ``u . r_final``, with
            ``r_final`` the residual after the last block, before the final norm.
        position: the position the target is read at (an int, negative from the end, or
            ``[batch]`` ints).
        method: ``"connection"``, the exact method; or a baseline (see
            `tl_connwalk.attribution.baselines`): ``"grad_x_input"`` (the real gradient times
            the embeddings) or ``"knockout"`` (ground truth by intervention: the target's drop
            when no other query may attend to the source, in any layer; one forward pass per
            source), or ``"rollout"`` (attention rollout: head-mean patterns with the
            identity, multiplied over layers; a distribution over sources). A baseline's
            ``bias`` is what it leaves unexplained.

    Returns:
        An `Attribution`: ``scores`` ``[batch, source]``, ``bias`` and ``target_value``
        ``[batch]``, with `Attribution.by_component` and `Attribution.edges`.

    Examples:
        >>> result = tl_connwalk.attribute(model, tokens, target=5, position=-1)
        >>> result.scores.shape, result.bias.shape
        (torch.Size([2, 8]), torch.Size([2]))
    """
    adapter_for(model)  # a supported model class, or a ConnWalkError naming them
    if method not in get_args(Method):
        raise ConnWalkError(f"unknown method {method!r}; choose one of {get_args(Method)}.")
    tokens = _tokens(model, input)
    frozen = FrozenNetwork.from_clean_run(model, tokens)
    target_ = targets.resolve(target, position, frozen.logits)
    clean = targets.clean_value(target_, frozen.logits, frozen.final_resid)
    if method != "connection":
        if method == "grad_x_input":
            scores = baselines.grad_x_input(frozen, target_)
        elif method == "knockout":
            scores = baselines.knockout(frozen, target_, clean)
        else:
            patterns = torch.stack([frozen.frozen[name] for name in pattern_hooks(model)])
            rows = torch.arange(len(target_.position), device=patterns.device)
            scores = baselines.rollout(patterns)[rows, target_.position].to(clean)
        return Attribution(
            scores=scores,
            bias=(clean - scores.sum(-1)).detach(),
            target_value=clean.detach(),
            tokens=tokens,
            position=target_.position,
            targets=tuple(target_.describe()),
            method=method,
        )
    result = connection(frozen, target_, clean)
    return Attribution(
        scores=result.scores,
        bias=result.bias,
        target_value=clean.detach(),
        tokens=tokens,
        position=target_.position,
        targets=tuple(target_.describe()),
        method=method,
        _components=result.components,
        _edges=result.edges,
        _routes=functools.cache(lambda max_length: route_table(frozen, target_, max_length)),
    )
