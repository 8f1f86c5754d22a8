"""Count the tensor operations a piece of code dispatches: the unit of cost on a GPU.

On a GPU each small operation is a kernel launch, and a measurement that launches many of them
is bound by the host's Python and the launch latency rather than by the arithmetic. Counting
the operations that reach PyTorch's dispatcher (``aten`` operators, after autograd and after
composite operations are split into the ones that run) measures that cost on any device,
without a GPU, and without timing noise: the same code on the same shapes dispatches the same
operations.

>>> from tl_connwalk.debug import count_operations
>>> with count_operations() as counted:
...     _ = torch.ones(3) + 1
>>> counted.total, counted.by_operation["aten.add"]
(2, 1)

On a GPU the measurements take larger chunks, blocks and products than on a CPU (fewer
launches, more memory; `on_device` says where). `device_budgets` sizes them as on a GPU on
every device, so that a CPU counts what a GPU would launch:

>>> from tl_connwalk.debug import device_budgets
>>> with device_budgets(), count_operations() as counted:
...     _ = torch.ones(3) + 1
>>> counted.total
2
"""

import collections
import contextvars
import operator
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tl_connwalk.errors import ConnWalkError

__all__ = [
    "OperationCount", "assumed_memory", "count_operations", "device_budgets", "on_device",
    "operations_of",
]  # fmt: skip


@dataclass
class OperationCount:
    """The operations dispatched inside a `count_operations` block.

    ``total``: every dispatched operator call; ``by_operation``: the calls per operator,
    keyed by its name without the overload (``"aten.mm"``, ``"aten.add"``).
    """

    by_operation: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        """Every dispatched operator call."""
        return sum(self.by_operation.values())

    def most_common(self, n: int = 10) -> list[tuple[str, int]]:
        """The ``n`` most called operators with their counts, most called first."""
        return self.by_operation.most_common(n)


class _Counter(TorchDispatchMode):
    """A dispatch mode that records each operator call into ``count`` and runs it unchanged."""

    def __init__(self, count: OperationCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.count.by_operation[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_operations() -> Iterator[OperationCount]:
    """Count every ``aten`` operation dispatched inside the ``with`` block (`OperationCount`).

    Results are unchanged: each operation runs as it would without the counter. The count
    covers the calling thread (the dispatch mode is thread-local), on every device.

    >>> with count_operations() as counted:
    ...     logits = model(tokens)
    >>> counted.by_operation["aten._softmax"] == model.cfg.n_layers  # one per attention layer
    True
    """
    count = OperationCount()
    with _Counter(count):
        yield count


def operations_of(fn: Callable[[], object]) -> OperationCount:
    """`count_operations` of one call of ``fn`` (its result is dropped)."""
    with count_operations() as counted:
        fn()
    return counted


#: Whether `device_budgets` is in force: the device sizes on the CPU as well (per thread and
#: async task, as the operation counter is).
_everywhere: contextvars.ContextVar[bool] = contextvars.ContextVar("device_budgets", default=False)

#: The GPU memory (bytes) `device_budgets` sizes the work for, where it was given one.
_memory: contextvars.ContextVar[int | None] = contextvars.ContextVar("device_memory", default=None)


def on_device(device: torch.device | None) -> bool:
    """Whether work on ``device`` takes a GPU's sizes (`tl_connwalk.core._fast.chunks`,
    `~.quartic`: on every device but the CPU a fixed number of operations costs a fixed number
    of kernel launches whatever their size, so chunks, blocks and products are made large and
    few there): any device but the CPU, and the CPU too inside `device_budgets`. ``None`` (no
    tensor to tell) is the CPU."""
    return _everywhere.get() or (device is not None and device.type != "cpu")


def assumed_memory() -> int | None:
    """The GPU memory (bytes) the enclosing `device_budgets` sizes the work for, or ``None``
    (each device's own: a CUDA device's, or the memory an MPS device recommends, else
    ``tl_connwalk.core.isometry.DEVICE_MEMORY``)."""
    return _memory.get() if _everywhere.get() else None


def device_budgets(memory: SupportsIndex | None = None) -> AbstractContextManager[None]:
    """Chunks, blocks and products sized as on a GPU, on every device: what the work launches
    on a GPU, counted on a CPU (`tl_connwalk.debug.count_operations`). The budgets are a
    share of the GPU's memory (``tl_connwalk.core.isometry.DEVICE_MEMORY_SHARE``): of
    ``memory`` bytes where given (``80 * 2**30``: an 80 GiB GPU), else of a CUDA device's own
    (or the memory an MPS device recommends), else of ``DEVICE_MEMORY`` (64 GiB; the CPU's
    case). Results do not depend on the sizes; the CPU runs slower and holds more memory
    inside. In force for the calling thread only. The random baselines' draws cached before
    the block keep the sizes they were made with (`tl_connwalk.clear_caches()` first, or a
    warm-up inside the block, counts them as a GPU would).

    >>> with device_budgets():
    ...     on_device(torch.device("cpu"))
    True
    >>> on_device(torch.device("cpu"))
    False
    """
    if memory is None:
        return _sized_as_on_a_gpu(None)
    try:
        size = -1 if isinstance(memory, bool) else operator.index(memory)
    except TypeError:
        size = -1
    if size <= 0:
        raise ConnWalkError(
            f"device_budgets(memory={memory!r}): memory is the GPU's memory in bytes, a "
            "positive integer (80 * 2**30 for an 80 GiB GPU), or None for each device's own."
        )
    return _sized_as_on_a_gpu(size)


@contextmanager
def _sized_as_on_a_gpu(memory: int | None) -> Iterator[None]:
    token = _everywhere.set(True)
    sized = None if memory is None else _memory.set(memory)
    try:
        yield
    finally:
        if sized is not None:
            _memory.reset(sized)
        _everywhere.reset(token)
