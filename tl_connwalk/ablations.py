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
``uniform_gates``           ``g^h :=`` the chosen heads' mean gate (all heads: ``1/H``, ``A^h = W``)
``message_patch``           any callable on the messages tensor
==========================  =================================================================

Every factory takes the model first, then the layer: ``factory(model, layer, ...)``. The four
transport patches take ``head=`` (an int, a list of heads each patched alike, or None for all);
`uniform_gates` takes ``heads=``, the group whose gates are shared. Layers and heads count from
the end when negative, as in Python (`tl_connwalk.core.checks.checked_index`).

The transport patches are exact maps on the messages, ``m'^h_j = m^h_j R^h``, equivalent to
output weights ``W_O^h R^h`` with ``W_V^h`` and ``b_V^h`` kept (so ``b_V^h`` goes through the
patched map like the rest of the value); see `tl_connwalk.core.transport_patches`.

Works on ``HookedTransformer`` and decoder ``TransformerBridge`` models (grouped-query ``W_V``
expanded here); a BERT Bridge refuses edits with `ConnWalkError` (see `tl_connwalk.hooks.bridge`).

>>> model = tl_connwalk.attach(model)
>>> patch = isometric_transport(model, 1, head=2)
>>> logits = model.run_with_hooks(tokens, fwd_hooks=patch)
>>> table = ablation_sweep(model, tokens, layers=[1], progress=False)
>>> table = ablation_sweep(model, tokens, layers=[1], positions=slice(4, -1), progress=False)
"""

import inspect
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.hook_points import HookPoint

from tl_connwalk.adapters import adapter_for, resolve_layer, resolve_layers
from tl_connwalk.adapters.weights import expand_kv_heads
from tl_connwalk.attribution.api import _tokens as tokens_of
from tl_connwalk.core.checks import check_flag, check_token_ids, checked_index
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
#: ``metric(logits)`` or ``metric(logits, targets)``, returning one number (see `ablation_sweep`)
Metric = Callable[..., Tensor | float]
Positions = int | Sequence[int] | slice | None


def _n_layers_heads(model: Any) -> tuple[int, int]:
    return int(model.cfg.n_layers), int(model.cfg.n_heads)


def _check_layer(
    model: Any, layer: object, point: Literal["walk", "gates", "messages"]
) -> tuple[int, str]:
    """``layer`` as a non-negative index (negative counts from the end) and the name of its
    ``point``, once ``model`` is a supported model with the conn hook points (`attach`)."""
    layer = resolve_layer(adapter_for(model), model, layer)
    name = hook_name(layer, point)
    if name not in model.hook_dict:
        raise ConnWalkError(
            f"{name} is not a hook point of this model: call tl_connwalk.attach(model) first"
        )
    return layer, name


def _head_index(n_heads: int, head: object, layer: int | None = None) -> list[int]:
    """``head`` (an int, a sequence of them, or None: every head) as non-negative indices,
    negative counting from the end."""
    if head is None:
        return list(range(n_heads))
    if isinstance(head, (str, bytes, Tensor)) or not isinstance(head, (numbers.Integral, Iterable)):
        raise ConnWalkError(
            f"head must be an int, a list of ints or None (every head), got {head!r}"
        )
    heads = list(head) if isinstance(head, Iterable) else [head]
    owner = "this layer" if layer is None else f"layer {layer}"
    return [checked_index(h, n_heads, "head", owner, "heads") for h in heads]


def _select(messages: Tensor, heads: list[int]) -> Tensor:
    """The head indices as a tensor on the messages' device."""
    return torch.tensor(heads, device=messages.device)


def zero_transport(model: Any, layer: int, head: Heads = None) -> list[Hook]:
    """Zero head ``h``'s messages, ``m'^h_j = 0``: the head adds nothing but its share of ``b_O``.

    The same logits as zeroing ``blocks.{layer}.attn.hook_z[:, :, h]`` (TransformerLens
    zero-ablation). ``head=None``: every head of the layer.

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=zero_transport(model, 0, head=1))
    """
    layer, name = _check_layer(model, layer, "messages")
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
    layer, name = _check_layer(model, layer, "messages")
    heads = _head_index(_n_layers_heads(model)[1], head, layer)
    dims = (1,) if check_flag(per_sequence, "per_sequence") else (0, 1)

    def hook(messages: Float[Tensor, "batch key head d_model"], hook: HookPoint) -> Tensor:
        index = _select(messages, heads)
        mean = messages.index_select(2, index).mean(dim=dims, keepdim=True)
        return messages.index_copy(2, index, mean.expand(*messages.shape[:2], *mean.shape[2:]))

    return [(name, hook)]


