"""The random baselines (spec §3): defects of random transports of the same shapes, value-head
sharing and head Frobenius norms (Gaussian factors), summarised over draws."""

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core import value_heads
from tl_connwalk.core._fast.grams import head_norms_sq
from tl_connwalk.core.checks import cast_heads, check_draws, working_dtype
from tl_connwalk.errors import ConnWalkError


def random_head_factors(
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    generator: torch.Generator,
    kv_heads: Sequence[int] | None = None,
) -> tuple[Float[Tensor, "head d_model d_head"], Float[Tensor, "head d_head d_model"]]:
    """Gaussian factors of the same shapes whose head transports have the same ``||T^h||_F``.

    ``kv_heads`` (grouped-query weights, `tl_connwalk.core.value_heads`): one random ``W_V``
    per value head, read by every query head that reads it, as in the model (spec §3).
    Each random head's scale ``s_h`` (`draw_scales`) is split evenly between its two factors;
    where value heads are shared, it goes on ``W_O^h`` alone (so they stay shared). Either
    way ``T'^h = s_h R_V^{kv(h)} R_O^h``; a zero head stays 0.

    >>> V, O = random_head_factors(torch.randn(2, 8, 4), torch.randn(2, 4, 8),
    ...                            torch.Generator().manual_seed(0))
    >>> V.shape, O.shape
    (torch.Size([2, 8, 4]), torch.Size([2, 4, 8]))
    """
    W_V, W_O = cast_heads(W_V, W_O)
    if generator.device.type != W_V.device.type:
        raise ConnWalkError(
            f"the generator is on {generator.device} but the weights are on {W_V.device}; "
            "pass torch.Generator(device=W_V.device) or an integer seed."
        )
    kv_heads = value_heads.check_kv_heads(kv_heads, W_V.shape[0])
    rand_V, rand_O = gaussian_factors(
        W_V.shape, W_O.shape, W_V.dtype, W_V.device, generator, kv_heads
    )
    scales = draw_scales(head_norms_sq(W_V, W_O), head_norms_sq(rand_V, rand_O))
    return scale_factors(rand_V, rand_O, scales, kv_heads)


def scale_factors(
    R_V: Float[Tensor, "head d_model d_head"],
    R_O: Float[Tensor, "head d_head d_model"],
    scales: Float[Tensor, " head"],
    kv_heads: Sequence[int] | None = None,
) -> tuple[Float[Tensor, "head d_model d_head"], Float[Tensor, "head d_head d_model"]]:
    """Factors of ``s_h R_V^h R_O^h``, in place: ``sqrt(s_h)`` on each, or ``s_h`` on ``R_O^h``
    alone where query heads share value heads (`random_head_factors`)."""
    if value_heads.is_shared(kv_heads):
        return R_V, R_O.mul_(scales.to(R_O)[:, None, None])
    factor = scales.to(R_O).sqrt()[:, None, None]
    return R_V.mul_(factor), R_O.mul_(factor)


