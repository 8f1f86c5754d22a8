"""The cost of ``tl_connwalk.attribute`` against ``run_with_cache``, same process.

``--method``: the exact method (``connection``, the default) or ``knockout_estimate`` (one
forward and one backward pass of the real model, and its ``exact`` sources knocked out for
real: for one target on a causal ``HookedTransformer``, about one forward pass more).

Two models: SmolLM2-135M from the zoo (30 layers, d_model 576) and a GPT-2-small-shaped random
``HookedTransformer`` (12 layers, d_model 768, 12 heads, vocabulary 50,257); one sequence of 256
and of 1,024 tokens; one CPU thread; after one untimed call of each, the median of ``--repeats``
runs of each, the two timed alternately, in CPU seconds of the process (``time.process_time``:
what the call computes, little moved by other work on the machine). Peak memory is the largest
resident-set growth during the first call in a fresh process (sampled every 2 ms), in MiB, in
``n^2 d_model`` float32s and against ``run_with_cache``'s own; those processes (not the timed
ones) run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB, so every tensor of that size
or more is handed back to the system when freed and the resident set follows the tensors alive
(with the default, adaptive threshold, glibc keeps freed blocks, and the resident set records
when a call happened to allocate rather than what it held). The baselines that rerun the model,
knockout (one forward pass per source, batched) and value zeroing (each layer once per source),
cost about ``n`` forward passes each: they are timed once, at ``--baseline-tokens`` (64), beside
the exact method at that length:

    OMP_NUM_THREADS=1 nice python benchmarks/attribution_cost.py
"""

import argparse
import collections
import functools
import multiprocessing
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import tl_connwalk


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def cpu_seconds(run: Callable[[], object]) -> float:
    """CPU seconds of one call of ``run``."""
    start = time.process_time()
    run()
    return time.process_time() - start


def peak_growth(run: Callable[[], object]) -> int:
    """The peak resident-set growth (bytes) during one call of ``run``."""
    start_rss, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss() - start_rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    run()
    done.set()
    sampler.join()
    return max(peak[0], _rss() - start_rss)


def gpt2_small() -> torch.nn.Module:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=12, d_model=768, d_head=64, n_heads=12, d_mlp=3072, n_ctx=1024, d_vocab=50257,
        act_fn="gelu_new", normalization_type="LN", seed=0, device="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HookedTransformer(cfg).eval()


def setup(name: str, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model = gpt2_small() if name == "gpt2-small-random" else tl_connwalk.zoo.load(name)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, n), generator=torch.Generator().manual_seed(0))
    return model, tokens


def first_peak(name: str, n: int, what: str, method: str = "connection") -> tuple[int, int]:
    """Peak resident-set growth of the first ``run_with_cache`` or ``attribute`` call, and
    the model's ``d_model``."""
    model, tokens = setup(name, n)
    d_model = int(model.cfg.d_model)
    if what == "run_with_cache":
        with torch.no_grad():
            return peak_growth(functools.partial(model.run_with_cache, tokens)), d_model
    run = functools.partial(tl_connwalk.attribute, model, tokens, method=method)
    return peak_growth(run), d_model


def timings(
    name: str, n: int, repeats: int, baselines: bool, method: str = "connection"
) -> tuple[float, float, str]:
    """Median seconds of ``run_with_cache`` and ``attribute``, alternating; the baselines'."""
    model, tokens = setup(name, n)
    cache = functools.partial(model.run_with_cache, tokens)
    exact_run = functools.partial(tl_connwalk.attribute, model, tokens, method=method)
    with torch.no_grad():  # the first call in a process pays one-off set-up: not timed
        cache()
    exact_run()
    base, exact = [], []
    for _ in range(repeats):
        with torch.no_grad():
            base.append(cpu_seconds(cache))
        exact.append(cpu_seconds(exact_run))
    b, e = statistics.median(base), statistics.median(exact)
    knock = "n/a | n/a | n/a | n/a"
    if baselines:
        k = cpu_seconds(functools.partial(exact_run, method="knockout"))
        v = cpu_seconds(functools.partial(exact_run, method="value_zeroing"))
        knock = f"{k:.1f} | {k / b:.0f} | {v:.1f} | {v / b:.0f}"
    return b, e, knock


