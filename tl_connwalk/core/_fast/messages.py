"""The head messages' Grams ``G_j[a,b] = m^a_j . m^b_j``, ``m^h_j = x_j W_V^h W_O^h`` (spec §3),
from ``d_head``-wide values and the output Gram ``W_O^cat W_O^cat^T`` (or the messages
themselves where that Gram is too wide), in blocks of keys: no ``d_model x d_model`` map."""

import math
from collections.abc import Callable

import torch
from einops import einsum, rearrange
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core._fast.chunks import query_chunks
from tl_connwalk.core._fast.lru import memoized
from tl_connwalk.core.checks import working_dtype
from tl_connwalk.errors import ConnWalkError


def cast_operands(field: Tensor, W_V: Tensor, W_O: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
    if field.ndim != 3 or W_V.ndim != 3 or W_O.ndim != 3:
        raise ConnWalkError(
            f"field must be [batch, key, d_model], W_V [head, d_model, d_head] and W_O "
            f"[head, d_head, d_model]; got {tuple(field.shape)}, {tuple(W_V.shape)}, "
            f"{tuple(W_O.shape)}."
        )
    if field.shape[-1] != W_V.shape[1] or W_V.shape[::2] != W_O.shape[:2]:
        raise ConnWalkError(
            f"field {tuple(field.shape)}, W_V {tuple(W_V.shape)} and W_O {tuple(W_O.shape)} do "
            "not compose: the field's last axis is W_V's d_model, and W_O is [head, d_head, "
            "d_model] with W_V's head and d_head."
        )
    dtype = working_dtype(field, W_V, W_O, *rest)
    return tuple(t.to(device=field.device, dtype=dtype) for t in (field, W_V, W_O, *rest))


def output_gram_rows(
    out_blocks: Float[Tensor, "head head d_head d_head"],
) -> Float[Tensor, " packed"]:
    """The output Gram ``W_O^cat W_O^cat^T`` by the blocks that pair each head with the next
    ``H // 2`` (cyclically), packed (``out_rows`` of `message_grams`).

    ``out_blocks[a, b] = W_O^a W_O^b^T`` (`tl_connwalk.core.isometry.head_factor_grams`' second
    result). Head ``a`` keeps the blocks ``b = (a + k) mod H`` for ``k = 0 ... H // 2`` as one
    ``[d_head, (H // 2 + 1) d_head]`` matrix, the heads one after another: every unordered
    head pair is among them (``W_O^b W_O^a^T`` is the transpose of ``W_O^a W_O^b^T``), and
    the layout is the same for every head, so `message_grams` takes all heads in one batched
    product. ``d_head^2 H (H // 2 + 1)`` numbers, about half of the symmetric Gram (GPT-2
    small: 1.3 MiB in float32 against 2.25 MiB).

    >>> W_O = torch.randn(3, 2, 8)
    >>> output_gram_rows(einsum(W_O, W_O, "a p d, b q d -> a b p q")).shape  # 4 * 3 * 2
    torch.Size([24])
    """
    n_heads = out_blocks.shape[0]
    heads = torch.arange(n_heads, device=out_blocks.device)
    partners = (heads[:, None] + heads[: n_heads // 2 + 1]) % max(1, n_heads)
    return rearrange(out_blocks[heads[:, None], partners], "a k p q -> (a p k q)")


def output_gram_rows_numel(n_heads: int, d_head: int) -> int:
    """Numbers `output_gram_rows` packs for ``n_heads`` heads of ``d_head``:
    ``d_head^2 H (H // 2 + 1)``.

    >>> output_gram_rows_numel(3, 2)
    24
    """
    return d_head * d_head * n_heads * (n_heads // 2 + 1)


def row_blocks(out_rows: Tensor, n_heads: int, d_head: int) -> Tensor:
    """The rows packed by `output_gram_rows` as ``[..., head, d_head, (H // 2 + 1) d_head]``
    (a view; any leading axes of ``out_rows``, e.g. one per draw): ``[..., a, :, k d_head :
    (k + 1) d_head]`` is ``W_O^a W_O^b^T`` with ``b = (a + k) mod H``."""
    expected = output_gram_rows_numel(n_heads, d_head)
    if out_rows.shape[-1:] != (expected,):
        raise ConnWalkError(
            f"out_rows {tuple(out_rows.shape)} must be [{expected}]: the output Gram "
            f"W_O^cat W_O^cat^T's blocks for {n_heads} heads of {d_head}, packed by "
            "output_gram_rows."
        )
    return out_rows.view(*out_rows.shape[:-1], n_heads, d_head, (n_heads // 2 + 1) * d_head)


@memoized("core.messages.pair_index", maxsize=8)
def _pair_index(n_heads: int, device: torch.device) -> Tensor:
    """``[H H]``: where ``G[a, b]`` lies among the products ``[head a, shift k]`` of
    `_value_grams` (flattened), ``G[a, (a + k) mod H]`` for ``k <= H // 2``.

    ``(a, b)`` reads ``(a, k)`` with ``k = (b - a) mod H`` where ``2 k < H``, else ``(b, H -
    k)`` (the same pair from ``b``); for ``2 k = H`` both heads hold the pair, and both
    ``(a, b)`` and ``(b, a)`` read the lower head's: the Gram is exactly symmetric.

    >>> _pair_index(3, torch.device("cpu")).view(3, 3)
    tensor([[0, 1, 5],
            [1, 2, 3],
            [5, 3, 4]])
    """
    n_shift = n_heads // 2 + 1
    heads = torch.arange(n_heads)
    a, b = heads[:, None], heads[None, :]
    k = (b - a) % max(1, n_heads)
    index = torch.where(2 * k < n_heads, a * n_shift + k, b * n_shift + (n_heads - k))
    index = torch.where(2 * k == n_heads, torch.minimum(a, b) * n_shift + k, index)
    return index.flatten().to(device)


def message_grams(
    field: Float[Tensor, "batch key d_model"],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    out_rows: Float[Tensor, " packed"] | None = None,
) -> Float[Tensor, "batch key head head"]:
    """The head-message Gram ``G_j[a,b] = (x_j T^a) . (x_j T^b)`` of every key.

    Without ``out_rows``, through the messages ``m^h_j = (x_j W_V^h) W_O^h``:
    ``O(batch n H d_head d_model + batch n H^2 d_model)`` time. With ``out_rows``, half the
    blocks ``W_O^a W_O^b^T`` of ``W_O^cat W_O^cat^T`` (each head with its next ``H // 2``,
    packed by `output_gram_rows`; `tl_connwalk.core._fast.head_grams.HeadGrams` keeps them for
    narrow layers), through the values ``v^a_j = x_j W_V^a`` alone::

        G_j[a,b] = v^a_j (W_O^a W_O^b^T) v^b_j^T

    for each unordered pair once: ``O(batch n H d_head (d_model + (H // 2 + 1) d_head))``; for
    GPT-2 small's heads and one sequence on one CPU thread 2.1x faster at 256 tokens, as fast
    at 1024 (the messages' products run at a higher rate there). Either way
    a block of keys at a time, every head in one batched product (the temporaries within
    the chunk budget, `chunks.chunk_entries`); the ``d_model x d_model`` maps ``T^h`` are never
    formed.

    >>> field, W_V, W_O = torch.randn(1, 3, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    >>> G = message_grams(field, W_V, W_O)
    >>> G.shape
    torch.Size([1, 3, 2, 2])
    >>> from einops import einsum
    >>> out_rows = output_gram_rows(einsum(W_O, W_O, "a p d, b q d -> a b p q"))
    >>> torch.allclose(message_grams(field, W_V, W_O, out_rows=out_rows), G, atol=1e-4)
    True
    """
    field, W_V, W_O = cast_operands(field, W_V, W_O)
    batch = field.shape[0]
    keys = rearrange(field, "batch key d_model -> (batch key) d_model")
    heads = (W_V.shape[0], W_V.shape[2])
    values = rearrange(W_V, "head d_model d_head -> d_model (head d_head)")  # a view for draws
    grams = _value_grams(
        lambda block: keys[block] @ values, keys, heads, None if out_rows is not None else W_O,
        out_rows,
    )  # fmt: skip
    return rearrange(grams, "(batch key) a b -> batch key a b", batch=batch)


def factored_message_grams(
    factor: Float[Tensor, "row rank"],
    values: Float[Tensor, "rank head_d_head"],
    n_heads: int,
    *,
    W_O: Float[Tensor, "head d_head d_model"] | None = None,
    out_rows: Float[Tensor, " packed"] | None = None,
) -> Float[Tensor, "row head head"]:
    """`message_grams` of rows whose values ``[v^1_j ... v^H_j]`` are ``factor[j] @ values``.

    ``values`` is ``[rank, H d_head]`` (heads side by side); the output side is ``out_rows``
    (as in `message_grams`) or else ``W_O``. A random baseline's values ``X R_V`` are, in
    distribution, ``L Y`` with ``L L^T = X X^T`` and ``Y`` standard Gaussian
    (`tl_connwalk.core._fast.draws.key_factor`): ``O(n^2 H d_head)`` instead of
    ``O(n d_model H d_head)`` for ``n < d_model`` keys.

    >>> L, Y, W_O = torch.randn(3, 3).tril(), torch.randn(3, 8), torch.randn(2, 4, 5)
    >>> factored_message_grams(L, Y, 2, W_O=W_O).shape
    torch.Size([3, 2, 2])
    """
    side = out_rows if W_O is None else W_O
    if side is None or (W_O is not None and out_rows is not None):
        raise ConnWalkError("factored_message_grams needs W_O or out_rows (one of them).")
    dtype = working_dtype(factor, values, side)
    factor, values = (t.to(device=factor.device, dtype=dtype) for t in (factor, values))
    d_head = values.shape[-1] // max(1, n_heads)
    if (
        factor.ndim != 2
        or values.shape != (factor.shape[1], n_heads * d_head)
        or (W_O is not None and W_O.shape[:2] != (n_heads, d_head))
    ):
        raise ConnWalkError(
            f"factor {tuple(factor.shape)} and values {tuple(values.shape)} must be [row, rank] "
            f"and [rank, head d_head] for {n_heads} heads"
            + ("" if W_O is None else f" of W_O {tuple(W_O.shape)} [head, d_head, d_model]")
            + "."
        )
    return _value_grams(
        lambda block: factor[block] @ values,
        factor,
        (n_heads, d_head),
        None if W_O is None else W_O.to(factor),
        out_rows,
    )


def stacked_factored_grams(
    factor: Float[Tensor, "seq row rank"],
    values: Float[Tensor, "draw rank head_d_head"],
    n_heads: int,
    *,
    out_rows: Float[Tensor, "draw packed"] | None = None,
    W_O: Float[Tensor, "head d_head d_model"] | None = None,
) -> Float[Tensor, "draw seq row head head"]:
    """`factored_message_grams` of several sequences' factors and several draws' values at
    once: the output side is each draw's ``out_rows`` (as in `message_grams`) or else one
    ``W_O`` shared by the draws (one of them, by name). One batched product per block of
    rows, whatever the number of draws and sequences.

    >>> L, Y, W_O = torch.randn(2, 3, 3).tril(), torch.randn(4, 3, 8), torch.randn(2, 4, 5)
    >>> stacked_factored_grams(L, Y, 2, W_O=W_O).shape
    torch.Size([4, 2, 3, 2, 2])
    """
    side = out_rows if W_O is None else W_O
    if side is None or (W_O is not None and out_rows is not None):
        raise ConnWalkError("stacked_factored_grams needs W_O or out_rows (one of them).")
    dtype = working_dtype(factor, values, side)
    factor, values, side = (t.to(device=factor.device, dtype=dtype) for t in (factor, values, side))
    d_head = values.shape[-1] // max(1, n_heads)
    return _value_grams(
        lambda block: einsum(factor[:, block], values, "seq row k, draw k e -> draw seq row e"),
        factor[0],
        (n_heads, d_head),
        None if W_O is None else side,
        None if W_O is not None else side[:, None],
        copies=values.shape[0] * factor.shape[0],
    )


def stacked_message_grams(
    field: Float[Tensor, "stack batch key d_model"],
    values: Float[Tensor, "stack d_model head_d_head"],
    n_heads: int,
    out_rows: Float[Tensor, "stack packed"],
) -> Float[Tensor, "stack batch key head head"]:
    """`message_grams` of several stacked problems at once (the layers of a model, say), each
    with a field, values ``W_V^cat = [W_V^1 ... W_V^H]`` ``[d_model, H d_head]`` and output
    Gram rows (`output_gram_rows`) of its own: one batched product per block of keys for
    every head, whatever the number of problems.

    >>> field, W_V, W_O = torch.randn(3, 1, 4, 8), torch.randn(3, 2, 8, 4), torch.randn(3, 2, 4, 8)
    >>> out_rows = torch.stack([output_gram_rows(einsum(o, o, "a p d, b q d -> a b p q"))
    ...                         for o in W_O])
    >>> G = stacked_message_grams(field, W_V.permute(0, 2, 1, 3).flatten(2), 2, out_rows)
    >>> torch.allclose(G[1], message_grams(field[1], W_V[1], W_O[1]), atol=1e-4)
    True
    """
    dtype = working_dtype(field, values, out_rows)
    field, values, out_rows = (
        t.to(device=field.device, dtype=dtype) for t in (field, values, out_rows)
    )
    keys = field.flatten(1, 2)  # every problem's sequences' keys, one after another
    heads = (n_heads, values.shape[-1] // max(1, n_heads))
    grams = _value_grams(
        lambda block: keys[:, block] @ values, keys[0], heads, None, out_rows,
        copies=field.shape[0],
    )  # fmt: skip
    return grams.unflatten(1, field.shape[1:3])


def _value_grams(
    values_of: Callable[[slice], Tensor],
    rows_like: Tensor,
    heads: tuple[int, int],
    W_O: Tensor | None,
    out_rows: Tensor | None,
    copies: int = 1,
) -> Tensor:
    """``G_j[a,b]`` ``[..., row, head, head]`` (``rows_like``'s rows: their number, dtype and
    device) from each block's values ``values_of(rows)`` (``[..., rows, head d_head]``, with
    ``copies`` the product of the leading axes: draws, sequences), block by block of rows:
    through ``out_rows`` (``[..., packed]``, leading axes that broadcast against the values')
    where given, else through ``W_O``."""
    (n_heads, d_head), n_rows = heads, rows_like.shape[0]
    if out_rows is None:
        if W_O is None:
            raise ConnWalkError("message Grams need W_O or out_rows (one of them).")
        grams = None
        # a quarter of the chunk budget: larger blocks only raise the peak (on the CPU,
        # 8B-shaped heads: 64 MiB more)
        per_row = copies * 4 * n_heads * W_O.shape[-1]
        for block in query_chunks(n_rows, per_row, device=rows_like.device):
            v = values_of(block).unflatten(-1, (n_heads, d_head))
            messages = einsum(v, W_O, "... row head p, head p d -> ... row head d")
            part = messages @ messages.mT
            if grams is None:
                grams = part.new_empty(*part.shape[:-3], n_rows, n_heads, n_heads)
            grams[..., block, :, :] = part
        assert grams is not None
        return grams
    blocks = row_blocks(out_rows.to(rows_like), n_heads, d_head)
    n_shift = n_heads // 2 + 1
    index = _pair_index(n_heads, rows_like.device)
    grams = None
    # the forms (the products of every head with its H // 2 + 1 partners) of every block in
    # one buffer: a fresh tensor of this size would come from fresh pages on every block (a
    # page fault per 4 KiB, on a CPU about as slow as the product itself)
    buffer = None
    # per row and copy: the forms, beside the values, their copy with the partners' heads
    # wrapped around and the product's operands (each at most H d_head): one batched product
    # per block of rows for every head, draw, sequence and stacked layer
    per_row = copies * (n_shift + 4) * n_heads * d_head
    for block in query_chunks(n_rows, per_row, device=rows_like.device):
        v = values_of(block).unflatten(-1, (n_heads, d_head))
        if grams is None:
            grams = v.new_empty(*v.shape[:-3], n_rows, n_heads, n_heads)
        if buffer is None:  # the first block is the largest
            buffer = v.new_empty(v.numel() * n_shift)
        # forms[..., j, a, k, :] = v^a_j W_O^a W_O^b^T, b = (a + k) mod H
        forms = _forms(v, blocks, buffer)
        wrapped = torch.cat([v, v[..., : n_shift - 1, :]], dim=-2)
        partners = wrapped.unfold(-2, n_shift, 1)  # [..., row, a, d_head, k]: v^b_j
        pairs = forms.unflatten(-1, (n_shift, d_head)).mul_(partners.mT).sum(-1)
        grams[..., block, :, :] = pairs.flatten(-2)[..., index].unflatten(-1, (n_heads, n_heads))
    assert grams is not None
    return grams


def _forms(
    v: Float[Tensor, "*lead row head d_head"],
    blocks: Float[Tensor, "*side head d_head e"],
    buffer: Tensor | None = None,
) -> Float[Tensor, "*lead row head e"]:
    """``v^a_j B^a`` for every head ``a`` (``blocks`` with leading axes that broadcast against
    ``v``'s), as one product per head with every row of the axes along which the blocks do not
    vary (their size-1 trailing axes: sequences, say) taken together: one batched product for
    every head and leading index, not one small one per sequence. Written into ``buffer`` (a
    flat tensor of at least as many numbers) where given and no gradient is asked for.

    >>> v, B = torch.randn(2, 3, 5, 4, 6), torch.randn(2, 1, 4, 6, 7)
    >>> torch.allclose(_forms(v, B), einsum(v, B, "... row a p, ... a p e -> ... row a e"))
    True
    """
    n_lead = v.ndim - 3
    side = (1,) * (n_lead - (blocks.ndim - 3)) + tuple(blocks.shape[:-3])
    keep = n_lead
    while keep and side[keep - 1] == 1:
        keep -= 1
    # the rows of every axis the blocks broadcast along, head-major: [..., head, rows, d_head]
    merged = v.flatten(keep, n_lead).movedim(-2, -3)
    side_blocks = blocks.reshape(*side[:keep], *blocks.shape[-3:])
    shape = (*merged.shape[:-1], blocks.shape[-1])
    out = None
    grad = torch.is_grad_enabled() and (merged.requires_grad or side_blocks.requires_grad)
    if buffer is not None and not grad and side_blocks.shape[:-2] == merged.shape[:-2]:
        out = buffer[: math.prod(shape)].view(shape)
    forms = torch.matmul(merged, side_blocks, out=out)  # [..., head, rows, e]
    return forms.movedim(-3, -2).unflatten(keep, v.shape[keep : n_lead + 1])
