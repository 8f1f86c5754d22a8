"""The debug utilities: operation counts, and the device budgets that let a CPU count what a
GPU launches without changing any result."""

import threading

import numpy as np
import pytest
import torch

import tl_connwalk
from tests.architectures import tokens
from tests.tolerances import cancelling_atol
from tl_connwalk.core._fast import chunks
from tl_connwalk.debug import count_operations, device_budgets, on_device, operations_of
from tl_connwalk.toy import random_bridge


def test_count_operations_counts_each_dispatched_operator():
    a = torch.ones(4, 4)
    with count_operations() as counted:
        b = a @ a
        _ = b.sum() + b.amax()
    assert counted.by_operation["aten.mm"] == 1
    assert counted.total == 4  # mm, sum, amax, add
    assert operations_of(lambda: a @ a).by_operation == {"aten.mm": 1}


def test_device_budgets_batch_the_table_without_changing_it(monkeypatch):
    """Small CPU budgets split the table's work into many chunks, groups and blocks; the
    device budgets take it at once: fewer operations, the same table (summed in another
    order: float32 defects near 0 keep half their digits)."""
    model = random_bridge("gpt2", n_layers=3, n_ctx=16)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(pos=16))
    monkeypatch.setattr(chunks, "CHUNK_ENTRIES", 4096)
    monkeypatch.setattr(chunks, "EDGE_BLOCK", 16)

    def table():
        return tl_connwalk.geometry_table(cache, baseline_draws=2, progress=False)

    table()  # warm: the head Grams once per set of weights
    on_cpu = operations_of(table).total
    expected = table()
    with device_budgets():
        tl_connwalk.clear_caches()  # the draws made again with a GPU's sizes
        table()
        on_gpu = operations_of(table).total
        got = table()
    assert on_gpu < on_cpu / 2
    assert not on_device(torch.device("cpu"))  # the budgets end with the block
    assert got.columns.tolist() == expected.columns.tolist()
    numbers = expected.select_dtypes("number").columns
    np.testing.assert_allclose(
        got[numbers].to_numpy(float),
        expected[numbers].to_numpy(float),
        rtol=0,
        atol=cancelling_atol(torch.float32),
        equal_nan=True,
    )
    assert (got[numbers].isna() == expected[numbers].isna()).all().all()


def test_device_budgets_hold_for_the_calling_thread_only():
    seen = []
    with device_budgets():
        other = threading.Thread(target=lambda: seen.append(on_device(torch.device("cpu"))))
        other.start()
        other.join()
        seen.append(on_device(torch.device("cpu")))
    assert seen == [False, True]


def test_device_budgets_apply_on_the_cpu_inside_the_block_only():
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="inside"), device_budgets():
        assert on_device(cpu)
        with device_budgets():  # nested: still in force after the inner block
            pass
        assert chunks.chunk_entries(cpu) == chunks.DEVICE_MEMORY // chunks.DEVICE_MEMORY_SHARE
        raise RuntimeError("inside")
    assert not on_device(cpu)
    assert chunks.chunk_entries(cpu) == chunks.CHUNK_ENTRIES
