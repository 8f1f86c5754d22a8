"""The view of an `Attribution`: its numbers gathered for the page (`attribution_data`).

The page shows the source tokens coloured by score with the target marked; the selected
token's direct paths (`Attribution.by_component`) and routes; the layer-by-head grid of each
component's direct path; and each layer's strongest edges (`Attribution.edges`) as arcs.
"""

import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from jaxtyping import Float, Int
from torch import Tensor

from tl_connwalk.attribution.routes import Route
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.views.labels import StrTokens, target_label, token_labels
from tl_connwalk.views.numbers import as_lists, rounded
from tl_connwalk.views.page import View


@runtime_checkable
class ShownAttribution(Protocol):
    """What the page reads from an attribution (a `tl_connwalk.Attribution`)."""

    @property
    def scores(self) -> Float[Tensor, "batch source"]: ...
    @property
    def bias(self) -> Float[Tensor, " batch"]: ...
    @property
    def target_value(self) -> Float[Tensor, " batch"]: ...
    @property
    def tokens(self) -> Int[Tensor, "batch source"]: ...
    @property
    def position(self) -> Int[Tensor, " batch"]: ...
    @property
    def targets(self) -> tuple[str, ...]: ...
    @property
    def method(self) -> str: ...

    def by_component(self) -> Float[Tensor, "batch component source"]: ...
    def component_names(self) -> list[str]: ...
    def edges(self, layer: int) -> Float[Tensor, "batch head query key"]: ...


_COMPONENT = re.compile(r"L(\d+)(?:H(\d+)|(MLP))")


def attribution_view(
    result: ShownAttribution,
    *,
    model: Any = None,
    str_tokens: StrTokens | None = None,
    routes: Sequence[Route] | None = None,
    top_edges: int = 8,
) -> View:
    """The `View` of ``result`` (`attribution_data` gathers its numbers).

    >>> view = attribution_view(tl_connwalk.attribute(model, tokens), model=model)
    >>> view.html().startswith("<!DOCTYPE html>")
    True
    """
    data = attribution_data(
        result, model=model, str_tokens=str_tokens, routes=routes, top_edges=top_edges
    )
    return View("attribution", f"Attribution ({result.method})", data)


def attribution_data(
    result: ShownAttribution,
    *,
    model: Any = None,
    str_tokens: StrTokens | None = None,
    routes: Sequence[Route] | None = None,
    top_edges: int = 8,
) -> dict[str, Any]:
    """What the page embeds, per sequence ``b`` (``data["sequences"][b]``):

    - ``tokens`` (labels, see `tl_connwalk.views.labels.token_labels`), ``scores``
      (``result.scores[b]``), ``position``, ``target`` (the label, its token ids decoded
      with ``model``'s tokenizer), ``target_value``, ``bias``;
    - ``selected``: the source shown on load, the one with the largest ``|score|`` (the
      first of equal ones);
    - ``components`` ``[component][source]``: ``result.by_component()[b]``, laid out on the
      grid by ``data["components"]`` (``names``, and each one's ``layer`` and ``column``:
      head ``h`` in column ``h``, the MLP in column ``n_heads``; layer ``-1`` off the grid);
    - ``edges[l]``: the ``top_edges`` edges ``j -> i`` of layer ``l`` with the largest
      ``|e_ij|``, ``e_ij = sum_h result.edges(l)[b, h, i, j]``, each ``{query, key, value,
      heads}`` (``heads``: the ``e^h_ij``); edges that carry exactly nothing are left out;
    - ``layer_totals[l]``: ``sum_{h,i,j} e^{l,h}_ij``, what all the edges of layer ``l`` carry;
    - ``routes``: the given routes of that sequence, largest ``|contribution|`` first;
    - ``exact`` and ``measured`` (``method="knockout_estimate"``, else ``None``): per source,
      whether its score is knockout's own value, and knockout as `Attribution.verify`
      measured it (``None`` where not measured).

    Fields a method does not define (``by_component``, ``edges`` and routes belong to
    ``method="connection"``) are ``None``, with the reason in ``data["notes"]``; the page then
    shows the scores alone. ``data["shares"]``: whether the page writes each part as a share
    of the target, ``value / target_value``: only for ``method="connection"``, whose scores
    and bias split the target exactly (a baseline's scores have the method's own units).
    Numbers keep `tl_connwalk.views.numbers.DIGITS` significant digits.

    >>> data = attribution_data(tl_connwalk.attribute(model, tokens), top_edges=3)
    >>> len(data["sequences"]), len(data["sequences"][0]["edges"][0])
    (2, 3)
    """
    if isinstance(top_edges, bool) or not isinstance(top_edges, int) or top_edges < 1:
        raise ConnWalkError(f"top_edges must be a positive int, got {top_edges!r}.")
    batch, n_pos = result.scores.shape
    labels = token_labels(result.tokens, batch, n_pos, model=model, str_tokens=str_tokens)
    names, parts, components_note = _components(result)
    layers, edges_note = _layer_edges(result)
    layout = None if names is None else _layout(names)
    sequences = []
    for b in range(batch):
        sequences.append(
            {
                "tokens": labels[b],
                "scores": as_lists(result.scores[b]),
                "position": int(result.position[b]),
                "selected": int(result.scores[b].abs().argmax()),
                "target": target_label(result.targets[b], model),
                "target_value": rounded(float(result.target_value[b])),
                "bias": rounded(float(result.bias[b])),
                "components": None if parts is None else as_lists(parts[b]),
                "edges": [_top_edges(edges[b], top_edges) for edges in layers] or None,
                "layer_totals": [rounded(float(edges[b].sum())) for edges in layers] or None,
                "routes": None,
                **_knockout_fields(result, b),
            }
        )
    routes_note = None
    if routes is None and result.method != "connection":
        routes_note = (
            f"No routes: routes belong to method='connection' (the frozen network, spec §6); "
            f"this attribution was made with method={result.method!r}."
        )
    elif routes is None:
        routes_note = (
            "No routes given: pass routes=k (the k largest of each sequence) or routes=[...]."
        )
    if routes is not None:
        for b, listed in enumerate(_routes_by_sequence(routes, batch, n_pos, names)):
            sequences[b]["routes"] = listed
    shape = (0, 0) if layout is None else (layout.pop("n_layers"), layout.pop("n_heads"))
    n_layers, n_heads = (len(layers), layers[0].shape[1]) if layers else shape
    return {
        "kind": "attribution",
        "method": result.method,
        "shares": result.method == "connection",
        "sequences": sequences,
        "components": layout,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "top_edges": top_edges,
        "notes": {"components": components_note, "edges": edges_note, "routes": routes_note},
    }


