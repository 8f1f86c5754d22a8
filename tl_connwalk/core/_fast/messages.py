"""The head messages' Grams ``G_j[a,b] = m^a_j . m^b_j``, ``m^h_j = x_j W_V^h W_O^h`` (spec §3),
from ``d_head``-wide values and the output Gram ``W_O^cat W_O^cat^T`` (or the messages
themselves where that Gram is too wide), in blocks of keys: no ``d_model x d_model`` map."""

import dataclasses
from collections.abc import Callable

import torch
from einops import rearrange
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
    >>> from einops import einsum
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
    `_paired_grams` (flattened), ``G[a, (a + k) mod H]`` for ``k <= H // 2``.

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
    head_values = _shared_keys(keys[None], W_V)
    if out_rows is None:
        grams = _message_route(head_values, keys, (1, 1), W_O)[0, 0]
    else:
        grams = _paired_grams(head_values, keys, (1, 1), heads, out_rows)[0, 0]
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
    head_values = _factored_values(factor[None], values[None], n_heads)
    if W_O is not None:
        return _message_route(head_values, factor, (1, 1), W_O.to(factor))[0, 0]
    return _paired_grams(head_values, factor, (1, 1), (n_heads, d_head), side)[0, 0]


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
    head_values = _factored_values(factor, values, n_heads)
    lead = (values.shape[0], factor.shape[0])
    if W_O is not None:
        return _message_route(head_values, factor[0], lead, side)
    return _paired_grams(head_values, factor[0], lead, (n_heads, d_head), side)


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

    >>> from einops import einsum
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
    stack = keys.shape[0]
    heads = (n_heads, values.shape[-1] // max(1, n_heads))

    def head_values(block: slice) -> Tensor:
        """``[stack, head, rows, d_head]``: each problem's values, copied head-major."""
        v = torch.bmm(keys[:, block], values)
        return v.view(stack, v.shape[1], *heads).transpose(1, 2).contiguous()

    grams = _paired_grams(head_values, keys[0], (stack, 1), heads, out_rows)[:, 0]
    return grams.unflatten(1, field.shape[1:3])


def _message_route(
    head_values: Callable[[slice], Tensor],
    rows_like: Tensor,
    lead: tuple[int, int],
    W_O: Float[Tensor, "head d_head d_model"],
) -> Tensor:
    """``G_j[a,b] = m^a_j . m^b_j`` ``[problem, seq, row, head, head]`` through the messages
    ``m^h_j = v^h_j W_O^h`` (one ``W_O`` for every problem), block by block of
    ``rows_like``'s rows, from each block's head-major values ``head_values(rows)``
    ``[problem, head, (seq rows), d_head]`` (as `_paired_grams`'). Per block every head's
    messages in one batched product, then every row's Gram in another."""
    n_problems, n_seq = lead
    n_heads, n_rows = W_O.shape[0], rows_like.shape[0]
    grams = rows_like.new_empty(n_problems, n_seq, n_rows, n_heads, n_heads)
    # a quarter of the chunk budget: larger blocks only raise the peak (on the CPU,
    # 8B-shaped heads: 64 MiB more)
    per_row = n_problems * n_seq * 4 * n_heads * W_O.shape[-1]
    for block in query_chunks(n_rows, per_row, device=rows_like.device):
        v = head_values(block)
        if n_problems > 1:  # the problems' rows after one another, for one product per head
            v = rearrange(v, "problem head row p -> 1 head (problem row) p")
        messages = torch.bmm(v[0], W_O)  # [head, rows, d_model]
        by_row = messages.transpose(0, 1)
        part = torch.bmm(by_row, by_row.mT)
        grams[:, :, block] = part.view(n_problems, n_seq, -1, n_heads, n_heads)
    return grams


def _shared_keys(keys: Tensor, W_V: Tensor) -> Callable[[slice], Tensor]:
    """Head-major values of keys ``[1, row, d_model]`` with ``W_V`` ``[head, d_model,
    d_head]``, block by block: ``[1, head, rows, d_head]``, the keys read by every head's
    product at once (a broadcast, not a copy)."""
    n_heads, d_model, d_head = W_V.shape

    def head_values(block: slice) -> Tensor:
        rows = keys[:, block]
        v = torch.bmm(rows.expand(n_heads, -1, d_model), W_V)
        return v.view(1, n_heads, rows.shape[1], d_head)

    return head_values


def _factored_values(
    factor: Float[Tensor, "seq row rank"],
    values: Float[Tensor, "draw rank head_d_head"],
    n_heads: int,
) -> Callable[[slice], Tensor]:
    """Head-major values ``factor[s, j] @ values[d]`` block by block of rows:
    ``[draw, head, (seq rows), d_head]``, every sequence's rows one after another (each
    draw's values made head-major once)."""
    n_draws, rank, width = values.shape
    d_head = width // max(1, n_heads)
    by_head = rearrange(values, "draw k (head p) -> (draw head) k p", head=n_heads).contiguous()

    def head_values(block: slice) -> Tensor:
        rows = factor[:, block].reshape(1, -1, rank)  # a view for one sequence
        v = torch.bmm(rows.expand(n_draws * n_heads, -1, rank), by_head)
        return v.view(n_draws, n_heads, rows.shape[1], d_head)

    return head_values


def _paired_grams(
    head_values: Callable[[slice], Tensor],
    rows_like: Tensor,
    lead: tuple[int, int],
    heads: tuple[int, int],
    out_rows: Tensor,
) -> Tensor:
    """``G_j[a,b] = v^a_j (W_O^a W_O^b^T) v^b_j^T`` ``[problem, seq, row, head, head]`` for
    ``lead = (problem, seq)``, block by block of ``rows_like``'s rows.

    ``head_values(rows)`` gives each block's values head-major, ``[problem, head, (seq rows),
    d_head]`` with ``(problem, head)`` one batch axis of a view; ``out_rows``
    ``[problem or 1, packed]`` holds each problem's output-Gram rows (`output_gram_rows`).
    Per block: the forms ``v^a_j W_O^a W_O^b^T`` of every head with its ``H // 2 + 1``
    partners ``b = (a + k) mod H`` in one batched product, the partners' values beside them
    (the heads wrapped around, one copy, then a strided view), their products summed over
    ``d_head``, and the pairs gathered into the Grams: nine operations besides the values',
    with the buffers and their views made once per block size.
    """
    (n_heads, d_head), n_rows = heads, rows_like.shape[0]
    n_problems, n_seq = lead
    n_shift = n_heads // 2 + 1
    blocks = row_blocks(out_rows.to(rows_like), n_heads, d_head)
    blocks = blocks.expand(n_problems, *blocks.shape[-3:]).reshape(-1, *blocks.shape[-2:])
    index = _pair_index(n_heads, rows_like.device)
    grams = rows_like.new_empty(n_problems, n_seq, n_rows, n_heads, n_heads)
    # per row, problem and sequence: the forms, the wrapped values and the values themselves
    # (each at most H d_head), the pairs
    per_row = n_problems * n_seq * (n_shift + 3) * n_heads * d_head
    views: _PairViews | None = None
    for block in query_chunks(n_rows, per_row, device=rows_like.device):
        v = head_values(block)
        rows = v.shape[2]
        if torch.is_grad_enabled() and (v.requires_grad or blocks.requires_grad):
            # the same steps without kept buffers, which autograd cannot follow
            forms = torch.bmm(v.view(-1, rows, d_head), blocks)
            wrapped = torch.cat([v, v[:, : n_shift - 1]], dim=1)
            partners = wrapped.unfold(1, n_shift, 1).transpose(-1, -2)
            pairs = (forms.view(*partners.shape) * partners).sum(-1).transpose(1, 2)
            flat = pairs.reshape(n_problems, n_seq, -1, n_heads * n_shift)
            grams[:, :, block] = flat[..., index].unflatten(-1, (n_heads, n_heads))
            continue
        if views is None or views.rows != rows:  # the first block is the largest
            views = _PairViews.of(views, v, n_shift, n_seq)
        torch.bmm(v.view(-1, rows, d_head), blocks, out=views.forms)
        torch.cat([v, v[:, : n_shift - 1]], dim=1, out=views.wrapped)
        torch.sum(views.products.mul_(views.partners), -1, out=views.pairs)
        out = grams[:, :, block].view(n_problems, n_seq, -1, n_heads * n_heads)
        torch.index_select(views.flat_pairs, -1, index, out=out)
    return grams


@dataclasses.dataclass(frozen=True)
class _PairViews:
    """`_paired_grams`' buffers viewed at one block size of ``rows`` (every sequence's):
    the forms (``forms`` for the product, ``products`` by partner), the wrapped values and
    their ``partners`` view ``[problem, head, rows, shift, d_head]``, and the pairs summed
    over ``d_head`` (``pairs`` by head, ``flat_pairs`` ``[problem, seq, rows, head shift]``)."""

    rows: int
    forms: Tensor
    products: Tensor
    wrapped: Tensor
    partners: Tensor
    pairs: Tensor
    flat_pairs: Tensor
    storage: tuple[Tensor, Tensor, Tensor]

    @classmethod
    def of(cls, old: "_PairViews | None", v: Tensor, n_shift: int, n_seq: int) -> "_PairViews":
        """Views at ``v``'s block size, in ``old``'s buffers (made here if there are none)."""
        n_problems, n_heads, rows, d_head = v.shape
        sizes = (
            n_problems * n_heads * rows * n_shift * d_head,
            n_problems * (n_heads + n_shift - 1) * rows * d_head,
            n_problems * rows * n_heads * n_shift,
        )
        if old is None:
            storage = (v.new_empty(sizes[0]), v.new_empty(sizes[1]), v.new_empty(sizes[2]))
        else:
            storage = old.storage
        forms_buffer, wrapped_buffer, pairs_buffer = (
            buffer[:n] for buffer, n in zip(storage, sizes, strict=True)
        )
        forms = forms_buffer.view(n_problems * n_heads, rows, n_shift * d_head)
        wrapped = wrapped_buffer.view(n_problems, n_heads + n_shift - 1, rows, d_head)
        flat = pairs_buffer.view(n_problems, rows, n_heads, n_shift)
        return cls(
            rows, forms, forms.view(n_problems, n_heads, rows, n_shift, d_head), wrapped,
            wrapped.unfold(1, n_shift, 1).transpose(-1, -2), flat.transpose(1, 2),
            flat.view(n_problems, n_seq, rows // n_seq, n_heads * n_shift), storage,
        )  # fmt: skip
