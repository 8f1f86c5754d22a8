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

#: two forward passes whose losses are compared: sums over every layer of the model
FORWARD_TERMS = 4096
#: a metric (a loss or logit difference) of two such runs, relative
METRIC_RTOL = rtol(torch.float32, FORWARD_TERMS)

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


def mean_pattern(heads, pattern, hook):
    """The chosen heads' patterns replaced by their mean, by hand at ``hook_pattern``."""
    pattern = pattern.clone()
    pattern[:, heads] = pattern[:, heads].mean(1, keepdim=True)
    return pattern


def test_uniform_gates_is_mean_pattern(model):
    toks = tokens()
    every = list(range(model.cfg.n_heads))
    expected = model.run_with_hooks(
        toks, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", partial(mean_pattern, every))]
    )
    assert_close(
        model.run_with_hooks(toks, fwd_hooks=ablations.uniform_gates(model, LAYER)), expected
    )


@pytest.mark.parametrize("arch", ["gpt2_ln", "llama_gqa_rotary", "ln_post_gemma_like"])
@pytest.mark.parametrize("heads", [[0, 2], [3, 1, 2]])
def test_uniform_gates_of_chosen_heads(arch, heads):
    """Chosen heads get their mean pattern (TransformerLens hook_pattern edited by hand); their
    total gate on every edge and every other head's gate are kept."""
    model = tl_connwalk.attach(build(arch))
    toks = tokens()
    expected = model.run_with_hooks(
        toks, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", partial(mean_pattern, heads))]
    )
    seen = {}

    def record(key, gates, hook):
        seen[key] = gates.detach().clone()

    gates_name = hook_name(LAYER, "gates")
    model.run_with_hooks(toks, fwd_hooks=[(gates_name, partial(record, "clean"))])
    patch = ablations.uniform_gates(model, LAYER, heads=heads)
    actual = model.run_with_hooks(toks, fwd_hooks=[*patch, (gates_name, partial(record, "new"))])
    assert_close(actual, expected)
    assert not torch.allclose(actual, model(toks))
    clean, new = seen["clean"], seen["new"]
    others = [h for h in range(model.cfg.n_heads) if h not in heads]
    torch.testing.assert_close(new[:, others], clean[:, others], rtol=0, atol=0)
    assert_close(new[:, heads].sum(1), clean[:, heads].sum(1))
    assert_close(new[:, heads], new[:, heads[:1]].expand(-1, len(heads), -1, -1))


def test_uniform_gates_needs_two_heads(model):
    for heads in (1, [2, 2], []):
        with pytest.raises(ConnWalkError, match="at least two heads"):
            ablations.uniform_gates(model, LAYER, heads=heads)


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
        model.run_with_hooks(toks, fwd_hooks=ablations.message_patch(model, LAYER, lambda m: m)),
        model(toks),
    )

    def zero_head_0(messages):
        return messages.index_fill(2, torch.tensor([0]), 0.0)

    expected = model.run_with_hooks(
        toks, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", partial(zero_z, [0]))]
    )
    zeroed = ablations.message_patch(model, LAYER, zero_head_0)
    assert_close(model.run_with_hooks(toks, fwd_hooks=zeroed), expected)
    with pytest.warns(DeprecationWarning, match=r"message_patch\(model, layer, fn\)"):
        old_order = ablations.message_patch(LAYER, zero_head_0)
    assert [name for name, _ in old_order] == [name for name, _ in zeroed]
    assert_close(model.run_with_hooks(toks, fwd_hooks=old_order), expected)
    with pytest.raises(ConnWalkError, match="layer"):
        ablations.message_patch(model, 7, zero_head_0)
    with pytest.raises(ConnWalkError, match="attach"):
        ablations.message_patch(build("gpt2_ln"), LAYER, zero_head_0)
    with pytest.raises(ConnWalkError, match="callable"):
        ablations.message_patch(model, LAYER)


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


def loss_at(logits, toks, positions):
    """Next-token cross-entropy at ``positions`` by hand, in float64."""
    log_probs = logits.double().log_softmax(-1)
    picked = [log_probs[:, p].gather(-1, toks[:, p + 1, None])[:, 0] for p in positions]
    return -torch.stack(picked, 1).mean().item()


