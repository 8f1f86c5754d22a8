"""Padding read off a walk, checked masks, and the one edge mask of a measurement.

References: walks built by hand in the three shapes padding takes (TransformerLens's zero
rows, Hugging Face's uniform rows, an encoder's attended-from pads), and the Markov
measurements of a padded walk against those of its real block alone.
"""

import pytest
import torch

from tests.tolerances import assert_close
from tl_connwalk.core import markov, padding
from tl_connwalk.errors import ConnWalkError


def causal_walk(n: int, seed: int = 0) -> torch.Tensor:
    scores = torch.randn(1, n, n, generator=torch.Generator().manual_seed(seed))
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, -torch.inf), -1)


def left_padded(block: torch.Tensor, n_pad: int, pad_rows: str) -> torch.Tensor:
    """``block`` behind ``n_pad`` pads whose rows are zero or uniform over every key."""
    n = block.shape[-1] + n_pad
    walk = torch.zeros(1, n, n)
    walk[:, n_pad:, n_pad:] = block
    if pad_rows == "uniform":
        walk[:, :n_pad] = 1.0 / n
    return walk


@pytest.mark.parametrize("pad_rows", ["zero", "uniform"])
def test_left_padding_is_detected(pad_rows: str) -> None:
    walk = left_padded(causal_walk(4), 2, pad_rows)
    assert padding.detect_padding(walk).tolist() == [[False, False, True, True, True, True]]


def test_right_padding_and_encoder_padding_are_detected() -> None:
    walk = torch.zeros(1, 5, 5)
    walk[:, :3, :3] = causal_walk(3)
    walk[:, 3:, :3] = torch.softmax(torch.randn(2, 3), -1)  # pad queries read real keys
    assert padding.detect_padding(walk).tolist() == [[True, True, True, False, False]]
    encoder = torch.zeros(1, 5, 5)
    encoder[:, :, 2:] = torch.softmax(torch.randn(5, 3), -1)  # two left pads, bidirectional
    assert padding.detect_padding(encoder).tolist() == [[False, False, True, True, True]]


def test_no_padding_gives_none() -> None:
    assert padding.detect_padding(causal_walk(5)) is None
    # a block that only attends to itself is no padding: its queries attend somewhere
    assert padding.detect_padding(torch.eye(4)[None]) is None


def test_an_unattended_key_inside_a_sequence_asks_for_the_mask() -> None:
    walk = causal_walk(5)
    walk[:, :, 2] = 0.0
    with pytest.raises(ConnWalkError, match="key 2 of sequence 0 .* pass the attention_mask"):
        padding.detect_padding(walk)


def test_checked_mask() -> None:
    walk = left_padded(causal_walk(3), 2, "uniform")
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert padding.checked_mask(walk, mask).tolist() == [[False, False, True, True, True]]
    assert padding.checked_mask(walk, torch.ones(1, 5)) is None
    with pytest.raises(ConnWalkError, match="padding, but the real query 0"):
        padding.checked_mask(walk, torch.tensor([[1, 1, 0, 1, 1]]))
    with pytest.raises(ConnWalkError, match="no real position in sequence 0"):
        padding.checked_mask(walk, torch.zeros(1, 5))


def _same_positions(got, expected) -> bool:
    return all(
        (g is None and e is None) or (g is not None and e is not None and torch.equal(g, e))
        for g, e in zip(got, expected, strict=True)
    )


