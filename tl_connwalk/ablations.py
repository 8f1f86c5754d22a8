"""Transport ablations on the connection-walk hook points, and a sweep over them.

Every factory returns a list of ``(hook_name, hook_fn)`` for
``model.run_with_hooks(tokens, fwd_hooks=...)`` on a model after ``tl_connwalk.attach(model)``;
none changes a weight. They act on ``blocks.{l}.attn.hook_conn_messages`` (``m^h_j``, the message
head ``h`` sends from key ``j``) or ``hook_conn_gates`` (spec §1.2):

==========================  =================================================================
``zero_transport``          ``m'^h = 0``: TransformerLens zero-ablation of the head at hook_z
``mean_transport``          ``m'^h_j = mean m^h`` over the batch and keys (mean ablation)
``isometric_transport``     ``T^h -> s U V^T``, the nearest scaled partial isometry
``scalar_transport``        ``T^h -> s U U^T``, s times the projection onto the range it reads
``uniform_gates``           ``g^h := 1/H``: patterns ``A^h := W``, the single-head reduction
``message_patch``           any callable on the messages tensor
==========================  =================================================================

The transport patches are exact maps on the messages, ``m'^h_j = m^h_j R^h``, equivalent to
output weights ``W_O^h R^h`` with ``W_V^h`` and ``b_V^h`` kept (so ``b_V^h`` goes through the
patched map like the rest of the value); see `tl_connwalk.core.transport_patches`.

Works on ``HookedTransformer`` and decoder ``TransformerBridge`` models (grouped-query ``W_V``
expanded here); a BERT Bridge refuses edits with `ConnWalkError` (see `tl_connwalk.bridge_hooks`).

>>> model = tl_connwalk.attach(model)
>>> patch = isometric_transport(model, 1, head=2)
>>> logits = model.run_with_hooks(tokens, fwd_hooks=patch)
>>> table = ablation_sweep(model, tokens, layers=[1], progress=False)
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.hook_points import HookPoint

from tl_connwalk.adapters.weights import expand_kv_heads
from tl_connwalk.core.transport_patches import (
    apply_message_map,
    isometric_message_map,
    scalar_message_map,
)
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks import hook_name
from tl_connwalk.plugin import attach, detach, is_attached

Hook = tuple[str, Callable[..., Any]]
Heads = int | Sequence[int] | None
Ablation = Literal["zero", "mean", "isometric", "scalar", "uniform_gates"]
ABLATIONS: tuple[Ablation, ...] = ("zero", "mean", "isometric", "scalar", "uniform_gates")


def _n_layers_heads(model: Any) -> tuple[int, int]:
    return int(model.cfg.n_layers), int(model.cfg.n_heads)


def _check_layer(model: Any, layer: int, point: Literal["walk", "gates", "messages"]) -> str:
    n_layers, _ = _n_layers_heads(model)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise ConnWalkError(f"layer must be an int in [0, {n_layers}), got {layer!r}")
    name = hook_name(layer, point)
    if name not in model.hook_dict:
        raise ConnWalkError(
            f"{name} is not a hook point of this model: call tl_connwalk.attach(model) first"
        )
    return name


def _head_index(n_heads: int, head: Heads, layer: int | None = None) -> list[int]:
    if head is None:
        return list(range(n_heads))
    heads = [head] if isinstance(head, int) else list(head)
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n_heads:
            where = "" if layer is None else f"layer {layer}: "
            raise ConnWalkError(f"{where}head must be in [0, {n_heads}) or None, got {head!r}")
    return heads


def _select(messages: Tensor, heads: list[int]) -> Tensor:
    """The head indices as a tensor on the messages' device."""
    return torch.tensor(heads, device=messages.device)


def zero_transport(model: Any, layer: int, head: Heads = None) -> list[Hook]:
    """Zero head ``h``'s messages, ``m'^h_j = 0``: the head adds nothing but its share of ``b_O``.

    The same logits as zeroing ``blocks.{layer}.attn.hook_z[:, :, h]`` (TransformerLens
    zero-ablation). ``head=None``: every head of the layer.

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=zero_transport(model, 0, head=1))
    """
    name = _check_layer(model, layer, "messages")
    heads = _head_index(_n_layers_heads(model)[1], head, layer)

    def hook(messages: Float[Tensor, "batch key head d_model"], hook: HookPoint) -> Tensor:
        return messages.index_fill(2, _select(messages, heads), 0.0)

    return [(name, hook)]


