"""All measurements on every layer of a GPT-2-small shape, for old-against-new comparisons.

Run the same file against two checkouts, back to back, one thread each::

    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/old .venv/bin/python benchmarks/compare.py
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/compare.py

It uses only the public API that every version has (``laplacian_residual``, ``layer_drift``,
``required_hooks``), so it runs on older code than `bench.py`. Two caches of other tokens are
measured in turn (``first``, ``second``: what a model's first and a further prompt cost),
against ``run_with_cache`` of the same tokens (the median of three).
"""

import json
import statistics
import sys
import time

import torch

import tl_connwalk
from tl_connwalk.toy import VOCAB, random_bridge


def measure(n_pos: int) -> dict[str, float]:
    model = random_bridge("gpt2", n_layers=12, d_model=768, n_heads=12, scale=0.02, n_ctx=n_pos)
    tokens = torch.randint(0, VOCAB - 1, (2, 1, n_pos), generator=torch.Generator().manual_seed(1))
    names = tl_connwalk.required_hooks(model)
    with torch.no_grad():
        caches = [model.run_with_cache(tokens[i], names_filter=names)[1] for i in range(2)]
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model.run_with_cache(tokens[0], names_filter=names)
            times.append(time.perf_counter() - start)
    forward = statistics.median(times)
    seconds = []
    for cache in caches:
        start = time.perf_counter()
        for layer in range(12):
            tl_connwalk.laplacian_residual(cache, layer, baseline_draws=2)
        tl_connwalk.layer_drift(cache)
        seconds.append(time.perf_counter() - start)
    return {"forward_s": forward, "first_s": seconds[0], "second_s": seconds[1],
            "first_ratio": seconds[0] / forward, "second_ratio": seconds[1] / forward}  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    sizes = [int(arg) for arg in sys.argv[1:]] or [256, 1024]
    print(json.dumps({"code": tl_connwalk.__file__, **{str(n): measure(n) for n in sizes}}))
