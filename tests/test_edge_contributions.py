"""``walk.edge_contributions()`` against TransformerLens's own value vectors, patterns and ``W_O``.

The reference reads ``hook_v`` (``x_j W_V^h + b_V^h``, as the model computed it), ``hook_pattern``
and the model's ``W_O``, and forms each head's message ``A^h_ij v^h_j W_O^h`` itself; summed
over keys, those messages must give ``hook_z`` / ``hook_result`` (the model's own mixing), which
checks the reference before its norms are compared.
"""

import pytest
import torch

import tl_connwalk
from tests.architectures import (
    BRIDGES,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_encoder,
    hooked_only,
    tokens,
)
from tests.tolerances import atol, rtol
from tl_connwalk.core.edge_norms import EdgeContributions, edge_contributions, message_norms


def reference(model, cache, layer):
    """Per-head messages ``[batch, query, key, head, d_model]`` with and without value biases."""
    attn = model.blocks[layer].attn
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()
    v = cache[f"blocks.{layer}.attn.hook_v"].double()  # [batch, key, kv_head, d_head]
    n_heads = pattern.shape[1]
    b_V = attn.b_V
    b_V = torch.zeros(v.shape[2:]) if b_V is None else b_V.detach().double()
    # grouped-query attention: query head h reads value head h // (query heads per value head)
    v = v.repeat_interleave(n_heads // v.shape[2], 2)
    b_V = b_V.repeat_interleave(n_heads // b_V.shape[0], 0)
    W_O = attn.W_O.detach().double()
    biased = torch.einsum("bhij,bjhd,hdm->bijhm", pattern, v, W_O)
    unbiased = torch.einsum("bhij,bjhd,hdm->bijhm", pattern, v - b_V, W_O)
    z = cache[f"blocks.{layer}.attn.hook_z"].double()
    scale = z.abs().max().item()
    torch.testing.assert_close(
        torch.einsum("bhij,bjhd->bihd", pattern, v),
        z,
        rtol=rtol(torch.float32),
        atol=atol(torch.float32, scale=scale),
    )
    result = f"blocks.{layer}.attn.hook_result"
    if result in cache:
        expected = cache[result].double()
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            biased.sum(2), expected, rtol=rtol(torch.float32), atol=atol(torch.float32, scale=scale)
        )
    return biased, unbiased


def check(model, toks, layers=(0, 1)):
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    for layer in layers:
        walk = tl_connwalk.connection_walk(cache, layer, model)
        got = walk.edge_contributions()
        assert isinstance(got, EdgeContributions)
        biased, unbiased = reference(model, cache, layer)
        head = biased.norm(dim=-1).permute(0, 3, 1, 2)  # [batch, head, query, key]
        edge = unbiased.sum(3).norm(dim=-1)
        for actual, expected in ((got.head, head), (got.edge, edge)):
            size = expected.abs().max().item()
            torch.testing.assert_close(
                actual.double(), expected, rtol=0, atol=atol(torch.float32, scale=size)
            )
        unattended = cache[f"blocks.{layer}.attn.hook_pattern"] == 0  # a causal mask's future
        assert (got.head[unattended] == 0).all()
        assert (got.edge[unattended.all(1)] == 0).all()


@hooked_only
@pytest.mark.parametrize(
    "arch_", ["gpt2_ln", "gpt2_processed", "llama_gqa_rotary", "llama_gqa_folded", "shortformer"]
)
def test_hooked_transformer(arch_):
    model = build(arch_)
    model.set_use_attn_result(True)
    check(model, tokens())


@hooked_only
def test_hooked_transformer_processed_on_load():
    """fold_ln and center_writing_weights on: the same model's weights, processed by
    TransformerLens; the head norms follow the processed ``W_O`` (centred outputs)."""
    model = build("gpt2_ln")
    model.load_and_process_state_dict(
        model.state_dict(), fold_ln=True, center_writing_weights=True, fold_value_biases=False
    )
    model.set_use_attn_result(True)
    check(model, tokens())


@hooked_only
def test_hooked_encoder():
    check(hooked_encoder(), tokens())


@pytest.mark.parametrize(("arch_", "compat"), BRIDGES)
def test_bridge(arch_, compat):
    check(cached_bridge(arch_, compat), bridge_tokens())


@hooked_only
def test_padding_contributes_nothing():
    """A right-padded sequence: edges into or out of the pads are 0, the rest as run alone."""
    model = build("gpt2_ln")
    toks = tokens(batch=1)
    mask = torch.ones_like(toks)
    mask[:, 6:] = 0
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, attention_mask=mask)
        _, alone = model.run_with_cache(toks[:, :6])
    got = tl_connwalk.connection_walk(cache, 1, model, attention_mask=mask).edge_contributions()
    expected = tl_connwalk.connection_walk(alone, 1, model).edge_contributions()
    assert (got.edge[:, 6:] == 0).all() and (got.edge[:, :, 6:] == 0).all()
    assert (got.head[:, :, 6:] == 0).all() and (got.head[..., 6:] == 0).all()
    torch.testing.assert_close(got.edge[:, :6, :6], expected.edge)
    torch.testing.assert_close(got.head[:, :, :6, :6], expected.head)


def test_message_norms_by_hand(monkeypatch):
    """Two heads, one edge: ``||(1/2)(3, 0) + (1/2)(3, 8)|| = ||(3, 4)|| = 5``; and blocks of one
    query give the same norms as one block."""
    from tl_connwalk.core import edge_norms

    A = torch.full((1, 2, 1, 1), 0.5, dtype=torch.float64)
    messages = torch.tensor([[[[3.0, 0.0], [3.0, 8.0]]]], dtype=torch.float64)
    assert message_norms(A, messages).item() == pytest.approx(5.0, rel=rtol(torch.float64, 4))
    A = torch.softmax(torch.randn(2, 3, 5, 5, dtype=torch.float64), -1)
    messages = torch.randn(2, 5, 3, 6, dtype=torch.float64)
    whole = message_norms(A, messages)
    monkeypatch.setattr(edge_norms, "QUERY_BLOCK_ELEMENTS", 1)
    torch.testing.assert_close(message_norms(A, messages), whole, rtol=0, atol=0)


def test_head_norms_scale_with_the_pattern():
    """``||A f|| = A ||f||``; a head sharing its value head with another gets the same ``f``."""
    A = torch.softmax(torch.randn(1, 2, 3, 3, dtype=torch.float64), -1)
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    W_V = torch.randn(1, 4, 2, dtype=torch.float64).expand(2, -1, -1)
    b_V = torch.randn(1, 2, dtype=torch.float64).expand(2, -1)
    W_O = torch.randn(2, 2, 4, dtype=torch.float64)
    edges = torch.ones(1, 3, 3, dtype=torch.bool)
    got = edge_contributions(A, x, W_V, b_V, W_O, edges)
    sizes = torch.stack(
        [((x @ W_V[h] + b_V[h]) @ W_O[h]).norm(dim=-1) for h in range(2)], 1
    )  # [batch, head, key]
    torch.testing.assert_close(got.head, A * sizes[:, :, None], rtol=rtol(torch.float64, 8), atol=0)