def tl_runs(model, toks, layer, head):
    """Logits of the clean model, TransformerLens zero-ablation at hook_z and the mean pattern
    at hook_pattern (the references of "zero" and "uniform_gates")."""
    heads = list(range(model.cfg.n_heads)) if head == "all" else [head]
    z_hook = (f"blocks.{layer}.attn.hook_z", partial(zero_z, heads))
    every = list(range(model.cfg.n_heads))
    gates_hook = (f"blocks.{layer}.attn.hook_pattern", partial(mean_pattern, every))
    return {
        "clean": model(toks),
        "zero": model.run_with_hooks(toks, fwd_hooks=[z_hook]),
        "uniform_gates": model.run_with_hooks(toks, fwd_hooks=[gates_hook]),
    }


def check_against(table, references, read, prefix):
    """Every zero / uniform_gates row, and the clean value, against ``read(reference logits)``."""
    for row in table.itertuples():
        if row.ablation not in references[row.head]:
            continue
        expected = read(references[row.head][row.ablation])
        ablated = getattr(row, f"{prefix}_ablated")
        assert ablated == pytest.approx(expected, rel=METRIC_RTOL, abs=METRIC_RTOL), row
        clean = read(references[row.head]["clean"])
        assert getattr(row, f"{prefix}_clean") == pytest.approx(
            clean, rel=METRIC_RTOL, abs=METRIC_RTOL
        )


@pytest.mark.parametrize("arch", ["gpt2_ln", "llama_gqa_rotary"])
def test_sweep_loss_at_chosen_positions(arch):
    """An induction-style loss: the default metric read only at the second half's positions."""
    model = build(arch)
    half = torch.randint(0, model.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(3))
    toks = torch.cat([half, half], dim=1)
    positions = [5, 6, 7, 8]  # each predicts a repeated token
    table = ablations.ablation_sweep(
        model, toks, ablations=("zero", "uniform_gates", "isometric"), layers=[LAYER],
        heads=[1, "all"], progress=False, positions=positions,
    )  # fmt: skip
    references = {h: tl_runs(model, toks, LAYER, h) for h in (1, "all")}
    check_against(table, references, lambda logits: loss_at(logits, toks, positions), "loss")
    assert set(zip(table["head"], table.ablation, strict=True)) == {
        (1, "zero"), (1, "isometric"), ("all", "zero"), ("all", "uniform_gates"),
        ("all", "isometric"),
    }  # fmt: skip
    # the same positions as a slice, and every position by default: TransformerLens's loss
    as_slice = ablations.ablation_sweep(
        model, toks, ("zero",), [LAYER], [1], progress=False, positions=slice(5, -1)
    )
    assert as_slice.loss_ablated.item() == table.loss_ablated.iloc[0]
    everywhere = ablations.ablation_sweep(model, toks, ("zero",), [LAYER], [1], progress=False)
    assert everywhere.loss_clean.item() == pytest.approx(
        model(toks, return_type="loss").item(), rel=METRIC_RTOL
    )
    assert everywhere.loss_ablated.item() == pytest.approx(
        loss_at(references[1]["zero"], toks, range(toks.shape[1] - 1)), rel=METRIC_RTOL
    )


def test_sweep_one_argument_metric(model):
    """metric(logits): a logit difference at the last position."""
    toks = tokens()

    def logit_diff(logits):
        return (logits[:, :, 3] - logits[:, :, 5]).mean()

    table = ablations.ablation_sweep(
        model, toks, ablations=("zero", "uniform_gates"), layers=[LAYER], heads=[2, "all"],
        progress=False, metric=logit_diff, positions=-1,
    )  # fmt: skip
    assert list(table.columns) == [
        "layer", "head", "ablation", "metric_clean", "metric_ablated", "delta_metric",
        "metric_tl_zero", "delta_metric_tl_zero",
    ]  # fmt: skip
    references = {h: tl_runs(model, toks, LAYER, h) for h in (2, "all")}

    def read(logits):
        return (logits[:, -1, 3] - logits[:, -1, 5]).double().mean().item()

    check_against(table, references, read, "metric")
    zero = table[table.ablation == "zero"]
    torch.testing.assert_close(
        torch.tensor(zero.metric_ablated.values),
        torch.tensor(zero.metric_tl_zero.values),
        rtol=rtol(torch.float32, FORWARD_TERMS),
        atol=atol(torch.float32, FORWARD_TERMS),
    )