def mean_transport(
    model: Any, layer: int, head: Heads = None, per_sequence: bool = False
) -> list[Hook]:
    """Replace head ``h``'s messages by their mean over the batch and key positions.

    ``per_sequence=True`` takes the mean over each sequence's keys only. The mean is over all key
    positions, as in TransformerLens mean ablation, so under a causal mask later keys enter it.

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=mean_transport(model, 0))
    """
    name = _check_layer(model, layer, "messages")
    heads = _head_index(_n_layers_heads(model)[1], head, layer)
    dims = (1,) if per_sequence else (0, 1)

    def hook(messages: Float[Tensor, "batch key head d_model"], hook: HookPoint) -> Tensor:
        index = _select(messages, heads)
        mean = messages.index_select(2, index).mean(dim=dims, keepdim=True)
        return messages.index_copy(2, index, mean.expand(*messages.shape[:2], *mean.shape[2:]))

    return [(name, hook)]


def _transport_patch(
    model: Any, layer: int, head: Heads, make_map: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
) -> list[Hook]:
    name = _check_layer(model, layer, "messages")
    attn = model.blocks[layer].attn
    heads = _head_index(_n_layers_heads(model)[1], head, layer)
    with torch.no_grad():
        # the Bridge's W_V keeps the key-value heads of grouped-query models: expand them
        W_V = expand_kv_heads(attn.W_V.detach(), attn.W_O.shape[0])
        read, write = make_map(W_V[heads], attn.W_O[heads].detach())

    def hook(messages: Float[Tensor, "batch key head d_model"], hook: HookPoint) -> Tensor:
        index = _select(messages, heads)
        patched = apply_message_map(
            messages.index_select(2, index), read.to(messages.device), write.to(messages.device)
        )
        return messages.index_copy(2, index, patched)

    return [(name, hook)]


def isometric_transport(model: Any, layer: int, head: Heads = None) -> list[Hook]:
    """Replace ``T^h = W_V^h W_O^h = U S V^T`` by its nearest scaled partial isometry ``s U V^T``.

    ``s = mean sigma``; implemented as ``m'^h_j = m^h_j s V S^-1 V^T`` (exact: the head then acts
    as if its output weights were ``W_O^h s V S^-1 V^T``, whose product with ``W_V^h`` is
    ``s U V^T``; ``b_V^h`` passes through the same map). The map is computed once, here, from
    the current weights, in float32 or wider.

    >>> patch = isometric_transport(model, 1, head=0)
    >>> logits = model.run_with_hooks(tokens, fwd_hooks=patch)
    """
    return _transport_patch(model, layer, head, isometric_message_map)


def scalar_transport(model: Any, layer: int, head: Heads = None) -> list[Hook]:
    """Replace ``T^h = U S V^T`` by ``s U U^T``: scale ``s = mean sigma``, no turning.

    ``U U^T`` projects onto the column space of ``T^h`` (the directions the head reads), so each
    read component is written back unrotated. As `isometric_transport`, via
    ``m'^h_j = m^h_j s V S^-1 U^T``.

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=scalar_transport(model, 1))
    """
    return _transport_patch(model, layer, head, scalar_message_map)


def uniform_gates(model: Any, layer: int) -> list[Hook]:
    """Set every gate to ``1/H``: each head's pattern becomes the walk ``W = mean_h A^h``.

    The layer is then one head with transport ``sum_h T^h`` (spec §1.2, the single-head
    reduction): the ablation of gating.

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=uniform_gates(model, 0))
    """
    name = _check_layer(model, layer, "gates")

    def hook(gates: Float[Tensor, "batch head query key"], hook: HookPoint) -> Tensor:
        return torch.full_like(gates, 1.0 / gates.shape[1])

    return [(name, hook)]


def message_patch(
    layer: int,
    fn: Callable[
        [Float[Tensor, "batch key head d_model"]], Float[Tensor, "batch key head d_model"]
    ],
) -> list[Hook]:
    """Apply ``fn(messages) -> messages`` at ``blocks.{layer}.attn.hook_conn_messages``.

    ``fn`` must keep the shape ``[batch, key, head, d_model]``; the attention output becomes
    ``sum_h A^h fn(m)^h + b_O``.

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=message_patch(0, lambda m: 2 * m))
    """

    def hook(messages: Float[Tensor, "batch key head d_model"], hook: HookPoint) -> Tensor:
        return fn(messages)

    return [(hook_name(layer, "messages"), hook)]


