"""The process-wide caches: listed, bounded, cleared, and results that do not depend on them."""

import torch

import tl_connwalk
from tl_connwalk.core._fast import disk, draws, head_grams, lru
from tl_connwalk.walk import ConnectionWalk

NAMES = {
    "core.head_grams",
    "core.draws.raw_draws",
    "core.draws.key_draws",
    "core.quartic.ranges",
    "core.quartic.layout",
    "core.messages.pair_index",
}


def small_walk(seed: int) -> ConnectionWalk:
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.softmax(torch.randn(1, 3, 5, 5, generator=gen), -1)
    W_V, W_O = torch.randn(3, 8, 2, generator=gen), torch.randn(3, 2, 8, generator=gen)
    return ConnectionWalk.from_pattern(pattern, torch.randn(1, 5, 8, generator=gen), W_V, W_O)


def test_every_cache_is_listed_filled_and_cleared():
    tl_connwalk.clear_caches()
    first = small_walk(0).laplacian_residual(baseline_draws=2).to_dict()
    listed = tl_connwalk.caches()
    assert set(listed) == NAMES
    for name in ("core.head_grams", "core.draws.raw_draws", "core.quartic.layout"):
        assert listed[name].currsize > 0 and listed[name].nbytes > 0, name
    assert listed["core.head_grams"].maxbytes == head_grams.CACHE_BYTES
    assert listed["core.draws.raw_draws"].maxsize == 2
    tl_connwalk.clear_caches()
    for name, info in tl_connwalk.caches().items():
        assert (info.hits, info.misses, info.currsize, info.nbytes) == (0, 0, 0, 0), name
    assert small_walk(0).laplacian_residual(baseline_draws=2).to_dict() == first


def test_a_store_keeps_the_most_recent_within_its_entries():
    calls = []

    def square(x: int) -> torch.Tensor:
        calls.append(x)
        return torch.full((4,), float(x * x))

    cached = lru.Memoized(square, lru.Store("test.square", maxsize=2))
    try:
        for x in (1, 2, 1, 3, 1, 2):
            assert cached(x)[0] == x * x
        assert calls == [1, 2, 3, 2]  # 2 left when 3 came (1 was used more recently)
        info = cached.cache_info()
        assert (info.hits, info.misses, info.currsize, info.nbytes) == (2, 4, 2, 2 * 16)
        assert cached.__wrapped__ is square
        cached.cache_clear()
        assert cached.cache_info().currsize == 0
    finally:
        del lru._STORES["test.square"]


def test_a_value_over_the_byte_bound_is_not_kept():
    store: lru.Store[torch.Tensor] = lru.Store("test.bytes", maxbytes=lambda: 20)
    try:
        store.put("small", torch.zeros(4))  # 16 bytes
        store.put("large", torch.zeros(8))  # 32 bytes: too large to keep
        assert store.get("large") is None and store.get("small") is not None
        store.put("other", torch.zeros(2))  # 8 more bytes: the oldest leaves
        assert store.get("small") is None and store.info().nbytes == 8
    finally:
        del lru._STORES["test.bytes"]


def test_tensor_bytes_reads_through_containers():
    held = head_grams.compute_head_grams(torch.randn(2, 4, 3), torch.randn(2, 3, 4))
    assert lru.tensor_bytes(held) == sum(
        t.numel() * t.element_size() for t in (held.norms_sq, held.K2, held.pair_gram,
                                               held.head_defects, held.out_rows) if t is not None
    )  # fmt: skip
    assert lru.tensor_bytes(([torch.zeros(3)], {"a": torch.zeros(2, dtype=torch.int64)})) == 28
    assert draws.raw_draws.cache_info().maxsize == 2


def test_the_disk_cache_serves_a_new_process_the_same_numbers(tmp_path, monkeypatch):
    """What a first measurement builds (head Grams, the draws) is read back from disk once
    the process-wide stores are empty, as a new process finds it; `clear_caches` empties the
    folder too, and the folder keeps within its bound."""
    monkeypatch.setenv("TL_CONNWALK_CACHE", str(tmp_path))
    tl_connwalk.clear_caches()
    first = small_walk(1).laplacian_residual(baseline_draws=2).to_dict()
    folder, entries, size = tl_connwalk.core.caches.disk_cache_info()
    assert folder == tmp_path / "grams" and entries == 2 and size > 0  # the layer's, the draws'
    lru.clear_caches()  # the memory of this process only: a new process
    computed = []
    monkeypatch.setattr(
        head_grams, "compute_head_grams", lambda *a, **k: computed.append(a) or None
    )
    again = small_walk(1).laplacian_residual(baseline_draws=2).to_dict()
    assert again == first and not computed  # read back, not computed
    tl_connwalk.clear_caches()
    assert tl_connwalk.core.caches.disk_cache_info()[1:] == (0, 0)
    monkeypatch.undo()
    monkeypatch.setenv("TL_CONNWALK_CACHE", str(tmp_path))
    monkeypatch.setattr(disk, "DISK_BYTES", size // 2)  # room for the smaller entry alone
    small_walk(1).laplacian_residual(baseline_draws=2)
    assert tl_connwalk.core.caches.disk_cache_info()[2] <= size // 2
    monkeypatch.setattr(disk, "DISK_BYTES", 0)  # off: nothing written
    tl_connwalk.clear_caches()
    small_walk(1).laplacian_residual(baseline_draws=2)
    assert tl_connwalk.core.caches.disk_cache_info()[1] == 0
