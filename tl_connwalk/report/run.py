"""The report job: model and text in, a folder with the model's connection-walk geometry out.

`run_report` loads the model, runs it once on the text keeping only the hooks the walks
need, measures every chosen layer (identity check, laplacian residual with and without the
sink, `geometry_table` with a progress bar, layer drift) and writes

    report.json      run metadata, per-layer processing, identity errors, every
                     LaplacianResidual.to_dict() (sink kept and excluded), drift, findings
    geometry.csv     geometry_table() rows for exclude_sink False and True
    *.png            walks, head defects, layer drift, residual components, scale
    index.html       the findings, figures and summary table on one self-contained page

into a temporary folder beside ``out``, renamed into place only when everything is written: a
failure leaves no half-written report. An existing non-empty ``out`` is replaced only with
``overwrite=True``.
"""

import dataclasses
import importlib.metadata
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from rich.console import Console
from torch import nn

import tl_connwalk
from tl_connwalk.adapters import adapter_for, resolve_layers
from tl_connwalk.analysis import geometry_table
from tl_connwalk.cache import n_layers_of_model
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.report import figures, html, inputs, terminal
from tl_connwalk.report.findings import findings as find
from tl_connwalk.report.measure import Measurements, head_frame, measure, run_cache, summary_frame

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_OUT = Path("connwalk-report")
DEFAULT_MAX_TOKENS = 128
DEFAULT_BASELINE_DRAWS = 4
FILES = ("report.json", "geometry.csv", *(name for name, _ in figures.FIGURES), "index.html")


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    """What ``tl-connwalk report`` was asked for (its command-line options)."""

    model: str = DEFAULT_MODEL
    backend: inputs.Backend | None = None
    text: Path | None = None
    dataset: Path | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    out: Path = DEFAULT_OUT
    device: str = "cpu"
    dtype: str = "float32"
    layers: Sequence[int] | None = None
    baseline_draws: int = DEFAULT_BASELINE_DRAWS
    seed: int = 0
    overwrite: bool = False
    progress: bool = True


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, or a non-empty folder without ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ConnWalkError(f"--out {out} is a file; pass a folder for the report.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConnWalkError(
            f"--out {out} exists and is not empty; pass --overwrite to replace it, or choose "
            "another --out."
        )


def _publish(staging: Path, out: Path) -> None:
    # renames are atomic on one filesystem; an old report is moved aside, not deleted, until
    # the new one is in place
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
        try:
            os.rename(staging, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old)
    else:
        os.rename(staging, out)


def _layers(model: nn.Module, chosen: Sequence[int] | None) -> list[int]:
    """The report's layers, sorted, each once; negative counts from the end."""
    return sorted(set(resolve_layers(adapter_for(model), model, chosen)))


def heatmap_layers(layers: Sequence[int]) -> list[int]:
    """First, middle and last of ``layers`` (fewer when there are fewer)."""
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


def _finite(value: Any) -> Any:
    # strict JSON has no NaN: not-applicable values become null
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _geometry(
    config: ReportConfig, cache: Any, layers: list[int], results: Measurements
) -> pd.DataFrame:
    """The geometry table for both sink settings, from the residuals already measured."""
    tables = []
    for exclude_sink in (False, True):
        table = geometry_table(
            cache,
            layers,
            exclude_sink=exclude_sink,
            baseline_draws=config.baseline_draws,
            seed=config.seed,
            progress=False,
            residuals={
                m.layer: m.without_sink if exclude_sink else m.with_sink for m in results.layers
            },
        )
        tables.append(table.assign(exclude_sink=exclude_sink))
    return pd.concat(tables, ignore_index=True)


