"""Connection walks from attention: walk, gates, transports and their action (spec §1).

Pure functions on tensors; nothing here knows a model class. Row vectors throughout, as in
TransformerLens: a message from key ``j`` to query ``i`` is ``x_j @ T_ij``.

Multi-head attention ``sum_h A^h X T^h + c`` with ``T^h = W_V^h W_O^h`` is exactly one connection
walk ``(W, T)``::

    W_ij   = (1/H) sum_h A^h_ij
    g^h_ij = A^h_ij / sum_h' A^h'_ij          (uniform 1/H where that sum is 0)
    T_ij   = H sum_h g^h_ij T^h
    c_i    = sum_h (sum_j A^h_ij) b_V^h W_O^h + b_O

and ``W_ij T_ij = sum_h A^h_ij T^h`` edge by edge, which is how `propagate` evaluates
``P X`` without ever forming a ``d_model x d_model`` map per edge.
"""

from collections.abc import Iterable, Sequence

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens import FactoredMatrix

from tl_connwalk.core.checks import check_heads as check_weights
from tl_connwalk.core.checks import check_tensors, checked_index
from tl_connwalk.errors import ConnWalkError


def check_heads(heads: Sequence[int], n_heads: int) -> tuple[int, ...]:
    """``heads`` as sorted distinct indices in ``0..n_heads-1``, negative counting from the
    end (`tl_connwalk.core.checks.checked_index`); a ConnWalkError otherwise.

    >>> check_heads([3, -4], 4)
    (0, 3)
    """
    given = (
        list(heads)
        if isinstance(heads, Iterable) and not isinstance(heads, (str, bytes, Tensor))
        else []
    )
    if not given:
        raise ConnWalkError(
            f"heads must be a non-empty sequence of head indices (e.g. [0, 2]), got {heads!r}."
        )
    chosen = [checked_index(h, n_heads, "head", "this layer", "heads") for h in given]
    twice = sorted({h for h in chosen if chosen.count(h) > 1})
    if twice:
        raise ConnWalkError(
            f"heads {given} name head {twice[0]} twice: pass distinct indices of the "
            f"layer's {n_heads} heads."
        )
    return tuple(sorted(chosen))


def check_operator(name: str, pattern: Tensor, W_V: Tensor, W_O: Tensor) -> None:
    """A ConnWalkError unless per-head ``pattern`` (or gates) ``[batch, head, query, key]``,
    ``W_V`` ``[head, d_model, d_head]`` and ``W_O`` ``[head, d_head, d_model]`` are tensors
    that fit together (the operands of `propagate` and `EffectiveTransport`)."""
    check_tensors(**{name: pattern}, W_V=W_V, W_O=W_O)
    check_weights(W_V, W_O)
    if (
        pattern.ndim != 4
        or pattern.shape[1] != W_V.shape[0]
        or pattern.shape[2] != pattern.shape[3]
    ):
        raise ConnWalkError(
            f"{name} must be [batch, head, query, key] with head = {W_V.shape[0]} (W_V's) and "
            f"query = key; got {tuple(pattern.shape)}."
        )


def walk_matrix(pattern: Float[Tensor, "batch head query key"]) -> Float[Tensor, "batch query key"]:
    """The walk ``W_ij = (1/H) sum_h A^h_ij`` (spec §1.2); row-stochastic when every head is.

    >>> A = torch.softmax(torch.randn(2, 4, 5, 5), -1)
    >>> walk_matrix(A).sum(-1)
    tensor([[1., 1., 1., 1., 1.], [1., 1., 1., 1., 1.]])
    """
    return reduce(pattern, "batch head query key -> batch query key", "mean")


def gates(pattern: Float[Tensor, "batch head query key"]) -> Float[Tensor, "batch head query key"]:
    """The gates ``g^h_ij = A^h_ij / sum_h' A^h'_ij`` (spec §1.2), uniform ``1/H`` on non-edges.

    ``g >= 0`` and ``sum_h g^h_ij = 1`` on every pair ``(i, j)``, edge or not, so that
    `patterns_from_walk` inverts the split exactly.

    >>> g = gates(torch.softmax(torch.randn(1, 3, 4, 4), -1))
    >>> torch.allclose(g.sum(1), torch.ones(1, 4, 4))
    True
    """
    return walk_and_gates(pattern)[1]


