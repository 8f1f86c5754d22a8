"""Random-baseline draws shared by every layer of one shape (spec §3, "random baseline").

`tl_connwalk.core.isometry.random_head_factors` draws Gaussian factors ``R_V, R_O`` and gives
head ``h`` of both the factor ``sqrt(s_h)``, ``s_h = ||T^h||_F / ||R^h||_F`` with
``R^h = R_V^h R_O^h`` (`isometry.draw_scales`): the drawn transport is ``s_h R^h``. With one
integer seed, every layer whose heads have the same shapes draws the same ``R_V, R_O``; only
``s`` depends on the layer. So what the Gram defects need of a draw is computed once per shape
and seed (`raw_draws`, cached), and a layer's draw is a rescaling of it (`layer_draws`)::

    K2'[a,b]        = s_a s_b K2_R[a,b]
    fold(K4')[p,q]  = s_p s_q fold(K4_R)[p,q],    s_p = s_a s_c for the head pair p = {a, c}
    delta(s_h R^h)  = delta(R^h)                  (0 where s_h = 0: a zero head stays 0)
    G'_j[a,b]       = s_a s_b G_R,j[a,b]          (message Grams, `field_defect.message_grams`)

These are the values of `isometry.random_baselines` with the same seed, up to rounding.
Grouped-query layers (``kv_heads``, `tl_connwalk.core.value_heads`) draw one ``R_V`` per
value head, shared by the query heads that read it as the model shares its own
(`isometry.gaussian_factors`); ``s_h`` then scales ``R_O^h`` alone.

The data-dependent field defect needs each layer's field ``X`` (``n`` keys of a sequence)
through a draw's values ``X R_V``, ``O(n d_model H d_head)`` per draw. For ``n < d_model``
it takes them in distribution instead (`LayerDraws.message_grams`): with ``X = L Q^T``
(``L L^T = X X^T`` lower triangular, ``Q`` ``[d_model, n]`` orthonormal) and ``Q_perp``
completing ``Q``, a standard Gaussian ``Z`` is ``Q Y + Q_perp Y_perp`` with ``Y``,
``Y_perp`` standard Gaussian, so ``X Z = L Y``, and head ``h``'s norm
``||Z^h R_O^h||_F^2 = <Y^h^T Y^h + Y_perp^h^T Y_perp^h, R_O^h R_O^h^T>`` needs only those
two ``d_head x d_head`` Grams (``Z``, ``Y``, ``Y_perp`` one block per value head, read by the
query heads that share it: ``Y^{kv(h)}`` above). ``Y`` and the Grams are drawn once per
``n`` and seed (`key_draws`, shared by every layer and sequence), ``L`` once per layer and
sequence (`key_factor`): the draw's values cost ``O(n^2 H d_head)``. These field draws are new
Gaussian value factors, not the ``R_V`` of the weight-only defects' draws: the same
distribution, other realisations, and one per sequence (each sequence's field baseline is
the same alone or in a batch).
"""

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence

import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float
from torch import Tensor

from tl_connwalk.core import checks, field_defect, isometry, value_heads
from tl_connwalk.core._fast import chunks, disk, head_grams, messages, quartic
from tl_connwalk.core._fast.lru import memoized
from tl_connwalk.core.value_heads import KVHeads
from tl_connwalk.errors import ConnWalkError

#: The field draws take the keys' route (`key_factor`) when its products,
#: ``n^2 (d_model + n_draws H d_head)`` for ``n`` keys per sequence, cost at most this share
#: of the direct ones, ``n_draws n d_model H d_head``: GPT-2 small with two draws up to 409
#: keys, a Llama-3-8B layer up to 2184.
KEY_ROUTE_SHARE = 0.8
#: Most bytes of output-Gram rows (`head_grams.HeadGrams.out_rows`) the raw draws of one shape
#: keep; the cache holds two shapes.
OUT_ROWS_BYTES = 2**29


