"""The report's own baselines: reversibility beside the uniform walk on the same edges, the
pairing beside random transports."""

import math

import torch

from tl_connwalk import ConnectionWalk
from tl_connwalk.core import markov
from tl_connwalk.report.measure import pairing_baseline, uniform_reversibility


def walk_of(scores: torch.Tensor, attention_mask: torch.Tensor | None = None) -> ConnectionWalk:
    """A walk of 2 heads with the given attention scores (``-inf``: no edge)."""
    generator = torch.Generator().manual_seed(0)
    batch, n_heads, n_pos, _ = scores.shape
    return ConnectionWalk.from_pattern(
        scores.softmax(-1),
        torch.randn(batch, n_pos, 8, generator=generator),
        torch.randn(n_heads, 8, 4, generator=generator),
        torch.randn(n_heads, 4, 8, generator=generator),
        attention_mask=attention_mask,
    )


def causal(batch: int, n_pos: int) -> torch.Tensor:
    scores = torch.randn(batch, 2, n_pos, n_pos, generator=torch.Generator().manual_seed(1))
    return scores.masked_fill(torch.ones(n_pos, n_pos).triu(1).bool(), -torch.inf)


def test_two_causal_positions_by_hand():
    """U = [[1, 0], [1/2, 1/2]], mu uniform (reducible): ||M - M^T|| / ||M + M^T|| = 1/sqrt(11)."""
    got = uniform_reversibility(walk_of(causal(1, 2)))
    torch.testing.assert_close(got, torch.tensor([1 / math.sqrt(11)]))


def test_it_reads_the_edges_only():
    """Any two walks on the same edges have one baseline; the walk's own residual differs."""
    first, second = walk_of(causal(1, 6)), walk_of(causal(1, 6) * 3.0)
    assert torch.equal(uniform_reversibility(first), uniform_reversibility(second))
    own = markov.reversibility_residual(first.walk).residual
    assert not torch.allclose(own, uniform_reversibility(first))


def test_every_pair_of_positions_is_reversible():
    full = walk_of(torch.randn(2, 2, 5, 5, generator=torch.Generator().manual_seed(2)))
    # U is symmetric and its stationary mu uniform, up to the rounding of mu's float64 solve
    assert uniform_reversibility(full).max() <= 5 * torch.finfo(torch.float64).eps


def test_padding_is_left_out():
    """A sequence padded at the end has the baseline of the same sequence alone."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    padded = uniform_reversibility(walk_of(causal(1, 6), attention_mask=mask))
    torch.testing.assert_close(padded, uniform_reversibility(walk_of(causal(1, 4))))


def test_pairing_baseline_is_seeded_random_transports_on_the_walk():
    walk = walk_of(torch.randn(2, 2, 5, 5, generator=torch.Generator().manual_seed(3)))
    base = pairing_baseline(walk, exclude_sink=False, draws=3, seed=7)
    assert base.draws.shape == (3, 2) and bool((base.draws > 0).all())
    again = pairing_baseline(walk, exclude_sink=False, draws=3, seed=7)
    assert torch.equal(base.draws, again.draws)
    other = pairing_baseline(walk, exclude_sink=False, draws=3, seed=8)
    assert not torch.equal(base.draws, other.draws)
    without_sink = pairing_baseline(walk, exclude_sink=True, draws=3, seed=7)
    assert not torch.allclose(base.draws, without_sink.draws)
