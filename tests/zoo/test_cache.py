"""The zoo's cache on disk (tl_connwalk.zoo.cache), always in a temporary cache folder.

Each test points ``$TL_CONNWALK_CACHE`` at a fresh folder laid out as the zoo writes it (files
named after the registry's wheels and models, small made-up contents), and checks listings and
removals against the files it wrote itself.
"""

import dataclasses
from pathlib import Path

import pytest

from tests.zoo.helpers import fake_spec, fake_wheel
from tl_connwalk import zoo
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.zoo import cache
from tl_connwalk.zoo.registry import MODELS

SMOL, GEMMA = MODELS["smollm2-135m"], MODELS["gemma3-270m"]


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


@pytest.fixture
def root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TL_CONNWALK_CACHE", str(root))
    return root


@pytest.fixture
def filled(root, tmp_path):
    """A cache with SmolLM2 (wheel, converted model), Gemma's wheels, leftovers and others;
    returns ``{path: bytes}`` of what was written, and an outside file a link points to."""
    sizes = {}

    def add(path, size):
        sizes[write(path, size)] = size

    add(root / "wheels" / SMOL.wheels[0].filename, 700)
    add(root / "models" / SMOL.key / "model.safetensors", 900)
    add(root / "models" / SMOL.key / "config.json", 30)
    for k, wheel in enumerate(GEMMA.wheels):
        add(root / "wheels" / wheel.filename, 100 + k)
    add(root / "wheels" / "old_model-0.1-py3-none-any.whl", 50)  # a stale wheel: no model
    add(root / "models" / ".convert-abc" / "source" / "model.gguf", 40)
    add(root / "notes.txt", 5)  # not the zoo's
    add(root / "wheels" / "README", 7)  # not a wheel
    outside = write(tmp_path / "outside" / "keep.whl", 11)
    (root / "wheels" / "linked.whl").symlink_to(outside)
    return sizes, outside


def test_missing_cache_is_empty_and_clearing_it_is_no_error(root):
    assert not root.exists()
    info = zoo.cache_info()
    assert info.root == root and info.entries == () and info.total == 0
    assert zoo.clear_cache().entries == ()
    assert zoo.clear_cache("minilm-l6").total == 0
    assert not root.exists()


def test_cache_info_lists_every_entry(filled, root):
    sizes, _ = filled
    info = zoo.cache_info()
    by_path = {entry.path: entry for entry in info.entries}
    smol_model = by_path[root / "models" / SMOL.key]
    assert (smol_model.kind, smol_model.models, smol_model.size) == ("model", (SMOL.name,), 930)
    smol_wheel = by_path[root / "wheels" / SMOL.wheels[0].filename]
    assert (smol_wheel.kind, smol_wheel.models, smol_wheel.size) == ("wheel", (SMOL.name,), 700)
    for wheel in GEMMA.wheels:
        assert by_path[root / "wheels" / wheel.filename].models == (GEMMA.name,)
    assert by_path[root / "wheels" / "old_model-0.1-py3-none-any.whl"].models == ()
    assert by_path[root / "models" / ".convert-abc"].kind == "temporary"
    assert by_path[root / "notes.txt"].kind == "other"
    assert by_path[root / "wheels" / "README"].kind == "other"
    link = by_path[root / "wheels" / "linked.whl"]
    assert link.size == (root / "wheels" / "linked.whl").lstat().st_size  # the link, not 11
    assert info.total == sum(entry.size for entry in info.entries)
    assert info.total == sum(sizes.values()) + link.size
    text = repr(info)
    assert str(root) in text and f"models/{SMOL.key}" in text and SMOL.name in text


def test_clear_one_model_keeps_the_others(filled, root):
    _, outside = filled
    before = zoo.cache_info()
    freed = zoo.clear_cache(SMOL.name)
    assert {entry.path for entry in freed.entries} == {
        root / "wheels" / SMOL.wheels[0].filename,
        root / "models" / SMOL.key,
    }
    assert freed.total == 700 + 930
    assert not (root / "models" / SMOL.key).exists()
    after = zoo.cache_info()
    assert after.total == before.total - freed.total
    assert all((root / "wheels" / wheel.filename).is_file() for wheel in GEMMA.wheels)
    assert (root / "models" / ".convert-abc").is_dir()  # leftovers belong to no one model
    assert outside.is_file()


def test_clear_everything_keeps_what_the_zoo_did_not_write(filled, root):
    _, outside = filled
    freed = zoo.clear_cache()
    assert {entry.kind for entry in freed.entries} == {"wheel", "model", "temporary"}
    left = zoo.cache_info()
    kept = {root / "notes.txt", root / "wheels" / "README"}
    assert {entry.path for entry in left.entries} == kept
    assert outside.read_bytes() == b"x" * 11  # the link was removed, not its target
    assert zoo.clear_cache().entries == ()


def test_a_wheel_shared_by_two_models_stays_until_both_go(root, monkeypatch):
    shared = fake_wheel()
    own = dataclasses.replace(fake_wheel("1" * 64), filename="own-1.0-py3-none-any.whl")
    models = {"a": fake_spec((shared,), name="a"), "b": fake_spec((own, shared), name="b")}
    monkeypatch.setattr(cache, "MODELS", models)
    write(root / "wheels" / shared.filename, 10)
    write(root / "models" / models["a"].key / "model.safetensors", 20)
    owners = {entry.path.name: entry.models for entry in zoo.cache_info().entries}
    assert owners == {shared.filename: ("a", "b"), models["a"].key: ("a",)}
    assert zoo.clear_cache("a").total == 20
    assert (root / "wheels" / shared.filename).is_file()
    assert zoo.clear_cache().total == 10


def test_never_reaches_outside_the_cache(root, tmp_path):
    outside = tmp_path / "elsewhere"
    write(outside / SMOL.wheels[0].filename, 10)
    root.mkdir()
    (root / "wheels").symlink_to(outside, target_is_directory=True)
    info = zoo.cache_info()
    assert [(entry.path.name, entry.kind) for entry in info.entries] == [("wheels", "other")]
    zoo.clear_cache()
    zoo.clear_cache(SMOL.name)
    assert (outside / SMOL.wheels[0].filename).is_file()
    with pytest.raises(ConnWalkError, match="not inside the cache"):
        cache._remove(outside / SMOL.wheels[0].filename, root)


def test_unknown_model_is_a_clear_error(root):
    with pytest.raises(ConnWalkError, match="smollm2-135m"):
        zoo.clear_cache("smollm3")
