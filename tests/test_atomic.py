"""The one atomic writer: a failed write leaves the old file and no temporary file; a good one replaces it
with ordinary permissions."""

from __future__ import annotations

import os

import pytest

from draftwise.atomic import atomic_path, write_text
from draftwise.bench.report import write_json


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    write_json({"a": 1}, target)
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert target.read_text() == '{\n  "a": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_good_write_replaces_with_ordinary_permissions(tmp_path):
    target = tmp_path / "sub" / "notes.txt"
    write_text(target, "one")
    write_text(target, "two")
    assert target.read_text() == "two"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
