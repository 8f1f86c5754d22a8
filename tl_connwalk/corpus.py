"""``analyze``: the geometry table of a whole corpus, streamed batch by batch.

Texts are tokenized, concatenated and cut into windows of ``seq_len`` tokens (each starting
with the tokenizer's BOS token when it has one), the way corpus statistics are usually taken;
token tensors are checked (integer ids, at least 2 positions, inside the vocabulary) and used
as given. Each batch runs through the model keeping only the hooks the walks need
(``names_filter``), its `tl_connwalk.geometry_table` is folded into running moments (count,
mean, M2: `tl_connwalk.core.moments`), and the cache is dropped: memory stays at one batch.
Under ``torchrun`` the batches are shared out between processes (`tl_connwalk.distributed`).
"""

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from tl_connwalk.adapters import adapter_for, resolve_layers
from tl_connwalk.adapters.hooked_transformer import is_encoder
from tl_connwalk.analysis import geometry_table
from tl_connwalk.cache import n_layers_of_model, required_hooks
from tl_connwalk.core.checks import check_flag, check_token_ids, is_count
from tl_connwalk.core.moments import Moments
from tl_connwalk.distributed import rank_and_world, reduce_to_rank0
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
        raise ConnWalkError(
            f"seq_len={seq_len} leaves no room for text after the BOS token: use seq_len >= 2."
        )
    buffer: list[int] = []
    for text in texts:
        if not isinstance(text, str):
            raise ConnWalkError(
                f"analyze() reads texts (strings) or token tensors; got a {type(text).__name__} "
                f"({text!r}) among the texts."
            )
        buffer += tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(buffer) >= body:
            yield torch.tensor(bos + buffer[:body])
            buffer = buffer[body:]


def check_tokens(tokens: Tensor, d_vocab: int | None = None) -> Tensor:
    """``tokens`` checked to be integer ids ``[batch, pos]`` with ``pos >= 2``, as int64.

    A sequence of one token has a single edge (the token to itself): its walk is the 1 x 1
    identity, every defect is the sink's alone and with ``exclude_sink`` there is no edge at
    all, so corpus statistics over it would be noise; ``analyze`` refuses it.
    ``connection_walk`` itself accepts such caches.
    """
    shape = tuple(tokens.shape)
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ConnWalkError(
            f"token tensors must be integer [batch, pos], got {tokens.dtype} {shape}: analyze() "
            "takes token ids (e.g. model.to_tokens(texts)); ids stored as floats: pass "
            "tokens.long()."
        )
    if tokens.ndim != 2:
        hint = " (one sequence: pass tokens[None])" if tokens.ndim == 1 else ""
        raise ConnWalkError(
            f"token tensors must be integer [batch, pos], got {tokens.dtype} {shape}{hint}."
        )
    if shape[0] == 0 or shape[1] == 0:
        raise ConnWalkError(
            f"got an empty token tensor {shape} [batch, pos]: pass at least one sequence of at "
            "least 2 tokens."
        )
    if shape[1] < 2:
        raise ConnWalkError(
            f"token sequences have length 1 {shape}: a single token's walk is the 1 x 1 "
            "identity, with nothing to measure; pass sequences of at least 2 tokens."
        )
    if d_vocab is not None:
        check_token_ids(tokens, d_vocab)
    return tokens.long()


def _batches(model: nn.Module, data: Any, batch_size: int, seq_len: int) -> Iterator[Tensor]:
    if isinstance(data, Tensor):
        d_vocab = getattr(getattr(model, "cfg", None), "d_vocab", None)
        yield from check_tokens(data, d_vocab if isinstance(d_vocab, int) else None).split(
            batch_size
        )
        return
    if hasattr(data, "column_names"):  # a datasets.Dataset: its "text" column
        if "text" not in data.column_names:
            raise ConnWalkError(f"the dataset has no 'text' column: {data.column_names}.")
        data = (row["text"] for row in data)
    if isinstance(data, str):
        data = [data]
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


@dataclasses.dataclass(frozen=True)
class _Summary:
    """The running summary of the tables seen so far: their labels and per-cell moments."""

    labels: pd.DataFrame  # KEYS and text columns (mu_kind), one row per table row
    columns: list[str]  # the measured columns of ``moments``, in order
    moments: Moments  # [row, column]

    @classmethod
    def of(cls, table: pd.DataFrame, weight: int) -> "_Summary":
        numbers = table.select_dtypes("number").drop(columns=["layer"])
        values = torch.tensor(numbers.to_numpy(dtype="float64"))
        labels = table.drop(columns=numbers.columns)
        return cls(labels, list(numbers.columns), Moments.of(values, weight))

    def merge(self, other: "_Summary") -> "_Summary":
        labels = self.labels.copy()
        for column in labels.columns:
            if column in KEYS:
                continue
            labels[column] = [
                ",".join(sorted({*a.split(","), *b.split(",")}))
                if isinstance(a, str) and isinstance(b, str)
                else a
                for a, b in zip(labels[column], other.labels[column], strict=True)
            ]
        return _Summary(labels, self.columns, self.moments.merge(other.moments))


def _merge(parts: list[_Summary]) -> _Summary:
    total = parts[0]
    for part in parts[1:]:
        total = total.merge(part)
    return total


def _input_device(model: nn.Module) -> torch.device | None:
    """Where the token ids go: the embedding's device (None: leave them; meta = offloaded).

    Read off the embedding module's parameters, not ``cfg.device``: in a model split over
    devices the embedding sits on the first one.
    """
    embed = getattr(model, "embed", None)
    source = embed if isinstance(embed, nn.Module) else model
    weight = next(source.parameters(), None)
    if weight is None or weight.is_meta:
        return None  # accelerate's hooks move inputs of offloaded modules themselves
    return weight.device


