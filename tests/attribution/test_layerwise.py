"""The layer-wise baselines (attention norm, ALTI, value zeroing) on a case worked by hand and
against their definitions computed another way: from TransformerLens's own ``hook_v``,
``hook_pattern`` and ``W_O``, from frozen single-layer runs through hooks, and from one
unbatched forward pass per source token."""

import math

import pytest
import torch
from torch.nn.functional import cosine_similarity

import tl_connwalk
from tests import tolerances
from tests.architectures import (
    HAS_BRIDGE,
    HookedTransformer,
    HookedTransformerConfig,
    bridge_only,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_encoder,
    hooked_only,
    tokens,
)

METHODS = ("attention_norm", "alti", "value_zeroing")


def hand_model():
    """One layer, one head, ``d_model = 2``, no norm: ``W_Q = W_K = 0`` (uniform causal
    attention), ``W_V = I``, ``W_O`` swaps the two coordinates, token ``t`` embeds as ``e_t``,
    no positional embedding, no bias. On tokens ``[0, 1]``: ``x_0 = (1, 0)``, ``x_1 = (0, 1)``,
    query 1 attends ``1/2, 1/2``."""
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=2, n_heads=1, d_head=2, n_ctx=4, d_vocab=2, attn_only=True,
        normalization_type=None, act_fn="relu", seed=0,
    )  # fmt: skip
    model = HookedTransformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.embed.W_E.copy_(torch.eye(2))
        model.unembed.W_U.copy_(torch.eye(2))
        model.blocks[0].attn.W_V.copy_(torch.eye(2)[None])
        model.blocks[0].attn.W_O.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]])[None])
    return model.to(torch.float64)


@hooked_only
def test_by_hand():
    """Query 1's output is ``y_1 = x_1 + swap((x_0 + x_1)/2) = (1/2, 3/2)``; its messages are
    ``swap(x_0)/2 = (0, 1/2)`` and ``swap(x_1)/2 = (1/2, 0)``.

    - Attention norm (residual on the diagonal): ``[||(0, 1/2)||, ||(1/2, 0) + (0, 1)||] =
      [1/2, sqrt(5)/2]``, normalised.
    - ALTI: ``T_1(x_0) = (0, 1/2)``, ``T_1(x_1) = (1/2, 1)``, ``||y_1||_1 = 2``, distances
      ``||(1/2, 1)||_1 = 3/2`` and ``||(0, 1/2)||_1 = 1/2``: ``c = [1/2, 3/2]``, i.e.
      ``[1/4, 3/4]``.
    - Value zeroing: zeroing ``v_0`` gives ``y_1 = (1/2, 1)``, zeroing ``v_1`` gives ``(0, 3/2)``:
      ``1 - cos`` with ``(1/2, 3/2)`` is ``1 - 1.75 / sqrt(1.25 * 2.5)`` and
      ``1 - 2.25 / (1.5 sqrt(2.5))``, normalised.
    """
    model, toks = hand_model(), torch.tensor([[0, 1]])
    atol = tolerances.atol(torch.float64, terms=4)  # sums of two terms of two coordinates
    norms = [0.5, math.sqrt(5) / 2]
    zeroing = [1 - 1.75 / math.sqrt(1.25 * 2.5), 1 - 2.25 / (1.5 * math.sqrt(2.5))]
    expected = {
        "attention_norm": [n / sum(norms) for n in norms],
        "alti": [0.25, 0.75],
        "value_zeroing": [d / sum(zeroing) for d in zeroing],
    }
    for method, row in expected.items():
        # value zeroing's 1 - cos keeps half the digits of a cosine near 1
        tol = tolerances.cancelling_atol(torch.float64, 4) if method == "value_zeroing" else atol
        result = tl_connwalk.attribute(model, toks, target=0, position=1, method=method)
        assert result.method == method
        torch.testing.assert_close(
            result.scores[0], torch.tensor(row, dtype=torch.float64), rtol=0, atol=tol
        )
        torch.testing.assert_close(result.scores.sum(-1) + result.bias, result.target_value)
        # query 0 sees only itself: its row is the identity's whatever the method
        first = tl_connwalk.attribute(model, toks, target=0, position=0, method=method)
        identity = torch.tensor([1.0, 0.0], dtype=torch.float64)
        torch.testing.assert_close(first.scores[0], identity, rtol=0, atol=tol)


