"""What the Gram defects need of a layer's head maps alone, computed once per set of weights.

The head transports ``T^h = W_V^h W_O^h`` give the head Grams ``K2``, the folded ``K4`` and
the head defects (spec §3; `tl_connwalk.core.isometry.gram_matrices`, `isometry.fold_pairs`,
`isometry.head_transport_defects`) and, for layers with ``H d_head <= OUT_GRAM_WIDTH``, the
half the blocks of the output Gram ``W_O^cat W_O^cat^T`` that spare the field defect its
messages (`tl_connwalk.core.field_defect.message_grams`). They depend on the weights, not on the
tokens: every cache of one model (each batch of ``analyze``, each prompt of a study) needs
the same ones, and for a GPT-2-small layer they cost about as much as that layer's forward
pass at 256 tokens. `head_grams` keeps them in a least-recently-used store of at most `CACHE_BYTES`,
keyed by a 128-bit XXH3 digest of the weights' bytes (with dtype, shapes and device):

- a copy of the weights hits (a walk holds copies: key-value heads expanded, dtype casts);
- any change of any value misses, however it was made (in place, through ``.data``, an
  optimiser step), so a hit returns what computing again would return: two different sets
  of weights share a digest with probability about ``2^-128`` (XXH3 is not a cryptographic
  hash: weights crafted to collide could fool it, nothing else will);
- the digest reads the weights once (about 30 GB/s on one CPU core: 0.14 ms for a
  GPT-2-small layer, where SHA-256 took 3 ms, 5% of a warm measurement of every layer);
  on an accelerator the weights are first copied to the host.

`cache_info` and `cache_clear` report on and empty the store, as ``functools.lru_cache`` does
(``tl_connwalk.caches`` and ``tl_connwalk.clear_caches``: every cache of the math core).
"""

import dataclasses

import torch
import xxhash
from jaxtyping import Float
from torch import Tensor

from tl_connwalk.core import checks, field_defect, isometry
from tl_connwalk.core._fast import disk
from tl_connwalk.core._fast.lru import CacheInfo, Store, tensor_bytes

#: Most bytes the store keeps (least recently used entries leave first). A GPT-2-small layer
#: needs 1.3 MiB (26 KiB without its ``out_rows``), a Llama-3-8B layer (32 heads) 1.1 MiB.
CACHE_BYTES = 2**28
#: Widest ``H d_head`` whose output Gram ``W_O^cat W_O^cat^T`` is kept (`HeadGrams.out_rows`,
#: half its blocks): 1024 is about 2 MiB in float32 (GPT-2 small: 768, 1.3 MiB). Wider
#: layers measure their message Grams through the messages (`field_defect.message_grams`).
OUT_GRAM_WIDTH = 1024


@dataclasses.dataclass(frozen=True)
class HeadGrams:
    """The weight-only terms of one layer's heads (or of one random draw of them).

    ``norms_sq[h] = ||T^h||_F^2`` (the diagonal of ``K2``), ``K2[a,b] = tr(T^a^T T^b)``,
    ``pair_gram = fold_pairs(K4)`` over the head pairs ``a <= c``, ``head_defects[h] =
    delta(T^h)`` with ``r = d_head``, and ``out_rows``, half the blocks of ``W_O^cat
    W_O^cat^T`` (each head's ``W_O^a W_O^b^T`` with its next ``H // 2`` heads, packed by
    `field_defect.output_gram_rows`; what `field_defect.message_grams` needs to skip the
    messages) where ``H d_head <= OUT_GRAM_WIDTH``, else ``None``. The random draws keep
    theirs stacked, each tensor with a leading draw axis (`tl_connwalk.core._fast.draws`).
    """

    norms_sq: Float[Tensor, "*draw head"]
    K2: Float[Tensor, "*draw head head"]
    pair_gram: Float[Tensor, "*draw pair pair"]
    head_defects: Float[Tensor, "*draw head"]
    out_rows: Float[Tensor, "*draw packed"] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return tensor_bytes(self)


