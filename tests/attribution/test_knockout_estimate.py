"""``method="knockout_estimate"`` (spec §7) against TransformerLens interventions: autograd through
a partial block of each score, knockout itself, and single edges really blocked."""

from typing import Any

import pytest
import torch

import tl_connwalk
from tests.architectures import (
    BRIDGE_DECODERS,
    bridge_only,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_encoder,
    hooked_only,
    tokens,
)
from tests.attribution.test_blocking import scores_edit
from tests.attribution.test_connection import FROZEN_TERMS, assert_exact
from tests.tolerances import rtol
from tl_connwalk import ConnWalkError


def knockout_of(model: Any, toks: torch.Tensor, **target: Any) -> tl_connwalk.Attribution:
    return tl_connwalk.attribute(model, toks, method="knockout", **target)


def partial_block_derivatives(
    model: Any, toks: torch.Tensor, token: int, position: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dy/dt`` at ``t = 0`` for the partial block ``score_ij + log(1 - t_ij)`` of every score
    of every layer (``[layer, batch, head, query, key]``, by autograd through the model), the
    patterns and ``y``."""
    n_layers, n = model.cfg.n_layers, toks.shape[1]
    shape = (n_layers, toks.shape[0], model.cfg.n_heads, n, n)
    dtype = next(model.parameters()).dtype
    strengths = torch.zeros(shape, dtype=dtype, requires_grad=True)
    patterns = {}

    def weaken(layer: int) -> Any:
        return lambda scores, hook: scores + torch.log1p(-strengths[layer])

    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", weaken(layer)) for layer in range(n_layers)]
    hooks += [
        (f"blocks.{layer}.attn.hook_pattern", lambda a, hook: patterns.__setitem__(hook.name, a))
        for layer in range(n_layers)
    ]
    logits = model.run_with_hooks(toks, fwd_hooks=hooks)
    y = logits[:, position, token]
    (grad,) = torch.autograd.grad(y.sum(), strengths)
    pattern = torch.stack(
        [patterns[f"blocks.{layer}.attn.hook_pattern"] for layer in range(n_layers)]
    )
    return grad, pattern.detach(), y.detach()


def check_first_order(model: Any, toks: torch.Tensor, causal: bool = True) -> None:
    """Each edge term is ``-(1 / (1 - A_ij)) dy/dt`` (compared as ``(1 - A_ij) k_ij = -dy/dt``),
    off the diagonal (a query's own key is never blocked: 0)."""
    result = tl_connwalk.attribute(
        model, toks, target=5, position=6, method="knockout_estimate", exact=0
    )
    grad, pattern, y = partial_block_derivatives(model, toks, 5, 6)
    edges = torch.stack([result.edges(layer) for layer in range(model.cfg.n_layers)])
    n = toks.shape[1]
    off = ~torch.eye(n, dtype=torch.bool)
    expected = torch.where(off, -grad.to(edges), 0)
    size = grad.abs().sum().item() + y.abs().max().item()
    atol = rtol(edges.dtype, FROZEN_TERMS) * size
    torch.testing.assert_close((1 - pattern.to(edges)) * edges, expected, rtol=0, atol=atol)
    assert torch.isfinite(edges).all()
    assert (edges[..., off.logical_not()] == 0).all(), "a query's own key was blocked"
    if causal:
        assert (edges[..., 0, :] == 0).all(), "position 0 has no other key to block"
    assert_exact(edges.sum((0, 2, 3)), result.scores, result)


@hooked_only
def test_edges_are_the_derivative_of_a_partial_block(arch):
    check_first_order(build(arch, dtype=torch.float64), tokens())


@hooked_only
def test_edges_are_the_derivative_of_a_partial_block_in_an_encoder():
    check_first_order(hooked_encoder(), tokens(), causal=False)


@pytest.mark.parametrize("arch_, compat", BRIDGE_DECODERS, ids=str)
def test_edges_are_the_derivative_of_a_partial_block_in_a_bridge(arch_, compat):
    check_first_order(cached_bridge(arch_, compat), bridge_tokens(pos=8))


@bridge_only
@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("method", ["knockout", "knockout_estimate"])
def test_a_bert_bridge_cannot_block_keys(method, compat):
    with pytest.raises(ConnWalkError, match="cannot be blocked through its hooks"):
        tl_connwalk.attribute(cached_bridge("bert", compat), bridge_tokens(), method=method)


# ------------------------------------------------------------- where first order is exact


@hooked_only
def test_one_attention_layer_without_norms_predicts_knockout_exactly():
    """``y`` is affine in ``z`` after a single attention-only layer: the first-order scores are
    knockout's."""
    model = build("attn_only_no_norm", dtype=torch.float64, n_layers=1)
    toks = tokens()
    for target in (dict(target=5, position=6), dict(target=(3, 8), position=-1)):
        got = tl_connwalk.attribute(model, toks, method="knockout_estimate", exact=0, **target)
        assert_exact(got.scores, knockout_of(model, toks, **target).scores, got)
        assert (got.remainder == 0).all() and not got.exact.any()


@hooked_only
def test_last_layer_edges_are_single_edges_blocked():
    """In the last layer of an attention-only model without norms each edge's prediction is the
    change of the target when that one edge (layer, head, query, key) is really blocked."""
    model = build("attn_only_no_norm", dtype=torch.float64)
    toks, position, token = tokens(), 6, 5
    result = tl_connwalk.attribute(
        model, toks, target=token, position=position, method="knockout_estimate"
    )
    edges = result.edges(-1)
    last = f"blocks.{model.cfg.n_layers - 1}.attn.hook_attn_scores"
    for head in range(model.cfg.n_heads):
        for key in range(position):
            block = scores_edit(head, position, key, lambda s: torch.full_like(s, -torch.inf))
            with torch.no_grad():
                blocked = model.run_with_hooks(toks, fwd_hooks=[(last, block)])[:, position, token]
            assert_exact(edges[:, head, position, key], result.target_value - blocked, result)
    assert (edges[:, :, :position] == 0).all() and (edges[:, :, position + 1 :] == 0).all()


# ------------------------------------------------------------- beyond first order


def check_exact_sources(model: Any, toks: torch.Tensor, **target: Any) -> tl_connwalk.Attribution:
    """Scores are the edges plus the remainder; the exact sources are knockout's own values, the
    first real position and the nearest before the target; every source exact with ``exact=n``."""
    result = tl_connwalk.attribute(model, toks, method="knockout_estimate", **target)
    knocked = knockout_of(model, toks, **target).scores
    edges = torch.stack([result.edges(layer) for layer in range(model.cfg.n_layers)])
    assert_exact(edges.sum((0, 2, 3)) + result.remainder, result.scores, result)
    assert (result.remainder[~result.exact] == 0).all()
    assert_exact(result.scores[result.exact], knocked[result.exact], result)
    every = tl_connwalk.attribute(
        model, toks, method="knockout_estimate", exact=toks.shape[1], **target
    )
    assert_exact(every.scores, knocked, every)
    return result


@hooked_only
def test_exact_sources_are_knockout(arch):
    model = build(arch, dtype=torch.float64)
    result = check_exact_sources(model, tokens(), target=5, position=6)
    assert result.exact[:, [0, 5]].all() and int(result.exact.sum()) == 4


@hooked_only
@pytest.mark.parametrize(
    "target",
    [
        None,
        (3, 8),
        "direction",
        ("blocks.1.hook_resid_pre", "direction"),
        ("blocks.0.mlp.hook_post", 3),
    ],
    ids=["top", "pair", "direction", "hook_direction", "neuron"],
)
def test_every_target_kind(target):
    model = build("gpt2_ln", dtype=torch.float64)
    u = torch.randn(
        model.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    if target == "direction":
        target = u
    elif isinstance(target, tuple) and target[1] == "direction":
        target = (target[0], u)
    result = check_exact_sources(model, tokens(), target=target, position=-3)
    if isinstance(target, tuple) and isinstance(target[0], str):
        later = int(target[0].split(".")[1])
        assert all(
            (result.edges(layer) == 0).all()
            for layer in range(later + (target[0].endswith("post")), 2)
        )


@hooked_only
def test_a_target_read_before_any_attention_has_nothing_to_block():
    model = build("gpt2_ln", dtype=torch.float64)
    for target in (("hook_embed", 3), ("blocks.0.hook_resid_pre", 2)):
        result = tl_connwalk.attribute(model, tokens(), target=target, method="knockout_estimate")
        assert (result.scores == 0).all() and (result.edges(0) == 0).all()
        assert_exact(result.bias, result.target_value, result)


@hooked_only
def test_encoder_exact_sources_are_knockout():
    """Knockout's own values on the exact sources, to float32's rounding of ``y - y_blocked``
    (runs batched differently)."""
    model = hooked_encoder()
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, target=5, position=4, method="knockout_estimate")
    knocked = knockout_of(model, toks, target=5, position=4).scores
    size = (result.target_value.abs() + knocked.abs().sum(-1)).max().item()
    atol = rtol(torch.float32, FROZEN_TERMS) * size
    torch.testing.assert_close(
        result.scores[result.exact], knocked[result.exact], rtol=0, atol=atol
    )
    assert result.exact[:, [0, 3]].all(), "the first position and the nearest (before) on a tie"
    assert int(result.exact.sum()) == 4


def test_bridge_exact_sources_are_knockout():
    check_exact_sources(cached_bridge("llama", False), bridge_tokens(pos=8), target=7, position=6)


# ------------------------------------------------------------- the record


@hooked_only
def test_verify_measures_the_largest_predictions(gpt2):
    toks = tokens()
    result = tl_connwalk.attribute(gpt2, toks, target=5, position=6, method="knockout_estimate")
    frame = result.verify(3)
    assert list(frame.columns) == [
        "batch",
        "source",
        "token",
        "predicted",
        "knockout",
        "error",
        "exact",
    ]
    assert len(frame) == 6 and set(frame["batch"]) == {0, 1}
    knocked = knockout_of(gpt2, toks, target=5, position=6).scores
    for row in frame.itertuples():
        assert row.source < 6
        assert row.knockout == pytest.approx(float(knocked[row.batch, row.source]), abs=1e-5)
        assert row.predicted == pytest.approx(float(result.scores[row.batch, row.source]))
    largest = result.scores[0, :6].abs().topk(3).indices
    assert set(frame[frame["batch"] == 0]["source"]) == set(largest.tolist())


@hooked_only
def test_what_knockout_estimate_does_not_have(gpt2):
    result = tl_connwalk.attribute(gpt2, tokens(), method="knockout_estimate")
    for call in (result.by_component, lambda: result.routes(2), result.component_names):
        with pytest.raises(ConnWalkError, match="has edges\\(layer\\) and remainder instead"):
            call()
    connection = tl_connwalk.attribute(gpt2, tokens())
    assert connection.remainder is None and connection.exact is None
    with pytest.raises(ConnWalkError, match="verify measures knockout"):
        connection.verify(2)
    with pytest.raises(ConnWalkError, match="k must be an int"):
        result.verify(-1)
    with pytest.raises(ConnWalkError, match="exact= belongs to method='knockout_estimate'"):
        tl_connwalk.attribute(gpt2, tokens(), exact=1)
    for bad in (-1, True):
        with pytest.raises(ConnWalkError, match="exact must be an int >= 0"):
            tl_connwalk.attribute(gpt2, tokens(), method="knockout_estimate", exact=bad)
