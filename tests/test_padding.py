"""Padded batches: every per-sequence measurement equals the sequence run alone.

For each model class (HookedTransformer, TransformerBridge, HookedEncoder) a batch of a full
sequence and a shorter one padded on the right or the left is run through TransformerLens;
first the model's own outputs for the real tokens are checked to match the short sequence
run alone, then every measurement of the padded sequence is compared with the one alone: the
walk's real rows, every `LaplacianResidual` field, per-edge defects, layer drift, the
geometry table, ``analyze`` and the report's measurements, with padding read off the cache
and with the mask given.
"""

import dataclasses
import math
from typing import Any

import pytest
import torch

import tl_connwalk
from tests.architectures import (
    HAS_HOOKED,
    bridge_tokens,
    build,
    cached_bridge,
    hooked_encoder,
    hooked_only,
)
from tests.architectures import tokens as hooked_tokens
from tests.tolerances import rtol
from tl_connwalk import ConnWalkError
from tl_connwalk.cache import n_layers_of
from tl_connwalk.report.measure import measure

N_POS, SHORT = 7, 4
#: float32 sums over a few dozen terms, renormalised rows: a few ulps of the largest value
TOL = 8 * rtol(torch.float32)


def padded_batch(toks: torch.Tensor, side: str) -> tuple[torch.Tensor, slice]:
    """``[2, N_POS]`` mask: sequence 0 full, sequence 1 ``SHORT`` real tokens on ``side``."""
    mask = torch.ones(2, N_POS, dtype=torch.long)
    real = slice(0, SHORT) if side == "right" else slice(N_POS - SHORT, N_POS)
    mask[1] = 0
    mask[1, real] = 1
    return mask, real


def close(batched: Any, alone: Any, what: str) -> None:
    batched = torch.as_tensor(batched, dtype=torch.float64)
    alone = torch.as_tensor(alone, dtype=torch.float64)
    scale = max(alone.nan_to_num().abs().max().item() if alone.numel() else 0.0, 1.0)
    torch.testing.assert_close(batched, alone, rtol=0, atol=TOL * scale, equal_nan=True, msg=what)


def compare_residuals(batched: Any, alone: Any, real: slice, what: str) -> None:
    """Sequence 1 of ``batched`` against sequence 0 of ``alone``, field by field."""
    for field in dataclasses.fields(batched):
        name = field.name
        a, b = getattr(batched, name), getattr(alone, name)
        if name == "mu":
            close(a[1, real], b[0], f"{what}: mu")
            pads = torch.ones(a.shape[1], dtype=torch.bool)
            pads[real] = False
            assert (a[1, pads] == 0).all()  # nothing on padding
        elif name == "mu_kind":
            assert a[1] == b[0], what
        elif name in ("head_defects", "layer", "processing", "exclude_sink", "mass_share"):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
        elif name == "baseline":
            for key in a:
                draws_a, draws_b = a[key].draws, b[key].draws
                if key == "head_defects":
                    close(draws_a, draws_b, f"{what}: baseline {key}")
                else:
                    close(draws_a[:, 1], draws_b[:, 0], f"{what}: baseline {key}")
        elif name == "nearest_operator":
            assert (a is None) == (b is None), what
            if a is None:
                continue
            assert a.exact and b.exact
            close(a.distance[1], b.distance[0], f"{what}: nearest operator")
        elif name == "pairing":
            assert (a is None) == (b is None), what
            if a is not None:
                close(a[1], b[0], f"{what}: pairing")
        elif isinstance(a, torch.Tensor):
            close(a[1], b[0], f"{what}: {name}")
        else:
            assert a == b, name