def _masks(mask: Tensor | None, data: Any, batch_size: int) -> Iterator[Tensor | None]:
    """The attention mask of each batch of a token tensor (None without a mask)."""
    if mask is None:
        return itertools.repeat(None)
    if not isinstance(data, Tensor) or tuple(mask.shape) != tuple(data.shape):
        shape = tuple(data.shape) if isinstance(data, Tensor) else type(data).__name__
        raise ConnWalkError(
            f"attention_mask {tuple(mask.shape)} goes with a token tensor of its shape [n, pos]; "
            f"data is {shape}."
        )
    return iter(mask.split(batch_size))


def _mask_argument(model: nn.Module) -> str:
    """The name ``run_with_cache`` takes the attention mask by: ``HookedEncoder`` has its own."""
    return "one_zero_attention_mask" if is_encoder(model) else "attention_mask"


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
    distributed: bool | None = None,
    attention_mask: Tensor | None = None,
) -> pd.DataFrame:
    """The `tl_connwalk.geometry_table` of a corpus, aggregated over batches.

    Args:
        model: a supported TransformerLens model, on one device or split over several
            (``n_devices``, ``device_map``): each layer is measured on its own device.
        data: an iterable of strings, a ``datasets.Dataset`` with a ``"text"`` column, an
            integer token tensor ``[n, pos]`` (``pos >= 2``), or an iterable of such tensors.
        batch_size, seq_len: sequences per forward pass, and tokens per window for texts.
        layers: the layers to measure (default all; negative counts from the end).
        max_batches: stop after this many batches (counted over all ranks).
        distributed: data parallel over a ``torch.distributed`` process group (``torchrun``,
            one process per device): rank ``r`` of ``W`` takes batches ``r, r + W, ...``, and
            the summaries are merged on rank 0 and broadcast, so every rank returns the table
            a single process would (up to float64 rounding). Every rank must pass the same
            ``data``. Default: when a process group is initialised. See
            `tl_connwalk.distributed`.
        attention_mask: ``[n, pos]`` (1: real token, 0: padding) for a padded token tensor
            ``data`` (e.g. ``model.to_tokens(texts)`` of texts of different lengths): the
            model runs with it and every sequence counts as if it ran alone. Without it,
            padding is read off the patterns (`tl_connwalk.cache.connection_walk`).

    Returns the table's columns as means over every sequence seen (each batch weighted by its
    size: one batch gives exactly ``geometry_table``'s numbers), plus ``n_sequences`` and, for
    each measurement, ``<name>_batch_std``, its spread over batches (weighted population
    standard deviation). Means and spreads are running float64 moments merged with Chan's
    parallel algorithm (`tl_connwalk.core.moments`); ``mu_kind`` lists every kind seen.

    >>> table = tl_connwalk.analyze(model, texts, seq_len=64)  # doctest: +SKIP
    """
    for name, value, least in (("batch_size", batch_size, 1), ("seq_len", seq_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConnWalkError(f"{name} must be an int >= {least}, got {value!r}.")
    if max_batches is not None and not is_count(max_batches):
        raise ConnWalkError(f"max_batches must be None or an int >= 1, got {max_batches!r}.")
    if not isinstance(data, (Tensor, Iterable)):
        raise ConnWalkError(
            "data must be texts, a datasets.Dataset with a 'text' column, a token tensor "
            f"[n, pos] or an iterable of token tensors, got {type(data).__name__}."
        )
    check_flag(progress, "progress")
    rank, world = rank_and_world(distributed)
    n_layers = n_layers_of_model(model)
    adapter = adapter_for(model)
    chosen = sorted(set(resolve_layers(adapter, model, layers)))
    hooked = sorted({*chosen, *(layer + 1 for layer in chosen if layer + 1 < n_layers)})
    names = required_hooks(model, hooked)
    device = _input_device(model)
    summary: _Summary | None = None
    batches = _batches(model, data, batch_size, seq_len)
    masks = _masks(attention_mask, data, batch_size)
    for index, tokens in enumerate(
        tqdm(batches, desc="analyze", disable=not progress or rank != 0)
    ):
        if max_batches is not None and index >= max_batches:
            break
        mask = next(masks)
        if index % world != rank:
            continue
        run_options: dict[str, Any] = {"names_filter": names}
        if mask is not None:
            mask = mask if device is None else mask.to(device)
            run_options[_mask_argument(model)] = mask
        with torch.no_grad():
            _, cache = model.run_with_cache(
                tokens if device is None else tokens.to(device), **run_options
            )
        table = geometry_table(
            cache, chosen, exclude_sink=exclude_sink, baseline_draws=baseline_draws,
            seed=seed, progress=False, attention_mask=mask,
        )  # fmt: skip
        del cache
        part = _Summary.of(table, tokens.shape[0])
        summary = part if summary is None else summary.merge(part)
    summary = reduce_to_rank0(summary, _merge, world)
    if summary is None:
        raise ConnWalkError(
            "analyze() got no complete sequence: the texts are shorter than seq_len."
        )
    moments = summary.moments
    rows = summary.labels.index
    means = pd.DataFrame(moments.mean.numpy(), columns=summary.columns, index=rows)
    spread = pd.DataFrame(moments.std.numpy(), columns=summary.columns, index=rows)
    result = pd.concat([summary.labels, means, spread.add_suffix("_batch_std")], axis=1)
    result["n_sequences"] = int(moments.count)
    return result
