"""Where the math has 0/0: every such case has a defined value, and no NaN reaches a summary.

The conventions tested here (each documented in the module named):

- **All-zero head** (``W_V^h = 0`` or ``W_O^h = 0``, so ``T^h = 0``): the zero map is the scaled
  isometry with scale 0, so its head defect ``delta(T^h)`` is 0, its per-head field defect is 0
  (every ratio ``rho^h`` is 0), and its random baseline stays 0 (``core/isometry.py``,
  ``core/field_defect.py``). A whole layer of zero transports has ``P = 0``: every defect,
  the scale and ``||P - P*|| / ||P||`` are 0.
- **A walk row with no mass** (a query whose keys are all masked: TransformerLens turns its
  softmax 0/0 into a zero row): gates there are uniform ``1/H`` (``core/walk.py``), the
  stochasticity residual of that row is 1 (honestly not stochastic), and the row has no edge, so
  it carries no weight in any walk-weighted summary.
- **A rank-deficient transport** is not a rank-``r`` partial isometry: it gets its honest positive
  defect over the top ``r`` singular values, zeros included (``core/isometry.py``).
- **A sequence of length 1**: the walk is ``[[1]]``; stochasticity, reversibility (``mu`` the
  stationary ``[1]``) and the field defect (one edge: no spread) are 0, the pairing is not
  applicable (``None`` / NaN in tables), layer drift is 0.
- **exclude_sink leaving a row empty** (row 0 of a causal walk has only key 0): the row drops
  out and the summary is the mean over the rows that keep mass; with no such row at all
  (length 1) it is 0 (``walk_weighted_mean``).

Every reference here is independent of the code under test: `tl_connwalk.core.reference`
builds the per-edge transports densely in float64 from the patterns and ``W_V^h W_O^h`` and
decomposes them by an SVD, and the field defect's weights are written out as a loop.
Tolerances: ``tests/tolerances.py``, from the dtype and the length of the sums; closed-form
defects against the SVD reference to ``cancelling_atol`` (the closed form takes
``sqrt(1 - x)`` with ``x ~ 1`` near 0, which keeps half of the working precision's digits).
"""

import math

import pandas as pd
import pytest
import torch
from einops import einsum

import tl_connwalk
from tests.architectures import build, hooked_only, tokens
from tests.tolerances import assert_close, atol, cancelling_atol, rtol
from tl_connwalk import ConnectionWalk
from tl_connwalk.core import markov
from tl_connwalk.core import reference as ref

#: Closed-form defects (float32 models; float64 cases held to the same) against the SVD.
DEFECT_ATOL = cancelling_atol(torch.float32)


def non_finite(record: object, path: str = "") -> list[str]:
    """The paths of every NaN or inf float in a nested ``to_dict()`` record."""
    if isinstance(record, dict):
        return [p for key, value in record.items() for p in non_finite(value, f"{path}.{key}")]
    if isinstance(record, list):
        return [p for i, value in enumerate(record) for p in non_finite(value, f"{path}[{i}]")]
    if isinstance(record, float) and not math.isfinite(record):
        return [path]
    return []


def assert_table_defined(table: pd.DataFrame, causal: bool = True) -> None:
    """NaN only where ``geometry_table`` documents it: pairing of causal walks, drift after the
    last layer, and on per-head rows the columns that belong to the whole layer."""
    layers = table[table["head"] == "all"].set_index("layer").select_dtypes("number")
    allowed = ["drift_to_next", *(["pairing"] if causal else [])]
    assert layers.drop(columns=allowed).notna().all().all(), layers
    assert layers["drift_to_next"].iloc[:-1].notna().all()
    heads = table[table["head"] != "all"]
    assert heads[["head_defect", "head_defect_baseline", "field_defect"]].notna().all().all()


def causal_pattern(batch: int, heads: int, n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = 2 * torch.randn(batch, heads, n, n, generator=generator)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, -torch.inf), -1)


