"""What a layer's measurements read of its walk and keep between calls.

`MeasuredWalk`: the walk's tensors the measurements read. `_LayerTerms`: what they need of the
walk's weights and field alone (unit-scaled field and weights, their head Grams, the message
Grams, the random draws), each made on first use. `Memo`: holds a walk's `_LayerTerms` between
calls. `tl_connwalk.walk.residual` re-exports `MeasuredWalk` and `Memo`.
"""

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core import field_defect, isometry
from tl_connwalk.core.caches import (
    HeadGrams,
    LayerDraws,
    head_grams,
    layer_draws,
    sampled,
    stacked_draw_message_grams,
    stacked_layer_draws,
)
from tl_connwalk.core.checks import abs_maxes
from tl_connwalk.errors import ConnWalkError


@runtime_checkable
class MeasuredWalk(Protocol):
    """What the measurements read of a walk: `tl_connwalk.walk.ConnectionWalk` is one.

    The tensors and shapes are those of `ConnectionWalk`'s attributes (spec §1.2).
    """

    @property
    def walk(self) -> Float[Tensor, "batch query key"]: ...
    @property
    def gates(self) -> Float[Tensor, "batch head query key"]: ...
    @property
    def field(self) -> Float[Tensor, "batch key d_model"]: ...
    @property
    def W_V(self) -> Float[Tensor, "head d_model d_head"]: ...
    @property
    def W_O(self) -> Float[Tensor, "head d_head d_model"]: ...
    @property
    def kv_heads(self) -> tuple[int, ...] | None: ...
    @property
    def attention_mask(self) -> Bool[Tensor, "batch pos"] | None: ...
    @property
    def layer(self) -> int | None: ...
    @property
    def processing(self) -> Mapping[str, bool]: ...
    @property
    def n_heads(self) -> int: ...
    def of_heads(self, heads: Sequence[int]) -> "MeasuredWalk": ...


class Memo:
    """What the measurements of one walk share between calls, held by the walk's owner.

    `tl_connwalk.walk.ConnectionWalk` keeps one per walk and passes it to
    `tl_connwalk.walk.residual.laplacian_residual` and
    `tl_connwalk.walk.residual.isometry_defects`: calls with other options (``exclude_sink``,
    ``mass_share``, ``mu``, ``exact``) then reuse the unit-scaled weights, their Gram tensors,
    the message Grams and the random draws. An in-place edit of the walk's field or weights
    is noticed (``Tensor._version``) and the terms are made again.
    """

    def __init__(self) -> None:
        self._terms: _LayerTerms | None = None

    def terms(self, walk: MeasuredWalk) -> "_LayerTerms":
        """The walk's `_LayerTerms`, made on first use and again after an in-place edit."""
        return Memo.terms_of([walk], [self])[0]

    @staticmethod
    def terms_of(walks: Sequence[MeasuredWalk], memos: Sequence["Memo"]) -> list["_LayerTerms"]:
        """Each walk's `terms` from its memo, those to make made together: the unit scales of
        all their fields and weights (`_unit_scaled`) are read off the device at once
        (`tl_connwalk.core.checks.abs_maxes`), not one synchronisation per tensor."""
        made = [
            (walk, memo)
            for walk, memo in zip(walks, memos, strict=True)
            if memo._terms is None or memo._terms.versions != _versions(walk)
        ]
        peaks = abs_maxes([tensor for walk, _ in made for tensor in _scaled_inputs(walk)])
        for index, (walk, memo) in enumerate(made):
            memo._terms = _LayerTerms(walk, peaks[3 * index : 3 * index + 3])
        return [memo._terms for memo in memos if memo._terms is not None]

    def clear(self) -> None:
        """Forget the terms (they are made again on the next call)."""
        self._terms = None


