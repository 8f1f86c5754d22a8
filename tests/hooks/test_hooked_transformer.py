"""The connection-walk hook points on tiny random HookedTransformers
(tl_connwalk.hooks.hooked_transformer).

References are TransformerLens's own activations: the walk and gates from ``hook_pattern``, the
messages against ``hook_z @ W_O`` (and ``hook_v @ W_O``), head ablation against zeroing
``hook_z``, pattern edits against patching ``hook_pattern`` directly.
"""

import copy
import hashlib
import warnings
from functools import partial

import pandas as pd
import pytest
import torch
from einops import einsum
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError
from transformer_lens import patching
from transformer_lens.hook_points import HookPoint

from tests.architectures import ARCHITECTURES, BASE, build, hooked_only, tokens
from tests.tolerances import assert_close
from tl_connwalk.core.walk import gates, head_messages, patterns_from_walk, walk_matrix
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks import HOOK_NAMES, hook_name, install, uninstall
from tl_connwalk.hooks import hooked_transformer as hooks

pytestmark = hooked_only

ARCHS = [*sorted(ARCHITECTURES), "lnpre"]
CONN = lambda name: "hook_conn" in name  # noqa: E731


def model_of(arch: str, dtype: torch.dtype = torch.float32):
    """``tests.architectures.build``, plus LNPre (pre-normalisation without affine weights)."""
    if arch != "lnpre":
        return build(arch, dtype=dtype)
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(**{**BASE, "act_fn": "gelu", "normalization_type": "LNPre"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model.to(dtype)


def expand(hook_v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Value heads repeated for the query heads that read them (grouped-query attention)."""
    return hook_v.repeat_interleave(n_heads // hook_v.shape[2], dim=2)


def zero_head(head: int, tensor: torch.Tensor, hook: HookPoint) -> torch.Tensor:
    """Zero ``tensor[:, :, head]``: the head axis of hook_z and of hook_conn_messages."""
    tensor[:, :, head] = 0.0
    return tensor


def fingerprint(model) -> dict:
    """Everything uninstall must restore: tensors, hook names, module tree, classes, hooks."""
    return {
        "state": {
            k: hashlib.sha256(v.numpy().tobytes()).hexdigest()
            for k, v in model.state_dict().items()
        },
        "hook_dict": [(k, id(v)) for k, v in model.hook_dict.items()],
        "mod_dict": [(k, id(v)) for k, v in model.mod_dict.items()],
        "modules": [(n, type(m), id(m)) for n, m in model.named_modules()],
        "fwd_hooks": [(n, len(m._forward_hooks)) for n, m in model.named_modules()],
        "attrs": [(n, sorted(vars(m))) for n, m in model.named_modules()],
    }


# --- the points exist and carry the right values -------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_points_listed_cached_and_exact(arch):
    model = model_of(arch)
    toks = tokens()
    plain = model(toks)
    install(model)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    for layer in range(n_layers):
        for point in HOOK_NAMES:
            name = f"blocks.{layer}.attn.{point}"
            assert (
                model.hook_dict[name]
                is model.mod_dict[name]
                is getattr(model.blocks[layer].attn, point)
            )
            assert model.hook_dict[name].name == name
    logits, cache = model.run_with_cache(toks)
    assert torch.equal(logits, plain)  # caching every point changes nothing, bit for bit
    assert torch.equal(model(toks), plain)
    for layer in range(n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        walk = cache[hook_name(layer, "walk")]
        gate = cache[hook_name(layer, "gates")]
        messages = cache[hook_name(layer, "messages")]
        assert walk.shape == (2, 9, 9) and gate.shape == (2, n_heads, 9, 9)
        assert messages.shape == (2, 9, n_heads, model.cfg.d_model)
        assert torch.equal(walk, walk_matrix(pattern)) and torch.equal(gate, gates(pattern))
        W_O, b_O = model.W_O[layer], model.b_O[layer]
        from_v = einsum(
            expand(cache[f"blocks.{layer}.attn.hook_v"], n_heads), W_O, "b k h e, h e d -> b k h d"
        )
        assert_close(messages, from_v)
        # sum_h A^h m^h + b_O is the attention output TransformerLens computes from hook_z
        rebuilt = (
            einsum(patterns_from_walk(walk, gate), messages, "b h q k, b k h d -> b q d") + b_O
        )
        z = cache[f"blocks.{layer}.attn.hook_z"]
        assert_close(rebuilt, einsum(z, W_O, "b q h e, h e d -> b q d") + b_O)
        if not model.cfg.use_normalization_before_and_after:
            assert_close(rebuilt, cache[f"blocks.{layer}.hook_attn_out"])


def test_messages_from_the_field():
    """m^h_j = (x_j W_V^h + b_V^h) W_O^h with the field x = LayerNorm output (spec §0)."""
    model = model_of("gpt2_ln")
    install(model)
    _, cache = model.run_with_cache(tokens())
    field = model.blocks[1].ln1(cache["blocks.1.hook_resid_pre"])  # the norm's own output
    expected = head_messages(field, model.W_V[1], model.b_V[1], model.W_O[1])
    assert_close(cache[hook_name(1, "messages")], expected)


def test_unhooked_points_are_not_computed(monkeypatch):
    """No hook on the new points: walk, gates and messages are never formed."""
    model = model_of("llama_gqa_rotary")
    install(model)

    def boom(*args, **kwargs):
        raise AssertionError("computed a connection-walk point nobody asked for")

    for name in ("walk_and_gates", "patterns_from_walk", "_messages"):
        monkeypatch.setattr(hooks, name, boom)
    toks = tokens()
    model(toks)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: not CONN(n))
    assert not any(CONN(name) for name in cache)
    model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda x, hook: x)])
    conn = model.blocks[0].attn.hook_v._conn
    assert conn.value is None and conn.pattern is None


def test_backward_caching_is_bit_exact_and_gradients_flow():
    """incl_bwd on every new point: the loss is bit for bit, and the point gradients are right.

    grad at messages: grad m^h_j = sum_i A^h_ij grad out_i (out = attention output);
    grad at the walk: grad W_ij = H sum_h g^h_ij grad A^h_ij (A = H W g).
    """
    model = model_of("gpt2_ln")
    toks = tokens()
    plain_loss = model(toks, return_type="loss")
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    install(model)
    names = lambda n: CONN(n) or n.endswith(("hook_pattern", "hook_attn_out"))  # noqa: E731
    loss, cache = model.run_with_cache(toks, names_filter=names, incl_bwd=True, return_type="loss")
    assert torch.equal(loss, plain_loss)
    for name, param in model.named_parameters():
        assert_close(param.grad, plain_grads[name])
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        grad_out = cache[f"blocks.{layer}.hook_attn_out_grad"]
        expected = einsum(pattern, grad_out, "b h q k, b q d -> b k h d")
        assert_close(cache[hook_name(layer, "messages") + "_grad"], expected)
        grad_pattern = cache[f"blocks.{layer}.attn.hook_pattern_grad"]
        gate = cache[hook_name(layer, "gates")]
        expected_walk = model.cfg.n_heads * einsum(gate, grad_pattern, "b h q k, b h q k -> b q k")
        causal = torch.ones(9, 9).tril().bool()  # above the diagonal A = 0: no gradient through W
        torch.testing.assert_close(
            cache[hook_name(layer, "walk") + "_grad"][:, causal], expected_walk[:, causal]
        )


def test_gradient_through_edited_messages():
    """With the messages doubled, d loss / d m' is still the pattern-transposed output gradient."""
    model = model_of("llama_gqa_rotary")
    install(model)
    grads = {}
    model.add_hook(hook_name(0, "messages"), lambda m, hook: 2 * m)
    model.add_hook(hook_name(0, "messages"), lambda g, hook: grads.__setitem__("m", g), dir="bwd")
    model.add_hook("blocks.0.hook_attn_out", lambda g, hook: grads.__setitem__("out", g), dir="bwd")
    _, cache = model.run_with_cache(tokens(), names_filter="blocks.0.attn.hook_pattern")
    model(tokens(), return_type="loss").backward()
    expected = einsum(
        cache["blocks.0.attn.hook_pattern"], grads["out"], "b h q k, b q d -> b k h d"
    )
    assert_close(grads["m"], expected)
    model.reset_hooks()


# --- they see the final values, whatever the order of hooks --------------------------------


@pytest.mark.parametrize("order", ["user_hooks_first", "install_first"])
def test_points_see_values_after_every_user_hook(order):
    model = model_of("llama_gqa_rotary")
    if order == "install_first":
        install(model)

    def sharpen(pattern, hook):  # a user's edit of the pattern, rows still stochastic
        return torch.softmax(4 * pattern.log().clamp(min=-50), -1)

    model.add_perma_hook("blocks.1.attn.hook_pattern", sharpen)
    model.add_hook("blocks.1.attn.hook_v", lambda v, hook: v * 3.0)
    model.add_hook("blocks.1.attn.hook_v", lambda v, hook: v.add_(1.0), prepend=True)
    if order == "user_hooks_first":
        install(model)
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, hook: p.flip(1))]):
        _, cache = model.run_with_cache(tokens())
    pattern, v = cache["blocks.1.attn.hook_pattern"], cache["blocks.1.attn.hook_v"]
    assert torch.equal(cache[hook_name(1, "walk")], walk_matrix(pattern))
    assert torch.equal(cache[hook_name(1, "gates")], gates(pattern))
    from_v = einsum(expand(v, model.cfg.n_heads), model.W_O[1], "b k h e, h e d -> b k h d")
    assert_close(cache[hook_name(1, "messages")], from_v)
    model.reset_hooks(including_permanent=True)
    _, plain = model.run_with_cache(tokens())
    assert not torch.equal(plain[hook_name(1, "walk")], cache[hook_name(1, "walk")])