def random_operands(heads: int = 3, d_model: int = 8, d_head: int = 2, n: int = 5, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    field = torch.randn(2, n, d_model, generator=generator)
    W_V = torch.randn(heads, d_model, d_head, generator=generator)
    W_O = torch.randn(heads, d_head, d_model, generator=generator)
    return causal_pattern(2, heads, n, seed), field, W_V, W_O


# ---------------------------------------------------------------- an all-zero head


@hooked_only
@pytest.mark.parametrize("weight", ["W_V", "W_O"])
def test_all_zero_head_has_defined_values(weight):
    model = build("gpt2_ln")
    with torch.no_grad():
        getattr(model.blocks[0].attn, weight)[1] = 0.0
    _, cache = model.run_with_cache(tokens())
    walk = tl_connwalk.connection_walk(cache, 0)
    assert_close(walk.apply() + walk.bias(), cache["blocks.0.hook_attn_out"])
    res = walk.laplacian_residual(baseline_draws=2, exact=True)
    assert non_finite(res.to_dict()) == []
    assert res.head_defects[1] == 0 and (res.head_defects[[0, 2, 3]] > 0).all()
    assert (res.head_field_defects[:, 1] == 0).all()
    assert (res.baseline["head_defects"].draws[:, 1] == 0).all()
    # the layer's defect still equals the SVD of every dense edge transport
    pattern = cache["blocks.0.attn.hook_pattern"]
    expected = ref.effective_defect(
        ref.walk(pattern), ref.gates(pattern), model.W_V[0], model.W_O[0]
    )
    torch.testing.assert_close(res.transport_defect.double(), expected, atol=DEFECT_ATOL, rtol=0)
    assert_table_defined(tl_connwalk.geometry_table(cache, baseline_draws=2, progress=False))


def test_layer_of_zero_transports_is_all_zeros():
    pattern, field, W_V, W_O = random_operands()
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, torch.zeros_like(W_O))
    for exclude_sink in (False, True):
        res = walk.laplacian_residual(baseline_draws=2, exact=True, exclude_sink=exclude_sink)
        assert non_finite(res.to_dict()) == []
        for value in (res.transport_defect, res.scale, res.field_defect, res.head_defects):
            assert (value == 0).all()
        assert (res.head_field_defects == 0).all()
        assert res.pairing is None  # causal
        assert res.nearest_operator is not None and (res.nearest_operator.distance == 0).all()
        for baseline in res.baseline.values():
            assert (baseline.draws == 0).all()
    assert (walk.isometry_defects("gram") == 0).all()
    assert (walk.isometry_defects("frobenius") == 0).all()
    assert (walk.apply() == 0).all()


# ---------------------------------------------------------------- rows without mass


@hooked_only
def test_fully_masked_query_rows_have_defined_values():
    """Left padding: the pad queries see only pad keys, so their pattern rows are all zero."""
    model = build("gpt2_ln")
    toks = tokens(batch=2, pos=7)
    mask = torch.ones_like(toks)
    mask[1, :3] = 0
    _, cache = model.run_with_cache(toks, attention_mask=mask)
    walk = tl_connwalk.connection_walk(cache, 0)
    assert (walk.walk[1, :3] == 0).all() and (walk.walk[1, 3:].sum(-1) > 0.99).all()
    assert torch.equal(walk.gates[1, :, :3], torch.full_like(walk.gates[1, :, :3], 0.25))
    assert_close(walk.apply() + walk.bias(), cache["blocks.0.hook_attn_out"])
    for exclude_sink in (False, True):
        res = walk.laplacian_residual(baseline_draws=2, exclude_sink=exclude_sink, exact=True)
        assert non_finite(res.to_dict()) == []
        # the padding's empty rows are no rows of the sequence: its real rows are stochastic
        assert walk.attention_mask is not None and not walk.attention_mask[1, :3].any()
        assert res.stochasticity[1] < rtol(torch.float32)
        assert res.mu_kind[1] == "uniform"  # causal: reducible
        table = tl_connwalk.geometry_table(
            cache, exclude_sink=exclude_sink, baseline_draws=2, progress=False
        )
        assert_table_defined(table)
        assert torch.isfinite(tl_connwalk.layer_drift(cache, exclude_sink=exclude_sink)).all()


