"""``Attribution``: the record `tl_connwalk.attribute` returns, the same for every method."""

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_connwalk.attribution.routes import Route, RouteTable
from tl_connwalk.core.checks import checked_index
from tl_connwalk.errors import ConnWalkError

if TYPE_CHECKING:
    from tl_connwalk.views.page import View


@dataclasses.dataclass(frozen=True, repr=False)
class Attribution:
    """How much each source token contributed to one target per sequence (spec §6).

    For ``method="connection"`` the split is exact for the frozen network ``F`` (patterns,
    normalisation scales and MLP gains fixed at the clean run): ``scores[b, s] = F(only e_s) -
    F(no embeddings)``, ``bias[b] = F(no embeddings)``, and
    ``scores.sum(-1) + bias == target_value``. Other methods fill ``scores`` by their own
    definition; their ``bias`` is what the method leaves unexplained, ``target_value -
    scores.sum(-1)``.

    Attributes:
        scores: ``[batch, source]`` each source position's contribution.
        bias: ``[batch]`` what no source sent.
        target_value: ``[batch]`` the target in the clean run (the model's own output).
        tokens: ``[batch, source]`` the input tokens.
        position: ``[batch]`` the position the target was read at.
        targets: one label per sequence, e.g. ``logit[17] @ 8``.
        method: the method that made the scores.
        attention_mask: ``[batch, source]`` 1 on real tokens, 0 on padding (``None``: no
            padding); padding's scores are 0.
        remainder: ``method="knockout_estimate"``: ``[batch, source]`` what the scores hold
            beyond the first-order edges (knockout measured minus predicted, on the sources
            knocked out for real; 0 elsewhere), so that ``scores`` is the edges summed over
            layers, heads and queries plus ``remainder``. ``None`` for other methods.
        exact: ``method="knockout_estimate"``: ``[batch, source]`` the sources whose score is
            knockout's own value (knocked out for real). ``None`` for other methods.

    Examples:
        >>> result = tl_connwalk.attribute(model, tokens)
        >>> result.scores.shape
        torch.Size([2, 8])
        >>> torch.testing.assert_close(result.scores.sum(-1) + result.bias, result.target_value)
    """

    scores: Float[Tensor, "batch source"]
    bias: Float[Tensor, " batch"]
    target_value: Float[Tensor, " batch"]
    tokens: Int[Tensor, "batch source"]
    position: Int[Tensor, " batch"]
    targets: tuple[str, ...]
    method: str
    attention_mask: Int[Tensor, "batch source"] | None = None
    remainder: Float[Tensor, "batch source"] | None = None
    exact: Bool[Tensor, "batch source"] | None = None
    _components: Callable[[], tuple[list[str], Tensor]] | None = dataclasses.field(
        default=None, compare=False
    )
    _edges: Tensor | None = dataclasses.field(default=None, compare=False)
    _routes: Callable[[int], RouteTable] | None = dataclasses.field(default=None, compare=False)
    _knock_out: Callable[[int], tuple[Tensor, Tensor]] | None = dataclasses.field(
        default=None, compare=False
    )
    _verified: dict[str, Tensor] = dataclasses.field(default_factory=dict, compare=False)

    def __repr__(self) -> str:
        batch, n_pos = self.scores.shape
        return (
            f"Attribution(method={self.method!r}, batch={batch}, sources={n_pos}, "
            f"targets={list(self.targets)})"
        )

    def show(
        self,
        *,
        model: Any = None,
        str_tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
        routes: Sequence[Route] | int | None = None,
        top_edges: int = 8,
    ) -> None:
        """Display this attribution in a Jupyter notebook, as `to_html` draws it."""
        self._view(model, str_tokens, routes, top_edges).show()

    def _view(
        self,
        model: Any,
        str_tokens: Sequence[str] | Sequence[Sequence[str]] | None,
        routes: Sequence[Route] | int | None,
        top_edges: int,
    ) -> "View":
        """The page `show` displays and `to_html` writes; ``routes`` as given, or for an int
        ``k`` the ``k`` largest of each sequence."""
        from tl_connwalk.attribution.view import attribution_view

        if isinstance(routes, int):
            routes = [
                route for b in range(len(self.scores)) for route in self.routes(routes, batch=b)
            ]
        return attribution_view(
            self, model=model, str_tokens=str_tokens, routes=routes, top_edges=top_edges
        )

    def to_html(
        self,
        path: str | Path,
        *,
        model: Any = None,
        str_tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
        routes: Sequence[Route] | int | None = None,
        top_edges: int = 8,
    ) -> Path:
        """Write this attribution to ``path`` as one self-contained HTML page; returns the path.

        The page (`tl_connwalk.views`) shows the source tokens coloured by score, the target
        position marked; hovering or clicking a token shows its direct paths and its ``routes``
        (`Route` records, or an int ``k``: the ``k`` largest routes of each sequence, `routes` with
        its default length, computed here); a layer-by-head grid of each component's direct path
        (`by_component`); and each layer's ``top_edges`` strongest edges (`edges`) as arcs.
        ``model`` (its tokenizer) or ``str_tokens`` label the tokens, else their ids do. It loads
        nothing from anywhere: open it in any browser, offline.

        >>> import tempfile
        >>> result = tl_connwalk.attribute(model, tokens)
        >>> result.to_html(f"{tempfile.mkdtemp()}/attribution.html", model=model).name
        'attribution.html'
        """
        return self._view(model, str_tokens, routes, top_edges).save(path)

    def _only(self, what: str, also: tuple[str, ...] = ()) -> None:
        if self.method != "connection" and self.method not in also:
            if self.method == "knockout_estimate":
                raise ConnWalkError(
                    f"{what} splits what each source sent through the frozen network "
                    "(method='connection', spec §6); method='knockout_estimate' predicts what "
                    "blocking would change and has edges(layer) and remainder instead."
                )
            allowed = " or ".join(repr(m) for m in ("connection", *also))
            raise ConnWalkError(
                f"{what} is defined for method={allowed} (spec §6, §7); this attribution was "
                f"made with method={self.method!r}."
            )

    def by_component(self) -> Float[Tensor, "batch component source"]:
        """``[batch, component, source]``: the direct path of each component, by source.

        Components, in order (`component_names`): ``embed`` (the embeddings' own direct
        path), then per layer ``L{l}H{h}`` for each head and ``L{l}MLP``. Entry ``[b, k, s]``
        is ``g . o_k,s``: the part of component ``k``'s output at the target position that
        source ``s`` sent (through the frozen network ``F``), read along ``g``, the frozen
        gradient of the target at the final residual. Summed over components it is
        ``scores``.

        Cost: ``F`` is affine, so ``o_k,s = o_k(only e_s) - o_k(no embeddings)``: ``pos + 1``
        forward passes of ``F`` per sequence, the inputs stacked on the batch in chunks of
        bounded memory, however many components there are. Computed once and kept.

        >>> result = tl_connwalk.attribute(model, tokens)
        >>> parts = result.by_component()
        >>> torch.testing.assert_close(parts.sum(1), result.scores)
        """
        return self._component_parts()[1].clone()

    def component_names(self) -> list[str]:
        """The names of `by_component`'s components, e.g. ``["embed", "L0H0", ...]``."""
        return list(self._component_parts()[0])

    def _component_parts(self) -> tuple[list[str], Tensor]:
        self._only("by_component")
        assert self._components is not None
        return self._components()

    def edges(self, layer: int) -> Float[Tensor, "batch head query key"]:
        """``[batch, head, query, key]``: what each edge of ``layer`` carries (connection), or
        what blocking it would change (knockout_estimate).

        ``method="connection"``: the share of the target each edge carries, ``e^{l,h}_ij = g_i .
        A^h_ij (v^h_j W_O^h)`` (spec §6) with ``g_i`` the frozen network's gradient of the
        target at layer ``l``'s attention output and ``v^h_j`` the value vector with its bias
        (grouped-query heads expanded). Summed over heads, queries and keys it is the target
        minus what ``F`` gives with that layer's heads silenced.

        ``method="knockout_estimate"``: the predicted effect on the target of blocking key
        ``j`` for query ``i`` in head ``h`` alone, ``y - y_blocked ~ - A^h_ij (m_ij - g_i .
        v^h_j)`` (spec §7), with ``g_i`` the real network's gradient at ``hook_z`` and
        ``m_ij`` the mean of ``g_i . v^h`` over the row's other keys, renormalised. Summed over
        layers, heads and queries it is ``scores - remainder``. A query's own key is never
        blocked (0).

        >>> result = tl_connwalk.attribute(model, tokens)
        >>> result.edges(0).shape
        torch.Size([2, 4, 8, 8])
        """
        self._only("edges", also=("knockout_estimate",))
        assert self._edges is not None
        n_layers = self._edges.shape[0]
        return self._edges[
            checked_index(layer, n_layers, "layer", "this model", "attention layers")
        ]

    def _route_table(self, max_length: int) -> RouteTable:
        self._only("routes")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0:
            raise ConnWalkError(f"max_length must be an int >= 0, got {max_length!r}.")
        assert self._routes is not None
        return self._routes(max_length)

    def routes(self, k: int | None = 10, *, batch: int = 0, max_length: int = 2) -> list[Route]:
        """The ``k`` routes of sequence ``batch`` with the largest ``|contribution|`` (spec §6).

        A route is source ``s`` -> components ``c_1 < ... < c_m`` (heads ``"L{l}H{h}"`` and
        MLPs ``"L{l}MLP"`` in forward order; ``()`` the embedding's direct path) -> target.
        The frozen network is affine: its final residual is ``prod_c (I + M_c)`` (each
        component's linear part ``M_c``, biases aside) applied to the embeddings, so
        ``c_s = sum_routes u . M_{c_m} ... M_{c_1} x_s`` exactly, with ``x_s`` position
        ``s``'s embeddings as the first residual holds them and ``u`` the target's gradient at
        the final residual. A route may pass several components, but not two heads of one layer
        (nor, in a parallel block, its heads and its MLP). Every route of at most
        ``max_length`` components is enumerated; what the longer ones carry is
        `route_remainder`: per source, the routes plus the remainder are ``scores``.

        Cost: for ``K`` components (``n_layers * (n_heads + 1)``), ``n`` positions and ``max_length
        = 2``, one forward and backward pass of the frozen network, ``2 K`` batched backward steps
        through single components and about ``K^2 / 2`` pattern products of ``n^2 d_head`` each
        (with a progress bar when long); memory ``K n d_model`` floats per sequence. Each further
        unit of ``max_length`` multiplies the routes by about ``K / length``. Computed once per
        ``max_length`` and kept.

        Args:
            k: how many routes; ``None`` for every route.
            batch: the sequence.
            max_length: the longest routes enumerated (components passed).

        >>> result = tl_connwalk.attribute(model, tokens)
        >>> [str(route) for route in result.routes(2)]  # doctest: +SKIP
        ['pos 7 -> target: +1.62', 'pos 3 -> L0H1 -> L1H0 -> target: -0.41']
        """
        table = self._route_table(max_length)
        n_batch = table.values.shape[0]
        if isinstance(batch, bool) or not isinstance(batch, int) or not -n_batch <= batch < n_batch:
            raise ConnWalkError(
                f"batch must be an int in {-n_batch}..{n_batch - 1}, got {batch!r}."
            )
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ConnWalkError(f"k must be an int >= 0 or None, got {k!r}.")
        values = table.values[batch]  # [route, source]
        if self.attention_mask is not None:  # padding is no source
            values = values[:, self.attention_mask[batch].to(values.device) != 0]
        sources = torch.arange(self.scores.shape[1])
        if self.attention_mask is not None:
            sources = sources[self.attention_mask[batch].cpu() != 0]
        flat = values.flatten()
        order = flat.abs().argsort(descending=True, stable=True)[:k]
        n_pos = values.shape[1]
        return [
            Route(
                batch % n_batch,
                int(sources[index % n_pos]),
                table.routes[index // n_pos],
                float(flat[index]),
            )
            for index in order.tolist()
        ]

    def route_remainder(self, max_length: int = 2) -> Float[Tensor, "batch source"]:
        """``[batch, source]``: what the routes longer than ``max_length`` carry.

        ``scores[b, s]`` is the sum of every route of source ``s`` up to ``max_length``
        components (`routes` with ``k=None``) plus ``route_remainder(max_length)[b, s]``. It is
        computed on its own: each longest enumerated route's covector pulled back through the
        whole network below it (not as ``scores`` minus the routes), and is 0 once
        ``max_length`` reaches the longest route (``2 n_layers``; ``n_layers`` without MLPs).
        """
        return self._route_table(max_length).remainder

    def verify(self, k: int = 5) -> Any:
        """Knockout measured for real on each target's ``k`` largest predicted sources, beside
        the prediction (``method="knockout_estimate"``), as a pandas DataFrame.

        For each sequence ``b``, the ``k`` sources with the largest ``|scores[b, s]|`` among
        those knockout can change (real tokens other than the target's position; in a causal
        model, before it) are knocked out (`tl_connwalk.attribution.baselines.knockout`: key
        ``s`` blocked for every other query, in every layer). One row per (sequence, source):
        ``batch``, ``source``, ``token``, ``predicted`` (``scores``), ``knockout`` (measured),
        ``error`` (``predicted - knockout``) and ``exact`` (whether the score was already
        knockout's own value, `exact`). The attribution's view shows the measured values beside
        the predictions once verified.

        Cost: one forward pass per distinct sequence and source knocked out (``k`` per
        sequence, fewer where targets on one sequence share sources).

        >>> result = tl_connwalk.attribute(model, tokens, method="knockout_estimate")
        >>> result.verify(2).columns.tolist()
        ['batch', 'source', 'token', 'predicted', 'knockout', 'error', 'exact']
        """
        import pandas as pd

        if self._knock_out is None:
            raise ConnWalkError(
                "verify measures knockout beside a prediction of it (method='knockout_estimate'); "
                f"this attribution was made with method={self.method!r}."
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConnWalkError(f"k must be an int >= 0 (sources per target), got {k!r}.")
        chosen, measured = self._knock_out(k)
        self._verified.update(sources=chosen, knockout=measured)
        exact = self.exact if self.exact is not None else torch.zeros_like(chosen)
        rows = []
        for b, source in chosen.nonzero().tolist():
            predicted = float(self.scores[b, source])
            actual = float(measured[b, source])
            token, was_exact = int(self.tokens[b, source]), bool(exact[b, source])
            rows.append((b, source, token, predicted, actual, predicted - actual, was_exact))
        frame = pd.DataFrame(
            rows, columns=["batch", "source", "token", "predicted", "knockout", "error", "exact"]
        )
        order = frame["predicted"].abs().sort_values(ascending=False, kind="stable").index
        return frame.loc[order].sort_values("batch", kind="stable").reset_index(drop=True)

    def to_dataframe(self, model: Any = None) -> Any:
        """A pandas DataFrame, one row per (sequence, source): ``batch``, ``source``,
        ``token``, ``score``, ``target``, ``target_value``, ``bias``, ``method``; padding
        left out. ``method="knockout_estimate"`` adds ``remainder`` and ``exact``.

        ``model``: a model with a tokenizer (``model.tokenizer``) adds ``str_token``, each
        source decoded, and decodes the tokens in the ``target`` labels (``logit[id 'token']``).

        >>> tl_connwalk.attribute(model, tokens).to_dataframe().shape
        (16, 8)
        """
        import pandas as pd

        from tl_connwalk.views.labels import decoded_target

        tokenizer = getattr(model, "tokenizer", None)
        if model is not None and tokenizer is None:
            raise ConnWalkError(
                f"model ({type(model).__name__}) has no tokenizer to decode the tokens with; "
                "call to_dataframe() without it for token ids."
            )
        labels = list(self.targets)
        if tokenizer is not None:
            labels = [decoded_target(label, tokenizer) for label in labels]
        batch, n_pos = self.scores.shape
        rows = torch.arange(batch).repeat_interleave(n_pos)
        columns: dict[str, Any] = {
            "batch": rows.numpy(),
            "source": torch.arange(n_pos).repeat(batch).numpy(),
            "token": self.tokens.reshape(-1).cpu().numpy(),
        }
        if tokenizer is not None:
            columns["str_token"] = [tokenizer.decode([int(t)]) for t in columns["token"]]
        columns |= {
            "score": self.scores.detach().reshape(-1).cpu().double().numpy(),
            "target": [labels[b] for b in rows.tolist()],
            "target_value": self.target_value.detach().cpu().double()[rows].numpy(),
            "bias": self.bias.detach().cpu().double()[rows].numpy(),
            "method": self.method,
        }
        if self.remainder is not None and self.exact is not None:
            columns["remainder"] = self.remainder.detach().reshape(-1).cpu().double().numpy()
            columns["exact"] = self.exact.reshape(-1).cpu().numpy()
        frame = pd.DataFrame(columns)
        if self.attention_mask is None:
            return frame
        return frame[self.attention_mask.reshape(-1).cpu().numpy() != 0].reset_index(drop=True)
