"""The connection-walk hook points on ``TransformerBridge`` (tl_connwalk.bridge_hooks).

Every toy architecture (GPT-2, grouped-query Llama, Gemma 3 with ``ln1_post``, BERT), with and
without compatibility mode, on TransformerLens 3.x and 4.x. References are the Bridge's own
activations: the walk and gates from ``hook_pattern``, the messages from ``hook_v`` and
``attn.W_O`` (value heads expanded by hand), head ablation against zeroing ``hook_z``, walk
edits against writing ``H W' g`` at ``hook_pattern`` directly.
"""

import copy
import functools

import pytest
import torch
from einops import einsum

import tl_connwalk
from tests.architectures import BRIDGE_DECODERS, BRIDGES, bridge_tokens, cached_bridge
from tests.tolerances import assert_close
from tl_connwalk import bridge_hooks
from tl_connwalk.core.walk import gates, patterns_from_walk, walk_matrix
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks import hook_name
from tl_connwalk.toy import random_bridge

LAYER = 1


def zero_head(head, tensor, hook):
    tensor = tensor.clone()
    tensor[:, :, head] = 0.0
    return tensor


def square_walk(walk, hook):
    return walk @ walk


def expected_messages(model, value):
    """``m^h_j = v^{h // r}_j W_O^h`` from the cached ``hook_v`` (KV heads expanded by hand)."""
    W_O = model.blocks[LAYER].attn.W_O.detach()
    value = value.repeat_interleave(W_O.shape[0] // value.shape[2], dim=2)
    return einsum(value, W_O, "b k h e, h e d -> b k h d")


def fingerprint(model) -> dict:
    return {
        "hook_dict": sorted((k, id(v)) for k, v in model.hook_dict.items()),
        "modules": [(n, type(m), id(m)) for n, m in model.named_modules()],
        "fwd_hooks": [(n, len(m._forward_hooks)) for n, m in model.named_modules()],
        "hook_types": [(n, type(m)) for n, m in model.named_modules() if "hook" in n],
    }


@pytest.mark.parametrize(("arch", "compat"), BRIDGES)
def test_attach_is_invisible_and_detach_exact(arch, compat):
    model = cached_bridge(arch, compat)
    tokens = bridge_tokens()
    with torch.no_grad():
        plain = model(tokens)
        before = fingerprint(model)
        tl_connwalk.attach(model)
        try:
            assert torch.equal(model(tokens), plain)
            names = {hook_name(layer, p) for layer in (0, 1) for p in ("walk", "gates", "messages")}
            assert names <= set(model.hook_dict)
        finally:
            tl_connwalk.detach(model)
        assert fingerprint(model) == before
        assert torch.equal(model(tokens), plain)


@pytest.mark.parametrize("bridge", BRIDGES, indirect=True)
def test_points_carry_walk_gates_messages(bridge):
    names = [hook_name(LAYER, p) for p in ("walk", "gates", "messages")]
    names += [f"blocks.{LAYER}.attn.hook_pattern", f"blocks.{LAYER}.attn.hook_v"]
    _, cache = bridge.run_with_cache(bridge_tokens(), names_filter=names)
    pattern = cache[names[3]]
    assert_close(cache[names[0]], walk_matrix(pattern))
    assert_close(cache[names[1]], gates(pattern))
    assert_close(cache[names[2]], expected_messages(bridge, cache[names[4]]))


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
@pytest.mark.parametrize("user_first", [False, True])
def test_messages_see_a_user_edit_of_hook_v(bridge, user_first):
    """A user hook on hook_v runs before the messages are taken, in either order."""
    v_name = f"blocks.{LAYER}.attn.hook_v"
    seen = {}

    def keep(key, tensor, hook):
        seen[key] = tensor.detach().clone()

    double = [(v_name, lambda v, hook: 2 * v)]
    ours = [
        (v_name, functools.partial(keep, "v")),
        (hook_name(LAYER, "messages"), functools.partial(keep, "m")),
    ]
    bridge.run_with_hooks(bridge_tokens(), fwd_hooks=double + ours if user_first else ours + double)
    # seen["v"] is the value before the doubling when our keep ran first
    final_value = seen["v"] if user_first else 2 * seen["v"]
    assert_close(seen["m"], expected_messages(bridge, final_value))


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
@pytest.mark.parametrize("head", [0, 3])
def test_zero_messages_is_zeroing_hook_z(bridge, head):
    tokens = bridge_tokens()
    ours = bridge.run_with_hooks(
        tokens, fwd_hooks=[(hook_name(LAYER, "messages"), functools.partial(zero_head, head))]
    )
    tl = bridge.run_with_hooks(
        tokens, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", functools.partial(zero_head, head))]
    )
    assert_close(ours, tl)
    assert not torch.allclose(ours, bridge(tokens))


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
def test_walk_edit_is_pattern_edit(bridge):
    """Squaring W at hook_conn_walk == writing ``H W^2 g`` at hook_pattern by hand."""
    tokens = bridge_tokens()

    def by_hand(pattern, hook):
        return patterns_from_walk(square_walk(walk_matrix(pattern), hook), gates(pattern))

    ours = bridge.run_with_hooks(tokens, fwd_hooks=[(hook_name(LAYER, "walk"), square_walk)])
    ref = bridge.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", by_hand)])
    assert_close(ours, ref)
    assert not torch.allclose(ours, bridge(tokens))


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
def test_patching_cached_walk_and_gates_is_a_no_op(bridge):
    tokens = bridge_tokens()
    names = [hook_name(LAYER, "walk"), hook_name(LAYER, "gates")]
    plain, cache = bridge.run_with_cache(tokens, names_filter=names)
    put = lambda t, hook: cache[hook.name]  # noqa: E731
    assert_close(bridge.run_with_hooks(tokens, fwd_hooks=[(n, put) for n in names]), plain)


@pytest.mark.parametrize("bridge", [b for b in BRIDGES if b[0] == "bert"], indirect=True)
@pytest.mark.parametrize("point", ["walk", "gates", "messages"])
def test_bert_refuses_edits_it_cannot_apply(bridge, point):
    """BERT's AttentionBridge fires hook_pattern after the output: edits raise, never vanish."""
    edit = lambda t, hook: 0.5 * t  # noqa: E731
    with pytest.raises(ConnWalkError, match="after the attention output"):
        bridge.run_with_hooks(bridge_tokens(), fwd_hooks=[(hook_name(LAYER, point), edit)])
    assert torch.equal(
        bridge(bridge_tokens()), bridge(bridge_tokens())
    )  # and no hook is left behind


@pytest.mark.parametrize("bridge", [("gpt2", False), ("llama", True)], indirect=True)
def test_no_work_without_conn_hooks(bridge, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("computed a conn point nobody hooked")

    for name in ("_through_walk", "_messages", "_correction"):
        monkeypatch.setattr(bridge_hooks, name, forbidden)
    keep = lambda t, hook: t  # noqa: E731
    names = ("hook_pattern", "hook_v", "o.hook_out")
    bridge.run_with_hooks(
        bridge_tokens(), fwd_hooks=[(f"blocks.{LAYER}.attn.{n}", keep) for n in names]
    )


def test_compatibility_mode_after_attach_keeps_points():
    model = random_bridge("gpt2")
    tl_connwalk.attach(model)
    model.enable_compatibility_mode()
    _, cache = model.run_with_cache(bridge_tokens(), names_filter=hook_name(LAYER, "walk"))
    assert cache[hook_name(LAYER, "walk")].shape == (2, 7, 7)
    tl_connwalk.detach(model)
    assert not any("hook_conn" in name for name in model.hook_dict)


def test_refuses_a_foreign_hook_point_subclass():
    model = random_bridge("gpt2", n_layers=1)

    class Foreign(type(model.blocks[0].attn.hook_pattern)):
        pass

    model.blocks[0].attn.hook_pattern.__class__ = Foreign
    with pytest.raises(ConnWalkError, match="another plugin wraps it"):
        tl_connwalk.attach(model)
    assert not any("hook_conn" in name for name in model.hook_dict)


@pytest.mark.parametrize("bridge", [("gpt2", False), ("llama", True)], indirect=True)
def test_pos_slice_slices_the_position_axes(bridge):
    """walk/gates: the query axis (as for hook_pattern); messages: the key axis, not the heads."""
    names = [hook_name(LAYER, p) for p in ("walk", "gates", "messages")]
    _, full = bridge.run_with_cache(bridge_tokens(), names_filter=names)
    _, sliced = bridge.run_with_cache(bridge_tokens(), names_filter=names, pos_slice=2)
    assert torch.equal(sliced[names[0]], full[names[0]][:, 2:3])
    assert torch.equal(sliced[names[1]], full[names[1]][:, :, 2:3])
    assert torch.equal(sliced[names[2]], full[names[2]][:, 2:3])


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
def test_gradient_at_messages_is_pattern_transposed_output_gradient(bridge):
    """``dL/dm^h_k = sum_q A^h_qk dL/d out_q`` with ``out`` the output projection's value."""
    seen = {}

    def keep(key, tensor, hook):
        seen[key] = tensor.detach()

    fwd = [(f"blocks.{LAYER}.attn.hook_pattern", functools.partial(keep, "A"))]
    bwd = [(hook_name(LAYER, "messages"), functools.partial(keep, "dm"))]
    o = bridge.blocks[LAYER].attn.o
    handle = o.register_full_backward_hook(lambda m, gi, go: seen.__setitem__("dout", go[0]))
    try:
        with bridge.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
            bridge(bridge_tokens()).square().sum().backward()
    finally:
        handle.remove()
        bridge.zero_grad(set_to_none=True)
    expected = einsum(seen["A"], seen["dout"], "b h q k, b q d -> b k h d")
    assert_close(seen["dm"], expected)


@pytest.mark.parametrize("bridge", [("llama", False)], indirect=True)
def test_points_survive_reset_hooks_and_deepcopy(bridge):
    zero = [(hook_name(LAYER, "messages"), functools.partial(zero_head, 1))]
    expected = bridge.run_with_hooks(bridge_tokens(), fwd_hooks=zero)
    bridge.reset_hooks(including_permanent=True)
    assert torch.equal(bridge.run_with_hooks(bridge_tokens(), fwd_hooks=zero), expected)
    twin = copy.deepcopy(bridge)
    assert torch.equal(twin.run_with_hooks(bridge_tokens(), fwd_hooks=zero), expected)
    assert twin.blocks[LAYER].attn.hook_v.__dict__["_tl_connwalk_conn"].attn is (
        twin.blocks[LAYER].attn
    )


@pytest.mark.parametrize("bridge", [("bert", False)], indirect=True)
def test_bert_allows_reading_and_no_op_patches(bridge):
    names = [hook_name(LAYER, p) for p in ("walk", "gates", "messages")]
    plain, cache = bridge.run_with_cache(bridge_tokens(), names_filter=names)
    put = lambda t, hook: cache[hook.name].clone()  # noqa: E731
    assert torch.equal(
        bridge.run_with_hooks(bridge_tokens(), fwd_hooks=[(n, put) for n in names]), plain
    )


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
def test_transformer_lens_patching_on_new_names(bridge):
    """``transformer_lens.patching.generic_activation_patch`` drives the points on the Bridge.

    Each head's clean messages patched into a corrupted run, by ``patching`` and by hand with
    ``run_with_hooks``: the same metric; and the patch changes it.
    """
    import pandas as pd
    from transformer_lens import patching

    name = hook_name(LAYER, "messages")
    clean, corrupted = bridge_tokens(), bridge_tokens().flip(-1)
    _, clean_cache = bridge.run_with_cache(clean, names_filter=[name])
    n_heads = clean_cache[name].shape[2]

    def metric(logits):
        return logits[:, -1, 0].mean()

    def setter(activation, index, clean_activation):
        activation[:, :, index[1]] = clean_activation[:, :, index[1]]
        return activation

    index_df = pd.DataFrame({"layer": pd.Series([None] * n_heads, dtype=object)})
    index_df["head"] = range(n_heads)
    result = patching.generic_activation_patch(
        bridge, corrupted, clean_cache, metric, setter, name, index_df=index_df
    )
    for head in range(n_heads):
        hook = lambda m, hook, h=head: setter(m, [None, h], clean_cache[name])  # noqa: E731
        expected = metric(bridge.run_with_hooks(corrupted, fwd_hooks=[(name, hook)]))
        assert_close(result[head], expected)
    assert not torch.allclose(result, metric(bridge(corrupted)))


@pytest.mark.parametrize("training", [False, True])
def test_new_points_take_the_models_mode(training):
    """A model in eval mode stays all in eval mode (TransformerLens 4's patching checks this)."""
    model = random_bridge("gpt2")
    model.train(training)
    tl_connwalk.attach(model)
    try:
        assert {m.training for m in model.modules()} == {training}
    finally:
        tl_connwalk.detach(model)