# --- edits change the forward pass as the spec says ----------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_zeroing_head_messages_is_zero_ablation_at_hook_z(arch):
    """Exact on every architecture, ln1_post included (the correction sits before ln1_post)."""
    model = model_of(arch)
    install(model)
    toks = tokens()
    for layer, head in [(0, 1), (1, 3)]:
        ours = model.run_with_hooks(
            toks, fwd_hooks=[(hook_name(layer, "messages"), partial(zero_head, head))]
        )
        theirs = model.run_with_hooks(
            toks, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", partial(zero_head, head))]
        )
        assert_close(ours, theirs)
        assert not torch.allclose(ours, model(toks))
    doubled = model.run_with_hooks(
        toks, fwd_hooks=[(hook_name(1, "messages"), lambda m, hook: 2 * m)]
    )
    z_doubled = model.run_with_hooks(
        toks, fwd_hooks=[("blocks.1.attn.hook_z", lambda z, hook: 2 * z)]
    )
    assert_close(doubled, z_doubled)


@pytest.mark.parametrize(
    ("setting", "arch"),
    [
        ("set_use_attn_result", "llama_gqa_rotary"),
        ("set_use_split_qkv_input", "llama_gqa_rotary"),
        ("set_use_attn_in", "gpt2_ln"),
    ],
)
def test_zero_ablation_with_attention_options(setting, arch):
    model = model_of(arch)
    getattr(model, setting)(True)
    install(model)
    toks = tokens()
    ours = model.run_with_hooks(toks, fwd_hooks=[(hook_name(1, "messages"), partial(zero_head, 2))])
    theirs = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.attn.hook_z", partial(zero_head, 2))])
    assert_close(ours, theirs)