def test_sweep_two_argument_metric(model):
    """metric(logits, targets): targets are the tokens the logits predict; default positions
    are every position but the last."""
    toks = tokens()
    seen = []

    def correct_logit(logits, targets):
        seen.append((tuple(logits.shape), targets.clone()))
        return logits.gather(-1, targets[..., None]).mean()

    table = ablations.ablation_sweep(
        model, toks, ablations=("zero",), layers=[LAYER], heads=["all"], progress=False,
        metric=correct_logit,
    )  # fmt: skip
    n_pos = toks.shape[1]
    assert seen[0][0] == (2, n_pos - 1, model.cfg.d_vocab)
    assert torch.equal(seen[0][1], toks[:, 1:])
    references = {"all": tl_runs(model, toks, LAYER, "all")}

    def read(logits):
        return logits[:, :-1].gather(-1, toks[:, 1:, None]).double().mean().item()

    check_against(table, references, read, "metric")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"positions": [8]}, "last position"),
        ({"positions": slice(5, None)}, "last position"),
        ({"positions": [9]}, "position 9 is out of range: each sequence has 9 positions"),
        ({"positions": slice(3, 3)}, "selects none"),
        ({"metric": lambda logits: logits.mean(-1)}, "one number"),
        ({"metric": lambda: 0.0}, "no positional argument"),
    ],
)
def test_sweep_refuses_bad_metric_or_positions(model, options, match):
    with pytest.raises(ConnWalkError, match=match):
        ablations.ablation_sweep(
            model, tokens(), ("zero",), [LAYER], ["all"], progress=False, **options
        )


def test_sweep_takes_one_sequence_as_a_batch_of_one(model):
    one = ablations.ablation_sweep(model, tokens()[0], ("zero",), [LAYER], ["all"], False)
    batch = ablations.ablation_sweep(model, tokens()[:1], ("zero",), [LAYER], ["all"], False)
    pd.testing.assert_frame_equal(one, batch)
    with pytest.raises((ConnWalkError, TypeCheckError), match=r"\[batch, pos\]|batch pos"):
        ablations.ablation_sweep(model, tokens()[None], ("zero",), [LAYER], progress=False)


def test_negative_layers_and_heads_count_from_the_end(model):
    """Every factory and the sweep read layer -1 and head -1 as the last ones, as Python does."""
    last_head = model.cfg.n_heads - 1
    toks = tokens()
    for factory in (
        ablations.zero_transport,
        ablations.mean_transport,
        ablations.isometric_transport,
        ablations.scalar_transport,
    ):
        negative, positive = factory(model, -1, head=-1), factory(model, LAYER, head=last_head)
        assert [name for name, _ in negative] == [name for name, _ in positive]
        assert torch.equal(
            model.run_with_hooks(toks, fwd_hooks=negative),
            model.run_with_hooks(toks, fwd_hooks=positive),
        )
    gates = ablations.uniform_gates(model, -1, heads=[0, -1])
    assert torch.equal(
        model.run_with_hooks(toks, fwd_hooks=gates),
        model.run_with_hooks(
            toks, fwd_hooks=ablations.uniform_gates(model, LAYER, heads=[0, last_head])
        ),
    )
    assert ablations.message_patch(model, -1, lambda m: m)[0][0] == hook_name(LAYER, "messages")
    table = ablations.ablation_sweep(model, toks, ("zero",), [-1], [-1], progress=False)
    assert list(zip(table["layer"], table["head"], strict=True)) == [(LAYER, last_head)]


@pytest.mark.parametrize(
    ("kinds", "heads"),
    [(("zero", "mean", "uniform_gates"), [0, 3, "all"]), (("uniform_gates",), [1, "all"])],
)
def test_sweep_announces_and_counts_its_forward_passes(model, capsys, kinds, heads):
    """The printed count and the bar's total are the forward passes the model really ran."""
    calls = []
    handle = model.embed.register_forward_hook(lambda *args: calls.append(1))
    try:
        ablations.ablation_sweep(model, tokens(), kinds, [0, LAYER], heads, progress=True)
    finally:
        handle.remove()
    err = capsys.readouterr().err
    passes = len(calls)
    assert f"ablation_sweep: {passes:,} forward passes" in err
    assert f"{passes}/{passes}" in err  # the progress bar's total, reached
    head_wise = len([k for k in kinds if k != "uniform_gates"])
    n_h, g = len(heads), int("uniform_gates" in kinds)
    if head_wise:  # the documented formula
        assert passes == 1 + 2 * (n_h * (head_wise + 1) + g)

    ablations.ablation_sweep(model, tokens(), kinds, [LAYER], heads, progress=False)
    assert capsys.readouterr().err == ""
