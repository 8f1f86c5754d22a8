"""TransformerBridge (TransformerLens 3.x and 4.x): the identity, fields and padding masks."""

import pytest
import torch
from einops import einsum

import tl_connwalk
from tests.architectures import BRIDGES, tokens
from tests.tolerances import assert_close
from tl_connwalk.toy import random_bridge


@pytest.fixture(
    scope="module", params=BRIDGES, ids=lambda p: f"{p[0]}-{'compat' if p[1] else 'raw'}"
)
def bridge_and_cache(request):
    arch, compat = request.param
    bridge = random_bridge(arch, compatibility_mode=compat)
    _, cache = bridge.run_with_cache(tokens())
    return bridge, cache


def test_identity_every_layer(bridge_and_cache):
    """apply() + bias() is the attention output: attn.o.hook_out (before BERT's residual+LN and
    Gemma's ln1_post, both of which TransformerLens puts inside attn.hook_out / hook_attn_out)."""
    bridge, cache = bridge_and_cache
    for layer in range(bridge.cfg.n_layers):
        walk = tl_connwalk.connection_walk(cache, layer)
        assert_close(walk.apply() + walk.bias(), cache[f"blocks.{layer}.attn.o.hook_out"])


def test_field_rebuilds_hook_v_with_kv_heads_expanded(bridge_and_cache):
    _, cache = bridge_and_cache
    walk = tl_connwalk.connection_walk(cache, 1)
    values = einsum(walk.field, walk.W_V, "b k d, h d e -> b k h e") + walk.b_V
    hook_v = cache["blocks.1.attn.hook_v"]
    assert_close(values, hook_v.repeat_interleave(walk.n_heads // hook_v.shape[2], dim=2))


def test_processing_reports_the_mode(bridge_and_cache):
    bridge, cache = bridge_and_cache
    walk = tl_connwalk.connection_walk(cache, 0)
    assert walk.processing["compatibility_mode"] == bridge.compatibility_mode


def test_cache_method_after_attach(bridge_and_cache):
    bridge, cache = bridge_and_cache
    tl_connwalk.attach(bridge)
    try:
        assert_close(cache.connection_walk(-1).walk, tl_connwalk.connection_walk(cache, 1).walk)
    finally:
        tl_connwalk.detach(bridge)


def test_required_hooks_names_filter():
    bridge = random_bridge("llama")
    names = tl_connwalk.required_hooks(bridge)
    hooks = ("hook_pattern", "hook_in")
    assert names == [f"blocks.{layer}.attn.{hook}" for layer in range(2) for hook in hooks]
    _, small = bridge.run_with_cache(tokens(), names_filter=names)
    _, full = bridge.run_with_cache(tokens())
    assert_close(
        tl_connwalk.connection_walk(small, 1).apply(), tl_connwalk.connection_walk(full, 1).apply()
    )


def test_encoder_padding_keys_are_off_the_walk():
    """BERT with a padding mask: masked keys carry no walk mass, and the identity still holds."""
    bridge = random_bridge("bert")
    toks = tokens(batch=2, pos=7)
    mask = torch.ones_like(toks)
    mask[1, 4:] = 0
    _, cache = bridge.run_with_cache(toks, attention_mask=mask)
    for layer in range(2):
        walk = tl_connwalk.connection_walk(cache, layer)
        assert walk.walk[1, :, 4:].abs().max() == 0
        assert_close(walk.walk.sum(-1), torch.ones(2, 7))
        assert_close(walk.apply() + walk.bias(), cache[f"blocks.{layer}.attn.o.hook_out"])


def test_encoder_walk_is_bidirectional():
    bridge = random_bridge("bert")
    _, cache = bridge.run_with_cache(tokens())
    walk = tl_connwalk.connection_walk(cache, 0)
    assert (walk.walk > 0).all()
