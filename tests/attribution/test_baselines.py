"""The baselines of ``attribute(method=...)`` against their definitions, computed another way."""

import pytest
import torch

import tl_connwalk
from tests.architectures import build, cached_bridge, hooked_only, tokens


def knocked_out_by_renormalising(model, toks, source, token, position):
    """The target with key ``source`` blocked for every other query in every layer, done after
    the softmax: column ``source`` zeroed off the diagonal and each row renormalised (what a
    ``-inf`` score does to a softmax)."""

    def renormalise(pattern, hook):
        keep = torch.ones_like(pattern)
        keep[..., source] = 0
        keep[..., source, source] = 1
        pattern = pattern * keep
        return pattern / pattern.sum(-1, keepdim=True)

    hooks = [(f"blocks.{layer}.attn.hook_pattern", renormalise) for layer in range(2)]
    with torch.no_grad():
        logits = model.run_with_hooks(toks, fwd_hooks=hooks)
    return logits[torch.arange(toks.shape[0]), position, token]


def check_knockout(model, toks):
    result = tl_connwalk.attribute(model, toks, target=5, position=6, method="knockout")
    expected = torch.stack(
        [
            result.target_value - knocked_out_by_renormalising(model, toks, s, 5, 6)
            for s in range(toks.shape[1])
        ],
        -1,
    )
    size = result.target_value.abs().max().item()
    atol = 64 * torch.finfo(result.scores.dtype).eps * size  # two softmax paths, same sums
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=atol)
    assert (result.scores[:, 7:] == 0).all(), "a key after the target position mattered"
    torch.testing.assert_close(result.scores.sum(-1) + result.bias, result.target_value)
    return result


@hooked_only
@pytest.mark.parametrize("arch_", ["gpt2_ln", "llama_gqa_rotary", "ln_post_gemma_like"])
def test_knockout_is_the_renormalised_pattern(arch_, monkeypatch):
    from tl_connwalk.attribution import baselines

    monkeypatch.setattr(baselines, "KNOCKOUT_CHUNK", 4)  # several chunks, the last one short
    check_knockout(build(arch_, dtype=torch.float64), tokens())


def test_bridge_knockout():
    model = cached_bridge("llama", False)
    check_knockout(model, torch.randint(0, 63, (2, 9), generator=torch.Generator().manual_seed(3)))


@hooked_only
@pytest.mark.parametrize("arch_", ["gpt2_ln", "llama_gqa_rotary"])
def test_grad_x_input_is_the_derivative_along_each_embedding(arch_):
    """``(dy/de_s) . e_s = d/dt y(e_s -> (1 + t) e_s)`` at ``t = 0``, by central differences."""
    model = build(arch_, dtype=torch.float64)
    toks = tokens()
    result = tl_connwalk.attribute(model, toks, target=3, method="grad_x_input")
    names = [name for name in ("hook_embed", "hook_pos_embed") if name in model.hook_dict]
    step = 1e-5

    def scaled(source, t):
        def scale(x, hook):
            x = x.clone()
            x[:, source] *= 1 + t
            return x

        with torch.no_grad():
            logits = model.run_with_hooks(toks, fwd_hooks=[(name, scale) for name in names])
        return logits[:, -1, 3]

    expected = torch.stack(
        [(scaled(s, step) - scaled(s, -step)) / (2 * step) for s in range(toks.shape[1])], -1
    )
    # central differences: error O(step^2 y''') ~ 1e-10 on these unit-scale targets
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=1e-8)
    assert result.method == "grad_x_input"
    with pytest.raises(tl_connwalk.ConnWalkError, match="method='connection'"):
        result.edges(0)