def _transport_patch(
    model: Any, layer: int, head: Heads, make_map: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
) -> list[Hook]:
    layer, name = _check_layer(model, layer, "messages")
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


def uniform_gates(model: Any, layer: int, heads: Heads = None) -> list[Hook]:
    """Share the gates of the heads ``S`` equally among them; the other heads' gates are kept::

        g'^h_ij = (1/|S|) sum_{h' in S} g^h'_ij   (h in S),    g'^h_ij = g^h_ij   (h not in S)

    so the walk ``W`` and the total gate ``sum_{h in S} g^h_ij`` of the group on every edge are
    unchanged, and each head of ``S`` gets the group's mean pattern ``A'^h = mean_{h' in S} A^h'``.
    ``heads=None``: every head, ``g^h := 1/H`` and ``A^h := W``: the layer is then one head with
    transport ``sum_h T^h`` (spec §1.2, the single-head reduction), the ablation of gating.
    Explicit ``heads`` must name at least two distinct heads (one head's gate would not change).

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=uniform_gates(model, 0))
    >>> logits = model.run_with_hooks(tokens, fwd_hooks=uniform_gates(model, 0, heads=[0, 2]))
    """
    layer, name = _check_layer(model, layer, "gates")
    chosen = _head_index(_n_layers_heads(model)[1], heads, layer)
    if heads is not None and len(set(chosen)) < 2:
        raise ConnWalkError(
            f"layer {layer}: uniform_gates shares the gates of at least two heads, got "
            f"heads={heads!r}; pass two or more heads, or heads=None for the whole layer"
        )
    chosen = sorted(set(chosen))

    def hook(gates: Float[Tensor, "batch head query key"], hook: HookPoint) -> Tensor:
        if len(chosen) == gates.shape[1]:
            return torch.full_like(gates, 1.0 / gates.shape[1])
        index = torch.tensor(chosen, device=gates.device)
        mean = gates.index_select(1, index).mean(dim=1, keepdim=True)
        return gates.index_copy(1, index, mean.expand(-1, len(chosen), -1, -1))

    return [(name, hook)]


MessageFn = Callable[
    [Float[Tensor, "batch key head d_model"]], Float[Tensor, "batch key head d_model"]
]


def message_patch(model: Any, layer: int | MessageFn, fn: MessageFn | None = None) -> list[Hook]:
    """Apply ``fn(messages) -> messages`` at ``blocks.{layer}.attn.hook_conn_messages``.

    ``fn`` must keep the shape ``[batch, key, head, d_model]``; the attention output becomes
    ``sum_h A^h fn(m)^h + b_O``. The older order ``message_patch(layer, fn)`` (no model, so no
    check of the layer) still works in this release, with a ``DeprecationWarning``.

    >>> logits = model.run_with_hooks(tokens, fwd_hooks=message_patch(model, 0, lambda m: 2 * m))
    """
    if isinstance(model, int) and not isinstance(model, bool) and callable(layer) and fn is None:
        warnings.warn(
            "message_patch(layer, fn) is deprecated and will be removed in the next release: "
            "call message_patch(model, layer, fn), model first like every other ablation",
            DeprecationWarning,
            stacklevel=2,
        )
        name, patch = hook_name(model, "messages"), layer
    else:
        if not callable(fn):
            raise ConnWalkError(
                "message_patch takes (model, layer, fn): an attached model, a layer index and a "
                f"callable on the messages; got layer={layer!r}, fn={fn!r}"
            )
        (_, name), patch = _check_layer(model, layer, "messages"), fn

    def hook(messages: Float[Tensor, "batch key head d_model"], hook: HookPoint) -> Tensor:
        return patch(messages)

    return [(name, hook)]


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


