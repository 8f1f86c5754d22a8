"""Operations dispatched by each measurement, against the forward pass that made the cache.

On a GPU every dispatched operation is a kernel launch, and the measurements are bound by their
number rather than by their arithmetic. This counts them (`tl_connwalk.debug`: every ``aten``
operation, deterministic, no GPU needed) on a warm model (its head Grams already computed, as
for every cache after a model's first), for

- ``gpt2``: a random GPT-2-small shape (12 layers, d_model 768, 12 heads);
- ``llama16``: a random 16-layer Llama-style grouped-query model (d_model 512, 8 heads, 4 KV
  heads);
- ``smollm2``: SmolLM2-135M from `tl_connwalk.zoo` (a ``TransformerBridge``; converted and
  cached on first use);
- ``llama8b``: 8 random layers of a Llama-3-8B-like shape (d_model 4096, 32 heads of 128, 16
  key-value heads; named only: not among the default three);

each with one sequence of 256 tokens (``--tokens``), on the CPU (``--device cuda``: a GPU).
A GPU takes larger chunks and blocks of work than a CPU (`tl_connwalk.debug.device_budgets`);
``--device-budgets`` takes them on the CPU too, so that a CPU counts what a GPU launches;
they are a share of the GPU's memory, ``--device-memory GIB`` (default: the device's own, 64
GiB on the CPU).
``forward`` is the ``run_with_cache(tokens)`` pass that made the cache (every hook point
cached), ``forward_lean`` the same pass with ``names_filter=tl_connwalk.required_hooks(model)``.
Per measurement it prints the operations summed over the layers, per layer, and as a multiple
of ``forward``:
``walk`` (``connection_walk`` of each layer), ``residual`` (``laplacian_residual`` with its
8 baseline draws, on a walk built beforehand), ``isometry`` (``isometry_defects``, the same),
``drift`` (``layer_drift`` of the cache) and ``table`` (``geometry_table`` as a whole). With
``--repeats N`` (default 5) it also times ``geometry_table`` against ``run_with_cache``,
interleaved, and reports their medians and the ratio of the medians (``table_time_ratio``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/op_count.py            # all three models
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/op_count.py gpt2 --repeats 0
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/op_count.py gpt2 --tokens 1024 --device-budgets
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/op_count.py llama8b --tokens 1024 \
        --repeats 0 --device-budgets --device-memory 139   # as on an H200
    python benchmarks/op_count.py gpt2 llama8b --tokens 1024 --device cuda

One JSON line per model.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

import tl_connwalk
from tl_connwalk.cache import n_layers_of
from tl_connwalk.debug import count_operations, device_budgets, operations_of
from tl_connwalk.toy import VOCAB, random_bridge

MODELS = ("gpt2", "llama16", "smollm2", "llama8b")
#: the random models: name -> `random_bridge` options
RANDOM = {
    "gpt2": {"arch": "gpt2", "n_layers": 12, "d_model": 768, "n_heads": 12, "scale": 0.02},
    "llama16": {"arch": "llama", "n_layers": 16, "d_model": 512, "n_heads": 8},
    "llama8b": {"arch": "llama", "n_layers": 8, "d_model": 4096, "n_heads": 32, "scale": 0.02},
}


def build(name: str, n_pos: int, device: str = "cpu") -> nn.Module:
    """One of `MODELS`, attached, on ``device``."""
    if name in RANDOM:
        model = random_bridge(**RANDOM[name], n_ctx=n_pos, device=device)  # type: ignore[arg-type]
    else:
        model = tl_connwalk.zoo.load("smollm2-135m", backend="bridge", progress=False)
        model = model.to(device)
    return tl_connwalk.attach(model)


def tokens_for(model: nn.Module, n_pos: int) -> torch.Tensor:
    vocab = min(VOCAB, model.cfg.d_vocab)
    return torch.randint(0, vocab, (1, n_pos), generator=torch.Generator().manual_seed(1))


def _median_times(
    fn: Callable[[], object], other: Callable[[], object], repeats: int, device: str
) -> tuple[float, float]:
    """Medians of ``repeats`` timings of ``fn`` and ``other``, interleaved (``other`` then
    ``fn``), in seconds; on a GPU each timing waits for the device."""

    def wait() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {"fn": [], "other": []}
    for _ in range(repeats):
        for key, call in (("other", other), ("fn", fn)):
            wait()
            start = time.perf_counter()
            call()
            wait()
            times[key].append(time.perf_counter() - start)
    return statistics.median(times["fn"]), statistics.median(times["other"])


def measure(
    name: str,
    n_pos: int,
    repeats: int,
    device: str = "cpu",
    as_on_gpu: bool = False,
    memory: int | None = None,
) -> dict[str, Any]:
    """The counts (and with ``repeats`` the times) of one model at ``n_pos`` tokens; with
    ``as_on_gpu``, chunks and blocks sized as on a GPU on any device (`device_budgets`), of
    ``memory`` bytes where given."""
    model = build(name, n_pos, device)
    tokens = tokens_for(model, n_pos).to(device)
    names = tl_connwalk.required_hooks(model)

    def forward() -> Any:
        return model.run_with_cache(tokens)[1]

    def forward_lean() -> Any:
        return model.run_with_cache(tokens, names_filter=names)[1]

    def table() -> object:
        return tl_connwalk.geometry_table(cache, progress=False)

    with torch.no_grad(), device_budgets(memory) if as_on_gpu else nullcontext():
        cache = forward()
        table()  # warm: the head Grams of every layer are computed once per set of weights
        counts = {"forward": operations_of(forward).total}
        counts["forward_lean"] = operations_of(forward_lean).total
        layers = range(n_layers_of(cache))
        per_layer: dict[str, list[int]] = {"walk": [], "residual": [], "isometry": []}
        for layer in layers:
            with count_operations() as built:
                walk = tl_connwalk.connection_walk(cache, layer)
            per_layer["walk"].append(built.total)
            per_layer["residual"].append(operations_of(walk.laplacian_residual).total)
            walk = tl_connwalk.connection_walk(cache, layer)
            per_layer["isometry"].append(operations_of(walk.isometry_defects).total)
        counts |= {key: sum(values) for key, values in per_layer.items()}
        counts["drift"] = operations_of(lambda: tl_connwalk.layer_drift(cache)).total
        table_count = operations_of(table)
        counts["table"] = table_count.total
        times = _median_times(table, forward, repeats, device) if repeats else None
    return {
        "model": name,
        "tokens": n_pos,
        "layers": len(layers),
        "device": device,
        "budgets": _budgets(device, as_on_gpu, memory),
        "torch": torch.__version__,
        "operations": counts,
        "per_layer": {key: sum(values) / len(layers) for key, values in per_layer.items()},
        "per_forward": {key: round(n / counts["forward"], 2) for key, n in counts.items()},
        "table_most_common": table_count.most_common(8),
        "table_time_ratio": None if times is None else times[0] / times[1],
        "table_seconds": None if times is None else times[0],
        "forward_seconds": None if times is None else times[1],
    }


def _budgets(device: str, as_on_gpu: bool, memory: int | None) -> str:
    """Which budgets the work took: ``cpu``, ``device`` (the device's own, or a GPU of
    ``DEVICE_MEMORY`` on the CPU) or ``device (N GiB)``."""
    if torch.device(device).type == "cpu" and not as_on_gpu:
        return "cpu"
    return "device" if memory is None else f"device ({memory / 2**30:g} GiB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help=f"some of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timings (0: counts only)")
    parser.add_argument("--device", default="cpu", help="where the model runs (cuda: a GPU)")
    parser.add_argument(
        "--device-budgets", action="store_true",
        help="chunks and blocks sized as on a GPU, on any device (count what a GPU launches)",
    )  # fmt: skip
    parser.add_argument(
        "--device-memory", type=float, metavar="GIB",
        help="with --device-budgets: size them for a GPU of this memory in GiB (default: the "
        "device's own, else DEVICE_MEMORY, 64)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.device_memory is not None and not args.device_budgets:
        parser.error("--device-memory sizes --device-budgets: pass both")
    if args.device_memory is not None and args.device_memory * 2**30 < 1:
        parser.error(f"--device-memory {args.device_memory}: a GPU's memory in GiB, above 0")
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {MODELS}")
    torch.set_num_threads(1)
    for name in args.models or MODELS[:3]:
        memory = None if args.device_memory is None else int(args.device_memory * 2**30)
        result = measure(name, args.tokens, args.repeats, args.device, args.device_budgets, memory)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
