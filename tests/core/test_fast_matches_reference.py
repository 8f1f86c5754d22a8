"""Every public fast measurement held to its definition in `tl_connwalk.core.reference`.

One table (`MEASUREMENTS`): each row names a measurement, computes it with the package's
public functions and with the reference (dense, float64, an SVD per edge), and says which
tolerance applies (`tests.tolerances`): ``"sum"`` for values that are sums of products
(``rtol`` of the dtype), ``"cancel"`` for values that are square roots of a cancelling
difference, as the closed-form defects near 0 are (``cancelling_atol``, half the digits).
Every row runs on every problem of `PROBLEMS`: random, causal, grouped-query, a sink token
with a silent key, and the hand-built exact cases (scaled orthogonal transports, a symmetric
walk), in float64 and float32. The key route of the field baseline draws other Gaussian
realisations than the reference, so it is held to the reference in distribution over seeds
(`test_the_key_route_field_baseline_has_the_reference_distribution`); the adapters are held
to the reference computed from the cache's tensors (`test_adapter_numbers_match_the_reference`).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import tl_connwalk
from tests.architectures import build, hooked_only, tokens
from tests.core.problems import Problem, random_problem, symmetric_problem
from tests.tolerances import assert_close, atol, cancelling_atol
from tl_connwalk.core import field_defect, generator, isometry, laplacian, markov
from tl_connwalk.core import reference as ref
from tl_connwalk.core import walk as core_walk
from tl_connwalk.core._fast import draws
from tl_connwalk.core._fast import messages as fast_messages
from tl_connwalk.core.value_heads import grouped_value_heads
from tl_connwalk.walk import ConnectionWalk

F64, F32 = torch.float64, torch.float32
#: Draws of the random baselines compared seed for seed.
DRAWS = 3
SEED = 7


@dataclasses.dataclass(frozen=True)
class Case:
    """A problem, a second walk's pattern on the same positions (for the drift), the value
    head each query head reads (``None``: its own) and the scale a hand-built case has."""

    name: str
    p: Problem
    next_pattern: Tensor
    kv_heads: tuple[int, ...] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.p.pattern.dtype


def _cast(p: Problem, dtype: torch.dtype) -> Problem:
    return Problem(*(getattr(p, f.name).to(dtype) for f in dataclasses.fields(p)))


def _grouped(dtype: torch.dtype) -> Problem:
    """Four query heads reading two value heads (``W_V`` expanded, as the walk holds it)."""
    p = random_problem(heads=4, seed=3)
    shared = [0, 0, 1, 1]
    return _cast(dataclasses.replace(p, W_V=p.W_V[shared], b_V=p.b_V[shared]), dtype)


def _sink(dtype: torch.dtype) -> Problem:
    """Most of every head's mass on key 0, whose field is ten times the others', and key 3
    silent (``x_3 = 0``: it sends no message)."""
    p = random_problem(seed=5, causal=True)
    pattern = 0.1 * p.pattern
    pattern[..., 0] += 0.9
    field = p.field.clone()
    field[:, 0] *= 10
    field[:, 3] = 0
    return _cast(dataclasses.replace(p, pattern=pattern, field=field), dtype)


#: The common scale of `_orthogonal`.
ORTHOGONAL_SCALE = 2.5


def _orthogonal(dtype: torch.dtype) -> Problem:
    """Heads ``T^h = c Q_h Q_h^T`` on complementary blocks of an orthogonal ``Q``, all with one
    pattern: every gate is ``1/H`` and ``T_ij = c I``, a scaled isometry (spec §2)."""
    p = random_problem(heads=3, d_model=9, d_head=3, seed=6)
    gen = torch.Generator().manual_seed(6)
    blocks = torch.linalg.qr(torch.randn(9, 9, generator=gen, dtype=F64)).Q.T.reshape(3, 3, 9)
    pattern = p.pattern[:, :1].expand_as(p.pattern).contiguous()
    W_V, W_O = ORTHOGONAL_SCALE * blocks.mT.contiguous(), blocks.contiguous()
    return _cast(dataclasses.replace(p, pattern=pattern, W_V=W_V, W_O=W_O), dtype)


def _case(name: str, p: Problem, kv_heads: tuple[int, ...] | None = None) -> Case:
    batch, heads, _, pos = p.pattern.shape
    second = random_problem(batch=batch, heads=heads, pos=pos, seed=9).pattern
    return Case(name, p, second.to(p.pattern.dtype), kv_heads)


def _problems() -> list[Case]:
    cases = []
    for dtype, suffix in ((F64, ""), (F32, "-f32")):
        cases += [
            _case("random" + suffix, random_problem(seed=1, dtype=dtype)),
            _case("causal" + suffix, random_problem(seed=2, causal=True, dtype=dtype)),
            _case("grouped" + suffix, _grouped(dtype), grouped_value_heads(4, 2)),
            _case("sink" + suffix, _sink(dtype)),
            _case("symmetric" + suffix, _cast(symmetric_problem(), dtype)),
            _case("orthogonal" + suffix, _orthogonal(dtype)),
        ]
    return cases


PROBLEMS = _problems()
CASES = {case.name: case for case in PROBLEMS}


# the pieces every row reads: the fast split of the pattern, and the reference's own


def fW(c: Case) -> Tensor:
    return core_walk.walk_matrix(c.p.pattern)


def fg(c: Case) -> Tensor:
    return core_walk.gates(c.p.pattern)


def rW(c: Case) -> Tensor:
    return ref.walk(c.p.pattern)


def rg(c: Case) -> Tensor:
    return _ref_gates(c.name)


@functools.cache
def _ref_gates(name: str) -> Tensor:
    return ref.gates(CASES[name].p.pattern)


def VO(c: Case) -> tuple[Tensor, Tensor]:
    return c.p.W_V, c.p.W_O


def rank(c: Case) -> int:
    return ref.transport_rank(c.p.W_V, c.kv_heads)


def on_walk(c: Case, values: Tensor) -> Tensor:
    return torch.where(rW(c) > 0, values, 0.0)


def conn_walk(c: Case) -> ConnectionWalk:
    p = c.p
    return ConnectionWalk.from_pattern(
        p.pattern, p.field, p.W_V, p.W_O, p.b_V, p.b_O, kv_heads=c.kv_heads
    )


@functools.cache
def residual(name: str) -> Any:
    """`laplacian_residual` of a problem's walk, with the nearest operator, computed once."""
    c = CASES[name]
    return conn_walk(c).laplacian_residual(baseline_draws=DRAWS, seed=SEED, exact=True)