def test_in_place_message_edit_and_hook_z_edits_compose():
    model = model_of("gpt2_ln")
    install(model)
    toks = tokens()

    def zero_in_place(m, hook):
        m[:, :, 2] = 0.0  # returns None: an in-place edit

    ours = model.run_with_hooks(
        toks,
        fwd_hooks=[
            (hook_name(0, "messages"), zero_in_place),
            ("blocks.0.attn.hook_z", partial(zero_head, 0)),
        ],
    )
    both = partial(zero_head, [0, 2])
    assert_close(ours, model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_z", both)]))


def test_patching_the_cached_walk_or_gates_is_a_no_op():
    model = model_of("parallel_rotary")
    install(model)
    toks = tokens()
    plain, cache = model.run_with_cache(toks, names_filter=CONN)
    fwd_hooks = [
        (name, lambda x, hook: cache[hook.name].clone()) for name in cache if "messages" not in name
    ]
    assert torch.equal(model.run_with_hooks(toks, fwd_hooks=fwd_hooks), plain)
    assert torch.equal(
        model.run_with_hooks(
            toks, fwd_hooks=[(hook_name(1, "messages"), lambda m, hook: m.clone())]
        ),
        plain,
    )


@pytest.mark.parametrize("point", ["walk", "gates"])
@pytest.mark.parametrize("in_place", [False, True])
def test_edited_walk_or_gates_recombine_into_patterns(point, in_place):
    """An edited W or g makes the layer use A^h = H W g^h: the same as patching hook_pattern."""
    model = model_of("ln_post_gemma_like")
    install(model)
    toks = tokens()
    _, cache = model.run_with_cache(toks, names_filter=CONN)
    _, other = model.run_with_cache(tokens(seed=7), names_filter=CONN)
    name = hook_name(1, point)

    def patch(x, hook):
        if in_place:
            x.copy_(other[name])
            return None
        return other[name]

    ours = model.run_with_hooks(toks, fwd_hooks=[(name, patch)])
    walk, gate = cache[hook_name(1, "walk")], cache[hook_name(1, "gates")]
    walk, gate = (other[name], gate) if point == "walk" else (walk, other[name])
    pattern = patterns_from_walk(walk, gate)
    theirs = model.run_with_hooks(
        toks, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, hook: pattern)]
    )
    assert_close(ours, theirs)
    assert not torch.allclose(ours, model(toks))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.floats(0.1, 5.0))
