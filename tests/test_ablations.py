"""Transport ablations (tl_connwalk.ablations) on tiny random HookedTransformers.

References are TransformerLens's own runs: zero-ablation at ``hook_z``, the mean pattern written
at ``hook_pattern``, mean values at ``hook_v``, and a copy of the model whose ``W_O`` is
replaced by the equivalent patched output weights; the patched head maps are checked against a
dense float64 SVD of ``model.OV``, fitted from the values and messages the patched run sent.
"""

import hashlib
from functools import partial

import pandas as pd
import pytest
import torch
from jaxtyping import TypeCheckError

import tl_connwalk
from tests.architectures import build, hooked_only, tokens
from tests.tolerances import assert_close, atol, rtol
from tl_connwalk import ablations
from tl_connwalk.core import transport_patches
from tl_connwalk.core.isometry import head_transport_defects
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.hooks import hook_name

pytestmark = hooked_only


def fit_rtol(values):
    """A head map fitted by least squares from float32 activations ``values`` is off by
    float32 rounding times their condition number (relative to the map's largest entry)."""
    return rtol(torch.float32) * torch.linalg.cond(values).item()


LAYER = 1


@pytest.fixture(scope="module")
def model():
    model = build("gpt2_ln")  # b_V != 0: the bias must ride through the patch
    tl_connwalk.attach(model)
    yield model
    tl_connwalk.detach(model)


def zero_z(heads, z, hook):
    return z.index_fill(2, torch.tensor(heads), 0.0)


@pytest.mark.parametrize("arch", ["gpt2_ln", "llama_gqa_rotary", "ln_post_gemma_like"])
@pytest.mark.parametrize("head", [2, None])
def test_zero_transport_is_tl_zero_ablation(arch, head):
    model = tl_connwalk.attach(build(arch))
    toks = tokens()
    heads = list(range(model.cfg.n_heads)) if head is None else [head]
    expected = model.run_with_hooks(
        toks, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", partial(zero_z, heads))]
    )
    actual = model.run_with_hooks(toks, fwd_hooks=ablations.zero_transport(model, LAYER, head))
    assert_close(actual, expected)
    assert not torch.allclose(actual, model(toks))


def test_uniform_gates_is_mean_pattern(model):
    toks = tokens()

    def mean_pattern(pattern, hook):
        return pattern.mean(1, keepdim=True).expand_as(pattern)

    expected = model.run_with_hooks(
        toks, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", mean_pattern)]
    )
    assert_close(
        model.run_with_hooks(toks, fwd_hooks=ablations.uniform_gates(model, LAYER)), expected
    )


@pytest.mark.parametrize("per_sequence", [False, True])
def test_mean_transport_is_mean_value(model, per_sequence):
    """Rows of A sum to 1, so the mean message is the mean value read out by W_O."""
    toks = tokens()
    dims = (1,) if per_sequence else (0, 1)

    def mean_v(v, hook):
        v = v.clone()
        v[:, :, 1] = v[:, :, 1].mean(dims, keepdim=True)
        return v

    expected = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_v", mean_v)])
    patch = ablations.mean_transport(model, LAYER, head=1, per_sequence=per_sequence)
    assert_close(model.run_with_hooks(toks, fwd_hooks=patch), expected)


def run_recording(model, patch, toks):
    """Logits of the patched run, with the final hook_v and messages it used."""
    seen = {}

    def record(key, tensor, hook):
        seen[key] = tensor.detach().clone()

    fwd_hooks = [
        *patch,
        (hook_name(LAYER, "messages"), partial(record, "messages")),
        (f"blocks.{LAYER}.attn.hook_v", partial(record, "v")),
    ]
    return model.run_with_hooks(toks, fwd_hooks=fwd_hooks), seen["v"], seen["messages"]


def dense_target(model, head, kind):
    T = model.OV[LAYER, head].AB.double()
    U, sigma, Vh = torch.linalg.svd(T)
    d_head = model.cfg.d_head
    U, sigma, Vh = U[:, :d_head], sigma[:d_head], Vh[:d_head]
    return sigma.mean() * (U @ Vh if kind == "isometric" else U @ U.T)


@pytest.mark.parametrize("kind", ["isometric", "scalar"])
def test_transport_patch_effective_map_is_exact(model, kind):
    """Fit the head's read-out W_O' from (v, m') of the patched run; W_V W_O' is the target."""
    make = getattr(ablations, f"{kind}_transport")
    toks = tokens(batch=3)
    head = 2
    logits, v, messages = run_recording(model, make(model, LAYER, head), toks)
    values = v[:, :, head].reshape(-1, model.cfg.d_head).double()
    sent = messages[:, :, head].reshape(-1, model.cfg.d_model).double()
    W_O_fit = torch.linalg.lstsq(values, sent).solution
    W_V = model.W_V[LAYER, head].double()
    target = dense_target(model, head, kind)
    fit = fit_rtol(values)
    torch.testing.assert_close(W_V @ W_O_fit, target, rtol=0, atol=fit * target.abs().max().item())
    defect = head_transport_defects(W_V[None], W_O_fit[None])
    assert defect.item() < fit  # centred: linear in the fit's error
    assert head_transport_defects(W_V[None], model.W_O[LAYER, head][None].double()).item() > 0.05
    # untouched heads send their usual messages
    clean = torch.einsum("bkhe,hed->bkhd", v, model.W_O[LAYER])
    others = [h for h in range(model.cfg.n_heads) if h != head]
    assert_close(messages[:, :, others], clean[:, :, others])

    # the same logits as a model whose W_O^h is the fitted read-out
    edited = build("gpt2_ln")
    with torch.no_grad():
        edited.blocks[LAYER].attn.W_O[head] = W_O_fit.float()
    expected = edited(toks)  # fitted, not exact, weights: the fit's tolerance
    torch.testing.assert_close(logits, expected, rtol=0, atol=fit * expected.abs().max().item())