def check_sequence(model: Any, toks: torch.Tensor, side: str, mask_name: str) -> None:
    mask, real = padded_batch(toks, side)
    logits, cache = model.run_with_cache(toks, **{mask_name: mask})
    alone_logits, alone = model.run_with_cache(toks[1:2, real])
    # TransformerLens itself computes the real tokens as it does alone
    close(logits[1, real], alone_logits[0], "the model's own logits")
    n_layers = n_layers_of(cache)
    for given in (None, mask):
        for layer in range(n_layers):
            walk = tl_connwalk.connection_walk(cache, layer, attention_mask=given)
            single = tl_connwalk.connection_walk(alone, layer)
            assert walk.attention_mask is not None
            assert walk.attention_mask[1].tolist() == mask[1].bool().tolist()
            assert walk.attention_mask[0].all()
            close(walk.walk[1, real, real], single.walk[0], "walk rows")
            for exclude_sink in (False, True):
                options = dict(exclude_sink=exclude_sink, exact=True, baseline_draws=3, seed=2)
                compare_residuals(
                    walk.laplacian_residual(**options),
                    single.laplacian_residual(**options),
                    real,
                    f"layer {layer} sink excluded {exclude_sink}",
                )
                compare_residuals(
                    walk.laplacian_residual(mass_share=0.8, mu="teleport", **options),
                    single.laplacian_residual(mass_share=0.8, mu="teleport", **options),
                    real,
                    "mass share, teleport",
                )
            for kind in ("gram", "frobenius"):
                per_edge = walk.isometry_defects(kind)
                close(per_edge[1, real, real], single.isometry_defects(kind)[0], kind)
                outside = per_edge[1].clone()
                outside[real, real] = 0.0
                assert (outside == 0).all()  # nothing on padding
        for exclude_sink in (False, True):
            close(
                tl_connwalk.layer_drift(cache, exclude_sink=exclude_sink, attention_mask=given)[1],
                tl_connwalk.layer_drift(alone, exclude_sink=exclude_sink)[0],
                "layer drift",
            )


def check_tables(model: Any, toks: torch.Tensor, side: str, mask_name: str) -> None:
    """geometry_table, analyze and the report's measurements: the means of the sequences."""
    mask, real = padded_batch(toks, side)
    _, cache = model.run_with_cache(toks, **{mask_name: mask})
    _, first = model.run_with_cache(toks[:1])
    _, second = model.run_with_cache(toks[1:2, real])
    options = dict(exclude_sink=True, baseline_draws=2, progress=False)
    table = tl_connwalk.geometry_table(cache, **options)
    alone = [tl_connwalk.geometry_table(c, **options) for c in (first, second)]
    numbers = table.select_dtypes("number").columns
    expected = (alone[0][numbers] + alone[1][numbers]) / 2
    close(table[numbers].to_numpy(), expected.to_numpy(), "geometry table")
    analyzed = tl_connwalk.analyze(model, toks, attention_mask=mask, **options)
    close(analyzed[numbers].to_numpy(), expected.to_numpy(), "analyze")

    layers = list(range(n_layers_of(cache)))
    batched = measure(cache, _outputs(cache, layers), layers, [], baseline_draws=2, seed=0,
                      progress=False, attention_mask=mask)  # fmt: skip
    single = measure(second, _outputs(second, layers), layers, [], baseline_draws=2, seed=0,
                     progress=False)  # fmt: skip
    for record_b, record_a in zip(batched.layers, single.layers, strict=True):
        compare_residuals(record_b.with_sink, record_a.with_sink, real, "report, sink")
        compare_residuals(record_b.without_sink, record_a.without_sink, real, "report, no sink")
        assert record_b.identity_error < TOL


def _outputs(cache: Any, layers: list[int]) -> dict[int, torch.Tensor]:
    """Each layer's attention output, rebuilt from its walk (the identity has its own tests)."""
    outputs = {}
    for layer in layers:
        walk = tl_connwalk.connection_walk(cache, layer)
        outputs[layer] = walk.apply() + walk.bias()
    return outputs