def rollout_row(matrices, position):
    """``(C_{L-1} ... C_0)[:, position]`` of row-normalised ``C_l`` ``[batch, query, key]``."""
    result = None
    for matrix in matrices:
        matrix = matrix / matrix.sum(-1, keepdim=True)
        result = matrix if result is None else matrix @ result
    return result[:, position]


def output_hook(model, layer):
    name = f"blocks.{layer}.hook_normalized_resid_post"
    if type(model).__name__ == "HookedEncoder":
        return name
    return f"blocks.{layer}.hook_resid_post"


def value_heads(model, cache, layer):
    """``hook_v`` expanded to the query heads ``[batch, key, head, d_head]`` and ``b_V``."""
    attn = model.blocks[layer].attn
    v = cache[f"blocks.{layer}.attn.hook_v"]
    n_heads = cache[f"blocks.{layer}.attn.hook_pattern"].shape[1]
    b_V = attn.b_V
    b_V = torch.zeros(v.shape[2:], dtype=v.dtype) if b_V is None else b_V.detach()
    v = v.repeat_interleave(n_heads // v.shape[2], 2)
    return v, b_V.repeat_interleave(n_heads // b_V.shape[0], 0)


def attention_norm_reference(model, toks, position):
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    matrices = []
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        v, _ = value_heads(model, cache, layer)
        vectors = torch.einsum("bhij,bjhd,hdm->bijm", pattern, v, model.blocks[layer].attn.W_O)
        eye = torch.eye(toks.shape[1], dtype=vectors.dtype)
        vectors = (
            vectors + eye[None, :, :, None] * cache[f"blocks.{layer}.hook_resid_pre"][:, :, None]
        )
        matrices.append(vectors.norm(dim=-1))
    return rollout_row(matrices, position)


def sublayer_output(model, toks, cache, layer, keep):
    """The attention sublayer's output of layer ``layer`` with its patterns and norm scales
    frozen and only source ``keep``'s residual entering it (none: ``keep=None``): BERT's
    LayerNorm ``ln1`` as its module outputs it, else ``hook_resid_mid`` (``hook_resid_post`` in
    attention-only models)."""
    encoder = type(model).__name__ == "HookedEncoder"
    read = f"blocks.{layer}.hook_resid_mid"
    if read not in cache:
        read = f"blocks.{layer}.hook_resid_post"
    frozen = [f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.ln1.hook_scale"]
    resid = cache[f"blocks.{layer}.hook_resid_pre"]
    masked = torch.zeros_like(resid)
    if keep is not None:
        masked[:, keep] = resid[:, keep]
    seen = {}
    hooks = [(name, lambda x, hook, name=name: cache[name]) for name in frozen if name in cache]
    hooks.append((f"blocks.{layer}.hook_resid_pre", lambda x, hook: masked))
    if not encoder:
        hooks.append((read, lambda x, hook: seen.__setitem__("y", x)))
    ln1 = model.blocks[layer].ln1
    handle = ln1.register_forward_hook(lambda module, args, out: seen.setdefault("ln1", out))
    try:
        with torch.no_grad():
            model.run_with_hooks(toks, fwd_hooks=hooks)
    finally:
        handle.remove()
    return seen["ln1"] if encoder else seen["y"]


def alti_reference(model, toks, position):
    """``T_i(x_j) = y(r_j alone) - y(no residual)`` with the layer's patterns and norm scales
    frozen, ``y`` the attention sublayer's output (`sublayer_output`); the difference leaves out
    the biases."""
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    matrices = []
    for layer in range(model.cfg.n_layers):
        none = sublayer_output(model, toks, cache, layer, None)
        T = torch.stack(
            [sublayer_output(model, toks, cache, layer, j) - none for j in range(toks.shape[1])], 2
        )  # [batch, query, key, d_model]
        y = T.sum(2, keepdim=True)
        c = (y.abs().sum(-1) - (y - T).abs().sum(-1)).clamp(min=0)
        matrices.append(c)
    return rollout_row(matrices, position)


def value_zeroing_reference(model, toks, position):
    """One plain forward pass per layer and source, ``hook_v`` of that source zeroed."""
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    matrices = []
    for layer in range(model.cfg.n_layers):
        clean = cache[output_hook(model, layer)]
        columns = []
        for j in range(toks.shape[1]):
            seen = {}

            def zero(v, hook, j=j):
                v = v.clone()
                v[:, j] = 0
                return v

            hooks = [
                (f"blocks.{layer}.attn.hook_v", zero),
                (output_hook(model, layer), lambda x, hook, seen=seen: seen.__setitem__("y", x)),
            ]
            with torch.no_grad():
                model.run_with_hooks(toks, fwd_hooks=hooks)
            columns.append(1 - cosine_similarity(seen["y"].double(), clean.double(), dim=-1))
        matrices.append(torch.stack(columns, -1))
    return rollout_row(matrices, position)


REFERENCES = {
    "attention_norm": attention_norm_reference,
    "alti": alti_reference,
    "value_zeroing": value_zeroing_reference,
}


def check(model, toks, method, dtype):
    result = tl_connwalk.attribute(model, toks, target=3, position=5, method=method)
    expected = REFERENCES[method](model, toks, 5).to(result.scores)
    if method == "value_zeroing":  # 1 - cos keeps half the digits of a cosine near 1
        atol = tolerances.cancelling_atol(dtype)
    else:
        # L1 norms of sums over positions and d_model; each layer's error carried by the product
        n_pos, d_model, n_layers = toks.shape[1], model.cfg.d_model, model.cfg.n_layers
        atol = tolerances.atol(dtype, terms=n_pos * d_model, scale=n_layers)
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=atol)
    torch.testing.assert_close(result.scores.sum(-1), torch.ones_like(result.bias))
    torch.testing.assert_close(result.scores.sum(-1) + result.bias, result.target_value)
    assert all(not point.fwd_hooks for point in model.hook_dict.values()), "a hook was left"


@hooked_only
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch_", ["gpt2_ln", "gpt2_processed", "llama_gqa_rotary"])
def test_hooked_transformer(arch_, method):
    check(build(arch_, dtype=torch.float64), tokens(), method, torch.float64)


@hooked_only
@pytest.mark.parametrize("method", METHODS)
def test_hooked_encoder(method):
    check(hooked_encoder().to(torch.float64), tokens(), method, torch.float64)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("arch_", "compat"), [("gpt2", False), ("llama", False), ("llama", True)])
def test_bridge(arch_, compat, method):
    check(cached_bridge(arch_, compat), bridge_tokens(), method, torch.float32)


@pytest.mark.parametrize("method", ["attention_norm", "value_zeroing"])
def test_bridge_with_a_norm_after_attention(method):
    """Gemma 3 (``ln1_post``): the messages' norms are taken before that norm; value zeroing
    reads the block's output."""
    check(cached_bridge("gemma3", False), bridge_tokens(), method, torch.float32)


@bridge_only
def test_bridge_alti_refuses_a_norm_after_attention():
    with pytest.raises(tl_connwalk.ConnWalkError, match="method='attention_norm'"):
        tl_connwalk.attribute(cached_bridge("gemma3", False), bridge_tokens(), method="alti")


@hooked_only
def test_value_zeroing_in_chunks(monkeypatch):
    """Sources split over several forward passes (the last one short) give the same matrix."""
    from tl_connwalk.attribution import layerwise

    model, toks = build("llama_gqa_rotary", dtype=torch.float64), tokens()
    whole = tl_connwalk.attribute(model, toks, method="value_zeroing")
    monkeypatch.setattr(layerwise, "VALUE_ZEROING_ROWS", 4 * 9)  # 4 sources of 9 positions
    chunked = tl_connwalk.attribute(model, toks, method="value_zeroing")
    # the same sums in other batch shapes: rounding only
    torch.testing.assert_close(
        chunked.scores, whole.scores, rtol=0, atol=tolerances.atol(torch.float64)
    )


@hooked_only
def test_alti_refuses_a_norm_after_attention():
    with pytest.raises(tl_connwalk.ConnWalkError, match="method='attention_norm'"):
        tl_connwalk.attribute(build("ln_post_gemma_like"), tokens(), method="alti")


@hooked_only
@pytest.mark.parametrize("method", METHODS)
def test_a_repeated_sequence_is_measured_once(method, monkeypatch):
    """Several targets on one text: the layer-wise method runs on the distinct sequences only,
    and each row is what that sequence gives alone."""
    from tl_connwalk.attribution import api

    model, toks = build("gpt2_ln", dtype=torch.float64), tokens()
    batch = toks[[0, 1, 0, 0]]
    position = torch.tensor([3, 5, 7, 2])
    seen = []
    measure = api.LAYERWISE[method]
    monkeypatch.setitem(
        api.LAYERWISE,
        method,
        lambda m, t, **kwargs: seen.append(t.shape[0]) or measure(m, t, **kwargs),
    )
    together = tl_connwalk.attribute(model, batch, position=position, method=method)
    assert seen == [2]
    for b in range(4):
        alone = tl_connwalk.attribute(
            model, batch[b : b + 1], position=int(position[b]), method=method
        )
        torch.testing.assert_close(
            together.scores[b], alone.scores[0], rtol=0, atol=tolerances.atol(torch.float64)
        )


LAYERWISE_MODELS = {
    "gpt2_ln": lambda: (build("gpt2_ln", dtype=torch.float64), tokens()),
    "encoder": lambda: (hooked_encoder().to(torch.float64), tokens()),
    "bridge_llama": lambda: (cached_bridge("llama", False), bridge_tokens()),
}


def _model(name):
    if name == "bridge_llama" and not HAS_BRIDGE:
        pytest.skip("TransformerLens 2.x has no TransformerBridge")
    if name != "bridge_llama" and HookedTransformer is None:
        pytest.skip("TransformerLens 4.x has no HookedTransformer")
    return LAYERWISE_MODELS[name]()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(LAYERWISE_MODELS))