def walk_and_gates(
    pattern: Float[Tensor, "batch head query key"],
) -> tuple[Float[Tensor, "batch query key"], Float[Tensor, "batch head query key"]]:
    """`walk_matrix` and `gates` from one sum over heads ``s_ij = sum_h A^h_ij``::

        W_ij = s_ij / H,    g^h_ij = A^h_ij (1 / s_ij) + [s_ij = 0] / H

    the gates in one fused pass over the pattern (``addcdiv`` of the broadcast
    ``[batch, 1, query, key]`` terms): two passes over the pattern in all, not four. The
    gates divide by ``s_ij`` rather than multiply by ``1 / s_ij``: at long contexts a softmax
    gives patterns as small as float32's subnormals, whose reciprocal is ``inf`` (``0 * inf``
    would make a NaN gate); ``A^h_ij / s_ij <= 1`` is finite wherever ``s_ij > 0``.

    >>> A = torch.softmax(torch.randn(2, 4, 5, 5), -1)
    >>> W, g = walk_and_gates(A)
    >>> torch.allclose(W, walk_matrix(A)), torch.allclose(g.sum(1), torch.ones(2, 5, 5))
    (True, True)
    """
    n_heads = pattern.shape[1]
    total = reduce(pattern, "batch head query key -> batch 1 query key", "sum")
    has_mass = total > 0
    # where s_ij = 0 every A^h_ij is 0: 0 / 1 plus the uniform 1 / H
    divisor = torch.where(has_mass, total, 1.0)
    uniform = torch.where(has_mass, 0.0, total.new_tensor(1.0 / n_heads))
    return total[:, 0] / n_heads, torch.addcdiv(uniform, pattern, divisor)


def patterns_from_walk(
    walk: Float[Tensor, "batch query key"], gates: Float[Tensor, "batch head query key"]
) -> Float[Tensor, "batch head query key"]:
    """Recombine a walk and its gates into per-head patterns ``A^h_ij = H W_ij g^h_ij``.

    The inverse of (`walk_matrix`, `gates`) up to rounding.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> torch.allclose(patterns_from_walk(walk_matrix(A), gates(A)), A)
    True
    """
    n_heads = gates.shape[1]
    return n_heads * einsum(
        walk, gates, "batch query key, batch head query key -> batch head query key"
    )