@dataclasses.dataclass(frozen=True)
class RawDraws:
    """The ``n_draws`` raw draws of one seed for heads of one shape, dtype and device.

    ``grams`` holds every draw's `head_grams.HeadGrams`, stacked (each tensor ``[draw,
    ...]``: the layers' measurements take all draws in one batched product); ``draws`` gives
    them one by one. ``kept`` holds the factors themselves when all of them fit the chunk
    budget (`chunks.chunk_entries`; GPT-2 small: 8 draws are 9.4M); otherwise `factors` draws them
    again from the seed (the same numbers) instead of holding them.
    """

    v_shape: torch.Size
    o_shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    seed: int
    grams: head_grams.HeadGrams
    kept: tuple[tuple[Tensor, Tensor], ...] | None
    kv_heads: KVHeads | None = None

    @property
    def draws(self) -> tuple[head_grams.HeadGrams, ...]:
        """Each draw's `head_grams.HeadGrams` (views of ``grams``)."""
        g, rows = self.grams, self.grams.out_rows
        return tuple(
            head_grams.HeadGrams(
                g.norms_sq[d],
                g.K2[d],
                g.pair_gram[d],
                g.head_defects[d],
                None if rows is None else rows[d],
            )
            for d in range(g.norms_sq.shape[0])
        )

    def factors(self) -> Iterator[tuple[Tensor, Tensor]]:
        """``(R_V, R_O)`` of every draw, in order."""
        if self.kept is not None:
            yield from self.kept
            return
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        for _ in self.draws:
            yield isometry.gaussian_factors(
                self.v_shape, self.o_shape, self.dtype, self.device, generator, self.kv_heads
            )


