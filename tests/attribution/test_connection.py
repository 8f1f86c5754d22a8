"""The exact method against the frozen network of spec §6 run through TransformerLens hooks."""

from typing import Any

import pytest
import torch
from jaxtyping import TypeCheckError
from torch.utils.checkpoint import checkpoint

import tl_connwalk
from tests.architectures import (
    BASE,
    BRIDGE_DECODERS,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_only,
    tokens,
)
from tests.attribution import reference
from tests.tolerances import rtol
from tl_connwalk import Attribution
from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.attribution import frozen

FROZEN_TERMS = 1024


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, result: Attribution) -> None:
    """Equal to the dtype's relative tolerance times the size of the sum that makes the target,
    ``sum_s |c_s| + |b|`` (every term carries rounding of that size); ``FROZEN_TERMS``: the
    frozen network's longest chains of sums (residual-width products over every layer)."""
    size = result.scores.abs().sum(-1).max() + result.bias.abs().max()
    atol = rtol(actual.dtype, FROZEN_TERMS) * size.item()
    torch.testing.assert_close(actual, expected.to(actual), rtol=0, atol=atol)


@hooked_only
def test_complete_and_equal_to_the_frozen_network(arch):
    """sum_s c_s + b = the model's logit, and c_s = F(only e_s) - F(none) run by hooks."""
    model = build(arch, dtype=torch.float64)
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, position=-2)
    logits = model(toks)
    top = logits[:, -2].argmax(-1)
    torch.testing.assert_close(result.target_value, logits[torch.arange(2), -2, top])
    assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
    expected = reference.source_contributions(model, toks, top, position=-2)
    assert_exact(result.scores, expected, result)
    assert (result.scores[:, -1] == 0).all(), "a later position sent something (causal mask)"


@pytest.mark.parametrize("arch_", ["gpt2_ln", "llama_gqa_rotary"])
@hooked_only
def test_targets_logit_difference_and_direction(arch_):
    model = build(arch_, dtype=torch.float64)
    toks = tokens()
    first = tl_connwalk.attribute(model, toks, target=3)
    second = tl_connwalk.attribute(model, toks, target=torch.tensor([5, 7]))
    diff = tl_connwalk.attribute(model, toks, target=(3, torch.tensor([5, 7])))
    assert_exact(diff.scores, first.scores - second.scores, diff)
    assert_exact(diff.target_value, first.target_value - second.target_value, diff)
    u = torch.randn(
        model.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    direction = tl_connwalk.attribute(model, toks, target=u, position=4)
    _, cache = model.run_with_cache(toks)
    resid = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, 4]
    torch.testing.assert_close(direction.target_value, resid @ u)
    assert_exact(direction.scores.sum(-1) + direction.bias, resid @ u, direction)
    assert (direction.scores[:, 5:] == 0).all()


def random_encoder() -> Any:
    """A random 2-layer BERT-style ``HookedEncoder`` in float64 (TransformerLens 3.x)."""
    from transformer_lens import HookedEncoder, HookedTransformerConfig

    cfg = HookedTransformerConfig(**{
        **BASE, "act_fn": "gelu", "normalization_type": "LN", "attention_dir": "bidirectional",
        "device": "cpu", "dtype": torch.float64,
    })  # fmt: skip
    model = HookedEncoder(cfg, move_to_device=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            one = 1.0 if name.endswith(".w") and "ln" in name else 0.0
            param.copy_(one + 0.2 * torch.randn(param.shape, generator=generator).double())
    return model


@hooked_only
def test_encoder_masked_position():
    """A HookedEncoder: every position sends to the masked one, through a post-norm stack and
    an MLM head whose activation is frozen as a gain."""
    model = random_encoder()
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, target=6, position=3)
    logits = model(toks)
    torch.testing.assert_close(result.target_value, logits[:, 3, 6])
    assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
    expected = reference.source_contributions(model, toks, torch.tensor([6, 6]), position=3)
    assert_exact(result.scores, expected, result)
    assert (result.scores[:, 4:] != 0).all(), "later positions sent nothing to an encoder"
    with pytest.raises(tl_connwalk.ConnWalkError, match="post-norm"):
        result.by_component()


@pytest.mark.parametrize("arch, compat", BRIDGE_DECODERS, ids=str)
def test_bridge_complete_and_equal_to_the_frozen_network(arch, compat):
    model = cached_bridge(arch, compat)
    toks = bridge_tokens()
    result = tl_connwalk.attribute(model, toks, target=11)
    assert result.scores.dtype == torch.float32
    logits = model(toks)
    torch.testing.assert_close(result.target_value, logits[:, -1, 11])
    assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
    expected = reference.source_contributions(model, toks, torch.tensor([11, 11]), position=-1)
    assert_exact(result.scores, expected, result)


def test_leaves_no_hook_and_changes_nothing(gpt2):
    toks = tokens()
    before = gpt2(toks)
    tl_connwalk.attribute(gpt2, toks).by_component()
    torch.testing.assert_close(gpt2(toks), before, rtol=0, atol=0)
    assert not any(hook.fwd_hooks for hook in gpt2.hook_dict.values())
    assert not gpt2.unembed._forward_pre_hooks


