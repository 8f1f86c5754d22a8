"""The library on a CUDA device: the walk is exact there and every measurement equals the CPU's.

Skipped where there is no CUDA device (CI has none); ``benchmarks/gpu.py`` runs this module
on a GPU machine before its timings. Tolerances (`tests.tolerances`): the walk identity as
everywhere, relative to the largest entry; CPU against CUDA, where both sides sum in other
orders (cuBLAS against the CPU's BLAS), float32's ``rtol`` relative plus its
``cancelling_atol`` absolute per value (defects lie in [0, 1] and near 0 are square roots of
cancelling differences). The baselines are not compared across devices: each device
draws from its own generator (`torch.Generator(device=...)`), so they are checked on CUDA
against the slow per-measurement reference instead (`tests.core.test_draws`).
"""

import dataclasses
import math

import pytest
import torch

import tl_connwalk
from tests.architectures import (
    ARCHITECTURES,
    HAS_HOOKED,
    bridge_tokens,
    build,
    hooked_only,
    tokens,
)
from tests.core.problems import Problem, random_problem
from tests.core.test_draws import ATOL, KEYED, field_reference, reference_baselines, residual_of
from tests.tolerances import assert_close, cancelling_atol, rtol
from tl_connwalk import LaplacianResidual
from tl_connwalk.core._fast import draws
from tl_connwalk.report.measure import output_hook
from tl_connwalk.toy import random_bridge

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: run on a GPU machine (benchmarks/gpu.py runs this first)",
)

CUDA = torch.device("cuda")
FIELDS = dataclasses.fields(Problem)
CASES = [("hooked", name) for name in ARCHITECTURES if HAS_HOOKED] + [
    ("bridge", arch) for arch in ("gpt2", "llama", "gemma3", "bert")
]


def _numbers(value: object, path: str = "") -> dict[str, float]:
    """Every float in a ``to_dict()`` tree, keyed by its path."""
    if isinstance(value, dict):
        items = [(f"{path}.{key}", sub) for key, sub in value.items()]
    elif isinstance(value, list):
        items = [(f"{path}[{i}]", sub) for i, sub in enumerate(value)]
    else:
        return {path: value} if isinstance(value, float) else {}
    return {k: v for where, sub in items for k, v in _numbers(sub, where).items()}


def _differences(expected: LaplacianResidual, got: LaplacianResidual) -> list[str]:
    """The values of two residuals that differ, the baselines left out (each device draws
    from its own generator); both must hold the same (and more than a few) values."""
    want, have = expected.to_dict(), got.to_dict()
    del want["baseline"], have["baseline"]
    assert want["processing"] == have["processing"]
    want, have = _numbers(want), _numbers(have)
    assert want.keys() == have.keys() and len(want) >= 10
    return [
        f"{key}: expected {want[key]!r}, got {have[key]!r}"
        for key in want
        if not math.isclose(
            want[key],
            have[key],
            rel_tol=rtol(torch.float32),
            abs_tol=cancelling_atol(torch.float32),
        )
    ]


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_walks_and_measurements_on_cuda_equal_the_cpu(kind, name):
    if kind == "hooked":
        model, on_cpu_model = build(name).to(CUDA), build(name)
        toks = tokens()
    else:  # random_bridge puts a model on the CPU unless asked (TransformerLens picks a GPU)
        model, on_cpu_model = random_bridge(name, device=CUDA), random_bridge(name)  # type: ignore[arg-type]
        toks = bridge_tokens()
    assert next(on_cpu_model.parameters()).device.type == "cpu"
    with torch.no_grad():
        _, on_cpu = on_cpu_model.run_with_cache(toks)
        _, on_cuda = model.run_with_cache(toks.to(CUDA))
    for layer in range(model.cfg.n_layers):
        walk = tl_connwalk.connection_walk(on_cuda, layer)
        for tensor in (walk.walk, walk.gates, walk.field, walk.W_V, walk.W_O):
            assert tensor.device.type == CUDA.type
        hook = output_hook(model, layer)
        if hook is not None:  # exact on the device: the walk gives TransformerLens's output
            assert_close(walk.apply() + walk.bias(), on_cuda[hook])
        res_cpu = tl_connwalk.laplacian_residual(on_cpu, layer, baseline_draws=2)
        res_cuda = tl_connwalk.laplacian_residual(on_cuda, layer, baseline_draws=2)
        assert not _differences(res_cpu, res_cuda), (name, layer)
    drift_cpu = tl_connwalk.layer_drift(on_cpu)
    assert_close(tl_connwalk.layer_drift(on_cuda).cpu(), drift_cpu)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("exclude_sink", [False, True])
