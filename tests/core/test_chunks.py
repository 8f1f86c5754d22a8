"""The chunk budgets: set through the public modules that show them, read where they are used."""

import numpy
import pytest
import torch

from tl_connwalk import debug
from tl_connwalk.core import isometry, laplacian
from tl_connwalk.core._fast import chunks, quartic
from tl_connwalk.errors import ConnWalkError


@pytest.mark.parametrize("module", [isometry, laplacian], ids=lambda m: m.__name__)
def test_setting_a_budget_through_a_public_module_sets_it_where_it_is_read(module, monkeypatch):
    monkeypatch.setattr(module, "CHUNK_ENTRIES", 64)
    assert chunks.CHUNK_ENTRIES == 64 == module.CHUNK_ENTRIES
    assert len(chunks.query_chunks(8, per_query=16)) == 2  # 64 entries: 4 rows per chunk
    monkeypatch.undo()
    assert chunks.CHUNK_ENTRIES == module.CHUNK_ENTRIES > 64


def test_a_budget_set_where_it_is_read_shows_through_the_public_module(monkeypatch):
    monkeypatch.setattr(chunks, "EDGE_BLOCK", 3)
    assert isometry.EDGE_BLOCK == 3


def test_devices_other_than_the_cpu_take_the_device_budget(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(chunks, "_memory_of", lambda device: None)  # a GPU of unknown memory
    budget = chunks.DEVICE_MEMORY // chunks.DEVICE_MEMORY_SHARE
    assert chunks.chunk_entries(cpu) == chunks.chunk_entries(None) == chunks.CHUNK_ENTRIES
    assert chunks.chunk_entries(cuda) == budget == 2**28 > chunks.CHUNK_ENTRIES
    per_query = chunks.CHUNK_ENTRIES // 4  # 4 rows per chunk on the CPU
    assert len(chunks.query_chunks(64, per_query, device=cpu)) == 16
    assert len(chunks.query_chunks(64, per_query, device=cuda)) == 1
    # edge chunks follow the walk's device unless told; a causal walk still gets
    # WALK_CHUNKS chunks on the CPU, DEVICE_WALK_CHUNKS on a GPU, each skipping its future
    walk = torch.tril(torch.ones(1, 256, 256))
    assert len(chunks.edge_chunks(256, 256, per_query, None, walk)) == 64
    assert len(chunks.edge_chunks(256, 256, per_query, None, walk, cuda)) == 4  # the budget
    small = 1024  # rows small enough that the budget holds every row, on either device
    assert len(chunks.edge_chunks(256, 256, small, None, walk)) == chunks.WALK_CHUNKS
    on_cuda = chunks.edge_chunks(256, 256, small, None, walk, cuda)
    assert len(on_cuda) == chunks.DEVICE_WALK_CHUNKS < chunks.WALK_CHUNKS
    assert [keys for _, keys in on_cuda] == [128, 256]
    with debug.device_budgets():
        assert len(chunks.edge_chunks(256, 256, small, None, walk)) == chunks.DEVICE_WALK_CHUNKS
    on_gpu = budget // per_query  # rows per chunk on a GPU
    assert len(chunks.edge_chunks(256, 256, per_query, None, None, cuda)) == -(-256 // on_gpu)


@pytest.mark.parametrize("gib", [256, 139, 80, 16, 1])
def test_the_device_budgets_are_a_share_of_the_gpus_memory(gib, monkeypatch):
    cuda = torch.device("cuda", 0)
    # a GPU of this memory: `_memory_of` reads CUDA's device properties
    monkeypatch.setattr(chunks, "_memory_of", lambda d: gib * 2**30 if d.type == "cuda" else None)
    share = max(chunks.CHUNK_ENTRIES, gib * 2**30 // chunks.DEVICE_MEMORY_SHARE)
    assert chunks.chunk_entries(cuda) == min(chunks.DEVICE_CHUNK_ENTRIES, share)
    expected = {256: 2**30, 139: 139 * 2**22, 80: 80 * 2**22, 16: 2**26, 1: 2**24}[gib]
    assert chunks.chunk_entries(cuda) == expected
    # the quartic forms' blocks: as many edges as that budget of products holds
    rows = quartic.quartic_rows(torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 10, 10))
    per_edge = rows.outputs * 3 * 2  # families, stacked problems
    assert chunks.edge_block(cuda, rows) == max(1, expected // per_edge)
    # at most the largest budgets
    monkeypatch.setattr(chunks, "DEVICE_CHUNK_ENTRIES", 2**25)
    monkeypatch.setattr(chunks, "DEVICE_BLOCK_ENTRIES", 2**25)
    assert chunks.chunk_entries(cuda) == min(2**25, expected)
    assert chunks.edge_block(cuda, rows) == max(1, min(2**25, expected) // per_edge)
    monkeypatch.undo()
    # devices that do not report their memory, and the CPU inside device_budgets, take
    # DEVICE_MEMORY's share
    unknown = chunks.DEVICE_MEMORY // chunks.DEVICE_MEMORY_SHARE
    assert chunks.chunk_entries(torch.device("xpu")) == unknown
    with debug.device_budgets():
        assert chunks.chunk_entries(torch.device("cpu")) == unknown


def test_device_budgets_size_the_work_for_the_memory_they_are_given(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(chunks, "_memory_of", lambda d: 16 * 2**30 if d.type == "cuda" else None)
    with debug.device_budgets(memory=139 * 2**30):
        assert chunks.chunk_entries(cpu) == chunks.chunk_entries(cuda) == 139 * 2**22
        assert debug.assumed_memory() == 139 * 2**30
        with debug.device_budgets():  # nested without memory: the outer block's
            assert chunks.chunk_entries(cpu) == 139 * 2**22
        with debug.device_budgets(memory=2**36):
            assert chunks.chunk_entries(cpu) == 2**28
        assert chunks.chunk_entries(cpu) == 139 * 2**22
    assert debug.assumed_memory() is None
    assert chunks.chunk_entries(cuda) == 2**26  # the device's own again
    for bad in (0, -(2**30)):
        with pytest.raises(ConnWalkError, match="memory in bytes"):
            debug.device_budgets(bad)  # on the call, before the block
    with debug.device_budgets(numpy.int64(2**36)):  # any integer
        assert chunks.chunk_entries(cpu) == 2**28


def test_an_mps_device_takes_the_memory_it_recommends(monkeypatch):
    """On Apple silicon the GPU shares the unified memory: the budgets are a share of what
    MPS recommends for one process's work (`torch.mps.recommended_max_memory`)."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * 2**30, raising=False)
    chunks._memory_of.cache_clear()
    try:
        assert chunks._memory_of(torch.device("mps")) == 16 * 2**30
        assert chunks.chunk_entries(torch.device("mps")) == 2**26
    finally:
        chunks._memory_of.cache_clear()


def test_an_mps_device_without_a_recommended_memory_takes_the_default(monkeypatch):
    """torch before 2.5 has no `torch.mps.recommended_max_memory`: `DEVICE_MEMORY`'s share."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.delattr(torch.mps, "recommended_max_memory", raising=False)
    chunks._memory_of.cache_clear()
    try:
        assert chunks._memory_of(torch.device("mps")) is None
        unknown = chunks.DEVICE_MEMORY // chunks.DEVICE_MEMORY_SHARE
        assert chunks.chunk_entries(torch.device("mps")) == unknown
    finally:
        chunks._memory_of.cache_clear()