@hooked_only
@pytest.mark.parametrize("arch", ["gpt2_ln", "llama_gqa_rotary", "ln_post_gemma_like"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_hooked_transformer_padded_sequence_measures_as_alone(arch: str, side: str) -> None:
    check_sequence(build(arch), hooked_tokens(batch=2, pos=N_POS), side, "attention_mask")


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma3", "bert"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_bridge_padded_sequence_measures_as_alone(arch: str, side: str) -> None:
    check_sequence(cached_bridge(arch, False), bridge_tokens(2, N_POS), side, "attention_mask")


@pytest.mark.parametrize("side", ["right", "left"])
def test_tables_of_a_padded_batch_are_the_means_of_the_sequences(side: str) -> None:
    model = build("gpt2_ln") if HAS_HOOKED else cached_bridge("gpt2", False)
    toks = hooked_tokens(batch=2, pos=N_POS) if HAS_HOOKED else bridge_tokens(2, N_POS)
    check_tables(model, toks, side, "attention_mask")


@hooked_only
def test_hooked_encoder_right_padded_sequence_measures_as_alone() -> None:
    check_sequence(
        hooked_encoder(), hooked_tokens(batch=2, pos=N_POS), "right", "one_zero_attention_mask"
    )


@hooked_only
def test_hooked_encoder_left_padding_measures_the_real_block() -> None:
    """HookedEncoder numbers left-padded tokens from the first pad (absolute positions), so
    the real tokens are not computed as alone; the walk then measures exactly the block of
    real tokens the model did compute, as a walk built from that block's own tensors."""
    model = hooked_encoder()
    toks = hooked_tokens(batch=2, pos=N_POS)
    mask, real = padded_batch(toks, "left")
    logits, cache = model.run_with_cache(toks, one_zero_attention_mask=mask)
    alone_logits, _ = model.run_with_cache(toks[1:2, real])
    assert not torch.allclose(logits[1, real], alone_logits[0], atol=1e-3)
    walk = tl_connwalk.connection_walk(cache, 1)
    block = tl_connwalk.ConnectionWalk.from_pattern(
        walk.patterns[1:, :, real, real], walk.field[1:, real], walk.W_V, walk.W_O, walk.b_V,
        walk.b_O, layer=1, processing=walk.processing,
    )  # fmt: skip
    for exclude_sink in (False, True):
        options = dict(exclude_sink=exclude_sink, exact=True, baseline_draws=3)
        compare_residuals(
            walk.laplacian_residual(**options), block.laplacian_residual(**options), real, "block"
        )


@hooked_only
def test_right_padding_without_a_mask_cannot_be_read_off_the_cache() -> None:
    """Without a mask the pads are attended like tokens; the given mask then says which are
    padding, and a mask that contradicts the cache is refused."""
    model = build("gpt2_ln")
    toks = hooked_tokens(batch=2, pos=N_POS)
    mask, real = padded_batch(toks, "right")
    _, cache = model.run_with_cache(toks)
    assert tl_connwalk.connection_walk(cache, 0).attention_mask is None
    walk = tl_connwalk.connection_walk(cache, 0, attention_mask=mask)
    _, alone = model.run_with_cache(toks[1:2, real])
    close(
        walk.laplacian_residual().transport_defect[1],
        tl_connwalk.connection_walk(alone, 0).laplacian_residual().transport_defect[0],
        "right padding with the mask given afterwards",
    )
    left, _ = padded_batch(toks, "left")
    with pytest.raises(ConnWalkError, match="attends to it: the cache was made with another"):
        tl_connwalk.connection_walk(cache, 0, attention_mask=left)
    with pytest.raises(ConnWalkError, match=r"must be \[batch, pos\]"):
        tl_connwalk.connection_walk(cache, 0, attention_mask=mask[:, 1:])


def test_unpadded_measurements_are_unchanged_by_an_all_ones_mask(gpt2: Any) -> None:
    toks = hooked_tokens(batch=2, pos=N_POS) if HAS_HOOKED else bridge_tokens(2, N_POS)
    _, cache = gpt2.run_with_cache(toks)
    walk = tl_connwalk.connection_walk(cache, 1)
    assert walk.attention_mask is None
    given = tl_connwalk.connection_walk(cache, 1, attention_mask=torch.ones(2, N_POS))
    for exclude_sink in (False, True):
        a = walk.laplacian_residual(exclude_sink=exclude_sink, baseline_draws=2).to_dict()
        b = given.laplacian_residual(exclude_sink=exclude_sink, baseline_draws=2).to_dict()
        assert a == b
    assert math.isfinite(float(tl_connwalk.layer_drift(cache).sum()))
