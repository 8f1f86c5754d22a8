"""The process-wide caches of the math core: what they hold, and how to empty them.

Six stores keep what depends on weights or shapes, not on tokens, so that every layer,
batch and prompt of a model shares it (docs/performance.md, "Caches"):

- ``core.head_grams``: each layer's head Gram tensors (`head_grams`), by an XXH3 digest of
  the weights, at most 256 MiB;
- ``core.draws.raw_draws``, ``core.draws.key_draws``: the random baselines' draws for the
  last two head shapes (`layer_draws` rescales them to a layer);
- ``core.quartic.ranges``, ``core.quartic.layout``: the quartic forms' index plans for the
  last 16 and 8 head counts.
- ``core.messages.pair_index``: where each head pair's message Gram lies among the products
  of every head with its next ``H // 2`` heads, for the last 8 head counts and devices.

Results never depend on them: a cleared cache is filled again with the same numbers. The
stores themselves are private (``tl_connwalk.core._fast``); `head_grams` and `layer_draws`
are the two cached terms a layer's measurements read (`tl_connwalk.walk.residual`),
`stacked_layer_draws` the draws of several layers at once and `stacked_draw_message_grams`
their field baselines; `sampled` takes the draws' walk-weighted defects on samples of edges.

>>> import tl_connwalk
>>> sorted(tl_connwalk.caches())[0]
'core.draws.key_draws'
>>> tl_connwalk.clear_caches()
>>> tl_connwalk.caches()["core.head_grams"].currsize
0
"""

from pathlib import Path

from tl_connwalk.core._fast import disk, draws, lru, quartic, sampled
from tl_connwalk.core._fast import head_grams as _head_grams
from tl_connwalk.core._fast.draws import (
    LayerDraws,
    layer_draws,
    stacked_draw_message_grams,
    stacked_layer_draws,
)
from tl_connwalk.core._fast.head_grams import HeadGrams, head_grams

__all__ = [
    "CacheInfo",
    "HeadGrams",
    "LayerDraws",
    "caches",
    "clear_caches",
    "disk_cache_info",
    "head_grams",
    "layer_draws",
    "sampled",
    "stacked_draw_message_grams",
    "stacked_layer_draws",
]

CacheInfo = lru.CacheInfo

#: the modules whose stores `caches` lists (imported here, so each has registered its own)
_HOLDERS = (draws, _head_grams, quartic)


def caches() -> dict[str, CacheInfo]:
    """Every process-wide cache by name: hits and misses since its last clear, entries and
    bytes held, and its bounds (`CacheInfo`)."""
    return lru.caches()


def clear_caches() -> None:
    """Empty every process-wide cache and reset its counts (memory is given back; the next
    measurement fills them again, with the same results), and the head Grams and draws kept
    on disk for other processes (`disk_cache_info`)."""
    lru.clear_caches()
    disk.clear()


def disk_cache_info() -> tuple[Path, int, int]:
    """The folder of the head Grams and draws kept on disk across processes, its number of
    files and their bytes (at most ``tl_connwalk.core._fast.disk.DISK_BYTES``, 256 MiB)."""
    return (disk.folder(), *disk.info())