def padded(pattern: torch.Tensor, field: torch.Tensor, n_pad: int):
    """The same sequence behind ``n_pad`` left pad positions that nothing attends to or from."""
    batch, heads, n, _ = pattern.shape
    big = torch.zeros(batch, heads, n + n_pad, n + n_pad, dtype=pattern.dtype)
    big[:, :, n_pad:, n_pad:] = pattern
    pad_field = torch.randn(
        batch, n_pad, field.shape[-1], generator=torch.Generator().manual_seed(9)
    )
    return big, torch.cat([pad_field, field], dim=1)


def test_rows_without_mass_do_not_dilute_walk_weighted_summaries():
    """Padding a sequence with positions that send and receive nothing leaves its summaries.

    A row without mass has no edge; counting it in the ``1/n`` of a walk-weighted mean would
    make a padded batch element read as more isometric than the same text unpadded.
    Reference: `tl_connwalk.core.reference.effective_defect` (an SVD per dense transport).
    """
    pattern, field, W_V, W_O = random_operands()
    big, big_field = padded(pattern, field, n_pad=2)
    plain = ConnectionWalk.from_pattern(pattern, field, W_V, W_O).laplacian_residual(
        baseline_draws=2, mu="uniform"
    )
    pad = ConnectionWalk.from_pattern(big, big_field, W_V, W_O).laplacian_residual(
        baseline_draws=2, mu="uniform"
    )
    expected = ref.effective_defect(ref.walk(big), ref.gates(big), W_V, W_O)
    torch.testing.assert_close(pad.transport_defect.double(), expected, atol=DEFECT_ATOL, rtol=0)
    for name in ("transport_defect", "scale", "field_defect", "head_field_defects"):
        assert_close(getattr(pad, name), getattr(plain, name))
    assert_close(pad.reversibility, plain.reversibility)
    assert_close(pad.baseline["transport_defect"].draws, plain.baseline["transport_defect"].draws)


def test_rows_without_mass_do_not_dilute_layer_drift():
    """Layer drift of a padded sequence is the drift of the sequence: mean TV over its rows."""
    before, after = causal_pattern(2, 3, 5, seed=1).mean(1), causal_pattern(2, 3, 5, seed=2).mean(1)
    pad_before, pad_after = torch.zeros(2, 7, 7), torch.zeros(2, 7, 7)
    pad_before[:, 2:, 2:], pad_after[:, 2:, 2:] = before, after
    expected = 0.5 * (before - after).abs().sum(-1).mean(-1)
    assert_close(markov.layer_drift(before, after), expected)
    assert_close(markov.layer_drift(pad_before, pad_after), expected)


def test_encoder_with_a_fully_padded_sequence():
    """A batch element whose every key is masked has an all-zero walk: every summary is 0."""
    pattern, field, W_V, W_O = random_operands()
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 5, 5, generator=generator)
    keys = torch.tensor([[True, True, True, False, False], [False] * 5])
    pattern = torch.softmax(scores.masked_fill(~keys[:, None, None, :], -torch.inf), -1)
    pattern = torch.where(torch.isnan(pattern), 0.0, pattern)  # what TransformerLens does
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O)
    assert (walk.walk[1] == 0).all() and (walk.walk[0, :, 3:] == 0).all()
    for exclude_sink in (False, True):
        res = walk.laplacian_residual(baseline_draws=2, exclude_sink=exclude_sink, exact=True)
        assert non_finite(res.to_dict()) == []
        assert res.stochasticity[1] == 1.0
        assert res.transport_defect[1] == 0 and res.scale[1] == 0 and res.field_defect[1] == 0
        assert res.pairing is not None and res.pairing_applicable.tolist() == [True, False]
        assert res.nearest_operator is not None
        assert res.nearest_operator.distance[1] == 0  # P = P* = 0
        W, g = ref.walk(pattern), ref.gates(pattern)
        expected = ref.effective_defect(W, g, W_V, W_O, exclude_sink=exclude_sink)
        torch.testing.assert_close(
            res.transport_defect.double(), expected, atol=DEFECT_ATOL, rtol=0
        )