@functools.cache
def residual_of_heaviest(name: str) -> Any:
    c = CASES[name]
    return conn_walk(c).laplacian_residual(baseline_draws=DRAWS, seed=SEED, mass_share=0.7)


def fast_transports(c: Case) -> Tensor:
    T = core_walk.EffectiveTransport(fg(c), *VO(c))
    n = c.p.pattern.shape[-1]
    return torch.stack([torch.stack([T[i, j].AB for j in range(n)], 1) for i in range(n)], 1)


def head_grams(c: Case) -> tuple[Tensor, Tensor, Tensor]:
    """``K2[a,b] = tr(T^a^T T^b)``, ``KM[a,b] = tr(T^a T^b)``, ``K4[a,b,c,e] =
    tr(T^b^T T^a T^c^T T^e)`` (spec §3) from the reference's dense head transports."""
    T = ref.head_transports(*VO(c))
    K2 = torch.einsum("axy,bxy->ab", T, T)
    KM = torch.einsum("axy,byx->ab", T, T)
    K4 = torch.einsum("bxy,axz,cwz,ewy->abce", T, T, T, T)
    return K2, KM, K4


def fast_baselines(c: Case) -> dict[str, isometry.RandomBaseline]:
    return _fast_baselines(c.name)


@functools.cache
def _fast_baselines(name: str) -> dict[str, isometry.RandomBaseline]:
    c = CASES[name]
    p = c.p
    measures = {
        "head": isometry.head_transport_defects,
        "effective": lambda V, W_o: isometry.effective_transport_defect(
            fW(c), fg(c), V, W_o, kv_heads=c.kv_heads
        ),
        "field": lambda V, W_o: field_defect.field_isometry_defect(p.field, fW(c), fg(c), V, W_o),
    }
    return isometry.random_baselines(measures, *VO(c), DRAWS, seed=SEED, kv_heads=c.kv_heads)