def head_transports(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> FactoredMatrix:
    """The head transports ``T^h = W_V^h W_O^h`` (the OV circuits), ``[head, d_model, d_model]``.

    Kept factored (rank ``d_head``); ``.AB`` forms the dense maps.

    >>> T = head_transports(torch.randn(2, 8, 2), torch.randn(2, 2, 8))
    >>> T.shape
    torch.Size([2, 8, 8])
    """
    return FactoredMatrix(W_V, W_O)


def propagate(
    pattern: Float[Tensor, "batch head query key"],
    field: Float[Tensor, "batch key d_model"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
) -> Float[Tensor, "batch query d_model"]:
    """The propagation ``(P X)_i = sum_j W_ij x_j T_ij = sum_h sum_j A^h_ij x_j W_V^h W_O^h``.

    Evaluated head by head through ``d_head``-wide values: ``O(batch n^2 H d_head)`` time and no
    per-edge ``d_model x d_model`` map.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> propagate(A, torch.randn(1, 3, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 8)).shape
    torch.Size([1, 3, 8])
    """
    values = einsum(field, W_V, "batch key d_model, head d_model d_head -> batch key head d_head")
    mixed = einsum(
        pattern, values, "batch head query key, batch key head d_head -> batch query head d_head"
    )
    return einsum(mixed, W_O, "batch query head d_head, head d_head d_model -> batch query d_model")


def attention_bias(
    pattern: Float[Tensor, "batch head query key"],
    b_V: Float[Tensor, "head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    b_O: Float[Tensor, " d_model"],
) -> Float[Tensor, "batch query d_model"]:
    """The bias ``c_i = sum_h (sum_j A^h_ij) b_V^h W_O^h + b_O`` (spec §1.2).

    ``sum_j A^h_ij`` is 1 for softmax rows, smaller with attention sinks or masked rows.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> attention_bias(A, torch.zeros(2, 4), torch.randn(2, 4, 8), torch.ones(8))[0, 0]
    tensor([1., 1., 1., 1., 1., 1., 1., 1.])
    """
    mass = reduce(pattern, "batch head query key -> batch query head", "sum")
    value_bias = einsum(b_V, W_O, "head d_head, head d_head d_model -> head d_model")
    return einsum(mass, value_bias, "batch query head, head d_model -> batch query d_model") + b_O


def head_messages(
    field: Float[Tensor, "batch key d_model"],
    W_V: Float[Tensor, "head d_model d_head"],
    b_V: Float[Tensor, "head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
) -> Float[Tensor, "batch key head d_model"]:
    """Each head's transported message ``m^h_j = (x_j W_V^h + b_V^h) W_O^h``.

    The attention output is ``sum_h sum_j A^h_ij m^h_j + b_O``.

    >>> head_messages(torch.randn(1, 3, 8), torch.randn(2, 8, 4), torch.zeros(2, 4),
    ...               torch.randn(2, 4, 8)).shape
    torch.Size([1, 3, 2, 8])
    """
    values = einsum(field, W_V, "batch key d_model, head d_model d_head -> batch key head d_head")
    return einsum(
        values + b_V, W_O, "batch key head d_head, head d_head d_model -> batch key head d_model"
    )


def edge_transport(
    edge_gates: Float[Tensor, "batch head"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
) -> FactoredMatrix:
    """One edge's effective transport ``T_ij = W_V^cat diag(H g_ij (x) 1_{d_head}) W_O^cat``.

    ``edge_gates`` is ``g[:, :, i, j]``. The result is a ``FactoredMatrix``
    ``[batch, d_model, d_model]`` of inner width ``H d_head``; ``.AB`` materialises it.

    >>> T = edge_transport(torch.full((1, 2), 0.5), torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> T.shape
    torch.Size([1, 8, 8])
    """
    n_heads = edge_gates.shape[1]
    left = einsum(
        W_V, n_heads * edge_gates, "head d_model d_head, batch head -> batch d_model head d_head"
    )
    left = rearrange(left, "batch d_model head d_head -> batch d_model (head d_head)")
    right = rearrange(W_O, "head d_head d_model -> (head d_head) d_model")
    return FactoredMatrix(left, right.expand(left.shape[0], *right.shape))


class EffectiveTransport:
    """All edges' effective transports ``T_ij``, held lazily as gates and head factors.

    Never materialises ``n^2 d_model^2`` numbers: indexing one edge gives its
    ``FactoredMatrix`` (`edge_transport`), ``[batch, d_model, d_model]``. With ``edges``
    ``[batch, query, key]`` (where the walk has an edge) a transport exists only on an edge:
    a pair that is an edge in no batch element raises a ConnWalkError, and batch elements
    where it is none get the zero map.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> T = EffectiveTransport(gates(A), torch.randn(2, 8, 4), torch.randn(2, 4, 8))
    >>> T[2, 0].shape, T.shape
    (torch.Size([1, 8, 8]), (1, 3, 3, 8, 8))
    """

    def __init__(
        self,
        gates: Float[Tensor, "batch head query key"],
        W_V: Float[Tensor, "head d_model d_head"],
        W_O: Float[Tensor, "head d_head d_model"],
        edges: Bool[Tensor, "batch query key"] | None = None,
    ) -> None:
        check_operator("gates", gates, W_V, W_O)
        if edges is not None and (
            not isinstance(edges, Tensor)
            or edges.dtype != torch.bool
            or edges.shape != gates.shape[:1] + gates.shape[2:]
        ):
            raise ConnWalkError(
                f"edges must be None or a bool tensor [batch, query, key] = "
                f"{tuple(gates.shape[:1] + gates.shape[2:])}, the gates'; got "
                f"{getattr(edges, 'dtype', type(edges).__name__)} "
                f"{tuple(getattr(edges, 'shape', ()))}."
            )
        self.gates = gates
        self.W_V = W_V
        self.W_O = W_O
        self.edges = edges

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(batch, query, key, d_model, d_model)``, the shape the dense tensor would have."""
        batch, _, n_query, n_key = self.gates.shape
        d_model = self.W_V.shape[1]
        return (batch, n_query, n_key, d_model, d_model)

    def __getitem__(self, edge: tuple[int, int]) -> FactoredMatrix:
        if not isinstance(edge, tuple) or len(edge) != 2:
            raise ConnWalkError(f"index one edge as [query, key] (two ints), got [{edge!r}].")
        _, _, n_query, n_key = self.gates.shape
        query = checked_index(edge[0], n_query, "query", "this walk", "positions")
        key = checked_index(edge[1], n_key, "key", "this walk", "positions")
        transport = edge_transport(self.gates[:, :, query, key], self.W_V, self.W_O)
        if self.edges is None or self.edges.is_meta:  # meta tensors hold no values to check
            return transport
        present = self.edges[:, query, key]
        if not bool(present.any()):
            raise ConnWalkError(
                f"({query}, {key}) is no edge of the walk (W_ij = 0: the future of a causal "
                "walk, padding or a key no head attends to), so it has no transport; "
                "walk.edges() shows the edges."
            )
        if bool(present.all()):
            return transport
        keep = present.to(transport.A)[:, None, None]
        return FactoredMatrix(transport.A * keep, transport.B)

    def __repr__(self) -> str:
        batch, n_query, n_key, d_model, _ = self.shape
        n_heads, _, d_head = self.W_V.shape
        return (
            f"EffectiveTransport(batch={batch}, query={n_query}, key={n_key}, d_model={d_model}, "
            f"rank<={n_heads * d_head}; index [query, key] for one edge's FactoredMatrix)"
        )
