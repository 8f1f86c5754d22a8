"""The chunk budgets: set through the public modules that show them, read where they are used."""

import pytest

from tl_connwalk.core import isometry, laplacian
from tl_connwalk.core._fast import chunks


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
