"""Benchmarks as ratios against TransformerLens's own forward pass, measured side by side.

Run: ``.venv/bin/python benchmarks/bench.py [--quick]``. Threads are pinned (``--threads``,
default 1) so that the two sides of each ratio see the same machine; every timing is the
median of interleaved repetitions. Peak memory is measured in a fresh subprocess per case as
the growth of the process's peak resident set (``ru_maxrss``) over the case's inputs.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformer_lens import ActivationCache

import tl_connwalk
from tl_connwalk.core._fast import draws, head_grams
from tl_connwalk.toy import VOCAB, random_bridge


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_ratio(
    ours: Callable[[], object], reference: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """(ours seconds, reference seconds, ratio), alternating the two to share machine noise."""
    ours(), reference()  # warm up
    a, b = [], []
    for _ in range(repeats):
        a.append(median_seconds(ours, 1))
        b.append(median_seconds(reference, 1))
    return statistics.median(a), statistics.median(b), statistics.median(a) / statistics.median(b)


def layer_cost(n_pos: int, repeats: int) -> dict[str, float]:
    """Building one layer's walk and applying it, vs one forward pass with run_with_cache."""
    model = random_bridge("llama", n_layers=4, d_model=256, n_heads=8)
    tokens = torch.randint(0, VOCAB - 1, (1, n_pos))
    names = tl_connwalk.required_hooks(model)
    _, cache = model.run_with_cache(tokens, names_filter=names)

    def ours() -> None:
        walk = tl_connwalk.connection_walk(cache, 2)
        walk.apply() + walk.bias()

    def forward() -> None:
        with torch.no_grad():
            model.run_with_cache(tokens, names_filter=names)

    t_ours, t_ref, ratio = interleaved_ratio(ours, forward, repeats)
    return {"tokens": n_pos, "walk_apply_bias_s": t_ours, "forward_s": t_ref, "ratio": ratio}


def hook_overhead(n_pos: int, repeats: int) -> dict[str, float]:
    """Attached forward (no conn hook used) vs plain; caching the conn points vs their inputs."""
    import warnings

    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=4, d_model=256, n_heads=8, d_head=32, d_mlp=1024, n_ctx=n_pos, d_vocab=1000,
        act_fn="gelu_new", normalization_type="LN", seed=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, attached = HookedTransformer(cfg), HookedTransformer(cfg)
    attached.load_state_dict(plain.state_dict())
    tl_connwalk.attach(attached)
    tokens = torch.randint(0, 1000, (4, n_pos))
    points = ("conn_walk", "conn_gates", "conn_messages")
    conn = [f"blocks.{layer}.attn.hook_{p}" for layer in range(4) for p in points]
    inputs = [f"blocks.{layer}.attn.hook_{p}" for layer in range(4) for p in ("pattern", "v")]

    def forward(model: torch.nn.Module) -> Callable[[], object]:
        return lambda: model(tokens)

    def cached(names: list[str]) -> Callable[[], object]:
        return lambda: attached.run_with_cache(tokens, names_filter=names)

    with torch.no_grad():
        _, _, idle = interleaved_ratio(forward(attached), forward(plain), repeats)
        _, _, caching = interleaved_ratio(cached(conn), cached(inputs), repeats)
    tl_connwalk.detach(attached)
    return {
        "tokens": n_pos,
        "attached_vs_plain_forward": idle,
        "cache_conn_vs_cache_inputs": caching,
    }


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(where: torch.device, fn: Callable[[], object]) -> float:
    """Seconds of ``fn()`` including the device work it queued."""
    _sync(where)
    start = time.perf_counter()
    fn()
    _sync(where)
    return time.perf_counter() - start


