"""``Attribution.by_component`` and ``Attribution.edges`` against TransformerLens and autograd."""

import functools
import sys
import types
from typing import Any

import pytest
import torch

import tl_connwalk
from tests.architectures import (
    BRIDGE_DECODERS,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_only,
    tokens,
)
from tests.attribution import reference
from tests.attribution.test_connection import FROZEN_TERMS
from tests.tolerances import rtol
from tests.views.pages import Page
from tl_connwalk import Attribution
from tl_connwalk.attribution import api, connection, targets
from tl_connwalk.attribution.frozen import FrozenNetwork


def tolerance(result: Attribution) -> float:
    """The dtype's relative tolerance times the size of the sum that makes the target."""
    size = result.scores.abs().sum(-1).max() + result.bias.abs().max()
    return rtol(result.scores.dtype, FROZEN_TERMS) * size.item()


def components_by_gradients(
    model: Any, toks: torch.Tensor, target: Any, position: int, mask: Any = None
) -> torch.Tensor:
    """``by_component`` by its definition through gradients: each component's read-out at the
    target position (its output along the frozen gradient ``g`` at the final residual) is one
    output of ``F``, and its gradient with respect to the embeddings, times the embeddings,
    splits it by source; one batched backward sweep over every component."""
    frozen = FrozenNetwork.from_clean_run(model, toks, mask)
    if mask is not None:
        position = api._real_position(position, mask)
    target = targets.resolve(target, position, frozen.logits, frozen.final_resid)
    _, cap_gain, _ = connection.evaluate(frozen, target, dict(frozen.embeddings), {})
    model = frozen.model
    rows = torch.arange(len(target.position))
    leaves = {
        name: v.detach().clone().requires_grad_(True) for name, v in frozen.embeddings.items()
    }
    seen: dict[str, torch.Tensor] = {}
    taps = {"blocks.0.hook_resid_pre": lambda x: seen.__setitem__("embed", x)}
    for layer in range(model.cfg.n_layers):
        taps[f"blocks.{layer}.attn.hook_z"] = functools.partial(seen.__setitem__, f"z{layer}")
        if not model.cfg.attn_only:
            taps[f"blocks.{layer}.hook_mlp_out"] = functools.partial(seen.__setitem__, f"m{layer}")
    with torch.enable_grad():
        y, _, resid = connection.evaluate(frozen, target, leaves, taps, cap_gain)
        (g_full,) = torch.autograd.grad(y.sum(), resid, retain_graph=True)
        g = g_full[rows, target.position].detach()
        reads = [(seen["embed"][rows, target.position] * g).sum(-1)[None]]
        for layer in range(model.cfg.n_layers):
            block = model.blocks[layer]
            scale = frozen.frozen.get(f"blocks.{layer}.ln1_post.hook_scale")
            g_attn = connection._post_norm_transpose(
                model,
                getattr(block, "ln1_post", None),
                None if scale is None else scale[rows, target.position],
                g,
            )
            g_z = torch.einsum("hdm,bm->bhd", block.attn.W_O.detach().to(g), g_attn)
            reads.append((seen[f"z{layer}"][rows, target.position] * g_z).sum(-1).T)
            if not model.cfg.attn_only:
                reads.append((seen[f"m{layer}"][rows, target.position] * g).sum(-1)[None])
        outputs = torch.cat(reads)  # [component, batch]
        eye = torch.eye(len(outputs), dtype=outputs.dtype)
        grads = torch.autograd.grad(
            outputs,
            list(leaves.values()),
            grad_outputs=eye[:, :, None].expand(-1, -1, len(rows)),
            is_grads_batched=True,
            allow_unused=True,
        )
    parts = sum(
        (grad * v).sum(-1)
        for grad, v in zip(grads, leaves.values(), strict=True)
        if grad is not None
    )
    return torch.as_tensor(parts).transpose(0, 1).detach()


