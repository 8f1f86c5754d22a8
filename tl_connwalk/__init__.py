"""tl_connwalk: self-attention as a connection walk, for TransformerLens models.

>>> import tl_connwalk
>>> model = tl_connwalk.attach(model)  # a TransformerBridge here
>>> logits, cache = model.run_with_cache(tokens)
>>> walk = cache.connection_walk(0)
>>> output = cache["blocks.0.attn.o.hook_out"]  # HookedTransformer: "blocks.0.hook_attn_out"
>>> torch.testing.assert_close(walk.apply() + walk.bias(), output)

The package is layered; a module imports only from its own layer and those below it, with no
import cycle (type-only imports included; ``tests/test_layering.py`` checks both):

1. ``errors``, ``debug``: `ConnWalkError`; an operation counter.
2. ``core``: the mathematics, tensors in and tensors out, no model class. Its public modules
   read as the formulas of the spec; the fast paths they call (chunk sizes, Gram tensors,
   per-edge closed forms, message Grams, the caches' stores) live in the private
   ``core._fast``, which nothing outside ``core`` imports. ``views`` renders pages from
   tensors on top of it.
3. ``walk``: the objects a user holds for one layer (`ConnectionWalk`, `LaplacianResidual`),
   built from tensors.
4. ``adapters``, ``hooks``: reading walks out of TransformerLens models, and the
   connection-walk hook points.
5. ``cache``, ``analysis``, ``plugin``, ``ablations``, ``attribution``, ``distributed``: what
   works on a model or its activation cache.
6. ``report``, ``cli``, ``zoo``, ``corpus``, ``toy`` and this package's namespace: the
   applications on top.
"""

import importlib
from types import ModuleType

from tl_connwalk.analysis import geometry_table as geometry_table
from tl_connwalk.analysis import layer_drift as layer_drift
from tl_connwalk.attribution import Attribution as Attribution
from tl_connwalk.attribution import attribute as attribute
from tl_connwalk.cache import connection_walk as connection_walk
from tl_connwalk.cache import laplacian_residual as laplacian_residual
from tl_connwalk.cache import required_hooks as required_hooks
from tl_connwalk.cache import walk_matrix as walk_matrix
from tl_connwalk.core.caches import caches as caches
from tl_connwalk.core.caches import clear_caches as clear_caches
from tl_connwalk.core.generator import ConnectionGenerator as ConnectionGenerator
from tl_connwalk.core.walk import EffectiveTransport as EffectiveTransport
from tl_connwalk.corpus import analyze as analyze
from tl_connwalk.errors import ConnWalkError as ConnWalkError
from tl_connwalk.plugin import attach as attach
from tl_connwalk.plugin import detach as detach
from tl_connwalk.plugin import is_attached as is_attached
from tl_connwalk.walk import ConnectionWalk as ConnectionWalk
from tl_connwalk.walk.residual import LaplacianResidual as LaplacianResidual

__version__ = "0.1.0"

# Submodules reachable as attributes (`tl_connwalk.zoo.load(...)`) but imported only on first
# use: they pull in heavier dependencies (gguf, transformers' model classes) that
# `import tl_connwalk` should not pay for.
_LAZY_SUBMODULES = ("ablations", "toy", "zoo")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "Attribution",
    "ConnWalkError",
    "ConnectionGenerator",
    "ConnectionWalk",
    "EffectiveTransport",
    "LaplacianResidual",
    "analyze",
    "attach",
    "attribute",
    "caches",
    "clear_caches",
    "connection_walk",
    "detach",
    "geometry_table",
    "is_attached",
    "laplacian_residual",
    "layer_drift",
    "required_hooks",
    "walk_matrix",
]