def _tl_zero_ablation(layer: int, heads: list[int]) -> list[Hook]:
    """TransformerLens's own zero-ablation at ``hook_z``, the sweep's reference."""

    def hook(z: Tensor, hook: HookPoint) -> Tensor:
        return z.index_fill(2, torch.tensor(heads, device=z.device), 0.0)

    return [(f"blocks.{layer}.attn.hook_z", hook)]


def _ablation_hooks(model: Any, ablation: Ablation, layer: int, head: int | None) -> list[Hook]:
    if ablation == "zero":
        return zero_transport(model, layer, head)
    if ablation == "mean":
        return mean_transport(model, layer, head)
    if ablation == "isometric":
        return isometric_transport(model, layer, head)
    if ablation == "scalar":
        return scalar_transport(model, layer, head)
    return uniform_gates(model, layer)


def _loss(model: Any, tokens: Tensor, hooks: list[Hook]) -> float:
    loss = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=hooks)
    return float(cast(Tensor, loss).item())


def ablation_sweep(
    model: Any,
    tokens: Tensor,
    ablations: Iterable[Ablation] = ABLATIONS,
    layers: Iterable[int] | None = None,
    heads: Iterable[int | Literal["all"]] | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Next-token loss under each ablation, one row per ``(layer, head, ablation)``.

    ``heads=None``: every head and ``"all"`` (the whole layer at once); ``uniform_gates`` acts
    on the layer, so it has only the ``"all"`` row. Columns: ``layer``, ``head`` (an int or
    ``"all"``), ``ablation``, ``loss_clean``, ``loss_ablated``, ``delta_loss`` (ablated minus
    clean) and ``loss_tl_zero``/``delta_loss_tl_zero``: TransformerLens zero-ablation of the same
    head(s) at ``hook_z``, the reference for ``"zero"``. Attaches the model if needed and detaches
    it afterwards only then; hooks are removed after each run and no weight changes. Runs under
    ``torch.no_grad``. Needs a model whose forward takes ``return_type="loss"``.

    >>> table = ablation_sweep(model, tokens, ablations=("zero", "isometric"), layers=[0])
    >>> sorted(set(table["ablation"]))
    ['isometric', 'zero']
    """
    ablations = tuple(ablations)
    for ablation in ablations:
        if ablation not in ABLATIONS:
            raise ConnWalkError(f"ablation must be one of {ABLATIONS}, got {ablation!r}")
    n_layers, n_heads = _n_layers_heads(model)
    layer_list = list(range(n_layers)) if layers is None else list(layers)
    head_list: list[int | Literal["all"]] = (
        [*range(n_heads), "all"] if heads is None else list(heads)
    )
    for head in head_list:
        if head != "all":
            _head_index(n_heads, cast(int, head))
    runs = [
        (layer, head, ablation)
        for layer in layer_list
        for head in head_list
        for ablation in ablations
        if head == "all" or ablation != "uniform_gates"
    ]
    attached_here = not is_attached(model)
    if attached_here:
        attach(model)
    try:
        with torch.no_grad():
            clean = _loss(model, tokens, [])
            reference: dict[tuple[int, int | str], float] = {}
            rows = []
            for layer, head, ablation in tqdm(runs, disable=not progress, desc="ablation_sweep"):
                index = None if head == "all" else cast(int, head)
                key = (layer, head)
                if key not in reference:
                    selected = _head_index(n_heads, index, layer)
                    reference[key] = _loss(model, tokens, _tl_zero_ablation(layer, selected))
                ablated = _loss(model, tokens, _ablation_hooks(model, ablation, layer, index))
                rows.append(
                    {
                        "layer": layer,
                        "head": head,
                        "ablation": ablation,
                        "loss_clean": clean,
                        "loss_ablated": ablated,
                        "delta_loss": ablated - clean,
                        "loss_tl_zero": reference[key],
                        "delta_loss_tl_zero": reference[key] - clean,
                    }
                )
    finally:
        if attached_here:
            detach(model)
    columns = [
        "layer", "head", "ablation", "loss_clean", "loss_ablated", "delta_loss",
        "loss_tl_zero", "delta_loss_tl_zero",
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=columns)
