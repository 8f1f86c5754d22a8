"""Chunk sizes of the per-edge work, one home for all: how many query rows (and edges) a
chunk holds, so that memory stays at the pattern's size plus one chunk. Results never depend
on them."""

import functools
import sys
import types
from typing import Any

import torch
from einops import reduce
from torch import Tensor

from tl_connwalk.core._fast.quartic import QuarticRows
from tl_connwalk.debug import assumed_memory, on_device

#: Working-memory budget (entries) of the chunked contractions below, on the CPU: small
#: chunks keep the temporaries in cache.
CHUNK_ENTRIES = 2**24


#: The same budget on other devices (CUDA, MPS), where every chunk costs a fixed number of
#: kernel launches whatever its size (`chunk_entries`): the device's memory over
#: ``DEVICE_MEMORY_SHARE`` numbers, at most this (4 GiB of float32 numbers).
DEVICE_CHUNK_ENTRIES = 2**30


#: Edges per block of the per-edge Gram work on the CPU: its temporaries stay in cache.
EDGE_BLOCK = 4096


#: Numbers in one block's products on other devices (CUDA, MPS), where a block costs kernel
#: launches rather than cache misses (`edge_block`): the device's memory over
#: ``DEVICE_MEMORY_SHARE``, at most this.
DEVICE_BLOCK_ENTRIES = 2**30


#: With a walk, automatic chunks of rows are at most this share of them (at least 16 rows),
#: so that a causal walk skips most of its future: 8 chunks skip 7/16 of the pairs.
WALK_CHUNKS = 8


#: The same on other devices, where a chunk costs launches rather than arithmetic: 2 chunks
#: skip a quarter of the pairs.
DEVICE_WALK_CHUNKS = 2


#: Both device budgets are a device's memory (bytes) over this: the measurements hold about
#: four budgets' numbers at once (the chunk, the quartic forms' products and a group of
#: layers with its stacked copy), so that is ~16 bytes per entry of the budget in float32,
#: and the peak stays near a sixteenth of the device (80 GiB: 2**28.3 numbers, 1.25 GiB;
#: 16 GiB: 2**26).
DEVICE_MEMORY_SHARE = 256


#: The memory (bytes) assumed for a device that does not tell its own (and for the CPU
#: inside `tl_connwalk.debug.device_budgets` without ``memory``): 64 GiB, budgets of 2**28
#: numbers (1 GiB in float32).
DEVICE_MEMORY = 64 * 2**30


#: The budgets above; the public modules that show them forward reads and assignments here.
BUDGETS = (
    "CHUNK_ENTRIES", "DEVICE_BLOCK_ENTRIES", "DEVICE_CHUNK_ENTRIES", "DEVICE_MEMORY",
    "DEVICE_MEMORY_SHARE", "DEVICE_WALK_CHUNKS", "EDGE_BLOCK", "WALK_CHUNKS",
)  # fmt: skip


class _ForwardedBudgets(types.ModuleType):
    """A module whose budget names read and set the values of this one."""

    def __getattribute__(self, name: str) -> Any:
        if name in BUDGETS:
            return getattr(sys.modules[__name__], name)
        return super().__getattribute__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in BUDGETS:
            setattr(sys.modules[__name__], name, value)
        super().__setattr__(name, value)


def forward_budgets(module: str) -> None:
    """Make ``module.CHUNK_ENTRIES`` (and the other `BUDGETS`) read and set this module's.

    >>> from tl_connwalk.core import isometry
    >>> old = CHUNK_ENTRIES
    >>> isometry.CHUNK_ENTRIES = 64
    >>> sys.modules[__name__].CHUNK_ENTRIES
    64
    >>> isometry.CHUNK_ENTRIES = old
    """
    sys.modules[module].__class__ = _ForwardedBudgets


