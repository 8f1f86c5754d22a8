"""Knockout runs after a prefix of clean keys and values (`kv_prefix`): what is recorded is what
TransformerLens's own key-value cache holds, recording changes nothing, and the runs give
knockout's values."""

from typing import Any

import pytest
import torch
import transformer_lens

import tl_connwalk
from tests.architectures import (
    ARCHITECTURES,
    bridge_only,
    build,
    cached_bridge,
    hooked_encoder,
    hooked_only,
)
from tests.attribution.test_connection import FROZEN_TERMS, assert_exact
from tests.tolerances import rtol
from tl_connwalk.attribution import kv_prefix

#: query/key norms and alternating local attention (a window of 3), as in Gemma 2 and 3: the
#: cache holds keys after the norm, and a run after a prefix must keep the window
NORMED_LOCAL = dict(
    act_fn="gelu",
    normalization_type="RMS",
    positional_embedding_type="rotary",
    rotary_dim=4,
    use_qk_norm=True,
    use_local_attn=True,
    attn_types=["global", "local"],
    window_size=3,
)


def model_named(name: str) -> Any:
    if name == "normed_local":
        return build("gpt2_ln", dtype=torch.float64, **NORMED_LOCAL)
    return build(name, dtype=torch.float64)


CASES = [*ARCHITECTURES, "normed_local"]


def transformer_lens_cache(model: Any, batch: int) -> Any:
    """TransformerLens's own key-value cache (its class in 3.x, or in 2.x)."""
    names = ("TransformerLensKeyValueCache", "HookedTransformerKeyValueCache")
    cache = next(getattr(transformer_lens, n) for n in names if hasattr(transformer_lens, n))
    return cache.init_cache(model.cfg, model.cfg.device, batch)


@hooked_only
@pytest.mark.parametrize("name", CASES)
def test_recorded_keys_and_values_are_what_transformer_lens_caches(name):
    model = model_named(name)
    toks = torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    ones = torch.ones_like(toks)
    reference = transformer_lens_cache(model, 2)
    with torch.no_grad():
        model(toks, past_kv_cache=reference, attention_mask=ones)
        recorded = kv_prefix.recorder(model, 2, toks.device)
        logits = model(toks, past_kv_cache=recorded, attention_mask=ones)
        plain = model(toks)
    for layer in range(model.cfg.n_layers):
        keys, values = recorded[layer].recorded  # type: ignore[misc]
        assert torch.equal(keys, reference[layer].past_keys), "the same run, the same keys"
        assert torch.equal(values, reference[layer].past_values)
    # recording changes nothing: the run without a cache, to the rounding of its sums
    atol = rtol(torch.float64, FROZEN_TERMS) * plain.abs().max().item()
    torch.testing.assert_close(logits, plain, rtol=0, atol=atol)


@hooked_only
@pytest.mark.parametrize("name", CASES)
def test_a_run_after_a_prefix_is_the_run_of_the_whole_sequence(name):
    """The last positions run after the first ``j + 1`` positions' keys and values give the
    logits of the whole sequence's run there (the same sums, split at the prefix)."""
    model = model_named(name)
    toks = torch.randint(0, model.cfg.d_vocab, (3, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        recorded = kv_prefix.recorder(model, 3, toks.device)
        whole = model(toks, past_kv_cache=recorded, attention_mask=torch.ones_like(toks))
        for length in (1, 4, 8):
            rows = torch.tensor([2, 0])
            suffix = toks[rows, length:]
            after = model(
                suffix,
                past_kv_cache=kv_prefix.prefix(recorded, rows, length),
                attention_mask=torch.ones_like(suffix),
            )
            atol = rtol(torch.float64, FROZEN_TERMS) * whole.abs().max().item()
            torch.testing.assert_close(after, whole[rows, length:], rtol=0, atol=atol)


@hooked_only
@pytest.mark.parametrize("name", CASES)
def test_many_targets_on_repeated_sequences_are_knocked_out_exactly(name):
    """A batch of one sequence repeated with targets at several positions, beside another:
    every source of every target knocked out after its prefix is knockout's own value."""
    model = model_named(name)
    toks = torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    toks = toks[[0, 0, 1, 0]]
    position = torch.tensor([3, 8, 8, 5])
    result = tl_connwalk.attribute(
        model, toks, method="knockout_estimate", position=position, exact=9
    )
    knocked = tl_connwalk.attribute(model, toks, method="knockout", position=position).scores
    assert result.exact.sum(-1).tolist() == position.tolist()
    assert_exact(result.scores, knocked, result)
    # the recording run's edges are those of a run without it
    first_order = tl_connwalk.attribute(
        model, toks, method="knockout_estimate", position=position, exact=0
    )
    for layer in range(model.cfg.n_layers):
        assert_exact(result.edges(layer), first_order.edges(layer), result)


@hooked_only
def test_a_causal_hooked_transformer_runs_after_a_prefix_and_an_encoder_does_not():
    assert kv_prefix.supports(build("gpt2_ln"))
    assert not kv_prefix.supports(hooked_encoder()), "an encoder's positions all change"


@bridge_only
def test_a_bridge_runs_every_position():
    assert not kv_prefix.supports(cached_bridge("llama", False))
