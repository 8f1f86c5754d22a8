"""Transport ablations (tl_connwalk.ablations) on toy ``TransformerBridge`` models.

TransformerLens 3.x and 4.x, with and without compatibility mode, GPT-2, grouped-query Llama
and Gemma 3 (``ln1_post``). References are the Bridge's own runs: zero-ablation at ``hook_z``,
the mean pattern written at ``hook_pattern``, and, for the transport patches, the output
projection re-run by hand with the patched output weights ``W_O^h R^h``
(``core.transport_patches.patched_output_weights``) from the cached ``hook_z``.
"""

import functools

import pandas as pd
import pytest
import torch
from einops import einsum

from tests.architectures import BRIDGE_DECODERS, BRIDGES, bridge_tokens
from tests.tolerances import assert_close, atol, rtol
from tl_connwalk import ablations
from tl_connwalk.adapters.weights import expand_kv_heads
from tl_connwalk.core import transport_patches
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.toy import random_bridge

LAYER = 1


def zero_z(heads, z, hook):
    return z.index_fill(2, torch.tensor(heads), 0.0)


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
@pytest.mark.parametrize("head", [2, None])
def test_zero_transport_is_tl_zero_ablation(bridge, head):
    heads = list(range(bridge.cfg.n_heads)) if head is None else [head]
    tl_zero = [(f"blocks.{LAYER}.attn.hook_z", functools.partial(zero_z, heads))]
    ours = ablations.zero_transport(bridge, LAYER, head)
    clean, clean_out = projection_output(bridge, [])
    expected, tl_out = projection_output(bridge, tl_zero)
    actual, ours_out = projection_output(bridge, ours)
    # the output projection's final value (after tl_connwalk's correction), bias included
    # rounding relative to the clean output: zeroed heads leave out - sum_h A^h m^h
    tol = rtol(torch.float32)
    floor = tol * clean_out.abs().max().item()
    torch.testing.assert_close(ours_out, tl_out, rtol=tol, atol=floor)
    assert not torch.allclose(actual, clean)
    if head is None and hasattr(bridge.blocks[LAYER], "ln1_post"):
        # whole layer: TL's output is exactly 0, ours float rounding (out - sum_h A^h m^h), and
        # Gemma's ln1_post scales that rounding by up to 1/sqrt(eps): the logits differ ~1e-4
        return
    assert_close(actual, expected)


def projection_output(bridge, fwd_hooks):
    """Logits and the final output of ``attn.o`` (a torch hook registered after ours)."""
    seen = {}
    handle = bridge.blocks[LAYER].attn.o.register_forward_hook(
        lambda module, args, output: seen.__setitem__("out", output.detach().clone())
    )
    try:
        logits = bridge.run_with_hooks(bridge_tokens(), fwd_hooks=fwd_hooks)
    finally:
        handle.remove()
    return logits, seen["out"]


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
@pytest.mark.parametrize("heads", [None, [0, 2]])
def test_uniform_gates_is_mean_pattern(bridge, heads):
    chosen = list(range(bridge.cfg.n_heads)) if heads is None else heads

    def mean_pattern(pattern, hook):
        pattern = pattern.clone()
        pattern[:, chosen] = pattern[:, chosen].mean(1, keepdim=True)
        return pattern

    expected = bridge.run_with_hooks(
        bridge_tokens(), fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", mean_pattern)]
    )
    actual = bridge.run_with_hooks(
        bridge_tokens(), fwd_hooks=ablations.uniform_gates(bridge, LAYER, heads=heads)
    )
    assert_close(actual, expected)
    assert not torch.allclose(actual, bridge(bridge_tokens()))


