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


# --- one architecture per attention flavour TransformerLens ships a Bridge adapter for --------


def _tiny_bridge(architecture: str, config_class: str, model_class: str, **config):
    """A random Bridge of a Hugging Face architecture from a tiny config, offline (eager
    attention, so that the patterns are computed; weights redrawn as in `tl_connwalk.toy`)."""
    import copy

    transformers = pytest.importorskip("transformers")
    builder = pytest.importorskip("transformer_lens.model_bridge.sources._bridge_builder")
    hf_config = getattr(transformers, config_class)(**config)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_class)(copy.deepcopy(hf_config)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.ndim >= 2 or name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    try:
        return builder.build_bridge_from_module(
            hf_model, architecture, hf_config=hf_config, tokenizer=None, device="cpu"
        ).eval()
    except (ValueError, KeyError, NotImplementedError) as error:  # no adapter in this version
        pytest.skip(f"{architecture}: {error}")


_SIZE = {"vocab_size": 64}
#: flavour -> (architecture, config class, model class, config); sizes: 2 layers, 4 heads, 32 wide
FLAVOURS = {
    "alibi-fused-qkv-bloom": ("BloomForCausalLM", "BloomConfig", "BloomForCausalLM",
        dict(hidden_size=32, n_layer=2, n_head=4, **_SIZE)),
    "alibi-mpt": ("MptForCausalLM", "MptConfig", "MptForCausalLM",
        dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=32, expansion_ratio=2, **_SIZE)),
    "alibi-parallel-falcon": ("FalconForCausalLM", "FalconConfig", "FalconForCausalLM",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
             parallel_attn=True, new_decoder_architecture=False, multi_query=False, **_SIZE)),
    "rotary-parallel-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", "GPTNeoXForCausalLM",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=32, use_parallel_residual=True, **_SIZE)),
    "rotary-parallel-gptj": ("GPTJForCausalLM", "GPTJConfig", "GPTJForCausalLM",
        dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, **_SIZE)),
    "partial-rotary-parallel-phi": ("PhiForCausalLM", "PhiConfig", "PhiForCausalLM",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=32, **_SIZE)),
    "separate-qkv-opt": ("OPTForCausalLM", "OPTConfig", "OPTForCausalLM",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
             max_position_embeddings=32, word_embed_proj_dim=32, **_SIZE)),
    "rotary-fused-qkv-codegen": ("CodeGenForCausalLM", "CodeGenConfig", "CodeGenForCausalLM",
        dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, n_ctx=32, **_SIZE)),
}  # fmt: skip


def _zero_head_1(tensor, hook):
    return tensor.index_fill(2, torch.tensor([1]), 0.0)


def _outcome(call):
    """``("ok", result)`` or ``("raised", type and message)`` of ``call()``."""
    try:
        return "ok", call()
    except Exception as error:  # whatever the architecture's own forward raises
        return "raised", (type(error), str(error))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_every_attention_flavour_is_measured_exactly_or_left_as_it_was(flavour):
    """ALiBi (BLOOM, MPT, Falcon), rotary with parallel attention and MLP (GPT-NeoX, GPT-J,
    Phi), separate projections (OPT), CodeGen's fused rotary QKV: after ``attach`` every call
    has the outcome it had before, and each layer's walk rebuilds ``attn.o.hook_out`` (BLOOM's
    ``attn.hook_out`` also adds the residual) with messages that ablate a head as ``hook_z``
    does, or, where the Bridge fires ``hook_pattern`` only after computing the output (GPT-J,
    OPT), refuse the edit with a ConnWalkError that says so. Where TransformerLens's own
    forward pass fails for this transformers version (CodeGen on transformers 5), it fails the
    same way attached."""
    architecture, config_class, model_class, config = FLAVOURS[flavour]
    model = _tiny_bridge(architecture, config_class, model_class, **config)
    toks = tokens(batch=2, pos=7) % 64
    with torch.no_grad():
        plain = _outcome(lambda: model(toks))
        tl_connwalk.attach(model)
        try:
            attached = _outcome(lambda: model(toks))
            if plain[0] == "raised":
                assert attached == plain
                return
            assert attached[0] == "ok" and torch.equal(attached[1], plain[1])
            _, cache = model.run_with_cache(toks)
            for layer in range(model.cfg.n_layers):
                walk = cache.connection_walk(layer)
                assert_close(walk.apply() + walk.bias(), cache[f"blocks.{layer}.attn.o.hook_out"])
                residual = walk.laplacian_residual(baseline_draws=2)
                assert torch.isfinite(residual.transport_defect).all()
            ablated = {
                point: _outcome(
                    lambda point=point: model.run_with_hooks(
                        toks, fwd_hooks=[(f"blocks.1.attn.{point}", _zero_head_1)]
                    )
                )
                for point in ("hook_conn_messages", "hook_z")
            }
            ours, theirs = ablated["hook_conn_messages"], ablated["hook_z"]
            assert theirs[0] == "ok" and not torch.equal(theirs[1], plain[1])
            if ours[0] == "raised":  # the Bridge computes this attention's output in one call
                assert ours[1][0] is tl_connwalk.ConnWalkError
                assert "fires AttentionBridge.hook_pattern after the attention output" in ours[1][1]
            else:
                assert_close(ours[1], theirs[1])
        finally:
            tl_connwalk.detach(model)
        assert not any("hook_conn" in name for name in model.hook_dict)
        assert torch.equal(model(toks), plain[1])


def test_encoder_decoder_is_refused_and_the_model_left_unchanged():
    """T5 (relative position bias, encoder and decoder stacks, cross-attention)."""
    model = _tiny_bridge(
        "T5ForConditionalGeneration", "T5Config", "T5ForConditionalGeneration",
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, **_SIZE,
    )  # fmt: skip
    before = {
        "hooks": sorted(model.hook_dict),
        "modules": [(name, type(module)) for name, module in model.named_modules()],
        "state": {name: tensor.clone() for name, tensor in model.state_dict().items()},
        "attrs": sorted(vars(model)),
    }
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="encoder-decoder model .layers encoder_blocks and deco"
    ):
        tl_connwalk.attach(model)
    assert not tl_connwalk.is_attached(model)
    assert sorted(model.hook_dict) == before["hooks"]
    assert [(name, type(module)) for name, module in model.named_modules()] == before["modules"]
    assert sorted(vars(model)) == before["attrs"]
    state = model.state_dict()
    assert state.keys() == before["state"].keys()
    assert all(torch.equal(state[name], before["state"][name]) for name in state)