def test_positions_of_walks_are_those_of_each_walk_alone() -> None:
    """Several layers' walks read at once: left-, right-, un-padded and uniform pad rows, each
    walk's positions those `positions_of` reads off it alone, with and without a mask."""
    batch = [
        torch.cat([left_padded(causal_walk(4, seed), 2, rows), causal_walk(6, seed)[None, 0]])
        for seed, rows in enumerate(["zero", "uniform", "zero"])
    ]
    right = torch.zeros(2, 6, 6)
    right[:, :4, :4] = causal_walk(4, 7)
    walks = [*batch, torch.cat([causal_walk(6, 3), causal_walk(6, 4)]), right]
    assert _same_positions(
        padding.positions_of_walks(walks, None), [padding.positions_of(w, None) for w in walks]
    )
    got = padding.positions_of_walks(walks[:3], None)
    assert got[0].tolist() == [[False, False, True, True, True, True], [True] * 6]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert _same_positions(
        padding.positions_of_walks(walks[:3], mask),
        [padding.positions_of(w, mask) for w in walks[:3]],
    )
    assert padding.positions_of_walks(walks[3:4], torch.ones(2, 6)) == [None]


def test_positions_of_walks_raise_the_error_of_the_first_walk_in_error() -> None:
    good, bad = causal_walk(5), causal_walk(5)
    bad[:, :, 2] = 0.0
    with pytest.raises(ConnWalkError, match="key 2 of sequence 0 .* pass the attention_mask"):
        padding.positions_of_walks([good, bad, good], None)
    leaky = left_padded(causal_walk(3), 2, "uniform")
    with pytest.raises(ConnWalkError, match="padding, but the real query 0"):
        padding.positions_of_walks([leaky, leaky], torch.tensor([[1, 1, 0, 1, 1]]))
    with pytest.raises(ConnWalkError, match="no real position in sequence 0"):
        padding.positions_of_walks([leaky, leaky], torch.zeros(1, 5))
    with pytest.raises(ConnWalkError, match="share one"):
        padding.positions_of_walks([good, causal_walk(4)], None)


def test_scope_is_one_mask() -> None:
    positions = torch.tensor([[False, True, True, True]])
    shape, cpu = torch.Size([1, 4, 4]), torch.device("cpu")
    mask, flag = padding.scope(positions, lambda q, k: k <= q, True, shape, cpu)
    expected = torch.zeros(1, 4, 4, dtype=torch.bool)
    expected[0, 2, 2] = expected[0, 3, 2] = expected[0, 3, 3] = True  # sink: position 1
    assert torch.equal(mask, expected) and flag is False
    # nothing restricted, or a mask of every edge: the unrestricted path
    assert padding.scope(None, None, True, shape, cpu) == (None, True)
    every = torch.ones(shape, dtype=torch.bool)
    assert padding.scope(None, every, False, shape, cpu) == (None, False)
    with pytest.raises(ConnWalkError, match="must be \\[batch, query, key\\]"):
        padding.scope(None, every[:, :2], False, shape, cpu)
    with pytest.raises(ConnWalkError, match="bool tensor or a function"):
        padding.scope(None, every.float(), False, shape, cpu)


@pytest.mark.parametrize("mu", ["stationary", "uniform", "teleport"])
@pytest.mark.parametrize("pad_rows", ["zero", "uniform"])
def test_markov_measurements_of_a_padded_walk_are_those_of_its_block(mu: str, pad_rows: str):
    scores = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(4))
    block = torch.softmax(scores, -1)  # irreducible: a stationary distribution exists
    walk = left_padded(block, 2, pad_rows)
    positions = padding.detect_padding(walk)
    padded = markov.reversibility_residual(walk, mu, positions=positions)  # type: ignore[arg-type]
    alone = markov.reversibility_residual(block, mu)  # type: ignore[arg-type]
    assert_close(padded.residual, alone.residual)
    assert_close(padded.mu[:, 2:], alone.mu)
    assert (padded.mu[:, :2] == 0).all() and padded.mu_kind == alone.mu_kind
    assert_close(
        markov.stochasticity_residual(walk, positions=positions),
        markov.stochasticity_residual(block),
    )
    given = torch.rand(1, 6, generator=torch.Generator().manual_seed(1))
    assert_close(
        markov.reversibility_residual(walk, given, positions=positions).residual,
        markov.reversibility_residual(block, given[:, 2:]).residual,
    )
