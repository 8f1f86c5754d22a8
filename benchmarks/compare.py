"""All measurements on every layer of a GPT-2-small shape, for old-against-new comparisons.

Run the same file against two checkouts, back to back, one thread each::

    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/old .venv/bin/python benchmarks/compare.py
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/compare.py

It uses only the public API that every version has (``laplacian_residual``, ``layer_drift``,
``required_hooks``), so it runs on older code than `bench.py`. A first cache is measured once
(``first``: what a model's first prompt costs), then a cache of other tokens (``second``:
what every further prompt costs) ``REPEATS`` times, each pass right after a ``run_with_cache``
pass of the same tokens; ``second`` and ``forward`` are the medians of those passes and
``second_min`` the fastest.
"""

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformer_lens import ActivationCache

import tl_connwalk
from tl_connwalk.toy import VOCAB, random_bridge

#: Passes of the second cache, each after a forward pass
REPEATS = 7


def measure(n_pos: int) -> dict[str, float]:
    model = random_bridge("gpt2", n_layers=12, d_model=768, n_heads=12, scale=0.02, n_ctx=n_pos)
    tokens = torch.randint(0, VOCAB - 1, (2, 1, n_pos), generator=torch.Generator().manual_seed(1))
    names = tl_connwalk.required_hooks(model)

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def measure_all(cache: ActivationCache) -> None:
        for layer in range(12):
            tl_connwalk.laplacian_residual(cache, layer, baseline_draws=2)
        tl_connwalk.layer_drift(cache)

    with torch.no_grad():
        caches = [model.run_with_cache(tokens[i], names_filter=names)[1] for i in range(2)]
        first = timed(lambda: measure_all(caches[0]))
        forward, second = [], []
        for _ in range(REPEATS):
            forward.append(timed(lambda: model.run_with_cache(tokens[1], names_filter=names)))
            second.append(timed(lambda: measure_all(caches[1])))
    fwd, sec = statistics.median(forward), statistics.median(second)
    return {"forward_s": fwd, "first_s": first, "second_s": sec, "second_min_s": min(second),
            "first_ratio": first / fwd, "second_ratio": sec / fwd}  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    sizes = [int(arg) for arg in sys.argv[1:]] or [256, 1024]
    print(json.dumps({"code": tl_connwalk.__file__, **{str(n): measure(n) for n in sizes}}))