@functools.cache
def _memory_of(device: torch.device) -> int | None:
    """Bytes of memory of a CUDA device, or the share of the unified memory an MPS device
    recommends for its work (``None`` for other devices, or without them)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory)
    recommended = getattr(torch.mps, "recommended_max_memory", None)  # torch >= 2.5
    if device.type == "mps" and recommended is not None and torch.backends.mps.is_available():
        return int(recommended())
    return None


def _device_budget(entries: int, device: torch.device | None) -> int:
    """A device budget: the device's memory over ``DEVICE_MEMORY_SHARE`` numbers, at most
    ``entries`` and at least ``CHUNK_ENTRIES``. The memory is the one
    `tl_connwalk.debug.device_budgets` was given, else a CUDA or MPS device's own
    (`_memory_of`), else ``DEVICE_MEMORY``."""
    memory = assumed_memory()
    if memory is None and device is not None:
        memory = _memory_of(device)
    if memory is None:
        memory = DEVICE_MEMORY
    return min(entries, max(CHUNK_ENTRIES, memory // DEVICE_MEMORY_SHARE))


def chunk_entries(device: torch.device | None = None) -> int:
    """The chunk budget of work on ``device``: where it takes a GPU's sizes (`on_device`),
    its memory over ``DEVICE_MEMORY_SHARE`` numbers (`_device_budget`: at most
    ``DEVICE_CHUNK_ENTRIES``, at least ``CHUNK_ENTRIES``), else ``CHUNK_ENTRIES``.

    >>> chunk_entries(torch.device("cpu")) == CHUNK_ENTRIES
    True
    >>> from tl_connwalk.debug import device_budgets
    >>> with device_budgets():  # a GPU of DEVICE_MEMORY
    ...     chunk_entries(torch.device("cpu")) == DEVICE_MEMORY // DEVICE_MEMORY_SHARE
    True
    """
    return _device_budget(DEVICE_CHUNK_ENTRIES, device) if on_device(device) else CHUNK_ENTRIES


def query_chunks(
    n_query: int,
    per_query: int,
    query_chunk: int | None = None,
    device: torch.device | None = None,
) -> list[slice]:
    """Slices of query rows: ``query_chunk`` rows each, or as many as fit the chunk budget of
    ``device`` (`chunk_entries`: ``CHUNK_ENTRIES`` numbers on the CPU); the last one ends at
    ``n_query``.

    >>> query_chunks(5, per_query=1, query_chunk=2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]

    Callers write each chunk's result into an output allocated before the loop: results kept
    as a list of small tensors between the large temporaries fragment the C heap, which then
    cannot reuse or return them (at 8192 tokens and 12 heads the process grows by gigabytes).
    """
    budget = chunk_entries(device)
    step = max(1, budget // max(1, per_query)) if query_chunk is None else query_chunk
    return [slice(start, min(start + step, n_query)) for start in range(0, n_query, step)]


def edge_chunks(
    n_query: int,
    n_key: int,
    per_query: int,
    query_chunk: int | None,
    walk: Tensor | None,
    device: torch.device | None = None,
) -> list[tuple[slice, int]]:
    """`query_chunks`, each with 1 + the last key that is an edge of any of its rows.

    Keys past it are no edge of the chunk (the future of a causal walk, trailing padding), so
    per-edge work stops there and the values there are left 0, as on every non-edge. With a
    walk, automatic chunks are at most a ``WALK_CHUNKS``-th of the rows (``DEVICE_WALK_CHUNKS``
    on a GPU; at least 16 rows), so that a causal walk skips most of its future. Without a
    walk every key counts. The budget is that of ``device`` (``None``: the walk's).
    """
    if walk is None:
        return [(rows, n_key) for rows in query_chunks(n_query, per_query, query_chunk, device)]
    if query_chunk is None:
        device = walk.device if device is None else device
        shares = DEVICE_WALK_CHUNKS if on_device(device) else WALK_CHUNKS
        budget = max(1, chunk_entries(device) // max(1, per_query))
        query_chunk = min(budget, max(16, -(-n_query // shares)))
    present = reduce(walk > 0, "batch query key -> query key", "max")
    positions = torch.arange(1, n_key + 1, device=walk.device)
    last = reduce(present * positions, "query key -> query", "max").tolist()
    return [(rows, max(last[rows], default=0)) for rows in query_chunks(n_query, 1, query_chunk)]


def edge_block(device: torch.device, rows: QuarticRows) -> int:
    """Edges per block of `_family_gram_defects`: ``EDGE_BLOCK`` on the CPU (at most as many
    as keep a block's products, ``QuarticRows.outputs`` per family, stacked problem and edge,
    within ``CHUNK_ENTRIES`` numbers); on a GPU (`on_device`) as many as fill its block
    budget of products (`_device_budget` of ``DEVICE_BLOCK_ENTRIES``), at least one.
    """
    per_edge = rows.outputs * rows.families * rows.stack
    if not on_device(device):
        return max(1, min(EDGE_BLOCK, CHUNK_ENTRIES // per_edge))
    return max(1, _device_budget(DEVICE_BLOCK_ENTRIES, device) // per_edge)
