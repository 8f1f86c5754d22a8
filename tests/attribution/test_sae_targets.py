"""An SAELens SAE feature's pre-activation as the target (optional: skipped without sae_lens).

The reference is SAELens's own encoder: the feature's ``hook_sae_acts_pre`` when the SAE encodes
the activation at its hook, in the clean run (the target) and in the whole frozen network of
spec §6 run by hooks, fed one source's embeddings at a time (the contributions).
"""

import warnings
from typing import Any

import pytest
import torch

import tl_connwalk
from tests.architectures import bridge_tokens, build, cached_bridge, hooked_only, tokens
from tests.attribution import reference
from tests.attribution.test_connection import assert_exact

with warnings.catch_warnings():  # SAELens imports TransformerLens's deprecated utils module
    warnings.simplefilter("ignore", DeprecationWarning)
    sae_lens = pytest.importorskip("sae_lens")
    from sae_lens.saes.sae import SAEMetadata


def random_sae(kind: str, d_in: int, hook: str, dtype: torch.dtype, **cfg: Any) -> Any:
    """A randomly initialised SAELens SAE of architecture ``kind`` (all parameters redrawn, so
    the biases are non-zero) reading ``hook``."""
    classes = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "gated": (sae_lens.GatedSAE, sae_lens.GatedSAEConfig),
    }
    sae_class, cfg_class = classes[kind]
    dtype_name = str(dtype).removeprefix("torch.")
    config = cfg_class(
        d_in=d_in, d_sae=2 * d_in, dtype=dtype_name, metadata=SAEMetadata(hook_name=hook), **cfg
    )
    sae = sae_class(config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return sae


def pre_activation(sae: Any, activation: torch.Tensor) -> torch.Tensor:
    """SAELens's ``hook_sae_acts_pre`` for ``activation`` ``[batch, pos, ...]``."""
    seen = {}
    handle = sae.hook_sae_acts_pre.register_forward_hook(
        lambda module, args, out: seen.update(pre=out)
    )
    try:
        with torch.no_grad():
            sae.encode(activation)
    finally:
        handle.remove()
    return seen["pre"]


def check(model: Any, toks: torch.Tensor, sae: Any, feature: int, position: int) -> None:
    hook = sae.cfg.metadata.hook_name
    result = tl_connwalk.attribute(model, toks, target=(sae, feature), position=position)
    _, cache = model.run_with_cache(toks)

    def read(activation: torch.Tensor) -> torch.Tensor:
        return pre_activation(sae, activation)[:, position, feature].to(result.scores)

    torch.testing.assert_close(result.target_value, read(cache[hook]))
    assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
    assert_exact(result.scores, reference.hook_contributions(model, toks, hook, read), result)
    assert result.targets[0] == f"{type(sae).__name__}[{feature}] at {hook} @ {position % 9}"


@hooked_only
@pytest.mark.parametrize(
    "arch_, kind, hook, cfg",
    [
        ("gpt2_ln", "standard", "blocks.1.hook_resid_pre", {}),
        ("gpt2_ln", "standard", "blocks.1.hook_resid_pre", {"apply_b_dec_to_input": False}),
        ("llama_gqa_rotary", "jumprelu", "blocks.1.hook_resid_mid", {}),
        ("ln_post_gemma_like", "topk", "blocks.0.hook_resid_post", {"k": 4}),
        ("gpt2_ln", "standard", "blocks.1.mlp.hook_post", {}),
        ("gpt2_ln", "standard", "blocks.1.attn.hook_z", {"reshape_activations": "hook_z"}),
    ],
    ids=str,
)
def test_sae_feature_equals_saelens_on_the_frozen_network(arch_, kind, hook, cfg):
    model = build(arch_, dtype=torch.float64)
    _, cache = model.run_with_cache(tokens())
    d_in = cache[hook][0, 0].numel()
    sae = random_sae(kind, d_in, hook, torch.float64, **cfg)
    check(model, tokens(), sae, feature=5, position=-3)


def test_bridge_sae_feature():
    model = cached_bridge("llama", False)
    hook = "blocks.1.hook_resid_pre"
    sae = random_sae("standard", model.cfg.d_model, hook, torch.float32)
    toks = bridge_tokens(pos=9)
    check(model, toks, sae, feature=11, position=6)


@pytest.mark.parametrize(
    "kind, cfg, feature, hook, match",
    [
        ("standard", {"normalize_activations": "layer_norm"}, 0, None, "normalises its input"),
        ("gated", {}, 0, None, "no pre-activation of the form"),
        ("standard", {}, 48, None, r"feature must be an int in 0\.\.47"),
        ("standard", {}, 0, "blocks.9.hook_resid_pre", "not a hook point"),
    ],
    ids=str,
)
def test_refused_saes(gpt2, kind, cfg, feature, hook, match):
    sae = random_sae(kind, 24, hook or "blocks.1.hook_resid_pre", torch.float32, **cfg)
    with pytest.raises(tl_connwalk.ConnWalkError, match=match):
        tl_connwalk.attribute(gpt2, tokens(), target=(sae, feature))


def test_sae_reading_another_width_is_refused(gpt2):
    sae = random_sae("standard", 10, "blocks.1.hook_resid_pre", torch.float32)
    with pytest.raises(
        tl_connwalk.ConnWalkError, match=r"reads 10 values per position, but .* holds \(24,\)"
    ):
        tl_connwalk.attribute(gpt2, tokens(), target=(sae, 0))


@hooked_only
def test_sae_feature_knockout_estimate_is_knockout_where_exact():
    """Every source knocked out for real (``exact`` = all): knockout's own scores."""
    model = build("gpt2_ln", dtype=torch.float64)
    hook = "blocks.1.hook_resid_pre"
    sae = random_sae("standard", model.cfg.d_model, hook, torch.float64)
    toks = tokens()
    target = dict(target=(sae, 5), position=-3)
    knocked = tl_connwalk.attribute(model, toks, method="knockout", **target)
    got = tl_connwalk.attribute(model, toks, method="knockout_estimate", exact=9, **target)
    assert_exact(got.scores, knocked.scores, got)
    assert (got.edges(1) == 0).all(), "a layer after the SAE's hook was read"
