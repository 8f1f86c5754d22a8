"""``ConnectionWalk``: the object a user holds for one attention layer (spec §1).

A frozen bundle of the walk ``W``, the gates ``g``, the field ``X`` the layer read, and the
head weights; every method delegates to the math core in `tl_connwalk.core`. Build one
from a TransformerLens cache with ``cache.connection_walk(layer)`` (after
``tl_connwalk.attach``) or `tl_connwalk.connection_walk`, or from raw tensors with
`ConnectionWalk.from_pattern`.
"""

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens import FactoredMatrix

from tl_connwalk.core import edge_norms, padding, value_heads
from tl_connwalk.core import walk as core
from tl_connwalk.core.checks import check_field_shape, check_tensors
from tl_connwalk.core.generator import ConnectionGenerator
from tl_connwalk.core.value_heads import KVHeads
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.walk import residual

if TYPE_CHECKING:
    from tl_connwalk.views.page import View


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 or wider: half precision is upcast, float64 stays."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass(frozen=True, repr=False)
class ConnectionWalk:
    """One attention layer as a connection walk ``(W, T)`` acting on the field ``X``.

    ``apply() + bias()`` is the layer's attention output exactly (spec §1.2):
    ``y_i = sum_j W_ij x_j T_ij + c_i`` with ``T_ij = H sum_h g^h_ij W_V^h W_O^h``.

    Attributes:
        walk: ``W`` ``[batch, query, key]``, ``W_ij = (1/H) sum_h A^h_ij``.
        gates: ``g`` ``[batch, head, query, key]``, ``g^h_ij = A^h_ij / sum_h' A^h'_ij``.
        field: ``X`` ``[batch, key, d_model]``, exactly what the value projection read.
        W_V: ``[head, d_model, d_head]`` value weights (grouped-query heads expanded).
        W_O: ``[head, d_head, d_model]`` output weights.
        b_V: ``[head, d_head]`` value biases (zero where the model has none).
        b_O: ``[d_model]`` output bias.
        layer: the layer index, when the walk came from a model.
        processing: which TransformerLens weight processing the model had (spec §2).
        kv_heads: grouped-query attention: the value head each query head reads
            (`tl_connwalk.core.value_heads`); ``None``: every head has its own. It sets the
            rank of the effective transports (``min(d_model, H_kv d_head)``, spec §3) and
            the sharing of the random baselines' value heads.
        attention_mask: ``[batch, pos]`` bool, True on each sequence's real tokens, False on
            padding; ``None`` when nothing is padding. Every measurement reads only the real
            positions, so each sequence of a padded batch measures as if it had run alone
            (`with_padding`; ``cache.connection_walk`` sets it). ``apply`` and ``bias`` still
            give every row, padding queries included (the layer's output exactly).

    Examples:
        >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
        >>> walk = ConnectionWalk.from_pattern(A, torch.randn(1, 3, 8), torch.randn(2, 8, 4),
        ...                                    torch.randn(2, 4, 8))
        >>> walk.apply().shape
        torch.Size([1, 3, 8])
    """

    walk: Float[Tensor, "batch query key"]
    gates: Float[Tensor, "batch head query key"]
    field: Float[Tensor, "batch key d_model"]
    W_V: Float[Tensor, "head d_model d_head"]
    W_O: Float[Tensor, "head d_head d_model"]
    b_V: Float[Tensor, "head d_head"]
    b_O: Float[Tensor, " d_model"]
    layer: int | None = None
    processing: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    kv_heads: KVHeads | None = None
    attention_mask: Bool[Tensor, "batch pos"] | None = None
    #: what the measurements of this walk share between calls (`residual.Memo`); a new walk
    #: (``dataclasses.replace``, `of_heads`, `with_padding`) starts with an empty one
    _memo: residual.Memo = dataclasses.field(
        default_factory=residual.Memo, init=False, repr=False, compare=False
    )

    @classmethod
    def from_pattern(
        cls,
        pattern: Tensor,
        field: Tensor,
        W_V: Tensor,
        W_O: Tensor,
        b_V: Tensor | None = None,
        b_O: Tensor | None = None,
        *,
        layer: int | None = None,
        processing: Mapping[str, bool] | None = None,
        kv_heads: Sequence[int] | None = None,
        attention_mask: Tensor | None = None,
    ) -> "ConnectionWalk":
        """Split per-head patterns into walk and gates (spec §1.2); computes in float32 or wider.

        Shapes: ``pattern [batch, head, query, key]``, ``field [batch, key, d_model]``,
        ``W_V [head, d_model, d_head]``, ``W_O [head, d_head, d_model]``, ``b_V [head, d_head]``,
        ``b_O [d_model]``; checked here with a ConnWalkError naming them (annotated as plain
        tensors so that runtime type checkers do not pre-empt that message). Missing biases
        are zero. Everything moves to ``field``'s device. ``attention_mask`` ``[batch, pos]``
        (nonzero: real token) marks padding, checked against the pattern (`with_padding`).

        Grouped-query attention: ``W_V`` (and ``b_V``) may hold the ``H_kv`` value heads
        ``[kv_head, d_model, d_head]``; query head ``h`` then reads value head ``kv_heads[h]``
        (default ``h // (H / H_kv)``, as TransformerLens and Hugging Face group heads), and
        they are expanded here. Weights already expanded to the query heads (e.g. a
        HookedTransformer's ``attn.W_V``) take ``kv_heads`` to say which heads share, and
        those heads' value weights and biases must be equal.

        >>> A = torch.softmax(torch.randn(1, 4, 3, 3), -1)
        >>> ConnectionWalk.from_pattern(A, torch.randn(1, 3, 8), torch.randn(2, 8, 2),
        ...                             torch.randn(4, 2, 8)).kv_heads
        (0, 0, 1, 1)
        """
        check_tensors(pattern=pattern, field=field, W_V=W_V, W_O=W_O)
        check_tensors(**{name: t for name, t in (("b_V", b_V), ("b_O", b_O)) if t is not None})
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise ConnWalkError(
                f"layer must be None or an int (the layer the walk came from), got {layer!r}."
            )
        if processing is not None and not isinstance(processing, Mapping):
            raise ConnWalkError(
                "processing must be None or a mapping of TransformerLens weight processing "
                f"options to bools (e.g. {{'fold_ln': True}}), got {type(processing).__name__}."
            )
        n_heads, d_head, d_model = W_O.shape if W_O.ndim == 3 else (0, 0, 0)
        W_V, b_V, kv = _expanded_values(W_V, b_V, n_heads, kv_heads)
        _check_shapes(pattern, field, W_V, W_O)
        for name, bias, shape in (("b_V", b_V, (n_heads, d_head)), ("b_O", b_O, (d_model,))):
            if bias is not None and tuple(bias.shape) != shape:
                raise ConnWalkError(
                    f"{name} {tuple(bias.shape)} must be {shape} "
                    f"({'[head, d_head]' if name == 'b_V' else '[d_model]'}), or None for zero."
                )
        dtype = _float_dtype(field.dtype)
        device = field.device

        def cast(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype)

        b_V = torch.zeros(n_heads, d_head) if b_V is None else b_V
        b_O = torch.zeros(d_model) if b_O is None else b_O
        walk, gates = core.walk_and_gates(cast(pattern))
        positions = None if attention_mask is None else padding.checked_mask(walk, attention_mask)
        return cls(
            walk=walk,
            gates=gates,
            field=cast(field),
            W_V=cast(W_V),
            W_O=cast(W_O),
            b_V=cast(b_V),
            b_O=cast(b_O),
            layer=layer,
            processing=dict(processing or {}),
            kv_heads=kv,
            attention_mask=positions,
        )

    def with_padding(self, attention_mask: Tensor | None = None) -> "ConnectionWalk":
        """This walk with the padding of its batch marked (`attention_mask`).

        ``attention_mask`` ``[batch, pos]`` (1 or True: real token, 0: padding) is the mask the
        model ran with (``run_with_cache(tokens, attention_mask=...)``); it is checked: no
        real query may attend to a position it calls padding. Without it, padding is read off
        the walk (`tl_connwalk.core.padding.detect_padding`): trailing keys that no query
        attends to (right padding) and leading keys that no later query attends to (left
        padding); any other key that no query attends to raises a ConnWalkError asking for
        the mask. A key no query attends to at the end of a sequence is taken for padding:
        pass an all-ones mask to say that every position is a real token.

        >>> walk.with_padding(torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]] * 2)).attention_mask.sum(-1)
        tensor([6, 6])
        """
        return ConnectionWalk.with_paddings([self], attention_mask)[0]

    @staticmethod
    def with_paddings(
        walks: Sequence["ConnectionWalk"], attention_mask: Tensor | None = None
    ) -> list["ConnectionWalk"]:
        """`with_padding` of each of several walks of one batch (the layers of one cache),
        their padding read in one pass (`tl_connwalk.core.padding.positions_of_walks`).

        >>> [w.attention_mask for w in ConnectionWalk.with_paddings([walk, walk])]
        [None, None]
        """
        residual.check_walks(walks)
        found = padding.positions_of_walks([walk.walk for walk in walks], attention_mask)
        return [
            walk
            if positions is None and walk.attention_mask is None
            else dataclasses.replace(walk, attention_mask=positions)
            for walk, positions in zip(walks, found, strict=True)
        ]

    def of_heads(self, heads: Sequence[int]) -> "ConnectionWalk":
        """The connection walk of the heads ``heads`` alone (spec §1.2 on that subset ``S``).

        ``W'_ij = (1/|S|) sum_{h in S} A^h_ij``, gates renormalised among ``S``
        (``g'^h_ij = A^h_ij / sum_{h' in S} A^h'_ij``) and transports
        ``T'_ij = |S| sum_{h in S} g'^h_ij T^h``; ``W_V``, ``W_O``, ``b_V`` of those heads,
        the layer's ``b_O``, the same field and padding. Heads are sorted; every head (in any
        order) gives this walk itself. ``O(batch |S| n^2)``.

        >>> walk.of_heads([0, 2]).gates.shape  # [batch, head, query, key]
        torch.Size([2, 2, 8, 8])
        """
        chosen = core.check_heads(heads, self.n_heads)
        if chosen == tuple(range(self.n_heads)):
            return self
        index = torch.tensor(chosen, device=self.gates.device)
        pattern = self.patterns[:, index]
        walk, gates = core.walk_and_gates(pattern)
        return dataclasses.replace(
            self,
            walk=walk,
            gates=gates,
            W_V=self.W_V[index.to(self.W_V.device)],
            W_O=self.W_O[index.to(self.W_O.device)],
            b_V=self.b_V[index.to(self.b_V.device)],
            kv_heads=_subset_value_heads(self.kv_heads, chosen),
        )

    def edges(self) -> Bool[Tensor, "batch query key"]:
        """Where the walk has an edge: ``W_ij > 0`` between real positions.

        >>> walk.edges().shape  # [batch, query, key]
        torch.Size([2, 8, 8])
        """
        present = self.walk > 0
        if self.attention_mask is None:
            return present
        return present & padding.real_edges(self.attention_mask)

    @property
    def n_heads(self) -> int:
        """``H``, the number of (query) heads."""
        return self.gates.shape[1]

    @property
    def n_value_heads(self) -> int:
        """``H_kv``, the number of distinct value heads the query heads read (``H`` without
        grouped-query attention)."""
        return value_heads.distinct_value_heads(self.kv_heads, self.n_heads)

    @functools.cached_property
    def patterns(self) -> Float[Tensor, "batch head query key"]:
        """The per-head patterns ``A^h_ij = H W_ij g^h_ij`` the walk and gates recombine into.

        Computed once per walk (``dataclasses.replace`` makes a new walk with a fresh one).
        """
        return core.patterns_from_walk(self.walk, self.gates)

    @property
    def head_transports(self) -> FactoredMatrix:
        """``T^h = W_V^h W_O^h`` as a ``FactoredMatrix`` ``[head, d_model, d_model]``."""
        return core.head_transports(self.W_V, self.W_O)

    @overload
    def effective_transport(
        self, query: None = None, key: None = None
    ) -> core.EffectiveTransport: ...

    @overload
    def effective_transport(self, query: int, key: int) -> FactoredMatrix: ...

    def effective_transport(
        self, query: int | None = None, key: int | None = None
    ) -> FactoredMatrix | core.EffectiveTransport:
        """``T_ij = H sum_h g^h_ij T^h`` for the edge ``key -> query``, every batch element.

        With an edge, a ``FactoredMatrix`` ``[batch, d_model, d_model]`` of inner width
        ``H d_head`` (``.AB`` is the dense map). Without, every edge lazily as an
        `EffectiveTransport` (index it ``[query, key]``).

        A transport exists only on an edge (`edges`: ``W_ij > 0`` between real positions),
        the rule every measurement follows: a pair that is no edge in any batch element (the
        future of a causal walk, padding) raises a ConnWalkError; batch elements where it is
        no edge get the zero map.

        >>> walk.effective_transport(3, 1).AB.shape  # [batch, d_model, d_model]
        torch.Size([2, 32, 32])
        """
        lazy = core.EffectiveTransport(self.gates, self.W_V, self.W_O, edges=self.edges())
        if query is None and key is None:
            return lazy
        if query is None or key is None:
            raise ConnWalkError(
                "effective_transport takes both query and key (one edge) or neither (all edges); "
                f"got query={query}, key={key}."
            )
        return lazy[query, key]

    def apply(
        self, field: Float[Tensor, "batch key d_model"] | None = None
    ) -> Float[Tensor, "batch query d_model"]:
        """``(P X)_i = sum_j W_ij x_j T_ij``; ``field`` defaults to the field the layer read
        (another field has its shape, ``[batch, key, d_model]``)."""
        if field is not None:
            check_field_shape(field, tuple(self.field.shape))
        field = self.field if field is None else field.to(self.field)
        return core.propagate(self.patterns, field, self.W_V, self.W_O)

    def bias(self) -> Float[Tensor, "batch query d_model"]:
        """``c_i = sum_h (sum_j A^h_ij) b_V^h W_O^h + b_O``, so that output ``= P X + c``."""
        return core.attention_bias(self.patterns, self.b_V, self.W_O, self.b_O)

    def edge_contributions(self) -> edge_norms.EdgeContributions:
        """The norm of what each edge carries (Kobayashi et al. 2020), per edge and per head.

        ``.edge`` ``[batch, query, key]``: ``||W_ij x_j T_ij||``, the walk's message (the
        transported field, no bias); ``.head`` ``[batch, head, query, key]``:
        ``||A^h_ij f^h(x_j)||`` with ``f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h``, value biases
        included and grouped-query value heads shared. Exactly the model's own value vectors
        (``hook_v``) and output weights, whatever weight processing it had. 0 off the walk's
        edges (`edges`: ``W_ij = 0``, padding). See `tl_connwalk.core.edge_norms`.

        >>> walk.edge_contributions().head.shape  # [batch, head, query, key]
        torch.Size([2, 4, 8, 8])
        """
        return edge_norms.edge_contributions(
            self.patterns, self.field, self.W_V, self.b_V, self.W_O, self.edges()
        )

    def generator(self) -> ConnectionGenerator:
        """``L = I - P`` as an operator: ``.matvec(field)``, ``.to_dense()`` on request."""
        return ConnectionGenerator(self.patterns, self.W_V, self.W_O)

    def laplacian_residual(self, **options: Any) -> residual.LaplacianResidual:
        """How far ``L = I - P`` is from a random-walk connection Laplacian (spec §2-4).

        Options as `tl_connwalk.walk.residual.laplacian_residual` (``mu``, ``alpha``,
        ``exclude_sink``, ``edges``, ``heads``, ``baseline_draws``, ``baseline_edges``,
        ``seed``, ``exact``, ``max_edges``, ``mass_share``, ``query_chunk``).

        >>> walk.laplacian_residual(exclude_sink=True).transport_defect.shape  # [batch]
        torch.Size([2])
        """
        residual.check_options(options)
        return residual.laplacian_residual(self, memo=self._memo, **options)

    @staticmethod
    def laplacian_residuals(
        walks: Sequence["ConnectionWalk"], **options: Any
    ) -> list[residual.LaplacianResidual]:
        """`laplacian_residual` of several walks with the same options, their per-edge work
        stacked (`tl_connwalk.walk.residual.laplacian_residuals`); each walk keeps what
        another call on it can reuse, as with its own `laplacian_residual`.

        >>> [r.layer for r in ConnectionWalk.laplacian_residuals([walk, walk])]
        [0, 0]
        """
        residual.check_options(options)
        residual.check_walks(walks)
        return residual.laplacian_residuals(walks, memos=[walk._memo for walk in walks], **options)

    def isometry_defects(
        self,
        kind: residual.DefectKind = "gram",
        *,
        edges: padding.EdgeMask | None = None,
        heads: Sequence[int] | None = None,
    ) -> Float[Tensor, "batch query key"]:
        """Per-edge defect of ``T_ij``: ``"gram"`` (eps, closed form) or ``"frobenius"`` (delta).

        0 where ``W_ij = 0``, on padding and off ``edges``. See
        `tl_connwalk.walk.residual.isometry_defects`.
        """
        return residual.isometry_defects(self, kind, edges=edges, heads=heads, memo=self._memo)

    def show(
        self,
        *,
        str_tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
        edge_contributions: Tensor | None = None,
        head_contributions: Tensor | None = None,
    ) -> None:
        """Display this walk in a Jupyter notebook, as `to_html` draws it."""
        self._view(str_tokens, edge_contributions, head_contributions).show()

    def _view(
        self,
        str_tokens: Sequence[str] | Sequence[Sequence[str]] | None,
        edge: Tensor | None,
        head: Tensor | None,
    ) -> "View":
        """The page `show` displays and `to_html` writes: with the contributions given, or
        with the norms of `edge_contributions` (named so on the page)."""
        from tl_connwalk.views import walk_view

        norms = edge is None and head is None
        if norms:
            contributions = self.edge_contributions()
            edge, head = contributions.edge, contributions.head
        return walk_view(
            self, str_tokens=str_tokens, edge_contributions=edge, head_contributions=head,
            norms=norms,
        )  # fmt: skip

    def to_html(
        self,
        path: str | Path,
        *,
        str_tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
        edge_contributions: Tensor | None = None,
        head_contributions: Tensor | None = None,
    ) -> Path:
        """Write this walk to ``path`` as one self-contained HTML page; returns the path.

        The page (`tl_connwalk.views`) shows the walk ``W`` as a heatmap, the gates and per-head
        patterns of the edge under the pointer, the incoming edges of a query as arcs, every head's
        gates, and a number per edge (``edge_contributions`` ``[batch, query, key]``) and per head
        and edge (``head_contributions`` ``[batch, head, query, key]``): by default the norms of
        `edge_contributions`, named as norms on the page. Colours follow a log scale (a switch on
        the page makes it linear), stated by each colour bar. ``str_tokens`` label the positions
        (e.g. ``model.to_str_tokens(tokens)``). It loads nothing from anywhere: open it in any
        browser, offline.

        >>> import tempfile
        >>> walk.to_html(f"{tempfile.mkdtemp()}/walk.html").name
        'walk.html'
        """
        return self._view(str_tokens, edge_contributions, head_contributions).save(path)

    def __repr__(self) -> str:
        batch, n_heads, n_pos, _ = self.gates.shape
        d_model, d_head = self.W_V.shape[1:]
        layer = "" if self.layer is None else f"layer={self.layer}, "
        heads = (
            f"{n_heads}"
            if self.kv_heads is None
            else f"{n_heads}, value_heads={self.n_value_heads}"
        )
        processing = ", ".join(f"{k}={v}" for k, v in self.processing.items()) or "unknown"
        pads = "" if self.attention_mask is None else ", padded"
        return (
            f"ConnectionWalk({layer}batch={batch}, pos={n_pos}{pads}, heads={heads}, "
            f"d_model={d_model}, d_head={d_head}, dtype={self.walk.dtype}, "
            f"device={self.walk.device}, processing: {processing})"
        )