def component_tolerance(result: Attribution, expected: torch.Tensor) -> float:
    """`tolerance`, with the components' own sizes: an entry is the difference of two reads of
    a component, each as large as the component's output over all sources."""
    return (
        tolerance(result)
        + rtol(result.scores.dtype, FROZEN_TERMS) * expected.abs().sum(-1).max().item()
    )


@pytest.mark.parametrize(
    "arch_", ["gpt2_ln", "gpt2_processed", "llama_gqa_rotary", "parallel_rotary", "shortformer"]
)
@hooked_only
def test_by_component_is_direct_logit_attribution_by_source(arch_):
    """A component's entry for source ``s`` is its direct logit attribution in the frozen
    network fed only ``s``'s embeddings (TransformerLens's ``stack_head_results`` and
    ``apply_ln_to_stack``), minus what it gives with no embeddings; summed over sources, that
    with all of them."""
    model = build(arch_, dtype=torch.float64)
    model.set_use_attn_result(True)
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, target=(4, 9), position=6)
    clean = reference.clean_cache(model, toks)
    stacks = []
    for keep in [*range(toks.shape[1]), "all", None]:
        with model.hooks(fwd_hooks=reference.frozen_hooks(model, clean, keep)):
            _, cache = model.run_with_cache(toks)
        heads = cache.stack_head_results(layer=-1, pos_slice=6).unflatten(0, (-1, 4))
        mlps = torch.stack([cache[f"blocks.{i}.hook_mlp_out"][:, 6] for i in range(2)])[:, None]
        per_layer = torch.cat([heads, mlps], 1).flatten(0, 1)
        stack = torch.cat([cache["blocks.0.hook_resid_pre"][:, 6][None], per_layer])
        stacks.append(clean.apply_ln_to_stack(stack, layer=-1, pos_slice=6))
    direction = model.tokens_to_residual_directions(torch.tensor(4)) - (
        model.tokens_to_residual_directions(torch.tensor(9))
    )
    if hasattr(model.ln_final, "w"):
        direction = direction * model.ln_final.w
    reads = torch.stack(stacks) @ direction  # [input, component, batch]
    expected = (reads[:-2] - reads[-1]).permute(2, 1, 0)
    parts = result.by_component()
    assert parts.shape == (2, 1 + 2 * 5, 9)
    assert result.component_names()[:3] == ["embed", "L0H0", "L0H1"]
    assert result.component_names()[5] == "L0MLP"
    atol = component_tolerance(result, expected)
    torch.testing.assert_close(parts, expected, rtol=0, atol=atol)
    torch.testing.assert_close(parts.sum(-1), (reads[-2] - reads[-1]).T, rtol=0, atol=atol)
    torch.testing.assert_close(parts.sum(1), result.scores, rtol=0, atol=tolerance(result))
    gradients = components_by_gradients(model, toks, (4, 9), 6)
    torch.testing.assert_close(parts, gradients, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "arch_", ["gpt2_ln", "llama_gqa_rotary", "parallel_rotary", "ln_post_gemma_like"]
)
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@hooked_only
def test_by_component_padded_equals_gradients(arch_, left, monkeypatch):
    """In a padded batch, padding sends nothing and the rest is the definition's; here the
    sources run one per pass (the smallest chunks). Summed over components it is the scores,
    which the connection method computes without reading any component (a norm after the
    attention, Gemma's ``ln1_post``, included)."""
    monkeypatch.setattr(connection, "COMPONENT_CHUNK_ENTRIES", 1)
    model = build(arch_, dtype=torch.float64)
    toks = tokens()
    mask = torch.ones_like(toks)
    if left:
        mask[1, :3] = 0
    else:
        mask[1, 6:] = 0
    result = tl_connwalk.attribute(model, toks, attention_mask=mask, target=5, position=-2)
    parts = result.by_component()
    expected = components_by_gradients(model, toks, 5, -2, mask)
    torch.testing.assert_close(parts, expected, rtol=0, atol=component_tolerance(result, expected))
    torch.testing.assert_close(parts.sum(1), result.scores, rtol=0, atol=tolerance(result))
    assert (parts[1][:, mask[1] == 0] == 0).all()


