"""``Attribution.by_component`` and ``Attribution.edges`` against TransformerLens and autograd."""

import pytest
import torch

import tl_connwalk
from tests.architectures import build, cached_bridge, hooked_only, tokens
from tests.attribution import reference
from tests.attribution.test_connection import FROZEN_TERMS
from tests.tolerances import rtol
from tl_connwalk import Attribution


def tolerance(result: Attribution) -> float:
    """The dtype's relative tolerance times the size of the sum that makes the target."""
    size = result.scores.abs().sum(-1).max() + result.bias.abs().max()
    return rtol(result.scores.dtype, FROZEN_TERMS) * size.item()


@pytest.mark.parametrize(
    "arch_", ["gpt2_ln", "gpt2_processed", "llama_gqa_rotary", "parallel_rotary", "shortformer"]
)
@hooked_only
def test_by_component_is_direct_logit_attribution_summed_over_sources(arch_):
    """Summed over sources, a component's entry is its direct logit attribution in the frozen
    network (TransformerLens's ``stack_head_results`` and ``apply_ln_to_stack``), minus what it
    gives with no embeddings."""
    model = build(arch_, dtype=torch.float64)
    model.set_use_attn_result(True)
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, target=(4, 9), position=6)
    clean = reference.clean_cache(model, toks)
    stacks = []
    for keep in ("all", None):
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
    expected = ((stacks[0] - stacks[1]) @ direction).T
    parts = result.by_component()
    assert parts.shape == (2, 1 + 2 * 5, 9)
    assert result.component_names()[:3] == ["embed", "L0H0", "L0H1"]
    assert result.component_names()[5] == "L0MLP"
    torch.testing.assert_close(parts.sum(-1), expected, rtol=0, atol=tolerance(result))
    torch.testing.assert_close(parts.sum(1), result.scores, rtol=0, atol=tolerance(result))


@hooked_only
def test_by_component_sums_to_scores_with_post_norms():
    model = build("ln_post_gemma_like", dtype=torch.float64)
    result = tl_connwalk.attribute(model, tokens())
    parts = result.by_component()
    torch.testing.assert_close(parts.sum(1), result.scores, rtol=0, atol=tolerance(result))
    assert parts[:, 1:5].abs().sum() > 0


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
    torch.testing.assert_close(
        result.by_component().sum(1), result.scores, rtol=0, atol=tolerance(result)
    )


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