def _unchanged(model: Any, untrained: torch.nn.Parameter) -> None:
    """No block keeps a forward of its own, no hook point a hook; every weight requires
    gradients as before."""
    assert not any("forward" in vars(block) for block in model.blocks)
    assert not any(point.fwd_hooks or point.bwd_hooks for point in model.hook_dict.values())
    assert not untrained.requires_grad
    others = [parameter for parameter in model.parameters() if parameter is not untrained]
    assert all(parameter.requires_grad for parameter in others)


def test_restores_blocks_and_weights_even_on_error(gpt2, monkeypatch):
    """The frozen network's backward pass recomputes each block and treats the weights as
    constants; afterwards, or after an error in its forward pass, the model is as it was
    (a weight the user set not to require gradients included)."""
    untrained = next(iter(gpt2.parameters()))
    untrained.requires_grad_(False)
    try:
        result = tl_connwalk.attribute(gpt2, tokens())
        _unchanged(gpt2, untrained)
        assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
        tl_connwalk.attribute(gpt2, tokens(), method="knockout_estimate")
        _unchanged(gpt2, untrained)

        def fail_with_gradients(activation: torch.Tensor, hook: Any) -> None:
            if torch.is_grad_enabled():  # the frozen network's forward pass, not the clean run
                raise RuntimeError("failed inside the frozen network")

        hooks = frozen.FrozenNetwork.hooks

        def failing(self: Any, *args: Any, **kwargs: Any) -> list:
            return [*hooks(self, *args, **kwargs), ("blocks.1.hook_resid_mid", fail_with_gradients)]

        monkeypatch.setattr(frozen.FrozenNetwork, "hooks", failing)
        with pytest.raises(RuntimeError, match="inside the frozen network"):
            tl_connwalk.attribute(gpt2, tokens())
        _unchanged(gpt2, untrained)
    finally:
        untrained.requires_grad_(True)


def test_recomputes_each_block_unless_the_model_has_hooks_of_its_own(gpt2, monkeypatch):
    """Each block of the frozen network is checkpointed once (its activations recomputed in
    the backward pass), with the results of the whole graph; a hook of the user's would run
    again in a recomputation, so with one the whole graph is kept and the hook runs as often
    as without recomputation. (A ``TransformerBridge`` always keeps the whole graph.)"""
    if is_bridge(gpt2):
        pytest.skip("a TransformerBridge keeps the frozen network's whole graph")
    checkpointed: list[int] = []

    def counting(function: Any, *args: Any, **kwargs: Any) -> Any:
        checkpointed.append(1)
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(frozen, "checkpoint", counting)
    recomputed = tl_connwalk.attribute(gpt2, tokens())
    assert len(checkpointed) == gpt2.cfg.n_layers
    calls: list[int] = []
    gpt2.add_hook("blocks.0.hook_resid_mid", lambda x, hook: calls.append(1), is_permanent=True)
    try:
        checkpointed.clear()
        whole = tl_connwalk.attribute(gpt2, tokens())
        assert checkpointed == []
        calls_whole, calls[:] = len(calls), []
        monkeypatch.setattr(frozen, "_has_hooks", lambda model: False)
        tl_connwalk.attribute(gpt2, tokens())
        assert len(checkpointed) == gpt2.cfg.n_layers
        assert len(calls) > calls_whole  # what keeping the whole graph avoids
    finally:
        gpt2.reset_hooks(including_permanent=True)
    assert_exact(recomputed.scores, whole.scores, recomputed)
    assert_exact(recomputed.edges(0), whole.edges(0), recomputed)


def test_text_input(gpt2):
    if not hasattr(gpt2, "tokenizer") or gpt2.tokenizer is None:
        gpt2 = cached_bridge("gpt2", False)
    result = tl_connwalk.attribute(gpt2, "t1 t2 t3")
    assert result.tokens.shape == result.scores.shape == (1, gpt2.to_tokens("t1 t2 t3").shape[1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target=99), "out of the vocabulary"),
        (dict(target=torch.tensor([1, 2, 3])), "one id per sequence"),
        (dict(target=torch.randn(2, 3, 4)), "direction target"),
        (dict(position=9), "out of range"),
        (dict(position=torch.tensor([1.5])), "position must be"),
    ],
)
def test_bad_input(gpt2, kwargs, match):
    with pytest.raises(tl_connwalk.ConnWalkError, match=match):
        tl_connwalk.attribute(gpt2, tokens(), **kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(target=(1, 2, 3)), dict(target="a"), dict(method="magic")], ids=str
)
def test_bad_types(gpt2, kwargs):
    """Refused by the checks, or under runtime type checking by the annotations."""
    with pytest.raises((tl_connwalk.ConnWalkError, TypeCheckError)):
        tl_connwalk.attribute(gpt2, tokens(), **kwargs)


def test_bad_model_and_input(gpt2):
    with pytest.raises(tl_connwalk.ConnWalkError, match="does not support"):
        tl_connwalk.attribute(torch.nn.Linear(2, 2), tokens())
    with pytest.raises(tl_connwalk.ConnWalkError, match="integers"):
        tl_connwalk.attribute(gpt2, torch.randn(2, 9))


@hooked_only
def test_solu_ln_is_refused():
    """SoLU's inner LayerNorm mixes neurons: there is no per-neuron gain to freeze."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    model = HookedTransformer(HookedTransformerConfig(**{**BASE, "act_fn": "solu_ln"}))
    with pytest.raises(tl_connwalk.ConnWalkError, match="no per-neuron gain"):
        tl_connwalk.attribute(model, tokens())
