"""Keys and values as TransformerLens's key-value cache holds them, for knockout runs that
recompute only the positions after the blocked key (spec §7).

In a causal model, blocking key ``j`` for every other query changes no position up to ``j``:
the run that blocks it needs the clean keys and values of positions ``0..j`` of every layer,
and recomputes only positions ``j + 1`` on. A ``HookedTransformer`` takes them as its
``past_kv_cache``; `recorder` stands in for that cache in the clean forward pass and keeps each
layer's keys and values exactly as the model would cache them (after any query/key norm or
clamp, before rotary embeddings), and `prefix` hands the first ``j + 1`` positions of some
sequences back to a later run. Only the two methods and the three attributes the model's
forward pass uses are provided.
"""

import dataclasses

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from tl_connwalk.adapters.versions import is_bridge
from tl_connwalk.attribution.frozen import config


@dataclasses.dataclass
class _Entry:
    """One layer's prefix. With no prefix (a recording), the keys and values a forward pass
    appends are kept, detached, and handed back unchanged, so the pass computes what it would
    without a cache."""

    past_keys: Float[Tensor, "batch prefix kv_head d_head"]
    past_values: Float[Tensor, "batch prefix kv_head d_head"]
    recorded: tuple[Tensor, Tensor] | None = None
    reached: bool = True
    frozen: bool = True

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if not self.reached:
            raise RuntimeError("a run after a prefix went past the layers the recording reached")
        if self.past_keys.shape[1] == 0:
            self.recorded = keys.detach(), values.detach()
            return keys, values
        return (
            torch.cat([self.past_keys, keys.to(self.past_keys)], 1),
            torch.cat([self.past_values, values.to(self.past_values)], 1),
        )


@dataclasses.dataclass
class PrefixCache:
    """Stands in for TransformerLens's key-value cache (``past_kv_cache=``): one `_Entry` per
    layer and the padding mask of the prefix (all ones: no padding)."""

    entries: list[_Entry]
    previous_attention_mask: Int[Tensor, "batch prefix"]
    frozen: bool = True

    def __getitem__(self, layer: int) -> _Entry:
        return self.entries[layer]

    def append_attention_mask(self, mask: Int[Tensor, "batch new"]) -> Int[Tensor, "batch all"]:
        return torch.cat([self.previous_attention_mask, mask.to(self.previous_attention_mask)], -1)


def supports(model: nn.Module) -> bool:
    """Whether ``model`` runs after a prefix this way: a causal ``HookedTransformer`` (a
    ``TransformerBridge`` or an encoder runs every position)."""
    causal = getattr(config(model), "attention_dir", "causal") == "causal"
    return causal and not is_bridge(model) and hasattr(model, "get_pos_offset")


def recorder(model: nn.Module, batch: int, device: torch.device) -> PrefixCache:
    """An empty cache whose entries record what a clean forward pass of ``batch`` sequences
    appends (pass it with ``attention_mask`` all ones)."""
    cfg = config(model)
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    empty = torch.empty(batch, 0, n_kv, int(cfg.d_head), device=device, dtype=cfg.dtype)
    entries = [_Entry(empty, empty) for _ in range(int(cfg.n_layers))]
    return PrefixCache(entries, torch.ones(batch, 0, dtype=torch.long, device=device))


def prefix(recorded: PrefixCache, rows: Int[Tensor, " run"], length: int) -> PrefixCache:
    """The first ``length`` positions of the sequences ``rows`` of a recording, as the cache of a
    run of those sequences (row ``r`` of the run: sequence ``rows[r]``). Layers the recording
    did not reach (it stopped inside the network) hold zeros of the prefix's shape (the model
    reads its position offset off layer 0), and a run must stop before them."""
    entries = []
    for entry in recorded.entries:
        if entry.recorded is None:
            _, _, n_kv, d_head = entry.past_keys.shape
            zeros = entry.past_keys.new_zeros(len(rows), length, n_kv, d_head)
            entries.append(_Entry(zeros, zeros, reached=False))
            continue
        keys, values = entry.recorded
        rows_ = rows.to(keys.device)
        entries.append(_Entry(keys[rows_, :length], values[rows_, :length]))
    mask = torch.ones(len(rows), length, dtype=torch.long, device=rows.device)
    return PrefixCache(entries, mask)
