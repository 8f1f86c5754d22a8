"""Checks of the math core's inputs, one home for all: each raises a `ConnWalkError` that says
what was wrong and how to fix it, or casts to the working precision (float32 or wider)."""

import cmath
import numbers
from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.errors import ConnWalkError


def working_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half precision and integers upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def is_count(value: object, least: int = 1) -> bool:
    """Whether ``value`` is an integer ``>= least`` (``True`` and ``False`` are no counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def checked_index(value: object, size: int, name: str, owner: str, units: str) -> int:
    """``value`` as an index in ``0..size-1``, negative counting from the end as in Python.

    The one rule and message for every index a user passes (layers, heads, positions): a
    ConnWalkError when ``value`` is no integer (``True`` and ``1.0`` are none) or lies outside
    ``-size..size-1``, naming ``owner``'s ``size`` ``units``.

    >>> checked_index(-1, 30, "layer", "this model", "attention layers")
    29
    >>> checked_index(30, 30, "layer", "this model", "attention layers")
    Traceback (most recent call last):
    ...
    tl_connwalk.errors.ConnWalkError: layer 30 is out of range: this model has 30 attention ...
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConnWalkError(
            f"{name} must be an int (negative counts from the end), got "
            f"{type(value).__name__} {value!r}."
        )
    index = int(value)
    if not -size <= index < size:
        valid = f"0..{size - 1}, or -{size}..-1 counted from the end" if size else "none"
        raise ConnWalkError(
            f"{name} {index} is out of range: {owner} has {size} {units} (valid: {valid})."
        )
    return index % size


def check_token_ids(tokens: Tensor, d_vocab: int) -> None:
    """A ConnWalkError unless every entry of the integer tensor ``tokens`` is an id of a
    vocabulary of ``d_vocab`` tokens, ``0..d_vocab-1`` (one reduction, one synchronisation).

    >>> check_token_ids(torch.tensor([[0, 63]]), 64)
    """
    if tokens.numel() == 0:
        return
    low, high = (int(v) for v in torch.stack(torch.aminmax(tokens)).tolist())
    if low < 0 or high >= d_vocab:
        raise ConnWalkError(
            f"token ids range over [{low}, {high}] but the model's vocabulary is "
            f"0..{d_vocab - 1}: were these tokens made by another tokenizer?"
        )


def check_optional_count(value: object, name: str, none_means: str, unit: str) -> None:
    """A ConnWalkError unless ``value`` is None (which means ``none_means``) or a positive
    integer (a number of ``unit``)."""
    if value is not None and not is_count(value):
        raise ConnWalkError(
            f"{name} must be None ({none_means}) or a positive {unit}, got {value!r}."
        )


def check_rank(rank: int, available: int | None = None, what: str = "") -> None:
    if not is_count(rank):
        raise ConnWalkError(f"rank must be a positive integer, got {rank!r}.")
    if available is not None and rank > available:
        raise ConnWalkError(
            f"rank={rank} but {what} has only {available} singular values; pass "
            f"rank <= {available} (a d x d map has at most d)."
        )


def check_heads(W_V: Tensor, W_O: Tensor) -> None:
    if W_V.ndim != 3 or W_O.ndim != 3:
        raise ConnWalkError(
            f"W_V must be [head, d_model, d_head] and W_O [head, d_head, d_model]; got "
            f"W_V {tuple(W_V.shape)}, W_O {tuple(W_O.shape)}."
        )
    if W_V.shape[0] != W_O.shape[0] or W_V.shape[1:] != W_O.shape[:0:-1]:
        raise ConnWalkError(
            f"W_V {tuple(W_V.shape)} and W_O {tuple(W_O.shape)} do not compose: need "
            "W_V [head, d_model, d_head] and W_O [head, d_head, d_model] with the same sizes."
        )


def cast_heads(W_V: Tensor, W_O: Tensor) -> tuple[Tensor, Tensor]:
    check_heads(W_V, W_O)
    dtype = working_dtype(W_V, W_O)
    return W_V.to(dtype), W_O.to(device=W_V.device, dtype=dtype)