@pytest.mark.parametrize("arch", ["gpt2_ln", "llama_gqa_folded", "ln_post_gemma_like"])
@pytest.mark.parametrize("kind", ["isometric", "scalar"])
def test_transport_patch_is_a_model_with_patched_output_weights(arch, kind):
    """Every head patched == the plain model with W_O^h := W_O^h R^h (bias b_V kept), bit-close."""
    model = tl_connwalk.attach(build(arch))
    toks = tokens()
    make = getattr(transport_patches, f"{kind}_message_map")
    attn = model.blocks[LAYER].attn
    W_O_patched = transport_patches.patched_output_weights(
        attn.W_O, *make(attn.W_V.detach(), attn.W_O.detach())
    )
    edited = build(arch)
    with torch.no_grad():
        edited.blocks[LAYER].attn.W_O.copy_(W_O_patched.float())
    patch = getattr(ablations, f"{kind}_transport")(model, LAYER)
    assert_close(model.run_with_hooks(toks, fwd_hooks=patch), edited(toks))


@pytest.mark.parametrize("kind", ["isometric", "scalar"])
def test_transport_patch_all_heads(model, kind):
    make = getattr(ablations, f"{kind}_transport")
    toks = tokens()
    _, v, messages = run_recording(model, make(model, LAYER), toks)
    for head in range(model.cfg.n_heads):
        values = v[:, :, head].reshape(-1, model.cfg.d_head).double()
        sent = messages[:, :, head].reshape(-1, model.cfg.d_model).double()
        W_O_fit = torch.linalg.lstsq(values, sent).solution
        target = dense_target(model, head, kind)
        product = model.W_V[LAYER, head].double() @ W_O_fit
        torch.testing.assert_close(
            product, target, rtol=0, atol=fit_rtol(values) * target.abs().max().item()
        )


def test_message_patch_runs_user_callable(model):
    toks = tokens()
    assert_close(
        model.run_with_hooks(toks, fwd_hooks=ablations.message_patch(LAYER, lambda m: m)),
        model(toks),
    )
    zeroed = ablations.message_patch(LAYER, lambda m: m.index_fill(2, torch.tensor([0]), 0.0))
    assert_close(
        model.run_with_hooks(toks, fwd_hooks=zeroed),
        model.run_with_hooks(toks, fwd_hooks=ablations.zero_transport(model, LAYER, 0)),
    )


def test_factories_refuse_bad_input(model):
    with pytest.raises(ConnWalkError, match="layer"):
        ablations.zero_transport(model, 7)
    with pytest.raises(ConnWalkError, match="head"):
        ablations.isometric_transport(model, 0, head=9)
    with pytest.raises(ConnWalkError, match="attach"):
        ablations.uniform_gates(build("gpt2_ln"), 0)
    with pytest.raises((ConnWalkError, TypeCheckError), match="ablation|nope"):
        ablations.ablation_sweep(model, tokens(), ablations=("nope",), progress=False)


def fingerprint(model):
    return (
        {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()},
        [(k, id(v)) for k, v in model.hook_dict.items()],
    )


def check_sweep(table, model, layers):
    n_heads = model.cfg.n_heads
    per_layer = 4 * (n_heads + 1) + 1  # four head-wise ablations on heads and "all"; gates once
    assert len(table) == per_layer * len(layers)
    assert list(table.columns) == [
        "layer", "head", "ablation", "loss_clean", "loss_ablated", "delta_loss",
        "loss_tl_zero", "delta_loss_tl_zero",
    ]  # fmt: skip
    assert set(table[table.ablation == "uniform_gates"]["head"]) == {"all"}
    assert not table.duplicated(["layer", "head", "ablation"]).any()
    pd.testing.assert_series_equal(
        table.delta_loss, table.loss_ablated - table.loss_clean, check_names=False
    )
    zero = table[table.ablation == "zero"]
    torch.testing.assert_close(
        torch.tensor(zero.loss_ablated.values),
        torch.tensor(zero.loss_tl_zero.values),
        rtol=rtol(torch.float32),
        atol=atol(torch.float32),  # a mean of log-probabilities, ~1 in size
    )
    assert table.loss_clean.nunique() == 1
    # ablating a whole layer of a random model moves the loss more than one head does, usually;
    # here only its size is checked: every ablation changes the loss, none makes it NaN
    assert table.loss_ablated.notna().all() and (table.delta_loss.abs() > 0).all()


def test_ablation_sweep_leaves_unattached_model_as_found():
    model = build("gpt2_ln")
    before = fingerprint(model)
    table = ablations.ablation_sweep(model, tokens(), progress=False)
    check_sweep(table, model, layers=[0, 1])
    assert fingerprint(model) == before
    assert not tl_connwalk.is_attached(model)
    assert hook_name(0, "messages") not in model.hook_dict


def test_ablation_sweep_keeps_attached_model_attached(model):
    before = fingerprint(model)
    table = ablations.ablation_sweep(model, tokens(), layers=[LAYER], progress=False)
    check_sweep(table, model, layers=[LAYER])
    assert fingerprint(model) == before
    assert tl_connwalk.is_attached(model)
    assert all(not p.fwd_hooks for p in model.hook_dict.values())


def test_ablation_sweep_subsets(model):
    table = ablations.ablation_sweep(
        model, tokens(), ablations=("zero", "uniform_gates"), layers=[0], heads=[1, "all"],
        progress=False,
    )  # fmt: skip
    assert list(zip(table["head"], table.ablation, strict=True)) == [
        (1, "zero"), ("all", "zero"), ("all", "uniform_gates"),
    ]  # fmt: skip