@pytest.mark.parametrize("bridge", BRIDGE_DECODERS, indirect=True)
@pytest.mark.parametrize("kind", ["isometric", "scalar"])
@pytest.mark.parametrize("head", [1, None])
def test_transport_patch_is_patched_output_weights(bridge, kind, head):
    """Patched run == ``attn.o`` output plus ``sum_h z^h (W_O^h R^h - W_O^h)`` from hook_z."""
    attn = bridge.blocks[LAYER].attn
    W_O = attn.W_O.detach()
    W_V = expand_kv_heads(attn.W_V.detach(), W_O.shape[0])  # KV heads expanded by hand
    read, write = getattr(transport_patches, f"{kind}_message_map")(W_V, W_O)
    delta = transport_patches.patched_output_weights(W_O, read, write).to(W_O) - W_O
    if head is not None:
        keep = torch.zeros(W_O.shape[0], 1, 1)
        keep[head] = 1.0
        delta = delta * keep
    z = {}

    def grab_z(value, hook):
        z["z"] = value

    def add_delta(out, hook):
        return out + einsum(z["z"], delta, "b q h e, h e d -> b q d")

    expected = bridge.run_with_hooks(
        bridge_tokens(),
        fwd_hooks=[
            (f"blocks.{LAYER}.attn.hook_z", grab_z),
            (f"blocks.{LAYER}.attn.o.hook_out", add_delta),
        ],
    )
    patch = getattr(ablations, f"{kind}_transport")(bridge, LAYER, head)
    actual = bridge.run_with_hooks(bridge_tokens(), fwd_hooks=patch)
    assert_close(actual, expected)
    assert not torch.allclose(actual, bridge(bridge_tokens()))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_ablation_sweep_on_a_bridge(arch):
    model = random_bridge(arch)
    names_before = sorted(model.hook_dict)
    table = ablations.ablation_sweep(model, bridge_tokens(), layers=[LAYER], progress=False)
    n_heads = model.cfg.n_heads
    assert len(table) == 4 * (n_heads + 1) + 1
    zero = table[table.ablation == "zero"]
    torch.testing.assert_close(
        torch.tensor(zero.loss_ablated.values),
        torch.tensor(zero.loss_tl_zero.values),
        rtol=rtol(torch.float32),
        atol=atol(torch.float32),  # a mean of log-probabilities, ~1 in size
    )
    assert table.loss_ablated.notna().all() and (table.delta_loss.abs() > 0).all()
    assert sorted(model.hook_dict) == names_before  # detached again


def test_ablation_sweep_metric_and_positions_on_a_bridge():
    """The loss at chosen positions, against the Bridge's own hook_z zero-ablation read by hand."""
    model = random_bridge("llama")
    toks = bridge_tokens()
    positions = [2, 4]
    table = ablations.ablation_sweep(
        model, toks, ("zero",), [LAYER], ["all"], progress=False, positions=positions
    )
    heads = list(range(model.cfg.n_heads))
    logits = model.run_with_hooks(
        toks, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", functools.partial(zero_z, heads))]
    )
    log_probs = logits.double().log_softmax(-1)[:, positions]
    expected = -log_probs.gather(-1, toks[:, [p + 1 for p in positions], None]).mean().item()
    assert table.loss_ablated.item() == pytest.approx(expected, rel=rtol(torch.float32, 4096))
    assert table.loss_tl_zero.item() == pytest.approx(expected, rel=rtol(torch.float32, 4096))


def test_ablation_sweep_takes_text():
    """Text is tokenised with the model, as tl_connwalk.attribute does; texts of different
    lengths, which would need padding, are refused (the sweep runs without a mask)."""
    model = random_bridge("gpt2")
    text = "t1 t2 t3 t4 t5 t6"
    options = dict(ablations=("zero",), layers=[LAYER], heads=[0, "all"], progress=False)
    from_text = ablations.ablation_sweep(model, [text, text], **options)
    from_tokens = ablations.ablation_sweep(model, model.to_tokens([text, text]), **options)
    pd.testing.assert_frame_equal(from_text, from_tokens)
    with pytest.raises(ConnWalkError, match="different lengths"):
        ablations.ablation_sweep(model, [text, "t1 t2"], **options)


@pytest.mark.parametrize("bridge", [b for b in BRIDGES if b[0] == "bert"], indirect=True)
def test_bert_ablations_refuse_clearly(bridge):
    with pytest.raises(ConnWalkError, match="after the attention output"):
        bridge.run_with_hooks(bridge_tokens(), fwd_hooks=ablations.zero_transport(bridge, LAYER, 0))
