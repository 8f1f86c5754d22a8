"""The text a view writes for each position (the token strings, or ``#id`` without a
tokenizer) and for the target (its token ids decoded: `target_label` with a model,
`decoded_target` with a tokenizer)."""

import re
from collections.abc import Sequence
from typing import Any

from jaxtyping import Int
from torch import Tensor

from tl_connwalk.errors import ConnWalkError

StrTokens = Sequence[str] | Sequence[Sequence[str]]


def token_labels(
    tokens: Int[Tensor, "batch pos"] | None,
    batch: int,
    n_pos: int,
    *,
    model: Any = None,
    str_tokens: StrTokens | None = None,
) -> list[list[str]]:
    """One label per position of each sequence, ``[batch][pos]``.

    ``str_tokens`` (one list for every sequence, or one per sequence) wins; else ``model``'s
    tokenizer decodes ``tokens`` one token at a time (as ``model.to_str_tokens`` does); else
    the labels are the token ids (``#id``), or the positions (``pos i``) without tokens.

    >>> token_labels(torch.tensor([[5, 7]]), 1, 2)
    [['#5', '#7']]
    >>> token_labels(None, 2, 2, str_tokens=["a", "b"])
    [['a', 'b'], ['a', 'b']]
    """
    if str_tokens is not None:
        return _given(str_tokens, batch, n_pos)
    if tokens is None:
        return [[f"pos {i}" for i in range(n_pos)] for _ in range(batch)]
    if model is None:
        return [[f"#{t}" for t in row] for row in tokens.tolist()]
    tokenizer = _tokenizer(model)
    return [[tokenizer.decode([t]) for t in row] for row in tokens.tolist()]


def target_label(label: str, model: Any = None) -> str:
    """``label`` (e.g. ``logit[17] @ 8``) with each token id followed by its token, quoted,
    decoded by ``model``'s tokenizer (`decoded_target`); unchanged without a model.

    >>> target_label("logit[17] - logit[4] @ 8")
    'logit[17] - logit[4] @ 8'
    """
    if model is None:
        return label
    return decoded_target(label, _tokenizer(model))


def decoded_target(label: str, tokenizer: Any) -> str:
    """A target label with every ``logit[id]`` followed by its token: ``logit[id 'token']``
    with the token ``tokenizer.decode([id])`` in curly single quotes (U+2018, U+2019), for any
    tokenizer with ``decode`` (e.g. ``model.tokenizer``).

    The rest of the label (differences, ``@ position``) is kept as it is; a label without
    logits comes back unchanged.

    >>> class Letters:
    ...     def decode(self, ids): return "".join(chr(ord("a") + i) for i in ids)
    >>> print(ascii(decoded_target("logit[2] - logit[0] @ 5", Letters())))
    'logit[2 \\u2018c\\u2019] - logit[0 \\u2018a\\u2019] @ 5'
    """
    return re.sub(
        r"logit\[(\d+)\]",
        lambda match: f"logit[{match[1]} \u2018{tokenizer.decode([int(match[1])])}\u2019]",
        label,
    )


def _tokenizer(model: Any) -> Any:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConnWalkError(
            f"model ({type(model).__name__}) has no tokenizer to decode the tokens with; pass "
            "str_tokens=[...] instead."
        )
    return tokenizer


def _given(str_tokens: StrTokens, batch: int, n_pos: int) -> list[list[str]]:
    rows: list[list[str]]
    if isinstance(str_tokens, str):
        raise ConnWalkError("str_tokens must be a list of strings, one per position, not a str.")
    if all(isinstance(label, str) for label in str_tokens):
        rows = [list(str_tokens)] * batch  # type: ignore[arg-type]
    elif all(isinstance(row, list | tuple) for row in str_tokens):
        rows = [list(row) for row in str_tokens]
    else:
        raise ConnWalkError(
            f"str_tokens must be {n_pos} strings (one per position) or {batch} such lists (one "
            f"per sequence); got {[type(label).__name__ for label in str_tokens][:4]} ..."
        )
    shape_ok = len(rows) == batch and all(len(row) == n_pos for row in rows)
    if not shape_ok or not all(isinstance(label, str) for row in rows for label in row):
        raise ConnWalkError(
            f"str_tokens must be {n_pos} strings (one per position) or {batch} such lists (one "
            f"per sequence); got {len(rows)} list(s) of lengths {[len(row) for row in rows]}."
        )
    return rows