def gpt2_small(n_pos: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A random GPT-2-small-shaped Bridge (12 layers, d_model 768, 12 heads of 64)."""
    return random_bridge(
        "gpt2", n_layers=12, d_model=768, n_heads=12, scale=0.02, n_ctx=n_pos, device=device
    )


def measure_every_layer(cache: ActivationCache, baseline_draws: int = 2) -> None:
    """``laplacian_residual`` of every layer of a `gpt2_small` cache, then the layer drift."""
    for layer in range(12):
        tl_connwalk.laplacian_residual(cache, layer, baseline_draws=baseline_draws)
    tl_connwalk.layer_drift(cache)


class _Peak:
    """Peak memory growth over the start: the process's resident set on CPU, the caching
    allocator's peak on CUDA (``torch.cuda.max_memory_allocated``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_allocated(device)
        else:
            self.start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.start
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start


def all_measurements(n_pos: int, baseline_draws: int, device: str = "cpu") -> dict[str, object]:
    """Every measurement on every layer of a GPT-2-small-shaped random model vs run_with_cache.

    12 layers, d_model 768, 12 heads of 64; batch 1. ``laplacian_residual`` per layer with the
    given number of baseline draws, plus layer drift. ``cold``: once, on a first cache with
    nothing computed before (the random draws, the field draws of this many keys and every
    layer's weight-only head Grams are computed inside the timing). ``warm``: on a cache of
    other tokens of the same model (what each further prompt or batch costs: the head Grams
    come from `core.head_grams`' store), the median of three passes, each right after a
    ``run_with_cache`` pass of the same tokens; the forward time is the median of those three
    and of three passes before the cold one.
    Peak memory: growth of the process peak (CPU) or of the allocator's peak (CUDA) over the
    caches during the cold pass and one warm pass (before the interleaved forward passes,
    whose own caches would count), against the cached patterns.
    """
    where = torch.device(device)
    model = gpt2_small(n_pos, where)
    tokens = torch.randint(0, VOCAB - 1, (2, 1, n_pos)).to(where)
    names = tl_connwalk.required_hooks(model)

    def measure_all(cache: ActivationCache) -> None:
        measure_every_layer(cache, baseline_draws)

    def forward_pass() -> object:
        return model.run_with_cache(tokens[1], names_filter=names)

    with torch.no_grad():
        forward: list[float] = []
        caches: dict[int, ActivationCache] = {}
        for rep in range(4):  # a warm-up pass, then three; one cache per tokens
            caches.pop(rep % 2, None)
            start = time.perf_counter()
            _, caches[rep % 2] = model.run_with_cache(tokens[rep % 2], names_filter=names)
            _sync(where)
            forward.append(time.perf_counter() - start)
        del forward[0]
        first, second = caches[0], caches[1]
        patterns = sum(first[n].numel() * 4 for n in names if n.endswith("hook_pattern"))
        draws.raw_draws.cache_clear()
        draws.key_draws.cache_clear()
        head_grams.cache_clear()
        peak = _Peak(where)
        cold = timed(where, lambda: measure_all(first))
        measure_all(second)  # the peak covers a cold and a warm pass, no further cache
        peak_bytes = peak.bytes()
        warm = []
        for _ in range(3):
            forward.append(timed(where, forward_pass))
            warm.append(timed(where, lambda: measure_all(second)))
    reference = statistics.median(forward)
    return {"device": device, "tokens": n_pos, "baseline_draws": baseline_draws,
            "cold_s": cold, "warm_s": statistics.median(warm), "run_with_cache_s": reference,
            "cold_ratio": cold / reference, "warm_ratio": statistics.median(warm) / reference,
            "warm_ratios": [w / reference for w in warm],
            "peak_extra_over_patterns": peak_bytes / patterns}  # fmt: skip


#: (query heads, key-value heads, d_head, d_model) of the layer shapes benchmarked alone
SHAPES = {"llama8b": (32, 8, 128, 4096), "gpt2": (12, 12, 64, 768)}


def layer_operands(n_pos: int, shape: str = "llama8b") -> tuple[torch.Tensor, ...]:
    """Pattern (causal, random), field, W_V, W_O of one layer of a shape in ``SHAPES``.

    Built in place, so that setting up does not raise the peak above the inputs themselves.
    Key-value heads are expanded to the query heads, as TransformerLens does.
    """
    heads, kv_heads, d_head, d_model = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    pattern = torch.rand(1, heads, n_pos, n_pos, generator=gen).tril_()
    pattern /= pattern.sum(-1, keepdim=True)
    field = torch.randn(1, n_pos, d_model, generator=gen)
    W_V = torch.randn(kv_heads, d_model, d_head, generator=gen) / d_model**0.5
    W_V = W_V.repeat_interleave(heads // kv_heads, 0)
    W_O = torch.randn(heads, d_head, d_model, generator=gen) / d_model**0.5
    return pattern, field, W_V, W_O


def layer_residual(
    n_pos: int, shape: str, baseline_draws: int = 2, device: str = "cpu"
) -> dict[str, object]:
    """laplacian_residual of one layer (all edges), cold and warm.

    ``seconds`` (cold): the first walk of these weights, with the head-Gram store and the
    shared draws (raw and field draws) emptied first, so the layer's and the draws' terms are
    computed inside the timing; ``peak_extra_MiB``: growth over the built walk during it.
    ``warm_seconds``: a new walk of the same pattern and weights (what each further prompt
    costs: both kept).
    """
    where = torch.device(device)
    operands = [t.to(where) for t in layer_operands(n_pos, shape)]
    n_pattern = operands[0].numel()

    def residual_seconds(walk: tl_connwalk.ConnectionWalk) -> float:
        return timed(where, lambda: walk.laplacian_residual(baseline_draws=baseline_draws))

    draws.raw_draws.cache_clear()
    draws.key_draws.cache_clear()
    head_grams.cache_clear()
    walk = tl_connwalk.ConnectionWalk.from_pattern(*operands)
    peak = _Peak(where)  # growth over the built walk
    cold = residual_seconds(walk)
    peak_bytes = peak.bytes()
    del walk
    warm = residual_seconds(tl_connwalk.ConnectionWalk.from_pattern(*operands))
    return {"device": device, "tokens": n_pos, "baseline_draws": baseline_draws,
            "seconds": cold, "warm_seconds": warm, "peak_extra_MiB": peak_bytes / 2**20,
            "pattern_MiB": n_pattern * 4 / 2**20}  # fmt: skip


def llama8b_layer(n_pos: int = 2048) -> dict[str, float]:
    """One Llama-3-8B-shaped layer (32 heads, 8 KV heads, d_head 128, d_model 4096) at n_pos."""
    pattern, field, W_V, W_O = layer_operands(n_pos)
    peak = _Peak(torch.device("cpu"))
    start = time.perf_counter()
    walk = tl_connwalk.ConnectionWalk.from_pattern(pattern, field, W_V, W_O)
    walk.apply() + walk.bias()
    seconds = time.perf_counter() - start
    return {"tokens": n_pos, "seconds": seconds, "peak_extra_MiB": peak.bytes() / 2**20,
            "pattern_MiB": pattern.numel() * 4 / 2**20}  # fmt: skip


def analyze_throughput(
    n_pos: int = 256,
    batch: int = 4,
    n_batches: int = 4,
    baseline_draws: int = 8,
    repeats: int = 3,
    device: str = "cpu",
) -> dict[str, object]:
    """``analyze`` over ``n_batches`` batches vs ``run_with_cache`` of the same batches.

    Random 4-layer Llama-style ``TransformerBridge`` (d_model 256, 8 heads, 4 KV heads); the
    reference keeps the same hooks (``names_filter=required_hooks(model)``), so the ratio is
    what measuring every layer costs on top of the forward passes analyze makes anyway.
    """
    where = torch.device(device)
    model = random_bridge("llama", n_layers=4, d_model=256, n_heads=8, n_ctx=n_pos, device=where)
    tokens = torch.randint(0, VOCAB - 1, (batch * n_batches, n_pos)).to(where)
    names = tl_connwalk.required_hooks(model)

    def ours() -> None:
        head_grams.cache_clear()  # each repetition computes every layer's head Grams anew
        tl_connwalk.analyze(
            model, tokens, batch_size=batch, baseline_draws=baseline_draws, progress=False
        )
        _sync(where)

    def forward() -> None:
        with torch.no_grad():
            for part in tokens.split(batch):
                model.run_with_cache(part, names_filter=names)
        _sync(where)

    t_ours, t_ref, ratio = interleaved_ratio(ours, forward, repeats)
    n_tokens = tokens.numel()
    return {"device": device, "tokens_per_batch": batch * n_pos, "batches": n_batches,
            "baseline_draws": baseline_draws, "analyze_tokens_per_s": n_tokens / t_ours,
            "forward_tokens_per_s": n_tokens / t_ref, "ratio": ratio}  # fmt: skip


#: (positions, sequences per batch, batches, baseline draws) of the data-parallel case
DP_WORK = (256, 4, 8, 2)


def _dp_model_and_tokens() -> tuple[torch.nn.Module, torch.Tensor]:
    """The same model and tokens in every process (seeded): 4-layer Llama-style Bridge."""
    n_pos, batch, n_batches, _ = DP_WORK
    model = random_bridge("llama", n_layers=4, d_model=256, n_heads=8, n_ctx=n_pos)
    gen = torch.Generator().manual_seed(0)
    return model, torch.randint(0, VOCAB - 1, (batch * n_batches, n_pos), generator=gen)


def _timed_analyze(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """Seconds of one ``analyze`` over the tokens, after a one-batch warm-up."""
    _, batch, _, draws = DP_WORK
    options = {"batch_size": batch, "baseline_draws": draws, "progress": False}
    tl_connwalk.analyze(model, tokens, max_batches=1, distributed=False, **options)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    tl_connwalk.analyze(model, tokens, **options)
    return time.perf_counter() - start


def _dp_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    model, tokens = _dp_model_and_tokens()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        seconds = _timed_analyze(model, tokens)
        if rank == 0:
            Path(out_file).write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def analyze_data_parallel(world: int = 2) -> dict[str, float]:
    """``analyze`` in one process vs ``world`` gloo processes (one thread each), same batches.

    Each process warms up on one batch first (which also draws its random baselines); the
    timed pass is the whole corpus, the ranks' results merged on rank 0 and broadcast.
    """
    model, tokens = _dp_model_and_tokens()
    single = _timed_analyze(model, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "seconds.json"))
        mp.spawn(_dp_worker, args=(world, str(Path(tmp, "init")), out), nprocs=world)
        parallel = json.loads(Path(out).read_text())
    n_pos, batch, n_batches, draws = DP_WORK
    return {"processes": world, "tokens": batch * n_batches * n_pos, "draws": draws,
            "single_s": single, "parallel_s": parallel, "speedup": single / parallel}  # fmt: skip


def bridge_hook_overhead(n_pos: int, repeats: int) -> dict[str, float]:
    """``hook_overhead`` on a random GPT-2 ``TransformerBridge`` (TransformerLens 3.x and 4.x)."""
    size = dict(n_layers=4, d_model=256, n_heads=8, n_ctx=n_pos)
    plain, attached = random_bridge("gpt2", **size), random_bridge("gpt2", **size)
    tl_connwalk.attach(attached)
    tokens = torch.randint(0, VOCAB, (4, n_pos))
    points = ("conn_walk", "conn_gates", "conn_messages")
    conn = [f"blocks.{layer}.attn.hook_{p}" for layer in range(4) for p in points]
    inputs = [f"blocks.{layer}.attn.hook_{p}" for layer in range(4) for p in ("pattern", "v")]
    with torch.no_grad():
        _, _, idle = interleaved_ratio(lambda: attached(tokens), lambda: plain(tokens), repeats)
        _, _, caching = interleaved_ratio(
            lambda: attached.run_with_cache(tokens, names_filter=conn),
            lambda: attached.run_with_cache(tokens, names_filter=inputs),
            repeats,
        )
    tl_connwalk.detach(attached)
    return {
        "tokens": n_pos,
        "attached_vs_plain_forward": idle,
        "cache_conn_vs_cache_inputs": caching,
    }


def kernels(n_pos: int, repeats: int = 9) -> dict[str, float]:
    """Milliseconds of the per-layer pieces of ``laplacian_residual`` on GPT-2-small heads.

    One causal random layer (12 heads of 64, d_model 768) and two random draws as the other
    families, as in ``laplacian_residual(baseline_draws=2)``: message Grams of one family by
    the messages and through the stored output Gram, the per-edge pass of three families
    (`isometry.gram_means`), the field pass of three families, and the weight-only terms
    (`isometry.head_factor_grams`, `head_grams.compute_head_grams`). Medians of ``repeats``.
    """
    from tl_connwalk.core import field_defect, isometry
    from tl_connwalk.core import walk as core_walk

    pattern, field, W_V, W_O = layer_operands(n_pos, "gpt2")
    walk, gates = core_walk.walk_matrix(pattern), core_walk.gates(pattern)
    families = [head_grams.compute_head_grams(W_V, W_O)]
    generators = [torch.Generator().manual_seed(d) for d in range(2)]
    factors = [isometry.gaussian_factors(W_V.shape, W_O.shape, W_V.dtype, W_V.device, generator)
               for generator in generators]  # fmt: skip
    families += [head_grams.compute_head_grams(*pair) for pair in factors]
    K2 = torch.stack([f.K2 for f in families])
    pair_gram = torch.stack([f.pair_gram for f in families])
    out_rows = families[0].out_rows
    grams = torch.stack([field_defect.message_grams(field, W_V, W_O)] * 3)
    rank = isometry.effective_rank(W_V, W_O)

    def ms(fn: Callable[[], object]) -> float:
        fn()  # warm up
        return 1e3 * median_seconds(fn, repeats)

    return {
        "tokens": n_pos,
        "message_grams_messages_ms": ms(lambda: field_defect.message_grams(field, W_V, W_O)),
        "message_grams_out_rows_ms": ms(
            lambda: field_defect.message_grams(field, W_V, W_O, out_rows=out_rows)
        ),
        "gram_means_3_families_ms": ms(
            lambda: isometry.gram_means(walk, gates, K2, pair_gram, rank)
        ),
        "field_pass_3_families_ms": ms(
            lambda: field_defect.field_isometry_defects(field, walk, gates, grams)
        ),
        "head_factor_grams_ms": ms(lambda: isometry.head_factor_grams(W_V, W_O)),
        "compute_head_grams_ms": ms(lambda: head_grams.compute_head_grams(W_V, W_O)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="256 and 1024 tokens only")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.case == "llama8b":
        print(json.dumps(llama8b_layer()))
        return
    if args.case == "kernels":
        print(json.dumps([kernels(n) for n in (256, 1024)]))
        return
    if args.case == "gpt2_all":
        print(json.dumps([all_measurements(n, 2) for n in (256, 1024)]))
        return
    if args.case == "llama8b_residual":
        print(json.dumps(layer_residual(512, "llama8b")))
        return
    if args.case == "long_residual":
        print(json.dumps(layer_residual(8192, "gpt2")))
        return
    if args.case == "hooks":
        print(json.dumps(hook_overhead(256, repeats=15)))
        return
    if args.case == "hooks_bridge":
        print(json.dumps(bridge_hook_overhead(256, repeats=15)))
        return
    if args.case == "analyze":
        print(json.dumps(analyze_throughput()))
        return
    if args.case == "analyze_dp":
        print(json.dumps(analyze_data_parallel()))
        return
    results: dict[str, object] = {"threads": args.threads, "torch": torch.__version__}
    sizes = [256, 1024] if args.quick else [256, 1024, 4096]
    results["layer_cost"] = [layer_cost(n, repeats=5 if n < 4096 else 3) for n in sizes]
    results["hook_overhead"] = hook_overhead(256, repeats=15)
    results["analyze"] = analyze_throughput(repeats=1 if args.quick else 3)
    if not args.quick:
        run = [sys.executable, __file__, "--case", "llama8b", "--threads", str(args.threads)]
        out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
        results["llama8b_layer_2048"] = json.loads(out)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
