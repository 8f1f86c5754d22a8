"""layer_drift and geometry_table over a whole cache."""

import itertools
import math

import pandas as pd
import pytest
import torch

import tl_connwalk
from tests.architectures import tokens
from tests.tolerances import cancelling_atol, rtol
from tl_connwalk import analysis
from tl_connwalk.toy import random_bridge


def test_layer_drift_is_total_variation_between_layers():
    model = random_bridge("llama", n_layers=3)
    _, cache = model.run_with_cache(tokens())
    drift = tl_connwalk.layer_drift(cache)
    walks = [cache[f"blocks.{layer}.attn.hook_pattern"].mean(1) for layer in range(3)]
    expected = torch.stack(
        [0.5 * (a - b).abs().sum(-1).mean(-1) for a, b in itertools.pairwise(walks)], -1
    )
    torch.testing.assert_close(drift, expected)
    sinkless = tl_connwalk.layer_drift(cache, exclude_sink=True)
    assert sinkless.shape == (2, 2) and not torch.equal(sinkless, drift)


def test_layer_drift_of_one_layer_is_empty():
    model = random_bridge("gpt2", n_layers=1)
    _, cache = model.run_with_cache(tokens())
    assert tl_connwalk.layer_drift(cache).shape == (tokens().shape[0], 0)


def test_geometry_table_is_tidy():
    model = random_bridge("gpt2", n_layers=2)
    _, cache = model.run_with_cache(tokens())
    table = tl_connwalk.geometry_table(cache, baseline_draws=2, progress=False)
    assert len(table) == 2 * (1 + 4)
    assert list(table[table["head"] == "all"]["layer"]) == [0, 1]
    for column in (
        "transport_defect",
        "transport_defect_baseline",
        "head_defect_baseline_std",
        "drift_to_next",
    ):
        assert column in table.columns
    layer_1 = tl_connwalk.laplacian_residual(cache, 1, baseline_draws=2)
    row = table[(table["layer"] == 1) & (table["head"] == "all")].iloc[0]
    assert row["transport_defect"] == layer_1.transport_defect.mean().item()
    assert row["pairing"] != row["pairing"]  # NaN: causal walks have no pairing
    # layer -1 is the last; measured alone, its numbers equal those measured with layer 0 up to
    # rounding (the table stacks the layers' work), and defects near 0 keep half the digits
    last = tl_connwalk.geometry_table(cache, [-1], baseline_draws=2, progress=False)
    pd.testing.assert_frame_equal(
        last,
        table[table["layer"] == 1].reset_index(drop=True),
        rtol=rtol(torch.float32),
        atol=cancelling_atol(torch.float32),
    )


@pytest.mark.parametrize("scoped", [False, True])
def test_geometry_table_drift_is_layer_drift_of_each_pair(scoped):
    """The table measures the drift of every layer of a group at once; each layer's is
    `layer_drift`'s column on a left-padded batch, with and without sink and edge scoping,
    and for a chosen set of layers that are not consecutive."""
    model = random_bridge("llama", n_layers=5)
    toks = tokens()
    mask = torch.ones_like(toks)
    mask[1, :2] = 0
    _, cache = model.run_with_cache(toks, attention_mask=mask)
    options = {"exclude_sink": True, "edges": lambda q, k: k < q} if scoped else {}
    drift = tl_connwalk.layer_drift(cache, attention_mask=mask, **options)
    for layers in (None, [3, 0, 1, 4]):
        table = tl_connwalk.geometry_table(
            cache, layers, baseline_draws=2, progress=False, attention_mask=mask, **options
        )
        rows = table[table["head"] == "all"].set_index("layer")["drift_to_next"]
        for layer, value in rows.items():
            if layer == 4:
                assert math.isnan(value)
            else:
                assert value == pytest.approx(drift[:, layer].mean().item(), rel=1e-6)


def test_cache_methods_after_attach():
    model = random_bridge("gpt2")
    tl_connwalk.attach(model)
    try:
        _, cache = model.run_with_cache(tokens())
        assert cache.laplacian_residual(0, baseline_draws=2).layer == 0
        assert cache.layer_drift().shape == (2, 1)
        assert len(cache.geometry_table(layers=[1], baseline_draws=2, progress=False)) == 5
    finally:
        tl_connwalk.detach(model)


def test_drift_pairs_whose_layers_disagree_on_padding_are_named():
    walk = torch.softmax(torch.randn(1, 4, 4), -1)
    real = torch.tensor([[False, True, True, True]])
    pairs = [((walk, None, 0), (walk, None, 1)), ((walk, None, 1), (walk, real, 2))]
    with pytest.raises(tl_connwalk.ConnWalkError, match="layers 1 and 2 disagree"):
        analysis._drifts(pairs, False, None)
    same = analysis._drifts(pairs[:1] * 2, False, None)
    assert [d.tolist() for d in same] == [[0.0], [0.0]]