def test_uniform_gates_is_the_single_head_reduction(seed, temperature):
    """Uniform gates (spec §1.2): every head attends by the walk; same as patching hook_pattern."""
    model = model_of("attn_only_no_norm")
    install(model)
    toks = tokens(seed=seed)

    def uniform(g, hook):
        return torch.full_like(g, 1 / g.shape[1])

    _, cache = model.run_with_cache(toks, names_filter=CONN)
    ours = model.run_with_hooks(toks, fwd_hooks=[(hook_name(0, "gates"), uniform)])
    walk = cache[hook_name(0, "walk")]
    pattern = walk[:, None].expand(-1, model.cfg.n_heads, -1, -1)
    theirs = model.run_with_hooks(
        toks, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, hook: pattern)]
    )
    assert_close(ours, theirs)
    del temperature  # the draw only diversifies hypothesis's examples


def test_shape_changing_hook_is_refused():
    model = model_of("gpt2_ln")
    install(model)
    with pytest.raises(ConnWalkError, match=r"hook_conn_walk returned shape \(2, 8, 9\)"):
        model.run_with_hooks(tokens(), fwd_hooks=[(hook_name(0, "walk"), lambda w, hook: w[:, 1:])])


# --- TransformerLens tools on the new names --------------------------------------------------


def test_position_slicing_cuts_the_position_axis():
    model = model_of("llama_gqa_rotary")
    install(model)
    toks = tokens()
    _, full = model.run_with_cache(toks, names_filter=CONN)
    _, cut = model.run_with_cache(toks, names_filter=CONN, pos_slice=[1, 4])
    idx = torch.tensor([1, 4])
    for layer in range(model.cfg.n_layers):
        assert torch.equal(cut[hook_name(layer, "walk")], full[hook_name(layer, "walk")][:, idx])
        assert torch.equal(
            cut[hook_name(layer, "gates")], full[hook_name(layer, "gates")][:, :, idx]
        )
        messages = full[hook_name(layer, "messages")]
        assert torch.equal(cut[hook_name(layer, "messages")], messages[:, idx])  # key, not head
    _, one = model.run_with_cache(
        toks, names_filter=CONN, pos_slice=-1, incl_bwd=True, return_type="loss"
    )
    assert one[hook_name(0, "messages") + "_grad"].shape == (
        2,
        1,
        model.cfg.n_heads,
        model.cfg.d_model,
    )


