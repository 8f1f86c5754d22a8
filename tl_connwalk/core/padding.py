"""Which positions of a padded batch are real tokens, and which edges a measurement keeps.

Pure functions on tensors. A batch of sequences of different lengths is padded (on the right,
TransformerLens's default, or on the left); every per-sequence measurement must read only the
sequence's real tokens, as if it had run alone. Padding is told apart in two ways:

- from an ``attention_mask`` ``[batch, pos]`` (1: real token, 0: padding), the one given to
  ``run_with_cache``; checked against the walk (no real query may attend to a padding key);
- from the walk alone (`detect_padding`): padding keys are those no real query attends to.
  On the right they are keys that no query attends to at all (a zero column of the walk);
  on the left the leading keys ``0..p-1`` that no later query attends to (Hugging Face
  models, whose padding queries attend nowhere real, give those queries a uniform row over
  every key; TransformerLens's own models a zero row).

Padding is then one edge mask like any other (`real_edges`): a measurement keeps the edges
between real positions, and a user's edge mask (`resolve_edges`) is intersected with it.
"""

import inspect
from collections.abc import Callable, Sequence

import torch
from einops import rearrange, reduce
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_connwalk.errors import ConnWalkError

#: An edge mask: ``[batch, query, key]`` booleans, or a function of the query and key token
#: positions (``[batch, query, 1]`` and ``[batch, 1, key]``, counted from each sequence's
#: first real token) returning booleans that broadcast to ``[batch, query, key]``. Annotated
#: as a plain tensor so that runtime type checkers leave the check to `resolve_edges`.
EdgeMask = Tensor | Callable[[Tensor, Tensor], Tensor]


def detect_padding(walk: Float[Tensor, "batch query key"]) -> Bool[Tensor, "batch pos"] | None:
    """The real positions of each sequence of ``walk``, or ``None`` where nothing is padding.

    Left padding: the longest prefix ``0..p-1`` (``p < n``) of keys that no query at or after
    ``p`` attends to, whose own queries attend nowhere or past it. Right padding: the trailing
    keys no query attends to (zero columns). Any other key that no query attends to cannot be
    told from a masked token: a ConnWalkError asks for the ``attention_mask``. ``W_ij = 0``
    exactly when every head's pattern is 0 there, so the walk alone decides. ``O(batch n^2)``.

    >>> W = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.5, 0.5]]])
    >>> detect_padding(W)  # one left pad
    tensor([[False,  True,  True]])
    """
    if walk.ndim != 3 or walk.shape[1] != walk.shape[2]:
        raise ConnWalkError(f"walk must be [batch, query, key], got {tuple(walk.shape)}.")
    real, unattended = _real_and_unattended(walk)
    if not bool(real.any(-1).all()):
        b = int((~real.any(-1)).nonzero()[0])
        raise ConnWalkError(
            f"sequence {b} of the batch has no position that a real token attends to: cannot "
            "tell its padding; pass the attention_mask the model ran with."
        )
    stray = unattended & real
    if bool(stray.any()):
        b, j = (int(v) for v in stray.nonzero()[0])
        raise ConnWalkError(
            f"key {j} of sequence {b} receives no attention from any query in any head, but it "
            "is not at either end of the sequence, so it is not padding and cannot be told "
            "from a masked token; pass the attention_mask the model ran with (all ones if "
            "every position is a real token)."
        )
    return None if bool(real.all()) else real