def compute_head_grams(
    W_V: Float[Tensor, "head d_model d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    out_rows: bool | None = None,
) -> HeadGrams:
    """`HeadGrams` of ``W_V``, ``W_O``, computed now (no store): ``O(H^3 d_head^3)``.

    ``out_rows``: whether to keep half the output Gram's blocks (``None``: where
    ``H d_head <= OUT_GRAM_WIDTH``; `tl_connwalk.core._fast.draws` keeps them at any width, since
    one set serves every layer of a shape).

    >>> terms = compute_head_grams(torch.randn(3, 8, 2), torch.randn(3, 2, 8))
    >>> terms.K2.shape, terms.pair_gram.shape, terms.out_rows.shape  # out_rows: 2 * 2 * 3 * 2
    (torch.Size([3, 3]), torch.Size([6, 6]), torch.Size([24]))
    """
    gram_v, gram_o = isometry.head_factor_grams(W_V, W_O)
    K2, K4 = isometry.grams_of_factor_grams(gram_v, gram_o)
    n_heads, _, d_head, _ = gram_o.shape
    if out_rows is None:
        out_rows = n_heads * d_head <= OUT_GRAM_WIDTH
    rows = field_defect.output_gram_rows(gram_o) if out_rows else None
    del gram_v, gram_o
    return HeadGrams(
        norms_sq=K2.diagonal().clone(),
        K2=K2,
        pair_gram=isometry.fold_pairs(K4),
        head_defects=isometry.head_transport_defects(W_V, W_O),
        out_rows=rows,
    )


def weights_digest(*tensors: Tensor) -> str:
    """128-bit XXH3 of the tensors' dtypes, shapes, devices and bytes: equal for equal values,
    different for different ones (but with probability about ``2^-128``).

    >>> weights_digest(torch.ones(2)) == weights_digest(torch.ones(2).clone())
    True
    >>> weights_digest(torch.ones(2)) == weights_digest(torch.ones(2).double())
    False
    """
    digest = xxhash.xxh3_128()
    for tensor in tensors:
        host = tensor.detach().contiguous().cpu()
        digest.update(f"{host.dtype} {tuple(host.shape)} {tensor.device};".encode())
        digest.update(host.reshape(-1).view(torch.uint8).numpy().data)  # no copy
    return digest.hexdigest()


#: The store of `head_grams`, by digest of the weights, at most `CACHE_BYTES` bytes.
_STORE: Store[HeadGrams] = Store("core.head_grams", maxbytes=lambda: CACHE_BYTES)


def head_grams(
    W_V: Float[Tensor, "head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> HeadGrams:
    """`compute_head_grams`, kept in the store: weights seen before cost only their digest.

    >>> W_V, W_O = torch.randn(3, 8, 2), torch.randn(3, 2, 8)
    >>> head_grams(W_V, W_O) is head_grams(W_V.clone(), W_O.clone())
    True
    """
    W_V, W_O = checks.cast_heads(W_V, W_O)
    key = weights_digest(W_V, W_O)
    found = _STORE.get(key)
    if found is None:
        out_rows = W_V.shape[0] * W_V.shape[2] <= OUT_GRAM_WIDTH
        disk_key = f"{key} {out_rows}"
        saved = disk.load("heads", disk_key)
        if saved is not None:  # computed by an earlier process
            found = from_tensors(saved, W_V.device)
        else:
            found = compute_head_grams(W_V, W_O, out_rows=out_rows)
            disk.save("heads", disk_key, to_tensors(found))
        _STORE.put(key, found)
    return found


def to_tensors(grams: HeadGrams) -> dict[str, Tensor]:
    """The tensors of ``grams`` by field name (``out_rows`` only where there are some)."""
    fields = {f.name: getattr(grams, f.name) for f in dataclasses.fields(grams)}
    return {name: value for name, value in fields.items() if value is not None}


def from_tensors(tensors: dict[str, Tensor], device: torch.device) -> HeadGrams:
    """`HeadGrams` of `to_tensors`' tensors, on ``device``."""
    return HeadGrams(**{name: value.to(device) for name, value in tensors.items()})


def cache_info() -> CacheInfo:
    """Hits, misses, entries and bytes of the `head_grams` store since the last clear."""
    return _STORE.info()


def cache_clear() -> None:
    """Empty the `head_grams` store and reset its counts."""
    _STORE.clear()
