"""What a model's first measurement builds, kept on disk across processes.

A layer's head Grams (`tl_connwalk.core._fast.head_grams`, by the digest of its weights) and
the random baselines' raw draws of a head shape (`tl_connwalk.core._fast.draws`, by shape,
dtype, seed and number of draws) cost about as much as the measurements of a prompt; they
depend on the weights or the shapes alone, so a new process (a notebook, `tl-connwalk
report`) reads them back instead of computing them again. They lie in ``grams/`` under the
zoo's cache folder (``$TL_CONNWALK_CACHE``, default ``~/.cache/tl_connwalk``), one file per
entry, at most `DISK_BYTES` in all (the least recently written go first; a GPT-2-small layer
takes 1.3 MiB, its 8 draws 10 MiB). `tl_connwalk.clear_caches` empties the folder.

A file that cannot be read (another process clearing it, a truncated write) counts as
absent: results never depend on this cache, only the time to the first result does. Writes
go to a temporary file renamed into place, so a reader sees a whole file or none.
"""

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor

#: Most bytes kept in the folder; 0 turns the disk cache off.
DISK_BYTES = 2**28
_ENV = "TL_CONNWALK_CACHE"
_SUFFIX = ".pt"


def folder() -> Path:
    """``grams/`` in ``$TL_CONNWALK_CACHE`` if set, else in ``~/.cache/tl_connwalk``."""
    root = os.environ.get(_ENV) or "~/.cache/tl_connwalk"
    return Path(root).expanduser().absolute() / "grams"


def _path(kind: str, key: str) -> Path:
    digest = hashlib.blake2b(f"{kind}/{key}".encode(), digest_size=16).hexdigest()
    return folder() / f"{kind}-{digest}{_SUFFIX}"


def load(kind: str, key: str) -> dict[str, Tensor] | None:
    """The tensors saved under ``(kind, key)`` on the CPU, or ``None``."""
    if DISK_BYTES <= 0:
        return None
    path = _path(kind, key)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):
        return None
    if not isinstance(loaded, dict) or loaded.get("__key__") != key:
        return None
    return {name: value for name, value in loaded.items() if isinstance(value, Tensor)}


def save(kind: str, key: str, tensors: dict[str, Tensor]) -> None:
    """Keep ``tensors`` under ``(kind, key)``, then trim the folder to `DISK_BYTES`; a folder
    that cannot be written is left alone."""
    if DISK_BYTES <= 0:
        return
    path = _path(kind, key)
    content: dict[str, object] = {name: t.detach().cpu() for name, t in tensors.items()}
    content["__key__"] = key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".write-")
        with os.fdopen(handle, "wb") as f:
            torch.save(content, f)
        os.replace(temporary, path)
    except OSError:
        return
    _trim()


def _entries() -> list[tuple[float, int, Path]]:
    found = []
    with contextlib.suppress(OSError):
        for path in folder().glob(f"*{_SUFFIX}"):
            with contextlib.suppress(OSError):
                stat = path.stat()
                found.append((stat.st_mtime, stat.st_size, path))
    return sorted(found)


def _trim() -> None:
    entries = _entries()
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
        if total <= DISK_BYTES:
            break
        with contextlib.suppress(OSError):
            path.unlink()
        total -= size


def info() -> tuple[int, int]:
    """Entries and bytes in the folder."""
    entries = _entries()
    return len(entries), sum(size for _, size, _ in entries)


def clear() -> None:
    """Remove every entry (and any leftover of an interrupted write)."""
    with contextlib.suppress(OSError):
        for path in folder().iterdir():
            if path.name.endswith(_SUFFIX) or path.name.startswith(".write-"):
                with contextlib.suppress(OSError):
                    path.unlink()
