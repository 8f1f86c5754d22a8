"""The view of a `ConnectionWalk`: one layer's walk, gates and edge contributions (`walk_data`).

The page shows the walk ``W`` as a heatmap (query rows, key columns), the selected edge's
gates and per-head patterns, the incoming edges of the selected query as arcs, the gates
``g^h`` of every head as small heatmaps, and the edge contributions when given. Colours
follow a log scale by default (``colour_scale="log"``: a sink column holding most of the
walk's mass does not wash out the other edges), switchable to linear on the page; each
heatmap's colour bar states its scale.
"""

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.views.labels import StrTokens, token_labels
from tl_connwalk.views.numbers import as_lists
from tl_connwalk.views.page import View


@runtime_checkable
class ShownWalk(Protocol):
    """What the page reads from a walk (a `tl_connwalk.ConnectionWalk`)."""

    @property
    def walk(self) -> Tensor: ...  # [batch, query, key]
    @property
    def gates(self) -> Tensor: ...  # [batch, head, query, key]
    @property
    def attention_mask(self) -> Tensor | None: ...  # [batch, pos]
    @property
    def layer(self) -> int | None: ...
    @property
    def kv_heads(self) -> Sequence[int] | None: ...


def walk_view(
    walk: ShownWalk,
    *,
    str_tokens: StrTokens | None = None,
    edge_contributions: Tensor | None = None,
    head_contributions: Tensor | None = None,
    norms: bool = False,
    colour_scale: str = "log",
) -> View:
    """The `View` of ``walk`` (`walk_data` gathers its numbers).

    >>> walk_view(walk).html().startswith("<!DOCTYPE html>")
    True
    """
    data = walk_data(
        walk,
        str_tokens=str_tokens,
        edge_contributions=edge_contributions,
        head_contributions=head_contributions,
        norms=norms,
        colour_scale=colour_scale,
    )
    layer = "" if walk.layer is None else f", layer {walk.layer}"
    return View("walk", f"Connection walk{layer}", data)


def walk_data(
    walk: ShownWalk,
    *,
    str_tokens: StrTokens | None = None,
    edge_contributions: Tensor | None = None,
    head_contributions: Tensor | None = None,
    norms: bool = False,
    colour_scale: str = "log",
) -> dict[str, Any]:
    """What the page embeds, per sequence ``b`` (``data["sequences"][b]``):

    ``tokens`` (labels: ``str_tokens``, one list for every sequence or one per sequence, else
    ``pos i``), ``real`` (False on padding, `ConnectionWalk.attention_mask`), ``walk``
    ``[query][key]`` (``W``), ``gates`` ``[head][query][key]`` (``g^h``), and when given
    ``edge`` ``[query][key]`` (a contribution per edge, e.g. ``||W_ij x_j T_ij||``) and
    ``head`` ``[head][query][key]`` (per head and edge, e.g. ``||A^h_ij f^h(x_j)||``), else
    ``None`` (shapes checked here, with a ConnWalkError naming them); ``selected``, the edge
    ``[query, key]`` shown on load: the last real query and its heaviest key (largest
    ``W_ij``). ``norms``: the contributions are the norms of
    `ConnectionWalk.edge_contributions` (the page names them so: per-head norms do not add up
    to the edge's). ``colour_scale``: ``"log"`` (default: colours follow ``log10`` of the
    value, over at most 4 decades below the largest) or ``"linear"``, the page's initial
    colour scale (a switch on the page changes it). The page holds ``O(batch H n^2)``
    numbers, each with `tl_connwalk.views.numbers.DIGITS` significant digits.

    >>> walk_data(walk)["sequences"][0]["gates"][0][0][0] == round(walk.gates[0, 0, 0, 0].item(), 6)
    True
    """
    if colour_scale not in ("log", "linear"):
        raise ConnWalkError(f"colour_scale must be 'log' or 'linear', got {colour_scale!r}.")
    batch, n_heads, n_pos, _ = walk.gates.shape
    labels = token_labels(None, batch, n_pos, str_tokens=str_tokens)
    edge = _checked(edge_contributions, "edge_contributions", (batch, n_pos, n_pos))
    head = _checked(head_contributions, "head_contributions", (batch, n_heads, n_pos, n_pos))
    mask = walk.attention_mask
    sequences = [
        {
            "tokens": labels[b],
            "real": [True] * n_pos if mask is None else mask[b].tolist(),
            "walk": as_lists(walk.walk[b]),
            "gates": as_lists(walk.gates[b]),
            "edge": None if edge is None else as_lists(edge[b]),
            "head": None if head is None else as_lists(head[b]),
            "selected": _heaviest_edge(walk.walk[b], None if mask is None else mask[b]),
        }
        for b in range(batch)
    ]
    return {
        "kind": "walk",
        "layer": walk.layer,
        "n_heads": n_heads,
        "value_heads": None if walk.kv_heads is None else list(walk.kv_heads),
        "norms": norms,
        "colour_scale": colour_scale,
        "sequences": sequences,
    }


def _heaviest_edge(walk: Tensor, real: Tensor | None) -> list[int]:
    """``[i, j]``: the last real query ``i`` (the last position without padding) and its key
    ``j`` with the largest ``W_ij`` (the first of equal ones)."""
    query = walk.shape[0] - 1 if real is None else int(real.nonzero().max())
    return [query, int(walk[query].argmax())]


def _checked(values: Tensor | None, name: str, shape: tuple[int, ...]) -> Tensor | None:
    if values is not None and not isinstance(values, Tensor):
        raise ConnWalkError(
            f"{name} must be a tensor of shape {shape}, got {type(values).__name__}."
        )
    if values is None or tuple(values.shape) == shape:
        return values
    raise ConnWalkError(
        f"{name} has shape {tuple(values.shape)}; this walk needs {shape} "
        f"({'[batch, query, key]' if len(shape) == 3 else '[batch, head, query, key]'})."
    )