def parts(name: str, n: int) -> dict[str, float]:
    """Where ``knockout_estimate``'s time goes, in ``run_with_cache``s of the same tokens (one
    call after an untimed one): the forward pass with gradients, the backward pass (block
    recomputation and edge effects included), the edge effects alone and each knockout run
    (by the number of positions it computes); a plain forward pass for scale."""
    from tl_connwalk.attribution import blocking
    from tl_connwalk.attribution import knockout_estimate as estimate

    model, tokens = setup(name, n)
    seconds: dict[str, float] = collections.defaultdict(float)

    def timed(key: Callable[..., str], function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[key(*args)] += time.process_time() - start

        return run

    def which(model: Any, tokens: torch.Tensor, *_: Any) -> str:
        if torch.is_grad_enabled():
            return "forward pass with gradients"
        return f"knockout run of {tokens.shape[1]} position(s)"

    estimate.run_until = timed(which, estimate.run_until)  # type: ignore[assignment]
    torch.autograd.backward = timed(lambda *_: "backward pass", torch.autograd.backward)
    blocking.edge_effects = timed(lambda *_: "of which edge effects", blocking.edge_effects)  # type: ignore[assignment]
    run = functools.partial(tl_connwalk.attribute, model, tokens, method="knockout_estimate")
    run()
    with torch.no_grad():
        base = cpu_seconds(functools.partial(model.run_with_cache, tokens))
        plain = cpu_seconds(functools.partial(model, tokens))
    seconds.clear()
    total = cpu_seconds(run)
    return {
        "plain forward pass (every logit)": plain / base,
        **{k: v / base for k, v in seconds.items()},
        "in all": total / base,
    }


#: glibc's setting for the peak-memory processes (read by each new process's allocator)
PEAK_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def fresh(
    function: Callable[..., Any], *args: Any, environment: dict[str, str] | None = None
) -> Any:
    """``function(*args)`` in a new process, with ``environment`` added to its own."""
    saved = dict(os.environ)
    os.environ.update(environment or {})
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(function, args)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gpt2-small-random"])
    parser.add_argument(
        "--baselines", action=argparse.BooleanOptionalAction, default=True,
        help="also time knockout and value zeroing",
    )  # fmt: skip
    parser.add_argument("--baseline-tokens", type=int, default=64)
    parser.add_argument(
        "--method", default="connection", choices=["connection", "knockout_estimate"]
    )
    parser.add_argument(
        "--parts", action="store_true",
        help="instead, where knockout_estimate's time goes, in run_with_caches",
    )  # fmt: skip
    args = parser.parse_args()
    if args.parts:
        for name in args.models:
            for n in args.tokens:
                shares = fresh(parts, name, n)
                print(
                    f"{name}, {n} tokens: " + "; ".join(f"{k} {v:.2f}" for k, v in shares.items())
                )
        return
    print(f"method={args.method!r}")
    print("| model | tokens | run_with_cache (s) | attribute (s) | ratio | peak MiB | "
          "peak / n^2 d_model floats | peak / run_with_cache's | knockout (s) | knockout ratio "
          "| value zeroing (s) | value zeroing ratio |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        lengths = [*args.tokens, *([args.baseline_tokens] if args.baselines else [])]
        for n in dict.fromkeys(lengths):
            baselines = args.baselines and n == args.baseline_tokens
            b, e, knock = fresh(timings, name, n, args.repeats, baselines, args.method)
            p, d_model = fresh(
                first_peak, name, n, "attribute", args.method, environment=PEAK_ENVIRONMENT
            )
            p_cache, _ = fresh(first_peak, name, n, "run_with_cache", environment=PEAK_ENVIRONMENT)
            print(f"| {name} | {n} | {b:.2f} | {e:.2f} | {e / b:.2f} | {p / 2**20:.0f} | "
                  f"{p / (4 * n * n * d_model):.2f} | {p / p_cache:.2f} | {knock} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
