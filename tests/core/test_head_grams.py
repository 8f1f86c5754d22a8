"""The store of weight-only head terms: what it returns, when it hits, when it must miss.

Reference: `compute_head_grams`, i.e. `isometry.gram_matrices`, `isometry.fold_pairs` and
`isometry.head_transport_defects` on the same weights. A hit must return exactly (bit for
bit) what computing again returns, and any change of a value must miss.
"""

import pytest
import torch

from tests.core.problems import random_problem
from tl_connwalk.core import isometry as iso
from tl_connwalk.core._fast import head_grams
from tl_connwalk.walk import ConnectionWalk


@pytest.fixture(autouse=True)
def empty_store():
    head_grams.cache_clear()
    yield
    head_grams.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_terms_are_the_gram_tensors_and_head_defects(dtype):
    p = random_problem(heads=4, d_model=10, d_head=3, seed=3, dtype=dtype)
    terms = head_grams.head_grams(p.W_V, p.W_O)
    K2, K4 = iso.gram_matrices(p.W_V, p.W_O)
    torch.testing.assert_close(terms.K2, K2, rtol=0, atol=0)
    torch.testing.assert_close(terms.pair_gram, iso.fold_pairs(K4), rtol=0, atol=0)
    torch.testing.assert_close(terms.norms_sq, iso.head_norms_sq(p.W_V, p.W_O))
    torch.testing.assert_close(
        terms.head_defects, iso.head_transport_defects(p.W_V, p.W_O), rtol=0, atol=0
    )
    assert terms.K2.dtype == terms.pair_gram.dtype == dtype


def test_the_output_gram_rows_are_kept_for_narrow_layers_only(monkeypatch):
    p = random_problem(heads=4, d_model=10, d_head=3, seed=4)
    terms = head_grams.head_grams(p.W_V, p.W_O)
    outputs = p.W_O.flatten(0, 1)  # W_O^cat, [H d_head, d_model]
    gram = outputs @ outputs.T

    # head a: the blocks W_O^a W_O^b^T for b = a, a + 1, a + 2 (mod 4), as [d_head, 3 d_head]
    def block(a, b):
        return gram[3 * a : 3 * a + 3, 3 * b : 3 * b + 3]

    half_rows = torch.cat(
        [torch.cat([block(a, (a + k) % 4) for k in range(3)], 1).reshape(-1) for a in range(4)]
    )
    torch.testing.assert_close(terms.out_rows, half_rows)
    assert terms.out_rows.numel() == 3 * 3 * 4 * 3 < gram.numel()
    assert terms.nbytes == sum(t.nbytes for t in (terms.norms_sq, terms.K2, terms.pair_gram,
                                                  terms.head_defects, terms.out_rows))  # fmt: skip
    monkeypatch.setattr(head_grams, "OUT_GRAM_WIDTH", 11)  # H d_head = 12 is wider
    wide = head_grams.compute_head_grams(p.W_V, p.W_O)
    assert wide.out_rows is None
    assert torch.equal(wide.pair_gram, terms.pair_gram)
    assert wide.nbytes == terms.nbytes - terms.out_rows.nbytes


def test_equal_weights_hit_and_any_changed_value_misses():
    p = random_problem(seed=5)
    first = head_grams.head_grams(p.W_V, p.W_O)
    assert head_grams.head_grams(p.W_V.clone(), p.W_O.clone()) is first  # a copy: a hit
    changed_values = p.W_V.clone()
    changed_values.data[1, 2, 0] += 1e-12  # a .data edit bumps no version: the digest sees it
    assert head_grams.head_grams(changed_values, p.W_O) is not first
    assert head_grams.head_grams(p.W_V.float(), p.W_O.float()) is not first  # another dtype
    # the same bytes in another shape (heads merged) are other weights
    assert head_grams.weights_digest(p.W_V) != head_grams.weights_digest(p.W_V.reshape(1, -1, 3))
    info = head_grams.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 3, 3)
    expected = sum(t.nbytes for t in head_grams._STORE.entries.values())
    assert info.nbytes == expected > 0


def test_a_hit_returns_what_computing_again_returns():
    p = random_problem(seed=6, dtype=torch.float32)
    stored = head_grams.head_grams(p.W_V, p.W_O)
    head_grams.head_grams(p.W_V, p.W_O)
    again = head_grams.compute_head_grams(p.W_V, p.W_O)
    for name in ("norms_sq", "K2", "pair_gram", "head_defects", "out_rows"):
        assert torch.equal(getattr(stored, name), getattr(again, name)), name


def test_the_store_keeps_the_most_recently_used_within_its_bytes(monkeypatch):
    problems = [random_problem(seed=seed) for seed in range(3)]
    size = head_grams.compute_head_grams(problems[0].W_V, problems[0].W_O).nbytes
    monkeypatch.setattr(head_grams, "CACHE_BYTES", 2 * size)
    first, second, _ = (head_grams.head_grams(p.W_V, p.W_O) for p in problems[:2] + problems[:1])
    assert first is _  # the first was used again: the second is now the oldest
    head_grams.head_grams(problems[2].W_V, problems[2].W_O)  # evicts the second
    info = head_grams.cache_info()
    assert (info.currsize, info.nbytes) == (2, 2 * size)
    assert head_grams.head_grams(problems[0].W_V, problems[0].W_O) is first
    assert head_grams.head_grams(problems[1].W_V, problems[1].W_O) is not second
    monkeypatch.setattr(head_grams, "CACHE_BYTES", size - 1)  # an entry too large to keep
    head_grams.cache_clear()
    head_grams.head_grams(problems[0].W_V, problems[0].W_O)
    assert head_grams.cache_info().currsize == 0


def test_walks_of_other_tokens_share_the_layers_terms_and_results_do_not_change():
    """Two caches of one model (other patterns and fields): one computation, same results."""
    first, second = random_problem(seed=7), random_problem(seed=8)

    def residual(p, W_V, W_O):
        walk = ConnectionWalk.from_pattern(p.pattern, p.field, W_V, W_O)
        return walk.laplacian_residual(baseline_draws=2).to_dict()

    stored = [residual(p, first.W_V, first.W_O) for p in (first, second)]
    info = head_grams.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    head_grams.cache_clear()
    fresh = residual(second, first.W_V, first.W_O)
    assert stored[1] == fresh
    assert stored[0] != stored[1]