def _real_and_unattended(
    walk: Float[Tensor, "batch query key"],
) -> tuple[Bool[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
    """The positions `detect_padding` takes for real tokens, and the keys no query attends to
    (every real one among them is an error there), before any check."""
    n_pos = walk.shape[-1]
    present = walk > 0
    index = torch.arange(n_pos, device=walk.device)
    # the last query that attends to each key and the last key each query attends to (-1:
    # none), from the first True of the flipped axis: no [batch, n, n] integer tensor
    last_query = _last_true(present, 1)
    last_key = _last_true(present, 2)
    # a prefix 0..p-1 is left padding when none of its keys is attended to from p on, and
    # each of its queries attends nowhere or past it (a uniform row): a prefix whose queries
    # attend only among themselves is a closed block of tokens, not padding
    reach = last_query.cummax(dim=-1).values  # [b, p-1]: the latest query into keys 0..p-1
    nearest = torch.where(last_key < 0, n_pos, last_key).cummin(dim=-1).values
    prefix_ok = (reach <= index[None, :]) & (nearest > index[None, :])
    prefix_ok[:, -1] = False  # not every position
    length = torch.where(prefix_ok, index[None, :] + 1, 0)
    left = reduce(length, "batch pos -> batch", "max")
    unattended = last_query < 0
    # trailing run of unattended keys: right padding
    trailing = unattended.flip(-1).to(torch.int64).cumprod(-1).flip(-1).bool()
    real = (index[None, :] >= left[:, None]) & ~trailing
    return real, unattended


def _last_true(present: Tensor, axis: int) -> Tensor:
    """Per line of ``present`` along ``axis`` (1: queries, 2: keys), the last True index or -1."""
    n_pos = present.shape[axis]
    first_from_end = present.flip(axis).to(torch.uint8).argmax(axis)
    return torch.where(present.any(axis), n_pos - 1 - first_from_end, -1)


def checked_mask(
    walk: Float[Tensor, "batch query key"], attention_mask: Tensor
) -> Bool[Tensor, "batch pos"] | None:
    """``attention_mask`` ``[batch, pos]`` (nonzero: real token) as booleans on the walk's
    device, ``None`` if every position is real; a ConnWalkError where it does not fit the walk.

    It fits when its shape is the walk's ``[batch, pos]``, every sequence has a real token,
    and no real query attends to a position it calls padding (a cache run with another mask).

    >>> W = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> checked_mask(W, torch.tensor([[0, 1]]))
    tensor([[False,  True]])
    """
    _check_mask_shape(attention_mask, walk.shape)
    real = attention_mask.to(walk.device) != 0
    if not bool(real.any(-1).all()):
        b = int((~real.any(-1)).nonzero()[0])
        raise ConnWalkError(f"attention_mask has no real position in sequence {b}.")
    leaks = (walk > 0) & real[:, :, None] & ~real[:, None, :]
    if bool(leaks.any()):
        b, i, j = (int(v) for v in leaks.nonzero()[0])
        raise ConnWalkError(
            f"attention_mask calls position {j} of sequence {b} padding, but the real query {i} "
            "attends to it: the cache was made with another mask. Pass the attention_mask "
            "the model ran with."
        )
    return None if bool(real.all()) else real


def _check_mask_shape(attention_mask: object, shape: torch.Size) -> None:
    """A ConnWalkError unless ``attention_mask`` is a tensor of the walk's ``[batch, pos]``
    holding only 1 (or True: a real token) and 0 (padding)."""
    if not isinstance(attention_mask, Tensor):
        raise ConnWalkError(
            f"attention_mask must be a [batch, pos] tensor, got {type(attention_mask).__name__}."
        )
    if tuple(attention_mask.shape) != tuple(shape[:2]):
        raise ConnWalkError(
            f"attention_mask {tuple(attention_mask.shape)} must be [batch, pos] = "
            f"{tuple(shape[:2])}, the batch and positions of the cache."
        )
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ConnWalkError(
            "attention_mask must hold 1 (or True) on real tokens and 0 on padding, got other "
            f"values ({attention_mask.dtype})."
        )


def real_edges(positions: Bool[Tensor, "batch pos"]) -> Bool[Tensor, "batch query key"]:
    """The edges between real positions, ``real_i and real_j``.

    >>> real_edges(torch.tensor([[True, False]]))
    tensor([[[ True, False],
             [False, False]]])
    """
    return rearrange(positions, "batch query -> batch query 1") & rearrange(
        positions, "batch key -> batch 1 key"
    )


def first_real(positions: Bool[Tensor, "batch pos"]) -> Int[Tensor, " batch"]:
    """Each sequence's first real position (its sink when it starts with BOS).

    >>> first_real(torch.tensor([[False, True, True], [True, True, False]]))
    tensor([1, 0])
    """
    return positions.to(torch.int64).argmax(-1)


def token_positions(
    positions: Bool[Tensor, "batch pos"] | None, batch: int, n_pos: int, device: torch.device
) -> Int[Tensor, "batch pos"]:
    """Each position counted from its sequence's first real token (padding on the left gets
    negative numbers), as TransformerLens numbers the tokens of a left-padded sequence.

    >>> token_positions(torch.tensor([[False, True, True]]), 1, 3, torch.device("cpu"))
    tensor([[-1,  0,  1]])
    """
    index = torch.arange(n_pos, device=device).expand(batch, n_pos)
    if positions is None:
        return index
    return index - first_real(positions.to(device))[:, None]


def resolve_edges(
    edges: EdgeMask,
    positions: Bool[Tensor, "batch pos"] | None,
    shape: torch.Size,
    device: torch.device,
) -> Bool[Tensor, "batch query key"]:
    """An edge mask as ``[batch, query, key]`` booleans of ``shape`` on ``device``.

    A callable gets the query and key token positions (`token_positions`) as
    ``[batch, query, 1]`` and ``[batch, 1, key]``; e.g. ``lambda q, k: k == q - 1`` keeps the
    previous-token edges, ``lambda q, k: k > 0`` drops the first token.

    >>> resolve_edges(lambda q, k: k == q, None, torch.Size([1, 2, 2]), torch.device("cpu"))
    tensor([[[ True, False],
             [False,  True]]])
    """
    batch, n_query, n_key = shape
    if callable(edges) and not isinstance(edges, Tensor):
        pos = token_positions(positions, batch, n_key, device)
        _check_edge_function(edges)
        mask = edges(pos[:, :, None], pos[:, None, :])
        if not isinstance(mask, Tensor):
            raise ConnWalkError(
                f"an edge-mask function must return a boolean tensor, got {type(mask).__name__}."
            )
        try:
            return mask.to(device=device, dtype=torch.bool).expand(batch, n_query, n_key)
        except RuntimeError as error:
            raise ConnWalkError(
                f"the edge-mask function returned {tuple(mask.shape)}, which does not broadcast "
                f"to [batch, query, key] = {tuple(shape)}."
            ) from error
    if not isinstance(edges, Tensor) or edges.dtype != torch.bool:
        raise ConnWalkError(
            "edges must be a [batch, query, key] bool tensor or a function of (query, key) "
            f"positions, got {type(edges).__name__}"
            + (f" of {edges.dtype}" if isinstance(edges, Tensor) else "")
            + "."
        )
    if tuple(edges.shape) != tuple(shape):
        raise ConnWalkError(
            f"edges {tuple(edges.shape)} must be [batch, query, key] = {tuple(shape)}, the walk's."
        )
    return edges.to(device)


def _check_edge_function(edges: Callable[..., object]) -> None:
    """A ConnWalkError unless ``edges`` can be called with two positional arguments (the query
    and key positions); a callable whose signature cannot be read is called as it is."""
    try:
        signature = inspect.signature(edges)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConnWalkError(
            f"an edge-mask function takes the query and key positions, edges(q, k) (e.g. "
            f"lambda q, k: k == q - 1), but {edges!r} takes {signature}."
        ) from None


def scope(
    positions: Bool[Tensor, "batch pos"] | None,
    edges: EdgeMask | None,
    exclude_sink: bool,
    shape: torch.Size,
    device: torch.device,
) -> tuple[Bool[Tensor, "batch query key"] | None, bool]:
    """The edges a walk-weighted summary keeps, as ``(mask, exclude_sink)`` for the core.

    One mask for everything that restricts a summary: the edges between real positions
    (`real_edges`), the user's ``edges`` (`resolve_edges`), and with ``exclude_sink`` every
    sequence's first real key (key 0 unless left-padded). With none of them, or a mask that
    keeps every edge, ``(None, exclude_sink)``: the core's unrestricted path, unchanged.

    >>> mask, flag = scope(torch.tensor([[False, True, True]]), None, True,
    ...                    torch.Size([1, 3, 3]), torch.device("cpu"))
    >>> mask[0].int(), flag
    (tensor([[0, 0, 0],
            [0, 0, 1],
            [0, 0, 1]], dtype=torch.int32), False)
    """
    mask = None if positions is None else real_edges(positions.to(device))
    if edges is not None:
        given = resolve_edges(edges, positions, shape, device)
        if positions is not None or not bool(given.all()):
            mask = given if mask is None else mask & given
    if mask is None:
        return None, exclude_sink
    if exclude_sink:
        sink = torch.zeros(shape[0], dtype=torch.int64, device=device)
        if positions is not None:
            sink = first_real(positions.to(device))
        keys = torch.arange(shape[-1], device=device)
        mask = mask & rearrange(keys[None, :] != sink[:, None], "batch key -> batch 1 key")
    return mask, False


def positions_of(
    walk: Float[Tensor, "batch query key"], attention_mask: Tensor | None
) -> Bool[Tensor, "batch pos"] | None:
    """The real positions: `checked_mask` of a given ``attention_mask``, else `detect_padding`."""
    if walk.is_meta:  # an offloaded layer holds no values to read padding from
        if attention_mask is None:
            return None
        return (attention_mask != 0).to(walk.device)
    if attention_mask is None:
        return detect_padding(walk)
    return checked_mask(walk, attention_mask)


def positions_of_walks(
    walks: Sequence[Float[Tensor, "batch query key"]], attention_mask: Tensor | None
) -> list[Bool[Tensor, "batch pos"] | None]:
    """`positions_of` of each of several walks of one shape (the layers of one cache), read
    in one pass over all of them with one synchronisation; where a walk's padding is in
    error, the ConnWalkError of `positions_of` on that walk (the first such walk's).
    ``O(len(walks) batch n^2)``.

    >>> left_pad = torch.tensor([[[0.0, 0.0], [0.0, 1.0]]])
    >>> positions_of_walks([left_pad, torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])], None)
    [tensor([[False,  True]]), None]
    """
    if not walks:
        return []
    shape = walks[0].shape
    if any(w.shape != shape for w in walks):
        raise ConnWalkError(
            "walks must share one [batch, query, key] shape, got "
            f"{sorted({tuple(w.shape) for w in walks})}."
        )
    # one walk, offloaded walks, walks on several devices (a model split over devices), or a
    # shape `positions_of` rejects: walk by walk
    several_devices = len({w.device for w in walks}) > 1
    not_square = len(shape) != 3 or shape[1] != shape[2]
    if len(walks) == 1 or several_devices or not_square or any(w.is_meta for w in walks):
        return [positions_of(walk, attention_mask) for walk in walks]
    n_walks, batch = len(walks), shape[0]
    stacked = torch.cat(list(walks))  # [walk batch, query, key]
    if attention_mask is None:
        real, unattended = _real_and_unattended(stacked)
        bad = (~real.any(-1) | (unattended & real).any(-1)).view(n_walks, batch).any(-1)
        all_real = real.view(n_walks, -1).all(-1)
        per_walk = real.split(batch)
    else:
        _check_mask_shape(attention_mask, shape)
        given = attention_mask.to(stacked.device) != 0
        outside = given[:, :, None] & ~given[:, None, :]  # a real query to a padding key
        leaks = (stacked.view(n_walks, *shape) > 0) & outside
        bad = leaks.flatten(1).any(-1) | ~given.any(-1).all()
        all_real = given.all().expand(n_walks)
        per_walk = (given,) * n_walks
    flags = torch.cat([bad, all_real]).tolist()
    for walk, failed in zip(walks, flags[:n_walks], strict=True):
        if failed:
            positions_of(walk, attention_mask)  # raises this walk's error
    return [None if flags[n_walks + k] else positions for k, positions in enumerate(per_walk)]