def edges_by_autograd(model, toks, layer, token, position):
    """d y / d alpha at alpha = 1 for the frozen network whose layer-``layer`` pattern is
    ``alpha * A``: each edge's message scaled alone."""
    clean = reference.clean_cache(model, toks)
    name = f"blocks.{layer}.attn.hook_pattern"
    alpha = torch.ones_like(clean[name], requires_grad=True)
    hooks = reference.frozen_hooks(model, clean, "all")
    hooks.append((name, lambda x, hook: clean[name] * alpha))
    logits = model.run_with_hooks(toks, fwd_hooks=hooks)
    (grad,) = torch.autograd.grad(logits[torch.arange(2), position, token].sum(), alpha)
    return grad


def edges_by_formula(model, toks, layer, token, position):
    """``g_i . A^h_ij (v^h_j W_O^h) = A^h_ij v^h_j . (W_O^h g_i)``: ``W_O^h g_i`` is the frozen
    network's gradient at head ``h``'s ``hook_z``; ``v`` is ``hook_v`` (KV heads repeated)."""
    clean = reference.clean_cache(model, toks)
    hooks = reference.frozen_hooks(model, clean, "all")
    seen = {}
    hooks.append((f"blocks.{layer}.attn.hook_z", lambda z, hook: seen.setdefault("z", z)))
    logits = model.run_with_hooks(toks, fwd_hooks=hooks)
    (g_z,) = torch.autograd.grad(logits[torch.arange(2), position, token].sum(), seen["z"])
    v = clean[f"blocks.{layer}.attn.hook_v"]
    v = v.repeat_interleave(model.cfg.n_heads // v.shape[2], dim=2)
    A = clean[f"blocks.{layer}.attn.hook_pattern"]
    return torch.einsum("bhqk,bkhd,bqhd->bhqk", A, v, g_z)


def silenced(model, toks, layer, token, position):
    """The frozen network's target with layer ``layer``'s heads silenced (``hook_z = 0``)."""
    clean = reference.clean_cache(model, toks)
    hooks = reference.frozen_hooks(model, clean, "all")
    hooks.append((f"blocks.{layer}.attn.hook_z", lambda z, hook: torch.zeros_like(z)))
    with torch.no_grad():
        return model.run_with_hooks(toks, fwd_hooks=hooks)[torch.arange(2), position, token]


@pytest.mark.parametrize(
    "arch_", ["gpt2_ln", "llama_gqa_rotary", "parallel_rotary", "ln_post_gemma_like"]
)
@pytest.mark.parametrize("layer", [0, 1])
@hooked_only
def test_edges_against_autograd_and_complete_per_layer(arch_, layer):
    model = build(arch_, dtype=torch.float64)
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, target=5, position=7)
    edges = result.edges(layer)
    for expected in (edges_by_formula(model, toks, layer, 5, 7),
                     edges_by_autograd(model, toks, layer, 5, 7)):  # fmt: skip
        torch.testing.assert_close(edges, expected, rtol=0, atol=tolerance(result))
    rest = silenced(model, toks, layer, 5, 7)
    torch.testing.assert_close(
        edges.sum((1, 2, 3)) + rest, result.target_value, rtol=0, atol=tolerance(result)
    )
    assert (edges[:, :, 8:] == 0).all(), "a query after the target position carried something"


def test_bridge_edges_and_components():
    model = cached_bridge("llama", False)
    toks = torch.randint(0, 63, (2, 9), generator=torch.Generator().manual_seed(3))
    result = tl_connwalk.attribute(model, toks, target=5, position=7)
    expected = edges_by_autograd(model, toks, 1, 5, 7)
    torch.testing.assert_close(result.edges(1), expected, rtol=0, atol=tolerance(result))