def _knockout_fields(result: ShownAttribution, b: int) -> dict[str, Any]:
    """``method="knockout_estimate"``: ``exact`` (per source, knocked out for real) and
    ``measured`` (knockout measured by `Attribution.verify`, ``None`` where not measured);
    ``None`` for other methods."""
    exact: Tensor | None = getattr(result, "exact", None)
    if exact is None:
        return {"exact": None, "measured": None}
    verified: dict[str, Tensor] = getattr(result, "_verified", {})
    measured: list[float | None] = [None] * exact.shape[1]
    if verified:
        for s in verified["sources"][b].nonzero()[:, 0].tolist():
            measured[s] = rounded(float(verified["knockout"][b, s]))
    return {"exact": exact[b].tolist(), "measured": measured}


def _components(result: ShownAttribution) -> tuple[list[str] | None, Tensor | None, str | None]:
    """``component_names``, ``by_component()`` and, where they are not defined, why not."""
    try:
        return result.component_names(), result.by_component(), None
    except ConnWalkError as error:
        return None, None, f"No head grid: {error}"


def _layer_edges(result: ShownAttribution) -> tuple[list[Tensor], str | None]:
    """Every layer's ``edges(layer)`` in order, or why there are none.

    The record holds one entry per layer and refuses the index past the last one.
    """
    layers: list[Tensor] = []
    while True:
        try:
            layers.append(result.edges(len(layers)))
        except ConnWalkError as error:
            if layers:
                return layers, None
            return [], f"No edge flows: {error}"


def _layout(names: list[str]) -> dict[str, Any]:
    """Each component's place on the layer-by-head grid (layer ``-1``: off the grid), and the
    grid's ``n_layers`` and ``n_heads``."""
    layer, column = [], []
    matches = [_COMPONENT.fullmatch(name) for name in names]
    n_heads = 1 + max((int(m[2]) for m in matches if m and m[2] is not None), default=-1)
    for match in matches:
        if match is None:
            layer.append(-1)
            column.append(-1)
        else:
            layer.append(int(match[1]))
            column.append(n_heads if match[3] else int(match[2]))
    n_layers = 1 + max(layer, default=-1)
    return {
        "names": names,
        "layer": layer,
        "column": column,
        "n_layers": n_layers,
        "n_heads": n_heads,
    }


def _top_edges(edges: Float[Tensor, "head query key"], k: int) -> list[dict[str, Any]]:
    """The ``k`` edges with the largest ``|sum_h e^h_ij|`` (none that carries exactly 0)."""
    total = edges.sum(0)
    n_key = total.shape[1]
    count = min(k, int((total != 0).sum()))
    order = total.abs().flatten().topk(count).indices
    return [
        {
            "query": int(index) // n_key,
            "key": int(index) % n_key,
            "value": rounded(float(total.flatten()[index])),
            "heads": as_lists(edges[:, int(index) // n_key, int(index) % n_key]),
        }
        for index in order
    ]


def _routes_by_sequence(
    routes: Sequence[Route], batch: int, n_pos: int, names: list[str] | None
) -> list[list[dict[str, Any]]]:
    """The routes of each sequence, largest ``|contribution|`` first, checked against it."""
    if isinstance(routes, (str, bytes)) or not isinstance(routes, Sequence):
        raise ConnWalkError(
            f"routes must be an int k (the k largest of each sequence) or a list of Route "
            f"(Attribution.routes gives them), got {type(routes).__name__} {routes!r}."
        )
    strays = [route for route in routes if not isinstance(route, Route)]
    if strays:
        raise ConnWalkError(
            f"routes must hold Route records (Attribution.routes gives them), got "
            f"{type(strays[0]).__name__} {strays[0]!r}."
        )
    known = None if names is None else set(names)
    listed: list[list[dict[str, Any]]] = [[] for _ in range(batch)]
    for route in routes:
        if not (0 <= route.batch < batch and 0 <= route.source < n_pos):
            raise ConnWalkError(
                f"route {route} has batch={route.batch}, source={route.source}, outside this "
                f"attribution's {batch} sequence(s) of {n_pos} positions."
            )
        unknown = [c for c in route.components if known is not None and c not in known]
        if unknown:
            raise ConnWalkError(
                f"route {route} passes {unknown}, which are not components of this attribution "
                "(see component_names())."
            )
        listed[route.batch].append(
            {
                "source": route.source,
                "components": list(route.components),
                "contribution": rounded(route.contribution),
            }
        )
    for items in listed:
        items.sort(key=lambda item: -abs(item["contribution"] or 0.0))
    return listed
