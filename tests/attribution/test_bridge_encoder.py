"""A BERT-style TransformerBridge: a masked position's logit, exact for the frozen network.

The Bridge runs Hugging Face's attention and shows the pattern after the fact, so the reference
here freezes attention by rebuilding ``z = A v`` from the clean pattern and the live values.
"""

from typing import Any

import pytest
import torch

import tl_connwalk
from tests.architectures import bridge_only, bridge_tokens, cached_bridge
from tests.attribution.test_connection import assert_exact

pytestmark = bridge_only
EMBEDDINGS = ("hook_embed", "hook_pos_embed", "token_type_embed.hook_out")


def reference(model: Any, toks: torch.Tensor, keep: int | None, position: int, token: int):
    """The target of the frozen network fed only source ``keep``'s embeddings, by hooks."""
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    head_act = model.original_model.cls.predictions.transform.transform_act_fn
    seen = []
    handle = head_act.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        model(toks)
    handle.remove()
    head_gain = seen[0][1] / seen[0][0]
    hooks: list[tuple[str, Any]] = []
    live: dict[str, torch.Tensor] = {}
    for name in cache:
        if name.endswith("hook_scale"):
            hooks.append((name, lambda x, hook, v=cache[name]: v))
    for layer in range(model.cfg.n_layers):
        pre, post = f"blocks.{layer}.mlp.hook_pre", f"blocks.{layer}.mlp.hook_post"
        gain = cache[post] / cache[pre]
        hooks += [(pre, lambda x, hook, pre=pre: live.__setitem__(pre, x))]
        hooks += [(post, lambda x, hook, pre=pre, g=gain: g * live[pre])]
        v_name, pattern = f"blocks.{layer}.attn.hook_v", cache[f"blocks.{layer}.attn.hook_pattern"]

        def z_hook(z, hook, v_name=v_name, pattern=pattern):
            v = live[v_name].reshape(*live[v_name].shape[:2], pattern.shape[1], -1)
            return torch.einsum("bhqk,bkhe->bqhe", pattern, v).reshape(z.shape)

        hooks += [(v_name, lambda x, hook, n=v_name: live.__setitem__(n, x))]
        hooks += [(f"blocks.{layer}.attn.hook_z", z_hook)]
    for name in EMBEDDINGS:
        value = torch.zeros_like(cache[name])
        if keep is not None:
            value[:, keep] = cache[name][:, keep]
        hooks.append((name, lambda x, hook, v=value: v))
    handle = head_act.register_forward_hook(lambda module, args, out: head_gain * args[0])
    try:
        with torch.no_grad():
            return model.run_with_hooks(toks, fwd_hooks=hooks)[:, position, token]
    finally:
        handle.remove()


@pytest.mark.parametrize("compat", [False, True])
def test_bert_bridge_masked_position(compat):
    model = cached_bridge("bert", compat)
    toks = bridge_tokens()
    result = tl_connwalk.attribute(model, toks, target=5, position=3)
    torch.testing.assert_close(result.target_value, model(toks)[:, 3, 5])
    assert_exact(result.scores.sum(-1) + result.bias, result.target_value, result)
    bias = reference(model, toks, None, 3, 5)
    expected = torch.stack(
        [reference(model, toks, s, 3, 5) - bias for s in range(toks.shape[1])], -1
    )
    assert_exact(result.scores, expected, result)
    assert_exact(result.bias, bias, result)
    assert (result.scores[:, 4:] != 0).all(), "later positions sent nothing to an encoder"
    with pytest.raises(tl_connwalk.ConnWalkError, match="post-norm"):
        result.routes()
