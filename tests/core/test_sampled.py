"""The random baselines on a sample of edges (`tl_connwalk.core._fast.sampled`) against the
same baselines on every edge, on every architecture.

Both estimate one number, the expected defect of a random transport; the full computation
is held to its definition in `tl_connwalk.core.reference` by the fast-vs-reference table. The
sampled estimate must lie within ``Z`` combined standard errors (each estimate's own, as
`RandomBaseline.se` reports it) of the full one. The draws are seeded, so the test is
deterministic; ``Z = 4`` would fail by chance with probability about 6e-5 per comparison if
the reported errors were right and the estimates normal.
"""

import pytest
import torch

import tl_connwalk
from tests.architectures import BASE, build, hooked_only
from tests.tolerances import assert_close, rtol
from tl_connwalk.core._fast import sampled
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.toy import random_bridge

#: Combined standard errors within which the two estimates of one expectation must agree.
Z = 4
#: Positions of the prompts: enough edges that a sample of `EDGES` is taken.
POS = 48
#: Draws per baseline: enough for the spread over draws to estimate the standard error.
DRAWS = 24
#: Edges per draw: at most d_model distinct keys (the keys' route), and more than d_model
#: (every draw's values through its R_V).
EDGES = (16, 32)


def _check_agree(walk: tl_connwalk.ConnectionWalk, edges: int, exclude_sink: bool) -> None:
    assert sampled.samples(POS, POS, edges), "the prompt must be long enough to be sampled"
    options = {"baseline_draws": DRAWS, "seed": 3, "exclude_sink": exclude_sink}
    fast = walk.laplacian_residual(baseline_edges=edges, **options)
    full = walk.laplacian_residual(baseline_edges=None, **options)
    for name in ("transport_defect", "field_defect"):
        est, ref = fast.baseline[name], full.baseline[name]
        assert est.sampled_edges == edges and ref.sampled_edges is None
        assert bool((est.se > 0).all())
        bound = Z * (est.se.double() ** 2 + ref.se.double() ** 2).sqrt()
        gap = (est.mean.double() - ref.mean.double()).abs()
        assert bool((gap <= bound).all()), f"{name}: off by {gap.tolist()} > {bound.tolist()}"
    # the weight-only baseline takes no sample: the same draws, the same numbers
    torch.testing.assert_close(
        fast.baseline["head_defects"].draws, full.baseline["head_defects"].draws, rtol=0, atol=0
    )
    # the layer's own defects do not depend on how its baselines are taken (but for the
    # order of the sums: the layer alone is chunked otherwise than beside its draws)
    assert_close(fast.transport_defect, full.transport_defect, torch.float32)
    assert_close(fast.field_defect, full.field_defect, torch.float32)


@pytest.mark.parametrize("edges", EDGES)
@pytest.mark.parametrize("exclude_sink", [False, True])
def test_the_sampled_baselines_agree_with_every_edge_within_their_error(
    arch: str, edges: int, exclude_sink: bool
) -> None:
    model = tl_connwalk.attach(build(arch, n_ctx=POS))
    tokens = torch.randint(0, BASE["d_vocab"], (2, POS), generator=torch.Generator().manual_seed(2))
    _, cache = model.run_with_cache(tokens)
    _check_agree(cache.connection_walk(-1), edges, exclude_sink)


@pytest.mark.parametrize("toy", ["gpt2", "llama", "gemma3", "bert"])
@pytest.mark.parametrize("edges", EDGES)
def test_the_sampled_baselines_agree_on_the_bridges(toy: str, edges: int) -> None:
    model = tl_connwalk.attach(random_bridge(toy, d_model=24, n_ctx=POS))  # type: ignore[arg-type]
    tokens = torch.randint(0, 63, (2, POS), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    _check_agree(cache.connection_walk(0), edges, exclude_sink=False)


@hooked_only
def test_short_walks_take_every_edge_and_bad_sizes_are_errors() -> None:
    model = tl_connwalk.attach(build("gpt2_ln"))
    _, cache = model.run_with_cache(torch.randint(0, BASE["d_vocab"], (1, 9)))
    res = cache.laplacian_residual(0, baseline_draws=3)  # 81 pairs: no sample pays
    assert res.baseline["transport_defect"].sampled_edges is None
    assert res.to_dict()["baseline"]["field_defect"]["sampled_edges"] is None
    for bad in (1, 0, -5, True):
        with pytest.raises(ConnWalkError, match="baseline_edges"):
            cache.laplacian_residual(0, baseline_edges=bad)


@hooked_only
def test_the_table_reports_each_baselines_standard_error() -> None:
    model = tl_connwalk.attach(build("gpt2_ln", n_ctx=POS))
    tokens = torch.randint(0, BASE["d_vocab"], (2, POS), generator=torch.Generator().manual_seed(2))
    _, cache = model.run_with_cache(tokens)
    table = tl_connwalk.geometry_table(cache, progress=False, baseline_edges=16, baseline_draws=4)
    for name in ("transport_defect", "field_defect", "head_defect"):
        assert (table[f"{name}_baseline_se"].dropna() > 0).all()
    res = cache.laplacian_residual(1, baseline_edges=16, baseline_draws=4)
    walk_row = table[(table["layer"] == 1) & (table["head"] == "all")].iloc[0]
    base = res.baseline["transport_defect"]
    # a batch mean, as every column: of each sequence's standard error
    expected = base.se.double().mean().item()
    assert walk_row["transport_defect_baseline_se"] == pytest.approx(
        expected, rel=rtol(torch.float32, base.draws.numel())
    )
