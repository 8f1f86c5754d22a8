"""The paper's first theorem on every architecture: apply() + bias() is the attention output."""

import pytest
import torch
from einops import einsum

import tl_connwalk
from tests.architectures import build, hooked_encoder, hooked_only, tokens
from tests.tolerances import assert_close

pytestmark = hooked_only


def attention_outputs(model, toks):
    """Run the model, capturing each attention module's own output (before any ln1_post)."""
    outputs = {}
    handles = [
        block.attn.register_forward_hook(
            lambda mod, args, out, layer=layer: outputs.__setitem__(layer, out)
        )
        for layer, block in enumerate(model.blocks)
    ]
    try:
        _, cache = model.run_with_cache(toks)
    finally:
        for handle in handles:
            handle.remove()
    return cache, outputs


def test_identity_every_layer(arch):
    model = build(arch)
    cache, attn_out = attention_outputs(model, tokens())
    for layer in range(model.cfg.n_layers):
        walk = tl_connwalk.connection_walk(cache, layer)
        rebuilt = walk.apply() + walk.bias()
        assert_close(rebuilt, attn_out[layer])
        if not model.cfg.use_normalization_before_and_after:
            assert_close(rebuilt, cache[f"blocks.{layer}.hook_attn_out"])


def test_field_is_the_value_input(arch):
    """x_j W_V^h + b_V^h reproduces hook_v (KV heads expanded for grouped-query models)."""
    model = build(arch)
    _, cache = model.run_with_cache(tokens())
    walk = tl_connwalk.connection_walk(cache, 1)
    values = einsum(walk.field, walk.W_V, "b k d, h d e -> b k h e") + walk.b_V
    hook_v = cache["blocks.1.attn.hook_v"]
    repeat = model.cfg.n_heads // hook_v.shape[2]
    assert_close(values, hook_v.repeat_interleave(repeat, dim=2))


def test_patterns_round_trip_exactly_enough(arch):
    model = build(arch)
    _, cache = model.run_with_cache(tokens())
    walk = tl_connwalk.connection_walk(cache, 0)
    assert_close(walk.patterns, cache["blocks.0.attn.hook_pattern"])
    assert_close(walk.walk.sum(-1), torch.ones(2, 9))


@pytest.mark.parametrize(
    ("setting", "arch_name"),
    [("set_use_split_qkv_input", "llama_gqa_rotary"), ("set_use_attn_in", "gpt2_ln")],
)
def test_split_inputs(setting, arch_name):
    model = build(arch_name)
    getattr(model, setting)(True)
    cache, attn_out = attention_outputs(model, tokens())
    walk = tl_connwalk.connection_walk(cache, 1)
    assert_close(walk.apply() + walk.bias(), attn_out[1])


def test_split_input_patched_per_head_is_refused():
    model = build("gpt2_ln")
    model.set_use_split_qkv_input(True)

    def perturb_head_0(v_input, hook):
        v_input[:, :, 0] += 1.0
        return v_input

    with model.hooks(fwd_hooks=[("blocks.0.hook_v_input", perturb_head_0)]):
        _, cache = model.run_with_cache(tokens())
    with pytest.raises(tl_connwalk.ConnWalkError, match="differs between heads"):
        tl_connwalk.connection_walk(cache, 0)


def test_remove_batch_dim_cache():
    model = build("gpt2_ln")
    toks = tokens(batch=1)
    _, attn_out = attention_outputs(model, toks)
    _, unbatched = model.run_with_cache(toks, remove_batch_dim=True)
    walk = tl_connwalk.connection_walk(unbatched, 1)
    assert walk.walk.shape == (1, 9, 9)
    assert_close(walk.apply() + walk.bias(), attn_out[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches_compute_in_float32(dtype):
    half = build("gpt2_ln", dtype=dtype)
    _, cache = half.run_with_cache(tokens())
    walk = tl_connwalk.connection_walk(cache, 1)
    assert walk.walk.dtype == torch.float32 and walk.W_V.dtype == torch.float32
    assert walk.apply().device == cache["blocks.1.hook_attn_out"].device
    assert_close(walk.apply() + walk.bias(), cache["blocks.1.hook_attn_out"].float(), dtype=dtype)


def test_float64_stays_float64():
    model = build("llama_gqa_rotary", dtype=torch.float64)
    cache, attn_out = attention_outputs(model, tokens())
    walk = tl_connwalk.connection_walk(cache, 0)
    assert walk.walk.dtype == torch.float64
    assert_close(walk.apply() + walk.bias(), attn_out[0])


def test_processing_is_reported():
    raw = tl_connwalk.connection_walk(build("gpt2_ln").run_with_cache(tokens())[1], 0)
    processed = tl_connwalk.connection_walk(build("gpt2_processed").run_with_cache(tokens())[1], 0)
    assert raw.processing == dict(
        fold_ln=False, center_writing_weights=False, fold_value_biases=False
    )
    assert processed.processing == dict(
        fold_ln=True, center_writing_weights=True, fold_value_biases=True
    )


def test_hooked_encoder_with_padding():
    """HookedEncoder (BERT, post-norm): field hook_resid_pre; padded keys are off the walk."""
    model = hooked_encoder()
    toks = tokens(batch=2, pos=7)
    mask = torch.ones_like(toks)
    mask[1, 4:] = 0
    _, cache = model.run_with_cache(toks, one_zero_attention_mask=mask)
    assert tl_connwalk.required_hooks(model, 0)[1] == "blocks.0.hook_resid_pre"
    for layer in range(2):
        walk = tl_connwalk.connection_walk(cache, layer)
        assert walk.walk[1, :, 4:].abs().max() == 0
        assert_close(walk.apply() + walk.bias(), cache[f"blocks.{layer}.hook_attn_out"])
