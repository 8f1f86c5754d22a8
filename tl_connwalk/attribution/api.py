"""`attribute`: one call for every attribution method, one `Attribution` record back."""

from typing import Literal, get_args

import torch
from torch import Tensor, nn

from tl_connwalk.adapters import adapter_for
from tl_connwalk.attribution import baselines, layerwise, mixing, targets
from tl_connwalk.attribution.connection import connection
from tl_connwalk.attribution.frozen import FrozenNetwork, pattern_hooks
from tl_connwalk.attribution.record import Attribution
from tl_connwalk.errors import ConnWalkError

Method = Literal[
    "connection", "grad_x_input", "knockout", "rollout", "attention_norm", "alti", "value_zeroing"
]

#: the baselines that roll out one token-mixing matrix per layer (`layerwise`, `mixing`)
LAYERWISE = {
    "attention_norm": layerwise.attention_norm,
    "alti": layerwise.alti,
    "value_zeroing": layerwise.value_zeroing,
}


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


def _mixing(frozen: FrozenNetwork, method: str, position: Tensor) -> Tensor:
    """Row ``position`` of a rolled-out mixing method (``rollout`` or a layer-wise one) over
    the layers that ran before the target."""
    names = [name for name in pattern_hooks(frozen.model) if name in frozen.frozen]
    if not names:  # the target is read before any attention: the identity
        return torch.eye(frozen.tokens.shape[1], device=position.device)[position]
    if method == "rollout":
        mixed = baselines.rollout(torch.stack([frozen.frozen[name] for name in names]))
    else:
        layers = LAYERWISE[method](frozen.model, frozen.tokens)[: len(names)]
        mixed = mixing.rolled_out(layers)
    rows = torch.arange(len(position), device=mixed.device)
    return mixed[rows, position.to(mixed.device)]


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
            ``r_final`` the residual after the last block, before the final norm. Inside the
            network, at a TransformerLens hook point ``h`` (activation ``x_h``, flattened at
            the position): ``(h, u)`` with a float direction ``u`` (one entry per unit of
            ``x_h``, or ``[batch, ...]``): ``u . x_h``; ``(h, i)`` with an int: unit ``i`` of
            ``x_h`` (a neuron of ``blocks.6.mlp.hook_post``); ``(sae, i)`` with an SAELens
            ``SAE``: feature ``i``'s pre-activation at the SAE's hook,
            ``(x_h - b_dec) W_enc[:, i] + b_enc[i]``. Only what runs before ``h`` enters: the
            clean run and ``F`` stop there, and later layers' edges are 0; ``by_component``
            is for output targets.
        position: the position the target is read at (an int, negative from the end, or
            ``[batch]`` ints).
        method: ``"connection"``, the exact method; or a baseline (see
            `tl_connwalk.attribution.baselines`): ``"grad_x_input"`` (the real gradient times
            the embeddings) or ``"knockout"`` (ground truth by intervention: the target's drop
            when no other query may attend to the source, in any layer; one forward pass per
            source), or ``"rollout"`` (attention rollout: head-mean patterns with the
            identity, multiplied over layers). The layer-wise baselines summarise each layer
            by a row-normalised matrix ``C_l`` (the residual path inside it) and roll it out,
            ``R = C_{L-1} ... C_0``, ``scores = R[position]`` (`tl_connwalk.attribution.mixing`):
            ``"attention_norm"`` (Kobayashi et al. 2020/2021:
            ``C_ij ~ ||sum_h A^h_ij f^h(x_j) + [i = j] r_i||``, ``f^h(x) = (x W_V^h + b_V^h)
            W_O^h``, ``r`` the residual entering the layer), ``"alti"`` (Ferrando et al. 2022:
            ``C_ij ~ max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1)`` over the attention sublayer's
            transformed vectors ``T_i(x_j)``, normalisation linearised, biases left out; pre-norm
            decoders and ``HookedEncoder``) and ``"value_zeroing"`` (Mohebbi et al. 2023:
            ``C_ij ~ 1 - cos(y_i^{-j}, y_i)``, ``y`` the layer's output and ``-j`` token ``j``'s
            value vector zeroed in every head; per sequence, one pass through each layer for
            all sources). A row with nothing measured becomes the identity's. Rollout and the
            layer-wise baselines give distributions over sources (``scores`` sum to 1). A
            baseline's ``bias`` is what it leaves unexplained.

    Returns:
        An `Attribution`: ``scores`` ``[batch, source]``, ``bias`` and ``target_value``
        ``[batch]``, with `Attribution.by_component` and `Attribution.edges`.

    Examples:
        >>> result = tl_connwalk.attribute(model, tokens, target=5, position=-1)
        >>> result.scores.shape, result.bias.shape
        (torch.Size([2, 8]), torch.Size([2]))
        >>> neuron = tl_connwalk.attribute(model, tokens, target=("blocks.0.mlp.hook_post", 7))
        >>> neuron.targets
        ('blocks.0.mlp.hook_post[7] @ 7', 'blocks.0.mlp.hook_post[7] @ 7')
    """
    adapter_for(model)  # a supported model class, or a ConnWalkError naming them
    if method not in get_args(Method):
        raise ConnWalkError(f"unknown method {method!r}; choose one of {get_args(Method)}.")
    tokens = _tokens(model, input)
    frozen = FrozenNetwork.from_clean_run(model, tokens, stop_at=targets.hook_of(model, target))
    target_ = targets.resolve(target, position, frozen.logits, frozen.final_resid)
    clean = targets.clean_value(target_, frozen.logits, frozen.final_resid)
    if method != "connection":
        if method == "grad_x_input":
            scores = baselines.grad_x_input(frozen, target_)
        elif method == "knockout":
            scores = baselines.knockout(frozen, target_, clean)
        else:
            scores = _mixing(frozen, method, target_.position).to(clean)
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
    )
