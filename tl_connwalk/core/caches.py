"""The process-wide caches of the math core: what they hold, and how to empty them.

Five stores keep what depends on weights or shapes, not on tokens, so that every layer,
batch and prompt of a model shares it (docs/performance.md, "Caches"):

- ``core.head_grams``: each layer's head Gram tensors (`tl_connwalk.core.head_grams`), by an
  XXH3 digest of the weights, at most ``head_grams.CACHE_BYTES`` bytes (256 MiB);
- ``core.draws.raw_draws``, ``core.draws.key_draws``: the random baselines' draws for the
  last two head shapes (`tl_connwalk.core.draws`);
- ``core.quartic.ranges``, ``core.quartic.layout``: the quartic forms' index plans for the
  last 16 and 8 head counts (`tl_connwalk.core.quartic`).

Results never depend on them: a cleared cache is filled again with the same numbers.

>>> import tl_connwalk
>>> sorted(tl_connwalk.caches())[0]
'core.draws.key_draws'
>>> tl_connwalk.clear_caches()
>>> tl_connwalk.caches()["core.head_grams"].currsize
0
"""

from tl_connwalk.core import draws, head_grams, quartic
from tl_connwalk.core._fast import lru

CacheInfo = lru.CacheInfo

#: the modules whose stores `caches` lists (imported here, so each has registered its own)
_HOLDERS = (draws, head_grams, quartic)


def caches() -> dict[str, CacheInfo]:
    """Every process-wide cache by name: hits and misses since its last clear, entries and
    bytes held, and its bounds (`CacheInfo`)."""
    return lru.caches()


def clear_caches() -> None:
    """Empty every process-wide cache and reset its counts (memory is given back; the next
    measurement fills them again, with the same results)."""
    lru.clear_caches()