def _expanded_values(
    W_V: Tensor, b_V: Tensor | None, n_heads: int, kv_heads: Sequence[int] | None
) -> tuple[Tensor, Tensor | None, KVHeads | None]:
    """``W_V``, ``b_V`` with one block per query head, and the value head each reads.

    Value heads fewer than query heads are expanded (`ConnectionWalk.from_pattern`); weights
    with one block per query head and a ``kv_heads`` are checked to share as it says.
    """
    if W_V.ndim != 3 or n_heads == 0:
        return W_V, b_V, None  # the shape check names what is wrong
    n_value = W_V.shape[0]
    if kv_heads is None and n_value != n_heads:
        if n_value > n_heads or n_heads % n_value:
            return W_V, b_V, None  # no grouping: the shape check names the shapes
        kv_heads = value_heads.grouped_value_heads(n_heads, n_value)
    kv = value_heads.check_kv_heads(kv_heads, n_heads)
    if kv is None:
        return W_V, b_V, None
    if n_value == n_heads:  # expanded already: the shared heads must be equal
        first = {head: kv.index(head) for head in set(kv)}
        source = torch.tensor([first[head] for head in kv], device=W_V.device)
        same = torch.equal(W_V, W_V[source]) and (
            b_V is None or b_V.ndim != 2 or torch.equal(b_V, b_V[source.to(b_V.device)])
        )
        if not same:
            raise ConnWalkError(
                f"kv_heads={kv} says query heads share value heads, but their W_V (or b_V) "
                "differ; pass the model's own map (e.g. grouped_value_heads(n_heads, "
                "n_key_value_heads)) or the unexpanded [kv_head, d_model, d_head] weights."
            )
        return W_V, b_V, kv
    if value_heads.n_value_heads(kv, n_heads) != n_value:
        raise ConnWalkError(
            f"kv_heads={kv} reads {value_heads.n_value_heads(kv, n_heads)} value heads but W_V "
            f"{tuple(W_V.shape)} holds {n_value}."
        )
    if b_V is not None and b_V.ndim == 2 and b_V.shape[0] == n_value:
        b_V = value_heads.expand_value_heads(b_V, kv)
    return value_heads.expand_value_heads(W_V, kv), b_V, kv