def test_first_layers_are_the_slice_of_all(name, method):
    """``layers=k`` computes the first ``k`` matrices, equal to those of every layer (the same
    arithmetic on the same activations); through `attribute`, a target read inside the network
    rolls out those below it."""
    from tl_connwalk.attribution import layerwise, mixing

    model, toks = _model(name)
    every = getattr(layerwise, method)(model, toks)
    assert every.shape[0] == model.cfg.n_layers == 2
    first = getattr(layerwise, method)(model, toks, layers=1)
    torch.testing.assert_close(first, every[:1], rtol=0, atol=0)
    torch.testing.assert_close(
        getattr(layerwise, method)(model, toks, layers=2), every, rtol=0, atol=0
    )
    result = tl_connwalk.attribute(
        model, toks, target=("blocks.1.hook_resid_pre", 0), position=4, method=method
    )
    expected = mixing.rolled_out(every[:1])[:, 4]
    torch.testing.assert_close(result.scores, expected.to(result.scores), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt2_ln", "bridge_llama"])
def test_value_zeroing_runs_no_layer_above(name):
    """With ``layers=1`` neither the clean run nor the zeroed runs enter block 1."""
    from tl_connwalk.attribution import layerwise

    model, toks = _model(name)
    calls = [0, 0]
    handles = [
        model.blocks[layer].register_forward_pre_hook(
            lambda module, args, layer=layer: calls.__setitem__(layer, calls[layer] + 1)
        )
        for layer in range(2)
    ]
    try:
        layerwise.value_zeroing(model, toks, layers=1)
    finally:
        for handle in handles:
            handle.remove()
    assert calls[0] > 0 and calls[1] == 0


@pytest.mark.parametrize("layers", [0, 3, True])
@hooked_only
def test_layers_checked(layers):
    from tl_connwalk.attribution import layerwise

    with pytest.raises(tl_connwalk.ConnWalkError, match="layers must be an int in 1..2"):
        layerwise.attention_norm(build("gpt2_ln"), tokens(), layers=layers)