@pytest.mark.parametrize("arch, compat", BRIDGE_DECODERS, ids=str)
def test_bridge_components_equal_gradients(arch, compat):
    model = cached_bridge(arch, compat)
    toks = bridge_tokens()
    result = tl_connwalk.attribute(model, toks, target=5, position=-2)
    parts = result.by_component()
    expected = components_by_gradients(model, toks, 5, -2)
    torch.testing.assert_close(parts, expected, rtol=0, atol=component_tolerance(result, expected))
    torch.testing.assert_close(parts.sum(1), result.scores, rtol=0, atol=tolerance(result))


def test_edges_layer_checked(gpt2):
    result = tl_connwalk.attribute(gpt2, tokens())
    with pytest.raises(tl_connwalk.ConnWalkError, match="out of range"):
        result.edges(2)
    assert result.edges(-1).shape == result.edges(1).shape


def test_to_dataframe_and_repr(gpt2):
    result = tl_connwalk.attribute(gpt2, tokens(), target=3)
    frame = result.to_dataframe()
    assert list(frame.columns) == [
        "batch", "source", "token", "score", "target", "target_value", "bias", "method"
    ]  # fmt: skip
    assert len(frame) == 18
    sums = frame.groupby("batch")["score"].sum() + frame.groupby("batch")["bias"].first()
    expected = result.target_value.double()
    torch.testing.assert_close(
        torch.tensor(sums.to_numpy()), expected, rtol=0, atol=tolerance(result)
    )
    assert frame["target"][0] == "logit[3] @ 8"
    assert "method='connection'" in repr(result)


def test_to_dataframe_decodes_with_the_models_tokenizer(gpt2):
    class Letters:
        def decode(self, ids):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    with_tokenizer = types.SimpleNamespace(tokenizer=Letters())
    toks = tokens()
    result = tl_connwalk.attribute(gpt2, toks, target=(3, 4))
    frame = result.to_dataframe(model=with_tokenizer)
    assert frame["str_token"].tolist() == [Letters().decode([int(t)]) for t in toks.flatten()]
    assert frame["target"][0] == "logit[3 \u2018d\u2019] - logit[4 \u2018e\u2019] @ 8"
    estimate = tl_connwalk.attribute(gpt2, toks, method="knockout_estimate")
    columns = estimate.to_dataframe().columns.tolist()
    assert columns[-2:] == ["remainder", "exact"]
    assert estimate.to_dataframe()["exact"].sum() == int(estimate.exact.sum())


def test_show_displays_the_page_to_html_writes(gpt2, tmp_path, monkeypatch):
    """``show`` and ``to_html`` draw one view: the same numbers, routes and labels."""
    shown = []
    display = types.ModuleType("IPython.display")
    display.HTML = lambda text: text  # type: ignore[attr-defined]
    display.display = shown.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", types.ModuleType("IPython"))
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    result = tl_connwalk.attribute(gpt2, tokens(), target=3)
    labels = [[f"t{i}" for i in range(9)]] * 2
    cases = [(None, [0, 0]), (2, [2, 2]), (result.routes(3, batch=1), [0, 3])]
    for routes, counts in cases:
        written = result.to_html(tmp_path / "a.html", str_tokens=labels, routes=routes, top_edges=2)
        result.show(str_tokens=labels, routes=routes, top_edges=2)
        expected = Page(written.read_text(encoding="utf-8")).data()
        assert Page(shown.pop()).data() == expected
        assert expected["sequences"][0]["tokens"] == labels[0]
        listed = [len(seq["routes"] or []) for seq in expected["sequences"]]
        assert listed == counts


@hooked_only
def test_by_component_gives_a_copy():
    """Editing what by_component returned does not change its next answer."""
    result = tl_connwalk.attribute(build("gpt2_ln", dtype=torch.float64), tokens())
    first = result.by_component()
    kept = first.clone()
    first.zero_()
    torch.testing.assert_close(result.by_component(), kept, rtol=0, atol=0)