def _check_shapes(pattern: Tensor, field: Tensor, W_V: Tensor, W_O: Tensor) -> None:
    """Raise a ConnWalkError naming the shapes when the operands do not fit together."""
    shapes = (
        f"pattern {tuple(pattern.shape)} [batch, head, query, key], field {tuple(field.shape)} "
        f"[batch, key, d_model], W_V {tuple(W_V.shape)} [head, d_model, d_head], "
        f"W_O {tuple(W_O.shape)} [head, d_head, d_model]"
    )
    if pattern.ndim != 4 or field.ndim != 3 or W_V.ndim != 3 or W_O.ndim != 3:
        raise ConnWalkError(f"operands have the wrong number of axes: {shapes}.")
    batch, n_heads, n_query, n_key = pattern.shape
    consistent = (
        field.shape[:2] == (batch, n_key)
        and n_query == n_key
        and W_V.shape[0] == n_heads == W_O.shape[0]
        and W_V.shape[1] == field.shape[2] == W_O.shape[2]
        and W_V.shape[2] == W_O.shape[1]
    )
    if not consistent:
        raise ConnWalkError(f"operand shapes do not fit together: {shapes}.")
    if n_key == 0:
        raise ConnWalkError("the walk has no positions (empty sequence); run at least one token.")


def _subset_value_heads(kv_heads: KVHeads | None, heads: Sequence[int]) -> KVHeads | None:
    """The value heads of the query heads ``heads``, renumbered ``0, 1, ...`` in order.

    >>> _subset_value_heads((0, 0, 1, 1, 2, 2), [1, 4, 5])
    (0, 1, 1)
    """
    if kv_heads is None:
        return None
    chosen = [kv_heads[h] for h in heads]
    number = {v: i for i, v in enumerate(sorted(set(chosen)))}
    return tuple(number[v] for v in chosen)