def next_token_loss(
    logits: Float[Tensor, "batch n d_vocab"], targets: Int[Tensor, "batch n"]
) -> Float[Tensor, ""]:
    """Mean cross-entropy ``-mean log softmax(logits)[target]``, in float32 or wider.

    The default metric of `ablation_sweep`: there ``logits`` are read at the chosen positions
    ``p`` and ``targets`` are the tokens they predict, ``tokens[:, p + 1]``; over every position
    it is TransformerLens's ``return_type="loss"``.

    >>> next_token_loss(torch.zeros(1, 2, 4), torch.tensor([[0, 3]]))  # log 4
    tensor(1.3863)
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.ndim < 1:
        raise ConnWalkError(
            f"logits must be a float tensor [..., d_vocab], got {_described(logits)}"
        )
    if (
        not isinstance(targets, Tensor)
        or targets.is_floating_point()
        or targets.is_complex()
        or targets.dtype == torch.bool
        or targets.shape != logits.shape[:-1]
    ):
        raise ConnWalkError(
            f"targets must be integer token ids of the logits' shape without d_vocab, "
            f"{tuple(logits.shape[:-1])}, got {_described(targets)}"
        )
    check_token_ids(targets, logits.shape[-1])
    log_probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    return -log_probs.gather(-1, targets[..., None]).mean()


def _described(value: object) -> str:
    """A tensor's dtype and shape, or another object's type and value, for a message."""
    if isinstance(value, Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _takes_targets(metric: Metric) -> bool:
    """Whether ``metric`` can take a second positional argument (then it gets the targets)."""
    try:
        parameters = list(inspect.signature(metric).parameters.values())
    except (TypeError, ValueError):
        raise ConnWalkError(
            f"metric {metric!r}: its signature cannot be read, so it is unclear whether it takes "
            "the targets; wrap it, e.g. metric=lambda logits: f(logits) or "
            "metric=lambda logits, targets: f(logits, targets)"
        ) from None
    kinds = [parameter.kind for parameter in parameters]
    positional = [k for k in kinds if k in (k.POSITIONAL_ONLY, k.POSITIONAL_OR_KEYWORD)]
    if inspect.Parameter.VAR_POSITIONAL in kinds or len(positional) >= 2:
        return True
    if len(positional) == 1:
        return False
    raise ConnWalkError(
        f"metric {metric!r} takes no positional argument; it must be metric(logits) or "
        "metric(logits, targets), returning one number"
    )


def _position_index(positions: Positions, n_pos: int, with_targets: bool) -> list[int]:
    """The chosen positions as indices in ``[0, n_pos)``; with targets, each needs a next one."""
    if positions is None:
        return list(range(n_pos - 1 if with_targets else n_pos))
    ends = (positions.start, positions.stop, positions.step) if isinstance(positions, slice) else ()
    if any(
        end is not None and (isinstance(end, bool) or not isinstance(end, numbers.Integral))
        for end in ends
    ) or (isinstance(positions, slice) and positions.step == 0):
        raise ConnWalkError(
            f"a slice of positions takes int bounds and a nonzero step, got {positions!r}"
        )
    if isinstance(positions, slice):
        chosen = list(range(n_pos)[positions])
    elif isinstance(positions, (str, bytes)) or not isinstance(
        positions, (numbers.Integral, Iterable)
    ):
        raise ConnWalkError(
            f"positions must be an int, a list of ints, a slice or None, got {positions!r}"
        )
    else:
        given = list(positions) if isinstance(positions, Iterable) else [positions]
        chosen = [checked_index(p, n_pos, "position", "each sequence", "positions") for p in given]
    if not chosen:
        raise ConnWalkError(f"positions={positions!r} selects none of the {n_pos} positions")
    if with_targets and n_pos - 1 in chosen:
        raise ConnWalkError(
            f"positions={positions!r} includes the last position ({n_pos - 1}), which has no "
            "next token: the loss and a two-argument metric read the logits at p against "
            "tokens[:, p + 1]; end the positions before it (e.g. slice(a, -1)), or use a "
            "one-argument metric(logits)"
        )
    return chosen


def _scalar(value: Tensor | float, metric: Metric) -> float:
    try:
        result = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        result = None
    if result is None or result.is_complex():
        raise ConnWalkError(
            f"metric {metric!r} returned {_described(value)}; it must return one number (a "
            "float or a one-element tensor)"
        )
    if result.numel() != 1:
        raise ConnWalkError(
            f"metric {metric!r} returned shape {tuple(result.shape)}; it must return one "
            "number (reduce over batch and positions, e.g. with .mean())"
        )
    return float(result.item())


def _sweep_tokens(model: Any, tokens: object) -> Int[Tensor, "batch pos"]:
    """``tokens`` as ``[batch, pos]`` ids in the model's vocabulary: token ids ``[batch, pos]``
    or ``[pos]``, or text (a string, or strings of one length in tokens) tokenised with the
    model as `tl_connwalk.attribute` does."""
    if isinstance(tokens, (str, list)) and getattr(model, "tokenizer", None) is None:
        raise ConnWalkError(
            "this model has no tokenizer to turn text into tokens; pass token ids [batch, pos]"
        )
    ids, mask = tokens_of(model, cast(Any, tokens), None)
    if mask is not None:
        raise ConnWalkError(
            "these texts have different lengths in tokens, and ablation_sweep runs without an "
            "attention mask (padding would enter the metric): sweep each text on its own, or "
            "pass texts of one length"
        )
    if ids.is_complex() or ids.dtype == torch.bool:
        raise ConnWalkError(
            f"tokens must be integer token ids [batch, pos] (model.to_tokens gives them) or "
            f"text, got {_described(ids)}"
        )
    check_token_ids(ids, int(model.cfg.d_vocab))
    return ids


def _reader(
    tokens: Int[Tensor, "batch pos"], metric: Metric | None, positions: Positions
) -> Callable[[Tensor], float]:
    """``logits -> number``: the metric (default `next_token_loss`) read at ``positions``."""
    chosen: Metric = metric if metric is not None else next_token_loss
    with_targets = metric is None or _takes_targets(metric)
    index = torch.tensor(_position_index(positions, tokens.shape[1], with_targets))
    targets = tokens[:, index.to(tokens.device) + 1] if with_targets else None

    def read(logits: Tensor) -> float:
        at = logits[:, index.to(logits.device)]
        value = chosen(at, targets.to(logits.device)) if targets is not None else chosen(at)
        return _scalar(value, chosen)

    return read


def _head_choices(n_heads: int, heads: object) -> list[int | Literal["all"]]:
    """The sweep's head choices: each an index (negative counts from the end) or ``"all"``."""
    if heads is None:
        return [*range(n_heads), "all"]
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise ConnWalkError(
            f'heads must be None or a list of head choices, each an int or "all" (the whole '
            f"layer), got {heads!r}"
        )
    choices: list[int | Literal["all"]] = []
    for head in heads:
        if isinstance(head, str) and head != "all":
            raise ConnWalkError(f'a head choice is an int or "all" (the whole layer), got {head!r}')
        choices.append(
            "all"
            if isinstance(head, str)
            else checked_index(head, n_heads, "head", "each layer", "heads")
        )
    return choices