class _LayerTerms:
    """What the measurements need of a walk's weights and field alone, each computed on first
    use and kept in the walk's `Memo`: calls with other options (``exclude_sink``,
    ``mass_share``, ``mu``, ``exact``; the report measures every layer with and without the
    sink) share them.

    ``field``, ``W_V``, ``W_O`` are unit-scaled (`_unit_scaled`; ``factor`` undoes it for the
    common scale); ``heads`` are their `HeadGrams` (from the store shared by every walk,
    `tl_connwalk.core.caches.head_grams`); ``layer_draws`` and ``draw_message_grams`` are
    memoised per ``(n_draws, seed)``.
    """

    def __init__(self, walk: MeasuredWalk, peaks: Sequence[float]) -> None:
        """``peaks``: ``max |t|`` of the walk's field, ``W_V`` and ``W_O`` (`_scaled_inputs`)."""
        self.versions = _versions(walk)
        (self.field, _), (self.W_V, v_factor), (self.W_O, o_factor) = (
            _unit_scaled(tensor, peak, name, walk.layer)
            for tensor, peak, name in zip(
                _scaled_inputs(walk), peaks, ("field", "W_V", "W_O"), strict=True
            )
        )
        self.factor = v_factor * o_factor
        self.kv_heads = walk.kv_heads
        self.positions = walk.attention_mask
        self.rank = isometry.effective_rank(self.W_V, self.W_O, walk.kv_heads)
        self._draws: dict[tuple[int, int], LayerDraws] = {}
        self._draw_grams: dict[tuple[int, int], Tensor] = {}
        self._message_grams: Tensor | None = None

    @functools.cached_property
    def heads(self) -> HeadGrams:
        """``K2``, folded ``K4``, head norms and defects: computed once per set of weights."""
        return head_grams(self.W_V, self.W_O)

    @property
    def message_grams(self) -> Tensor:
        """`field_defect.message_grams` of the field (made on first use)."""
        if self._message_grams is None:
            self._message_grams = field_defect.message_grams(
                self.field, self.W_V, self.W_O, out_rows=self.heads.out_rows
            )
        return self._message_grams

    @staticmethod
    def stack_message_grams(
        terms: Sequence["_LayerTerms"],
        n_draws: int,
        seed: int,
        baseline_edges: int | None = None,
    ) -> None:
        """Make the message Grams of each walk's field and of its ``(n_draws, seed)`` draws
        that ``terms`` lack, stacked over the walks of one head shape, dtype and field shape
        (`field_defect.stacked_message_grams`,
        `tl_connwalk.core.caches.stacked_draw_message_grams`): one batched product per block
        of keys for every head of all of them, after the draws they lack
        (`stack_layer_draws`). Walks whose baselines take a sample of edges
        (``baseline_edges``, `tl_connwalk.core._fast.sampled.samples`) need no draws' Grams
        of every key: they get none here. Padded walks are left to `message_grams` and
        `draw_message_grams`, one walk at a time; so are the fields' own Grams of heads too
        wide to keep their output-Gram rows (their draws' are stacked).
        """
        _LayerTerms.stack_layer_draws(terms, n_draws, seed)
        groups: dict[tuple[object, ...], list[_LayerTerms]] = {}
        for term in terms:
            if term.positions is None:
                shapes = (
                    term.field.shape, term.field.dtype, term.W_V.shape, term.W_O.shape,
                    term.W_V.dtype, term.W_V.device, term.kv_heads,
                )  # fmt: skip
                groups.setdefault(shapes, []).append(term)
        for group in groups.values():
            if len(group) < 2:
                continue
            own = [
                term
                for term in group
                if term._message_grams is None and term.heads.out_rows is not None
            ]
            if own:
                out_rows = [term.heads.out_rows for term in own]
                grams = field_defect.stacked_message_grams(
                    torch.stack([term.field for term in own]),
                    torch.stack([term.W_V.permute(1, 0, 2) for term in own]).flatten(2),
                    own[0].W_V.shape[0],
                    torch.stack([rows for rows in out_rows if rows is not None]),
                )
                for term, gram in zip(own, grams, strict=True):
                    term._message_grams = gram
            key = (n_draws, seed)
            n_keys = group[0].field.shape[1]
            if sampled.samples(n_keys, n_keys, baseline_edges):
                continue
            drawn = [term for term in group if key not in term._draw_grams]
            if drawn:
                grams = stacked_draw_message_grams(
                    [term.layer_draws(n_draws, seed) for term in drawn],
                    torch.stack([term.field for term in drawn]),
                )
                for term, gram in zip(drawn, grams, strict=True):
                    term._draw_grams[key] = gram

    @staticmethod
    def stack_layer_draws(terms: Sequence["_LayerTerms"], n_draws: int, seed: int) -> None:
        """Make the ``(n_draws, seed)`` `layer_draws` that ``terms`` lack, those of heads of
        one shape, dtype and device together (`tl_connwalk.core.caches.stacked_layer_draws`)."""
        key = (n_draws, seed)
        groups: dict[tuple[object, ...], list[_LayerTerms]] = {}
        for term in terms:
            if key not in term._draws:
                shapes = (
                    term.W_V.shape, term.W_O.shape, term.W_V.dtype, term.W_V.device,
                    term.kv_heads,
                )  # fmt: skip
                groups.setdefault(shapes, []).append(term)
        for group in groups.values():
            first = group[0]
            made = stacked_layer_draws(
                first.W_V, first.W_O, torch.stack([term.heads.norms_sq for term in group]),
                n_draws, seed, kv_heads=first.kv_heads,
            )  # fmt: skip
            for term, draws in zip(group, made, strict=True):
                term._draws[key] = draws

    def layer_draws(self, n_draws: int, seed: int) -> LayerDraws:
        """`tl_connwalk.core.caches.layer_draws` of the (unit-scaled) weights."""
        key = (n_draws, seed)
        if key not in self._draws:
            self._draws[key] = layer_draws(
                self.W_V, self.W_O, n_draws, seed, norms_sq=self.heads.norms_sq,
                kv_heads=self.kv_heads,
            )  # fmt: skip
        return self._draws[key]

    def draw_message_grams(self, n_draws: int, seed: int) -> Float[Tensor, "draw batch key a b"]:
        """`LayerDraws.message_grams` of the field.

        In a padded batch each sequence's real keys are drawn for as a sequence of their
        length (the field draws depend on it), one call per length: a sequence's field
        baseline is then the one it has alone. Padding keys get zero Grams (no edge reads
        them).
        """
        key = (n_draws, seed)
        if key not in self._draw_grams:
            rand = self.layer_draws(n_draws, seed)
            positions = self.positions
            if positions is None:
                self._draw_grams[key] = rand.message_grams(self.field)
            else:
                self._draw_grams[key] = self._per_length(rand, positions)
        return self._draw_grams[key]

    def _per_length(self, rand: LayerDraws, positions: Tensor) -> Tensor:
        n_draws, n_heads = rand.scales.shape
        grams = self.field.new_zeros(n_draws, *self.field.shape[:2], n_heads, n_heads)
        lengths = positions.sum(-1)
        for length in lengths.unique().tolist():
            seqs = (lengths == length).nonzero().flatten()
            keys = positions[seqs].nonzero()[:, 1].view(len(seqs), int(length))
            rows = seqs[:, None].expand_as(keys)
            grams[:, rows, keys] = rand.message_grams(self.field[rows, keys])
        return grams