@memoized("core.draws.raw_draws", maxsize=2)
def raw_draws(
    v_shape: torch.Size,
    o_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    n_draws: int,
    kv_heads: KVHeads | None = None,
) -> RawDraws:
    """The raw draws of `isometry.random_baselines` (integer ``seed``, the same ``kv_heads``),
    with their Grams.

    Cached for the last two shapes: a model's layers share them. Costs, once,
    ``n_draws`` times one layer's `isometry.gram_matrices` and head defects. Each draw keeps
    half its output Gram's blocks (`head_grams.HeadGrams.out_rows`, what spares
    `field_defect.message_grams` the messages) at any width while all draws' rows together
    fit ``OUT_ROWS_BYTES`` (a Llama-3-8B shape: 34 MiB per draw, 272 MiB for 8 draws).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    keep = n_draws * (v_shape.numel() + o_shape.numel()) <= chunks.chunk_entries(device)
    row_bytes = field_defect.output_gram_rows_numel(v_shape[0], v_shape[2]) * dtype.itemsize
    out_rows = n_draws * row_bytes <= OUT_ROWS_BYTES
    disk_key = (
        f"{tuple(v_shape)} {tuple(o_shape)} {dtype} {device} {seed} {n_draws} {kv_heads} {out_rows}"
    )
    saved = disk.load("draws", disk_key)
    if saved is not None:  # made by an earlier process: the factors drawn again, if kept
        kept = [
            (_values_major(R_V), R_O)
            for R_V, R_O in (
                isometry.gaussian_factors(v_shape, o_shape, dtype, device, generator, kv_heads)
                for _ in range(n_draws if keep else 0)
            )
        ]
        return RawDraws(
            v_shape, o_shape, dtype, device, seed, head_grams.from_tensors(saved, device),
            tuple(kept) if keep else None, kv_heads,
        )  # fmt: skip
    draws, kept = [], []
    rows = None  # every draw's output-Gram rows, filled draw by draw (no second copy)
    for d in range(n_draws):
        R_V, R_O = isometry.gaussian_factors(v_shape, o_shape, dtype, device, generator, kv_heads)
        # not in the head-Gram store: this cache holds them
        grams = head_grams.compute_head_grams(R_V, R_O, out_rows=out_rows)
        if grams.out_rows is not None:
            if rows is None:
                rows = grams.out_rows.new_empty(n_draws, *grams.out_rows.shape)
            rows[d] = grams.out_rows
            grams = dataclasses.replace(grams, out_rows=None)
        draws.append(grams)
        if keep:  # R_V laid out as W_V^cat [d_model, head d_head], what message Grams multiply
            kept.append((_values_major(R_V), R_O))
        del R_V, R_O  # before the next draw: one draw's factors alive at a time
    stacked = head_grams.HeadGrams(
        norms_sq=torch.stack([d.norms_sq for d in draws]),
        K2=torch.stack([d.K2 for d in draws]),
        pair_gram=torch.stack([d.pair_gram for d in draws]),
        head_defects=torch.stack([d.head_defects for d in draws]),
        out_rows=rows,
    )
    disk.save("draws", disk_key, head_grams.to_tensors(stacked))
    return RawDraws(
        v_shape, o_shape, dtype, device, seed, stacked, tuple(kept) if keep else None, kv_heads
    )


def _sharing(kv_heads: KVHeads | None) -> tuple[KVHeads, ...]:
    """``kv_heads`` as the trailing argument of the cached `raw_draws` and `key_draws`, or no
    argument without sharing: a call that names no ``kv_heads`` hits the same cache entry."""
    return () if kv_heads is None else (kv_heads,)


def _values_major(W_V: Tensor) -> Tensor:
    """``W_V`` ``[head, d_model, d_head]`` over storage laid out as ``W_V^cat = [d_model, head
    d_head]``: the same values, and `field_defect.message_grams` reads ``W_V^cat`` without a
    copy (1.4 ms per GPT-2-small call, twice per layer with two draws)."""
    return (
        rearrange(W_V, "head d_model d_head -> d_model head d_head").contiguous().permute(1, 0, 2)
    )


def key_factor(
    field: Float[Tensor, "batch key d_model"], n_draws: int, width: int
) -> tuple[Float[Tensor, "batch key key"], Bool[Tensor, " batch"]] | None:
    """Per sequence, lower-triangular ``L`` with ``L L^T = X X^T`` for its keys ``X``, and
    whether its factorisation succeeded; ``None`` where the keys' route does not pay.

    ``None`` when ``n^2 (d_model + n_draws width)`` exceeds ``KEY_ROUTE_SHARE`` of
    ``n_draws n d_model width`` (``n`` keys per sequence, ``width = H d_head``: the draws'
    value columns). The Cholesky factorisation (in float64) fails for a sequence with a zero
    key or more keys than ``d_model``: that sequence's field draws multiply ``X R_V``
    directly. The route needs no more than ``L L^T = X X^T`` and ``n <= d_model``: then
    ``X = L Q^T`` with orthonormal ``Q`` even where ``X`` has less than full rank (a repeated
    key that the factorisation passes with a pivot at rounding level).

    >>> factor, factored = key_factor(torch.randn(2, 4, 64), n_draws=2, width=64)
    >>> factor.shape, factored
    (torch.Size([2, 4, 4]), tensor([True, True]))
    >>> key_factor(torch.zeros(1, 4, 64), n_draws=2, width=64)[1]  # not definite
    tensor([False])
    """
    _, n_keys, d_model = field.shape
    direct = n_draws * d_model * width
    if n_keys == 0 or n_keys * (d_model + n_draws * width) > KEY_ROUTE_SHARE * direct:
        return None
    factor, info = torch.linalg.cholesky_ex((field @ field.mT).double())
    return factor.to(field.dtype), info == 0


def _key_seed(seed: int, n_keys: int, part: str) -> int:
    """A generator seed for the field draws of ``n_keys`` keys, one per ``part``."""
    digest = hashlib.blake2b(f"{seed}/{n_keys}/{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclasses.dataclass(frozen=True)
class KeyDraws:
    """The field draws of ``n_keys`` keys: what the layers' `key_factor` route shares.

    ``norms_sq[d, h]`` is ``||Z^{kv(h)} R_O^h||_F^2`` of draw ``d``'s implied Gaussian ``Z``
    (module docstring). ``kept`` holds each draw's standard Gaussian ``Y`` ``[n_keys, H
    d_head]`` (value heads expanded to the query heads that read them) when all of them fit
    the chunk budget (`chunks.chunk_entries`); otherwise `values` draws them again from their seed.
    """

    n_keys: int
    width: int
    dtype: torch.dtype
    device: torch.device
    seed: int
    norms_sq: Float[Tensor, "draw head"]
    kept: tuple[Tensor, ...] | None
    kv_heads: KVHeads | None = None

    def values(self) -> Iterator[Tensor]:
        """``Y`` of every draw, in order."""
        if self.kept is not None:
            yield from self.kept
            return
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        n_heads = self.norms_sq.shape[1]
        d_head = self.width // n_heads
        drawn = value_heads.n_value_heads(self.kv_heads, n_heads) * d_head
        for _ in range(self.norms_sq.shape[0]):
            Y = torch.randn(
                (self.n_keys, drawn), dtype=self.dtype, device=self.device, generator=generator
            )
            yield _expanded(Y, self.kv_heads, d_head)


def _expanded(values: Tensor, kv_heads: KVHeads | None, d_head: int) -> Tensor:
    """``[rows, H_kv d_head]`` value columns as ``[rows, H d_head]``: query head ``h`` gets
    value head ``kv(h)``'s block (unchanged without ``kv_heads``)."""
    blocks = rearrange(values, "rows (kv d_head) -> rows kv d_head", d_head=d_head)
    expanded = value_heads.expand_value_heads(blocks, kv_heads, dim=1)
    return rearrange(expanded, "rows head d_head -> rows (head d_head)")