def _write(
    staging: Path,
    config: ReportConfig,
    record: dict[str, Any],
    results: Measurements,
    geometry: pd.DataFrame,
    found: dict[str, Any],
) -> None:
    summary, heads = summary_frame(results), head_frame(results)
    model = record["model"]
    subtitle = f"{model['name']} ({model['class']}), {record['tokens']['count']} tokens"
    draws = config.baseline_draws
    # float rounding of a row sum of n walk entries: what stochasticity shows of an exact walk
    working = torch.float64 if config.dtype == "float64" else torch.float32
    noise = record["tokens"]["count"] * torch.finfo(working).eps
    geometry.to_csv(staging / "geometry.csv", index=False)
    pngs = [
        figures.walk_heatmaps(results.walks, subtitle + ", sequence 0", staging / "walks.png"),
        figures.head_defects(heads, draws, subtitle, staging / "head_defects.png"),
        figures.layer_drift(results.drift, subtitle, staging / "layer_drift.png"),
        figures.residual_components(summary, draws, subtitle, staging / "residual.png", noise),
        figures.effective_scale(summary, subtitle, staging / "scale.png"),
    ]
    headings = dict(figures.FIGURES)
    meta = {
        "model": f"{model['name']} ({model['class']}, backend {model['backend']})",
        "TransformerLens": record["transformer_lens_version"],
        "weight processing": html.processing_lines([m.processing for m in results.layers]),
        "text": f"{record['text']['source']}: {record['text']['path']}",
        "tokens": record["tokens"]["count"],
        "layers": f"{len(record['layers'])} of {model['n_layers']}",
        "random baseline": f"{draws} draws, seed {config.seed}",
        "device, dtype": f"{config.device}, {config.dtype}",
    }
    texts = [item["text"] for item in found.values()]
    html.write_index(
        staging / "index.html",
        f"Connection-walk geometry of {model['name']}",
        meta,
        texts,
        [(png, headings[png.name]) for png in pngs],
        summary,
        {"residual.png": list(figures.residual_omissions(summary, noise).values())},
    )
    record["summary"] = summary.to_dict(orient="records")
    record["findings"] = found
    record["files"] = list(FILES)
    text = json.dumps(_finite(record), indent=1, allow_nan=False)
    (staging / "report.json").write_text(text + "\n", encoding="utf-8")


def run_report(config: ReportConfig, console: Console | None = None) -> Path:
    """Run the report job (see the module docstring); returns the report folder."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: room for the whole table
            console = Console(width=160)
    out = config.out
    check_out(out, config.overwrite)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConnWalkError("--device cuda but torch sees no CUDA device; use --device cpu.")
    if config.baseline_draws < 2:
        raise ConnWalkError(f"--baseline-draws must be >= 2, got {config.baseline_draws}.")
    timing: dict[str, float] = {}
    start = time.perf_counter()
    console.print(f"loading {config.model} ...", highlight=False)
    model, backend = inputs.load_model(
        config.model, config.backend, config.device, config.dtype, config.progress
    )
    timing["load_s"] = time.perf_counter() - start
    text, source = inputs.read_text(config.text, config.dataset)
    user_text = config.text is not None or config.dataset is not None
    tokens = inputs.tokens_for(model, config.model, text, user_text, config.max_tokens, config.seed)
    layers = _layers(model, config.layers)
    mark = time.perf_counter()
    cache, outputs = run_cache(model, tokens, layers)
    timing["forward_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    results = measure(
        cache,
        outputs,
        layers,
        heatmap_layers(layers),
        baseline_draws=config.baseline_draws,
        seed=config.seed,
        progress=config.progress,
    )
    timing["residuals_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    geometry = _geometry(config, cache, layers, results)
    timing["geometry_table_s"] = time.perf_counter() - mark
    summary = summary_frame(results)
    found = find(summary, head_frame(results), results.drift)
    cfg: Any = model.cfg
    processing = {str(m.processing) for m in results.layers}
    record: dict[str, Any] = {
        "model": {
            "name": config.model,
            "backend": backend,
            "class": type(model).__name__,
            "n_layers": n_layers_of_model(model),
            "n_heads": int(cfg.n_heads),
            "n_key_value_heads": getattr(cfg, "n_key_value_heads", None),
            "d_model": int(cfg.d_model),
            "d_head": int(cfg.d_head),
        },
        "transformer_lens_version": importlib.metadata.version("transformer-lens"),
        "tl_connwalk_version": tl_connwalk.__version__,
        "torch_version": torch.__version__,
        "device": config.device,
        "dtype": config.dtype,
        "text": source,
        "tokens": {
            "count": int(tokens.shape[-1]),
            "max_tokens": config.max_tokens,
            "ids": tokens[0].tolist(),
        },
        "baseline_draws": config.baseline_draws,
        "seed": config.seed,
        "processing_summary": "; ".join(sorted(processing)),
        "layers": [m.to_dict() for m in results.layers],
        "layer_drift": {key: value.tolist() for key, value in results.drift.items()},
        "timing": timing,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write(staging, config, record, results, geometry, found)
        check_out(out, config.overwrite)  # nothing appeared there meanwhile
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    title = f"{config.model}: connection-walk geometry, {tokens.shape[-1]} tokens"
    texts = [item["text"] for item in found.values()]
    terminal.print_summary(console, title, summary, texts, str(out))
    console.print(
        f"time: load {timing['load_s']:.0f}s, forward {timing['forward_s']:.0f}s, "
        f"residuals {timing['residuals_s']:.0f}s, geometry table "
        f"{timing['geometry_table_s']:.0f}s, total {time.perf_counter() - start:.0f}s",
        highlight=False,
    )
    return out
