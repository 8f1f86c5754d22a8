"""The baselines of ``attribute(method=...)`` against their definitions, computed another way."""

import pytest
import torch

import tl_connwalk
from tests import tolerances
from tests.architectures import build, cached_bridge, hooked_only, tokens
from tests.tolerances import rtol


def knocked_out_by_renormalising(model, toks, source, token, position):
    """The target with key ``source`` (an int or a list of keys) blocked for every other query
    in every layer, done after the softmax: column ``source`` zeroed off the diagonal and each
    row renormalised (what a ``-inf`` score does to a softmax)."""
    sources = [source] if isinstance(source, int) else source

    def renormalise(pattern, hook):
        keep = torch.ones_like(pattern)
        for s in sources:
            keep[..., s] = 0
            keep[..., s, s] = 1
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
    atol = tolerances.atol(result.scores.dtype, scale=size)  # two softmax paths, same sums
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


@hooked_only
def test_block_keys_blocks_each_run_its_own_set(monkeypatch):
    """Runs with several keys blocked at once, a different set per sequence, chunked."""
    from tl_connwalk.attribution import baselines

    monkeypatch.setattr(baselines, "KNOCKOUT_CHUNK", 2)
    model = build("llama_gqa_rotary", dtype=torch.float64)
    toks = tokens()
    sets = [[[0, 3], [1]], [[2, 4, 5], []], [[6], [0, 1, 2, 3]]]  # [run][sequence] -> keys
    keys = torch.zeros(len(sets), toks.shape[0], toks.shape[1], dtype=torch.bool)
    for r, per_sequence in enumerate(sets):
        for b, blocked in enumerate(per_sequence):
            keys[r, b, blocked] = True
    got = baselines.block_keys(model, toks, keys, lambda logits, final: logits[:, 6, 5])
    expected = torch.stack(
        [
            torch.stack(
                [
                    knocked_out_by_renormalising(model, toks[b : b + 1], blocked, 5, 6)[0]
                    for b, blocked in enumerate(per_sequence)
                ]
            )
            for per_sequence in sets
        ]
    )
    atol = tolerances.atol(got.dtype, scale=expected.abs().max().item())
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


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


def test_rollout_by_hand():
    """Abnar & Zuidema's rollout on a hand-worked case: one head, two tokens, two layers with
    ``A = [[1, 0], [1/2, 1/2]]``: ``B = (A + I)/2 = [[1, 0], [1/4, 3/4]]``, and ``B B`` has
    second row ``[1/4 + 3/4 * 1/4, 3/4 * 3/4] = [7/16, 9/16]``."""
    from tl_connwalk.attribution.baselines import rollout

    A = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    result = rollout(A[None, None, None].expand(2, 1, 1, 2, 2))
    expected = torch.tensor([[1.0, 0.0], [7 / 16, 9 / 16]], dtype=torch.float64)
    torch.testing.assert_close(result[0], expected, rtol=0, atol=rtol(torch.float64, 4))


def test_rollout_of_a_model(gpt2):
    """Two layers: ``B_1 B_0`` from the cached patterns, read at the target position."""
    toks = tokens()
    result = tl_connwalk.attribute(gpt2, toks, position=4, method="rollout")
    _, cache = gpt2.run_with_cache(toks)
    eye = torch.eye(9)
    B0, B1 = ((cache[f"blocks.{i}.attn.hook_pattern"].mean(1) + eye) / 2 for i in range(2))
    torch.testing.assert_close(result.scores, (B1 @ B0)[:, 4])
    torch.testing.assert_close(result.scores.sum(-1), torch.ones(2))