@memoized("core.draws.key_draws", maxsize=2)
def key_draws(
    v_shape: torch.Size,
    o_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    n_draws: int,
    n_keys: int,
    kv_heads: KVHeads | None = None,
) -> KeyDraws:
    """The field draws of ``n_keys`` keys for heads of one shape (integer ``seed``), cached
    for the last two: every layer of a model, on prompts of one length, shares them.

    Draws ``Y`` ``[n_keys, H_kv d_head]`` and ``Y_perp`` ``[d_model - n_keys, H_kv d_head]``
    (blocks of rows at a time; ``H_kv = H`` without ``kv_heads``) from seeds of their own,
    and with the raw draws' ``R_O`` (`raw_draws`, same seed and ``kv_heads``) the implied
    heads' squared norms, once: ``O(n_draws d_model H d_head^2)``.
    """
    n_heads, d_model, d_head = v_shape
    if not 0 <= n_keys <= d_model:
        raise ConnWalkError(
            f"the field draws' route needs at most d_model = {d_model} keys, got {n_keys}."
        )
    raw = raw_draws(v_shape, o_shape, dtype, device, seed, n_draws, *_sharing(kv_heads))
    width = n_heads * d_head
    n_value = value_heads.n_value_heads(kv_heads, n_heads)
    values_seed = _key_seed(seed, n_keys, "values")
    values = torch.Generator(device=device).manual_seed(values_seed)
    perp = torch.Generator(device=device).manual_seed(_key_seed(seed, n_keys, "perp"))
    keep = n_draws * n_keys * width <= chunks.chunk_entries(device)
    norms, kept = [], []
    for (_, R_O), raw_draw in zip(raw.factors(), raw.draws, strict=True):
        Y = torch.randn((n_keys, n_value * d_head), dtype=dtype, device=device, generator=values)
        gram = einsum(*(Y.view(n_keys, n_value, d_head),) * 2, "n k p, n k q -> k p q")
        for rows in chunks.query_chunks(d_model - n_keys, width, device=device):
            block = torch.randn(
                (rows.stop - rows.start, n_value, d_head),
                dtype=dtype, device=device, generator=perp,
            )  # fmt: skip
            gram += einsum(block, block, "n k p, n k q -> k p q")
        norms.append(
            einsum(
                value_heads.expand_value_heads(gram, kv_heads),
                _output_blocks(raw_draw, R_O),
                "h p q, h p q -> h",
            )
        )
        if keep:
            kept.append(_expanded(Y, kv_heads, d_head))
    return KeyDraws(
        n_keys, width, dtype, device, values_seed, torch.stack(norms),
        tuple(kept) if keep else None, kv_heads,
    )  # fmt: skip


