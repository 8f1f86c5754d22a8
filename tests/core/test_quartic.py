"""The per-edge forms by monomials (`tl_connwalk.core._fast.quartic`).

References: ``u^T F u`` and ``g^T K2 g`` evaluated directly in float64 on every edge; the
cost model's ranges against every set of cut points.
"""

import gc
import itertools
import math
import weakref
from contextlib import nullcontext

import pytest
import torch

from tests.tolerances import assert_close
from tl_connwalk import debug
from tl_connwalk.core._fast import quartic

F64 = torch.float64


def direct_forms(g, K2, pair_gram):
    """``u^T F u`` and ``g^T K2 g`` per family and edge, from the dense ``F`` and ``K2``."""
    first, second = quartic.head_pairs(g.shape[0])
    u = g[first] * g[second]  # [pair, edge]
    s4 = torch.einsum("pe,fpq,qe->fe", u, pair_gram, u)
    s2 = torch.einsum("ae,fab,be->fe", g, K2, g)
    return s4, s2


@pytest.mark.parametrize("n_heads", [1, 2, 3, 5, 12])
@pytest.mark.parametrize("product_cost", [0, 860, 10**9])
@pytest.mark.parametrize("row_cost", [0, 9, 10**6])
def test_forms_equal_the_dense_quadratic_forms(n_heads, product_cost, row_cost, monkeypatch):
    # product_cost 0: a range per second index; 1e9: one range for all; 860: the default;
    # row_cost 0: no range transposed; 1e6: every range with fewer columns than rows is
    monkeypatch.setattr(quartic, "PRODUCT_COST", product_cost)
    monkeypatch.setattr(quartic, "ROW_COST", row_cost)
    generator = torch.Generator().manual_seed(n_heads)
    n_pairs, families, n_edges = n_heads * (n_heads + 1) // 2, 3, 37
    K2 = torch.randn(families, n_heads, n_heads, generator=generator, dtype=F64)
    # F need not be symmetric: only (F + F^T) / 2 counts
    pair_gram = torch.randn(families, n_pairs, n_pairs, generator=generator, dtype=F64)
    g = torch.rand(n_heads, n_edges, generator=generator, dtype=F64)
    rows = quartic.quartic_rows(K2, pair_gram)
    if product_cost == 0 and row_cost == 0 and n_heads > 1:
        assert len(rows.ranges) == n_heads
    if product_cost == 10**9:
        assert [(part.b0, part.b1) for part in rows.ranges] == [(0, n_heads)]
    if row_cost == 0:
        assert not any(part.transposed for part in rows.ranges)
    if row_cost == 10**6 and product_cost == 0 and n_heads >= 5:
        assert rows.ranges[-1].transposed
    # one block, several with a partial last one (on a GPU a whole one, overlapping the one
    # before), another call at that block size (the buffers of the one before) on other
    # gates, fewer edges than the buffers hold
    cases = ((n_edges, g), (8, g), (8, g.flip(1)), (n_edges + 5, g[:, :3]), (8, g))
    for (step, gates), budgets in itertools.product(cases, (nullcontext, debug.device_budgets)):
        expected = direct_forms(gates, K2, pair_gram)
        with budgets():
            got = quartic.forms(gates, rows, step)
        for value, want in zip(got, expected, strict=True):
            assert_close(value, want, terms=n_heads**4)  # sums over head quadruples


@pytest.mark.parametrize("n_heads", [1, 3, 6])
def test_each_monomial_has_one_coefficient(n_heads):
    # F of ones: every monomial g^a g^b g^c g^e (a <= b <= c <= e) gets one non-zero
    # coefficient (the number of pair products that give it), nothing else is non-zero
    n_pairs = n_heads * (n_heads + 1) // 2
    rows = quartic.quartic_rows(
        torch.zeros(1, n_heads, n_heads, dtype=F64), torch.ones(1, n_pairs, n_pairs, dtype=F64)
    )
    nonzero = sum(int((block != 0).sum()) for block in rows.blocks)
    assert nonzero == math.comb(n_heads + 3, 4)
    assert sum(block.sum() for block in rows.blocks) == n_pairs**2


