"""Targets inside the network (a hook point's direction or unit) against the frozen network of
spec §6 run through TransformerLens hooks, whole, on several architectures."""

from typing import Any

import pytest
import torch

import tl_connwalk
from tests import tolerances
from tests.architectures import (
    BRIDGE_DECODERS,
    HAS_HOOKED,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_only,
    tokens,
)
from tests.attribution import reference
from tests.attribution.test_connection import assert_exact


def random_direction(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def along(u: torch.Tensor, position: int) -> Any:
    """``y = u . x[:, position]`` (``x`` flattened per position)."""
    return lambda x: (x[:, position].flatten(1) * u.reshape(-1).to(x)).sum(-1)


def hook_cases(model: Any) -> list[tuple[str, Any, Any]]:
    """(hook, target's second element, read of the activation) for a model; position 5."""
    cfg = model.cfg
    u_resid = random_direction((cfg.d_model,), cfg.dtype)
    u_z = random_direction((cfg.n_heads, cfg.d_head), cfg.dtype, seed=1)
    cases = [
        ("blocks.1.hook_resid_pre", u_resid, along(u_resid, 5)),
        ("blocks.1.attn.hook_z", u_z, along(u_z, 5)),
    ]
    if "blocks.0.hook_resid_mid" in model.hook_dict:  # not in parallel blocks
        cases.append(("blocks.0.hook_resid_mid", u_resid, along(u_resid, 5)))
    if not cfg.attn_only:
        cases.append(("blocks.1.mlp.hook_post", 3, lambda x: x[:, 5, 3]))
    return cases


def check(model: Any, toks: torch.Tensor, hook: str, which: Any, read: Any) -> None:
    """Complete, equal to the whole frozen network run by hooks, the clean activation as target,
    and nothing from after the position (causal)."""
    result = tl_connwalk.attribute(model, toks, target=(hook, which), position=5)
    _, cache = model.run_with_cache(toks)
    torch.testing.assert_close(result.target_value, read(cache[hook]))
    assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
    expected = reference.hook_contributions(model, toks, hook, read)
    assert_exact(result.scores, expected, result)
    assert (result.scores[:, 6:] == 0).all(), "a later position sent something (causal mask)"
    assert result.targets[0].endswith("@ 5") and hook in result.targets[0]


@hooked_only
@pytest.mark.parametrize(
    "arch_", ["gpt2_ln", "llama_gqa_rotary", "parallel_rotary", "ln_post_gemma_like"]
)
def test_hook_targets_equal_the_frozen_network(arch_):
    model = build(arch_, dtype=torch.float64)
    for hook, which, read in hook_cases(model):
        check(model, tokens(), hook, which, read)


@pytest.mark.parametrize("arch, compat", BRIDGE_DECODERS, ids=str)
def test_bridge_hook_targets(arch, compat):
    model = cached_bridge(arch, compat)
    for hook, which, read in hook_cases(model):
        check(model, bridge_tokens(pos=8), hook, which, read)


class Counter:
    """Counts forward calls of a module, for the test's own lifetime."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.handle = module.register_forward_hook(lambda *args: self.count())

    def count(self) -> None:
        self.calls += 1


@pytest.mark.parametrize("kind", ["hooked", "bridge"])
def test_later_layers_do_not_run_and_edges_are_zero(kind):
    """A target at layer 1's input: layer 1 never runs (clean run and frozen network), its edges
    are 0, and the model is left as it was (outputs, hooks)."""
    if kind == "hooked" and not HAS_HOOKED:
        pytest.skip("TransformerLens 4.x has no HookedTransformer")
    model = (
        build("gpt2_ln", dtype=torch.float64) if kind == "hooked" else cached_bridge("llama", False)
    )
    toks = tokens() if kind == "hooked" else bridge_tokens()
    before = model(toks)
    counter = Counter(model.blocks[1])
    try:
        result = tl_connwalk.attribute(
            model, toks, target=("blocks.1.hook_resid_pre", 0), position=-1
        )
    finally:
        counter.handle.remove()
    assert counter.calls == 0, "layer 1 ran for a target at its input"
    assert (result.edges(1) == 0).all()
    assert result.edges(0).abs().sum() > 0
    assert result.edges(0).shape == result.edges(1).shape
    torch.testing.assert_close(model(toks), before, rtol=0, atol=0)
    assert not any(hook.fwd_hooks for hook in model.hook_dict.values())


@hooked_only
def test_edges_add_up_to_the_target_minus_the_layer_silenced():
    """Spec §6's edge identity holds for a target inside the network: layer 0's edges sum to
    ``y`` minus ``F`` with layer 0's heads silenced (patterns zeroed)."""
    model = build("gpt2_ln", dtype=torch.float64)
    toks = tokens()
    hook, u = "blocks.1.hook_resid_pre", random_direction((model.cfg.d_model,), torch.float64)
    result = tl_connwalk.attribute(model, toks, target=(hook, u), position=5)
    cache = reference.clean_cache(model, toks)
    hooks = reference.frozen_hooks(model, cache, "all")
    silenced = [(n, f) for n, f in hooks if n != "blocks.0.attn.hook_pattern"]
    silenced.append(("blocks.0.attn.hook_pattern", lambda x, hook: torch.zeros_like(x)))
    seen = {}
    with torch.no_grad():
        model.run_with_hooks(toks, fwd_hooks=[*silenced, (hook, lambda x, hook: seen.update(x=x))])
    expected = result.target_value - along(u, 5)(seen["x"])
    assert_exact(result.edges(0).sum((1, 2, 3)), expected, result)


@hooked_only
def test_rollout_stops_at_the_target():
    """Rollout for a target at layer 1's input rolls out layer 0 only: ``B_0`` row 4."""
    model = build("gpt2_ln")
    toks = tokens()
    result = tl_connwalk.attribute(
        model, toks, target=("blocks.1.hook_resid_pre", 0), position=4, method="rollout"
    )
    _, cache = model.run_with_cache(toks)
    B0 = (cache["blocks.0.attn.hook_pattern"].mean(1) + torch.eye(9)) / 2
    torch.testing.assert_close(result.scores, B0[:, 4])
    at_input = tl_connwalk.attribute(
        model, toks, target=("blocks.0.hook_resid_pre", 0), position=4, method="rollout"
    )
    torch.testing.assert_close(at_input.scores, torch.eye(9)[4].expand(2, -1))


@hooked_only
@pytest.mark.parametrize("arch_", ["gpt2_ln", "llama_gqa_rotary"])
def test_knockout_and_grad_x_input_read_the_hook(arch_):
    """Knockout: the activation's drop with key ``s`` blocked after the softmax (renormalised
    rows); gradient times input: central differences along each position's embeddings."""
    model = build(arch_, dtype=torch.float64)
    toks = tokens()
    hook = "blocks.1.mlp.hook_post"
    read = lambda x: x[:, 5, 3]  # noqa: E731
    knocked = tl_connwalk.attribute(model, toks, target=(hook, 3), position=5, method="knockout")

    def run(hooks: list) -> torch.Tensor:
        seen = {}
        with torch.no_grad():
            model.run_with_hooks(toks, fwd_hooks=[*hooks, (hook, lambda x, hook: seen.update(x=x))])
        return read(seen["x"])

    def renormalise(source: int) -> list:
        def edit(pattern, hook):
            keep = torch.ones_like(pattern)
            keep[..., source] = 0
            keep[..., source, source] = 1
            return pattern * keep / (pattern * keep).sum(-1, keepdim=True)

        return [(f"blocks.{layer}.attn.hook_pattern", edit) for layer in range(2)]

    clean = run([])
    expected = torch.stack([clean - run(renormalise(s)) for s in range(9)], -1)
    atol = tolerances.atol(torch.float64, scale=clean.abs().max().item())
    torch.testing.assert_close(knocked.scores, expected, rtol=0, atol=atol)
    torch.testing.assert_close(knocked.target_value, clean)

    gxi = tl_connwalk.attribute(model, toks, target=(hook, 3), position=5, method="grad_x_input")
    names = [name for name in ("hook_embed", "hook_pos_embed") if name in model.hook_dict]
    step = 1e-5

    def scaled(source: int, t: float) -> torch.Tensor:
        def scale(x, hook):
            x = x.clone()
            x[:, source] *= 1 + t
            return x

        return run([(name, scale) for name in names])

    central = torch.stack([(scaled(s, step) - scaled(s, -step)) / (2 * step) for s in range(9)], -1)
    # central differences: error O(step^2 y''') ~ 1e-10 on these unit-scale targets
    torch.testing.assert_close(gxi.scores, central, rtol=0, atol=1e-8)


@hooked_only
def test_target_at_an_mlp_pre_activation():
    """An MLP pre-activation is affine in the embeddings in ``F``; its clean value is read."""
    model = build("gpt2_ln", dtype=torch.float64)
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, target=("blocks.0.mlp.hook_pre", 2), position=3)
    _, cache = model.run_with_cache(toks)
    torch.testing.assert_close(result.target_value, cache["blocks.0.mlp.hook_pre"][:, 3, 2])
    assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)


@pytest.mark.parametrize(
    "target, match",
    [
        (("blocks.1.resid_pre", 0), r"not a hook point.*blocks\.\{l\}\.hook_resid_pre"),
        (("blocks.7.hook_resid_pre", 0), "not a hook point"),
        (("blocks.0.attn.hook_pattern", 0), "cannot be a target"),
        (("blocks.0.ln1.hook_scale", 0), "cannot be a target"),
        (("blocks.0.mlp.hook_post", 10_000), "out of range"),
        (("blocks.0.mlp.hook_post", torch.tensor([1, 2])), "unit index"),
        (("blocks.0.hook_resid_pre", torch.ones(5)), "24 entries per position"),
        (("blocks.0.attn.hook_result", 0), "does not fire"),
    ],
    ids=str,
)
def test_bad_hook_targets(gpt2, target, match):
    with pytest.raises(tl_connwalk.ConnWalkError, match=match):
        tl_connwalk.attribute(gpt2, tokens(), target=target)


def test_by_component_is_for_output_targets(gpt2):
    result = tl_connwalk.attribute(gpt2, tokens(), target=("blocks.1.hook_resid_pre", 0))
    with pytest.raises(tl_connwalk.ConnWalkError, match="inside the network"):
        result.by_component()