def check_gates(gates: Tensor, n_heads: int) -> None:
    if gates.ndim != 4 or gates.shape[1] != n_heads:
        raise ConnWalkError(
            f"gates must be [batch, head, query, key] with head={n_heads} (the size of K2); "
            f"got {tuple(gates.shape)}."
        )


def check_chunk(query_chunk: int | None) -> None:
    check_optional_count(
        query_chunk, "query_chunk", "automatic, the chunk budget's numbers per chunk",
        "number of query rows",
    )  # fmt: skip


def check_tensors(**tensors: object) -> None:
    """A ConnWalkError naming the first of ``tensors`` (name=value) that is no tensor."""
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            raise ConnWalkError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")


def check_field_shape(field: object, shape: tuple[int, ...]) -> None:
    """A ConnWalkError unless ``field`` is a float tensor of ``shape``
    ``[batch, pos, d_model]`` (the walk's)."""
    if isinstance(field, Tensor):
        if field.is_floating_point() and tuple(field.shape) == tuple(shape):
            return
        got = f"{field.dtype} {tuple(field.shape)}"
    else:
        got = type(field).__name__
    raise ConnWalkError(
        f"field must be a float tensor [batch, pos, d_model] = {tuple(shape)}, the walk's; got "
        f"{got}."
    )


def cast_gates(gates: Tensor, *grams: Tensor) -> tuple[Tensor, ...]:
    dtype = working_dtype(gates, *grams)
    return tuple(t.to(device=gates.device, dtype=dtype) for t in (gates, *grams))


def check_edges(edges: Tensor, gates: Tensor) -> None:
    if edges.shape != gates.shape[:1] + gates.shape[2:]:
        raise ConnWalkError(
            f"edges {tuple(edges.shape)} must be [batch, query, key] like the gates' "
            f"{tuple(gates.shape[:1] + gates.shape[2:])}."
        )


def all_finite(*tensors: Tensor) -> bool:
    """Whether every entry of every tensor is finite: their sums first (a NaN or Inf anywhere
    makes a sum one; 4x cheaper), element by element only when a sum is not (finite numbers
    whose sum overflowed).

    >>> all_finite(torch.full((2,), 3e38)), all_finite(torch.tensor([1.0, float("nan")]))
    (True, False)
    """
    if all(cmath.isfinite(t.sum().item()) for t in tensors):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def has_negative(tensor: Tensor) -> bool:
    """Whether any entry is ``< 0`` (NaN is not): one reduction, 6x faster than ``(t < 0).any()``.

    >>> has_negative(torch.tensor([0.0, 2.0])), has_negative(torch.tensor([1.0, -0.5]))
    (False, True)
    """
    return tensor.numel() > 0 and bool(tensor.amin() < 0)


def check_walk_nonnegative(walk: Float[Tensor, "batch query key"], name: str = "walk") -> None:
    """A ConnWalkError unless every entry of ``walk`` is ``>= 0``, naming where it is not.

    The message counts the negative entries and names the first one (batch, query, key and
    value), so the row at fault can be found.

    >>> check_walk_nonnegative(torch.tensor([[[1.0, 0.0], [0.5, -0.5]]]))
    Traceback (most recent call last):
    ...
    tl_connwalk.errors.ConnWalkError: walk has 1 negative entry, the first at batch 0, query 1, ...
    """
    if not has_negative(walk):
        return
    negative = walk < 0
    count, first = int(negative.sum()), negative.nonzero()[0].tolist()
    where = ", ".join(
        f"{axis} {i}" for axis, i in zip(("batch", "query", "key"), first, strict=True)
    )
    raise ConnWalkError(
        f"{name} has {count} negative entr{'y' if count == 1 else 'ies'}, the first at {where} "
        f"({walk[tuple(first)].item():.3g}); a walk matrix is >= 0 (spec §1): the head mean of "
        "softmax attention patterns. Was a pattern edited (a hook on hook_pattern) or the walk "
        "made by hand? Pass a walk of attention probabilities."
    )


