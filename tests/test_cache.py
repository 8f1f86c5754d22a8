"""connection_walk on caches: the hooks it needs, and the errors for everything else."""

import inspect
import re

import pytest
import torch
from torch import nn
from transformer_lens import ActivationCache

import tl_connwalk
from tests.architectures import attention_output, bridge_tokens, build, hooked_only, tokens
from tests.tolerances import assert_close
from tl_connwalk.toy import random_bridge

# Under test, jaxtyping+beartype reject wrong argument types before our checks run; users run
# without them, so the messages they see come from the undecorated function.
unchecked_connection_walk = inspect.unwrap(tl_connwalk.connection_walk)


def test_required_hooks_are_enough(arch):
    model = build(arch)
    names = tl_connwalk.required_hooks(model)
    assert len(names) == 2 * model.cfg.n_layers
    _, cache = model.run_with_cache(tokens(), names_filter=names)
    assert set(cache.keys()) == set(names)
    _, full = model.run_with_cache(tokens())
    for layer in range(model.cfg.n_layers):
        assert_close(
            tl_connwalk.connection_walk(cache, layer).apply(),
            tl_connwalk.connection_walk(full, layer).apply(),
        )


def check_walk_matrix_reads_only_patterns(model, tokens):
    patterns = [n for n in tl_connwalk.required_hooks(model) if n.endswith("hook_pattern")]
    _, cache = model.run_with_cache(tokens, names_filter=patterns)
    _, full = model.run_with_cache(tokens)
    for layer in range(model.cfg.n_layers):
        walk = tl_connwalk.walk_matrix(cache, layer)
        assert walk.dtype == torch.float32
        assert torch.equal(walk, tl_connwalk.connection_walk(full, layer).walk)
    assert torch.equal(tl_connwalk.layer_drift(cache), tl_connwalk.layer_drift(full))
    with pytest.raises(tl_connwalk.ConnWalkError, match="lacks"):
        tl_connwalk.connection_walk(cache, 0)  # the walk itself needs the field too


def test_walk_matrix_reads_only_the_patterns(arch):
    check_walk_matrix_reads_only_patterns(build(arch), tokens())


@pytest.mark.parametrize("bridge_arch", ["gpt2", "llama", "gemma3", "bert"])
def test_walk_matrix_reads_only_the_patterns_on_bridges(bridge_arch):
    check_walk_matrix_reads_only_patterns(random_bridge(bridge_arch), bridge_tokens())


def test_walk_matrix_names_a_missing_pattern(gpt2):
    names = [n for n in tl_connwalk.required_hooks(gpt2) if n != "blocks.1.attn.hook_pattern"]
    _, cache = gpt2.run_with_cache(tokens(), names_filter=names)
    with pytest.raises(tl_connwalk.ConnWalkError, match=r"lacks \['blocks.1.attn.hook_pattern'\]"):
        tl_connwalk.walk_matrix(cache, 1)
    with pytest.raises(tl_connwalk.ConnWalkError, match="walk matrix of layer 1"):
        tl_connwalk.layer_drift(cache)


def test_missing_hooks_are_named_with_a_fix(gpt2):
    without_patterns = [n for n in tl_connwalk.required_hooks(gpt2) if "hook_pattern" not in n]
    _, cache = gpt2.run_with_cache(tokens(), names_filter=without_patterns)
    needed = tl_connwalk.required_hooks(gpt2, 1)
    assert needed[0] == "blocks.1.attn.hook_pattern"
    message = r"(?s)lacks \['blocks.1.attn.hook_pattern'\].*" + re.escape(
        f"names_filter={needed!r}"
    )
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.connection_walk(cache, 1)


@pytest.mark.parametrize("layer", [2, -3, 100])
def test_layer_out_of_range(gpt2, layer):
    _, cache = gpt2.run_with_cache(tokens())
    with pytest.raises(
        tl_connwalk.ConnWalkError, match=f"layer {layer} is out of range: this model has 2"
    ):
        tl_connwalk.connection_walk(cache, layer)


def test_negative_layer_counts_from_the_end(gpt2):
    _, cache = gpt2.run_with_cache(tokens())
    assert tl_connwalk.connection_walk(cache, -1).layer == 1
    with pytest.raises(tl_connwalk.ConnWalkError, match="layer must be an int .*, got str"):
        unchecked_connection_walk(cache, "1")


