"""The per-edge quadratic and quartic forms of the gates, monomial by monomial (spec §3).

The Gram defect of an edge's effective transport (`tl_connwalk.core.isometry`) needs, for its
gates ``g`` (``H`` heads) and each transport family (a layer, its random draws) with head Grams
``K2`` and folded ``K4`` ``F`` (`isometry.fold_pairs`, over the ``P = H (H + 1) / 2`` head
pairs ``a <= c``)::

    s2 = g^T K2 g      = k . u        u_{ac} = g^a g^c  (the pair products)
    s4 = sum_abce K4[a,b,c,e] g^a g^b g^c g^e = u^T F u

A quartic form in ``H`` variables has only ``C(H + 3, 4)`` distinct monomials
``g^a g^b g^c g^e`` with ``a <= b <= c <= e`` (1365 for ``H = 12``, 52360 for ``H = 32``)
against the ``P^2`` entries of ``F`` (6084, 278784). Each is ``u_{ab} u_{ce}``: a row pair
``(a, b)`` times a column pair ``(c, e)`` with ``b <= c``. So with ``C`` the coefficient of
each monomial (the sum of the entries of ``F`` that multiply it)::

    s4 = sum_{(a,b)} u_{ab} sum_{(c,e): c >= b} C[(a,b), (c,e)] u_{ce}

In `head_pairs` order (first index major) the column pairs with ``c >= b`` are a suffix, from
``(b, b)`` on. The rows are taken by their second index ``b``; a range ``[b0, b1)`` of it is
one matrix product of its coefficient rows (zero where ``c < b``) with the suffix from
``(b0, b0)``, or, where the range has fewer column pairs than row pairs, of the transposed
coefficients with the row pairs' products (`QuarticRows`): each product writes one row per
output pair and family, and those rows, not the multiply-adds, are most of its time on a CPU.
The ranges and their orientations are chosen once per head count and number of families
(`_ranges`) by a cost model of those products, measured on one CPU thread. For ``H = 12`` and
three families: 3 ranges, 2214 multiply-adds per family and edge and 46 output rows, against
3920 and 78 through the upper block triangle of ``F``; for ``H = 32``: 16 ranges, 56134
against 143616 multiply-adds, 370 against 528 rows.
"""

import dataclasses
from typing import NamedTuple

import torch
from einops import rearrange
from torch import Tensor

from tl_connwalk.core._fast.lru import memoized
from tl_connwalk.debug import on_device
from tl_connwalk.errors import ConnWalkError

#: The cost model of one range's product over a block of edges, in multiply-adds per edge:
#: a fixed cost per product and one per output row beside the ``rows x columns`` work
#: (one CPU thread, 4096 edges: 0.086 ms, 0.93 us per row, 0.1 us per multiply-add per edge).
PRODUCT_COST = 860
ROW_COST = 9

#: The fixed cost of a product on a GPU, in the same multiply-adds per edge, an estimate: a
#: kernel launch (~10 us of host and launch latency, ~2.5e8 multiply-adds of float32 work
#: there) over the ~10^4 edges of a block of many stacked wide layers
#: (`tl_connwalk.core._fast.chunks.edge_block`; fewer or narrower layers take larger blocks,
#: where a launch costs less per edge). Fewer, larger products: for ``H = 32`` and nine
#: families 7 ranges instead of 28 (65261 multiply-adds per family and edge instead of
#: 53350), for ``H = 12`` 2 instead of 5.
DEVICE_PRODUCT_COST = 20000