# ---------------------------------------------------------------- rank-deficient transports


def test_rank_deficient_head_gets_its_honest_defect():
    """A head whose ``W_V`` has rank 1 (of ``d_head = 2``): ``delta = sqrt(1 - 1/2)``."""
    pattern, field, W_V, W_O = random_operands()
    W_V = W_V.clone()
    W_V[0, :, 1] = 3 * W_V[0, :, 0]
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O)
    res = walk.laplacian_residual(baseline_draws=2, exact=True)
    assert non_finite(res.to_dict()) == []
    sigma = torch.linalg.svdvals(W_V.double() @ W_O.double())[:, :2]
    assert sigma[0, 1] < rtol(torch.float32) * sigma[0, 0]  # rank 1 to float32 rounding of 3 x
    tol = atol(res.head_defects.dtype)
    expected = ref.head_defects(W_V, W_O)
    torch.testing.assert_close(res.head_defects.double(), expected, atol=tol, rtol=0)
    assert abs(res.head_defects[0].item() - math.sqrt(0.5)) < tol


def test_rank_deficient_effective_transport():
    """Every head the same map: ``T_ij = H T^1`` has rank ``d_head < r = min(d, H d_head)``."""
    pattern, field, W_V, W_O = random_operands(heads=3, d_model=8, d_head=2)
    W_V, W_O = W_V[:1].expand(3, -1, -1), W_O[:1].expand(3, -1, -1)
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O)
    for exclude_sink in (False, True):
        res = walk.laplacian_residual(baseline_draws=2, exact=True, exclude_sink=exclude_sink)
        assert non_finite(res.to_dict()) == []
        W, g = ref.walk(pattern), ref.gates(pattern)
        eps = ref.edge_defects(g, W_V, W_O, 6)
        assert (eps[W > 0] > 0.5).all()  # rank 2 of 6: far from a rank-6 isometry
        expected = ref.effective_defect(W, g, W_V, W_O, exclude_sink=exclude_sink)
        torch.testing.assert_close(
            res.transport_defect.double(), expected, atol=DEFECT_ATOL, rtol=0
        )
    frob = walk.isometry_defects("frobenius")
    assert torch.isfinite(frob).all()
    torch.testing.assert_close(
        frob.double(),
        torch.where(W > 0, ref.edge_defects(g, W_V, W_O, 6, "frobenius"), 0.0),
        atol=atol(frob.dtype),
        rtol=0,
    )


# ---------------------------------------------------------------- sequences of length 1


@hooked_only
def test_sequence_of_length_one():
    model = build("gpt2_ln")
    _, cache = model.run_with_cache(tokens(batch=2, pos=1))
    walk = tl_connwalk.connection_walk(cache, 1)
    assert torch.equal(walk.walk, torch.ones(2, 1, 1))
    assert_close(walk.apply() + walk.bias(), cache["blocks.1.hook_attn_out"])
    pattern = cache["blocks.1.attn.hook_pattern"]
    W, g = ref.walk(pattern), ref.gates(pattern)
    for exclude_sink in (False, True):
        res = walk.laplacian_residual(baseline_draws=2, exclude_sink=exclude_sink, exact=True)
        assert non_finite(res.to_dict()) == []
        assert (res.stochasticity <= atol(walk.walk.dtype, 1)).all()
        assert (res.reversibility == 0).all()
        assert res.mu_kind == ("stationary", "stationary") and (res.mu == 1).all()
        assert res.pairing is None and not res.pairing_applicable.any()
        assert (res.field_defect == 0).all()  # one edge: no spread
        assert (res.head_defects > 0).all()  # weights only: unaffected
        expected = ref.effective_defect(W, g, model.W_V[1], model.W_O[1], exclude_sink=exclude_sink)
        torch.testing.assert_close(
            res.transport_defect.double(), expected, atol=DEFECT_ATOL, rtol=0
        )
        if exclude_sink:  # no edge left: the documented 0
            assert (res.transport_defect == 0).all() and (res.scale == 0).all()
        table = tl_connwalk.geometry_table(
            cache, exclude_sink=exclude_sink, baseline_draws=2, progress=False
        )
        assert_table_defined(table)
        assert (tl_connwalk.layer_drift(cache, exclude_sink=exclude_sink) == 0).all()


