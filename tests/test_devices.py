"""Each layer's walk is built on that layer's device; device mix-ups are explained.

No second device here, so PyTorch's ``meta`` device stands in for one: one block's weights
and that layer's cache entries go to ``meta``, the other layers stay on the CPU, like a model
split over two devices. Any operation mixing a CPU tensor with a meta tensor raises, and a
result on the CPU (say, from a hidden ``.to(cfg.device)`` or a tensor created without a
device) would show, so this proves that the walk of a layer, its exact attention output,
its effective transports and its generator are computed on the layer's own device, whatever
the other layers' devices. It does not prove the measurements (``laplacian_residual``,
``geometry_table``): they take data-dependent decisions (finiteness checks, ``.item()``) that
meta tensors cannot answer; nor anything about speed or transfers on real accelerators.
"""

import pytest
import torch

import tl_connwalk
import tl_connwalk.adapters.hooked_transformer as hooked_adapter
from tests.architectures import attention_output, build, hooked_only, tokens
from tests.tolerances import assert_close
from tl_connwalk.toy import random_bridge


def _layer_to_meta(model, cache, layer: int) -> None:
    """Move block ``layer`` and its cache entries to ``meta``, as if on a second device."""
    model.blocks[layer].to("meta")
    for name in tl_connwalk.required_hooks(model, layer):
        cache.cache_dict[name] = cache.cache_dict[name].to("meta")


@hooked_only
def test_each_layer_is_built_on_its_own_device(monkeypatch):
    model = build("llama_gqa_rotary")  # grouped-query heads, RMS norm weights applied to x
    _, cache = model.run_with_cache(tokens())
    expected = attention_output(model, cache, 0)
    _layer_to_meta(model, cache, 1)
    # The processing flags are read off the weights' values, which meta tensors do not have.
    monkeypatch.setattr(hooked_adapter, "inferred_processing", lambda W_O, b_V: {})
    on_meta = tl_connwalk.connection_walk(cache, 1)
    for tensor in (on_meta.walk, on_meta.gates, on_meta.field, on_meta.W_V, on_meta.W_O):
        assert tensor.is_meta
    assert (on_meta.apply() + on_meta.bias()).is_meta
    assert on_meta.effective_transport(3, 1).AB.is_meta
    assert on_meta.generator().to_dense().is_meta
    assert on_meta.walk.shape == (2, 9, 9)
    on_cpu = tl_connwalk.connection_walk(cache, 0)  # the other "device" still works exactly
    assert on_cpu.walk.device.type == "cpu"
    assert_close(on_cpu.apply() + on_cpu.bias(), expected)


def _bridge_and_cache():
    model = random_bridge("llama", n_layers=2)
    _, cache = model.run_with_cache(tokens(pos=6).clamp(max=63))
    return model, cache


@pytest.mark.parametrize("layer", [0, 1])
def test_cache_entries_of_one_layer_on_two_devices(layer):
    model, cache = _bridge_and_cache()
    pattern, field = tl_connwalk.required_hooks(model, layer)
    cache.cache_dict[pattern] = cache.cache_dict[pattern].to("meta")
    message = (
        rf"layer {layer}: its cached tensors are on different devices \({pattern} on meta, "
        rf"{field} on cpu\).*cache = cache.to\(device\)"
    )
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.connection_walk(cache, layer)


def test_offloaded_weights_are_explained():
    model, cache = _bridge_and_cache()
    model.blocks[1].to("meta")  # what accelerate's cpu/disk offload leaves in the module
    with pytest.raises(
        tl_connwalk.ConnWalkError,
        match=r"(?s)layer 1: its attention weights are on the meta device.*blocks\.1\.attn\..* on "
        r"meta.*while its cache is on cpu.*every layer on a real device",
    ):
        tl_connwalk.connection_walk(cache, 1)
    assert tl_connwalk.connection_walk(cache, 0).walk.device.type == "cpu"


def test_a_cache_without_values_is_explained():
    model, cache = _bridge_and_cache()
    for name in tl_connwalk.required_hooks(model, 0):
        cache.cache_dict[name] = cache.cache_dict[name].to("meta")
    with pytest.raises(
        tl_connwalk.ConnWalkError,
        match=r"layer 0: its cache entries are meta tensors without values.*weights hold data",
    ):
        tl_connwalk.connection_walk(cache, 0)


def test_tokens_go_to_the_embedding_device():
    from tl_connwalk.corpus import _input_device

    model = random_bridge("llama", n_layers=2)
    assert _input_device(model) == torch.device("cpu")
    model.embed.to("meta")  # offloaded: accelerate's hooks move the inputs, so leave them
    assert _input_device(model) is None
