"""The size of what each edge carries: the norm-based quantities of Kobayashi et al. (2020).

An attention layer's output is ``y_i = sum_j sum_h A^h_ij f^h(x_j) + b_O`` with
``f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h`` (`tl_connwalk.core.walk.head_messages`). The norms of
its parts, per edge ``j -> i``:

- ``head[b, h, i, j] = ||A^h_ij f^h(x_j)|| = A^h_ij ||f^h(x_j)||``: one head's message, value
  bias included (``A >= 0``);
- ``message_norms``: ``||sum_h A^h_ij m^h_j||`` for any per-head messages ``m``; with
  ``m^h_j = x_j W_V^h W_O^h`` it is the walk's message ``||W_ij x_j T_ij||`` (spec §1.2), with
  ``m = f`` Kobayashi's ``||sum_h A^h_ij f^h(x_j)||``.

Memory: the summed messages are formed a block of queries at a time (`QUERY_BLOCK_ELEMENTS`).
"""

import dataclasses

import torch
from einops import einsum
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core.walk import head_messages

#: floats held at once by the per-edge messages ``[batch, query block, key, d_model]``
QUERY_BLOCK_ELEMENTS = 2**24


@dataclasses.dataclass(frozen=True)
class EdgeContributions:
    """Norms of what each edge of one attention layer carries (Kobayashi et al. 2020).

    Attributes:
        edge: ``[batch, query, key]``, ``||W_ij x_j T_ij||``: the walk's message on the edge
            ``j -> i``, the field transported (no bias: value biases are in
            ``ConnectionWalk.bias``).
        head: ``[batch, head, query, key]``, ``||A^h_ij f^h(x_j)||`` with
            ``f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h``: each head's message, value bias included
            (heads that share a value head in grouped-query attention share ``f``).

    Both are 0 off the walk's edges (``W_ij = 0``, padding).
    """

    edge: Float[Tensor, "batch query key"]
    head: Float[Tensor, "batch head query key"]


def message_norms(
    pattern: Float[Tensor, "batch head query key"],
    messages: Float[Tensor, "batch key head d_model"],
) -> Float[Tensor, "batch query key"]:
    """``||sum_h A^h_ij m^h_j||`` per edge, the summed messages formed a block of queries at once.

    >>> A = torch.ones(1, 2, 1, 1) / 2
    >>> message_norms(A, torch.tensor([[[[3.0, 0.0], [3.0, 8.0]]]]))
    tensor([[[5.]]])
    """
    batch, _, n_query, n_key = pattern.shape
    block = max(1, QUERY_BLOCK_ELEMENTS // max(1, batch * n_key * messages.shape[-1]))
    norms = [
        einsum(
            pattern[:, :, start : start + block],
            messages,
            "batch head query key, batch key head d_model -> batch query key d_model",
        ).norm(dim=-1)
        for start in range(0, n_query, block)
    ]
    return torch.cat(norms, 1)


def edge_contributions(
    pattern: Float[Tensor, "batch head query key"],
    field: Float[Tensor, "batch key d_model"],
    W_V: Float[Tensor, "head d_model d_head"],
    b_V: Float[Tensor, "head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    edges: Bool[Tensor, "batch query key"],
) -> EdgeContributions:
    """`EdgeContributions` of a layer: ``||W_ij x_j T_ij||`` and ``||A^h_ij f^h(x_j)||``.

    ``W_V``, ``b_V`` hold one block per query head (grouped-query heads expanded). Entries off
    ``edges`` are 0. ``O(batch n^2 (H + d_model))`` time.

    >>> A = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> norms = edge_contributions(A, torch.randn(1, 3, 8), torch.randn(2, 8, 4),
    ...                            torch.zeros(2, 4), torch.randn(2, 4, 8),
    ...                            torch.ones(1, 3, 3, dtype=torch.bool))
    >>> norms.edge.shape, norms.head.shape
    (torch.Size([1, 3, 3]), torch.Size([1, 2, 3, 3]))
    """
    unbiased = head_messages(field, W_V, torch.zeros_like(b_V), W_O)
    edge = message_norms(pattern, unbiased)
    sizes = head_messages(field, W_V, b_V, W_O).norm(dim=-1)  # [batch, key, head]
    head = pattern * sizes.transpose(1, 2)[:, :, None]
    return EdgeContributions(edge=edge.where(edges, 0.0), head=head.where(edges[:, None], 0.0))
