"""The connection-walk hook points on ``TransformerBridge`` (tl_connwalk.hooks.bridge).

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
from tl_connwalk.core.walk import gates, patterns_from_walk, walk_matrix
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks import bridge as bridge_hooks
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


# --- architectures the points cannot fully read: latent attention, opaque attention -------


def _glm_moe_dsa_bridge():
    """A tiny random GLM-MoE-DSA Bridge (multi-head latent attention, sparse attention mask)."""
    transformers = pytest.importorskip("transformers")
    builder = pytest.importorskip("transformer_lens.model_bridge.sources._bridge_builder")
    config = transformers.GlmMoeDsaConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=2,
        num_experts_per_tok=1, n_group=1, topk_group=1, q_lora_rank=8, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8, vocab_size=64,
        max_position_embeddings=32, index_topk=4, index_head_dim=8, index_n_heads=2,
        mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.GlmMoeDsaForCausalLM(copy.deepcopy(config)).eval()
    return builder.build_bridge_from_module(
        hf_model, "GlmMoeDsaForCausalLM", hf_config=config, tokenizer=None, device="cpu"
    ).eval()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_latent_attention_keeps_every_call_and_explains_the_walk():
    """MLA has no linear value map: the messages point is absent, walk and gates work, every
    call that worked before attach still does, and connection_walk names the architecture."""
    model = _glm_moe_dsa_bridge()
    tokens = bridge_tokens(batch=1, pos=8)
    with torch.no_grad():
        plain, plain_cache = model.run_with_cache(tokens)
        tl_connwalk.attach(model)
        try:
            logits, cache = model.run_with_cache(tokens)
            assert torch.equal(logits, plain)
            assert set(cache.keys()) - set(plain_cache.keys()) == {
                hook_name(layer, "walk") for layer in (0, 1)
            }
            assert hook_name(LAYER, "messages") not in model.hook_dict
            names = [hook_name(LAYER, "walk"), hook_name(LAYER, "gates")]
            needed = [*names, *tl_connwalk.required_hooks(model, LAYER)]
            _, conn = model.run_with_cache(tokens, names_filter=needed)
            pattern = conn[f"blocks.{LAYER}.attn.hook_pattern"]
            assert_close(conn[names[0]], walk_matrix(pattern))
            assert_close(conn[names[1]], gates(pattern))
            assert_close(tl_connwalk.walk_matrix(conn, LAYER), conn[names[0]])
            with pytest.raises(ConnWalkError, match="GlmMoeDsaAttentionBridge.*MLA"):
                conn.connection_walk(LAYER)
        finally:
            tl_connwalk.detach(model)
        assert not any("hook_conn" in name for name in model.hook_dict)


class _OpaqueAttention(torch.nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.out = torch.nn.Linear(d_model, d_model)

    def forward(self, x, cos, sin):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v)


class _GatedMLP(torch.nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(d_model, d_model), torch.nn.Linear(d_model, d_model)
        self.down = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class _Block(torch.nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.attn, self.mlp = _OpaqueAttention(d_model), _GatedMLP(d_model)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _OpaqueModel(torch.nn.Module):
    """The module tree TransformerLens's pretrain adapter wraps (embed/blocks/norm_f/lm_head)."""

    def __init__(self, d_model: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.blocks = torch.nn.ModuleList([_Block(d_model) for _ in range(2)])
        self.norm_f = torch.nn.LayerNorm(d_model)
        self.lm_head = torch.nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens, **kwargs):
        x, cos = self.embed(tokens), torch.ones(tokens.shape[1], 2)
        for block in self.blocks:
            x = block(x, cos, cos)
        return {"logits": self.lm_head(self.norm_f(x))}


def test_opaque_attention_is_refused_and_the_model_left_unchanged():
    pretrain = pytest.importorskip("transformer_lens.model_bridge.supported_architectures.pretrain")
    from transformer_lens.config.transformer_bridge_config import TransformerBridgeConfig

    cfg = TransformerBridgeConfig(
        d_model=16, d_head=4, n_layers=2, n_ctx=32, n_heads=4, d_vocab=64, d_mlp=32,
        architecture=pretrain.ARCHITECTURE_NAME,
    )  # fmt: skip
    model = pretrain.build_pretrain_bridge(_OpaqueModel(), cfg)

    def snapshot():
        return {
            **fingerprint(model),
            "registry": sorted((k, id(v)) for k, v in model._hook_registry.items()),
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "attrs": sorted(vars(model)),
        }

    before = snapshot()
    with pytest.raises(ConnWalkError, match="NativeForwardAttentionBridge.*output projection o"):
        tl_connwalk.attach(model)
    after = snapshot()
    state, state_after = before.pop("state"), after.pop("state")
    assert after == before and state.keys() == state_after.keys()
    assert all(torch.equal(state[k], state_after[k]) for k in state)
    assert not tl_connwalk.is_attached(model)
    _, cache = model.run_with_cache(bridge_tokens())
    with pytest.raises(ConnWalkError, match="NativeForwardAttentionBridge"):
        tl_connwalk.connection_walk(cache, 0)
