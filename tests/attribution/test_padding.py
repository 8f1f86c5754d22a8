"""Padded batches: padding sends nothing, counts nowhere, and each sequence is as if alone."""

import pytest
import torch

import tl_connwalk
from tests.architectures import bridge_tokens, build, cached_bridge, hooked_only, tokens
from tests.attribution.test_connection import assert_exact

METHODS = ["connection", "knockout_estimate", "grad_x_input", "knockout", "rollout"]


def padded(
    toks: torch.Tensor, short: int, left: bool, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence 1 cut to its first ``short`` tokens and padded with ``pad``; the mask."""
    toks, mask = toks.clone(), torch.ones_like(toks)
    n_pos = toks.shape[1]
    cut = toks[1, :short].clone()
    toks[1], mask[1] = pad, 0
    span = slice(n_pos - short, None) if left else slice(0, short)
    toks[1, span], mask[1, span] = cut, 1
    return toks, mask


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("arch_", ["gpt2_ln", "llama_gqa_rotary"])
@hooked_only
def test_padded_sequence_scores_equal_the_sequence_alone(arch_, left, method):
    model = build(arch_, dtype=torch.float64)
    toks, mask = padded(tokens(), 6, left, pad=0)
    result = tl_connwalk.attribute(
        model, toks, attention_mask=mask, method=method, target=(3, 5), position=-2
    )
    alone = tl_connwalk.attribute(model, toks[1:, mask[1] == 1], method=method, target=(3, 5),
                                  position=-2)  # fmt: skip
    first = tl_connwalk.attribute(model, toks[:1], method=method, target=(3, 5), position=-2)
    assert_exact(result.scores[1, mask[1] == 1], alone.scores[0], alone)
    assert (result.scores[1, mask[1] == 0] == 0).all()
    assert_exact(result.scores[0], first.scores[0], first)
    assert_exact(result.target_value, torch.cat([first.target_value, alone.target_value]), alone)
    assert int(result.position[1]) == (toks.shape[1] - 2 if left else 4)
    if method == "connection":
        assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
        sources = {route.source for route in result.routes(None, batch=1, max_length=1)}
        assert sources == set(mask[1].nonzero().flatten().tolist())
        assert len(result.to_dataframe()) == int(mask.sum())


def test_bridge_right_padding_and_texts():
    model = cached_bridge("gpt2", False)
    toks, mask = padded(bridge_tokens(pos=9), 5, False, pad=63)
    result = tl_connwalk.attribute(model, toks, attention_mask=mask, target=7)
    alone = tl_connwalk.attribute(model, toks[1:, :5], target=7)
    assert_exact(result.scores[1, :5], alone.scores[0], alone)
    assert (result.scores[1, 5:] == 0).all()
    texts = ["t1 t2 t3 t4", "t5 t6"]
    both = tl_connwalk.attribute(model, texts, target=7)
    second = tl_connwalk.attribute(model, texts[1], target=7)
    n = second.scores.shape[1]
    assert both.attention_mask is not None and int(both.attention_mask[1].sum()) == n
    assert_exact(both.scores[1][both.attention_mask[1] == 1], second.scores[0], second)


def test_bad_masks(gpt2):
    toks = tokens()
    with pytest.raises(tl_connwalk.ConnWalkError, match="attention_mask must be"):
        tl_connwalk.attribute(gpt2, toks, attention_mask=torch.ones(2, 3))
    with pytest.raises(tl_connwalk.ConnWalkError, match="no real token"):
        tl_connwalk.attribute(gpt2, toks, attention_mask=torch.tensor([[1] * 9, [0] * 9]))
    mask = torch.ones_like(toks)
    mask[1, 4:] = 0
    with pytest.raises(tl_connwalk.ConnWalkError, match=r"\[9, 4\] real"):
        tl_connwalk.attribute(gpt2, toks, attention_mask=mask, position=5)