def gaussian_factors(
    v_shape: torch.Size,
    o_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    kv_heads: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Standard Gaussian ``R_V``, ``R_O`` of the given shapes: the raw draw of
    `random_head_factors`, drawn in that order from ``generator``.

    With ``kv_heads`` (`tl_connwalk.core.value_heads`), one ``R_V`` per value head is drawn
    (``[H_kv, d_model, d_head]``) and query head ``h`` gets ``R_V^{kv(h)}``: ``R_V`` still has
    ``v_shape``, with the model's sharing. Without sharing, the same numbers as no
    ``kv_heads``.
    """
    if kv_heads is None:
        rand_V = torch.randn(v_shape, dtype=dtype, device=device, generator=generator)
    else:
        n_value = value_heads.n_value_heads(kv_heads, v_shape[0])
        drawn = torch.randn(
            (n_value, *v_shape[1:]), dtype=dtype, device=device, generator=generator
        )
        rand_V = value_heads.expand_value_heads(drawn, kv_heads)
    return rand_V, torch.randn(o_shape, dtype=dtype, device=device, generator=generator)


def draw_scales(
    target_sq: Float[Tensor, "*target head"], drawn_sq: Float[Tensor, "*draw head"]
) -> Float[Tensor, "*scale head"]:
    """``s_h = ||T^h||_F / ||R^h||_F`` from the squared norms: ``s_h R^h`` has ``T^h``'s norm.

    0 where the draw ``R^h`` is 0; ``drawn_sq`` may hold several draws (leading axes), and
    ``target_sq`` several targets (leading axes that broadcast against the draws').
    `random_head_factors` puts ``s_h`` on the factors (`scale_factors`).
    """
    target, drawn = target_sq.clamp_min(0.0).sqrt(), drawn_sq.clamp_min(0.0).sqrt()
    return torch.where(drawn > 0, target / torch.where(drawn > 0, drawn, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class RandomBaseline:
    """A measurement repeated on random transports (spec §3): every draw, their mean, its
    standard error and the spread of the draws.

    ``draws[d]`` is draw ``d``'s value, or where the draws are taken on a sample of edges
    (``sampled_edges`` per draw and sequence, `tl_connwalk.walk.residual.laplacian_residual`'s
    ``baseline_edges``) its estimate, with ``sample_var[d]`` that estimate's variance over
    its sample. Each draw is independent and has its own sample, so ``se``, the standard
    deviation of the draws' values over ``sqrt(n_draws)``, is the standard error of ``mean``
    as an estimate of the expected defect of a random transport, the sampling included.
    ``std`` is the spread of the draws' own defects: the sample standard deviation over
    draws (``n_draws >= 2``), less the mean sampling variance where there is a sample.
    """

    draws: Float[Tensor, "draw ..."]
    sample_var: Float[Tensor, "draw ..."] | None = None
    sampled_edges: int | None = None

    @property
    def mean(self) -> Tensor:
        return self.draws.mean(0)

    @property
    def std(self) -> Tensor:
        if self.sample_var is None:
            return self.draws.std(0)
        spread = self.draws.var(0) - self.sample_var.to(self.draws).mean(0)
        return spread.clamp_min(0.0).sqrt()

    @property
    def se(self) -> Tensor:
        return self.draws.std(0) / self.n_draws**0.5

    @property
    def n_draws(self) -> int:
        return self.draws.shape[0]

    def to_dict(self) -> dict[str, object]:
        return {
            "mean": self.mean.tolist(),
            "std": self.std.tolist(),
            "se": self.se.tolist(),
            "n_draws": self.n_draws,
            "sampled_edges": self.sampled_edges,
        }


def random_baseline(
    measure: Callable[[Tensor, Tensor], Tensor],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    n_draws: int = 16,
    *,
    seed: int | torch.Generator = 0,
    kv_heads: Sequence[int] | None = None,
) -> RandomBaseline:
    """``measure(W_V', W_O')`` on ``n_draws`` random factor pairs (`random_head_factors`).

    Same shapes, same sharing of value heads (``kv_heads``, for grouped-query weights) and
    same head Frobenius norms, Gaussian factors (spec §3). Only ``W_V`` and ``W_O`` are drawn:
    a measure keeps the model's walk and gates, so its queries and keys (shared or not) stay
    the model's. ``seed`` is an integer (a fresh generator on the weights' device) or a
    ``torch.Generator``.

    >>> from tl_connwalk.core.isometry import head_transport_defects
    >>> base = random_baseline(head_transport_defects, torch.randn(2, 16, 4),
    ...                        torch.randn(2, 4, 16), n_draws=4)
    >>> base.mean.shape, base.std.shape
    (torch.Size([2]), torch.Size([2]))
    """
    return random_baselines({"measure": measure}, W_V, W_O, n_draws, seed=seed, kv_heads=kv_heads)[
        "measure"
    ]


def random_baselines(
    measures: Mapping[str, Callable[[Tensor, Tensor], Tensor]],
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    n_draws: int = 16,
    *,
    seed: int | torch.Generator = 0,
    kv_heads: Sequence[int] | None = None,
) -> dict[str, RandomBaseline]:
    """`random_baseline` of several measurements on the same ``n_draws`` random factor pairs.

    Each draw is made once and every measurement evaluated on it: the same baselines as one
    `random_baseline` call per measurement with the same integer ``seed``, for the cost of one
    set of draws.

    >>> from tl_connwalk.core.isometry import head_transport_defects
    >>> bases = random_baselines({"head": head_transport_defects}, torch.randn(2, 16, 4),
    ...                          torch.randn(2, 4, 16), n_draws=4)
    >>> bases["head"].mean.shape
    torch.Size([2])
    """
    check_draws(n_draws)
    if isinstance(seed, torch.Generator):
        generator = seed
    elif isinstance(seed, int):
        generator = torch.Generator(device=W_V.device).manual_seed(seed)
    else:
        raise ConnWalkError(f"seed must be an int or a torch.Generator, got {seed!r}.")
    draws: dict[str, list[Tensor]] = {name: [] for name in measures}
    for _ in range(n_draws):
        factors = random_head_factors(W_V, W_O, generator, kv_heads)
        for name, measure in measures.items():
            draws[name].append(measure(*factors))
    baselines = {}
    for name, values in draws.items():
        stacked = torch.stack(values)
        baselines[name] = RandomBaseline(stacked.to(working_dtype(stacked)))
    return baselines
