"""`attribute`: one call for every attribution method, one `Attribution` record back."""

import functools
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from tl_connwalk.adapters import adapter_for
from tl_connwalk.attribution import baselines, knockout_estimate, layerwise, mixing, targets
from tl_connwalk.attribution.connection import connection
from tl_connwalk.attribution.frozen import FrozenNetwork, pattern_hooks
from tl_connwalk.attribution.record import Attribution
from tl_connwalk.attribution.routes import route_table
from tl_connwalk.errors import ConnWalkError

Method = Literal[
    "connection",
    "knockout_estimate",
    "grad_x_input",
    "knockout",
    "rollout",
    "attention_norm",
    "alti",
    "value_zeroing",
]

#: the baselines that roll out one token-mixing matrix per layer (`layerwise`, `mixing`)
LAYERWISE = {
    "attention_norm": layerwise.attention_norm,
    "alti": layerwise.alti,
    "value_zeroing": layerwise.value_zeroing,
}


def _tokens(
    model: nn.Module, input: str | list[str] | Tensor, attention_mask: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Tokens ``[batch, pos]`` and the padding mask (``None``: no padding)."""
    if isinstance(input, Tensor):
        if input.is_floating_point() or input.ndim not in (1, 2):
            raise ConnWalkError(
                f"input must be tokens [batch, pos] (integers) or text; got {input.dtype} "
                f"{tuple(input.shape)}."
            )
        tokens = input if input.ndim == 2 else input[None]
        d_vocab = int(getattr(model.cfg, "d_vocab", 0) or 0)
        if tokens.numel() and d_vocab and (tokens.min() < 0 or tokens.max() >= d_vocab):
            raise ConnWalkError(
                f"tokens must be ids in 0..{d_vocab - 1} (this model's vocabulary); got "
                f"{int(tokens.min())}..{int(tokens.max())}. Pass the ids model.to_tokens gives."
            )
        return tokens, _checked_mask(attention_mask, tokens)
    if isinstance(input, str):
        input = [input]
    if not (isinstance(input, list) and input and all(isinstance(t, str) for t in input)):
        raise ConnWalkError(
            f"input must be tokens [batch, pos] or text (a string or a list of strings), got "
            f"{type(input).__name__}."
        )
    if attention_mask is not None:
        raise ConnWalkError(
            "attention_mask goes with tokens; texts are padded and masked here. Pass tokens and "
            "their mask, or texts alone."
        )
    pieces = [_text_tokens(model, text) for text in input]
    lengths = [len(piece) for piece in pieces]
    n_pos = max(lengths)
    if min(lengths) == n_pos:
        return torch.stack(pieces), None
    tokenizer: Any = getattr(model, "tokenizer", None)
    left = getattr(tokenizer, "padding_side", "right") == "left"
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    tokens = torch.full((len(pieces), n_pos), pad, dtype=pieces[0].dtype)
    mask = torch.zeros(len(pieces), n_pos, dtype=torch.long)
    for row, piece in enumerate(pieces):
        start = n_pos - len(piece) if left else 0
        tokens[row, start : start + len(piece)] = piece
        mask[row, start : start + len(piece)] = 1
    return tokens.to(pieces[0].device), mask.to(pieces[0].device)


def _text_tokens(model: nn.Module, text: str) -> Tensor:
    tokens: Any = model.to_tokens(text)  # type: ignore[operator]
    return (tokens[0] if isinstance(tokens, tuple) else tokens)[0]  # an encoder's tuple


def _checked_mask(attention_mask: Tensor | None, tokens: Tensor) -> Tensor | None:
    """``attention_mask`` as 0/1 integers on the tokens' device; ``None`` if nothing is padding."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != tokens.shape:
        shape = getattr(attention_mask, "shape", type(attention_mask).__name__)
        raise ConnWalkError(
            f"attention_mask must be [batch, pos] = {tuple(tokens.shape)} like the tokens "
            f"(1: real token, 0: padding), got {shape}."
        )
    mask = (attention_mask != 0).long().to(tokens.device)
    if not bool(mask.any(-1).all()):
        b = int((~mask.any(-1)).nonzero()[0])
        raise ConnWalkError(f"attention_mask has no real token in sequence {b}.")
    return None if bool(mask.all()) else mask


def _real_position(position: int | Tensor, mask: Tensor) -> Tensor:
    """``position`` counted over each sequence's real tokens (``-1``: its last real token) as
    an index into the padded batch ``[batch]``."""
    counts = mask.sum(-1)
    pos = torch.as_tensor(position, device=mask.device)
    if pos.is_floating_point() or pos.ndim > 1 or pos.numel() not in (1, len(mask)):
        raise ConnWalkError(
            f"position must be an int or one per sequence ([{len(mask)}] integers), got "
            f"{position!r}."
        )
    pos = pos.reshape(-1).expand(len(mask)).long()
    if ((pos < -counts) | (pos >= counts)).any():
        raise ConnWalkError(
            f"position {pos.tolist()} is out of range for sequences of {counts.tolist()} real "
            "tokens (with padding, positions count each sequence's real tokens; -1 is its last)."
        )
    nth = pos % counts  # the nth real token
    ranks = mask.cumsum(-1) - 1
    return ((ranks == nth[:, None]) & (mask != 0)).long().argmax(-1)


def _mixing(frozen: FrozenNetwork, method: str, position: Tensor) -> Tensor:
    """Row ``position`` of a rolled-out mixing method (``rollout`` or a layer-wise one) over
    the layers that ran before the target. A layer-wise method measures each distinct
    sequence of the batch once (a batch of targets on one text costs one sequence)."""
    names = [name for name in pattern_hooks(frozen.model) if name in frozen.frozen]
    if not names:  # the target is read before any attention: the identity
        return torch.eye(frozen.tokens.shape[1], device=position.device)[position]
    if method == "rollout":
        mixed = baselines.rollout(torch.stack([frozen.frozen[name] for name in names]))
    else:
        distinct, inverse = torch.unique(frozen.tokens, dim=0, return_inverse=True)
        layers = LAYERWISE[method](frozen.model, distinct, layers=len(names))
        mixed = mixing.rolled_out(layers)[inverse]
    rows = torch.arange(len(position), device=mixed.device)
    return mixed[rows, position.to(mixed.device)]


def attribute(
    model: nn.Module,
    input: str | list[str] | Tensor,
    *,
    target: targets.TargetSpec = None,
    position: int | Tensor = -1,
    method: Method = "connection",
    attention_mask: Tensor | None = None,
    exact: int | None = None,
) -> Attribution:
    """Split a target output over the source tokens that made it (spec §6), or predict what
    knocking each one out would change (``method="knockout_estimate"``, spec §7).

    ``method="connection"`` is exact for the frozen network ``F``: attention patterns,
    normalisation scales (``hook_scale``) and MLP activations (as per-neuron gains) fixed at
    the clean run. ``F`` is affine in the input embeddings ``e_s`` (token plus positional
    embedding of position ``s``), and ``scores[b, s] = F(only e_s) - F(no embeddings)``,
    ``bias[b] = F(no embeddings)``, ``scores.sum(-1) + bias == target_value`` (the model's
    own output). It costs one clean run, one forward and backward pass of ``F`` and one
    forward pass for the bias, however many sources there are; on a ``HookedTransformer`` or
    ``HookedEncoder`` the backward pass recomputes each block (one more forward pass of
    ``F``), so that memory holds one block's activations at a time.

    Args:
        model: a TransformerLens ``HookedTransformer``, ``HookedEncoder`` (a masked position's
            logit) or decoder ``TransformerBridge``.
        input: tokens ``[batch, pos]`` (or ``[pos]``), a text, or texts (of any lengths:
            padded on the tokenizer's side, then masked).
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
            ``[batch]`` ints). In a padded batch it counts each sequence's real tokens (``-1``:
            its last real token); ``Attribution.position`` is the index in the padded batch.
        method: ``"connection"``, the exact method; ``"knockout_estimate"``, knockout
            predicted (spec §7): ``scores[b, s]`` predicts ``y - y_s`` with key ``s`` blocked for
            every other query, in every layer, from one forward and one backward pass of the
            real model (the renormalised attention of each blocked edge read along the
            target's gradient at ``hook_z``), ``exact`` sources per target knocked out for
            real; `Attribution.edges` predicts blocking each edge, `Attribution.remainder` is
            what the exact sources added, `Attribution.verify` measures knockout beside the
            prediction; or a baseline (see
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
            The layer-wise baselines do not take padded batches: attribute those sequences
            one at a time.
        attention_mask: ``[batch, pos]`` with tokens: 1 on real tokens, 0 on padding (left or
            right), as ``run_with_cache`` takes it. Padding sends nothing and counts nowhere:
            its scores are 0, it is left out of `Attribution.routes` and
            `Attribution.to_dataframe`, and each sequence's scores are those it has alone.

        exact: ``method="knockout_estimate"`` only: how many sources per target are knocked
            out for real, where the first order is poorest: the first position (the attention
            sink), then those nearest the target (default 2; 0: the first order alone). Each
            costs at most one forward pass per distinct sequence, shared by the targets on it;
            on a causal ``HookedTransformer`` without padding, only the positions after the
            source are recomputed (the one just before a target: one position).

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
    if exact is not None and method != "knockout_estimate":
        raise ConnWalkError(
            f"exact= belongs to method='knockout_estimate' (sources knocked out for real beside "
            f"its prediction); method={method!r} takes no exact=."
        )
    tokens, mask = _tokens(model, input, attention_mask)
    if method == "knockout_estimate":
        if mask is not None:
            position = _real_position(position, mask)
        return _estimated(model, tokens, mask, target, position, exact)
    if mask is not None and method in LAYERWISE:
        raise ConnWalkError(
            f"method={method!r} does not take padded batches (attention_mask or texts of "
            "different lengths); attribute those sequences one at a time."
        )
    frozen = FrozenNetwork.from_clean_run(
        model, tokens, mask, stop_at=targets.hook_of(model, target)
    )
    if mask is not None:
        position = _real_position(position, mask)
    target_ = targets.resolve(target, position, frozen.logits, frozen.final_resid)
    clean = targets.clean_value(target_, frozen.logits, frozen.final_resid)
    if method != "connection":
        if method == "grad_x_input":
            scores = baselines.grad_x_input(frozen, target_)
        elif method == "knockout":
            scores = baselines.knockout(frozen, target_, clean)
        else:
            scores = _mixing(frozen, method, target_.position).to(clean)
        if mask is not None:
            scores = scores * mask.to(scores)
        return Attribution(
            scores=scores,
            bias=(clean - scores.sum(-1)).detach(),
            target_value=clean.detach(),
            tokens=tokens,
            position=target_.position,
            targets=tuple(target_.describe()),
            method=method,
            attention_mask=mask,
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
        attention_mask=mask,
        _components=result.components,
        _edges=result.edges,
        _routes=functools.cache(lambda max_length: route_table(frozen, target_, max_length)),
    )


def _estimated(
    model: nn.Module,
    tokens: Tensor,
    mask: Tensor | None,
    target: targets.TargetSpec,
    position: int | Tensor,
    exact: int | None,
) -> Attribution:
    """``method="knockout_estimate"`` as an `Attribution` (spec §7)."""
    n_exact = knockout_estimate.DEFAULT_EXACT if exact is None else exact
    if isinstance(n_exact, bool) or not isinstance(n_exact, int) or n_exact < 0:
        raise ConnWalkError(
            f"exact must be an int >= 0 (sources per target knocked out for real), got {exact!r}."
        )
    est = knockout_estimate.estimate(model, tokens, mask, target, position, n_exact)

    scores = est.first_order + est.remainder

    def verify(k: int) -> tuple[Tensor, Tensor]:
        # the exact sources' scores are knockout's own values already: only the others run
        chosen = knockout_estimate.largest(scores, est.measurable, k)
        runs = chosen & ~est.exact
        measured = knockout_estimate.knock_out(model, tokens, mask, est.target, est.clean, runs)
        return chosen, torch.where(est.exact, scores, measured)

    return Attribution(
        scores=scores,
        bias=est.clean - scores.sum(-1),
        target_value=est.clean,
        tokens=tokens,
        position=est.target.position,
        targets=tuple(est.target.describe()),
        method="knockout_estimate",
        attention_mask=mask,
        remainder=est.remainder,
        exact=est.exact,
        _edges=est.edges,
        _knock_out=verify,
    )
