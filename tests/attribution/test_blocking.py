"""The closed form of a blocked key (spec §7) against its plain definition and against the
model's own attention with the score masked at ``hook_attn_scores``, on every architecture."""

from typing import Any

import pytest
import torch

from tests import tolerances
from tests.architectures import (
    BRIDGE_DECODERS,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_encoder,
    hooked_only,
    tokens,
)
from tl_connwalk.attribution import blocking


def random_rows(
    batch: int, heads: int, n: int, causal: bool, spread: float, seed: int = 0
) -> torch.Tensor:
    """Softmax patterns ``[batch, head, n, n]`` from scores of standard deviation ``spread``."""
    generator = torch.Generator().manual_seed(seed)
    scores = spread * torch.randn(batch, heads, n, n, generator=generator, dtype=torch.float64)
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spread", [1.0, 12.0], ids=["soft", "peaked"])
def test_edge_effects_equal_the_renormalised_rows(causal, spread):
    """The cumulative-sum form against each row renormalised without the key, in float64."""
    pattern = random_rows(2, 3, 7, causal, spread)
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(2, 7, 3, 5, generator=generator, dtype=torch.float64)
    values = torch.randn(2, 7, 3, 5, generator=generator, dtype=torch.float64)
    got = blocking.edge_effects(pattern, grad, values)
    expected = blocking.edge_effects_reference(pattern, grad, values)
    size = (grad.abs().amax() * values.abs().amax() * 5).item()
    torch.testing.assert_close(
        got, expected, rtol=0, atol=tolerances.atol(torch.float64, 7 * 5, size)
    )
    assert (got.diagonal(dim1=-2, dim2=-1) == 0).all(), "a query's own key was blocked"


def test_a_dominant_key_keeps_its_digits_in_float32():
    """Where ``A_ij`` is within a few ulps of 1, ``1 - A_ij`` by subtraction is mostly rounding;
    the sums that exclude ``j`` keep the other keys' weights, so float32 agrees with float64."""
    scores = torch.tensor([[0.0, -16.0, -17.0, -18.0]], dtype=torch.float64).expand(4, 4)
    pattern = scores.softmax(-1)[None, None]  # every row: key 0 holds 1 - 2e-7
    generator = torch.Generator().manual_seed(2)
    grad = torch.randn(1, 4, 1, 3, generator=generator, dtype=torch.float64)
    values = torch.randn(1, 4, 1, 3, generator=generator, dtype=torch.float64)
    expected = blocking.edge_effects_reference(pattern, grad, values)
    got = blocking.edge_effects(pattern.float(), grad.float(), values.float())
    size = (grad.abs().amax() * values.abs().amax() * 3).item()
    atol = tolerances.atol(torch.float32, 4 * 3, size)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol)


def test_a_row_with_no_other_key_gives_zero_not_nan():
    """Position 0 of a causal row holds only itself; a float32 row may hold one key with weight
    exactly 1: nothing to renormalise onto, so the effect is 0 (and finite)."""
    pattern = torch.tensor([[[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]]])
    grad = torch.ones(1, 3, 1, 2)
    values = torch.arange(6.0).reshape(1, 3, 1, 2)
    got = blocking.edge_effects(pattern, grad, values)
    assert torch.isfinite(got).all()
    assert (got == 0).all()
    assert (blocking.blocked_change(pattern, values) == 0).all()


# ---------------------------------------------------------------- against the model's softmax


def per_head(x: torch.Tensor, cfg: Any) -> torch.Tensor:
    """``hook_z``/``hook_v`` as ``[batch, pos, head, d_head]``, grouped values repeated."""
    x = x.reshape(*x.shape[:2], -1, cfg.d_head)
    return x.repeat_interleave(cfg.n_heads // x.shape[2], dim=2)


def scores_edit(head: int, query: int, key: int, edit: Any) -> Any:
    """A ``hook_attn_scores`` hook that replaces score ``(head, query, key)`` of every sequence
    by ``edit(score)``."""

    def hook(scores: torch.Tensor, hook: Any) -> torch.Tensor:
        scores = scores.clone()
        scores[:, head, query, key] = edit(scores[:, head, query, key])
        return scores

    return hook


def blocked_z(model: Any, toks: torch.Tensor, layer: int, edges: list[tuple[int, int, int]]):
    """``hook_z`` of ``layer`` in one run per edge ``(head, query, key)``, that score set to
    ``-inf`` at ``hook_attn_scores`` in every sequence; ``[edge, batch, pos, head, d_head]``."""
    out = []
    for head, query, key in edges:
        seen: dict[str, torch.Tensor] = {}
        block = scores_edit(head, query, key, lambda score: torch.full_like(score, -torch.inf))
        hooks = [
            (f"blocks.{layer}.attn.hook_attn_scores", block),
            (f"blocks.{layer}.attn.hook_z", lambda z, hook, seen=seen: seen.update(z=z)),
        ]
        with torch.no_grad():
            model.run_with_hooks(toks, fwd_hooks=hooks)
        out.append(per_head(seen["z"], model.cfg))
    return torch.stack(out)


def check_closed_form(model: Any, toks: torch.Tensor, causal: bool) -> None:
    n = toks.shape[1]
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j and (j < i or not causal)]
    edges = [(h, *pairs[(7 * h + 3 * k) % len(pairs)]) for h in range(2) for k in range(4)]
    for layer in range(model.cfg.n_layers):
        names = [f"blocks.{layer}.attn.{name}" for name in ("hook_z", "hook_v", "hook_pattern")]
        with torch.no_grad():
            _, cache = model.run_with_cache(toks, names_filter=names)
        z, v = per_head(cache[names[0]], model.cfg), per_head(cache[names[1]], model.cfg)
        change = blocking.blocked_change(cache[names[2]], v)  # [batch, head, query, key, d]
        got = blocked_z(model, toks, layer, edges)
        expected = z.expand_as(got).clone()
        for e, (head, query, key) in enumerate(edges):
            expected[e, :, query, head] += change[:, head, query, key]
        atol = tolerances.atol(z.dtype, n * model.cfg.d_head, v.abs().max().item())
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)


@hooked_only
def test_closed_form_is_the_masked_score(arch):
    """``z + A_ij / (1 - A_ij) (z_i - v_j)`` is what the model computes with score ``(i, j)`` at
    ``-inf``, in every layer (grouped-query, rotary, parallel, Gemma-style norms ...)."""
    check_closed_form(build(arch, dtype=torch.float64), tokens(), causal=True)


@hooked_only
def test_closed_form_is_the_masked_score_in_an_encoder():
    check_closed_form(hooked_encoder(), tokens(), causal=False)


@pytest.mark.parametrize("arch_, compat", BRIDGE_DECODERS, ids=str)
def test_closed_form_is_the_masked_score_in_a_bridge(arch_, compat):
    check_closed_form(cached_bridge(arch_, compat), bridge_tokens(pos=7), causal=True)
