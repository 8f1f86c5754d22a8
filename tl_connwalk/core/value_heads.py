"""Which value head each query head reads, and the rank that allows (spec §3).

In grouped-query attention ``H`` query heads share ``H_kv`` value (and key) heads: query head
``h`` reads value head ``kv(h)``, ``T^h = W_V^{kv(h)} W_O^h``. A map from query heads to value
heads is a tuple ``kv_heads`` of ``H`` integers; ``None`` means no sharing (``kv(h) = h``).
TransformerLens and Hugging Face models group consecutive heads, ``kv(h) = h // (H / H_kv)``
(`grouped_value_heads`).

Every effective transport ``T_ij = H sum_h g^h_ij W_V^{kv(h)} W_O^h`` factors through the value
coordinates of the distinct value heads its heads read, so its rank is at most
``min(d_model, H_kv d_head)`` (`transport_rank`): the ``r`` of the effective-transport defect
and of the common scale. Rotary embeddings (of any rotary dimension) act on queries and keys
only: they change the patterns, never ``W_V`` or ``W_O``, so they enter no rank.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from tl_connwalk.errors import ConnWalkError

KVHeads = tuple[int, ...]


def grouped_value_heads(n_heads: int, n_value_heads: int) -> KVHeads:
    """``kv(h) = h // (H / H_kv)``: consecutive query heads share a value head, as in
    TransformerLens (``n_key_value_heads``) and Hugging Face (``num_key_value_heads``).

    >>> grouped_value_heads(6, 2)
    (0, 0, 0, 1, 1, 1)
    """
    for name, value in (("n_heads", n_heads), ("n_value_heads", n_value_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConnWalkError(f"{name} must be a positive integer, got {value!r}.")
    if n_heads % n_value_heads:
        raise ConnWalkError(
            f"{n_heads} query heads cannot share {n_value_heads} value heads evenly; grouped-query "
            "attention needs n_heads to be a multiple of n_key_value_heads."
        )
    group = n_heads // n_value_heads
    return tuple(h // group for h in range(n_heads))


def check_kv_heads(kv_heads: Sequence[int] | None, n_heads: int) -> KVHeads | None:
    """``kv_heads`` as a tuple after checking it maps ``n_heads`` query heads to value heads
    ``0, 1, ...`` (``None`` stays ``None``: no sharing).

    >>> check_kv_heads([0, 0, 1, 1], 4)
    (0, 0, 1, 1)
    """
    if kv_heads is None:
        return None
    values = (
        tuple(kv_heads) if isinstance(kv_heads, Sequence) and not isinstance(kv_heads, str) else ()
    )
    if len(values) != n_heads or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_heads for v in values
    ):
        raise ConnWalkError(
            f"kv_heads must give the value head (an integer in 0..{n_heads - 1}: there are at "
            f"most as many value heads as query heads) of each of the {n_heads} query heads, got "
            f"{kv_heads!r}; e.g. grouped_value_heads(n_heads, n_key_value_heads)."
        )
    return values


def n_value_heads(kv_heads: Sequence[int] | None, n_heads: int) -> int:
    """How many value heads the factors hold: ``max kv(h) + 1`` (``H`` without sharing).

    >>> n_value_heads((0, 0, 1, 1), 4), n_value_heads(None, 4)
    (2, 4)
    """
    checked = check_kv_heads(kv_heads, n_heads)
    return n_heads if checked is None else max(checked, default=-1) + 1


def distinct_value_heads(
    kv_heads: Sequence[int] | None, n_heads: int, heads: Sequence[int] | None = None
) -> int:
    """``H_kv`` of a set of query heads: the number of distinct value heads they read.

    ``heads``: the query heads involved (``None``: all ``n_heads``). This is what bounds the
    rank of a transport mixing those heads (`transport_rank`).

    >>> kv = grouped_value_heads(6, 2)
    >>> distinct_value_heads(kv, 6), distinct_value_heads(kv, 6, heads=[0, 2])
    (2, 1)
    """
    checked = check_kv_heads(kv_heads, n_heads)
    chosen = range(n_heads) if heads is None else heads
    for h in chosen:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n_heads:
            raise ConnWalkError(f"heads must be query heads in [0, {n_heads}), got {heads!r}.")
    return len({h if checked is None else checked[h] for h in chosen})


def transport_rank(d_model: int, d_head: int, n_distinct: int) -> int:
    """``r = min(d_model, H_kv d_head)``: the rank an effective transport of heads reading
    ``n_distinct = H_kv`` value heads can have (spec §3).

    >>> transport_rank(576, 64, 3)  # SmolLM2-135M: 9 query heads on 3 value heads
    192
    """
    return min(d_model, n_distinct * d_head)


def is_shared(kv_heads: Sequence[int] | None) -> bool:
    """Whether two query heads read one value head.

    >>> is_shared((0, 0, 1, 1)), is_shared((0, 1, 2)), is_shared(None)
    (True, False, False)
    """
    return kv_heads is not None and len(set(kv_heads)) < len(kv_heads)


def expand_value_heads(values: Tensor, kv_heads: Sequence[int] | None, dim: int = 0) -> Tensor:
    """One block per query head along ``dim``: query head ``h`` gets value head ``kv(h)``'s
    block of ``values`` (``[..., kv_head, ...]`` to ``[..., head, ...]``; unchanged without
    ``kv_heads``). The one expansion of grouped-query weights, values and draws.

    >>> expand_value_heads(torch.tensor([10, 20]), grouped_value_heads(4, 2))
    tensor([10, 10, 20, 20])
    """
    if kv_heads is None:
        return values
    return values.index_select(dim, torch.tensor(tuple(kv_heads), device=values.device))
