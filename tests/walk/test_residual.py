"""laplacian_residual and per-edge defects on real caches, against SVDs of materialised maps."""

import inspect
import json

import pytest
import torch

import tl_connwalk
from tests.architectures import tokens
from tests.tolerances import assert_close, cancelling_atol
from tl_connwalk.core import reference as ref
from tl_connwalk.core._fast import head_grams as fast_head_grams
from tl_connwalk.toy import random_bridge
from tl_connwalk.walk import _layer_terms as layer_terms


@pytest.fixture(scope="module", params=["gpt2", "llama", "bert"])
def walk(request):
    model = random_bridge(request.param, d_model=16, n_heads=4)
    _, cache = model.run_with_cache(tokens(batch=2, pos=5))
    return tl_connwalk.connection_walk(cache, 1)


def transport_rank(walk):
    """``min(d_model, H_kv d_head)``, ``H_kv`` counted as the distinct value heads in ``W_V``
    (grouped-query heads share theirs: the llama toy's 4 query heads read 2)."""
    n_value_heads = torch.unique(walk.W_V.flatten(1), dim=0).shape[0]
    return min(walk.W_V.shape[1], n_value_heads * walk.W_V.shape[2])


def svd_defects(walk):
    """delta and eps of every edge of the walk from `tl_connwalk.core.reference` (an SVD of
    each dense T_ij, float64), with the rank counted from the weights."""
    rank = transport_rank(walk)
    on_walk = walk.walk.double() > 0
    return tuple(
        torch.where(on_walk, ref.edge_defects(walk.gates, walk.W_V, walk.W_O, rank, kind), 0.0)
        for kind in ("frobenius", "gram")
    )


def test_per_edge_defects_match_svd(walk):
    delta, eps = svd_defects(walk)
    tol = cancelling_atol(walk.walk.dtype)  # sqrt(1 - x) forms on both sides
    torch.testing.assert_close(walk.isometry_defects("gram").double(), eps, atol=tol, rtol=0)
    torch.testing.assert_close(walk.isometry_defects("frobenius").double(), delta, atol=tol, rtol=0)


def test_residual_matches_independent_references(walk):
    res = walk.laplacian_residual(baseline_draws=3)
    _, eps = svd_defects(walk)
    n = walk.walk.shape[-1]
    expected = (walk.walk.double() * eps).sum((-1, -2)) / n
    tol = cancelling_atol(walk.walk.dtype)  # sqrt(1 - x) forms on both sides
    torch.testing.assert_close(res.transport_defect.double(), expected, atol=tol, rtol=0)
    # head defects from TransformerLens's own FactoredMatrix SVD of the OV circuits
    sigma = walk.head_transports.S.double()[:, : walk.W_V.shape[2]]
    delta = (1 - sigma.sum(-1) ** 2 / (sigma.shape[-1] * (sigma**2).sum(-1))).sqrt()
    torch.testing.assert_close(res.head_defects.double(), delta, atol=tol, rtol=0)
    torch.testing.assert_close(res.stochasticity, (walk.walk.sum(-1) - 1).abs().amax(-1))
    # the common scale: walk-weighted ||T_ij||_F / sqrt(r)
    rank = transport_rank(walk)
    norms = torch.linalg.matrix_norm(ref.effective_transports(walk.gates, walk.W_V, walk.W_O))
    expected_scale = ref.walk_weighted_mean(walk.walk, norms / rank**0.5)
    # ||T_ij||_F^2 sums
    assert_close(res.scale, expected_scale, walk.walk.dtype, terms=walk.W_V.shape[1] ** 2)
    assert all(b.n_draws == 3 for b in res.baseline.values())
    json.dumps(res.to_dict())
    assert "transport_defect" in repr(res) and "random" in repr(res)


def test_pairing_applies_to_encoders_only(walk):
    res = walk.laplacian_residual(baseline_draws=2)
    bidirectional = bool((walk.walk > 0).all())
    assert (res.pairing is not None) == bidirectional
    assert res.mu_kind == (("stationary",) * 2 if bidirectional else ("uniform",) * 2)


def test_symmetric_walk_with_paired_orthogonal_transports_is_a_connection_laplacian():
    """Symmetric doubly stochastic walk, one head with T = s Q (Q symmetric orthogonal): every
    condition holds, so every residual is 0 (spec §2)."""
    n, d = 5, 6
    scores = torch.randn(n, n, dtype=torch.float64)
    S = torch.exp(scores + scores.T)
    for _ in range(200):  # Sinkhorn: symmetric and doubly stochastic
        S = S / S.sum(-1, keepdim=True)
        S = (S + S.T) / 2
    v = torch.nn.functional.normalize(torch.randn(d, dtype=torch.float64), dim=0)
    Q = torch.eye(d, dtype=torch.float64) - 2 * torch.outer(v, v)  # a reflection
    walk = tl_connwalk.ConnectionWalk.from_pattern(
        S[None, None], torch.randn(1, n, d, dtype=torch.float64), 2 * Q[None], Q[None]
    )
    res = walk.laplacian_residual(baseline_draws=2, exact=True)
    assert res.nearest_operator is not None and res.nearest_operator.exact
    for value in (
        res.nearest_operator.distance,
        res.stochasticity,
        res.reversibility,
        res.transport_defect,
        res.pairing,
        res.field_defect,
    ):
        assert value is not None
        # defects and distances near 0 are square roots of cancelling differences
        zero = torch.zeros(1, dtype=torch.float64)
        torch.testing.assert_close(value, zero, atol=cancelling_atol(torch.float64, n * d), rtol=0)
    torch.testing.assert_close(res.scale, torch.full((1,), 2.0, dtype=torch.float64))