@pytest.mark.parametrize("mask", [False, True])
def test_connection_walks_are_each_layers_connection_walk(gpt2, mask):
    """A group of layers built at once (their padding read together) equals each layer's
    `connection_walk`, on a left-padded batch, with its mask or with the padding detected."""
    toks = tokens()
    attention_mask = torch.ones_like(toks)
    attention_mask[0, :3] = 0
    _, cache = gpt2.run_with_cache(toks, attention_mask=attention_mask)
    given = attention_mask if mask else None
    walks = tl_connwalk.cache.connection_walks(cache, [1, 0], attention_mask=given)
    for walk, layer in zip(walks, [1, 0], strict=True):
        alone = tl_connwalk.connection_walk(cache, layer, attention_mask=given)
        assert walk.layer == layer
        assert torch.equal(walk.attention_mask, alone.attention_mask)
        assert torch.equal(walk.attention_mask[0], torch.arange(9) >= 3)
        for name in ("walk", "gates", "field", "W_V", "W_O"):
            assert torch.equal(getattr(walk, name), getattr(alone, name)), name


def test_unsupported_model_is_named():
    cache = ActivationCache({}, nn.Linear(2, 2))
    with pytest.raises(
        tl_connwalk.ConnWalkError,
        match="does not support torch.nn.modules.linear.Linear; supported",
    ):
        tl_connwalk.connection_walk(cache, 0)


def test_not_a_cache_and_cache_without_model(gpt2):
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="expected a transformer_lens ActivationCache, got dict"
    ):
        unchecked_connection_walk({}, 0)
    _, cache = gpt2.run_with_cache(tokens())
    orphan = ActivationCache(cache.cache_dict, None)  # type: ignore[arg-type]
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="pass it: connection_walk\\(cache, layer, model=model\\)"
    ):
        tl_connwalk.connection_walk(orphan, 0)
    assert_close(
        tl_connwalk.connection_walk(orphan, 0, model=gpt2).apply(),
        tl_connwalk.connection_walk(cache, 0).apply(),
    )


def test_sliced_caches(gpt2):
    _, cache = gpt2.run_with_cache(tokens(batch=3))
    whole = tl_connwalk.connection_walk(cache, 1)
    one = tl_connwalk.connection_walk(cache.apply_slice_to_batch_dim(2), 1)
    some = tl_connwalk.connection_walk(cache.apply_slice_to_batch_dim(slice(0, 2)), 1)
    assert one.walk.shape == (1, 9, 9)
    assert_close(one.apply(), whole.apply()[2:])
    assert_close(some.apply(), whole.apply()[:2])


def test_single_token_sequence(gpt2):
    _, cache = gpt2.run_with_cache(tokens(pos=1))
    walk = tl_connwalk.connection_walk(cache, 0)
    assert_close(walk.walk, torch.ones(2, 1, 1))
    assert_close(walk.apply() + walk.bias(), attention_output(gpt2, cache, 0))


def test_measurements_do_not_mutate_the_cache(gpt2):
    _, cache = gpt2.run_with_cache(tokens())
    before = {name: value.clone() for name, value in cache.items()}
    walk = tl_connwalk.connection_walk(cache, 0)
    walk.apply(), walk.bias(), walk.generator().to_dense(), walk.effective_transport(2, 1).AB
    for name, value in cache.items():
        assert torch.equal(value, before[name]), name


OTHER_MODEL_FIX = re.escape(
    "Pass the model that made the cache, connection_walk(cache, layer, model=that_model), or "
    "make a cache with this one: `_, cache = model.run_with_cache(tokens)`."
)


def test_cache_from_another_model_is_named():
    """Another class or other sizes: both models are described, whatever hooks it holds."""
    _, cache = random_bridge("gpt2").run_with_cache(tokens())
    other = random_bridge("llama", n_heads=2, d_model=16)
    message = (
        r"this cache was made by another model, a TransformerBridge \(n_layers=2, d_model=32, "
        r"n_heads=4, d_head=8\), not the TransformerBridge \(n_layers=2, d_model=16, n_heads=2, "
        r"d_head=8\) passed\. " + OTHER_MODEL_FIX
    )
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.connection_walk(cache, 0, model=other)