def _versions(walk: MeasuredWalk) -> tuple[int, ...]:
    """In-place edits of a walk's field or weights bump these (``Tensor._version``; -1 for an
    inference tensor, which keeps no counter and cannot be edited outside inference mode)."""
    return tuple(-1 if t.is_inference() else t._version for t in (walk.field, walk.W_V, walk.W_O))


def _scaled_inputs(walk: MeasuredWalk) -> tuple[Tensor, Tensor, Tensor]:
    """What `_LayerTerms` unit-scales: the walk's field, ``W_V`` and ``W_O``."""
    return walk.field, walk.W_V, walk.W_O


def _unit_scaled(tensor: Tensor, peak: float, name: str, layer: int | None) -> tuple[Tensor, float]:
    """``(c t, c)`` with ``c`` the power of two that brings ``peak = max |t|`` nearest to 1.

    Every defect is invariant under scaling the field and the transports (spec §3), but the
    closed forms raise transport norms to the fourth power, which leaves float32's range for
    ``||T||_F`` beyond about 1e9 or below 1e-9. A power of two rescales without rounding
    error (the defects agree with the unscaled ones to the last bit or so); inputs whose
    ``max |t|`` lies in ``[2^-8, 2^8]`` are used as they are, without a copy. A non-finite
    ``peak`` is an error naming the input (``name``, of layer ``layer``).
    """
    if not math.isfinite(peak):
        where = "the walk's" if layer is None else f"layer {layer}'s"
        raise ConnWalkError(
            f"{where} {name} {tuple(tensor.shape)} has non-finite entries (NaN or Inf); check "
            "the model's weights and the cached activations."
        )
    if peak == 0.0 or 2.0**-8 <= peak <= 2.0**8:
        return tensor, 1.0
    factor = 2.0 ** -round(math.log2(peak))
    return tensor * factor, factor