def test_transformer_lens_patching_on_new_names():
    """``transformer_lens.patching.generic_activation_patch`` drives the new points.

    ``get_act_name`` cannot spell ``blocks.{l}.attn.hook_conn_*`` from a layer number (it would
    give ``blocks.{l}.hook_conn_*``), so the index frame carries ``layer=None`` and the full name.
    """
    model = model_of("gpt2_ln")
    install(model)
    clean, corrupted = tokens(seed=1), tokens(seed=2)
    _, clean_cache = model.run_with_cache(clean, names_filter=CONN)

    def metric(logits):
        return logits[:, -1, 0].mean()

    def setter(activation, index, clean_activation):
        activation[:, :, index[1]] = clean_activation[:, :, index[1]]
        return activation

    name = hook_name(1, "messages")
    index_df = pd.DataFrame({"layer": pd.Series([None] * 4, dtype=object), "head": range(4)})
    result = patching.generic_activation_patch(
        model, corrupted, clean_cache, metric, setter, name, index_df=index_df
    )
    for head in range(4):
        hook = lambda m, hook, h=head: setter(m, [None, h], clean_cache[name])  # noqa: E731
        expected = metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, hook)]))
        assert_close(result[head], expected)
    assert not torch.allclose(result, metric(model(corrupted)))


# --- robustness: reset_hooks, deepcopy, .to, other plugins, uninstall ------------------------


def test_survives_reset_hooks_including_permanent():
    model = model_of("gpt2_ln")
    install(model)
    model.reset_hooks(including_permanent=True)
    model.reset_hooks(including_permanent=True, clear_contexts=True)
    toks = tokens()
    with model.hooks(fwd_hooks=[(hook_name(1, "messages"), partial(zero_head, 0))]):
        ours = model(toks)
    theirs = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.attn.hook_z", partial(zero_head, 0))])
    assert_close(ours, theirs)
    _, cache = model.run_with_cache(toks, names_filter=CONN)
    assert len(cache) == 3 * model.cfg.n_layers


def test_survives_deepcopy():
    model = model_of("llama_gqa_rotary")
    install(model)
    twin = copy.deepcopy(model)
    attn = twin.blocks[1].attn
    assert (
        attn.hook_pattern._conn.walk is attn.hook_conn_walk is twin.hook_dict[hook_name(1, "walk")]
    )
    assert attn.hook_v._conn is attn.hook_pattern._conn is not model.blocks[1].attn.hook_v._conn
    toks = tokens()
    assert torch.equal(twin(toks), model(toks))
    twin.add_hook(hook_name(1, "messages"), partial(zero_head, 2))  # on the twin only
    expected = model.run_with_hooks(
        toks, fwd_hooks=[(hook_name(1, "messages"), partial(zero_head, 2))]
    )
    assert_close(twin(toks), expected)
    assert not torch.allclose(model(toks), expected)


def test_survives_to_device_and_dtype():
    model = model_of("ln_post_gemma_like")
    install(model)
    model.to("cpu", print_details=False)
    model.to(torch.float64, print_details=False)
    plain = model_of("ln_post_gemma_like", dtype=torch.float64)
    toks = tokens()
    assert torch.equal(model(toks), plain(toks))
    _, cache = model.run_with_cache(toks, names_filter=CONN)
    assert all(value.dtype == torch.float64 for value in cache.values())
    ours = model.run_with_hooks(toks, fwd_hooks=[(hook_name(0, "messages"), partial(zero_head, 1))])
    theirs = plain.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_z", partial(zero_head, 1))])
    assert_close(ours, theirs)