@hooked_only
def test_a_cache_of_another_model_class_is_named():
    _, cache = random_bridge("gpt2").run_with_cache(tokens())
    with pytest.raises(tl_connwalk.ConnWalkError, match="not the HookedTransformer"):
        tl_connwalk.walk_matrix(cache, 0, model=build("gpt2_ln"))


@hooked_only
def test_another_model_of_the_same_sizes_is_named_not_a_names_filter():
    """A cache of a model without LayerNorm lacks the normalised input another model reads:
    the cause is the model passed, not a names_filter."""
    _, cache = build("attn_only_no_norm").run_with_cache(tokens())
    message = (
        r"this cache was made by another model, a HookedTransformer \(n_layers=2, d_model=24, "
        r"n_heads=4, d_head=4\), not the one passed \(same sizes\)\. It lacks "
        r"\['blocks\.0\.ln1\.hook_normalized'\], which the model passed reads\. " + OTHER_MODEL_FIX
    )
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.connection_walk(cache, 0, model=build("gpt2_ln"))


@hooked_only
def test_a_cache_without_its_model_is_matched_by_hook_names_and_shapes(gpt2):
    """Without ``cache.model``: hooks the model does not have, or a field of another width."""
    names = [n for n in gpt2.hook_dict if "mlp" in n or "hook_pattern" in n]
    _, filtered = gpt2.run_with_cache(tokens(), names_filter=names)
    bare = ActivationCache(filtered.cache_dict, None)
    other = build("attn_only_no_norm")
    foreign = [name for name in filtered.cache_dict if name not in other.hook_dict]
    assert foreign[0] == "blocks.0.mlp.hook_pre"
    message = (
        r"this cache was made by another model: it lacks \['blocks\.0\.hook_resid_pre'\], which "
        r"this HookedTransformer \(n_layers=2, d_model=24, n_heads=4, d_head=4\) needs, and "
        rf"holds {len(foreign)} hooks that this model does not have "
        r"\(blocks\.0\.mlp\.hook_pre, .*\)\. " + OTHER_MODEL_FIX
    )
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.connection_walk(bare, 0, model=other)
    _, bridge_cache = random_bridge("gpt2").run_with_cache(tokens())
    with pytest.raises(
        tl_connwalk.ConnWalkError,
        match=r"blocks\.0\.ln1\.hook_normalized has shape \(2, 9, 32\) \[batch, pos, d_model\] but "
        r"the model has d_model=24 .*was this cache made by another model\?",
    ):
        tl_connwalk.connection_walk(ActivationCache(bridge_cache.cache_dict, None), 0, model=gpt2)


@pytest.mark.parametrize(
    "make", [pytest.param(build, marks=hooked_only), random_bridge], ids=["hooked", "bridge"]
)
def test_a_negative_pattern_names_layer_hook_head_and_place(make):
    model = make("gpt2_ln" if make is build else "gpt2")
    _, cache = model.run_with_cache(tokens())
    cache.cache_dict["blocks.1.attn.hook_pattern"][1, 2, 4, 1] = -0.5
    message = (
        r"layer 1: blocks\.1\.attn\.hook_pattern has negative entries in heads \[2\], the first "
        r"at batch 1, head 2, query 4, key 1 \(-0\.5\); attention patterns are probabilities "
        r">= 0 .*\(spec §1\)\. Was the pattern edited by a hook\? Run the cache without that hook"
    )
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.connection_walk(cache, 1)


def test_nan_pattern_names_layer_and_head(gpt2):
    _, cache = gpt2.run_with_cache(tokens())
    cache.cache_dict["blocks.1.attn.hook_pattern"][1, 2, 3, 0] = float("nan")
    with pytest.raises(tl_connwalk.ConnWalkError, match=r"layer 1: .* NaN or Inf in heads \[2\]"):
        tl_connwalk.connection_walk(cache, 1)


def test_wrong_batch_flag_is_explained(gpt2):
    _, cache = gpt2.run_with_cache(tokens())
    lying = ActivationCache(cache.cache_dict, gpt2, has_batch_dim=False)
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="has_batch_dim=False — does that match its tensors"
    ):
        tl_connwalk.connection_walk(lying, 0)