def _count_passes(runs: Sequence[tuple[int, int | str, Ablation]]) -> int:
    """One clean pass, one per run, one TransformerLens reference per (layer, head)."""
    return 1 + len(runs) + len({(layer, head) for layer, head, _ in runs})


def ablation_sweep(
    model: Any,
    tokens: Int[Tensor, "batch pos"] | Int[Tensor, " pos"] | str | list[str],
    ablations: Iterable[Ablation] = ABLATIONS,
    layers: Iterable[int] | None = None,
    heads: Iterable[int | Literal["all"]] | None = None,
    progress: bool = True,
    *,
    metric: Metric | None = None,
    positions: Positions = None,
) -> pd.DataFrame:
    """A metric (default: next-token loss) under each ablation, one row per (layer, head, ablation).

    Args:
        model: a ``HookedTransformer`` or decoder ``TransformerBridge``; attached here if it is
            not, and detached afterwards only then. Hooks are removed after each run, no weight
            changes, everything runs under ``torch.no_grad``.
        tokens: ``[batch, pos]`` (or ``[pos]``) token ids, or text: a string, or strings of
            one length in tokens (tokenised with the model, as `tl_connwalk.attribute` does;
            the sweep runs without an attention mask, so texts of different lengths, which
            would need padding, are refused).
        ablations: which of ``"zero"``, ``"mean"``, ``"isometric"``, ``"scalar"``,
            ``"uniform_gates"`` to run (default all five).
        layers: the layers to ablate, one at a time (default every layer).
        heads: the head choices, each ablated on its own: an int (one head) or ``"all"`` (the
            whole layer at once); default every head and ``"all"``. ``uniform_gates`` acts on
            the layer, so it runs only for ``"all"``.
        progress: print the number of forward passes before starting and show a progress bar
            counting them; ``False`` for silence.
        metric: what is read from the logits. ``metric(logits)`` gets the logits at the chosen
            positions, ``[batch, n, d_vocab]``; a metric that takes a second positional argument
            is called ``metric(logits, targets)`` with ``targets = tokens[:, p + 1]``
            ``[batch, n]``, the tokens those logits predict. It returns one number (a float or a
            one-element tensor). Default: `next_token_loss`, the mean next-token cross-entropy.
        positions: where the metric reads the logits: an int, a list of ints (negative from the
            end), or a slice of the ``pos`` axis. Default: every position for a one-argument
            metric, every position but the last (which predicts nothing) for the loss and a
            two-argument metric, which refuse the last position.

    Cost: ``1 + L * (n_h * (a + 1) + g)`` forward passes of ``tokens``, for ``L`` layers,
    ``n_h`` head choices and ``a >= 1`` head-wise ablations: one clean pass, and per layer and
    head choice ``a`` ablated passes and one TransformerLens ``hook_z`` reference, plus
    ``g = 1`` for ``uniform_gates`` when ``"all"`` is a head choice. All defaults on a model with
    ``H`` heads: ``1 + L (5 H + 6)``, e.g. 1,531 passes for 30 layers of 9 heads; pass
    ``layers=`` and ``heads=["all"]`` (``1 + 6 L``) to cut it down.

    Returns:
        a DataFrame with columns ``layer``, ``head`` (an int or ``"all"``), ``ablation``,
        ``loss_clean``, ``loss_ablated``, ``delta_loss`` (ablated minus clean) and
        ``loss_tl_zero``/``delta_loss_tl_zero``: TransformerLens zero-ablation of the same
        head(s) at ``hook_z``, the reference for ``"zero"``. With a ``metric``, ``loss`` reads
        ``metric`` in every column name (``metric_clean``, ``delta_metric``, ...).

    >>> table = ablation_sweep(model, tokens, ablations=("zero", "isometric"), layers=[0],
    ...                        progress=False)
    >>> sorted(set(table["ablation"]))
    ['isometric', 'zero']
    >>> last = ablation_sweep(model, tokens, ablations=("zero",), layers=[0], heads=["all"],
    ...                       metric=lambda logits: logits[:, 0, 0].mean(), positions=-1,
    ...                       progress=False)
    >>> list(last.columns[3:6])
    ['metric_clean', 'metric_ablated', 'delta_metric']
    """
    adapter = adapter_for(model)
    tokens = _sweep_tokens(model, tokens)
    if isinstance(ablations, (str, bytes)) or not isinstance(ablations, Iterable):
        raise ConnWalkError(
            f"ablations must be a list of names from {ABLATIONS}, got {ablations!r}"
        )
    ablations = tuple(ablations)
    for ablation in ablations:
        if ablation not in ABLATIONS:
            raise ConnWalkError(f"ablation must be one of {ABLATIONS}, got {ablation!r}")
    check_flag(progress, "progress")
    read = _reader(tokens, metric, positions)
    n_heads = _n_layers_heads(model)[1]
    layer_list = resolve_layers(adapter, model, layers)
    head_list = _head_choices(n_heads, heads)
    runs = [
        (layer, head, ablation)
        for layer in layer_list
        for head in head_list
        for ablation in ablations
        if head == "all" or ablation != "uniform_gates"
    ]
    passes = _count_passes(runs)
    if progress:
        print(
            f"ablation_sweep: {passes:,} forward passes of {tuple(tokens.shape)} tokens "
            f"({len(layer_list)} layers x {len(head_list)} head choices x {len(ablations)} "
            "ablations, with the clean run and a hook_z reference per head choice); "
            "progress=False hides this",
            file=sys.stderr,
        )

    def run(hooks: list[Hook]) -> float:
        value = read(cast(Tensor, model.run_with_hooks(tokens, fwd_hooks=hooks)))
        bar.update()
        return value

    attached_here = not is_attached(model)
    if attached_here:
        attach(model)
    try:
        with (
            torch.no_grad(),
            tqdm(total=passes, disable=not progress, desc="ablation_sweep", unit="pass") as bar,
        ):
            clean = run([])
            reference: dict[tuple[int, int | str], float] = {}
            rows = []
            for layer, head, ablation in runs:
                index = None if head == "all" else cast(int, head)
                key = (layer, head)
                if key not in reference:
                    selected = _head_index(n_heads, index, layer)
                    reference[key] = run(_tl_zero_ablation(layer, selected))
                ablated = run(_ablation_hooks(model, ablation, layer, index))
                rows.append(
                    (layer, head, ablation, clean, ablated, ablated - clean, reference[key],
                     reference[key] - clean)
                )  # fmt: skip
    finally:
        if attached_here:
            detach(model)
    what = "loss" if metric is None else "metric"
    columns = [
        "layer", "head", "ablation", f"{what}_clean", f"{what}_ablated", f"delta_{what}",
        f"{what}_tl_zero", f"delta_{what}_tl_zero",
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=columns)
