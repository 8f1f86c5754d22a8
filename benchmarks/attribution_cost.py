"""The cost of ``tl_connwalk.attribute`` (exact method) against ``run_with_cache``, same process.

A GPT-2-small-shaped random ``HookedTransformer`` (12 layers, d_model 768, 12 heads, vocabulary
50,257), one sequence of 256 tokens, best of three runs each, one CPU thread:

    OMP_NUM_THREADS=1 python benchmarks/attribution_cost.py
"""

import time
import warnings
from collections.abc import Callable

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

import tl_connwalk


def best(run: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    cfg = HookedTransformerConfig(
        n_layers=12, d_model=768, d_head=64, n_heads=12, d_mlp=3072, n_ctx=1024, d_vocab=50257,
        act_fn="gelu_new", normalization_type="LN", seed=0, device="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HookedTransformer(cfg).eval()
    tokens = torch.randint(0, 50257, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = best(lambda: model.run_with_cache(tokens))
    exact = best(lambda: tl_connwalk.attribute(model, tokens))
    print(f"run_with_cache {base:.3f} s, attribute {exact:.3f} s, ratio {exact / base:.2f}")


if __name__ == "__main__":
    main()
