"""Chan's merge of running moments against numpy's weighted mean and variance of all the data."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tolerances import rtol
from tl_connwalk.core.moments import Moments


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    cut=st.integers(0, 12),
    seed=st.integers(0, 2**16),
)
def test_any_grouping_gives_the_weighted_moments_of_all(weights, cut, seed):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(len(weights), 3, 2)) * rng.uniform(0.1, 100.0)
    w = np.asarray(weights, dtype=float)
    parts = [Moments.of(torch.tensor(v), weight) for v, weight in zip(values, weights, strict=True)]
    # sequential (one process) and two groups merged at the end (two ranks)
    sequential = parts[0]
    for part in parts[1:]:
        sequential = sequential.merge(part)
    cut = min(cut, len(parts) - 1) or 1
    grouped = parts[0]
    for part in parts[1:cut]:
        grouped = grouped.merge(part)
    if cut < len(parts):
        rest = parts[cut]
        for part in parts[cut + 1 :]:
            rest = rest.merge(part)
        grouped = grouped.merge(rest)
    mean = np.average(values, axis=0, weights=w)
    std = np.sqrt(np.average((values - mean) ** 2, axis=0, weights=w))
    scale = np.abs(values).max()
    for summary in (sequential, grouped):
        assert summary.count == w.sum()
        # merges of up to 12 parts, each a few float64 operations
        tol = rtol(torch.float64, len(weights))
        np.testing.assert_allclose(summary.mean.numpy(), mean, rtol=tol, atol=tol * scale)
        np.testing.assert_allclose(summary.std.numpy(), std, rtol=tol, atol=tol * scale)


def test_nan_cells_stay_nan_and_others_are_unaffected():
    a = Moments.of(torch.tensor([1.0, float("nan")]), 2)
    b = Moments.of(torch.tensor([4.0, float("nan")]), 1)
    merged = a.merge(b)
    assert merged.mean[0].item() == 2.0 and torch.isnan(merged.mean[1])
    # std = sqrt(M2 / n), M2 = 6: a division and a square root, each rounded
    assert abs(merged.std[0].item() - np.sqrt(2.0)) <= rtol(torch.float64, 2) * np.sqrt(2.0)
    assert torch.isnan(merged.std[1])


def test_per_cell_counts_merge_to_the_weighted_moments_and_empty_cells_stay_empty():
    rng = np.random.default_rng(3)
    values = rng.normal(size=(2, 3, 10))
    weights = rng.uniform(size=(2, 3, 10))
    weights[1, 2] = 0.0  # a cell without weight in every chunk
    weights[0, 1, :5] = 0.0  # a cell without weight in the first chunk only
    chunks = [
        Moments.of_weighted(torch.tensor(values[..., s]), torch.tensor(weights[..., s]))
        for s in (slice(0, 5), slice(5, 10))
    ]
    empty = torch.zeros(2, 3, dtype=torch.float64)
    merged = Moments(count=0.0, mean=empty, m2=empty).merge(chunks[0]).merge(chunks[1])
    at_once = Moments.merged([Moments(count=empty, mean=empty, m2=empty), *chunks])
    full = weights.sum(-1) > 0
    mean = np.where(full, (weights * values).sum(-1) / np.where(full, weights.sum(-1), 1), 0)
    var = (weights * (values - mean[..., None]) ** 2).sum(-1) / np.where(full, weights.sum(-1), 1)
    tol = rtol(torch.float64, values.shape[-1])
    for summary in (merged, at_once):
        np.testing.assert_allclose(summary.mean.numpy(), mean, rtol=tol, atol=tol)
        np.testing.assert_allclose(summary.std.numpy(), np.sqrt(var), rtol=tol, atol=tol)
        assert summary.mean[1, 2] == 0 and summary.std[1, 2] == 0


@settings(max_examples=40, deadline=None)
@given(
    value=st.floats(-1e6, 1e6, allow_nan=False).filter(lambda v: v != 0),
    weights=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=20),
    cut=st.integers(1, 19),
)
def test_equal_values_have_exactly_zero_spread(value, weights, cut):
    """Centred on an observation, equal values give their value as the mean and ``M2 = 0``,
    also merged from two chunks; a plain ``sum w x / n`` rounds to a neighbour of the value."""
    w = torch.tensor(weights, dtype=torch.float64)[None]
    values = torch.full_like(w, value)
    cut = min(cut, w.shape[1] - 1)
    whole = Moments.of_weighted(values, w)
    parts = [Moments.of_weighted(values[:, :cut], w[:, :cut])]
    parts.append(Moments.of_weighted(values[:, cut:], w[:, cut:]))
    merged = parts[0].merge(parts[1])
    for summary in (whole, merged, Moments.merged(parts)):
        if w.sum() > 0:
            assert summary.mean.item() == value
        assert summary.m2.item() == 0 and summary.std.item() == 0 and summary.cv.item() == 0