def in_memory_order(tensor: Tensor) -> Tensor:
    """``tensor`` with its axes permuted into the order of its strides when that makes it
    contiguous (else as it is): for reductions whose result does not depend on the order,
    which run several times faster over contiguous memory (a Bridge's ``W_V`` is a transposed
    view: ``abs().max()`` 2.2 ms as laid out, 0.2 ms in memory order, GPT-2 small).

    >>> in_memory_order(torch.ones(3, 4).T).is_contiguous()
    True
    """
    if tensor.is_contiguous():
        return tensor
    order = sorted(range(tensor.ndim), key=lambda axis: -tensor.stride()[axis])
    permuted = tensor.permute(order)
    return permuted if permuted.is_contiguous() else tensor


def abs_max(tensor: Tensor) -> float:
    """``max |t|`` as a float (0 for no entries; NaN if any entry is NaN), one pass over the
    tensor in memory order (`in_memory_order`) without an ``abs`` copy.

    >>> abs_max(torch.tensor([[-3.0, 2.0]]).T)
    3.0
    """
    return abs_maxes([tensor])[0]


def abs_maxes(tensors: Sequence[Tensor]) -> list[float]:
    """`abs_max` of each tensor, read off the device at once: one synchronisation per device
    for all of them (not one per tensor), one reduction per tensor.

    >>> abs_maxes([torch.tensor([-3.0, 2.0]), torch.zeros(0), torch.tensor([0.5])])
    [3.0, 0.0, 0.5]
    """
    peaks = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel() > 0:
            by_device.setdefault(tensor.device, []).append(index)
    with torch.no_grad():  # no graph of the reductions, and no detached copies to record
        for indices in by_device.values():
            pairs = [torch.aminmax(in_memory_order(tensors[i])) for i in indices]
            if len(pairs) == 1:
                low, high = pairs[0]
            else:
                low, high = (torch.stack(ends) for ends in zip(*pairs, strict=True))
            values = torch.maximum(-low, high).reshape(-1).tolist()
            for index, value in zip(indices, values, strict=True):
                peaks[index] = float(value)
    return peaks


def check_flag(value: object, name: str) -> bool:
    """``value`` if it is a bool, else a ConnWalkError naming the option ``name``."""
    if not isinstance(value, bool):
        raise ConnWalkError(f"{name} must be True or False, got {value!r}.")
    return value


def check_device(device: object) -> None:
    """A ConnWalkError unless ``device`` names a torch device (``"cpu"``, ``"cuda:1"``, a
    ``torch.device``)."""
    try:
        torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as error:
        raise ConnWalkError(
            f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}."
        ) from error


def check_draws(n_draws: object, name: str = "n_draws") -> None:
    """A ConnWalkError unless ``n_draws`` (the option ``name``) is an integer ``>= 2`` (a
    spread needs two draws)."""
    if not is_count(n_draws, least=2):
        raise ConnWalkError(f"{name} must be an integer >= 2 (for a spread), got {n_draws!r}.")


def ratio_defect(
    spread: Float[Tensor, "*batch"], size: Float[Tensor, "*batch"]
) -> Float[Tensor, "*batch"]:
    """``sqrt(spread / size)`` with ``0/0 = 0`` (the zero map) and rounding clamped to [0, 1].

    Raises if either is not finite (float overflow: rescale the transports towards norm 1,
    as `tl_connwalk.walk.residual.laplacian_residual` does) rather than let a NaN pass as 0.
    """
    if not all_finite(spread, size):
        raise ConnWalkError(
            "a defect overflowed the working precision (transport norms to the fourth power "
            "left the float range); scale W_V, W_O towards norm 1 or use float64 - every defect "
            "is invariant under that scaling."
        )
    safe = torch.where(size > 0, size, torch.ones_like(size))
    ratio = torch.where(size > 0, spread / safe, torch.zeros_like(size))
    return ratio.clamp(0.0, 1.0).sqrt()
