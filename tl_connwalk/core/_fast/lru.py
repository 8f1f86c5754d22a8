"""The process-wide caches of the math core: least-recently-used stores, bounded, listed.

Every store registers under its name at import; `caches` reports on all of them and
`clear_caches` empties them (``tl_connwalk.caches``, ``tl_connwalk.clear_caches``). A store is
bounded in entries, in bytes (the tensors its values hold, `tensor_bytes`), or both; the least
recently used entries leave first, and a value larger than the byte bound is not kept.
"""

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, NamedTuple, ParamSpec, TypeVar

from torch import Tensor

V = TypeVar("V")
P = ParamSpec("P")


class CacheInfo(NamedTuple):
    """One store's hits and misses since its last clear, and what it holds.

    ``currsize`` entries of at most ``maxsize`` (``None``: no bound on entries) and ``nbytes``
    bytes of tensors of at most ``maxbytes`` (``None``: no bound on bytes).
    """

    hits: int
    misses: int
    currsize: int
    nbytes: int
    maxsize: int | None = None
    maxbytes: int | None = None


def tensor_bytes(value: object) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or tuples, lists, dicts and dataclasses of
    them; anything else counts 0)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(tensor_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class Store(Generic[V]):
    """A least-recently-used map bounded in entries and in bytes, thread-safe, registered.

    ``maxbytes`` is read on every insertion (a function, so that a module constant can set it).
    """

    def __init__(
        self, name: str, *, maxsize: int | None = None, maxbytes: Callable[[], int] | None = None
    ) -> None:
        self.name = name
        self.maxsize = maxsize
        self.maxbytes = maxbytes
        self.entries: OrderedDict[Hashable, V] = OrderedDict()
        self.sizes: dict[Hashable, int] = {}
        self.nbytes = self.hits = self.misses = 0
        self.lock = threading.Lock()
        _STORES[name] = self

    def get(self, key: Hashable) -> V | None:
        with self.lock:
            found = self.entries.get(key)
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
                self.entries.move_to_end(key)
            return found

    def put(self, key: Hashable, value: V) -> None:
        size = tensor_bytes(value)
        limit = None if self.maxbytes is None else self.maxbytes()
        with self.lock:
            if key in self.entries or (limit is not None and size > limit):
                return
            self.entries[key], self.sizes[key] = value, size
            self.nbytes += size
            while (limit is not None and self.nbytes > limit) or (
                self.maxsize is not None and len(self.entries) > self.maxsize
            ):
                old, _ = self.entries.popitem(last=False)
                self.nbytes -= self.sizes.pop(old)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.sizes.clear()
            self.nbytes = self.hits = self.misses = 0

    def info(self) -> CacheInfo:
        limit = None if self.maxbytes is None else self.maxbytes()
        with self.lock:
            return CacheInfo(
                self.hits, self.misses, len(self.entries), self.nbytes, self.maxsize, limit
            )


_STORES: dict[str, Store[Any]] = {}


class Memoized(Generic[P, V]):
    """``function`` with its results kept in a `Store`, keyed by its arguments (hashable);
    ``cache_info`` and ``cache_clear`` as ``functools.lru_cache`` has them, ``__wrapped__``
    the function itself, uncached."""

    def __init__(self, function: Callable[P, V], store: Store[V]) -> None:
        functools.update_wrapper(self, function)
        self.__wrapped__ = function
        self.store = store

    # ``Any`` rather than ``P.args``/``P.kwargs``: older beartype releases (the runtime
    # type checker of the test suite) cannot read a ParamSpec's parts
    def __call__(self, *args: Any, **kwargs: Any) -> V:
        key = (args, tuple(sorted(kwargs.items())))
        found = self.store.get(key)
        if found is None:
            found = self.__wrapped__(*args, **kwargs)
            self.store.put(key, found)
        return found

    def cache_info(self) -> CacheInfo:
        return self.store.info()

    def cache_clear(self) -> None:
        self.store.clear()


def memoized(name: str, *, maxsize: int) -> Callable[[Callable[P, V]], Memoized[P, V]]:
    """Keep a function's last ``maxsize`` results in a registered `Store` named ``name``."""

    def wrap(function: Callable[P, V]) -> Memoized[P, V]:
        return Memoized(function, Store(name, maxsize=maxsize))

    return wrap


def caches() -> dict[str, CacheInfo]:
    """Every process-wide cache of the math core by name, with its `CacheInfo`."""
    return {name: store.info() for name, store in sorted(_STORES.items())}


def clear_caches() -> None:
    """Empty every process-wide cache of the math core and reset its counts."""
    for store in _STORES.values():
        store.clear()