def test_baselines_on_cuda_equal_fresh_draws_per_measurement(dtype, exclude_sink):
    draws.raw_draws.cache_clear()
    p = random_problem(heads=3, pos=6, d_model=10, d_head=3, seed=4, causal=True, dtype=dtype)
    p = dataclasses.replace(p, **{f.name: getattr(p, f.name).to(CUDA) for f in FIELDS})
    res = residual_of(p, baseline_draws=3, seed=11, exclude_sink=exclude_sink)
    for name, base in reference_baselines(p, 3, 11, exclude_sink).items():
        assert res.baseline[name].draws.device.type == CUDA.type
        torch.testing.assert_close(
            res.baseline[name].draws, base.draws, atol=ATOL[dtype], rtol=0, msg=name
        )


@pytest.mark.parametrize("exclude_sink", [False, True])
def test_field_draws_through_the_keys_factor_on_cuda_equal_explicit_value_factors(exclude_sink):
    """The keys' route on CUDA (`draws.key_factor`, `draws.key_draws`, CUDA generators):
    the field baseline equals the slow measurement of the Gaussian value factors it stands
    for, built on CUDA (`tests.core.test_draws.field_reference`); float64, ``ATOL``."""
    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    p = random_problem(seed=4, **KEYED)
    p = dataclasses.replace(p, **{f.name: getattr(p, f.name).to(CUDA) for f in FIELDS})
    assert draws.key_factor(p.field, 3, 12) is not None
    res = residual_of(p, baseline_draws=3, seed=11, exclude_sink=exclude_sink)
    expected = field_reference(p, 3, 11, exclude_sink)
    assert res.baseline["field_defect"].draws.device.type == CUDA.type
    torch.testing.assert_close(
        res.baseline["field_defect"].draws, expected, atol=ATOL[torch.float64], rtol=0
    )


def test_wide_edge_blocks_on_cuda_equal_the_cpu():
    """A GPT-2-small-shaped layer at 512 tokens: on CUDA the per-edge work runs in blocks of
    hundreds of thousands of edges (`tl_connwalk.core._fast.chunks.edge_block`), on the CPU
    in blocks of 4096."""
    from benchmarks.bench import layer_operands

    operands = layer_operands(512, "gpt2")
    on_cpu = tl_connwalk.ConnectionWalk.from_pattern(*operands).laplacian_residual()
    walk = tl_connwalk.ConnectionWalk.from_pattern(*(t.to(CUDA) for t in operands))
    assert not _differences(on_cpu, walk.laplacian_residual())


@hooked_only
def test_a_model_split_over_cuda_and_the_cpu_measures_each_layer_on_its_device():
    """Block 1 and its cache entries on CUDA, block 0 on the CPU, as in a model split over two
    devices: each layer's walk and measurements run on that layer's device and equal the
    all-CPU numbers; the drift between the two layers and the table cross the devices.
    (`tests/test_devices.py` proves the walks' placement with ``meta``, which cannot answer
    the measurements' data-dependent decisions.)"""
    model = build("llama_gqa_rotary")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens())
    expected = [tl_connwalk.laplacian_residual(cache, layer) for layer in (0, 1)]
    drift, table = tl_connwalk.layer_drift(cache), tl_connwalk.geometry_table(cache)
    model.blocks[1].to(CUDA)
    for name in tl_connwalk.required_hooks(model, 1):
        cache.cache_dict[name] = cache.cache_dict[name].to(CUDA)
    for layer, device in ((0, "cpu"), (1, "cuda")):
        walk = tl_connwalk.connection_walk(cache, layer)
        assert walk.walk.device.type == walk.W_V.device.type == device
        res = tl_connwalk.laplacian_residual(cache, layer)
        assert res.transport_defect.device.type == device
        assert not _differences(expected[layer], res), layer
    assert_close(tl_connwalk.layer_drift(cache).cpu(), drift)
    split = tl_connwalk.geometry_table(cache)
    assert split.shape == table.shape and list(split.columns) == list(table.columns)