def sizes(n_heads, b0, b1):
    """Row pairs (with the k row in the first range) and column pairs of a range."""
    n_pairs = n_heads * (n_heads + 1) // 2
    rows = b1 * (b1 + 1) // 2 - b0 * (b0 + 1) // 2 + (b0 == 0)
    return rows, n_pairs - sum(n_heads - a for a in range(b0))


@pytest.mark.parametrize("n_heads", [1, 2, 4, 7])
@pytest.mark.parametrize("families", [1, 3])
def test_ranges_are_the_cheapest_cuts_and_orientations(n_heads, families):
    def cost(b0, b1, transposed):
        rows, columns = sizes(n_heads, b0, b1)
        outputs = columns if transposed else rows
        return quartic.PRODUCT_COST + families * (rows * columns + quartic.ROW_COST * outputs)

    def best_cost(b0, b1):  # the first range keeps its k row: never transposed
        return min(cost(b0, b1, t) for t in ((False,) if b0 == 0 else (False, True)))

    def total(cuts):
        bounds = (0, *cuts, n_heads)
        return sum(best_cost(b0, b1) for b0, b1 in itertools.pairwise(bounds))

    best = min(
        total(cuts)
        for size in range(n_heads)
        for cuts in itertools.combinations(range(1, n_heads), size)
    )
    ranges = quartic._ranges(n_heads, families)
    assert ranges[0].b0 == 0 and ranges[-1].b1 == n_heads and not ranges[0].transposed
    assert all(a.b1 == b.b0 for a, b in itertools.pairwise(ranges))
    assert sum(cost(*part) for part in ranges) == best


def test_fewer_products_than_the_triangle_for_many_heads():
    # GPT-2 small (12 heads) and Llama-3-8B (32) with two draws: the multiply-adds per family
    # and edge against the upper triangle of F (plus the k row)
    for n_heads, bound in ((12, 2300), (32, 60000)):
        n_pairs = n_heads * (n_heads + 1) // 2
        ranges = quartic._ranges(n_heads, 3)
        work = sum(math.prod(sizes(n_heads, part.b0, part.b1)) for part in ranges)
        assert work <= bound < n_pairs * (n_pairs + 1) // 2
        # the products' outputs: fewer than one per pair where ranges run transposed
        zeros = torch.zeros(3, n_heads, n_heads), torch.zeros(3, n_pairs, n_pairs)
        assert quartic.quartic_rows(*zeros).outputs < 1 + n_pairs


def test_a_gpu_takes_fewer_larger_products():
    """On a GPU a product costs a kernel launch: its ranges come from ``DEVICE_PRODUCT_COST``,
    on any device inside `device_budgets`, and give the same forms."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device names: nothing allocated
    for n_heads, families, most in ((12, 9, 2), (32, 9, 7)):
        on_gpu = quartic._ranges(n_heads, families, cuda)
        assert on_gpu == quartic._cheapest_ranges(
            n_heads, families, quartic.DEVICE_PRODUCT_COST, quartic.ROW_COST
        )
        assert len(on_gpu) <= most < len(quartic._ranges(n_heads, families, cpu))
        with debug.device_budgets():
            assert quartic._ranges(n_heads, families, cpu) == on_gpu
    generator = torch.Generator().manual_seed(0)
    K2 = torch.randn(9, 12, 12, generator=generator, dtype=F64)
    pair_gram = torch.randn(9, 78, 78, generator=generator, dtype=F64)
    g = torch.rand(12, 37, generator=generator, dtype=F64)
    with debug.device_budgets():
        rows = quartic.quartic_rows(K2, pair_gram)
    assert len(rows.ranges) < len(quartic.quartic_rows(K2, pair_gram).ranges)
    for got, want in zip(quartic.forms(g, rows, 8), direct_forms(g, K2, pair_gram), strict=True):
        assert_close(got, want, terms=12**4)


def test_the_kept_buffers_go_with_their_rows():
    """`forms` keeps its buffers on the `QuarticRows` for the next call; they hold no
    reference back to the rows, so they are freed with them, without waiting for the cycle
    collector."""
    n_heads, n_pairs = 3, 6
    rows = quartic.quartic_rows(torch.rand(2, n_heads, n_heads), torch.rand(2, n_pairs, n_pairs))
    quartic.forms(torch.rand(n_heads, 10), rows, 4)
    kept = weakref.ref(rows.buffers[0].products)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del rows
        assert kept() is None
    finally:
        if enabled:
            gc.enable()