def test_install_is_idempotent_and_uninstall_restores_everything():
    model = model_of("llama_gqa_rotary")
    toks = tokens()
    plain, before = model(toks), fingerprint(model)
    model.add_perma_hook("blocks.0.attn.hook_v", lambda v, hook: v)  # a user's hook survives both
    user_hooks = model.blocks[0].attn.hook_v.fwd_hooks[:]
    uninstall(model)  # not installed: a no-op
    install(model)
    once = fingerprint(model)
    install(model)
    assert fingerprint(model) == once
    assert sum(len(block.attn._forward_hooks) for block in model.blocks) == model.cfg.n_layers
    model.add_hook(hook_name(0, "messages"), lambda m, hook: 0 * m)
    uninstall(model)
    uninstall(model)
    assert model.blocks[0].attn.hook_v.fwd_hooks == user_hooks
    model.reset_hooks(including_permanent=True)
    assert fingerprint(model) == before
    assert type(model.blocks[0].attn.hook_v) is HookPoint
    assert torch.equal(model(toks), plain)
    install(model)  # and again, after a full cycle: the same names and module types
    again = fingerprint(model)
    for key in ("hook_dict", "mod_dict", "modules"):
        assert [item[:-1] for item in again[key]] == [item[:-1] for item in once[key]]
    assert torch.equal(model(toks), plain)


class OtherPluginHookPoint(HookPoint):
    """Another plugin's wrapper of an existing HookPoint, made the same way as ours."""


def test_refuses_hook_points_another_plugin_wrapped():
    model = model_of("gpt2_ln")
    model.blocks[1].attn.hook_pattern.__class__ = OtherPluginHookPoint
    before = fingerprint(model)
    with pytest.raises(
        ConnWalkError, match=r"blocks\.1\.attn\.hook_pattern is a .*OtherPluginHookPoint"
    ):
        install(model)
    assert fingerprint(model) == before  # nothing half-installed
    model.blocks[1].attn.hook_pattern.__class__ = HookPoint
    install(model)
    model.blocks[0].attn.hook_v.__class__ = OtherPluginHookPoint  # wrapped after us
    with pytest.raises(ConnWalkError, match="another plugin"):
        uninstall(model)
    with pytest.raises(ConnWalkError, match="another plugin"):
        install(model)


def test_refuses_models_without_hook_dict_and_bad_names():
    with pytest.raises(ConnWalkError, match="HookedRootModule"):
        install(torch.nn.Linear(2, 2))
    # under test, beartype refuses the Literal before our own check does
    with pytest.raises((ConnWalkError, TypeCheckError), match="hook_name|'walk', 'gates'"):
        hook_name(0, "pattern")  # type: ignore[arg-type]


def test_messages_refused_with_past_kv_cache_walk_works():
    """Generation with past_kv_cache: the walk sees the new queries; messages refuse clearly."""
    try:
        from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache
    except ImportError:  # TransformerLens 2.x
        from transformer_lens.past_key_value_caching import (
            HookedTransformerKeyValueCache as TransformerLensKeyValueCache,
        )

    model = model_of("gpt2_ln")
    install(model)
    toks = tokens()
    ones = partial(torch.ones, dtype=torch.long)
    kv_cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch_size=2)
    model(toks[:, :5], past_kv_cache=kv_cache, attention_mask=ones(2, 5))
    seen = []
    model.add_hook(hook_name(0, "walk"), lambda w, hook: seen.append(w.shape))
    model(toks[:, 5:], past_kv_cache=kv_cache, attention_mask=ones(2, 4))
    assert seen == [(2, 4, 9)]
    model.add_hook(hook_name(0, "messages"), lambda m, hook: m)
    with pytest.raises(ConnWalkError, match="past_kv_cache"):
        model(toks[:, :1], past_kv_cache=kv_cache, attention_mask=ones(2, 1))


@pytest.mark.parametrize("training", [False, True])
def test_new_points_take_the_models_mode(training):
    """A model in eval mode stays all in eval mode (TransformerLens 4's patching checks this)."""
    model = model_of("gpt2_ln")
    model.train(training)
    install(model)
    assert {m.training for m in model.modules()} == {training}
