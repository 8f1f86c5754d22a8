"""Scoped measurements: edge masks, head subsets, and no transport on a non-edge.

References: a mask of every edge and the full head set give the unscoped numbers exactly; a
real subset of heads or edges is measured against a walk built here from the chosen heads'
cached patterns and the model's own OV weights by `tl_connwalk.core.reference` (one dense map
and one SVD per edge).
"""

from typing import Any

import pytest
import torch
from einops import einsum

import tl_connwalk
from tests.architectures import HAS_HOOKED, bridge_tokens
from tests.architectures import tokens as hooked_tokens
from tests.tolerances import cancelling_atol, rtol
from tl_connwalk import ConnWalkError
from tl_connwalk.core import reference as ref

HEADS = [0, 2]


def cache_of(model: Any) -> Any:
    toks = hooked_tokens(batch=2, pos=8) if HAS_HOOKED else bridge_tokens(2, 8)
    return model.run_with_cache(toks)[1]


def test_every_edge_and_every_head_reproduce_the_unscoped_numbers(gpt2: Any) -> None:
    cache = cache_of(gpt2)
    walk = tl_connwalk.connection_walk(cache, 1)
    every = torch.ones_like(walk.walk, dtype=torch.bool)
    all_heads = list(range(walk.n_heads))[::-1]
    for exclude_sink in (False, True):
        options = dict(exclude_sink=exclude_sink, baseline_draws=2, mass_share=0.9)
        plain = walk.laplacian_residual(**options).to_dict()
        for scoped in (
            walk.laplacian_residual(edges=every, **options),
            walk.laplacian_residual(edges=lambda q, k: k >= 0, **options),
            walk.laplacian_residual(heads=all_heads, **options),
        ):
            record = scoped.to_dict()
            for key in ("edges_masked", "heads"):
                record.pop(key), plain.pop(key, None)
            assert record == plain
        assert torch.equal(
            tl_connwalk.layer_drift(cache, exclude_sink=exclude_sink, edges=every),
            tl_connwalk.layer_drift(cache, exclude_sink=exclude_sink),
        )
    assert torch.equal(walk.isometry_defects(edges=every), walk.isometry_defects())
    assert walk.of_heads(all_heads) is walk


def reference_subset(walk: Any, pattern: torch.Tensor, heads: list[int], edges: torch.Tensor):
    """Walk-weighted eps and scale of the chosen heads' own walk on ``edges``, and the per-edge
    eps, from `tl_connwalk.core.reference` (an SVD per edge)."""
    A = pattern[:, heads]
    W, g, V, W_o = ref.walk(A), ref.gates(A), walk.W_V[heads], walk.W_O[heads]
    return (
        ref.effective_defect(W, g, V, W_o, keep=edges),
        ref.common_scale(W, g, V, W_o, keep=edges),
        ref.edge_defects(g, V, W_o, ref.transport_rank(V)),
    )


@pytest.mark.parametrize("masked", [False, True])
def test_a_head_subset_and_an_edge_mask_against_a_walk_built_from_those_heads(
    gpt2: Any, masked: bool
) -> None:
    cache = cache_of(gpt2)
    walk = tl_connwalk.connection_walk(cache, 1)
    pattern = cache["blocks.1.attn.hook_pattern"]
    n = walk.walk.shape[-1]
    previous = torch.arange(n)[:, None] - torch.arange(n)[None, :] == 1  # key = query - 1
    edges = previous.expand(2, n, n) if masked else torch.ones(2, n, n, dtype=torch.bool)
    res = walk.laplacian_residual(heads=HEADS, edges=edges if masked else None, baseline_draws=2)
    defect, scale, eps = reference_subset(walk, pattern, HEADS, edges)
    tol = 50 * rtol(torch.float32)
    torch.testing.assert_close(res.transport_defect.double(), defect, atol=tol, rtol=0)
    torch.testing.assert_close(res.scale.double(), scale, atol=tol, rtol=tol)
    assert res.heads == tuple(HEADS) and res.edges_masked == masked
    assert res.head_defects.shape == (len(HEADS),)
    per_edge = walk.isometry_defects(heads=HEADS, edges=edges if masked else None).double()
    on = edges & (pattern[:, HEADS].sum(1) > 0)
    # closed-form eps: a square root of a cancelling difference
    torch.testing.assert_close(
        per_edge, torch.where(on, eps, 0.0), atol=cancelling_atol(torch.float32), rtol=0
    )
    # the subset walk is the mean of those heads' patterns, its output theirs
    sub = walk.of_heads(HEADS)
    torch.testing.assert_close(sub.walk, pattern[:, HEADS].mean(1).to(sub.walk))
    heads_out = einsum(
        pattern[:, HEADS].to(walk.field), walk.field, walk.W_V[HEADS], walk.W_O[HEADS],
        "b h i j, b j m, h m d, h d n -> b i n",
    )  # fmt: skip
    torch.testing.assert_close(sub.apply(), heads_out, atol=tol, rtol=tol)


def test_scoped_tables(gpt2: Any) -> None:
    cache = cache_of(gpt2)
    table = tl_connwalk.geometry_table(
        cache, heads=[1, 3], edges=lambda q, k: k > 0, baseline_draws=2, progress=False
    )
    assert sorted(set(table["head"]) - {"all"}) == [1, 3]
    walk = tl_connwalk.connection_walk(cache, 0)
    res = walk.laplacian_residual(heads=[1, 3], edges=lambda q, k: k > 0, baseline_draws=2)
    row = table[(table["layer"] == 0) & (table["head"] == "all")].iloc[0]
    assert row["transport_defect"] == pytest.approx(res.transport_defect.mean().item())
    drift = tl_connwalk.layer_drift(cache, heads=[1, 3], edges=lambda q, k: k > 0)
    assert row["drift_to_next"] == pytest.approx(drift[:, 0].mean().item())
    with pytest.raises(ConnWalkError, match="distinct indices"):
        walk.of_heads([0, -walk.n_heads])
    with pytest.raises(ConnWalkError, match="non-empty sequence"):
        walk.of_heads([])


def test_no_transport_on_a_non_edge(gpt2: Any) -> None:
    walk = tl_connwalk.connection_walk(cache_of(gpt2), 0)
    with pytest.raises(ConnWalkError, match=r"\(2, 5\) is no edge of the walk"):
        walk.effective_transport(2, 5)  # the future of a causal walk
    with pytest.raises(ConnWalkError, match="no edge"):
        walk.effective_transport()[2, 5]
    # an edge in one batch element only (key 2 is padding in the other): the zero map there
    toks = hooked_tokens(batch=2, pos=8) if HAS_HOOKED else bridge_tokens(2, 8)
    mask = torch.tensor([[1] * 8, [0] * 4 + [1] * 4])
    padded = tl_connwalk.connection_walk(gpt2.run_with_cache(toks, attention_mask=mask)[1], 0)
    T = padded.effective_transport(5, 2)
    assert T.AB[1].abs().max() == 0 and T.AB[0].abs().max() > 0
    torch.testing.assert_close(T.AB[0], walk.effective_transport(5, 2).AB[0])