# ---------------------------------------------------------------- exclude_sink emptying rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exclude_sink_drops_the_rows_it_empties(dtype):
    """Row 0 of a causal walk has only key 0: with ``exclude_sink`` it has no edge left."""
    pattern, field, W_V, W_O = (t.to(dtype) for t in random_operands(n=6))
    walk = ConnectionWalk.from_pattern(pattern, field, W_V, W_O)
    res = walk.laplacian_residual(baseline_draws=2, exclude_sink=True, exact=True)
    assert non_finite(res.to_dict()) == []
    W, g = ref.walk(pattern), ref.gates(pattern)
    expected = ref.effective_defect(W, g, W_V, W_O, exclude_sink=True)
    torch.testing.assert_close(res.transport_defect.double(), expected, atol=DEFECT_ATOL, rtol=0)
    expected_scale = ref.common_scale(W, g, W_V, W_O, exclude_sink=True)
    T = ref.effective_transports(g, W_V, W_O)
    assert_close(res.scale.double(), expected_scale, dtype, terms=T.shape[-1] ** 2)
    # field defect: the walk-weighted CV of rho_ij = |x_j T_ij| / |x_j| over the kept edges
    x = field.double()
    rho = einsum(x, T, "b k d, b q k d e -> b q k e").norm(dim=-1) / x.norm(dim=-1)[:, None]
    for b in range(2):
        weights = W[b].clone()
        weights[:, 0] = 0
        mass = weights.sum(-1, keepdim=True)
        p = torch.where(mass > 0, weights / torch.where(mass > 0, mass, 1.0), 0.0)
        p = p / p.sum()
        mean = (p * rho[b]).sum()
        cv = ((p * (rho[b] - mean) ** 2).sum()).sqrt() / mean
        assert abs(res.field_defect[b].item() - cv.item()) < atol(dtype)


# ---------------------------------------------------------------- the float32 range


@pytest.mark.parametrize("factor", [1e-6, 1e-3, 1e3, 1e5, 1e8])
def test_defects_are_scale_invariant_across_the_float32_range(factor):
    """Every defect is invariant under ``W_V, W_O, x -> c W_V, c W_O, c x`` (spec §3).

    In float32 the closed forms square the transport norms twice (``sum sigma^4``, the message
    Grams): ``||T||_F`` beyond ~1e9 overflows and below ~1e-9 underflows. The result must stay
    the float64 one, or at the very least never be a NaN turned into a silent 0.
    """
    pattern, field, W_V, W_O = random_operands()
    reference = ConnectionWalk.from_pattern(
        pattern.double(), field.double(), W_V.double(), W_O.double()
    ).laplacian_residual(baseline_draws=2)
    scaled = ConnectionWalk.from_pattern(
        pattern, factor * field, factor * W_V, factor * W_O
    ).laplacian_residual(baseline_draws=2)
    assert non_finite(scaled.to_dict()) == []
    for name in ("transport_defect", "field_defect", "head_defects", "pairing"):
        actual, expected = getattr(scaled, name), getattr(reference, name)
        if expected is None:
            assert actual is None
            continue
        torch.testing.assert_close(actual.double(), expected, atol=DEFECT_ATOL, rtol=0)