def _output_blocks(raw: head_grams.HeadGrams, R_O: Tensor) -> Tensor:
    """``R_O^h R_O^h^T`` ``[head, d_head, d_head]``: from the kept output-Gram rows if any."""
    n_heads, d_head, _ = R_O.shape
    if raw.out_rows is None:
        return R_O @ R_O.mT
    return messages.row_blocks(raw.out_rows, n_heads, d_head)[..., :d_head]


@dataclasses.dataclass(frozen=True)
class LayerDraws:
    """The random draws of one layer: the shared raw draws scaled to its head norms.

    ``scales[d, h]`` is ``s_h`` of draw ``d``; ``K2``, ``pair_gram`` and ``head_defects`` are the
    draws' (``[draw, ...]``), ready for `isometry.gram_defect_means` beside the layer's own.
    ``norms_sq``: the layer's ``||T^h||_F^2``, to which the field draws are scaled too.
    """

    raw: RawDraws
    scales: Float[Tensor, "draw head"]
    K2: Float[Tensor, "draw head head"]
    pair_gram: Float[Tensor, "draw pair pair"]
    head_defects: Float[Tensor, "draw head"]
    norms_sq: Float[Tensor, " head"]

    def message_grams(
        self, field: Float[Tensor, "batch key d_model"]
    ) -> Float[Tensor, "draw batch key head head"]:
        """`field_defect.message_grams` of each field draw on ``field``.

        The draw is ``T'^h = s_h R^h``, so its message Gram is that of the raw draw times
        ``s_a s_b``: no scaled copy of the factors is made (and the raw draws' ``out_rows``,
        where kept, spare their messages). The sequences that `key_factor` factors take the
        raw values ``L Y`` instead (`key_draws`, module docstring), scaled to the layer's head
        norms through the implied ``||Z^h R_O^h||_F``: every draw and every such sequence in
        one batched product where the output-Gram rows are kept. The other sequences go
        through each draw's ``R_V``, one raw draw alive at a time.
        """
        return stacked_draw_message_grams([self], field[None])[0]

    def factors(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Each draw's ``(W_V', W_O')``, as `isometry.random_head_factors` returns them."""
        for raw, scale in zip(self.raw.factors(), self.scales, strict=True):
            if self.raw.kept is not None:  # the cached draw stays as it is: scale a copy
                raw = raw[0].clone(), raw[1].clone()
            scaled = isometry.scale_factors(*raw, scale, self.raw.kv_heads)
            del raw  # one draw's factors alive at a time (2 x 64 MiB for an 8B layer)
            yield scaled
            del scaled


def _outer(scale: Tensor) -> Tensor:
    """``s_a s_b`` ``[..., head, head]`` of per-head scales ``[..., head]``."""
    return scale[..., :, None] * scale[..., None, :]


def stacked_draw_message_grams(
    layers: Sequence["LayerDraws"], field: Float[Tensor, "stack batch key d_model"]
) -> Float[Tensor, "stack draw batch key head head"]:
    """`LayerDraws.message_grams` of several layers' draws (one raw draw set: the layers'
    heads have one shape) on their fields ``field[l]``, at once.

    The layers' sequences go side by side as one batch of sequences through the raw draws
    (the keys' route or each draw's ``R_V``), each sequence then scaled to its own layer's
    head norms: the operations do not grow with the number of layers.

    >>> W_V, W_O = torch.randn(2, 16, 4), torch.randn(2, 4, 16)
    >>> a = layer_draws(W_V, W_O, n_draws=3, seed=0)
    >>> b = layer_draws(2 * W_V, W_O, n_draws=3, seed=0)
    >>> stacked_draw_message_grams([a, b], torch.randn(2, 1, 5, 16)).shape
    torch.Size([2, 3, 1, 5, 2, 2])
    """
    raw = layers[0].raw
    if len(layers) != field.shape[0] or any(layer.raw is not raw for layer in layers):
        raise ConnWalkError(
            f"{len(layers)} layers' draws for {field.shape[0]} fields: stacked draws need one "
            "field per layer and the same raw draws (heads of one shape, one seed)."
        )
    n_draws, n_heads = raw.grams.norms_sq.shape
    stack, batch = field.shape[:2]
    flat = field.flatten(0, 1)  # the layers' sequences side by side
    # each sequence's layer, whose head norms its draws take
    owner = torch.arange(stack, device=field.device).repeat_interleave(batch)
    grams = flat.new_empty(n_draws, stack * batch, field.shape[2], n_heads, n_heads)
    keys = key_factor(flat, n_draws, raw.v_shape[0] * raw.v_shape[2])
    direct: Tensor | None = None  # the sequences through R_V (None: all)
    if keys is not None:
        factor, factored = keys
        if bool(factored.any()):
            keyed = key_draws(
                raw.v_shape, raw.o_shape, raw.dtype, raw.device, raw.seed, n_draws,
                factor.shape[1], *_sharing(raw.kv_heads),
            )  # fmt: skip
            norms_sq = torch.stack([layer.norms_sq for layer in layers])
            scale = _outer(isometry.draw_scales(norms_sq[:, None], keyed.norms_sq))
            part = _keyed_grams(keyed, raw, factor[factored])
            grams[:, factored] = part * scale[owner[factored]].transpose(0, 1)[:, :, None].to(part)
        direct = ~factored
    if direct is None or bool(direct.any()):
        keys_of = flat if direct is None else flat[direct]
        scales = torch.stack([layer.scales for layer in layers])[
            owner if direct is None else owner[direct]
        ]
        for d, (R_V, R_O) in enumerate(raw.factors()):
            out_rows = None if raw.grams.out_rows is None else raw.grams.out_rows[d]
            part = field_defect.message_grams(keys_of, R_V, R_O, out_rows=out_rows)
            del R_V, R_O  # before the next draw is made
            part = part * _outer(scales[:, d])[:, None].to(part)
            if direct is None:
                grams[d] = part
            else:
                grams[d, direct] = part
    return grams.unflatten(1, (stack, batch)).transpose(0, 1)


def _keyed_grams(
    keyed: KeyDraws, raw: RawDraws, factor: Float[Tensor, "seq key key"]
) -> Float[Tensor, "draw seq key head head"]:
    """The raw message Grams of the values ``L Y`` of every draw (``Y`` from ``keyed``) for
    each factored sequence's ``L``: all draws at once through the kept output-Gram rows, else
    one draw at a time through its ``R_O``."""
    n_heads = raw.v_shape[0]
    if raw.grams.out_rows is not None:
        values = torch.stack(list(keyed.values()))
        return messages.stacked_factored_grams(factor, values, n_heads, out_rows=raw.grams.out_rows)
    parts = [
        messages.stacked_factored_grams(factor, Y[None], n_heads, W_O=R_O)[0]
        for Y, (_, R_O) in zip(keyed.values(), raw.factors(), strict=True)
    ]
    return torch.stack(parts)


def layer_draws(
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    n_draws: int,
    seed: int,
    *,
    norms_sq: Float[Tensor, " head"] | None = None,
    kv_heads: KVHeads | None = None,
) -> LayerDraws:
    """The ``n_draws`` random draws of `isometry.random_baselines` (integer ``seed``, the same
    ``kv_heads``) for a layer.

    ``norms_sq``: the layer's ``||T^h||_F^2`` when already known (e.g. from its
    `tl_connwalk.core._fast.head_grams.HeadGrams`); else computed here. ``kv_heads``: the value head
    each query head reads, for grouped-query weights (`tl_connwalk.core.value_heads`).

    >>> draws = layer_draws(torch.randn(2, 16, 4), torch.randn(2, 4, 16), n_draws=3, seed=0)
    >>> draws.K2.shape, draws.pair_gram.shape, draws.head_defects.shape
    (torch.Size([3, 2, 2]), torch.Size([3, 3, 3]), torch.Size([3, 2]))
    """
    _check_draws(n_draws, seed)
    W_V, W_O = checks.cast_heads(W_V, W_O)
    target = isometry.head_norms_sq(W_V, W_O) if norms_sq is None else norms_sq.to(W_V)
    return stacked_layer_draws(W_V, W_O, target[None], n_draws, seed, kv_heads=kv_heads)[0]


def stacked_layer_draws(
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    norms_sq: Tensor,
    n_draws: int,
    seed: int,
    *,
    kv_heads: KVHeads | None = None,
) -> list[LayerDraws]:
    """`layer_draws` of several layers whose heads have one shape (``W_V``, ``W_O``: one of
    them, for the shapes, dtype and device) and the squared head norms ``norms_sq[l]``
    (``[layer, head]``; annotated as a plain tensor so that runtime type checkers leave the
    check, and its message, to this function): one set of operations for all of them (the
    scaled Grams of every layer's draws at once).

    >>> W_V, W_O = torch.randn(2, 16, 4), torch.randn(2, 4, 16)
    >>> a, b = stacked_layer_draws(W_V, W_O, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 3, 0)
    >>> torch.equal(b.norms_sq, torch.tensor([3.0, 4.0])), a.raw is b.raw
    (True, True)
    """
    _check_draws(n_draws, seed)
    W_V, W_O = checks.cast_heads(W_V, W_O)
    if norms_sq.ndim != 2 or norms_sq.shape[1] != W_V.shape[0]:
        raise ConnWalkError(
            f"norms_sq {tuple(norms_sq.shape)} must be [layer, head] with head={W_V.shape[0]}: "
            "each layer's squared head norms ||T^h||_F^2."
        )
    kv_heads = value_heads.check_kv_heads(kv_heads, W_V.shape[0])
    raw = raw_draws(W_V.shape, W_O.shape, W_V.dtype, W_V.device, seed, n_draws, *_sharing(kv_heads))
    target = norms_sq.to(W_V)
    scales = isometry.draw_scales(target[:, None], raw.grams.norms_sq)  # [layer, draw, head]
    first, second = quartic.head_pairs(W_V.shape[0], W_V.device)
    pair_scales = scales[..., first] * scales[..., second]
    K2, pair_gram, head_defects = raw.grams.K2, raw.grams.pair_gram, raw.grams.head_defects
    K2 = K2 * scales[..., :, None] * scales[..., None, :]
    pair_gram = pair_gram * pair_scales[..., :, None] * pair_scales[..., None, :]
    head_defects = torch.where(scales > 0, head_defects, torch.zeros_like(head_defects))
    return [
        LayerDraws(raw=raw, norms_sq=norms, scales=scale, K2=k2, pair_gram=pairs, head_defects=hd)
        for norms, scale, k2, pairs, hd in zip(
            *(t.unbind() for t in (target, scales, K2, pair_gram, head_defects)), strict=True
        )
    ]


def _check_draws(n_draws: object, seed: object) -> None:
    """A ConnWalkError unless ``n_draws`` is a number of draws and ``seed`` an integer."""
    isometry.check_draws(n_draws)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConnWalkError(f"seed must be an integer, got {seed!r}.")