def test_defect_kind_is_checked(walk):
    with pytest.raises(tl_connwalk.ConnWalkError, match='kind must be "gram" or "frobenius"'):
        inspect.unwrap(tl_connwalk.walk.residual.isometry_defects)(walk, "nuclear")
    with pytest.raises(tl_connwalk.ConnWalkError, match="baseline_draws must be an integer >= 2"):
        walk.laplacian_residual(baseline_draws=1)


def test_exact_nearest_operator_is_reported_and_sampled_when_large(walk):
    exact = walk.laplacian_residual(baseline_draws=2, exact=True)
    nearest = exact.nearest_operator
    assert nearest is not None and nearest.exact
    assert ((nearest.distance > 0) & (nearest.distance < 10)).all()
    sampled = walk.laplacian_residual(baseline_draws=2, exact=True, max_edges=8, seed=1)
    assert sampled.nearest_operator is not None and not sampled.nearest_operator.exact
    assert sampled.nearest_operator.n_sampled == (8, 8)
    assert "sampled edges" in repr(sampled)
    json.dumps(sampled.to_dict())
    assert walk.laplacian_residual(baseline_draws=2).nearest_operator is None


def _tensors(value, prefix=""):
    """Every tensor of a `LaplacianResidual` (baselines included), by name."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {
            key: tensor
            for name, item in value.items()
            for key, tensor in _tensors(item, f"{prefix}.{name}").items()
        }
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is None:
        return {}
    return {
        key: tensor
        for name in fields
        for key, tensor in _tensors(getattr(value, name), f"{prefix}.{name}").items()
    }


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize(
    "options",
    [{}, {"exclude_sink": True}, {"mass_share": 0.9}, {"heads": [0, 2]},
     {"edges": lambda q, k: k <= q - 1}, {"mu": "teleport", "query_chunk": 2}, {"pos": 20},
     {"wide": True}],
    ids=["plain", "sink", "mass", "heads", "edges", "teleport", "more_keys_than_d_model",
         "wide_heads"],
)  # fmt: skip
def test_stacked_layers_measure_as_each_layer_alone(arch, options, monkeypatch, request):
    """`ConnectionWalk.laplacian_residuals` (every layer's per-edge work, message Grams and
    Markov conditions stacked) gives each layer's `laplacian_residual` of the walk alone;
    with more keys than ``d_model`` the field draws take each draw's ``R_V``, not the keys'
    route; with heads too wide to keep their output-Gram rows each layer's field takes its
    messages, its draws stacked with the other layers'."""
    options = dict(options)
    stacked_draws = None  # with wide heads: the layers whose draws' message Grams are made together
    if options.pop("wide", False):
        monkeypatch.setattr(fast_head_grams, "OUT_GRAM_WIDTH", 8)  # H d_head = 16 is wider
        tl_connwalk.clear_caches()  # no head Grams with output-Gram rows, before or after
        request.addfinalizer(tl_connwalk.clear_caches)
        stacked_draws = []
        made = layer_terms.stacked_draw_message_grams
        monkeypatch.setattr(
            layer_terms,
            "stacked_draw_message_grams",
            lambda draws, fields: stacked_draws.append(len(draws)) or made(draws, fields),
        )
    model = random_bridge(arch, n_layers=3, d_model=16, n_heads=4, n_ctx=32)
    _, cache = model.run_with_cache(tokens(batch=2, pos=options.pop("pos", 6)))
    walks = [tl_connwalk.connection_walk(cache, layer) for layer in range(3)]
    stacked = tl_connwalk.ConnectionWalk.laplacian_residuals(walks, baseline_draws=3, **options)
    if stacked_draws is not None:
        assert stacked_draws == [3] and walks[0].n_heads * walks[0].W_V.shape[-1] > 8
    for layer, res in enumerate(stacked):
        alone = tl_connwalk.connection_walk(cache, layer).laplacian_residual(
            baseline_draws=3, **options
        )
        assert res.layer == layer and res.mu_kind == alone.mu_kind
        got, want = _tensors(res), _tensors(alone)
        assert got.keys() == want.keys()
        for name, value in want.items():
            if value.is_floating_point():
                assert_close(got[name], value, terms=walks[0].walk.shape[-1] ** 2)
            else:
                assert torch.equal(got[name], value), name


def test_stacked_walks_of_different_head_counts_take_heads_valid_for_each():
    """``heads=`` for walks of 4 and 6 heads (two models): each result is that walk's alone."""
    walks = []
    for n_heads in (4, 6):
        model = random_bridge("gpt2", n_layers=1, d_model=24, n_heads=n_heads, n_ctx=16)
        _, cache = model.run_with_cache(tokens(batch=1, pos=5))
        walks.append(tl_connwalk.connection_walk(cache, 0))
    stacked = tl_connwalk.ConnectionWalk.laplacian_residuals(walks, baseline_draws=2, heads=[0, 3])
    for walk, res in zip(walks, stacked, strict=True):
        alone = walk.laplacian_residual(baseline_draws=2, heads=[0, 3])
        assert res.heads == alone.heads == (0, 3)
        assert_close(res.transport_defect, alone.transport_defect, terms=25)
    with pytest.raises(tl_connwalk.ConnWalkError, match="4 heads"):
        tl_connwalk.ConnectionWalk.laplacian_residuals(walks, baseline_draws=2, heads=[0, 5])
