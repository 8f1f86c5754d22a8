"""ConnectionWalk on real caches: the edge transports act as the attention does, edge by edge."""

import dataclasses

import pytest
import torch
from einops import einsum

import tl_connwalk
from tests.architectures import build, hooked_only, tokens
from tests.tolerances import assert_close

pytestmark = hooked_only


@pytest.fixture(scope="module")
def gqa_walk_and_cache():
    model = build("llama_gqa_rotary")
    _, cache = model.run_with_cache(tokens())
    return tl_connwalk.connection_walk(cache, 1), cache, model


def test_edge_action_is_the_edges_share_of_the_output(gqa_walk_and_cache):
    """W_ij x_j T_ij = sum_h A^h_ij (v^h_j - b_V^h) W_O^h with v = TransformerLens's hook_v."""
    walk, cache, model = gqa_walk_and_cache
    pattern = cache["blocks.1.attn.hook_pattern"]
    v = cache["blocks.1.attn.hook_v"].repeat_interleave(2, dim=2) - walk.b_V
    W_O = model.blocks[1].attn.W_O.detach()
    for i, j in [(0, 0), (5, 2), (8, 8), (8, 0)]:
        T = walk.effective_transport(i, j)
        assert T.shape == (2, 24, 24) and T.mdim == 4 * 4
        action = walk.walk[:, i, j, None] * einsum(walk.field[:, j], T.AB, "b f, b f e -> b e")
        share = einsum(pattern[:, :, i, j], v[:, j], W_O, "b h, b h e, h e d -> b d")
        assert_close(action, share)


def test_edge_shares_sum_to_apply(gqa_walk_and_cache):
    walk, _, _ = gqa_walk_and_cache
    lazy = walk.effective_transport()
    assert lazy.shape == (2, 9, 9, 24, 24)
    total = sum(
        walk.walk[:, i, j, None] * einsum(walk.field[:, j], lazy[i, j].AB, "b f, b f e -> b e")
        for i in [4]
        for j in range(5)  # the keys of causal row 4: no transport on a non-edge
    )
    assert_close(total, walk.apply()[:, 4])


def test_head_transports_are_ov_circuits(gqa_walk_and_cache):
    walk, _, model = gqa_walk_and_cache
    assert_close(walk.head_transports.AB, model.OV[1].AB)


def test_uniform_gates_ablation_is_the_summed_single_head(gqa_walk_and_cache):
    walk, _, _ = gqa_walk_and_cache
    uniform = dataclasses.replace(walk, gates=torch.full_like(walk.gates, 1 / walk.n_heads))
    summed = walk.head_transports.AB.sum(0)
    expected = einsum(walk.walk, walk.field @ summed, "b i j, b j e -> b i e")
    assert_close(uniform.apply(), expected)


def test_apply_on_other_fields_and_generator(gqa_walk_and_cache):
    walk, _, _ = gqa_walk_and_cache
    other = torch.randn_like(walk.field)
    assert_close(walk.generator().matvec(other), other - walk.apply(other))


def test_effective_transport_argument_errors(gqa_walk_and_cache):
    walk, _, _ = gqa_walk_and_cache
    with pytest.raises(tl_connwalk.ConnWalkError, match="both query and key"):
        walk.effective_transport(3)
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="key 9 is out of range: this walk has 9 positions"
    ):
        walk.effective_transport(0, 9)


def test_from_pattern_shape_errors():
    pattern = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="do not fit together: pattern \\(1, 2, 3, 3\\)"
    ):
        tl_connwalk.ConnectionWalk.from_pattern(
            pattern, torch.randn(1, 4, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 8)
        )
    with pytest.raises(tl_connwalk.ConnWalkError, match="wrong number of axes"):
        tl_connwalk.ConnectionWalk.from_pattern(
            pattern[0], torch.randn(1, 3, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 8)
        )


def test_repr_says_what_it_is(gqa_walk_and_cache):
    walk, _, _ = gqa_walk_and_cache
    text = repr(walk)
    assert "layer=1" in text and "heads=4" in text and "fold_ln=False" in text
