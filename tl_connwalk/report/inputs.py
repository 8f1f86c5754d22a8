"""What a report reads: the model (a zoo name, a local directory or a toy) and its tokens.

Model names are resolved in this order: ``toy-<arch>`` (a random offline ``TransformerBridge``
from `tl_connwalk.toy`, for tests and quick tries), then anything
`tl_connwalk.zoo.load` accepts (a zoo name such as ``smollm2-135m``, a local Hugging Face
directory, or a TransformerLens model name where a hub is reachable). Text comes from a file,
from every ``*.txt`` file of a folder (sorted by name, joined with blank lines), or by default
from `tl_connwalk.zoo.default_text`; it is tokenized as one sequence (the model's BOS
token first, as TransformerLens prepends it) and cut to ``max_tokens``.
"""

from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.toy import VOCAB, Architecture, random_bridge

Backend = Literal["hooked", "bridge"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOY_PREFIX = "toy-"
#: the size of the toy models a report builds (small enough for a test in seconds)
TOY_SIZE = {"n_layers": 4, "d_model": 64, "n_heads": 4}


def toy_names() -> list[str]:
    """``["toy-gpt2", "toy-llama", "toy-gemma3", "toy-bert"]``."""
    return [TOY_PREFIX + arch for arch in get_args(Architecture)]


def load_model(
    name: str, backend: Backend | None, device: str, dtype: str, progress: bool = True
) -> tuple[nn.Module, Backend]:
    """The model ``name`` on ``device`` in ``dtype``, and the backend it was loaded with.

    ``backend=None`` picks ``"bridge"`` for toy models (the only kind `tl_connwalk.toy`
    builds) and ``"hooked"`` otherwise. ``progress=False``: no conversion or loading bars (toy
    models never draw any).
    """
    if dtype not in DTYPES:
        raise ConnWalkError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    if name.startswith(TOY_PREFIX):
        arch = name.removeprefix(TOY_PREFIX)
        if arch not in get_args(Architecture):
            raise ConnWalkError(f"unknown toy model {name!r}; choose one of {toy_names()}.")
        if backend == "hooked":
            raise ConnWalkError(
                f"{name} is a random TransformerBridge (tl_connwalk.toy); use --backend bridge "
                "or leave --backend out."
            )
        model: nn.Module = random_bridge(arch, **TOY_SIZE)  # type: ignore[arg-type]
        if device != "cpu" or dtype != "float32":  # toy models are built on the CPU in float32
            model.to(device=device, dtype=DTYPES[dtype])
        return model, "bridge"
    from tl_connwalk import zoo

    chosen: Backend = backend or "hooked"
    model = zoo.load(name, backend=chosen, device=device, dtype=DTYPES[dtype], progress=progress)
    return model, chosen


def read_text(text: Path | None, dataset: Path | None) -> tuple[str, dict[str, Any]]:
    """The text to analyse and a record of where it came from (for ``report.json``)."""
    if text is not None and dataset is not None:
        raise ConnWalkError("pass --text FILE or --dataset DIR, not both.")
    if text is not None:
        if not text.is_file():
            raise ConnWalkError(f"--text {text}: no such file.")
        return text.read_text("utf-8"), {"source": "file", "path": str(text)}
    if dataset is not None:
        files = sorted(dataset.glob("*.txt")) if dataset.is_dir() else []
        if not files:
            raise ConnWalkError(
                f"--dataset {dataset}: expected a folder holding *.txt files, found none."
            )
        joined = "\n\n".join(path.read_text("utf-8") for path in files)
        return joined, {
            "source": "dataset",
            "path": str(dataset),
            "files": [path.name for path in files],
        }
    from tl_connwalk import zoo

    return zoo.default_text(), {"source": "default", "path": "tl_connwalk.zoo.default_text()"}


def context_length(model: nn.Module) -> int:
    """The longest sequence the model takes (``cfg.n_ctx``)."""
    cfg: Any = model.cfg
    return int(cfg.n_ctx)


def tokens_for(
    model: nn.Module, name: str, text: str, user_text: bool, max_tokens: int, seed: int = 0
) -> Tensor:
    """``[1, pos]`` token ids: ``text`` tokenized and cut to ``max_tokens`` (and the context).

    Toy models have a 64-word vocabulary (``t0`` .. ``t62``) in which English is all unknown
    words; without a user text they read seeded random tokens instead.
    """
    if max_tokens < 2:
        raise ConnWalkError(
            f"--max-tokens must be at least 2 (a walk needs edges), got {max_tokens}."
        )
    length = min(max_tokens, context_length(model))
    device = next(model.parameters()).device
    if name.startswith(TOY_PREFIX) and not user_text:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, VOCAB - 1, (1, length), generator=generator).to(device)
    tokens = model.to_tokens(text, truncate=False)  # type: ignore[operator]
    return tokens[:, :length].to(device)
