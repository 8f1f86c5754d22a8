"""Grouped-query models end to end (spec §3): a constructed exact scaled partial isometry reads 0.

Query heads that share value heads give effective transports of rank at most
``H_kv d_head``; measured with that rank, a transport that is a multiple of a projection
onto the value heads' columns has every defect 0 and the common scale is that multiple.
Built on a HookedTransformer with ``n_key_value_heads`` (rotary dimension below ``d_head``:
rotary acts on queries and keys only) and on the toy Llama TransformerBridge.
"""

import math

import pytest
import torch

import tl_connwalk
from tests.architectures import hooked_only
from tests.core.test_value_heads import defect_tolerance, orthonormal_value_heads
from tl_connwalk.core import isometry
from tl_connwalk.toy import random_bridge

try:
    from transformer_lens import HookedTransformer, HookedTransformerConfig
except ImportError:  # TransformerLens 4.x
    HookedTransformer = HookedTransformerConfig = None  # type: ignore[assignment,misc]


def check_exact_partial_isometry(cache, n_heads, n_value, dtype):
    """Every defect of layer 0 is 0 to ``dtype``'s tolerance and the scale is ``2 H / H_kv``:
    ``T_ij = H sum_h (1/H) W_V^{kv(h)} 2 W_V^{kv(h)T} = (2 H / H_kv) P``, ``P`` the projection
    onto the ``H_kv d_head`` orthonormal value columns."""
    walk = tl_connwalk.connection_walk(cache, 0)
    assert walk.n_value_heads == n_value
    tol = defect_tolerance(dtype, n_heads)
    on_walk = walk.walk > 0
    for kind in ("gram", "frobenius"):
        assert walk.isometry_defects(kind)[on_walk].abs().max() < tol, kind
    res = walk.laplacian_residual(baseline_draws=2)
    assert res.transport_defect.abs().max() < tol
    assert (res.baseline["transport_defect"].mean > 10 * tol).all()  # random draws are not
    multiple = 2 * n_heads / n_value
    torch.testing.assert_close(res.scale, torch.full_like(res.scale, multiple))
    # a head subset: its transports factor through the value heads it reads (spec §3), here
    # the first head alone (1 value head) and the first and last (2 value heads, one each)
    for heads in ([0], [0, n_heads - 1]):
        sub = walk.of_heads(heads)
        distinct = len({walk.kv_heads[h] for h in heads})
        assert sub.n_value_heads == distinct
        scoped = walk.laplacian_residual(heads=heads, baseline_draws=2)
        assert scoped.transport_defect.abs().max() < tol, heads
        expected = 2 * len(heads) / distinct
        torch.testing.assert_close(scoped.scale, torch.full_like(scoped.scale, expected))
        assert sub.isometry_defects("frobenius")[sub.walk > 0].abs().max() < tol, heads
    # the rank H d_head of weights whose sharing is not declared: sqrt(1 - H_kv / H) here
    d_model, d_head = walk.W_V.shape[1:]
    unmapped = isometry.effective_transport_defect(walk.walk, walk.gates, walk.W_V, walk.W_O)
    assert min(d_model, n_heads * d_head) == n_heads * d_head  # the constructions keep it so
    torch.testing.assert_close(
        unmapped, torch.full_like(unmapped, math.sqrt(1 - n_value / n_heads)), atol=tol, rtol=0
    )


@hooked_only
def test_hooked_transformer_grouped_query_partial_isometry():
    n_heads, n_value, d_model, d_head = 6, 2, 48, 6
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=d_model, d_head=d_head, n_heads=n_heads, n_key_value_heads=n_value,
        n_ctx=16, d_vocab=40, act_fn="silu", normalization_type="RMS", attn_only=True,
        positional_embedding_type="rotary", rotary_dim=4, dtype=torch.float64, device="cpu",
    )  # fmt: skip
    model = HookedTransformer(cfg)
    V = orthonormal_value_heads(n_value, d_model, d_head)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.W_Q.zero_()  # equal scores: every head attends alike
        attn.b_Q.zero_()
        attn._W_V.copy_(V)
        attn._b_V.zero_()
        attn.W_O.copy_(2 * attn.W_V.mT)
    tl_connwalk.attach(model)
    try:
        _, cache = model.run_with_cache(torch.arange(8)[None] % 40)
        check_exact_partial_isometry(cache, n_heads, n_value, torch.float64)
    finally:
        tl_connwalk.detach(model)


@pytest.mark.parametrize("compat", [False, True])
def test_bridge_llama_grouped_query_partial_isometry(compat):
    n_heads, d_model = 4, 32  # the toy Llama: n_heads // 2 = 2 value heads, d_head = 8
    model = random_bridge("llama", n_layers=1, d_model=d_model, n_heads=n_heads)
    attention = model.original_model.model.layers[0].self_attn
    n_value, d_head = model.cfg.n_key_value_heads, d_model // n_heads
    V = orthonormal_value_heads(n_value, d_model, d_head).float()
    kv = [h // (n_heads // n_value) for h in range(n_heads)]
    with torch.no_grad():
        attention.q_proj.weight.zero_()
        attention.v_proj.weight.copy_(V.mT.reshape(n_value * d_head, d_model))
        attention.o_proj.weight.copy_(2 * torch.cat([V[k] for k in kv], dim=-1))
    if compat:
        model.enable_compatibility_mode()
    tl_connwalk.attach(model)
    try:
        _, cache = model.run_with_cache(torch.arange(7)[None])
        check_exact_partial_isometry(cache, n_heads, n_value, torch.float32)
    finally:
        tl_connwalk.detach(model)