def ref_baseline(c: Case, measure: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    return ref.random_baseline(measure, *VO(c), DRAWS, seed=SEED, kv_heads=c.kv_heads)


@functools.cache
def _ref_baselines(name: str) -> dict[str, tuple[Tensor, Tensor]]:
    c = CASES[name]
    return {
        "head": ref_baseline(c, ref.head_defects),
        "effective": ref_baseline(c, lambda V, W_o: ref_effective(c, V, W_o)),
        "field": ref_baseline(c, lambda V, W_o: ref_field(c, V, W_o)),
    }


def ref_baselines(c: Case) -> dict[str, tuple[Tensor, Tensor]]:
    return _ref_baselines(c.name)


def ref_effective(c: Case, V: Tensor, W_o: Tensor) -> Tensor:
    return ref.effective_defect(rW(c), rg(c), V, W_o, c.kv_heads)


def ref_field(c: Case, V: Tensor, W_o: Tensor) -> Tensor:
    return ref.field_defect(c.p.field, rW(c), rg(c), V, W_o)


def ref_mu(c: Case) -> Tensor:
    return ref.measure(rW(c))


def ref_scale(c: Case) -> Tensor:
    return ref.common_scale(rW(c), rg(c), *VO(c), c.kv_heads)


def ref_head_ratios(c: Case) -> Tensor:
    """``rho^h_j = ||x_j T^h|| / ||x_j||`` (0 where ``x_j = 0``), ``[batch, key, head]``."""
    X = c.p.field.double()
    norms = torch.linalg.vector_norm(X, dim=-1)[..., None]
    sent = torch.linalg.vector_norm(
        torch.einsum("bjd,hde->bjhe", X, ref.head_transports(*VO(c))), dim=-1
    )
    return torch.where(norms > 0, sent / norms.clamp_min(1e-300), 0.0)


def well_conditioned(c: Case) -> Tensor:
    """``I + 0.3 T^0 / ||T^0||_2``: singular values in [0.7, 1.3], a unique polar factor."""
    T = ref.head_transports(*VO(c))[0]
    return (torch.eye(T.shape[0], dtype=F64) + 0.3 * T / torch.linalg.matrix_norm(T, 2)).to(c.dtype)


def values(c: Case) -> Tensor:
    """Per-edge values to summarise, independent of the walk."""
    gen = torch.Generator().manual_seed(11)
    return torch.rand(c.p.pattern[:, 0].shape, generator=gen, dtype=F64).to(c.dtype)


def ref_edge_rows(c: Case, sink: bool) -> Tensor:
    return ref.walk_weighted_mean(rW(c), values(c), exclude_sink=sink)


def ref_message_grams(field: Tensor, W_V: Tensor, W_O: Tensor) -> Tensor:
    """``G_j[a,b] = m^a_j . m^b_j`` from the reference's messages (no value bias)."""
    m = ref.messages(field, W_V, torch.zeros(W_V.shape[::2], dtype=W_V.dtype), W_O)
    return torch.einsum("bjae,bjce->bjac", m, m)


def out_rows(W_O: Tensor) -> Tensor:
    return field_defect.output_gram_rows(torch.einsum("apd,bqd->abpq", W_O, W_O))


Row = tuple[str, Callable[[Case], Any], Callable[[Case], Any], str]

#: name, fast, reference, tolerance ("sum", "unit", "cancel" or "exact"; see the module)
MEASUREMENTS: list[Row] = [
    # spec §1: the walk, its transports and its action
    ("walk", fW, rW, "sum"),
    ("gates", fg, rg, "sum"),
    ("patterns_from_walk", lambda c: core_walk.patterns_from_walk(fW(c), fg(c)),
     lambda c: c.p.pattern, "sum"),
    ("head_transports", lambda c: core_walk.head_transports(*VO(c)).AB,
     lambda c: ref.head_transports(*VO(c)), "sum"),
    ("EffectiveTransport", fast_transports,
     lambda c: ref.effective_transports(rg(c), *VO(c)), "sum"),
    ("propagate", lambda c: core_walk.propagate(c.p.pattern, c.p.field, *VO(c)),
     lambda c: ref.apply(c.p.pattern, c.p.field, *VO(c)), "sum"),
    ("ConnectionWalk.apply", lambda c: conn_walk(c).apply(),
     lambda c: ref.apply(c.p.pattern, c.p.field, *VO(c)), "sum"),
    ("attention_bias", lambda c: core_walk.attention_bias(c.p.pattern, c.p.b_V, c.p.W_O, c.p.b_O),
     lambda c: ref.bias(c.p.pattern, c.p.b_V, c.p.W_O, c.p.b_O), "sum"),
    ("ConnectionWalk.bias", lambda c: conn_walk(c).bias(),
     lambda c: ref.bias(c.p.pattern, c.p.b_V, c.p.W_O, c.p.b_O), "sum"),
    ("head_messages", lambda c: core_walk.head_messages(c.p.field, c.p.W_V, c.p.b_V, c.p.W_O),
     lambda c: ref.messages(c.p.field, c.p.W_V, c.p.b_V, c.p.W_O), "sum"),
    ("generator.to_dense",
     lambda c: generator.ConnectionGenerator(c.p.pattern, *VO(c)).to_dense(),
     lambda c: ref.generator(c.p.pattern, *VO(c)), "sum"),
    ("generator.matvec", lambda c: conn_walk(c).generator().matvec(c.p.field),
     lambda c: c.p.field.double() - ref.apply(c.p.pattern, c.p.field, *VO(c)), "sum"),
    # spec §2-3: the Markov conditions and the drift
    ("stochasticity", lambda c: markov.stochasticity_residual(fW(c)),
     lambda c: ref.stochasticity(rW(c)), "unit"),
    ("is_irreducible", lambda c: markov.is_irreducible(fW(c)),
     lambda c: ref.is_irreducible(rW(c)), "exact"),
    ("mu stationary", lambda c: markov.reversibility_residual(fW(c)).mu, ref_mu, "sum"),
    ("mu teleport", lambda c: markov.stationary_distribution(fW(c), teleport=0.85),
     lambda c: ref.measure(rW(c), "teleport"), "sum"),
    ("reversibility", lambda c: markov.reversibility_residual(fW(c)).residual,
     lambda c: ref.reversibility(rW(c), ref_mu(c)), "unit"),
    ("reversibility uniform", lambda c: markov.reversibility_residual(fW(c), "uniform").residual,
     lambda c: ref.reversibility(rW(c), ref.measure(rW(c), "uniform")), "unit"),
    ("reversibility given", lambda c: markov.reversibility_residual(fW(c), c.p.mu).residual,
     lambda c: ref.reversibility(rW(c), c.p.mu), "unit"),
    ("layer_drift", lambda c: markov.layer_drift(fW(c), core_walk.walk_matrix(c.next_pattern)),
     lambda c: ref.layer_drift(rW(c), ref.walk(c.next_pattern)), "unit"),
    ("layer_drift sink",
     lambda c: markov.layer_drift(fW(c), core_walk.walk_matrix(c.next_pattern), exclude_sink=True),
     lambda c: ref.layer_drift(rW(c), ref.walk(c.next_pattern), exclude_sink=True), "unit"),
    ("pairing", lambda c: markov.pairing_residual(fW(c), fg(c), *VO(c)).residual,
     lambda c: ref.pairing(rW(c), rg(c), *VO(c))[0], "cancel"),
    ("pairing sink",
     lambda c: markov.pairing_residual(fW(c), fg(c), *VO(c), exclude_sink=True).residual,
     lambda c: ref.pairing(rW(c), rg(c), *VO(c), exclude_sink=True)[0], "cancel"),
    ("pairing applicable", lambda c: markov.pairing_residual(fW(c), fg(c), *VO(c)).applicable,
     lambda c: ref.pairing(rW(c), rg(c), *VO(c))[1], "exact"),
    ("edge_pairing_residuals", lambda c: torch.where(
        (fW(c) > 0) & (fW(c) > 0).mT, markov.edge_pairing_residuals(
            fg(c), isometry.head_gram(*VO(c)), isometry.head_mixed_gram(*VO(c))), 0.0),
     lambda c: torch.where((rW(c) > 0) & (rW(c) > 0).mT, ref.edge_pairing(rg(c), *VO(c)), 0.0),
     "cancel"),
    # spec §3: summaries
    ("walk_weighted_mean", lambda c: isometry.walk_weighted_mean(fW(c), values(c)),
     lambda c: ref.walk_weighted_mean(rW(c), values(c)), "sum"),
    ("walk_weighted_mean sink",
     lambda c: isometry.walk_weighted_mean(fW(c), values(c), exclude_sink=True),
     lambda c: ref.walk_weighted_mean(rW(c), values(c), exclude_sink=True), "sum"),
    ("walk_weighted_cv", lambda c: isometry.walk_weighted_cv(fW(c), values(c)),
     lambda c: ref.walk_weighted_cv(rW(c), values(c)), "sum"),
    ("heaviest_edges", lambda c: isometry.heaviest_edges(fW(c), 0.7),
     lambda c: ref.heaviest_edges(rW(c), 0.7), "exact"),
    ("covered_mass_share",
     lambda c: isometry.covered_mass_share(fW(c), isometry.heaviest_edges(fW(c), 0.7)),
     lambda c: (rW(c) * ref.heaviest_edges(rW(c), 0.7)).sum((1, 2)) / rW(c).sum((1, 2)), "sum"),
    # spec §3: isometry defects of the heads and of the effective transports
    ("head_singular_values", lambda c: isometry.head_singular_values(*VO(c)),
     lambda c: torch.linalg.svdvals(ref.head_transports(*VO(c)))[:, : c.p.W_V.shape[-1]], "sum"),
    ("head_transport_defects", lambda c: isometry.head_transport_defects(*VO(c)),
     lambda c: ref.head_defects(*VO(c)), "unit"),
    ("isometry_defect", lambda c: isometry.isometry_defect(
        torch.linalg.svdvals(ref.head_transports(*VO(c))).to(c.dtype), c.p.W_V.shape[-1]),
     lambda c: ref.isometry_defect(ref.head_transports(*VO(c)), c.p.W_V.shape[-1]), "unit"),
    ("gram_defect", lambda c: isometry.gram_defect(
        torch.linalg.svdvals(ref.head_transports(*VO(c))).to(c.dtype), c.p.W_V.shape[-1]),
     lambda c: ref.gram_defect(ref.head_transports(*VO(c)), c.p.W_V.shape[-1]), "unit"),
    ("frobenius_scale", lambda c: isometry.frobenius_scale(
        torch.linalg.svdvals(ref.head_transports(*VO(c))).to(c.dtype), c.p.W_V.shape[-1]),
     lambda c: torch.linalg.matrix_norm(ref.head_transports(*VO(c))) / c.p.W_V.shape[-1] ** 0.5,
     "sum"),
    ("effective_rank", lambda c: isometry.effective_rank(*VO(c), c.kv_heads), rank, "exact"),
    ("head_gram", lambda c: isometry.head_gram(*VO(c)), lambda c: head_grams(c)[0], "sum"),
    ("head_mixed_gram", lambda c: isometry.head_mixed_gram(*VO(c)),
     lambda c: head_grams(c)[1], "sum"),
    ("gram_matrices", lambda c: isometry.gram_matrices(*VO(c))[1],
     lambda c: head_grams(c)[2], "sum"),
    ("edge_gram_defects",
     lambda c: isometry.edge_gram_defects(fg(c), *isometry.gram_matrices(*VO(c)), rank(c), fW(c)),
     lambda c: on_walk(c, ref.edge_defects(rg(c), *VO(c), rank(c))), "cancel"),
    ("folded_edge_gram_defects", lambda c: isometry.folded_edge_gram_defects(
        fg(c), isometry.head_gram(*VO(c)),
        isometry.fold_pairs(isometry.gram_matrices(*VO(c))[1]), rank(c)),
     lambda c: ref.edge_defects(rg(c), *VO(c), rank(c)), "cancel"),
    ("edge_frobenius_scales",
     lambda c: isometry.edge_frobenius_scales(fg(c), isometry.head_gram(*VO(c)), rank(c)),
     lambda c: torch.linalg.matrix_norm(ref.effective_transports(rg(c), *VO(c))) / rank(c) ** 0.5,
     "sum"),
    ("edge_singular_values", lambda c: isometry.isometry_defect(
        isometry.edge_singular_values(fg(c), *VO(c)), rank(c)),
     lambda c: ref.edge_defects(rg(c), *VO(c), rank(c), "frobenius"), "unit"),
    ("effective_transport_defect", lambda c: isometry.effective_transport_defect(
        fW(c), fg(c), *VO(c), kv_heads=c.kv_heads),
     lambda c: ref.effective_defect(rW(c), rg(c), *VO(c), c.kv_heads), "cancel"),
    ("effective_transport_defect sink", lambda c: isometry.effective_transport_defect(
        fW(c), fg(c), *VO(c), kv_heads=c.kv_heads, exclude_sink=True),
     lambda c: ref.effective_defect(rW(c), rg(c), *VO(c), c.kv_heads, exclude_sink=True),
     "cancel"),
    ("effective_transport_defect heaviest", lambda c: isometry.effective_transport_defect(
        fW(c), fg(c), *VO(c), kv_heads=c.kv_heads, edges=isometry.heaviest_edges(fW(c), 0.7)),
     lambda c: ref.effective_defect(
         rW(c), rg(c), *VO(c), c.kv_heads, keep=ref.heaviest_edges(rW(c), 0.7)), "cancel"),
    ("common_scale", lambda c: isometry.common_scale(fW(c), fg(c), *VO(c), kv_heads=c.kv_heads),
     ref_scale, "sum"),
    # spec §3: the data-dependent defects
    ("message_grams", lambda c: field_defect.message_grams(c.p.field, *VO(c)),
     lambda c: ref_message_grams(c.p.field, *VO(c)), "sum"),
    ("message_grams out_rows",
     lambda c: field_defect.message_grams(c.p.field, *VO(c), out_rows=out_rows(c.p.W_O)),
     lambda c: ref_message_grams(c.p.field, *VO(c)), "sum"),
    ("message_norm_ratios", lambda c: field_defect.message_norm_ratios(c.p.field, fg(c), *VO(c)),
     lambda c: ref.message_ratios(c.p.field, rg(c), *VO(c)), "sum"),
    ("head_message_norm_ratios",
     lambda c: field_defect.head_message_norm_ratios(c.p.field, *VO(c)),
     ref_head_ratios, "sum"),
    ("field_isometry_defect", lambda c: field_defect.field_isometry_defect(
        c.p.field, fW(c), fg(c), *VO(c)),
     lambda c: ref.field_defect(c.p.field, rW(c), rg(c), *VO(c)), "cancel"),
    ("field_isometry_defect sink", lambda c: field_defect.field_isometry_defect(
        c.p.field, fW(c), fg(c), *VO(c), exclude_sink=True),
     lambda c: ref.field_defect(c.p.field, rW(c), rg(c), *VO(c), exclude_sink=True), "cancel"),
    ("head_field_isometry_defects", lambda c: field_defect.head_field_isometry_defects(
        c.p.field, fW(c), fg(c), *VO(c)),
     lambda c: ref.head_field_defects(c.p.field, rW(c), rg(c), *VO(c)), "cancel"),
    ("head_field_isometry_defects sink", lambda c: field_defect.head_field_isometry_defects(
        c.p.field, fW(c), fg(c), *VO(c), exclude_sink=True),
     lambda c: ref.head_field_defects(c.p.field, rW(c), rg(c), *VO(c), exclude_sink=True),
     "cancel"),
    # spec §4: the nearest random-walk connection operator
    ("reversibilised_walk", lambda c: laplacian.reversibilised_walk(fW(c), c.p.mu),
     lambda c: ref.reversibilised_walk(rW(c), c.p.mu), "sum"),
    ("polar_factor", lambda c: laplacian.polar_factor(well_conditioned(c)),
     lambda c: ref.polar(well_conditioned(c)), "sum"),
    ("nearest_connection_operator_distance",
     lambda c: laplacian.nearest_connection_operator_distance(
         fW(c), fg(c), *VO(c), c.p.mu, ref_scale(c).to(c.dtype)).distance,
     lambda c: ref.nearest_operator_distance(rW(c), rg(c), *VO(c), c.p.mu, ref_scale(c)), "sum"),
    # spec §3: random baselines, the same draws for one seed
    ("random_baselines head", lambda c: fast_baselines(c)["head"],
     lambda c: ref_baselines(c)["head"], "unit"),
    ("random_baselines effective", lambda c: fast_baselines(c)["effective"],
     lambda c: ref_baselines(c)["effective"], "cancel"),
    ("random_baselines field", lambda c: fast_baselines(c)["field"],
     lambda c: ref_baselines(c)["field"], "cancel"),
    ("layer_draws", lambda c: draws.layer_draws(
        *VO(c), DRAWS, SEED, kv_heads=c.kv_heads).head_defects.mean(0),
     lambda c: ref_baselines(c)["head"][0], "unit"),
    # spec §4: laplacian_residual, the whole layer at once
    ("residual stochasticity", lambda c: residual(c.name).stochasticity,
     lambda c: ref.stochasticity(rW(c)), "unit"),
    ("residual reversibility", lambda c: residual(c.name).reversibility,
     lambda c: ref.reversibility(rW(c), ref_mu(c)), "unit"),
    ("residual mu", lambda c: residual(c.name).mu, ref_mu, "sum"),
    ("residual transport_defect", lambda c: residual(c.name).transport_defect,
     lambda c: ref.effective_defect(rW(c), rg(c), *VO(c), c.kv_heads), "cancel"),
    ("residual scale", lambda c: residual(c.name).scale, ref_scale, "sum"),
    ("residual pairing", lambda c: residual(c.name).pairing_applicable,
     lambda c: ref.pairing(rW(c), rg(c), *VO(c))[1], "exact"),
    ("residual head_defects", lambda c: residual(c.name).head_defects,
     lambda c: ref.head_defects(*VO(c)), "unit"),
    ("residual field_defect", lambda c: residual(c.name).field_defect,
     lambda c: ref.field_defect(c.p.field, rW(c), rg(c), *VO(c)), "cancel"),
    ("residual head_field_defects", lambda c: residual(c.name).head_field_defects,
     lambda c: ref.head_field_defects(c.p.field, rW(c), rg(c), *VO(c)), "cancel"),
    # at the residual's own mu and scale (held to theirs by the rows "residual mu" and
    # "residual scale"): the distance amplifies mu's rounding by the walk over its gap to W*
    ("residual nearest_operator", lambda c: residual(c.name).nearest_operator.distance,
     lambda c: ref.nearest_operator_distance(
         rW(c), rg(c), *VO(c), residual(c.name).mu, residual(c.name).scale), "sum"),
    ("residual baseline head_defects", lambda c: residual(c.name).baseline["head_defects"],
     lambda c: ref_baselines(c)["head"], "unit"),
    ("residual baseline transport_defect",
     lambda c: residual(c.name).baseline["transport_defect"],
     lambda c: ref_baselines(c)["effective"], "cancel"),
    ("residual mass_share", lambda c: residual_of_heaviest(c.name).transport_defect,
     lambda c: ref.effective_defect(
         rW(c), rg(c), *VO(c), c.kv_heads, keep=ref.heaviest_edges(rW(c), 0.7)), "cancel"),
    ("isometry_defects gram", lambda c: conn_walk(c).isometry_defects("gram"),
     lambda c: on_walk(c, ref.edge_defects(rg(c), *VO(c), rank(c))), "cancel"),
    ("isometry_defects frobenius", lambda c: conn_walk(c).isometry_defects("frobenius"),
     lambda c: on_walk(c, ref.edge_defects(rg(c), *VO(c), rank(c), "frobenius")), "unit"),
]  # fmt: skip


def _pairs(value: Any) -> list[Tensor]:
    """A measurement as tensors: a baseline as its mean and spread."""
    if isinstance(value, isometry.RandomBaseline):
        return [value.mean, value.std]
    if isinstance(value, tuple):
        return list(value)
    return [torch.as_tensor(value)]


def check(actual: Any, expected: Any, tolerance: str, dtype: torch.dtype) -> None:
    """``actual`` within the row's tolerance of ``expected`` (see the module)."""
    for got, want in zip(_pairs(actual), _pairs(expected), strict=True):
        assert got.shape == want.shape, (got.shape, want.shape)
        if tolerance == "exact":
            assert torch.equal(got.cpu(), want.to(got.dtype).cpu())
        elif tolerance == "sum":
            assert_close(got.double(), want.double(), dtype)
        else:
            bound = atol(dtype) if tolerance == "unit" else cancelling_atol(dtype)
            gap = (got.double() - want.double()).abs().max().item()
            assert gap <= bound, f"off by {gap:.3g} > {bound:.3g}"


@pytest.mark.parametrize("case", PROBLEMS, ids=lambda c: c.name)
@pytest.mark.parametrize("row", MEASUREMENTS, ids=lambda row: row[0])
def test_fast_matches_reference(row: Row, case: Case) -> None:
    _, fast, reference, tolerance = row
    check(fast(case), reference(case), tolerance, case.dtype)


def test_the_hand_built_cases_are_exact_in_the_reference() -> None:
    """The reference itself on the exact cases: zero defects, a reversible, paired walk."""
    for dtype in (F64, F32):
        c = CASES["orthogonal" if dtype == F64 else "orthogonal-f32"]
        zero = [
            ref.head_defects(*VO(c)),
            ref.effective_defect(rW(c), rg(c), *VO(c)),
            ref.field_defect(c.p.field, rW(c), rg(c), *VO(c)),
            ref.edge_defects(rg(c), *VO(c), rank(c), "frobenius"),
        ]
        for value in zero:
            assert value.abs().max() <= atol(dtype)
        assert_close(ref_scale(c), torch.full((2,), ORTHOGONAL_SCALE, dtype=F64), dtype)
        c = CASES["symmetric" if dtype == F64 else "symmetric-f32"]
        assert ref.reversibility(rW(c), c.p.mu).abs().max() <= atol(dtype)
        residual, applicable = ref.pairing(rW(c), rg(c), *VO(c))
        assert applicable.all() and residual.abs().max() <= atol(dtype)
        assert_close(ref.reversibilised_walk(rW(c), c.p.mu), rW(c), dtype)
    causal = CASES["causal"]
    assert not ref.is_irreducible(rW(causal)).any()
    assert not ref.pairing(rW(causal), rg(causal), *VO(causal))[1].any()


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("side", ["out_rows", "W_O"])
def test_every_draw_and_sequence_at_once_matches_the_reference_one_by_one(dtype, side) -> None:
    """The field baselines' batched message Grams (`messages.stacked_factored_grams`: values
    ``L_s Y_d`` for every sequence ``s`` and draw ``d`` in one product) against the
    reference's messages of each pair alone."""
    gen = torch.Generator().manual_seed(SEED)
    seqs, keys, heads, d_head, d_model, draws = 3, 5, 4, 2, 9, 3
    factor = torch.randn(seqs, keys, keys, generator=gen, dtype=F64).tril()
    values = torch.randn(draws, keys, heads * d_head, generator=gen, dtype=F64)
    outputs = torch.randn(draws, heads, d_head, d_model, generator=gen, dtype=F64)
    if side == "W_O":  # one W_O shared by the draws
        outputs = outputs[:1].expand(draws, -1, -1, -1)
        given = {"W_O": outputs[0].to(dtype)}
    else:
        given = {"out_rows": torch.stack([out_rows(W_O) for W_O in outputs]).to(dtype)}
    got = fast_messages.stacked_factored_grams(factor.to(dtype), values.to(dtype), heads, **given)
    assert got.shape == (draws, seqs, keys, heads, heads)
    for d in range(draws):
        W_V = values[d].view(keys, heads, d_head).permute(1, 0, 2)  # keys' values per head
        for s in range(seqs):
            want = ref_message_grams(factor[s][None], W_V, outputs[d])[0]
            check(got[d, s], want, "sum", dtype)


#: Seeds of the field baseline's distribution test, and the z-score its means may differ by.
SEEDS = 48
Z = 4.0


def test_the_key_route_field_baseline_has_the_reference_distribution() -> None:
    """With fewer keys than ``d_model`` the field baseline draws ``L Y`` instead of ``X R_V``
    (spec §3): other realisations of the same Gaussian transports. Over ``SEEDS`` seeds, the
    mean and the spread of its draws agree with the reference's own draws to ``Z`` standard
    errors of the difference of two means over ``SEEDS`` seeds."""
    n_draws = 4
    p = random_problem(batch=2, heads=2, pos=6, d_model=16, d_head=4, seed=8)
    walk = ConnectionWalk.from_pattern(p.pattern, p.field, p.W_V, p.W_O)
    factor = draws.key_factor(p.field, n_draws, width=2 * 4)
    assert factor is not None and factor[1].all()  # every sequence takes the keys' route
    fast, slow = [], []
    for seed in range(SEEDS):
        base = walk.laplacian_residual(baseline_draws=n_draws, seed=seed).baseline
        fast.append(torch.stack([base["field_defect"].mean, base["field_defect"].std]))
        field = lambda V, W_o: ref.field_defect(p.field, walk.walk, walk.gates, V, W_o)  # noqa: E731
        slow.append(torch.stack(ref.random_baseline(field, p.W_V, p.W_O, n_draws, seed)))
    fast_t, slow_t = torch.stack(fast).double(), torch.stack(slow)  # [seed, mean/std, batch]
    error = ((fast_t.var(0) + slow_t.var(0)) / SEEDS).sqrt()
    gap = (fast_t.mean(0) - slow_t.mean(0)).abs()
    assert (gap <= Z * error).all(), gap / error
    # the fast route is not the reference's draws themselves: other realisations
    assert not torch.allclose(fast_t, slow_t)


ADAPTED = ["gpt2_ln", "llama_gqa_rotary"]


def _cache_case(model: Any, cache: Any, layer: int) -> Case:
    """The reference's inputs read off the cache and weights as spec §0 defines them."""
    norm = model.blocks[layer].ln1
    # the normalised residual from its definition: (x - mean x) / scale * w + b (LayerNorm),
    # x / scale * w (RMSNorm); hook_normalized holds it with or without the affine part
    # depending on the TransformerLens version
    x = cache[f"blocks.{layer}.hook_resid_pre"]
    if hasattr(norm, "b"):
        x = x - x.mean(-1, keepdim=True)
    field = x / cache[f"blocks.{layer}.ln1.hook_scale"] * norm.w
    if hasattr(norm, "b"):
        field = field + norm.b
    cfg = model.cfg
    kv = cfg.n_key_value_heads
    weights = (model.W_V[layer], model.W_O[layer], model.b_V[layer], model.b_O[layer])
    pattern = cache["pattern", layer]
    mu = torch.rand(pattern.shape[0], pattern.shape[-1], generator=torch.Generator().manual_seed(2))
    p = Problem(pattern, field, weights[0], weights[1], weights[2], weights[3], mu + 0.1)
    kv_heads = None if kv is None else grouped_value_heads(cfg.n_heads, kv)
    return Case("cache", p, cache["pattern", layer - 1], kv_heads)


@hooked_only
@pytest.mark.parametrize("arch", ADAPTED)
def test_adapter_numbers_match_the_reference(arch: str) -> None:
    """``cache.connection_walk`` and the measurements on it against the reference computed
    from the cache's own tensors (pattern, normalised field, weights)."""
    model = build(arch)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens())
    walk = tl_connwalk.connection_walk(cache, 1)
    c = _cache_case(model, cache, 1)
    res = walk.laplacian_residual(baseline_draws=DRAWS, seed=SEED, exact=True)
    output = ref.apply(c.p.pattern, c.p.field, *VO(c)) + ref.bias(
        c.p.pattern, c.p.b_V, c.p.W_O, c.p.b_O
    )
    rows = [
        (walk.walk, rW(c), "sum"),
        (walk.gates, ref.gates(c.p.pattern), "sum"),
        (walk.apply() + walk.bias(), output, "sum"),
        (cache["blocks.1.hook_attn_out"], output, "sum"),  # TransformerLens's own output
        (res.stochasticity, ref.stochasticity(rW(c)), "unit"),
        (res.reversibility, ref.reversibility(rW(c), ref_mu(c)), "unit"),
        (res.mu, ref_mu(c), "sum"),
        (res.transport_defect, ref.effective_defect(rW(c), ref.gates(c.p.pattern), *VO(c),
                                                    c.kv_heads), "cancel"),
        (res.scale, ref.common_scale(rW(c), ref.gates(c.p.pattern), *VO(c), c.kv_heads), "sum"),
        (res.pairing_applicable, ref.pairing(rW(c), ref.gates(c.p.pattern), *VO(c))[1], "exact"),
        (res.head_defects, ref.head_defects(*VO(c)), "unit"),
        (res.field_defect, ref.field_defect(c.p.field, rW(c), ref.gates(c.p.pattern), *VO(c)),
         "cancel"),
        (res.head_field_defects,
         ref.head_field_defects(c.p.field, rW(c), ref.gates(c.p.pattern), *VO(c)), "cancel"),
        (res.baseline["head_defects"],
         ref.random_baseline(ref.head_defects, *VO(c), DRAWS, SEED, c.kv_heads), "unit"),
        (walk.isometry_defects(), on_walk(c, ref.edge_defects(
            ref.gates(c.p.pattern), *VO(c), rank(c))), "cancel"),
        (tl_connwalk.layer_drift(cache)[:, 0],
         ref.layer_drift(ref.walk(cache["pattern", 0]), rW(c)), "unit"),
    ]  # fmt: skip
    scale = ref.common_scale(rW(c), ref.gates(c.p.pattern), *VO(c), c.kv_heads)
    distance = ref.nearest_operator_distance(
        rW(c), ref.gates(c.p.pattern), *VO(c), ref_mu(c), scale
    )
    rows.append((res.nearest_operator.distance, distance, "sum"))
    for actual, expected, tolerance in rows:
        check(actual, expected, tolerance, torch.float32)
