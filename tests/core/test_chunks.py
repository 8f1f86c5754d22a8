"""The chunk budgets: set through the public modules that show them, read where they are used."""

import pytest
import torch

from tl_connwalk import debug
from tl_connwalk.core import isometry, laplacian
from tl_connwalk.core._fast import chunks, quartic


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
    monkeypatch.setattr(chunks, "_memory_of", lambda device: None)  # a GPU of any memory
    assert chunks.chunk_entries(cpu) == chunks.chunk_entries(None) == chunks.CHUNK_ENTRIES
    assert chunks.chunk_entries(cuda) == chunks.DEVICE_CHUNK_ENTRIES > chunks.CHUNK_ENTRIES
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
    on_gpu = chunks.DEVICE_CHUNK_ENTRIES // per_query  # rows per chunk on a GPU
    assert len(chunks.edge_chunks(256, 256, per_query, None, None, cuda)) == -(-256 // on_gpu)


@pytest.mark.parametrize("gib", [80, 16, 1])
def test_a_cuda_device_caps_the_device_budgets_by_its_memory(gib, monkeypatch):
    cuda = torch.device("cuda", 0)
    # a GPU of this memory: `_memory_of` reads CUDA's device properties
    monkeypatch.setattr(chunks, "_memory_of", lambda d: gib * 2**30 if d.type == "cuda" else None)
    cap = max(chunks.CHUNK_ENTRIES, gib * 2**30 // chunks.DEVICE_MEMORY_SHARE)
    assert chunks.chunk_entries(cuda) == min(chunks.DEVICE_CHUNK_ENTRIES, cap)
    assert {80: 2**28, 16: 2**26, 1: 2**24}[gib] == chunks.chunk_entries(cuda)
    # the quartic forms' blocks: as many edges as the capped budget of products holds
    rows = quartic.quartic_rows(torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 10, 10))
    per_edge = rows.outputs * 3 * 2  # families, stacked problems
    width = chunks.edge_block(cuda, rows)
    assert width == max(1, min(chunks.DEVICE_BLOCK_ENTRIES, cap) // per_edge)
    # other devices, and the CPU inside device_budgets, take the budgets uncapped
    assert chunks.chunk_entries(torch.device("mps")) == chunks.DEVICE_CHUNK_ENTRIES
    with debug.device_budgets():
        assert chunks.chunk_entries(torch.device("cpu")) == chunks.DEVICE_CHUNK_ENTRIES
