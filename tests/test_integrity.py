"""Files checked before use (issue 55, item 4): a GGUF header checked field by field, registry files hashed on
their first use in a process (stamped after), no download while offline variables are set, a re-assembly that says
why, superseded cache entries removed. Small synthetic GGUF files in temporary caches; nothing here reads or writes
~/.cache/draftwise."""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np
import pytest

from draftwise.errors import ModelNotAvailableError
from draftwise.models import cache, chunks, integrity, registry
from draftwise.models.integrity import CorruptFileError, check_header, verify_file

TOKENS = [f"tok{i}" for i in range(40)] + ["é", "ü", "日本"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    for name in integrity.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    integrity.forget()
    yield
    integrity.forget()


def write_gguf(path) -> bytes:
    """A small GGUF (metadata of every kind, a vocabulary, two tensors); returns its bytes."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_string("general.name", "tiny")
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_token_list(TOKENS)
    writer.add_array("tokenizer.ggml.token_type", [1] * len(TOKENS))
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((43, 32)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _flip(path, offset: int, value: int | None = None) -> None:
    """One byte of `path` changed in place (XOR 0xFF, or set to `value`), its modification time moved on a second
    (the file system's clock ticks coarsely: a write within the same tick keeps the old time)."""
    data = bytearray(path.read_bytes())
    data[offset] = data[offset] ^ 0xFF if value is None else value
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def _data_offset(data: bytes) -> int:
    from gguf import GGUFReader
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        return GGUFReader(f.name).data_offset


# ------------------------------------------------------------------------------------------------ the header

def test_a_sound_header_passes(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    check_header(tmp_path / "m.gguf")  # negative control: no error


@pytest.mark.parametrize("offset, value, field", [
    (0, ord("X"), "at offset 0: magic"),
    (4, 9, "at offset 4: version"),
    (15, 0x40, "at offset 8: tensor count"),
    (23, 0x40, "at offset 16: metadata count"),
    (31, 0x40, "at offset 24: metadata key #0 length"),
])
def test_a_flipped_header_field_is_named_with_its_offset(tmp_path, offset, value, field):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    _flip(path, offset, value)
    with pytest.raises(CorruptFileError) as error:
        check_header(path)
    message = str(error.value)
    assert "GGUF header is corrupt " + field in message and "\n" not in message


def test_a_token_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    data = write_gguf(path)
    at = data.index("日本".encode())
    _flip(path, at, 0xFF)
    with pytest.raises(CorruptFileError, match=rf"corrupt at offset {at}: 'tokenizer.ggml.tokens'\[42\] \(not UTF-8\)"):
        check_header(path)


def test_every_flipped_header_byte_is_one_line_or_harmless(tmp_path):
    """Each byte of the header flipped in turn: the check reports a CorruptFileError in one line, or passes (a
    value such as a float or a letter of a name can be anything); it never fails otherwise or hangs."""
    path = tmp_path / "m.gguf"
    data = write_gguf(path)
    caught = 0
    for offset in range(_data_offset(data)):
        flipped = bytearray(data)
        flipped[offset] ^= 0xFF
        path.write_bytes(bytes(flipped))
        try:
            check_header(path)
        except CorruptFileError as error:
            assert "GGUF header is corrupt at offset" in str(error) and "\n" not in str(error)
            caught += 1
    assert caught > _data_offset(data) // 2


# -------------------------------------------------------------------------------- registry files and stamps

def _spec(tmp_path, parts: int = 2) -> tuple[chunks.ChunkedFile, list]:
    """A registry file shipped as `parts` chunk files (standing in for installed chunk packages)."""
    data = write_gguf(tmp_path / "source.gguf")
    step = -(-len(data) // parts)
    files = []
    for i in range(parts):
        part = tmp_path / f"part{i + 1:02d}.bin"
        part.write_bytes(data[i * step: (i + 1) * step])
        files.append(part)
    spec = chunks.ChunkedFile("tiny-gguf", "tiny.gguf", "tiny-part{}", parts, "0.1.0", len(data),
                              hashlib.sha256(data).hexdigest())
    return spec, files


@pytest.fixture
def tiny_entry(tmp_path, monkeypatch):
    """'tiny-gguf' registered like the Qwen pair, its chunks 'installed'; pip must never run."""
    spec, files = _spec(tmp_path)
    monkeypatch.setitem(registry.QWEN_FILES, spec.name, spec)
    monkeypatch.setattr(chunks, "_installed_chunks", lambda s: files if s is spec else None)
    monkeypatch.setattr(chunks.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    entry = registry._chunked_entry(spec.name, "target", "a tiny GGUF")
    monkeypatch.setitem(registry._ENTRIES, spec.name, entry)
    monkeypatch.setattr(registry, "registry_files", lambda: [
        (spec.name, chunks.assembled_path(spec) if chunks.assembled_path(spec).is_file() else None, spec.sha256,
         spec.size, registry.repull(spec.name))])
    return spec, entry, files


def _hashes(monkeypatch) -> list:
    calls = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda path, *a: calls.append(path) or real(path, *a))
    return calls


def test_a_registry_file_is_hashed_once_then_stamped(tiny_entry, monkeypatch):
    spec, entry, _ = tiny_entry
    path = entry.gguf()  # assembled (hashed while written): stamped
    hashes = _hashes(monkeypatch)
    integrity.forget()  # a new process
    assert entry.gguf() == path and hashes == []  # the stamp matches: one stat, no hashing
    integrity.stamp_path(path).unlink()
    integrity.forget()
    assert entry.gguf() == path and len(hashes) == 1  # no stamp: hashed on first use in the process ...
    assert entry.gguf() == path and len(hashes) == 1  # ... and not again in it
    integrity.forget()
    entry.gguf()
    assert len(hashes) == 1 and integrity.stamp_path(path).is_file()  # ... nor in the next one


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_flipped_byte_in_a_registry_file_is_caught_on_first_use(tiny_entry, where, capsys):
    from draftwise.cli import main

    spec, entry, _ = tiny_entry
    path = entry.gguf()
    data = path.read_bytes()
    _flip(path, len(data) - 3 if where == "data" else 15, None if where == "data" else 0x40)
    integrity.forget()
    with pytest.raises(CorruptFileError) as error:
        entry.gguf()
    message = str(error.value)
    assert "\n" not in message and "does not match its SHA-256" in message
    assert f"draftwise models --pull {spec.name}" in message
    assert ("GGUF header is corrupt at offset 8: tensor count" in message) == (where == "header")
    integrity.forget()
    capsys.readouterr()
    code = main(["generate", "--target", spec.name, "--method", "ar", "--max-new-tokens", "2", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not match its SHA-256" in err
    if where == "header":
        assert "GGUF header is corrupt" in err


def test_models_verify_hashes_whatever_the_stamp_says(tiny_entry, capsys):
    from draftwise.cli import main

    spec, entry, _ = tiny_entry
    path = entry.gguf()
    assert main(["models", "--verify"]) == 0
    assert "SHA-256 ok" in capsys.readouterr().out
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the same size, and the stamp's times put back: only a full hash can see it
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert main(["models", "--verify"]) == 2
    out, err = capsys.readouterr()
    assert "damaged" in out and err.startswith("draftwise: error: 1 damaged:") and err.count("\n") == 1


def test_pull_assembles_a_damaged_file_again_and_says_why(tiny_entry, capsys):
    spec, entry, _ = tiny_entry
    path = entry.gguf()
    good = path.read_bytes()
    _flip(path, len(good) - 3)
    messages = []
    assert registry.pull(spec.name, log=messages.append) == path
    assert path.read_bytes() == good
    assert any("damaged (it does not match its SHA-256): assembling it from 2 installed packages" in m
               for m in messages)


def test_offline_nothing_is_downloaded_and_one_line_says_how_to_fetch(tiny_entry, monkeypatch):
    spec, entry, files = tiny_entry
    monkeypatch.setattr(chunks, "_installed_chunks", lambda s: None)  # the packages are not installed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError) as error:
        entry.gguf()
    message = str(error.value)
    assert "not assembled yet, and HF_HUB_OFFLINE=1 forbids downloading it" in message and "\n" not in message
    assert f"draftwise models --pull {spec.name}" in message
    assert not chunks.assembled_path(spec).exists()


def test_a_truncated_file_is_assembled_again_saying_why_and_not_offline(tiny_entry, monkeypatch):
    spec, entry, files = tiny_entry
    path = entry.gguf()
    path.write_bytes(path.read_bytes()[:100])
    monkeypatch.setattr(chunks, "_installed_chunks", lambda s: None)
    monkeypatch.setenv("DRAFTWISE_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError, match=rf"damaged \(tiny.gguf has 100 bytes, expected {spec.size}\), "
                                                     r"and DRAFTWISE_OFFLINE=1 forbids downloading"):
        entry.gguf()
    monkeypatch.delenv("DRAFTWISE_OFFLINE")
    monkeypatch.setattr(chunks, "_downloaded_chunks", lambda s, folder: iter(files))  # "PyPI"
    messages = []
    chunks.assemble(spec, log=messages.append)
    assert messages[0] == (f"draftwise: tiny.gguf is damaged (tiny.gguf has 100 bytes, expected {spec.size}): "
                           f"downloading 2 packages tiny-partN==0.1.0 from PyPI and assembling it (0.00 GiB)")
    integrity.forget()
    assert entry.gguf() == path and path.stat().st_size == spec.size


# ---------------------------------------------------------------------------------------- a user's GGUF file

def test_a_gguf_path_with_a_corrupt_header_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import tiny_llama, tiny_tokenizer
    import draftwise
    from draftwise.cli import main

    path = tmp_path / "m.gguf"
    write_gguf(path)
    converted = []

    def fake_convert(gguf, out, *, expected_sha256):
        converted.append(gguf)
        tiny_llama(0).save_pretrained(out)
        tiny_tokenizer().save_pretrained(out)

    monkeypatch.setattr(registry, "convert_gguf", fake_convert)
    capsys.readouterr()
    assert draftwise.load_model(str(path), dtype="dequantize").name == "m"  # negative control: it loads
    _flip(path, 23, 0x40)
    with pytest.raises(CorruptFileError, match="GGUF header is corrupt at offset 16: metadata count"):
        draftwise.load_model(str(path), dtype="dequantize")
    assert len(converted) == 1  # refused before conversion
    capsys.readouterr()
    code = main(["generate", "--target", str(path), "--dtype", "dequantize", "--method", "ar", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "GGUF header is corrupt at offset 16: metadata count" in err
    assert "not a valid JSON" not in err


# ------------------------------------------------------------------------------- superseded cache entries

def test_a_new_entry_removes_the_ones_it_supersedes(tmp_path):
    def build(out):
        (out / "config.json").write_text("{}")

    quiet = []
    old = cache.ensure_entry("m-meta-aaaaaaaaaaaa", build, source_sha256="a", supersedes="m-meta-",
                             source="/f/m.gguf", log=quiet.append)
    other = cache.ensure_entry("m-meta-bbbbbbbbbbbb", build, source_sha256="b", supersedes="m-meta-",
                               source="/elsewhere/m.gguf", log=quiet.append)  # another file named m
    legacy = cache.ensure_entry("m-meta-cccccccccccc", build, source_sha256="c", log=quiet.append)  # no source kept
    unrelated = cache.ensure_entry("m-meta-x-dddddddddddd", build, source_sha256="d", log=quiet.append)
    messages = []
    new = cache.ensure_entry("m-meta-eeeeeeeeeeee", build, source_sha256="e", supersedes="m-meta-",
                             source="/f/m.gguf", log=messages.append)
    assert new.is_dir() and other.is_dir() and unrelated.is_dir()
    assert not old.exists() and not legacy.exists()
    assert messages[-1].startswith("draftwise: removed 2 superseded cache entries of m-meta")
    assert sorted(p.name for p in new.parent.iterdir()) == sorted(
        ["m-meta-bbbbbbbbbbbb", "m-meta-eeeeeeeeeeee", "m-meta-x-dddddddddddd"])