def head_pairs(n_heads: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """The unordered head pairs ``{a, c}``, ``a <= c``, as index tensors ``(first, second)``,
    first index major: ``(0, 0), (0, 1), ..., (0, H - 1), (1, 1), ...``."""
    first, second = torch.triu_indices(n_heads, n_heads, device=device)
    return first, second


def _suffix_start(n_heads: int, b: int) -> int:
    """Position of the pair ``(b, b)`` in `head_pairs` order: the pairs with first index ``< b``."""
    return b * n_heads - b * (b - 1) // 2


class _Range(NamedTuple):
    """Row pairs with second index in ``[b0, b1)`` against the column pairs from ``(b0, b0)``.

    ``transposed``: the product runs the other way round (coefficients transposed, times the
    row pairs' products), so that it outputs one row per *column* pair, the fewer here.
    """

    b0: int
    b1: int
    transposed: bool

    def row_pairs(self) -> slice:
        """The range's row pairs, as positions in `_layout`'s ``rows`` order."""
        return slice(self.b0 * (self.b0 + 1) // 2, self.b1 * (self.b1 + 1) // 2)


def _ranges(n_heads: int, families: int, device: torch.device | None = None) -> tuple[_Range, ...]:
    """`_cheapest_ranges` under the current ``PRODUCT_COST`` (``DEVICE_PRODUCT_COST`` for work
    on a GPU, `on_device`) and ``ROW_COST``."""
    product_cost = DEVICE_PRODUCT_COST if on_device(device) else PRODUCT_COST
    return _cheapest_ranges(n_heads, families, product_cost, ROW_COST)


@memoized("core.quartic.ranges", maxsize=16)
def _cheapest_ranges(
    n_heads: int, families: int, product_cost: int, row_cost: int
) -> tuple[_Range, ...]:
    """The ranges of second indices, and their orientations, that minimise the cost model.

    A range ``[b0, b1)`` has ``b1 (b1 + 1) / 2 - b0 (b0 + 1) / 2`` row pairs (plus the ``k``
    row in the first, which is never transposed) and ``P - suffix_start(b0)`` column pairs;
    its product outputs ``families`` rows per row pair, or per column pair when transposed.
    Dynamic programming over the cut points, ``O(H^2)``.
    """
    n_pairs = n_heads * (n_heads + 1) // 2

    def cost(b0: int, b1: int) -> tuple[int, bool]:
        rows = b1 * (b1 + 1) // 2 - b0 * (b0 + 1) // 2 + (b0 == 0)
        columns = n_pairs - _suffix_start(n_heads, b0)
        options = [(rows, False)] if b0 == 0 else [(rows, False), (columns, True)]
        return min(
            (product_cost + families * (rows * columns + row_cost * outputs), transposed)
            for outputs, transposed in options
        )

    best, cut = [0] + [0] * n_heads, [0] * (n_heads + 1)
    for b1 in range(1, n_heads + 1):
        best[b1], cut[b1] = min((best[b0] + cost(b0, b1)[0], b0) for b0 in range(b1))
    ranges, b1 = [], n_heads
    while b1 > 0:
        b0 = cut[b1]
        ranges.append(_Range(b0, b1, cost(b0, b1)[1]))
        b1 = b0
    return tuple(reversed(ranges))


@memoized("core.quartic.layout", maxsize=8)
def _layout(n_heads: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Index tensors of the monomial coefficients, made once per head count and device.

    ``(rows, source, target)``: ``rows`` lists the pairs by second index (``(0, 0), (0, 1),
    (1, 1), (0, 2), ...``) as positions in `head_pairs` order; entry ``source`` of the
    flattened ``F`` (``p P + q``) adds to entry ``target`` of the flattened coefficients
    (row pair ``p``, column pair ``q`` of the monomial's sorted indices ``(m0, m1) (m2, m3)``).
    """
    first, second = head_pairs(n_heads)
    n_pairs = first.numel()
    position = torch.zeros(n_heads, n_heads, dtype=torch.long)
    position[first, second] = torch.arange(n_pairs)
    rows = position[
        torch.cat([torch.arange(b + 1) for b in range(n_heads)]),
        torch.cat([torch.full((b + 1,), b) for b in range(n_heads)]),
    ]
    p, q = (t.reshape(-1) for t in torch.meshgrid(torch.arange(n_pairs), torch.arange(n_pairs),
                                                  indexing="ij"))  # fmt: skip
    heads = torch.stack([first[p], second[p], first[q], second[q]], dim=-1).sort(-1).values
    target = position[heads[:, 0], heads[:, 1]] * n_pairs + position[heads[:, 2], heads[:, 3]]
    return rows.to(device), (p * n_pairs + q).to(device), target.to(device)


@dataclasses.dataclass(frozen=True)
class QuarticRows:
    """Several families' ``K2`` and folded ``K4`` as the coefficient blocks of `forms`.

    ``blocks[k]`` holds, for the ``k``-th range of ``ranges``, the monomial coefficients of
    its row pairs against the column pairs from ``(b0, b0)`` on, rows ``(pair family)``-major,
    or their transpose (one row per column pair) where the range is ``transposed``; the first
    block starts with one row per family of ``k`` (``k_{ac} = K2[a,c] + K2[c,a]``, ``K2[a,a]``
    on the diagonal), so the same product gives ``s2 = k . u``. Each block has a leading
    axis of ``stack`` entries: stacked problems (layers, say) with gates of their own, every
    entry's products in one batched product; ``stacked`` says whether the Grams came with
    that axis (else it has one entry).

    ``gathered`` lists the pair products `forms` gathers in one pass: first the
    ``n_multipliers`` pairs whose products multiply the output rows after ``s2`` (a normal
    range's row pairs, a transposed range's column pairs), then each transposed range's row
    pairs, the factor of its product (at ``inputs[k]``; ``None`` for a normal range, whose
    factor is the column suffix of ``u`` itself). ``pairs`` holds the heads ``(a, c)`` of the
    pair products ``u``, in `head_pairs` order; ``buffers``, `forms`' buffers, which its next
    call reuses.
    """

    blocks: tuple[Tensor, ...]
    ranges: tuple[_Range, ...]
    gathered: Tensor
    inputs: tuple[slice | None, ...]
    n_multipliers: int
    families: int
    n_heads: int
    stack: int
    stacked: bool
    pairs: tuple[Tensor, Tensor]
    buffers: list["_Buffers"] = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def outputs(self) -> int:
        """Products per family and edge in `forms`' buffer: ``s2``, then one per output row."""
        return 1 + self.n_multipliers


def quartic_rows(K2: Tensor, pair_gram: Tensor) -> QuarticRows:
    """`QuarticRows` of ``K2`` ``[family, H, H]`` and ``pair_gram = fold_pairs(K4)``
    ``[family, P, P]`` (any square ``F``: only ``(F + F^T) / 2`` counts in ``u^T F u``), or of
    several stacked problems' ``[stack, family, H, H]`` and ``[stack, family, P, P]``."""
    stacked = K2.ndim == 4
    if not stacked:
        K2, pair_gram = K2[None], pair_gram[None]
    stack, families, n_heads, n_pairs = *K2.shape[:2], K2.shape[-1], pair_gram.shape[-1]
    rows, source, target = _layout(n_heads, K2.device)
    coefficients = pair_gram.new_zeros(stack, families, n_pairs * n_pairs)
    coefficients.index_add_(2, target, pair_gram.reshape(stack, families, -1)[..., source])
    coefficients = coefficients.view(stack, families, n_pairs, n_pairs)
    first, second = head_pairs(n_heads, K2.device)
    k = torch.where(
        first == second, K2[..., first, second], K2[..., first, second] + K2[..., second, first]
    )
    ranges = _ranges(n_heads, families, K2.device)
    blocks, multipliers = [], []
    factors: list[Tensor | None] = []  # a transposed range's row pairs: its product's factor
    for part in ranges:
        suffix = _suffix_start(n_heads, part.b0)
        row_pairs = rows[part.row_pairs()]
        block = coefficients[..., row_pairs, suffix:]
        if part.transposed:
            blocks.append(rearrange(block, "s family p q -> s (q family) p").contiguous())
            multipliers.append(torch.arange(suffix, n_pairs, device=K2.device))
            factors.append(row_pairs)
            continue
        if part.b0 == 0:
            block = torch.cat([k[..., None, :], block], dim=2)
        blocks.append(rearrange(block, "s family p q -> s (p family) q").contiguous())
        multipliers.append(row_pairs)
        factors.append(None)
    n_multipliers = sum(m.numel() for m in multipliers)
    inputs, at = [], n_multipliers
    for factor in factors:
        inputs.append(None if factor is None else slice(at, at + factor.numel()))
        at += 0 if factor is None else factor.numel()
    gathered = torch.cat(multipliers + [f for f in factors if f is not None])
    return QuarticRows(
        tuple(blocks), ranges, gathered, tuple(inputs), n_multipliers, families, n_heads, stack,
        stacked, (first, second),
    )  # fmt: skip


def forms(g: Tensor, rows: QuarticRows, step: int) -> tuple[Tensor, Tensor]:
    """``s4 = u^T F u`` and ``s2 = g^T K2 g`` of each family on every edge: two
    ``[family, edge]``, from the gates ``g`` ``[head, edge]``, ``step`` edges at a time; for
    stacked `QuarticRows`, two ``[stack, family, edge]`` from ``[stack, head, edge]``.

    Per block of edges: the pair products ``u`` (`head_pairs` order), one gather of the
    products `QuarticRows.gathered` lists, one (batched) matrix product per range (times the
    column pairs' products, or the row pairs' where transposed) into one ``[stack, outputs,
    family, edge]`` buffer (slot 0: ``s2``), then one multiply-and-sum by the multipliers'
    products into ``s4``: ``10 + ranges`` operations. The buffers are kept on ``rows``
    (`_Buffers`) for its next call, with their views at each block size. On a GPU
    (`on_device`) the last block is a whole one that ends at the last edge (its overlap with
    the block before is computed twice), so that every block has one size.
    """
    if (
        g.ndim != (3 if rows.stacked else 2)
        or (rows.stacked and g.shape[0] != rows.stack)
        or g.shape[-2] != rows.n_heads
    ):
        raise ConnWalkError(
            f"gates {tuple(g.shape)} must be [head, edge], or [stack, head, edge] with "
            f"{rows.stack} stacked problems for stacked Grams, with the Grams' {rows.n_heads} "
            "heads."
        )
    if not rows.stacked:
        g = g[None]
    stack, _, n_edges = g.shape
    s4, s2 = g.new_empty(stack, rows.families, n_edges), g.new_empty(stack, rows.families, n_edges)
    first, second = rows.pairs
    size = min(step, n_edges)
    buffers = _Buffers.kept(rows, g, size)  # kept on rows, which they do not refer back to
    starts = list(range(0, n_edges, max(1, size)))
    if starts and on_device(g.device):
        starts[-1] = n_edges - size
    for start in starts:
        block = g[..., start : start + size]
        views = buffers.at(rows, block.shape[-1])
        # u_{ac} = g^a g^c for c >= a, in `head_pairs` order: every pair in one product
        torch.mul(block.index_select(1, first), block.index_select(1, second), out=views.u)
        torch.index_select(views.u, 1, rows.gathered, out=views.gathered)
        for coefficients, factor, out in zip(rows.blocks, views.inputs, views.outputs, strict=True):
            torch.bmm(coefficients, factor, out=out)
        s2[..., start : start + views.size] = views.s2
        torch.sum(views.rest.mul_(views.multipliers), 1, out=s4[..., start : start + views.size])
    return (s4, s2) if rows.stacked else (s4[0], s2[0])


class _Buffers:
    """`forms`' flat buffers for blocks of up to ``capacity`` edges of one `QuarticRows`, and
    their views at the block sizes in use (the largest and the last other one)."""

    def __init__(self, rows: QuarticRows, g: Tensor, capacity: int) -> None:
        n_pairs = rows.n_heads * (rows.n_heads + 1) // 2
        self.capacity = capacity
        self.pairs = g.new_empty(rows.stack * (n_pairs + rows.gathered.numel()) * capacity)
        self.products = g.new_empty(rows.stack * rows.outputs * rows.families * capacity)
        self.views: dict[int, _BlockViews] = {}

    @classmethod
    def kept(cls, rows: QuarticRows, g: Tensor, size: int) -> "_Buffers":
        """The buffers ``rows`` keeps when they hold ``size`` edges of gates like ``g`` (dtype
        and device), else new ones, kept in their place."""
        if rows.buffers:
            buffers = rows.buffers[0]
            pairs = buffers.pairs
            if buffers.capacity >= size and (pairs.dtype, pairs.device) == (g.dtype, g.device):
                return buffers
        rows.buffers.clear()  # the old ones freed before the new ones are made
        rows.buffers.append(cls(rows, g, size))
        return rows.buffers[0]

    def at(self, rows: QuarticRows, size: int) -> "_BlockViews":
        """The buffers viewed at blocks of ``size`` edges of ``rows`` (made on first use)."""
        if size not in self.views:
            if len(self.views) > 1:  # keep the largest: every call's whole blocks
                largest = max(self.views)
                self.views = {largest: self.views[largest]}
            self.views[size] = _BlockViews.of(rows, self.pairs, self.products, size)
        return self.views[size]


@dataclasses.dataclass(frozen=True)
class _BlockViews:
    """`forms`' buffers viewed at one block size: the pair products ``u`` and the gathered
    ones, each range's factor (``inputs``) and output rows (``outputs``), and the output
    buffer's ``s2`` slot, its other rows (``rest``) and their ``multipliers``."""

    size: int
    u: Tensor
    gathered: Tensor
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    s2: Tensor
    rest: Tensor
    multipliers: Tensor

    @classmethod
    def of(cls, rows: QuarticRows, pairs: Tensor, products: Tensor, size: int) -> "_BlockViews":
        stack, families, n_heads = rows.stack, rows.families, rows.n_heads
        n_pairs, n_gathered = n_heads * (n_heads + 1) // 2, rows.gathered.numel()
        u = pairs[: stack * n_pairs * size].view(stack, n_pairs, size)
        gathered = pairs[stack * n_pairs * size : stack * (n_pairs + n_gathered) * size]
        gathered = gathered.view(stack, n_gathered, size)
        mixed = products[: stack * rows.outputs * families * size].view(
            stack, rows.outputs, families, size
        )
        inputs, outputs, at = [], [], 0
        for part, coefficients, taken in zip(rows.ranges, rows.blocks, rows.inputs, strict=True):
            inputs.append(
                u[:, _suffix_start(n_heads, part.b0) :] if taken is None else gathered[:, taken]
            )
            height = coefficients.shape[1] // families
            outputs.append(mixed[:, at : at + height].view(stack, -1, size))
            at += height
        return cls(
            size, u, gathered, tuple(inputs), tuple(outputs), mixed[:, 0], mixed[:, 1:],
            gathered[:, : rows.n_multipliers, None],
        )  # fmt: skip
