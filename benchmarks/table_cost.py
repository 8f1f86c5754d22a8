"""`geometry_table`'s CPU time against `run_with_cache`'s, first call and warm, one thread.

For each model (`op_count.MODELS`: the GPT-2-small shape, the 16-layer grouped-query Llama
shape, SmolLM2-135M) and each length, one fresh process (so that its first call is a
process's first call, caches of earlier cases not held) does:

1. ``run_with_cache`` three times (the first warms TransformerLens up, the rest are timed);
2. ``geometry_table`` of the last cache: the ``first`` call, which builds what a model's
   first table builds (head Grams, the baselines' draws);
3. ``REPEATS`` times, on caches of other tokens: ``run_with_cache``, then ``geometry_table``
   of its cache (``warm``).

Every time is ``time.process_time`` (the process's CPU time, which another process on the
machine does not inflate as much as the wall clock), with one thread. ``first_ratio`` is the
first call over the median forward pass, ``warm_ratio`` the median warm call over the same.
``--cold`` empties every cache first, the head Grams and draws kept on disk across processes
included (`tl_connwalk.clear_caches`): the first call is then a model's first ever; without
it, the first call of a process that finds them on disk. ``--profile`` prints the cProfile
of one warm call (and ``--profile-first`` of the first call) sorted by own time instead.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/table_cost.py
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/table_cost.py gpt2 --tokens 1024
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/table_cost.py gpt2 --profile

One JSON line per model and length.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: warm passes (each after a forward pass of its own tokens)
REPEATS = 3


def _cpu_seconds(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def measure(
    name: str, n_pos: int, draws: int, profile: str | None, cold: bool = False
) -> dict[str, object]:
    """One model at ``n_pos`` tokens, in this process (see the module docstring); ``cold``:
    every cache emptied first, the one on disk included (a model's first call ever)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import op_count

    import tl_connwalk

    torch.set_num_threads(1)
    if cold:
        tl_connwalk.clear_caches()
    model = op_count.build(name, n_pos)
    vocab = min(op_count.VOCAB, model.cfg.d_vocab)
    tokens = torch.randint(
        0, vocab, (REPEATS + 1, 1, n_pos), generator=torch.Generator().manual_seed(1)
    )

    def forward(i: int) -> object:
        return model.run_with_cache(tokens[i])[1]

    def table(cache: object) -> object:
        return tl_connwalk.geometry_table(cache, progress=False, baseline_draws=draws)

    forwards, warm = [], []
    with torch.no_grad():
        forward(0)
        forwards.append(_cpu_seconds(lambda: forward(0))[0])
        seconds, cache = _cpu_seconds(lambda: forward(0))
        forwards.append(seconds)
        if profile == "first":
            return _profiled(lambda: table(cache))
        first, _ = _cpu_seconds(lambda: table(cache))
        for i in range(1, REPEATS + 1):
            seconds, later = _cpu_seconds(lambda i=i: forward(i))
            forwards.append(seconds)
            if profile == "warm" and i == REPEATS:
                return _profiled(lambda later=later: table(later))
            warm.append(_cpu_seconds(lambda later=later: table(later))[0])
    fwd = statistics.median(forwards)
    return {
        "model": name,
        "tokens": n_pos,
        "baseline_draws": draws,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "forward_s": round(fwd, 3),
        "first_s": round(first, 3),
        "cold": cold,
        "warm_s": [round(t, 3) for t in warm],
        "first_ratio": round(first / fwd, 2),
        "warm_ratio": round(statistics.median(warm) / fwd, 2),
    }


def _profiled(fn: Callable[[], object]) -> dict[str, object]:
    profiler = cProfile.Profile(time.process_time)
    profiler.runcall(fn)
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    if os.environ.get("TABLE_COST_CALLERS"):
        stats.print_callers(os.environ["TABLE_COST_CALLERS"])
    return {"profiled": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help="gpt2, llama16, smollm2 (default: all three)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--draws", type=int, default=8, help="baseline_draws (default 8)")
    parser.add_argument("--profile", action="store_true", help="cProfile of a warm call")
    parser.add_argument("--profile-first", action="store_true", help="cProfile of the first")
    parser.add_argument(
        "--cold", action="store_true",
        help="empty every cache first, the head Grams and draws kept on disk included",
    )  # fmt: skip
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    profile = "first" if args.profile_first else "warm" if args.profile else None
    if args.inside:  # one case, in this process
        (name,), (n_pos,) = args.models, args.tokens
        print(json.dumps(measure(name, n_pos, args.draws, profile, args.cold)), flush=True)
        return
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    for name in args.models or ["gpt2", "llama16", "smollm2"]:
        for n_pos in args.tokens:
            command = [sys.executable, __file__, name, "--tokens", str(n_pos), "--inside"]
            command += ["--draws", str(args.draws)] + ["--cold"] * args.cold
            command += ["--profile"] * args.profile + ["--profile-first"] * args.profile_first
            subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
