"""Routes: the exact expansion of each source's contribution over the components it passes."""

from typing import Any

import pytest
import torch
from jaxtyping import TypeCheckError

import tl_connwalk
from tests.architectures import (
    BRIDGE_DECODERS,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_encoder,
    hooked_only,
    tokens,
)
from tests.attribution import reference
from tests.attribution.test_connection import assert_exact
from tl_connwalk import Attribution


def summed_routes(result: Attribution, max_length: int) -> torch.Tensor:
    """``[batch, source]``: the contributions of every route up to ``max_length``, summed."""
    total = torch.zeros_like(result.scores)
    for b in range(result.scores.shape[0]):
        for route in result.routes(None, batch=b, max_length=max_length):
            total[b, route.source] += route.contribution
    return total


@pytest.mark.parametrize("max_length", [0, 1, 2])
def test_routes_and_remainder_make_the_scores(arch, max_length):
    """Enumerated routes plus the remainder (computed by its own backward pass) are scores."""
    model = build(arch, dtype=torch.float64)
    result = tl_connwalk.attribute(model, tokens(), position=-2)
    remainder = result.route_remainder(max_length)
    assert remainder.shape == result.scores.shape
    assert_exact(summed_routes(result, max_length) + remainder, result.scores, result)
    everything = result.routes(None, max_length=max_length)
    lengths = {len(route.components) for route in everything}
    assert lengths == set(range(max_length + 1))
    top = result.routes(5, max_length=max_length)
    assert [abs(r.contribution) for r in top] == sorted(
        (abs(r.contribution) for r in everything), reverse=True
    )[:5]


@pytest.mark.parametrize("arch_, longest", [("attn_only_no_norm", 2), ("gpt2_ln", 4)])
@hooked_only
def test_every_route_enumerated_leaves_no_remainder(arch_, longest):
    """A 2-layer model's longest route passes one head per layer (and each MLP): enumerating
    up to that length leaves nothing for the remainder, and the routes alone are scores."""
    model = build(arch_, dtype=torch.float64)
    result = tl_connwalk.attribute(model, tokens())
    size = result.scores.abs().max()
    assert_exact(result.route_remainder(longest), torch.zeros_like(result.scores), result)
    assert_exact(summed_routes(result, longest), result.scores, result)
    assert result.route_remainder(longest - 1).abs().max() > 1e-3 * size, "no longest route"
    per_layer = (1 + model.cfg.n_heads) * (1 + (not model.cfg.attn_only))  # (I + heads)(I + MLP)
    n_routes = per_layer**model.cfg.n_layers
    assert len(result.routes(None, max_length=longest)) == n_routes * result.scores.shape[1]


def keep_only(model: Any, component: str | None) -> list[tuple[str, Any]]:
    """Hooks silencing every head and MLP but ``component`` (``"L1H2"``, ``"L0MLP"``)."""
    hooks = []
    for layer in range(model.cfg.n_layers):
        kept = torch.zeros(model.cfg.n_heads, 1, dtype=torch.float64)
        if component is not None and component.startswith(f"L{layer}H"):
            kept[int(component.split("H")[1])] = 1
        hooks.append((f"blocks.{layer}.attn.hook_z", lambda z, hook, kept=kept: z * kept))
        if not model.cfg.attn_only and component != f"L{layer}MLP":
            hooks.append((f"blocks.{layer}.hook_mlp_out", lambda x, hook: torch.zeros_like(x)))
    return hooks


def kept_contributions(model: Any, toks: torch.Tensor, component: str | None, position: int,
                       token: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``F_c(only e_s) - F_c(none)`` per source, ``F_c`` the frozen network (by hooks) with
    every component but ``c`` silenced: the direct path plus the length-1 route through c."""
    cache = reference.clean_cache(model, toks)
    rows = torch.arange(toks.shape[0])

    def target(keep: int | None) -> torch.Tensor:
        hooks = reference.frozen_hooks(model, cache, keep) + keep_only(model, component)
        with torch.no_grad():
            return model.run_with_hooks(toks, fwd_hooks=hooks)[rows, position, token]

    bias = target(None)
    return torch.stack([target(s) - bias for s in range(toks.shape[1])], -1)


@pytest.mark.parametrize(
    "arch_", ["gpt2_ln", "llama_gqa_rotary", "parallel_rotary", "ln_post_gemma_like"]
)
@pytest.mark.parametrize("component", ["L0H1", "L1H3", "L0MLP", "L1MLP"])
@hooked_only
def test_length_one_route_equals_the_network_with_one_component_kept(arch_, component):
    model = build(arch_, dtype=torch.float64)
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, position=-3)
    routes = [r for b in range(2) for r in result.routes(None, batch=b, max_length=1)]
    ours = torch.zeros_like(result.scores)
    for route in routes:
        if route.components == (component,):
            ours[route.batch, route.source] = route.contribution
    token = result.tokens.new_tensor([int(t.split("[")[1].split("]")[0]) for t in result.targets])
    kept = kept_contributions(model, toks, component, -3, token)
    direct = kept_contributions(model, toks, None, -3, token)
    assert_exact(ours, kept - direct, result)
    assert ours.abs().max() > 0


@pytest.mark.parametrize("arch, compat", BRIDGE_DECODERS, ids=str)
def test_bridge_routes_make_the_scores(arch, compat):
    model = cached_bridge(arch, compat)
    result = tl_connwalk.attribute(model, bridge_tokens(), target=11)
    remainder = result.route_remainder(1)
    assert_exact(summed_routes(result, 1) + remainder, result.scores, result)


def test_bad_route_arguments(gpt2):
    result = tl_connwalk.attribute(gpt2, tokens())
    with pytest.raises(tl_connwalk.ConnWalkError, match="max_length"):
        result.routes(max_length=-1)
    with pytest.raises((tl_connwalk.ConnWalkError, TypeCheckError)):
        result.routes(1.5)  # type: ignore[arg-type]
    with pytest.raises(tl_connwalk.ConnWalkError, match="batch must be"):
        result.routes(batch=2)
    with pytest.raises(tl_connwalk.ConnWalkError, match="method='connection'"):
        tl_connwalk.attribute(gpt2, tokens(), method="rollout").routes()


@hooked_only
def test_encoder_routes_are_refused():
    result = tl_connwalk.attribute(hooked_encoder(), tokens(), target=3, position=2)
    with pytest.raises(tl_connwalk.ConnWalkError, match="post-norm"):
        result.routes()


def test_route_text():
    from tl_connwalk.attribution.routes import Route

    assert str(Route(0, 3, ("L0H1", "L1MLP"), 0.5)) == "pos 3 -> L0H1 -> L1MLP -> target: +0.5"
