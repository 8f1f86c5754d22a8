"""``analyze``: the geometry table of a whole corpus, streamed batch by batch.

Texts are tokenized, concatenated and cut into windows of ``seq_len`` tokens (each starting
with the tokenizer's BOS token when it has one), the way corpus statistics are usually taken;
token tensors are used as given. Each batch runs through the model keeping only the hooks the
walks need (``names_filter``), its :func:`~tl_connwalk.analysis.geometry_table` is folded into
running sums, and the cache is dropped: memory stays at one batch.
"""

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from tl_connwalk.analysis import geometry_table
from tl_connwalk.cache import n_layers_of_model, required_hooks
from tl_connwalk.errors import ConnWalkError

#: Columns that identify a row rather than measure something.
KEYS = ("layer", "head")


def token_windows(model: nn.Module, texts: Iterable[str], seq_len: int) -> Iterator[Tensor]:
    """Windows ``[seq_len]`` of the concatenated, tokenized ``texts`` (BOS first if any)."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConnWalkError(
            "this model has no tokenizer, so analyze() cannot tokenize text; pass token "
            "tensors [batch, pos] instead."
        )
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    body = seq_len - len(bos)
    if body < 1:
        raise ConnWalkError(f"seq_len={seq_len} leaves no room for text after the BOS token.")
    buffer: list[int] = []
    for text in texts:
        buffer += tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(buffer) >= body:
            yield torch.tensor(bos + buffer[:body])
            buffer = buffer[body:]


def _batches(model: nn.Module, data: Any, batch_size: int, seq_len: int) -> Iterator[Tensor]:
    if isinstance(data, Tensor):
        if data.ndim != 2 or data.dtype not in (torch.int64, torch.int32):
            raise ConnWalkError(
                f"token tensors must be integer [batch, pos], got {data.dtype} {tuple(data.shape)}."
            )
        yield from data.split(batch_size)
        return
    if hasattr(data, "column_names"):  # a datasets.Dataset: its "text" column
        if "text" not in data.column_names:
            raise ConnWalkError(f"the dataset has no 'text' column: {data.column_names}.")
        data = (row["text"] for row in data)
    items = iter(data)
    first = next(items, None)
    if first is None:
        raise ConnWalkError("analyze() got no data: pass texts or token tensors.")
    if isinstance(first, Tensor):
        for item in itertools.chain([first], items):
            yield from _batches(model, item, batch_size, seq_len)
        return
    windows = token_windows(model, itertools.chain([first], items), seq_len)
    batch: list[Tensor] = []
    for window in windows:
        batch.append(window)
        if len(batch) == batch_size:
            yield torch.stack(batch)
            batch = []
    if batch:
        yield torch.stack(batch)


def analyze(
    model: Any,
    data: Any,
    *,
    batch_size: int = 8,
    seq_len: int = 128,
    layers: Iterable[int] | None = None,
    max_batches: int | None = None,
    exclude_sink: bool = False,
    baseline_draws: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """The :func:`~tl_connwalk.analysis.geometry_table` of a corpus, aggregated over batches.

    Args:
        model: a supported TransformerLens model.
        data: an iterable of strings, a ``datasets.Dataset`` with a ``"text"`` column, an
            integer token tensor ``[n, pos]``, or an iterable of such tensors.
        batch_size, seq_len: sequences per forward pass, and tokens per window for texts.
        layers: the layers to measure (default all).
        max_batches: stop after this many batches.

    Returns the table's columns as means over every sequence seen (each batch weighted by its
    size: one batch gives exactly ``geometry_table``'s numbers), plus ``n_sequences`` and, for
    each measurement, ``<name>_batch_std``, its spread over batches.

    >>> table = tl_connwalk.analyze(model, texts, seq_len=64)  # doctest: +SKIP
    """
    n_layers = n_layers_of_model(model)
    chosen = sorted({layer % n_layers for layer in (range(n_layers) if layers is None else layers)})
    hooked = sorted({*chosen, *(layer + 1 for layer in chosen if layer + 1 < n_layers)})
    names = required_hooks(model, hooked)
    device = next(model.parameters()).device
    sums: pd.DataFrame | None = None
    squares: pd.DataFrame | None = None
    labels: pd.DataFrame | None = None
    seen = 0
    for index, tokens in enumerate(
        tqdm(_batches(model, data, batch_size, seq_len), desc="analyze", disable=not progress)
    ):
        if max_batches is not None and index >= max_batches:
            break
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens.to(device), names_filter=names)
        table = geometry_table(
            cache, chosen, exclude_sink=exclude_sink, baseline_draws=baseline_draws,
            seed=seed, progress=False,
        )  # fmt: skip
        del cache
        numbers = table.select_dtypes("number").drop(columns=["layer"])
        weight = tokens.shape[0]
        sums = numbers * weight if sums is None else sums + numbers * weight
        squares = numbers**2 * weight if squares is None else squares + numbers**2 * weight
        labels = table.drop(columns=numbers.columns)
        seen += weight
    if sums is None or squares is None or labels is None:
        raise ConnWalkError(
            "analyze() got no complete sequence: the texts are shorter than seq_len."
        )
    means = sums / seen
    spread = (squares / seen - means**2).clip(lower=0) ** 0.5
    result = pd.concat([labels, means, spread.add_suffix("_batch_std")], axis=1)
    result["n_sequences"] = seen
    return result
